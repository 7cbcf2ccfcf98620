"""One GPU session: install what the GPU image lacks, then every step in order, each within its
own time budget, writing ``report.md``, ``results.json`` and ``session-files.tar.gz`` (every step's
JSON and log: the device returns at most 8 files of ``$OUT``) into ``--out`` after each step.

On the lent GPU machine (``prepare.py`` prints the call to make; no network there):
    python3 tools/gpu/session.py --carry .gpu-carry --commit <git describe here> --out "$OUT"
On your own GPU, with TransformerEngine installed (``pip install '.[gpu]'``; docs/gpu.md):
    python tools/gpu/session.py --out gpu-session
On a CPU, the same sequence at tiny shapes, to keep the kit from rotting (CI runs it,
``tests/gpu_kit/test_session.py``):
    python tools/gpu/session.py --rehearse --out /tmp/rehearsal

The steps, their budgets and their rows are in ``session_steps.py``; the report's form and the
meaning of each status in ``session_report.py``; the carry in ``carry_manifest.py``.  A step that
fails or runs out of time (its commands are killed, process group and all) costs only its own
rows; the session goes on with the next step.  The exit status is 0 when no row FAILED, timed
out or went missing, else 1.

Standard library only: the session runs before anything is installed.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import os
import platform
import signal
import subprocess
import sys
import tarfile
import time
from datetime import datetime, timezone
from pathlib import Path

from carry_manifest import WHEELS, CarryError, Manifest, verify
from session_report import ReportRow, SessionReport, StepResult
from session_steps import EXPORTS, GPU, REHEARSAL, ROOT, STEPS, Command, Mode, Step, checkout_commit, load_json

MIN_STEP_S = 10.0
"""A step is not started with less than this (or its whole budget, if smaller) left of the
session's budget."""
KILL_GRACE_S = 5.0
BUNDLE = "session-files.tar.gz"
"""The steps' folders and logs in one archive beside the report: the device returns at most 8
files of ``$OUT``, its top-level ones first (``bundle``)."""
LOG_TAIL_BYTES = 256 * 2**10
"""A step's log keeps its last 256 KiB (the device returns files up to a size)."""


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--out", default=os.environ.get("OUT", "gpu-session"), help="where the report goes (default $OUT)"
    )
    parser.add_argument("--carry", type=Path, help="a carry folder made by prepare.py, installed first")
    parser.add_argument("--site", type=Path, default=Path("/tmp/lime-gpu-site"), help="where the carry is installed")
    parser.add_argument("--rehearse", action="store_true", help="the same steps on a CPU at tiny shapes")
    parser.add_argument("--budget", type=float, help="the session's seconds (default: the mode's, 540 on a GPU)")
    parser.add_argument(
        "--commit", help="the checkout's commit, for the report (default: git's; the device copies no git)"
    )
    parser.add_argument(
        "--steps",
        nargs="+",
        choices=[step.name for step in STEPS],
        help="run only these steps (default: those a GPU session runs by default, every step in a rehearsal)",
    )
    return parser.parse_args(argv)


# --------------------------------------------------------------------------- install


def install(carry: Path, site: Path, folder: Path, env: dict[str, str]) -> dict[str, str]:
    """Install ``carry``'s wheels that this Python needs into ``site`` (pip, no index, no
    dependencies): the ``always`` ones, and the ``missing`` ones this Python lacks; record what
    was installed in ``folder/install.json``.  Returns ``env`` with ``site`` on the Python path and
    the image's NVIDIA libraries on the loader's.  CarryError when the carry cannot be used."""
    manifest = Manifest.read(carry)
    verify(carry, manifest)
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    if python != manifest.python:
        raise CarryError(f"the carry is for Python {manifest.python}, this is {python}")
    wanted = [wheel for wheel in manifest.wheels if wheel.install == "always" or not _installed(wheel.distribution)]
    started = time.monotonic()
    if wanted:
        command = [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--no-compile", "--quiet"]
        command += ["--disable-pip-version-check", "--target", str(site), "--upgrade"]
        command += [str(carry / WHEELS / wheel.wheel) for wheel in wanted]
        completed = subprocess.run(command, capture_output=True, text=True)
        if completed.returncode:
            raise CarryError(f"pip could not install the carry: {completed.stderr.strip()[-400:]}")
    seconds = time.monotonic() - started
    names = ", ".join(f"{wheel.distribution} {wheel.version}" for wheel in wanted) or "nothing"
    summary = f"{len(wanted)} of {len(manifest.wheels)} wheels in {seconds:.0f} s"
    _write_json(folder / "install.json", dict(summary=summary, note=f"{names}; carry of {manifest.commit}"))
    return carried_environment(env, site)


def _installed(distribution: str) -> bool:
    try:
        importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def carried_environment(env: dict[str, str], site: Path) -> dict[str, str]:
    """``env`` with ``site`` first on the Python path and TE's framework set to PyTorch; the
    loader's path as the image has it.  TransformerEngine finds torch's NVIDIA libraries itself;
    putting the wheels' ``nvidia/*/lib`` first on ``LD_LIBRARY_PATH`` (as this kit did until the
    second H200 session) made cuDNN load its sublibraries from two copies, the wheel's and the
    image's own in ``/usr/lib``, and refuse them (``CUDNN_STATUS_SUBLIBRARY_LOADING_FAILED``): TE
    then ran its unfused attention for every model (``attention_probe.py``)."""
    return dict(
        env,
        PYTHONPATH=os.pathsep.join([str(site), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        NVTE_FRAMEWORK="pytorch",
    )


# --------------------------------------------------------------------------- steps


def run_command(argv: list[str], env: dict[str, str], log: Path, timeout: float) -> int | None:
    """Run ``argv`` in the checkout, its output appended to ``log``; its exit status, or None when
    it ran past ``timeout`` seconds (then its whole process group is terminated, then killed)."""
    with log.open("a") as output:
        output.write(f"\n$ {' '.join(argv)}\n")
        output.flush()
        process = subprocess.Popen(
            argv, cwd=ROOT, env=env, stdout=output, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            return process.wait(timeout=max(timeout, 0.0))
        except subprocess.TimeoutExpired:
            _stop_group(process)
            output.write(f"\n[session: stopped after {timeout:.0f} s]\n")
            return None


def _stop_group(process: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=KILL_GRACE_S)
            return
        except subprocess.TimeoutExpired:
            continue


def run_step(step: Step, mode: Mode, folder: Path, env: dict[str, str], budget: float, log: Path) -> StepResult:
    """Run ``step``'s commands one after another within ``budget`` seconds in all; its rows."""
    result = StepResult(step.name, step.title, budget_s=budget)
    started = time.monotonic()
    problems = run_commands(step.commands(mode, folder), env, log, budget, result)
    result.seconds = time.monotonic() - started
    _trim(log)
    found = read_rows(step, mode, folder, problems)
    timed_out = result.status == "timeout"
    if problems and not timed_out:
        result.reason = f"{'; '.join(problems)} (logs/{log.name})."
    result.rows = declared_rows(step, found, "timeout" if timed_out else "missing", result.reason)
    if not timed_out:
        bad = problems or any(row.status in ("FAILED", "missing") for row in result.rows)
        result.status = "failed" if bad else "ok"
    return result


def run_commands(
    commands: list[Command], env: dict[str, str], log: Path, budget: float, result: StepResult
) -> list[str]:
    """Run ``commands`` in order within ``budget`` seconds, each shown in ``result.commands``; a
    command past the budget is stopped and marks ``result`` ``timeout``.  The failures, named."""
    started, failures = time.monotonic(), []
    for command in commands:
        result.commands.append(" ".join(_shown(argument) for argument in command.argv))
        remaining = budget - (time.monotonic() - started)
        status = run_command(command.argv, env, log, remaining) if remaining > 0 else None
        if status is None:
            result.status, result.reason = "timeout", f"stopped at its {budget:.0f} s budget (logs/{log.name})."
            break
        if status:
            failures.append(f"`{Path(command.argv[1]).name}` exited {status}")
    return failures


def read_rows(step: Step, mode: Mode, folder: Path, problems: list[str]) -> list[ReportRow]:
    """The rows ``step`` finds in ``folder``; none (and a problem added) when its output is malformed."""
    try:
        return step.read(mode, folder)
    except (ValueError, KeyError, TypeError) as error:
        problems.append(f"its output could not be read ({type(error).__name__}: {error})")
        return []


def _shown(argument: str) -> str:
    """An argument as a shell would need it (empty ones quoted), paths inside the checkout relative."""
    if argument == "":
        return '""'
    if argument == sys.executable:
        return "python"
    return argument.replace(str(ROOT) + os.sep, "")


def declared_rows(step: Step, found: list[ReportRow], absent: str, reason: str) -> list[ReportRow]:
    """``step.rows`` in their order, each as found or, when absent, with the status ``absent``
    (``timeout`` or ``missing``) and ``reason``; then the found rows it did not declare (a
    failing gradient, an error)."""
    by_name = {row.name: row for row in found}
    rows = [by_name.get(name) or ReportRow(name, status=absent, note=reason) for name in step.rows]
    return rows + [row for row in found if row.name not in step.rows]


def skipped_step(step: Step, reason: str) -> StepResult:
    rows = [ReportRow(name, status="skipped", note=reason) for name in step.rows]
    return StepResult(step.name, step.title, "skipped", reason=reason, rows=rows)


def _trim(log: Path) -> None:
    if log.is_file() and log.stat().st_size > LOG_TAIL_BYTES:
        with log.open("rb") as file:
            file.seek(-LOG_TAIL_BYTES, os.SEEK_END)
            tail = file.read()
        log.write_bytes(b"[session: earlier output cut]\n" + tail)


# --------------------------------------------------------------------------- the session


def run_session(
    mode: Mode, out: Path, steps: list[Step], carry: Path | None, site: Path, commit: str | None = None
) -> SessionReport:
    """Every step of ``steps`` in order within ``mode.budget_s``; the report, written after each."""
    (out / "logs").mkdir(parents=True, exist_ok=True)
    report = SessionReport(session_header(mode, carry, commit))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    deadline = time.monotonic() + mode.budget_s
    stop_reason = ""
    for step in steps:
        folder = out / "steps" / step.name
        folder.mkdir(parents=True, exist_ok=True)
        budget = min(step.budget(mode), deadline - time.monotonic())
        if stop_reason or budget < min(MIN_STEP_S, step.budget(mode)):
            result = skipped_step(step, stop_reason or "the session's time was spent")
        else:
            started = time.monotonic()
            try:
                if step.name == "environment" and carry is not None:
                    env = install(carry, site, folder, env)
                spent = time.monotonic() - started
                result = run_step(step, mode, folder, env, budget - spent, out / "logs" / f"{step.name}.log")
                result.seconds += spent
                env = exported_environment(env, folder)
                if step.name == "environment":
                    report.header.update(device_header(out))
            except CarryError as error:
                stop_reason = f"the carry could not be installed: {error}"
                result = skipped_step(step, stop_reason)
                result.status = "failed"
        report.steps.append(result)
        report.write(out)
        bundle(out)
        print(f"session: {step.name}: {result.status} ({result.seconds:.0f} s)", flush=True)
    return report


def bundle(out: Path) -> None:
    """``out``'s ``logs`` and ``steps`` folders as ``out/BUNDLE``, replaced whole: the benches' JSON
    (absolute times, host and idle ms, the profiles) comes back with the report, where the
    device's file limit dropped it before (8765886: 8 of 19 files came back, no step JSON)."""
    part = out / f"{BUNDLE}.part"
    with tarfile.open(part, "w:gz") as archive:
        for name in ("logs", "steps"):
            if (out / name).is_dir():
                archive.add(out / name, arcname=name)
    part.replace(out / BUNDLE)


def exported_environment(env: dict[str, str], folder: Path) -> dict[str, str]:
    """``env`` with the variables a step exported for the steps after it (its ``EXPORTS`` file,
    e.g. the library environment under which TransformerEngine finds its fused attention)."""
    return dict(env, **load_json(folder / EXPORTS))


def session_header(mode: Mode, carry: Path | None, commit: str | None = None) -> dict[str, str]:
    """Where and when the session ran: mode, budget, the checkout's commit (``commit`` as the
    caller gives it: the device copies the working tree without git), the carry's, start time."""
    header = {
        "mode": mode.name + (" (CPU, tiny shapes, local spec)" if mode.rehearsal else ""),
        "started": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "budget": f"{mode.budget_s:.0f} s",
        "commit": commit or checkout_commit(),
        "host": f"{platform.node()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
    }
    try:
        return header | ({"carry made at": Manifest.read(carry).commit} if carry is not None else {})
    except CarryError:
        return header


def device_header(out: Path) -> dict[str, str]:
    """The device and versions the environment step found (none before it ran)."""
    found = load_json(out / "steps" / "environment" / "environment.json")
    names = ("device", "torch", "megatron-core", "TransformerEngine")
    return {name: found[name] for name in names if name in found}


def _write_json(path: Path, document: dict) -> None:
    path.write_text(json.dumps(document, indent=1))


def chosen_steps(names: list[str] | None, rehearse: bool) -> list[Step]:
    """The steps of ``names`` in the session's order; without names, those a GPU session runs by
    default (``Step.by_default``: their budgets fill one device call), or every step in a rehearsal
    (CI's, so that none rots)."""
    if names:
        return [step for step in STEPS if step.name in names]
    return [step for step in STEPS if rehearse or step.by_default]


def main(argv=None) -> int:
    args = parse_args(argv)
    mode = REHEARSAL if args.rehearse else GPU
    if args.budget:
        mode = dataclasses.replace(mode, budget_s=args.budget)
    steps = chosen_steps(args.steps, args.rehearse)
    out = Path(args.out)
    report = run_session(mode, out, steps, args.carry, args.site, args.commit)
    print(report.markdown(), flush=True)  # also on stdout: the device returns its tail even without files
    problems = report.problems
    print(
        f"session: report in {out / 'report.md'}; " + (f"{len(problems)} problem rows" if problems else "no problems")
    )
    for problem in problems[:20]:
        print(f"  {problem}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
