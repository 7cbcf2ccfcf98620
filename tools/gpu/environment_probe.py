"""What the GPU session runs on: Python, torch, the device, megatron-core, TransformerEngine (its
cuDNN and FP8 support), written as one JSON object (``--json PATH``) and printed.

Run by the session's environment step after the install, in the environment every later step
gets; each finding that could not be made is a ``<name> problem`` entry naming the error (a CPU
machine has no TransformerEngine: never install it there, it breaks ``import megatron.core``).
"""

from __future__ import annotations

import argparse
import json
import platform
from collections.abc import Callable


def finding(found: dict, name: str, probe: Callable[[], str]) -> None:
    """``found[name] = probe()``, or ``found[name + " problem"]`` naming the error it raised."""
    try:
        found[name] = probe()
    except Exception as error:  # noqa: BLE001 - every failure is a finding, reported by name
        found[f"{name} problem"] = f"{type(error).__name__}: {(str(error).splitlines() or [''])[0][:200]}"


def device() -> str:
    import torch

    if not torch.cuda.is_available():
        return "cpu (no CUDA)"
    major, minor = torch.cuda.get_device_capability()
    return f"{torch.cuda.get_device_name()} (compute capability {major}.{minor}, CUDA {torch.version.cuda})"


def megatron_core() -> str:
    from importlib.metadata import version

    import megatron.core

    return f"{version('megatron-core')} ({megatron.core.__file__.rsplit('/megatron/', 1)[0]})"


def transformer_engine() -> str:
    import transformer_engine
    import transformer_engine.pytorch  # noqa: F401 - the import users' runs make

    return f"{transformer_engine.__version__} ({transformer_engine.__file__.rsplit('/transformer_engine/', 1)[0]})"


def cudnn() -> str:
    import transformer_engine.pytorch as te

    return str(te.get_cudnn_version())


def fp8() -> str:
    import transformer_engine.pytorch as te

    available, reason = te.is_fp8_available(return_reason=True)
    if not available:
        raise RuntimeError(f"FP8 unavailable: {reason}")
    return "available"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", metavar="PATH", required=True)
    args = parser.parse_args(argv)
    found: dict = {"python": platform.python_version()}
    finding(found, "torch", lambda: __import__("torch").__version__)
    finding(found, "device", device)
    finding(found, "megatron-core", megatron_core)
    for name, probe in (("TransformerEngine", transformer_engine), ("cuDNN", cudnn), ("FP8", fp8)):
        finding(found, name, probe)
    with open(args.json, "w") as file:
        json.dump(found, file, indent=1)
    for name, value in found.items():
        print(f"{name}: {value}", flush=True)
    return found


if __name__ == "__main__":
    main()
