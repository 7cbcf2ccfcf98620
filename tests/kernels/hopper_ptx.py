"""Compile the routing kernels for Hopper (sm_90) on a machine without a GPU and print, as JSON,
what their PTX multiplies with: ``python -m tests.kernels.hopper_ptx`` (Triton compiling, not
its interpreter: run without ``TRITON_INTERPRET``).  ``test_kernels_compile_for_hopper`` reads it."""

from __future__ import annotations

import inspect
import json
import os
import re

ROW_OPERANDS = ("out", "acc", "more", "x1", "x2", "st")
"""The mix kernel's operands of the rows' dtype (pointers ``<name>_k`` and ``<name>_v``)."""


def ptx(kernel, pointers: dict[str, str], constants: dict) -> str:
    """The PTX of ``kernel`` (a ``triton.jit`` function) for sm_90, integer arguments as i32."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(inspect.signature(kernel.fn).parameters)
    signature = {name: "constexpr" if name in constants else pointers.get(name, "i32") for name in names}
    source = ASTSource(fn=kernel, signature=signature, constexprs={(names.index(k),): v for k, v in constants.items()})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["ptx"]


def products(code: str) -> dict:
    """What ``code`` multiplies with: its tensor-core instructions, whether any reads TF32, and
    whether it has float32 FMAs."""
    return dict(
        mma=sorted(set(re.findall(r"\b(?:w?gmma|mma)\.[a-z0-9._]+", code))),
        tf32="tf32" in code,
        fma=bool(re.search(r"\bfma\.rn\.f32\b", code)),
    )


def report() -> dict:
    """Per variant (kernel, rows' dtype): ``products`` of its PTX."""
    import triton.language as tl

    from lime_megatron.kernels import routing_kernels

    result = {}
    for dtype in ("fp32", "bf16", "fp16"):
        rows = {f"{name}_{half}": f"*{dtype}" for name in ROW_OPERANDS for half in "kv"}
        for flags in (True, False):
            mix = dict(HAS_ACC=flags, HAS_MORE=flags, HAS_STORE=flags, ACC=tl.float32, UPCAST=False)
            tiles = dict(BLOCK_R=16, BLOCK_K=16, BLOCK_N=128)
            code = ptx(routing_kernels.mix_kernel, {**rows, "a1": "*fp32", "a2": f"*{dtype}"}, {**mix, **tiles})
            result[f"mix {dtype} {'with' if flags else 'without'} sums and store"] = products(code)
        for atomic in (True, False):
            pointers = {"out": "*fp32", **{f"{name}_{half}": f"*{dtype}" for name in ("g", "x") for half in "kv"}}
            constants = dict(ATOMIC=atomic, ACC=tl.float32, UPCAST=False, BLOCK_M=16, BLOCK_C=32, BLOCK_N=64)
            code = ptx(routing_kernels.weight_grad_kernel, pointers, constants)
            result[f"weight_grad {dtype} {'atomic' if atomic else 'per split'}"] = products(code)
    return result


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("compile without TRITON_INTERPRET (the interpreter does not compile)")
    print(json.dumps(report()))
