"""Triton's CPU interpreter for a bench that runs on a CPU: ``TRITON_INTERPRET=1`` counts only if set
before triton is imported, and megatron-core imports it, so the benches that count or run the
Triton routing kernels import this module before the package (``--device cuda`` compiles them)."""

import os
import sys

if not any(argument.endswith("cuda") for argument in sys.argv[1:]):
    os.environ.setdefault("TRITON_INTERPRET", "1")
