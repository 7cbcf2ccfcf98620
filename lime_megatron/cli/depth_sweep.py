"""Depth-scaling sweep (paper §5.5, Fig. 6): LIMe and LLaMA at several depths, one command.

    python tools/depth_sweep.py tools/depth_sweep_cpu.yaml          # the CPU-sized default
    NNODES=4 NODE_RANK=$RANK MASTER_ADDR=node0 MASTER_PORT=29500 \\
        python tools/depth_sweep.py examples/depth_sweep_paper.yaml  # on every node

The YAML lists ``families`` (name -> trainer options, e.g. ``{lime: true, lime_router: full}`` or
``{lime: false}``), ``depths`` (each with ``num_layers``, ``nproc`` = processes per node and its
layout options: ``pipeline_model_parallel_size``, ``num_virtual_stages_per_pipeline_rank``,
``tensor_model_parallel_size``, ...), ``tokens`` (the token budget of every run: train iterations =
tokens / (global batch x sequence length)), ``common`` trainer options, an optional base
``config`` (a ``pretrain_lime.py --config`` YAML) and ``data``: ``{arithmetic: {num_samples: N}}``
(the paper's arithmetic task, made once with the project's tools, as ``python -m lime_megatron``
does) or trainer data options (``data_path``, ``tokenizer_type``, ...).  Keys are trainer flags with
underscores; relative paths are taken from the current directory, where the runs are launched.

Each run (``<family>-L<depth>``) is launched through ``torch.distributed.run`` and
``lime_megatron.cli.pretrain`` with ``--save``/``--load`` on its own checkpoint directory and a metrics file
under ``output_dir/runs/<name>/``.  Nodes: ``--nnodes``/``--node-rank``/``--master-addr``/
``--master-port`` come from ``NNODES``, ``NODE_RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` (one node,
``--standalone``, when ``NNODES`` is unset or 1); every node runs the same command on a shared file
system.  A run with ``done.json`` is skipped; an interrupted one is relaunched and the trainer
resumes from its last checkpoint exactly.  The results go to ``output_dir``: ``results.md`` and
``results.json`` (final and best validation loss, tokens, training FLOPs with the router's from
``lime_megatron.planning.flops.training_flops_per_iteration``, wall time, tokens/s), ``loss_vs_tokens.png``
and ``loss_vs_flops.png`` (per depth, Fig. 6) and ``validation_vs_depth.png`` (per family).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from lime_megatron.cli.main_job import data_steps, tool_command, trainer_data_flags
from lime_megatron.extras import requires_extra
from lime_megatron.training.arguments import CommandParser

LAYOUT_KEYS = ("nproc",)
"""Depth entry keys that are not trainer options."""


class SweepError(ValueError):
    """A sweep description that cannot be run."""


@dataclass
class Run:
    """One training run of the sweep."""

    family: str
    depth: int
    nproc: int
    options: dict
    """Trainer options (flag names with underscores), train iterations and paths included."""
    directory: Path

    @property
    def name(self) -> str:
        return f"{self.family}-L{self.depth}"

    @property
    def metrics_file(self) -> Path:
        return self.directory / "metrics.jsonl"

    @property
    def done_file(self) -> Path:
        return self.directory / "done.json"


@dataclass
class Sweep:
    """A parsed sweep description."""

    output_dir: Path
    runs: list[Run] = field(default_factory=list)
    config: str | None = None
    data: dict = field(default_factory=dict)


# --------------------------------------------------------------------------- the plan


def load_sweep(path: str, output_dir: str | None = None) -> Sweep:
    """The runs of the sweep YAML ``path`` (``output_dir`` overrides the file's)."""
    with open(path, encoding="utf-8") as file:
        spec = yaml.safe_load(file)
    for key in ("families", "depths", "tokens"):
        if key not in spec:
            raise SweepError(f"{path}: missing '{key}' (see lime_megatron/cli/depth_sweep.py)")
    out = Path(output_dir or spec.get("output_dir") or "depth_sweep").resolve()
    sweep = Sweep(out, config=spec.get("config"), data=spec.get("data") or {})
    common = dict(spec.get("common") or {})
    for entry in spec["depths"]:  # depth by depth, so a partial sweep compares families
        for family, family_options in spec["families"].items():
            depth = dict(entry)
            if "num_layers" not in depth:
                raise SweepError(f"{path}: a depth entry has no num_layers: {depth}")
            nproc = int(depth.pop("nproc", 1))
            options = {**common, **(family_options or {}), **depth}
            options["train_iters"] = train_iterations(spec["tokens"], options)
            directory = out / "runs" / f"{family}-L{depth['num_layers']}"
            options.update(
                save=str(directory / "checkpoints"),
                load=str(directory / "checkpoints"),
                metrics_file=str(directory / "metrics.jsonl"),
            )
            sweep.runs.append(Run(family, int(depth["num_layers"]), nproc, options, directory))
    return sweep


def train_iterations(tokens: int, options: dict) -> int:
    """Iterations that spend the token budget: tokens / (global batch x sequence length)."""
    for key in ("global_batch_size", "seq_length"):
        if key not in options:
            raise SweepError(f"the sweep needs '{key}' in common, a family or a depth entry")
    per_iteration = int(options["global_batch_size"]) * int(options["seq_length"])
    if tokens < per_iteration:
        raise SweepError(f"token budget {tokens} is less than one iteration ({per_iteration} tokens)")
    return int(tokens) // per_iteration


def node_flags(env: dict) -> list[str]:
    """torchrun's node options from ``NNODES``, ``NODE_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``
    (``--standalone`` for one node)."""
    nnodes = int(env.get("NNODES", 1))
    if nnodes == 1:
        return ["--standalone"]
    missing = [name for name in ("NODE_RANK", "MASTER_ADDR") if name not in env]
    if missing:
        raise SweepError(f"NNODES={nnodes} needs {' and '.join(missing)} in the environment")
    return [
        "--nnodes",
        str(nnodes),
        "--node-rank",
        env["NODE_RANK"],
        "--master-addr",
        env["MASTER_ADDR"],
        "--master-port",
        env.get("MASTER_PORT", "29500"),
    ]


def run_config(sweep: Sweep, run: Run) -> Path:
    """Write ``run``'s trainer options (the base config, the sweep's data options unless it uses
    the arithmetic task, then the run's own) as a ``pretrain_lime.py --config`` YAML; its path."""
    options: dict[str, Any] = {}  # option name -> YAML value
    if sweep.config:
        with open(sweep.config, encoding="utf-8") as file:
            options.update(yaml.safe_load(file) or {})
    if "arithmetic" not in sweep.data:
        options.update(sweep.data)
    options.update(run.options)
    run.directory.mkdir(parents=True, exist_ok=True)
    path = run.directory / "config.yaml"
    path.write_text(yaml.safe_dump(options, sort_keys=False))
    return path


def trainer_argv(sweep: Sweep, run: Run, data: list[str]) -> list[str]:
    """``pretrain_lime.py`` arguments of ``run``: its config file and the arithmetic data flags."""
    return ["--config", str(run_config(sweep, run)), *data]


def launch_command(sweep: Sweep, run: Run, data: list[str], env: dict) -> list[str]:
    """The torchrun command of ``run``."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *node_flags(env),
        "--nproc-per-node",
        str(run.nproc),
        "-m",
        "lime_megatron.cli.pretrain",
        *trainer_argv(sweep, run, data),
    ]


# --------------------------------------------------------------------------- data


def data_flags(sweep: Sweep) -> list[str]:
    """Trainer data flags of the arithmetic task (made under ``output_dir/data`` once); none when
    the sweep gives its own data options (they go into each run's config)."""
    if "arithmetic" not in sweep.data:
        return []
    out = sweep.output_dir / "data"
    out.mkdir(parents=True, exist_ok=True)
    spec = sweep.data["arithmetic"] or {}
    num_samples, test_samples = int(spec.get("num_samples", 20000)), int(spec.get("test_samples", 400))
    if not (out / "arith_response_document.idx").exists():
        for name, tool, tool_args in data_steps(out, num_samples, test_samples):
            print(f"=== {name}", flush=True)
            subprocess.run(tool_command(tool, *tool_args), check=True)
    return trainer_data_flags(out)


# --------------------------------------------------------------------------- running


def execute(sweep: Sweep, run: Run, flags: list[str], env: dict, launch=subprocess.run) -> str:
    """Train ``run`` unless it is done; ``finished``, ``resumed`` or ``skipped``.  Wall time
    accumulates over attempts in ``done.json``/``attempts.json``."""
    if run.done_file.exists():
        return "skipped"
    run.directory.mkdir(parents=True, exist_ok=True)
    attempts_file = run.directory / "attempts.json"
    attempts = json.loads(attempts_file.read_text()) if attempts_file.exists() else []
    command = launch_command(sweep, run, flags, env)
    print(f"\n=== {run.name} ({'resuming' if attempts else 'new'})\n$ {' '.join(command)}", flush=True)
    start = time.perf_counter()
    completed = launch(command)
    attempts.append({"seconds": time.perf_counter() - start, "returncode": completed.returncode})
    attempts_file.write_text(json.dumps(attempts))
    if completed.returncode:
        raise SystemExit(f"{run.name} failed (exit status {completed.returncode}); rerun the sweep to resume it")
    trained = read_metrics(run.metrics_file)[-1]["iteration"] if run.metrics_file.exists() else 0
    if trained < run.options["train_iters"]:
        raise SystemExit(
            f"{run.name} stopped at iteration {trained} of {run.options['train_iters']} (signal?); "
            "rerun the sweep to resume it"
        )
    if int(env.get("NODE_RANK", 0)) == 0:
        run.done_file.write_text(
            json.dumps({"wall_seconds": sum(a["seconds"] for a in attempts), "attempts": len(attempts)})
        )
    return "resumed" if len(attempts) > 1 else "finished"


# --------------------------------------------------------------------------- results


def read_metrics(path: Path) -> list[dict]:
    """Per-iteration records of a metrics file; a resumed run's repeated iterations keep their
    last record."""
    records = {}
    for line in path.read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            records[record["iteration"]] = record
    return [records[i] for i in sorted(records)]


def flops_per_iteration(sweep: Sweep, run: Run, flags: list[str], world_size: int) -> float:
    """Training FLOPs of one iteration of ``run`` (router included): the trainer's own options,
    config and ``flops.training_flops_per_iteration``."""
    from lime_megatron.planning import flops
    from lime_megatron.training import arguments, data

    options = arguments.parse_run(trainer_argv(sweep, run, flags), world_size=world_size)
    vocab = data.tokenizer_of(options.data, options.model.vocab_size).vocab_size
    return flops.training_flops_per_iteration(
        arguments.transformer_config(options), options.model.seq_length, vocab, options.training.global_batch_size
    )


def summarize(sweep: Sweep, flags: list[str], nnodes: int = 1) -> list[dict]:
    """One row per finished run."""
    rows = []
    for run in sweep.runs:
        if not run.done_file.exists():
            continue
        records = read_metrics(run.metrics_file)
        done = json.loads(run.done_file.read_text())
        validation = [r["validation_loss"] for r in records if "validation_loss" in r]
        per_iteration = int(run.options["global_batch_size"]) * int(run.options["seq_length"])
        flops = flops_per_iteration(sweep, run, flags, run.nproc * nnodes)
        rows.append(
            dict(
                family=run.family,
                depth=run.depth,
                nproc=run.nproc,
                final_validation_loss=validation[-1] if validation else None,
                best_validation_loss=min(validation) if validation else None,
                final_train_loss=records[-1]["lm_loss"],
                iterations=records[-1]["iteration"],
                tokens=records[-1]["iteration"] * per_iteration,
                training_flops=flops * records[-1]["iteration"],
                wall_seconds=done["wall_seconds"],
                tokens_per_sec=float(np.median([r["tokens_per_sec"] for r in records[1:] or records])),
                curve=[
                    (r["iteration"] * per_iteration, r["iteration"] * flops, r["lm_loss"], r.get("validation_loss"))
                    for r in records
                ],
            )
        )
    return rows


def markdown_table(rows: list[dict]) -> str:
    """The results as a markdown table."""
    header = (
        "| family | layers | processes | final val loss | best val loss | final train loss | tokens | "
        "training FLOPs | wall time (s) | tokens/s |"
    )
    lines = [header, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        val = f"{row['final_validation_loss']:.4f}" if row["final_validation_loss"] is not None else "-"
        best = f"{row['best_validation_loss']:.4f}" if row["best_validation_loss"] is not None else "-"
        lines.append(
            f"| {row['family']} | {row['depth']} | {row['nproc']} | {val} | {best} | "
            f"{row['final_train_loss']:.4f} | {row['tokens']:,} | {row['training_flops']:.3g} | "
            f"{row['wall_seconds']:.0f} | {row['tokens_per_sec']:,.0f} |"
        )
    return "\n".join(lines)


def write_results(rows: list[dict], out: Path) -> list[Path]:
    """``results.md``, ``results.json`` and the three plots; their paths."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.md").write_text(markdown_table(rows) + "\n")
    (out / "results.json").write_text(json.dumps(rows, indent=1))
    return [out / "results.md", out / "results.json", *plot(rows, out)]


def plot(rows: list[dict], out: Path) -> list[Path]:
    """Loss against tokens and against FLOPs per depth (Fig. 6); validation loss against depth."""
    with requires_extra("plots"):
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

    depths = sorted({row["depth"] for row in rows})
    families = list(dict.fromkeys(row["family"] for row in rows))
    paths = []
    for axis_index, (key, label) in enumerate([("tokens", "tokens"), ("flops", "training FLOPs")]):
        figure, axes = plt.subplots(1, len(depths), figsize=(4.5 * len(depths), 3.8), squeeze=False, sharey=True)
        for axis, depth in zip(axes[0], depths):
            for row in (r for r in rows if r["depth"] == depth):
                curve = np.array([(c[axis_index], c[2]) for c in row["curve"]])
                (line,) = axis.plot(curve[:, 0], curve[:, 1], label=f"{row['family']} train", alpha=0.8)
                val = [(c[axis_index], c[3]) for c in row["curve"] if c[3] is not None]
                if val:
                    axis.plot(*zip(*val), "o--", color=line.get_color(), label=f"{row['family']} validation")
            axis.set(title=f"{depth} layers", xlabel=label)
            axis.legend(fontsize=8)
        axes[0][0].set_ylabel("loss (nats/token)")
        figure.tight_layout()
        paths.append(out / f"loss_vs_{key}.png")
        figure.savefig(paths[-1], dpi=110)
        plt.close(figure)
    figure, axis = plt.subplots(figsize=(5.5, 4))
    for family in families:
        points = sorted(
            (r["depth"], r["final_validation_loss"])
            for r in rows
            if r["family"] == family and r["final_validation_loss"] is not None
        )
        if points:
            axis.plot(*zip(*points), "o-", label=family)
    axis.set(xscale="log", xlabel="layers", ylabel="final validation loss", title="validation loss against depth")
    axis.set_xticks(depths, [str(d) for d in depths])
    axis.legend()
    figure.tight_layout()
    paths.append(out / "validation_vs_depth.png")
    figure.savefig(paths[-1], dpi=110)
    plt.close(figure)
    return paths


# --------------------------------------------------------------------------- main


def parse_args(argv=None) -> argparse.Namespace:
    parser = CommandParser(description=__doc__.split("\n")[1])
    parser.add_argument("sweep", help="sweep YAML (tools/depth_sweep_cpu.yaml, examples/depth_sweep_paper.yaml)")
    parser.add_argument("--output-dir", help="overrides the YAML's output_dir")
    parser.add_argument("--only", help="comma-separated run names to run (others: results only)")
    parser.add_argument("--report-only", action="store_true", help="write the table and plots of finished runs")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    env = dict(os.environ)
    sweep = load_sweep(args.sweep, args.output_dir)
    flags = data_flags(sweep)
    start = time.perf_counter()
    if not args.report_only:
        chosen = set(args.only.split(",")) if args.only else None
        outcomes = {
            run.name: execute(sweep, run, flags, env) for run in sweep.runs if chosen is None or run.name in chosen
        }
        print("\nruns: " + ", ".join(f"{name} {outcome}" for name, outcome in outcomes.items()))
    if int(env.get("NODE_RANK", 0)) != 0:
        return 0
    rows = summarize(sweep, flags, int(env.get("NNODES", 1)))
    paths = write_results(rows, sweep.output_dir)
    print("\n" + markdown_table(rows))
    print(
        f"\nsweep: {len(rows)} of {len(sweep.runs)} runs finished, {time.perf_counter() - start:.0f} s this "
        f"invocation; written: {', '.join(str(p) for p in paths)}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
