#!/usr/bin/env python
"""Start-up time of the commands: seconds until ``--help`` prints or a wrong path is reported.

    python bench/bench_startup.py [--runs 5] [--cases pretrain-help pretrain-data-path ...]
                                  [--roots . /path/to/other/checkout] [--importtime pretrain-help]
                                  [--top 8] [--markdown]

Each case runs a command of a checkout (``pretrain_lime.py``, ``tools/<name>.py``,
``python -m lime_megatron``) in a fresh Python process, with that checkout first on the import
path, and times it from start to exit (interpreter start and imports included: what a user
waits for); the median of ``--runs`` runs per case, the exit status and the last line of its
stderr that names an error are printed. Cases with a wrong path or flag must exit
non-zero and name the problem: a case that does not is marked ``unexpected``.

``--roots`` times the same cases in several checkouts (this one by default; e.g. a clone of the
commit before a change), their runs interleaved so that a change in the machine's load reaches
all of them alike: one median column per checkout.

``--importtime CASE`` runs that case once more (in the first checkout) under
``python -X importtime`` and prints the top-level packages that took the longest to import (self
time summed per package). The figures depend on the machine and on its load: compare cases run
together.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from tables import field, print_table

ROOT = Path(__file__).resolve().parents[1]
MISSING = "no-such-dir/no-such-file"
"""A path that does not exist (relative to the checkout)."""
TINY_RUN = [
    *("--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32"),
    *("--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-3"),
    *("--tokenizer-type", "NullTokenizer", "--vocab-size", "128"),
]
"""A valid trainer command line but for its data source."""

CASES = {
    "pretrain-help": (["pretrain_lime.py", "--help"], None),
    "pretrain-data-path": (["pretrain_lime.py", *TINY_RUN, "--data-path", MISSING], MISSING),
    "pretrain-config": (["pretrain_lime.py", "--config", MISSING + ".yaml"], MISSING),
    "pretrain-unknown-flag": (["pretrain_lime.py", *TINY_RUN, "--mock-data", "--num-layer", "2"], "--num-layer"),
    "main-job-help": (["-m", "lime_megatron", "--help"], None),
    "preprocess-help": (["tools/preprocess_data.py", "--help"], None),
    "preprocess-input": (["tools/preprocess_data.py", "--input", MISSING, "--output-prefix", "OUT"], MISSING),
    "convert-help": (["tools/convert_checkpoint.py", "--help"], None),
    "convert-input": (["tools/convert_checkpoint.py", "export", MISSING, "OUT"], MISSING),
    "generate-help": (["tools/generate.py", "--help"], None),
    "generate-input": (["tools/generate.py", MISSING, "--prompt", "1 + 1 ="], MISSING),
    "score-help": (["tools/score_generation.py", "--help"], None),
    "score-input": (["tools/score_generation.py", MISSING, "--test-file", MISSING], MISSING),
}
"""Case name -> (the arguments of ``python``, a text its stderr must hold: None for ``--help``,
which must exit 0)."""
DEFAULT_CASES = ["pretrain-help", "pretrain-data-path", "pretrain-config", "pretrain-unknown-flag", "main-job-help"]
DEFAULT_CASES += ["preprocess-help", "preprocess-input", "convert-help", "convert-input"]
DEFAULT_CASES += ["generate-help", "generate-input", "score-help", "score-input"]


def environment(root: Path) -> dict[str, str]:
    """The commands' environment: checkout ``root`` first on the import path."""
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": str(root) + (os.pathsep + path if path else "")}


def run_once(root: Path, arguments: list[str], workdir: str, python_flags: tuple[str, ...] = ()):
    """(seconds, exit status, stderr) of one run of ``python *python_flags *arguments`` in ``root``."""
    command = [sys.executable, *python_flags, *[str(root / a) if a.endswith(".py") else a for a in arguments]]
    start = time.perf_counter()
    done = subprocess.run(command, cwd=workdir, env=environment(root), capture_output=True, text=True)
    return time.perf_counter() - start, done.returncode, done.stderr


def measure(names: list[str], roots: list[Path], runs: int, workdir: str) -> list[dict]:
    """One row per case of ``names``: per checkout of ``roots`` (``s0``, ``s1``, ...) the median
    seconds of ``runs`` runs, interleaved; the exit statuses and the check of them all, the error
    line of the first checkout."""
    seconds: dict[tuple[str, int], list[float]] = {(name, i): [] for name in names for i in range(len(roots))}
    statuses: dict[str, set[int]] = {name: set() for name in names}
    errors: dict[tuple[str, int], set[str]] = {key: set() for key in seconds}
    for _ in range(runs):
        for name in names:
            for i, root in enumerate(roots):
                elapsed, status, stderr = run_once(root, CASES[name][0], workdir)
                seconds[name, i].append(elapsed)
                statuses[name].add(status)
                errors[name, i].add(error_line(stderr))
    rows = []
    for name in names:
        expected = CASES[name][1]
        messages = set().union(*(errors[name, i] for i in range(len(roots))))
        ok = statuses[name] == {0} if expected is None else 0 not in statuses[name]
        ok = ok and all(expected in message for message in messages) if expected else ok
        row = dict(case=name, status=",".join(map(str, sorted(statuses[name]))), check="ok" if ok else "unexpected")
        row.update({f"s{i}": statistics.median(seconds[name, i]) for i in range(len(roots))})
        row["error"] = " | ".join(sorted(errors[name, 0]))[:110]
        rows.append(row)
    return rows


def error_line(stderr: str) -> str:
    """The line of ``stderr`` that says what went wrong (its last ``error`` line, else its last line)."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower()]
    return (errors or lines or [""])[-1]


IMPORT_LINE = re.compile(r"import time:\s+(\d+) \|\s+(\d+) \|( *)(\S+)")


def import_offenders(root: Path, name: str, workdir: str, top: int) -> list[dict]:
    """The ``top`` top-level packages by import time (self time summed) of one run of case ``name``."""
    _, _, stderr = run_once(root, CASES[name][0], workdir, ("-X", "importtime"))
    per_package: Counter[str] = Counter()
    modules: Counter[str] = Counter()
    for line in stderr.splitlines():
        match = IMPORT_LINE.match(line)
        if match:
            package = match.group(4).split(".")[0]
            per_package[package] += int(match.group(1))
            modules[package] += 1
    return [
        dict(package=package, self_s=micros / 1e6, modules=modules[package])
        for package, micros in per_package.most_common(top)
    ]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=5, help="runs per case (each a fresh process)")
    parser.add_argument("--cases", nargs="+", choices=CASES, default=DEFAULT_CASES, help="the cases to time")
    parser.add_argument(
        "--roots", nargs="+", type=Path, default=[ROOT], help="checkouts whose commands are timed (default: this one)"
    )
    parser.add_argument("--importtime", choices=CASES, help="also list this case's slowest imports")
    parser.add_argument("--top", type=int, default=8, help="packages listed by --importtime")
    parser.add_argument("--markdown", action="store_true", help="print Markdown tables")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    load = " ".join(f"{value:.2f}" for value in os.getloadavg())
    print(f"{os.cpu_count()} CPUs, load average {load}; median of {args.runs} runs per case\n")
    roots = [root.resolve() for root in args.roots]
    for i, root in enumerate(roots):
        print(f"s{i}: seconds in {root}")
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as workdir:
        rows = measure(args.cases, roots, args.runs, workdir)
        columns = [("case", field("case"))]
        columns += [(f"s{i}", field(f"s{i}", ".2f")) for i in range(len(roots))]
        columns += [("exit", field("status")), ("check", field("check")), ("stderr", field("error"))]
        print()
        print_table(columns, rows, args.markdown)
        if args.importtime:
            print(f"\nslowest imports of {args.importtime} in {roots[0]} (self time per top-level package):\n")
            offenders = import_offenders(roots[0], args.importtime, workdir, args.top)
            columns = [("package", field("package")), ("s", field("self_s", ".2f")), ("modules", field("modules"))]
            print_table(columns, offenders, args.markdown)
    print(f"\nload average after: {' '.join(f'{value:.2f}' for value in os.getloadavg())}")
    return 0 if all(row["check"] == "ok" for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
