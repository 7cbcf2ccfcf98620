"""The operands of the routing kernels and the calls that launch them (``routing_kernels``).

A ``Halves`` names rows of keys|values where they lie, as the kernels address them (base tensors,
an element offset and three strides): buffer rows, attention's layout, the strided keys/values of
megatron's QKV split.  Building one dispatches no operator, so a product costs the host its launch
(and its output's allocation) whatever its operands' layouts.  ``Columns`` names a router matrix
``[R, K]`` the same way (a weight, a slice of it, a transposed slice of a ``RouterStack``).

``mix`` and ``weight_grad`` launch the kernels through ``launch``, which an observer may wrap
(``set_launch_observer``: ``testing.dispatched_operators`` counts a launch as one operator, and
keeps Triton's interpreter's own tensor work on a CPU out of the count).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

LaunchObserver = Callable[[str, Callable[[], None]], None]
"""``(kernel name, launch) -> None``: runs ``launch()`` once."""

_OBSERVER: LaunchObserver | None = None


def set_launch_observer(observer: LaunchObserver | None) -> None:
    """Install ``observer`` around every kernel launch (None removes it)."""
    global _OBSERVER
    _OBSERVER = observer


def launch(kernel, grid: tuple[int, ...], *args, **constants) -> None:
    """``kernel[grid](*args, **constants)``, through the observer when one is installed."""
    if not args[0].is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            "the Triton routing kernels run on CUDA tensors; on a CPU only in Triton's interpreter "
            "(TRITON_INTERPRET=1 set before triton is imported, as the tests do): use "
            "--lime-routing-kernel torch"
        )

    def run() -> None:
        kernel[grid](*args, **constants)

    if _OBSERVER is None:
        run()
    else:
        _OBSERVER(kernel.__name__, run)


ROWS_WIDTH = 64
"""Elements per position where rows are read as rows (``Halves.of_rows`` without a width)."""


@dataclass(frozen=True)
class Halves:
    """``count`` rows of keys|values: element e of position p = ``s_p * batch + b_p`` of row i of
    the keys half at ``keys + start + i * row + s_p * outer + b_p * inner + e`` with ``(row,
    outer, inner) = key_strides``, of the values half at ``values + value_offset + start + ...``
    with ``value_strides``; ``positions`` P of ``width`` D elements per half."""

    keys: torch.Tensor
    values: torch.Tensor
    value_offset: int
    start: int
    key_strides: tuple[int, int, int]
    value_strides: tuple[int, int, int]
    count: int
    positions: int
    width: int
    batch: int

    @staticmethod
    def of_rows(rows: torch.Tensor, first: int, count: int, width: int | None = None) -> Halves:
        """Rows ``first..first+count-1`` of a ``[n, 2 * P * width]`` tensor with contiguous rows (the
        buffer, kept gradients, external blocks), ``width`` the head dimension where positions
        pair with attention's, else any divisor of a half (``ROWS_WIDTH`` at most)."""
        length, row = rows.shape[1], rows.stride(0)
        width = width or math.gcd(length // 2, ROWS_WIDTH)
        strides = (row, width, 0)
        return Halves(rows, rows, length // 2, first * row, strides, strides, count, length // (2 * width), width, 1)

    @staticmethod
    def of_heads(keys: torch.Tensor, values: torch.Tensor | None = None) -> Halves:
        """Keys and values ``[s, b, heads, d]`` (attention's layout, megatron's strided QKV split,
        the gradients attention returns: any strides with adjacent elements) or ``[positions,
        heads, d]``; with ``values`` None, ``keys`` holds both halves, the values after the keys'
        positions (``[2*s*b, heads, d]``).  A tensor whose elements are not adjacent is made
        contiguous first."""
        keys = keys if keys.stride(-1) == 1 else keys.contiguous()
        batch = keys.shape[1] if keys.dim() == 4 else 1
        heads, width = keys.shape[-2], keys.shape[-1]
        positions = math.prod(keys.shape[:-2])
        if values is None:
            positions //= 2
            strides = _strides(keys)
            return Halves(
                keys, keys, keys.shape[0] // 2 * keys.stride(0), 0, strides, strides, heads, positions, width, batch
            )
        values = values if values.stride(-1) == 1 else values.contiguous()
        return Halves(keys, values, 0, 0, _strides(keys), _strides(values), heads, positions, width, batch)

    def arguments(self, batch: int) -> tuple:
        """The kernels' ten pointer/offset/stride arguments of this operand, its positions split as
        ``s_p * batch + b_p`` (its own split, or any where one stride steps through all its
        positions)."""
        return (
            self.keys,
            self.values,
            self.value_offset,
            self.start,
            *self._in_batch(self.key_strides, batch),
            *self._in_batch(self.value_strides, batch),
        )

    def _in_batch(self, strides: tuple[int, int, int], batch: int) -> tuple[int, int, int]:
        row, outer, inner = strides
        if batch == self.batch:
            return strides
        if self.batch > 1 and outer != self.batch * inner:
            raise ValueError(f"operands split positions by {self.batch} and by {batch}")
        step = inner if self.batch > 1 else outer
        return row, batch * step, step

    def collapsible(self) -> bool:
        """Whether one stride steps through all positions of each half (any split serves)."""
        return self.batch == 1 or all(
            outer == self.batch * inner for _, outer, inner in (self.key_strides, self.value_strides)
        )


def _strides(heads: torch.Tensor) -> tuple[int, int, int]:
    """(row, outer, inner) of ``[s, b, heads, d]`` (heads, s, b) or ``[positions, heads, d]``."""
    return (
        (heads.stride(-2), heads.stride(0), heads.stride(1))
        if heads.dim() == 4
        else (heads.stride(-2), heads.stride(0), 0)
    )


def launch_batch(*operands: Halves | None) -> int:
    """The position split a launch over ``operands`` uses: that of any operand needing its own."""
    return next((halves.batch for halves in operands if halves is not None and not halves.collapsible()), 1)


@dataclass(frozen=True)
class Columns:
    """A router matrix ``[rows, count]``: element (i, k) at ``matrix + start + i * row + k * column``."""

    matrix: torch.Tensor
    start: int
    row: int
    column: int
    rows: int
    count: int

    @staticmethod
    def of(matrix: torch.Tensor, rows: slice, columns: slice, transposed: bool = False) -> Columns:
        """``matrix[rows, columns]`` (``.t()`` of it when ``transposed``) of a contiguous 2-D
        ``matrix``, no view dispatched."""
        width = matrix.shape[1]
        start = rows.start * width + columns.start
        height, count = rows.stop - rows.start, columns.stop - columns.start
        if transposed:
            return Columns(matrix, start, 1, width, count, height)
        return Columns(matrix, start, width, 1, height, count)

    @staticmethod
    def of_view(matrix: torch.Tensor) -> Columns:
        """A 2-D tensor as it is (any strides: a weight, a column slice, a transpose)."""
        return Columns(matrix, 0, matrix.stride(0), matrix.stride(1), *matrix.shape)

    def arguments(self) -> tuple:
        """The kernels' four arguments of this matrix (pointer, offset, strides)."""
        return self.matrix, self.start, self.row, self.column


ACCUMULATORS = {torch.float64: "float64"}
"""The kernels' accumulator dtype by operand dtype (float32 otherwise)."""


def accumulator(dtype: torch.dtype):
    """The ``tl`` dtype products of ``dtype`` operands accumulate in."""
    import triton.language as tl

    return getattr(tl, ACCUMULATORS.get(dtype, "float32"))


def block(size: int, smallest: int = 16, largest: int = 64) -> int:
    """A power-of-two tile edge covering ``size`` within ``[smallest, largest]`` (``tl.dot``
    needs 16 at least)."""
    return max(smallest, min(largest, next_power_of_2(size)))


def next_power_of_2(size: int) -> int:
    """The least power of two >= ``size`` (>= 1)."""
    return 1 << max(0, size - 1).bit_length()


MIX_TILE = 128
"""Elements of a half per program of ``mix_kernel`` (BLOCK_N)."""


def mix(
    out: Halves,
    first: tuple[Columns, Halves] | None,
    second: tuple[Columns, Halves] | None = None,
    accumulate: Halves | None = None,
    store: Halves | None = None,
    more: Halves | None = None,
) -> None:
    """``out = accumulate + more + A1 @ X1 + A2 @ X2`` for ``first = (A1, X1)``, ``second = (A2,
    X2)`` (either None: no such term; ``more``: a second sum to add), writing X2 to ``store`` when
    given; one launch of ``routing_kernels.mix_kernel``.  ``out`` may be ``accumulate`` itself
    (added in place)."""
    from lime_megatron.kernels.routing_kernels import mix_kernel

    if store is not None and second is None:
        raise ValueError("the stored operand is the second term's")
    if first is None and second is None:
        raise ValueError("a mix needs at least one term")
    (a1, x1), (a2, x2) = first or second, second or first  # an absent term's operands: K = 0, never read
    narrow_rows = out.count
    added, stored, further = accumulate or out, store or out, more or out
    batch = launch_batch(out, x1, x2, accumulate, store, more)
    grid = (ceil_div(out.positions * out.width, MIX_TILE), ceil_div(narrow_rows, block(narrow_rows)), 2)
    launch(
        mix_kernel,
        grid,
        *out.arguments(batch),
        *added.arguments(batch),
        *further.arguments(batch),
        *a1.arguments(),
        a1.count if first else 0,
        *x1.arguments(batch),
        *a2.arguments(),
        a2.count if second else 0,
        *x2.arguments(batch),
        *stored.arguments(batch),
        narrow_rows,
        out.positions,
        out.width,
        batch,
        HAS_ACC=accumulate is not None,
        HAS_MORE=more is not None,
        HAS_STORE=store is not None,
        ACC=accumulator(out.keys.dtype),
        UPCAST=not out.keys.is_cuda,
        BLOCK_R=block(narrow_rows),
        BLOCK_K=16,
        BLOCK_N=MIX_TILE,
    )


WEIGHT_GRAD_TILE = 64
"""Elements per step of ``weight_grad_kernel``'s loop over positions (BLOCK_N)."""


def weight_grad_splits(halves: Halves, tiles: int) -> int:
    """Splits of the positions for the weight gradient of ``tiles`` output tiles: about four
    programs per multiprocessor on a GPU, two splits in Triton's CPU interpreter (each program
    runs in Python there)."""
    if not halves.keys.is_cuda:
        return min(2, halves.positions)
    sms = torch.cuda.get_device_properties(halves.keys.device).multi_processor_count
    return max(1, min(halves.positions, 4 * sms // max(1, tiles)))


def weight_grad(
    out: torch.Tensor, grads: Halves, rows: Halves, column_start: int, deterministic: bool, splits: int
) -> None:
    """``out[..., column_start : column_start + rows.count] (+)= grads @ rows^T`` summed over both
    halves and every position: with ``deterministic`` ``out`` is ``[splits, M, width]`` (one slice
    per split, summed by the caller), else ``[M, width]`` added to atomically.  One launch."""
    from lime_megatron.kernels.routing_kernels import weight_grad_kernel

    block_m, block_c = block(grads.count), block(rows.count)
    grid = (splits, ceil_div(grads.count, block_m), ceil_div(rows.count, block_c))
    split_stride, row_stride, column_stride = out.stride() if deterministic else (0, *out.stride())
    batch = launch_batch(grads, rows)
    launch(
        weight_grad_kernel,
        grid,
        out,
        split_stride,
        row_stride,
        column_stride,
        column_start,
        *grads.arguments(batch),
        grads.count,
        *rows.arguments(batch),
        rows.count,
        rows.positions,
        rows.width,
        batch,
        ceil_div(rows.positions, splits),
        ATOMIC=not deterministic,
        ACC=accumulator(rows.keys.dtype),
        UPCAST=not rows.keys.is_cuda,
        BLOCK_M=block_m,
        BLOCK_C=block_c,
        BLOCK_N=WEIGHT_GRAD_TILE,
    )


def ceil_div(numerator: int, denominator: int) -> int:
    """``numerator / denominator`` rounded up (grid sizes)."""
    return -(-numerator // denominator)


def weight_grad_sums(
    grads: Halves, terms: list[tuple[int, Halves]], width: int, dtype: torch.dtype, deterministic: bool
) -> torch.Tensor:
    """``[M, width]`` in ``dtype``: ``grads @ rows^T`` of each ``(column_start, rows)`` of ``terms``
    at its columns, zero elsewhere: one launch per term into one result (``weight_grad``), plus one
    sum over the splits when ``deterministic``."""
    widest = max(rows.count for _, rows in terms)
    splits = weight_grad_splits(grads, ceil_div(grads.count, block(grads.count)) * ceil_div(widest, block(widest)))
    shape = (splits, grads.count, width) if deterministic else (grads.count, width)
    out = grads.keys.new_zeros(shape, dtype=dtype)
    for column_start, rows in terms:
        weight_grad(out, grads, rows, column_start, deterministic, splits)
    return out.sum(0) if deterministic else out
