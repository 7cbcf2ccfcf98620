"""Compile the routing kernels for Hopper (sm_90) on a machine without a GPU and print, as JSON,
what their PTX multiplies with: ``python -m tests.kernels.hopper_ptx`` (Triton compiling, not
its interpreter: run without ``TRITON_INTERPRET``).  ``test_kernels_compile_for_hopper`` reads it.

``python -m tests.kernels.hopper_ptx --launches PATH`` compiles instead the launches recorded in
PATH (``specialization``, in the interpreter: a model's own launches, with the argument
specialization Triton's runtime gives them on a GPU: integers divisible by 16 marked so, ones made
constants) and prints how each reads and writes memory (``memory_access``)."""

from __future__ import annotations

import argparse
import inspect
import json
import os
import re
from collections import Counter

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
    return (("*fp32", *["i32"] * 7), operand(dtype), "i32", operand(dtype), "i32", ("i32",) * 3)


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
    """Per variant (kernel, rows' dtype): ``products`` of its PTX, the variants compiled side by
    side (``compiled``)."""
    from lime_megatron.kernels.operands import MIX_TILES

    jobs = {}
    for dtype in ("fp32", "bf16", "fp16"):
        mix_signature = {name: operand(dtype) for name in ROW_OPERANDS}
        mix_signature |= dict(a1=("*fp32", *["i32"] * 4), a2=(f"*{dtype}", *["i32"] * 4), shape=("i32",) * 3)
        mix_signature |= dict(weight=weight_argument(dtype), tiles=("i32",) * 6)
        tiles = dict(BLOCK_R=16, BLOCK_K=16, BLOCK_M=16, BLOCK_C=32, W_BLOCK_N=64, WIDTH=128, W_WIDTH=128)
        for variant, flags in MIX_VARIANTS.items():
            elements = MIX_TILES.weight_grad_elements if flags["WEIGHT_GRAD"] else MIX_TILES.elements
            constants = {**flags, **tiles, "BLOCK_N": elements, "ATOMIC": flags["WEIGHT_GRAD"]}
            jobs[f"mix {dtype} {variant}"] = ("mix_kernel", mix_signature, constants)
        for atomic in (True, False):
            constants = dict(ATOMIC=atomic, BLOCK_M=16, BLOCK_C=32, W_BLOCK_N=64, W_WIDTH=128)
            jobs[f"weight_grad {dtype} {'atomic' if atomic else 'per split'}"] = (
                "weight_grad_kernel",
                {"weight": weight_argument(dtype)},
                constants,
            )
    return dict(zip(jobs, map(products, compiled(_variant_ptx, jobs.values()))))


def _variant_ptx(job: tuple[str, dict, dict]) -> str:
    """The sm_90 PTX of a ``report`` job ``(kernel name, signature, constants)``: float32 sums, no
    upcast (as on a GPU)."""
    import triton.language as tl

    from lime_megatron.kernels import routing_kernels

    kernel, signature, constants = job
    return ptx(getattr(routing_kernels, kernel), signature, {**constants, "ACC": tl.float32, "UPCAST": False})


def compiled(compile_one, jobs) -> list[str]:
    """``compile_one`` of each job, in forked processes, one per core (each compile runs Triton's
    passes and ptxas on one core)."""
    import multiprocessing

    jobs = list(jobs)
    with multiprocessing.get_context("fork").Pool(min(len(jobs), os.cpu_count() or 1)) as pool:
        return pool.map(compile_one, jobs, chunksize=1)


def specialization(kernel, args: tuple, constants: dict) -> dict:
    """A launch of ``kernel`` as Triton's runtime specializes it (``native_specialize_impl``:
    each argument's type, ``D`` where an integer or pointer is divisible by 16, integers equal to 1
    made constants), JSON-ready: the kernel's name, per non-constant argument its types and
    specialization keys, the constants (dtypes by name)."""
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import native_specialize_impl

    specialized = [native_specialize_impl(BaseBackend, value, False, True, True) for value in args]
    named = {name: value if isinstance(value, (bool, int)) else str(value) for name, value in constants.items()}
    return dict(
        kernel=kernel.fn.__name__, types=[t for t, _ in specialized], keys=[k for _, k in specialized], constants=named
    )


def compile_launch(launch: dict) -> str:
    """The sm_90 PTX of a launch recorded by ``specialization`` (compiled as on a GPU: no upcast)."""
    import triton
    import triton.language as tl
    from triton._utils import find_paths_if, get_iterable_path
    from triton.backends.compiler import BaseBackend, GPUTarget
    from triton.compiler import ASTSource

    from lime_megatron.kernels import routing_kernels

    kernel = getattr(routing_kernels, launch["kernel"])
    names = list(inspect.signature(kernel.fn).parameters)
    dtypes = {"fp32": tl.float32, "fp64": tl.float64}
    constants = {name: dtypes.get(value, value) for name, value in launch["constants"].items()} | {"UPCAST": False}
    arguments = [name for name in names if name not in constants]
    as_tuple = lambda value: tuple(map(as_tuple, value)) if isinstance(value, list) else value  # noqa: E731
    signature = dict(zip(arguments, map(as_tuple, launch["types"]))) | dict.fromkeys(constants, "constexpr")
    keys = [as_tuple(launch["keys"][arguments.index(name)]) if name in arguments else "" for name in names]
    sigvals = [signature[name] for name in names]
    constexprs = {(names.index(name),): value for name, value in constants.items()}
    constexprs |= {
        path: get_iterable_path(keys, path)
        for path in find_paths_if(sigvals, lambda _, v: v == "constexpr")
        if len(path) > 1
    }
    attrs = {
        path: BaseBackend.parse_attr(get_iterable_path(keys, path))
        for path in find_paths_if(keys, lambda _, k: isinstance(k, str))
    }
    source = ASTSource(
        fn=kernel, signature=signature, constexprs=constexprs, attrs={p: a for p, a in attrs.items() if a}
    )
    return triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["ptx"]


def memory_access(code: str) -> dict:
    """How ``code`` moves memory: global loads, asynchronous copies (by bytes per copy), stores
    and atomics, each instruction form counted."""
    forms = re.findall(r"\b(ld\.global[.a-z0-9]*|st\.global[.a-z0-9]*|atom[.a-z0-9]*)", code)
    copies = re.findall(r"\bcp\.async\.c[ag]\.shared\.global \[[^]]*\], \[[^]]*\], (0x[0-9a-f]+)", code)
    return dict(Counter(forms) + Counter(f"cp.async {int(size, 16)} bytes" for size in copies))


def launches_report(path: str) -> list[dict]:
    """Per launch recorded at ``path``: its constants and ``memory_access`` of its PTX."""
    launches = json.loads(open(path).read())
    return [
        dict(launch, access=memory_access(code)) for launch, code in zip(launches, compiled(compile_launch, launches))
    ]


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("compile without TRITON_INTERPRET (the interpreter does not compile)")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--launches", metavar="PATH", help="compile the launches recorded at PATH")
    args = parser.parse_args()
    print(json.dumps(launches_report(args.launches) if args.launches else report()))
