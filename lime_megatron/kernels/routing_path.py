"""Which way a model chunk's routing products run: Triton kernels or torch operators
(``--lime-routing-kernel``, ``LimeTransformerConfig.lime_routing_kernel``).

``auto`` (the default) takes the Triton kernels (``kernels.routing_kernels``) where they cover the
run: CUDA tensors, static routers (the dynamic router's per-token products are torch operators),
bf16/fp16/float32 rows (float64 is a CPU dtype here); torch elsewhere, the CPU's path and the
reference the kernels are tested against.  ``triton`` asks for the kernels and refuses, with one
message, a run they cannot serve; on a CPU they run in Triton's interpreter
(``TRITON_INTERPRET=1``), which is how CI tests them.  ``torch`` never launches a kernel.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from lime_megatron.choices import LimeConfigError

GPU_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
"""Row dtypes the kernels serve on a GPU."""


def routing_kernel(config, device: torch.device) -> str:
    """``"triton"`` or ``"torch"``: how a chunk of the model ``config`` with tensors on ``device``
    runs its routing products (module docstring); raises ``LimeConfigError`` where ``triton`` was
    asked for and cannot be honoured."""
    if planned_kernel(config, device) == "torch":
        return "torch"
    refusal = triton_refusal(config, device)
    if refusal is None:
        return "triton"
    if config.lime_routing_kernel == "triton":
        raise LimeConfigError(f"--lime-routing-kernel triton: {refusal}")
    return "torch"


def planned_kernel(config, device: torch.device) -> str:
    """The path a run of ``config`` on a ``device`` takes where triton is installed (``routing_kernel``
    less the installation, which the machine a run is planned on need not have)."""
    choice = config.lime_routing_kernel
    if choice == "torch" or not config.lime:
        return "torch"
    if choice == "triton":
        return "triton"
    return "triton" if device.type == "cuda" and kernel_refusal(config, device) is None else "torch"


def triton_refusal(config, device: torch.device) -> str | None:
    """Why the Triton kernels cannot serve this run here, or None."""
    if importlib.util.find_spec("triton") is None:
        return "the triton package is not installed (pip install triton)"
    return kernel_refusal(config, device)


def kernel_refusal(config, device: torch.device) -> str | None:
    """Why the kernels cannot serve this run on a ``device`` (wherever triton is installed), or None."""
    if config.lime_router == "dynamic":
        return "the dynamic router's per-token products have no Triton kernel; use --lime-routing-kernel torch"
    if device.type == "cuda" and config.params_dtype not in GPU_DTYPES:
        return f"the kernels take bf16, fp16 or float32 rows on a GPU, not {config.params_dtype}"
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return (
            "the kernels run on CUDA tensors; on a CPU only in Triton's interpreter "
            "(TRITON_INTERPRET=1 before triton is imported)"
        )
    return None
