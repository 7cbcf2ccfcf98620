"""Which attention backend TransformerEngine selects on this machine, and under which library
environment it selects its fused one: ``python tools/gpu/attention_probe.py --json PATH
--exports PATH``.

The first two H200 sessions found TransformerEngine running its unfused attention for every
model: cuDNN refused its sublibraries (``CUDNN_STATUS_SUBLIBRARY_LOADING_FAILED``) because the
session had put torch's NVIDIA wheels' ``nvidia/*/lib`` first on ``LD_LIBRARY_PATH`` while the
image has its own cuDNN in ``/usr/lib``: one process mapped both copies.  The second session's
probe found it, and the session no longer touches the loader's path
(``session.carried_environment``).  This probe stays as the first thing a session measures: it
runs one bf16 GQA causal attention, forward and backward, in a fresh process per candidate
environment (``CANDIDATES``: as the session runs it; without any wheel's lib folder on the
loader's path; with TE pointed at the cuDNN torch loaded; with that cuDNN's libraries
preloaded; a candidate that changes nothing is not run), each with cuDNN's error log on, and
records per candidate the backend TE selected, TE's reasons, cuDNN's errors and the cuDNN, NVRTC
and cuBLAS files the process mapped.  The first candidate under which TE selects FusedAttention,
when the session's own environment does not, is written to ``--exports``: the session runs its
later steps with those variables (``session.exported_environment``).

On a machine without CUDA or without TransformerEngine (the CPU rehearsal) it records why and
tries nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

EXPECTED = "FusedAttention"
"""What TE 2.20 selects for bf16 GQA causal attention on Hopper without flash-attn installed."""
LIBRARY_NAMES = ("libcudnn", "libnvrtc", "libcublas")
CUDNN_ERROR_LINES = 12
"""How many of cuDNN's error-log lines (``CUDNN_LOGERR_DBG``) a candidate keeps."""
TRY_TIMEOUT_S = 25.0
"""A candidate's process imports torch, TE and the package and runs one attention (the package alone
imports in 3.4 s on the 2-core CI machine)."""


@dataclass(frozen=True)
class Candidate:
    """A library environment to try: its name and how it changes the session's environment."""

    name: str
    drop_wheel_libraries: bool
    """Without the wheels' ``nvidia/*/lib`` folders on ``LD_LIBRARY_PATH`` (a user's environment
    may have put them there)."""
    cudnn_home: bool = False
    """``CUDNN_HOME`` set above the folder of the cuDNN torch loaded (TE loads cuDNN from there)."""
    preload_cudnn: bool = False
    """``LD_PRELOAD`` of every cuDNN library in torch's cuDNN folder: its sublibraries then resolve
    to the same version whatever else the loader's path holds."""


CANDIDATES = (
    Candidate("as the session runs it", drop_wheel_libraries=False),
    Candidate("without the wheels' lib folders on LD_LIBRARY_PATH", drop_wheel_libraries=True),
    Candidate("CUDNN_HOME at torch's cuDNN", drop_wheel_libraries=False, cudnn_home=True),
    Candidate("LD_PRELOAD of torch's cuDNN libraries", drop_wheel_libraries=False, preload_cudnn=True),
)


def wheel_library_folders() -> set[str]:
    """The ``nvidia/*/lib`` folders of this Python's NVIDIA wheels."""
    return {str(path) for path in Path(sysconfig.get_paths()["purelib"]).glob("nvidia/*/lib")}


def mapped_libraries() -> list[str]:
    """The cuDNN, NVRTC and cuBLAS files this process has mapped (``/proc/self/maps``)."""
    found = set()
    for line in Path("/proc/self/maps").read_text().splitlines():
        path = line.split()[-1] if line.split() else ""
        if any(Path(path).name.startswith(name) for name in LIBRARY_NAMES):
            found.add(path)
    return sorted(found)


def torch_cudnn_folder() -> str | None:
    """The folder of the cuDNN library torch loads (None without CUDA or cuDNN)."""
    import torch

    if not torch.cuda.is_available() or torch.backends.cudnn.version() is None:
        return None
    return next((str(Path(path).parent) for path in mapped_libraries() if Path(path).name.startswith("libcudnn")), None)


def candidate_environment(candidate: Candidate, base: dict[str, str], cudnn_folder: str | None) -> dict[str, str]:
    """The variables ``candidate`` changes in ``base`` (only those: what the session exports)."""
    changed = {}
    if candidate.drop_wheel_libraries:
        wheels = wheel_library_folders()
        kept = [entry for entry in base.get("LD_LIBRARY_PATH", "").split(os.pathsep) if entry and entry not in wheels]
        changed["LD_LIBRARY_PATH"] = os.pathsep.join(kept)
    if candidate.cudnn_home and cudnn_folder:
        changed["CUDNN_HOME"] = str(Path(cudnn_folder).parent)
    if candidate.preload_cudnn and cudnn_folder:
        libraries = sorted(str(path) for path in Path(cudnn_folder).glob("libcudnn*.so.*"))
        changed["LD_PRELOAD"] = " ".join(filter(None, [*libraries, base.get("LD_PRELOAD", "")]))
    return changed


def try_attention() -> dict:
    """One bf16 GQA causal attention through TE, forward and backward, in this process: the
    backend TE selected, its reasons for ruling out the expected one, and the libraries mapped."""
    import torch
    import transformer_engine.pytorch as te

    from lime_megatron.gpu_check import SELECTED_BACKEND, backend_reasons, captured_log_messages

    attention = te.DotProductAttention(8, 64, num_gqa_groups=2, attn_mask_type="causal", qkv_format="sbhd")
    shapes = ((256, 2, 8, 64), (256, 2, 2, 64), (256, 2, 2, 64))
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for shape in shapes)
    error = ""
    with captured_log_messages() as messages:
        try:
            attention(q, k, v).sum().backward()
            torch.cuda.synchronize()
        except Exception as failure:  # noqa: BLE001 - the failure is the finding
            error = f"{type(failure).__name__}: {str(failure)[:300]}"
    selected = sorted({match.group(1) for message in messages for match in SELECTED_BACKEND.finditer(message)})
    return dict(selected=selected, reasons=backend_reasons(messages, EXPECTED), error=error, mapped=mapped_libraries())


def run_candidate(name: str, changed: dict[str, str], base: dict[str, str]) -> dict:
    """``try_attention`` in a fresh process under ``base`` with the ``changed`` variables, with
    cuDNN's and TE's debug logs on: its findings, the variables changed, and cuDNN's last error
    lines."""
    env = dict(base, **changed, NVTE_DEBUG="1", NVTE_DEBUG_LEVEL="2", CUDNN_LOGERR_DBG="1", CUDNN_LOGDEST_DBG="stderr")
    record: dict = dict(name=name, changed=changed)
    try:
        done = subprocess.run(
            [sys.executable, __file__, "--try"], env=env, capture_output=True, text=True, timeout=TRY_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        return dict(record, selected=[], error=f"no answer within {TRY_TIMEOUT_S:.0f} s")
    lines = done.stdout.strip().splitlines()
    try:
        record.update(json.loads(lines[-1]))
    except (IndexError, json.JSONDecodeError):
        record.update(selected=[], error=f"exited {done.returncode}: {done.stderr.strip()[-400:]}")
    record["cudnn_errors"] = [line for line in done.stderr.splitlines() if line.lstrip()[:2] in ("E!", "e!")][
        -CUDNN_ERROR_LINES:
    ]
    return record


def fused(record: dict) -> bool:
    """Whether a candidate's ``record`` has TE select ``EXPECTED`` alone and run it without error."""
    return record.get("selected") == [EXPECTED] and not record.get("error")


def unavailable_reason() -> str | None:
    """Why no candidate can run here (no CUDA, no TransformerEngine), else None."""
    import importlib.util

    import torch

    if not torch.cuda.is_available():
        return "no CUDA device"
    if importlib.util.find_spec("transformer_engine") is None:
        return "TransformerEngine is not installed"
    return None


def probe() -> dict:
    """Every candidate in order, stopping at the first that selects ``EXPECTED``; the findings,
    with ``exports``: the variables of that candidate when it is not the first."""
    reason = unavailable_reason()
    if reason:
        return dict(skipped=reason, candidates=[], exports={})
    cudnn_folder = torch_cudnn_folder()
    found = dict(torch_cudnn_folder=cudnn_folder, wheel_library_folders=sorted(wheel_library_folders()))
    candidates, exports, base = [], {}, dict(os.environ)
    for index, candidate in enumerate(CANDIDATES):
        changed = candidate_environment(candidate, base, cudnn_folder)
        if index and all(base.get(name) == value for name, value in changed.items()):
            continue  # the session's own environment, tried first
        record = run_candidate(candidate.name, changed, base)
        candidates.append(record)
        if fused(record):
            exports = record["changed"]
            break
    return dict(found, candidates=candidates, exports=exports)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", metavar="PATH", help="the findings")
    parser.add_argument("--exports", metavar="PATH", help="the variables the session's later steps get")
    parser.add_argument("--try", dest="attempt", action="store_true", help="(internal) one attempt, JSON on stdout")
    args = parser.parse_args(argv)
    if args.attempt:
        print(json.dumps(try_attention()), flush=True)
        return 0
    if not args.json:
        parser.error("--json is required")
    found = probe()
    Path(args.json).write_text(json.dumps(found, indent=1))
    if args.exports:
        Path(args.exports).write_text(json.dumps(found["exports"], indent=1))
    for record in found["candidates"]:
        print(f"{record['name']}: {record['selected'] or 'none'} {record.get('error', '')}", flush=True)
    print(f"exports for the later steps: {found['exports'] or 'none'}; {found.get('skipped', '')}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
