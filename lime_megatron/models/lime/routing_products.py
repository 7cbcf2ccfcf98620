"""The matrix products of LIMe's routing, and the one hook that can observe them.

Every routing product multiplies a narrow operand (router columns ``[r, k]``, or their transpose)
with a wide one: ``k`` rows of ``N = 2 * s * b * d`` elements (buffer rows, kept gradient rows,
partial sums).  Such a product does 2 * r FLOPs per wide element read, so it runs at memory
bandwidth; what it costs is the bytes of its wide operand.

Products are named by what they compute (``kind``): ``forward`` (Eq. 2), ``weight_grad`` (the
router-weight gradient ``g @ rows^T``), ``row_grad`` (the gradient of the source rows
``W^T @ g``) and ``rebuild`` (Eq. 2 again in backward for dropped routed K/V).  With no observer
installed (``set_product_observer``) a product is the plain torch call; an observer, called as
``observer(kind, wide, flops, run)``, runs the product itself (``run()``) and returns its result
(``flops`` None: a per-token read of the dynamic router, no matrix product).  The measurement
built on it (bytes, FLOPs and seconds by kind) lives in ``lime_megatron.testing.routing_reads``.

Router-weight gradients reduce over N and are accumulated in float32 for bf16/fp16 rows
(``float32_product``): a bf16 run keeps its routers in float32 and the products cast them to the
rows' dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

from lime_megatron.kernels import operands as kernels
from lime_megatron.kernels.operands import Columns, Halves

Result = TypeVar("Result")

ProductObserver = Callable[[str, torch.Tensor | Halves, int | None, Callable[[], Result]], Result]
"""``(kind, wide operand (a tensor, or rows as the kernels address them), FLOPs or None, run) ->
run()``'s result."""

_OBSERVER: ProductObserver | None = None


def set_product_observer(observer: ProductObserver | None) -> None:
    """Install ``observer`` around every routing product and per-token read (None removes it)."""
    global _OBSERVER
    _OBSERVER = observer


def observed_product(kind: str, wide: torch.Tensor | Halves, flops: int, product: Callable[[], Result]) -> Result:
    """``product()``, a matrix product reading the N-wide ``wide`` for ``flops`` FLOPs, through the
    observer when one is installed."""
    return product() if _OBSERVER is None else _OBSERVER(kind, wide, flops, product)


def observed_read(kind: str, wide: torch.Tensor) -> torch.Tensor:
    """``wide``, a per-token product's read of N-wide rows, shown to the observer when one is
    installed."""
    return wide if _OBSERVER is None else _OBSERVER(kind, wide, None, lambda: wide)


def matrix_flops(narrow: torch.Tensor, wide: torch.Tensor) -> int:
    """FLOPs of ``narrow @ wide`` ([r, k] @ [k, N])."""
    return 2 * narrow.shape[0] * narrow.shape[1] * wide.shape[1]


def routing_product(
    kind: str, narrow: torch.Tensor, wide: torch.Tensor, accumulate: torch.Tensor | None = None, triton: bool = False
) -> torch.Tensor:
    """``narrow @ wide`` ([r, k] @ [k, N]) in ``wide``'s dtype (router weights may be kept in float32
    beside bf16 activations), plus ``accumulate`` ([r, N]) in the same kernel when given (a new
    tensor either way); with ``triton`` one launch of ``kernels.routing_kernels.mix_kernel``."""
    flops = matrix_flops(narrow, wide)
    if triton:
        return observed_product(kind, wide, flops, lambda: triton_rows_product(narrow, wide, accumulate))
    narrow = narrow.to(wide.dtype)
    if accumulate is None:
        return observed_product(kind, wide, flops, lambda: narrow @ wide)
    return observed_product(kind, wide, flops, lambda: torch.addmm(accumulate, narrow, wide))


def routing_product_attention_layout(
    kind: str,
    narrow: torch.Tensor,
    wide: torch.Tensor,
    inner: int,
    accumulate: torch.Tensor | None = None,
    triton: bool = False,
) -> torch.Tensor:
    """``narrow @ wide`` written straight into attention's layout: ``[r, k] @ [k, M * inner]`` ->
    ``[M, r, inner]`` contiguous (with ``M * inner = 2*s*b*d``, ``inner = d``: ``[2, s, b, r, d]``),
    one strided-batched product instead of the ``[r, N]`` product and its rearranging copy, plus
    ``accumulate`` (``[M, r, inner]``, or a view of that shape's elements) in the same kernel when
    given; with ``triton`` one launch of ``kernels.routing_kernels.mix_kernel``."""
    if triton:
        flops = matrix_flops(narrow, wide)
        return observed_product(kind, wide, flops, lambda: triton_attention_product(narrow, wide, inner, accumulate))
    batched = wide.view(wide.shape[0], -1, inner).transpose(0, 1)
    return batched_product(kind, batched_narrow(narrow, batched), batched, accumulate)


def batched_narrow(narrow: torch.Tensor, batched: torch.Tensor) -> torch.Tensor:
    """The narrow operand ``[r, k]`` in the dtype of ``batched`` ``[M, k, inner]``, broadcast over
    its M positions (a view)."""
    return narrow.to(batched.dtype).expand(batched.shape[0], -1, -1)


def batched_product(
    kind: str, narrow: torch.Tensor, batched: torch.Tensor, accumulate: torch.Tensor | None = None
) -> torch.Tensor:
    """``narrow @ batched`` (``[M, r, k] @ [M, k, inner]``, ``narrow`` one matrix broadcast over M)
    -> ``[M, r, inner]``, plus ``accumulate`` in the same kernel when given; its wide operand is
    ``batched``."""
    flops = 2 * narrow.shape[1] * batched.numel()
    if accumulate is None:
        return observed_product(kind, batched, flops, lambda: torch.bmm(narrow, batched))
    accumulate = accumulate.view(batched.shape[0], narrow.shape[1], batched.shape[2])
    return observed_product(kind, batched, flops, lambda: torch.baddbmm(accumulate, narrow, batched))


def key_value_halves(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``[h, (k|v, s, b, d)]`` (buffer rows, their partial sums or gradients) as their keys'
    and values' halves ``[h, s*b*d]``: two views."""
    return tuple(rows.view(rows.shape[0], 2, -1).unbind(1))


def routing_product_keys_values(
    kind: str,
    narrow: torch.Tensor,
    wide: torch.Tensor,
    inner: int,
    accumulate: tuple[torch.Tensor, torch.Tensor] | None = None,
    triton: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``routing_product_attention_layout`` of the keys' and the values' halves of the rows
    ``wide`` apart, each plus its half of ``accumulate`` when given: keys and values
    ``[s*b, r, inner]``, two tensors, so that attention can keep the values without the keys
    (only RoPE reads those).  The two halves' batched views come from one view of ``wide``
    and share one broadcast ``narrow`` (each operator is host time, docs/routing.md); with
    ``triton`` both halves are one launch of ``kernels.routing_kernels.mix_kernel``."""
    if triton:
        flops = matrix_flops(narrow, wide)
        return observed_product(kind, wide, flops, lambda: triton_keys_values_product(narrow, wide, inner, accumulate))
    halves = wide.view(wide.shape[0], 2, -1, inner).permute(1, 2, 0, 3).unbind(0)
    narrow = batched_narrow(narrow, halves[0])
    return tuple(batched_product(kind, narrow, half, added) for half, added in zip(halves, accumulate or (None, None)))


def weight_grad_dtype(weight: torch.Tensor) -> torch.dtype:
    """The dtype router-weight gradients are accumulated and returned in: float32 at least
    (float64 for float64 weights)."""
    return torch.float64 if weight.dtype == torch.float64 else torch.float32


def placed_columns(pieces: list[tuple[slice, torch.Tensor]], weight: torch.Tensor) -> torch.Tensor:
    """A router-weight gradient shaped like ``weight``, in ``weight_grad_dtype``: each piece
    ``(columns, [rows, len(columns)])`` at its columns, zero elsewhere.  Pieces that adjoin (the
    usual case: a run of consecutive sources, split at its block's start under blocked routing)
    are joined by one ``cat`` (none for a single piece) and padded by one ``pad`` (none where
    they span the weight's columns, e.g. the full router's)."""
    dtype = weight_grad_dtype(weight)
    pieces = sorted(pieces, key=lambda piece: piece[0].start)
    if pieces and all(left.stop == right.start for (left, _), (right, _) in zip(pieces, pieces[1:])):
        grad = torch.cat([piece for _, piece in pieces], dim=1) if len(pieces) > 1 else pieces[0][1]
        margins = (pieces[0][0].start, weight.shape[1] - pieces[-1][0].stop)
        grad = grad if grad.dtype == dtype else grad.to(dtype)
        return grad if margins == (0, 0) else torch.nn.functional.pad(grad, margins)
    grad = torch.zeros_like(weight, dtype=dtype)
    for columns, piece in pieces:
        grad[:, columns] = piece
    return grad


def weight_grad_product(grad_rows: torch.Tensor, rows: torch.Tensor, triton: bool = False) -> torch.Tensor:
    """:func:`float32_product`, the router-weight gradient's product (kind ``weight_grad``); with
    ``triton`` ``kernels.routing_kernels.weight_grad_kernel`` (``triton_weight_grad``)."""
    flops = 2 * grad_rows.shape[0] * rows.shape[0] * rows.shape[1]
    if triton:
        return observed_product("weight_grad", rows, flops, lambda: triton_weight_grad(grad_rows, rows))
    return observed_product("weight_grad", rows, flops, lambda: float32_product(grad_rows, rows))


FLOAT32_CHUNK_BYTES = 64 * 2**20
"""Bytes of the float32 copies of one chunk of the reduced dimension in ``float32_product``."""


CUBLAS_FLOAT32_OUTPUT = torch.torch_version.TorchVersion(torch.__version__) >= "2.8"
"""``torch.mm(..., out_dtype=torch.float32)`` exists (torch 2.8): on CUDA, bf16/fp16 operands,
float32 accumulation and result in one cuBLAS product."""


def float32_product(grad_rows: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``grad_rows @ rows^T`` (``[m, N] x [n, N] -> [m, n]``), accumulated in float32 for
    bf16/fp16 operands: the router weight gradient reduces over N = 2*s*b*d elements (about 2M at
    the paper's 1B shape), where bf16 partial sums (split-K) lose about 1e-2 relative.  On CUDA
    (torch >= 2.8) one cuBLAS product with a float32 result (``CUBLAS_FLOAT32_OUTPUT``: on an H200,
    [128, 2^20] x [512, 2^20]^T in 0.35 ms against 6.4 ms upcast by chunks, 3.7e-5 relative);
    elsewhere the operands are upcast a chunk of N at a time (``FLOAT32_CHUNK_BYTES``), never
    whole.  Float32 and float64 operands multiply as they are."""
    if grad_rows.dtype in (torch.float32, torch.float64) and rows.dtype == grad_rows.dtype:
        return grad_rows @ rows.t()
    if grad_rows.is_cuda and CUBLAS_FLOAT32_OUTPUT and rows.dtype == grad_rows.dtype:
        return torch.mm(grad_rows, rows.t(), out_dtype=torch.float32)
    step = max(1, FLOAT32_CHUNK_BYTES // (4 * (grad_rows.shape[0] + rows.shape[0])))
    product = grad_rows.new_zeros(grad_rows.shape[0], rows.shape[0], dtype=torch.float32)
    for start in range(0, rows.shape[1], step):
        product.addmm_(grad_rows[:, start : start + step].float(), rows[:, start : start + step].float().t())
    return product


def triton_rows_product(narrow: torch.Tensor, wide: torch.Tensor, accumulate: torch.Tensor | None) -> torch.Tensor:
    """``routing_product`` as one ``mix_kernel`` launch: rows ``[r, N]`` (a new tensor)."""
    out = wide.new_empty(narrow.shape[0], wide.shape[1])
    added = None if accumulate is None else Halves.of_rows(accumulate, 0, narrow.shape[0])
    kernels.mix(
        Halves.of_rows(out, 0, narrow.shape[0]),
        (Columns.of_view(narrow), Halves.of_rows(wide, 0, wide.shape[0])),
        accumulate=added,
    )
    return out


def triton_attention_product(
    narrow: torch.Tensor, wide: torch.Tensor, inner: int, accumulate: torch.Tensor | None
) -> torch.Tensor:
    """``routing_product_attention_layout`` as one ``mix_kernel`` launch: ``[M, r, inner]``."""
    r, positions = narrow.shape[0], wide.shape[1] // (2 * inner)
    out = wide.new_empty(2 * positions, r, inner)
    added = None if accumulate is None else Halves.of_heads(accumulate.view(2 * positions, r, inner))
    kernels.mix(
        Halves.of_heads(out),
        (Columns.of_view(narrow), Halves.of_rows(wide, 0, wide.shape[0], inner)),
        accumulate=added,
    )
    return out


def triton_keys_values_product(
    narrow: torch.Tensor, wide: torch.Tensor, inner: int, accumulate: tuple[torch.Tensor, torch.Tensor] | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``routing_product_keys_values`` as one ``mix_kernel`` launch: keys and values
    ``[s*b, r, inner]``, two tensors."""
    r, positions = narrow.shape[0], wide.shape[1] // (2 * inner)
    keys, values = wide.new_empty(positions, r, inner), wide.new_empty(positions, r, inner)
    added = None if accumulate is None else Halves.of_heads(*accumulate)
    kernels.mix(
        Halves.of_heads(keys, values),
        (Columns.of_view(narrow), Halves.of_rows(wide, 0, wide.shape[0], inner)),
        accumulate=added,
    )
    return keys, values


def triton_weight_grad(grad_rows: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``float32_product`` as ``weight_grad_kernel`` launches: ``grad_rows @ rows^T`` ``[m, n]`` in
    ``weight_grad_dtype``, deterministic (per-split sums, then one sum)."""
    grads, wide = Halves.of_rows(grad_rows, 0, grad_rows.shape[0]), Halves.of_rows(rows, 0, rows.shape[0])
    return kernels.weight_grad_sums(grads, [(0, wide)], rows.shape[0], weight_grad_dtype(rows), deterministic=True)
