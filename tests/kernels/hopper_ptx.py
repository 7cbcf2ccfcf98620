"""Compile the routing kernels for Hopper (sm_90) on a machine without a GPU and print, as JSON,
what their PTX multiplies with: ``python -m tests.kernels.hopper_ptx`` (Triton compiling, not
its interpreter: run without ``TRITON_INTERPRET``).  ``test_kernels_compile_for_hopper`` reads it."""

from __future__ import annotations

import inspect
import json
import os
import re

ROW_OPERANDS = ("out", "acc", "more", "x1", "x2", "store")
"""The mix kernel's operands of the rows' dtype (each a tuple: keys, values, ten integers)."""


MIX_VARIANTS = {  # the mix kernel's variants by what its launches ask of it: its flags
    "with sums and store": dict(HAS_ACC=True, HAS_MORE=True, HAS_STORE=True, WEIGHT_GRAD=False, KEEP=False),
    "without sums and store": dict(HAS_ACC=False, HAS_MORE=False, HAS_STORE=False, WEIGHT_GRAD=False, KEEP=False),
    "with the weight gradient (a layer's backward)": dict(
        HAS_ACC=True, HAS_MORE=True, HAS_STORE=False, WEIGHT_GRAD=True, KEEP=True
    ),
    "with the weight gradient (a block's backward)": dict(
        HAS_ACC=False, HAS_MORE=False, HAS_STORE=False, WEIGHT_GRAD=True, KEEP=False
    ),
}


def operand(dtype: str) -> tuple[str, ...]:
    """The signature of an operand tuple (``Halves.arguments``) of ``dtype`` rows."""
    return (f"*{dtype}", f"*{dtype}", *["i32"] * 10)


def weight_argument(dtype: str) -> tuple:
    """The signature of ``weight_grad_kernel``'s ``weight``: float32 sums, ``dtype`` rows."""
    return (("*fp32", *["i32"] * 7), operand(dtype), "i32", operand(dtype), "i32", ("i32",) * 4)


def ptx(kernel, signature: dict, constants: dict) -> str:
    """The PTX of ``kernel`` (a ``triton.jit`` function) for sm_90; ``signature`` the types of its
    other arguments (tuples for tuple arguments)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(inspect.signature(kernel.fn).parameters)
    full = {name: "constexpr" if name in constants else signature[name] for name in names}
    source = ASTSource(fn=kernel, signature=full, constexprs={(names.index(k),): v for k, v in constants.items()})
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
        mix_signature = {name: operand(dtype) for name in ROW_OPERANDS}
        mix_signature |= dict(a1=("*fp32", *["i32"] * 4), a2=(f"*{dtype}", *["i32"] * 4), shape=("i32",) * 4)
        mix_signature |= dict(weight=weight_argument(dtype), tiles=("i32",) * 6)
        tiles = dict(BLOCK_R=16, BLOCK_K=16, BLOCK_N=128, BLOCK_M=16, BLOCK_C=32, W_BLOCK_N=64)
        for variant, flags in MIX_VARIANTS.items():
            constants = {**flags, **tiles, "ACC": tl.float32, "UPCAST": False, "ATOMIC": flags["WEIGHT_GRAD"]}
            result[f"mix {dtype} {variant}"] = products(ptx(routing_kernels.mix_kernel, mix_signature, constants))
        for atomic in (True, False):
            constants = dict(ATOMIC=atomic, ACC=tl.float32, UPCAST=False, BLOCK_M=16, BLOCK_C=32, W_BLOCK_N=64)
            code = ptx(routing_kernels.weight_grad_kernel, {"weight": weight_argument(dtype)}, constants)
            result[f"weight_grad {dtype} {'atomic' if atomic else 'per split'}"] = products(code)
    return result


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("compile without TRITON_INTERPRET (the interpreter does not compile)")
    print(json.dumps(report()))
