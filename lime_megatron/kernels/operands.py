"""The operands of the routing kernels and the calls that launch them (``routing_kernels``).

A ``Halves`` names rows of keys|values where they lie, as the kernels address them (base tensors,
an element offset and three strides): buffer rows, attention's layout, the strided keys/values of
megatron's QKV split.  Building one dispatches no operator, so a product costs the host its launch
(and its output's allocation) whatever its operands' layouts.  ``Columns`` names a router matrix
``[R, K]`` the same way (a weight, a slice of it, a transposed slice of a ``RouterStack``).  A layer
builds about a dozen such records per pass, so they are slotted dataclasses, not frozen ones (whose
``__init__`` sets each field through ``object.__setattr__``: 2.5 us a ``Halves`` on the 2-core VM,
0.3 us slotted); nothing changes one after it is built.

``mix`` and ``weight_grad`` launch the kernels through ``launch``, which an observer may wrap
(``launches_observed``: ``testing.dispatched_operators`` counts a launch as one operator, and
keeps Triton's interpreter's own tensor work on a CPU out of the count; ``testing.kernel_launches``
times each launch and counts the bytes it moves).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Launch:
    """One kernel launch as ``launch`` makes it: the kernel, its grid, its arguments in order, its
    constants (``constexpr`` keywords) and its warps per program (None: Triton's default)."""

    kernel: Any
    grid: tuple[int, ...]
    args: tuple
    constants: dict
    warps: int | None = None

    @property
    def name(self) -> str:
        return self.kernel.__name__

    @property
    def device(self) -> torch.device:
        return _first_tensor(self.args).device

    def named_arguments(self) -> dict[str, Any]:
        """The arguments and constants by the kernel's parameter names."""
        names = inspect.signature(self.kernel.fn).parameters
        return dict(zip(names, self.args)) | self.constants


LaunchObserver = Callable[[Launch, Callable[[], None]], None]
"""``(the launch, run) -> None``: calls ``run()`` once."""

_OBSERVER: LaunchObserver | None = None


@contextlib.contextmanager
def launches_observed(observer: LaunchObserver) -> Iterator[None]:
    """Every kernel launch inside the ``with`` block goes through ``observer``; the observer in
    place before (one or none) is back afterwards, so observers nest."""
    global _OBSERVER
    previous, _OBSERVER = _OBSERVER, observer
    try:
        yield
    finally:
        _OBSERVER = previous


def current_observer() -> LaunchObserver | None:
    """The observer launches go through now (None: none)."""
    return _OBSERVER


def launch(kernel, grid: tuple[int, ...], args: tuple, constants: dict, warps: int | None = None) -> None:
    """``kernel[grid](*args, **constants)`` with ``num_warps=warps`` (None: Triton's default),
    through the observer when one is installed."""
    if not _first_tensor(args).is_cuda and not _interpreted():
        raise RuntimeError(
            "the Triton routing kernels run on CUDA tensors; on a CPU only in Triton's interpreter "
            "(TRITON_INTERPRET=1 set before triton is imported, as the tests do): use "
            "--lime-routing-kernel torch"
        )

    options = constants if warps is None else {**constants, "num_warps": warps}
    if _OBSERVER is None:
        kernel[grid](*args, **options)
    else:
        _OBSERVER(Launch(kernel, grid, args, constants, warps), lambda: kernel[grid](*args, **options))


@functools.cache
def routing_kernels():
    """The ``routing_kernels`` module, imported at the first launch: it imports Triton, which reads
    ``TRITON_INTERPRET`` once, at its import (the tests set it first)."""
    from lime_megatron.kernels import routing_kernels as kernels

    return kernels


@functools.cache
def _interpreted() -> bool:
    """Whether Triton runs in its CPU interpreter (``TRITON_INTERPRET=1``, which Triton reads once, at
    its import: read here at the first launch, after it); if so, one that can run the kernels."""
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if interpreted:
        import numpy
        import triton

        check_interpreter(triton.__version__, numpy.__version__)
    return interpreted


def check_interpreter(triton_version: str, numpy_version: str) -> None:
    """Refuse, naming the fix, Triton's interpreter before 3.7 beside numpy 2.4 or later: it takes a
    kernel's loop bound with ``int()`` of a one-element array, an error since numpy 2.4 (Triton 3.7
    squeezes the array first; measured with Triton 3.6, which torch 2.11 pins, and numpy 2.4.6)."""
    if _major_minor(triton_version) < (3, 7) and _major_minor(numpy_version) >= (2, 4):
        raise RuntimeError(
            f"Triton {triton_version}'s CPU interpreter cannot run the routing kernels beside numpy "
            f"{numpy_version} (loop bounds fail with 'only 0-dimensional arrays can be converted to Python "
            "scalars'): install numpy<2.4 or triton>=3.7"
        )


def _major_minor(version: str) -> tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


def _first_tensor(args: tuple) -> torch.Tensor:
    """The tensor of a launch's first operand (operands travel as tuples, their tensor first)."""
    first = args[0]
    while isinstance(first, tuple):
        first = first[0]
    return first


ROWS_WIDTH = 64
"""Elements per position where rows are read as rows (``Halves.of_rows`` without a width)."""


@dataclass(slots=True)
class Halves:
    """``count`` rows of keys|values: element e of position p = ``s_p * batch + b_p`` of row i of
    the keys half at ``keys + start + i * row + s_p * outer + b_p * inner + e`` with ``(row,
    outer, inner) = key_strides``, of the values half at ``values + value_offset + start + ...``
    with ``value_strides``; ``positions`` P of ``width`` D elements per half.  Rows come in groups
    of ``group`` (``of_groups``: a routing block's tensors, one per layer): row i is row ``i %
    group`` of group ``i // group``, which lies ``group_stride`` after the one before."""

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
    group: int = 1 << 30
    group_stride: int = 0

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
        keys, key_strides = _adjacent(keys)
        shape = keys.shape
        if len(shape) == 4:
            s, batch, heads, width = shape
            positions = s * batch
        else:
            positions, heads, width = shape
            batch = 1
        if values is None:
            value_offset = shape[0] // 2 * key_strides[1]  # the values' first position, after the keys'
            return Halves(keys, keys, value_offset, 0, key_strides, key_strides, heads, positions // 2, width, batch)
        values, value_strides = _adjacent(values)
        return Halves(keys, values, 0, 0, key_strides, value_strides, heads, positions, width, batch)

    @staticmethod
    def of_groups(keys: torch.Tensor, values: torch.Tensor | None = None) -> Halves:
        """Keys and values ``[G, s, b, heads, d]`` of equal strides, adjacent elements (a routing
        block's layers, one group each: ``G * heads`` rows); with ``values`` None, ``keys``
        ``[2 * G, s, b, heads, d]`` holds both halves, the values' groups after the keys'."""
        if keys.stride(-1) != 1 or (values is not None and values.stride() != keys.stride()):
            raise ValueError("grouped keys and values need adjacent elements and equal strides")
        groups = keys.shape[0] if values is not None else keys.shape[0] // 2
        _, s, b, heads, width = keys.shape
        strides = (keys.stride(3), keys.stride(1), keys.stride(2))
        value_offset = 0 if values is not None else groups * keys.stride(0)
        values = keys if values is None else values
        return Halves(
            keys, values, value_offset, 0, strides, strides, groups * heads, s * b, width, b, heads, keys.stride(0)
        )

    @staticmethod
    def of_rank_chunks(chunks: torch.Tensor, first: int, count: int) -> Halves:
        """Rows ``first..first+count-1`` of contiguous chunks ``[..., 2 * C, s, b, k, d]``, chunk
        c's keys at 2c and its values at 2c + 1 (a tensor-parallel rank's keys and values of its k
        heads in attention's layout, one chunk per rank, as a reduce-scatter takes them and an
        all-gather leaves them; C may count the ranks of several layers, and leading dimensions
        more): row i is head ``i % k`` of chunk ``i // k``; ``first`` a multiple of k."""
        *_, s, b, heads, width = chunks.shape
        if first % heads:
            raise ValueError(f"row {first} does not begin a chunk of {heads} heads")
        strides, half = (width, b * heads * width, heads * width), s * b * heads * width
        start = first // heads * 2 * half
        return Halves(chunks, chunks, half, start, strides, strides, count, s * b, width, b, heads, 2 * half)

    @property
    def bytes(self) -> int:
        """Bytes of the elements these rows address (both halves)."""
        return 2 * self.count * self.positions * self.width * self.keys.element_size()

    def arguments(self, batch: int) -> tuple:
        """The kernels' operand tuple of twelve pointers, offsets and strides, its positions split
        as ``s_p * batch + b_p`` (its own split, or any where one stride steps through all its
        positions)."""
        keys, values = self.key_strides, self.value_strides
        if batch != self.batch:
            keys, values = self._in_batch(batch)
        return (self.keys, self.values, self.value_offset, self.start, *keys, *values, self.group, self.group_stride)

    def _in_batch(self, batch: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
        """The keys' and the values' strides with positions split as ``s_p * batch + b_p``."""
        if not self.collapsible():
            raise ValueError(f"operands split positions by {self.batch} and by {batch}")
        (key_row, key_outer, key_inner), (value_row, value_outer, value_inner) = self.key_strides, self.value_strides
        key_step, value_step = (key_inner, value_inner) if self.batch > 1 else (key_outer, value_outer)
        return (key_row, batch * key_step, key_step), (value_row, batch * value_step, value_step)

    def collapsible(self) -> bool:
        """Whether one stride steps through all positions of each half (any split serves)."""
        (_, key_outer, key_inner), (_, value_outer, value_inner) = self.key_strides, self.value_strides
        return self.batch == 1 or (key_outer == self.batch * key_inner and value_outer == self.batch * value_inner)


def _adjacent(heads: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """``heads`` ``[s, b, heads, d]`` or ``[positions, heads, d]`` (made contiguous unless its
    elements are adjacent) and its (row, outer, inner) strides: (heads, s, b), or (heads,
    positions, 0); one ``stride()`` call where nothing is copied (a layer asks for about five)."""
    strides = heads.stride()
    if strides[-1] != 1:
        heads = heads.contiguous()
        strides = heads.stride()
    if len(strides) == 4:
        return heads, (strides[2], strides[0], strides[1])
    return heads, (strides[1], strides[0], 0)


def launch_batch(*operands: Halves | None) -> int:
    """The position split a launch over ``operands`` uses: that of any operand needing its own."""
    for halves in operands:
        if halves is not None and halves.batch != 1 and not halves.collapsible():
            return halves.batch
    return 1


@dataclass(slots=True)
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


@functools.cache
def accumulator(dtype: torch.dtype):
    """The ``tl`` dtype products of ``dtype`` operands accumulate in."""
    import triton.language as tl

    return getattr(tl, ACCUMULATORS.get(dtype, "float32"))


@functools.cache
def block(size: int, smallest: int = 16, largest: int = 64) -> int:
    """A power-of-two tile edge covering ``size`` within ``[smallest, largest]`` (``tl.dot``
    needs 16 at least)."""
    return max(smallest, min(largest, next_power_of_2(size)))


def next_power_of_2(size: int) -> int:
    """The least power of two >= ``size`` (>= 1)."""
    return 1 << max(0, size - 1).bit_length()


@dataclass(frozen=True)
class MixTiles:
    """How ``mix_kernel`` tiles a mix: at most ``rows`` output rows per tile (BLOCK_R), each row
    tile reading every source row once; as many elements of a half (BLOCK_N) as keep the tile
    within ``area`` float32 sums in registers, at most ``elements``; ``warps`` warps per program
    (Triton's ``num_warps``: the threads sharing a tile's loads and sums); and how far the
    router-weight gradient's programs step through the positions (``weight_grad_step``)."""

    rows: int = 128
    """A routing block of up to 16 layers of 8 kv heads reads each source row once."""
    area: int = 64 * 128
    elements: int = 128
    weight_grad_elements: int = 512
    """``elements`` of a mix launched with weight-gradient programs (a backward's).  On an H200 at
    1B GQA-8 in bf16 (the launch profiles of the 8765886 and ce64950 sessions, which timed the two
    tiles in either order), such launches took 17-21% less time with 512 than with 128 (0.88
    against 1.06-1.08 ms and 0.60 against 0.74-0.75 ms a step), at 1B MHA 1% less.  The forward's
    launches keep 128: the profile cannot compare them yet (its second step timed the storing
    launches 2.3x slower under unchanged tiles as well; BENCHMARKS.md)."""
    warps: int = 4
    """Triton's default, named so that a launch profile can compare others."""
    weight_grad_step: int = 64
    """Elements of a half per step of the router-weight gradient's loop over positions (its
    programs' W_BLOCK_N, in a mix's launch or its own)."""

    def tile(self, count: int, weight_grad: bool = False) -> tuple[int, int]:
        """(BLOCK_R, BLOCK_N) of a mix into ``count`` output rows (``weight_grad``: in a launch with
        the weight gradient's programs)."""
        rows = block(count, 16, self.rows)
        return rows, min(self.weight_grad_elements if weight_grad else self.elements, self.area // rows)


@functools.cache
def _tile(tiles: MixTiles, count: int, weight_grad: bool) -> tuple[int, int]:
    """``tiles.tile(count, weight_grad)``, kept: a layer asks for two or three each pass."""
    return tiles.tile(count, weight_grad)


MIX_TILES = MixTiles()
"""The tiles mixes take on a GPU (``use_mix_tiles`` changes them: the launch profile compares)."""
INTERPRETED_TILES = MixTiles(area=128 * 1024, elements=1024, weight_grad_elements=1024, weight_grad_step=1024)
"""The tiles mixes take in Triton's CPU interpreter, which runs a launch's programs one after
another and each tile operation as a numpy call behind Triton's own Python, so that a launch costs
about its programs times their loop steps: up to 1024 elements of a half per program and per
weight-gradient step, where ``MIX_TILES`` takes 128 or 512, and 64 (docs/routing.md, "Tiles in
Triton's interpreter").  The kernel tests run ``MIX_TILES``, whose ragged tails they check."""
_chosen: MixTiles | None = None


def mix_tiles() -> MixTiles:
    """The tiles mixes take now: ``use_mix_tiles``'s, else ``MIX_TILES`` (``INTERPRETED_TILES`` in
    Triton's interpreter)."""
    if _chosen is not None:
        return _chosen
    return INTERPRETED_TILES if _interpreted() else MIX_TILES


@contextlib.contextmanager
def use_mix_tiles(tiles: MixTiles) -> Iterator[None]:
    """Mixes launched within the block take ``tiles``: the same products (tiles split the output
    and the elements, never a sum), another division of the work among programs."""
    global _chosen
    before, _chosen = _chosen, tiles
    try:
        yield
    finally:
        _chosen = before


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
    tiles, arguments, constants = _mix_launch(out, first, second, accumulate, store, more)
    operand = arguments[0]  # out's: a placeholder for the weight gradient's operands, never read
    unused = ((out.keys, 0, 0, 1, 0, 0, 0, 0), operand, 0, operand, 0, (0, 1, 0))
    constants.update(_NO_WEIGHT_GRAD)
    launch(
        routing_kernels().mix_kernel, (tiles[2],), (*arguments, unused, (*tiles, 1, 1, 0)), constants, mix_tiles().warps
    )


_NO_WEIGHT_GRAD = dict(WEIGHT_GRAD=False, ATOMIC=False, BLOCK_M=16, BLOCK_C=16, W_BLOCK_N=16, KEEP=False, W_WIDTH=1)
"""``mix_kernel``'s weight-gradient constants where it launches no weight-gradient programs."""


def mix_and_weight_grad(
    out: Halves,
    first: tuple[Columns, Halves] | None,
    second: tuple[Columns, Halves],
    weight_out: torch.Tensor,
    rows: Halves,
    column_start: int | Placement,
    own_row: int | None,
    deterministic: bool,
    splits: int,
    accumulate: Halves | None = None,
    more: Halves | None = None,
) -> None:
    """``mix(out, first, second, accumulate, more=more)`` and ``weight_grad(weight_out, X2, rows,
    column_start, deterministic, splits)`` in one launch of ``routing_kernels.mix_kernel``, X2 (the
    incoming gradient) then written over ``rows``' rows ``own_row..own_row + X2.count - 1``, which
    only the weight gradient reads: a layer's backward (``fused_routing``; ``own_row`` None: X2
    is kept elsewhere, nothing written).  Where X2 is written its rows must fit one tile
    (``fits_one_tile``), so that one program alone reads each row it overwrites."""
    grads = second[1]
    if own_row is not None and not fits_one_tile(grads):
        raise ValueError(f"the fused backward reads {grads.count} gradient rows: more than one tile")
    mixed = _mix_launch(out, first, second, accumulate, None, more, weight_grad=True)
    _launch_both(mixed, _weight_grad_launch(weight_out, grads, rows, column_start, deterministic, splits), own_row)


def mix_beside_weight_grad(
    out: Halves,
    first: tuple[Columns, Halves],
    weight_out: torch.Tensor,
    grads: Halves,
    rows: Halves,
    column_start: int | Placement,
    deterministic: bool,
    splits: int,
) -> None:
    """``mix(out, first)`` and ``weight_grad(weight_out, grads, rows, column_start, deterministic,
    splits)`` in one launch of ``routing_kernels.mix_kernel``, neither writing what the other
    reads: two of a routing block's backward products (``fused_blocks``)."""
    mixed = _mix_launch(out, first, None, None, None, None, weight_grad=True)
    _launch_both(mixed, _weight_grad_launch(weight_out, grads, rows, column_start, deterministic, splits), None)


def _launch_both(mixed: tuple[tuple[int, int, int], tuple, dict], weighed: tuple, keep_first: int | None) -> None:
    """One ``mix_kernel`` launch of a mix (``_mix_launch``'s ``mixed``) and a weight
    gradient (``_weight_grad_launch``'s ``weighed``) whose programs keep its G over its rows from
    ``keep_first`` on (None: keep nothing)."""
    (tiles, arguments, constants), (grid, weight_arguments, weight_constants) = mixed, weighed
    if (weight_constants.pop("ACC"), weight_constants.pop("UPCAST")) != (constants["ACC"], constants["UPCAST"]):
        raise ValueError("the fused backward's rows and gradients differ in dtype or device")
    constants.update(weight_constants, WEIGHT_GRAD=True, KEEP=keep_first is not None)
    programs = (tiles[2] + grid[0] * grid[1] * grid[2],)
    arguments = (*arguments, weight_arguments, (*tiles, *grid[:2], keep_first or 0))
    launch(routing_kernels().mix_kernel, programs, arguments, constants, mix_tiles().warps)


def fits_one_tile(grads: Halves) -> bool:
    """Whether the weight gradient of ``grads`` runs one tile of its rows (``block``'s largest)."""
    return grads.count <= block(grads.count)


def _mix_launch(
    out: Halves,
    first: tuple[Columns, Halves] | None,
    second: tuple[Columns, Halves] | None,
    accumulate: Halves | None,
    store: Halves | None,
    more: Halves | None,
    weight_grad: bool = False,
) -> tuple[tuple[int, int, int], tuple, dict]:
    """(tiles, arguments, constants) of ``mix``'s share of a ``mix_kernel`` launch (``weight_grad``:
    beside the weight gradient's programs, ``MixTiles.tile``): ``tiles`` its tiles of a half's
    elements, of the output rows, and its programs (both halves); its operands up to ``shape`` (the
    weight gradient's and ``tiles`` argument not included)."""
    if store is not None and second is None:
        raise ValueError("the stored operand is the second term's")
    if first is None and second is None:
        raise ValueError("a mix needs at least one term")
    (a1, x1), (a2, x2) = first or second, second or first  # an absent term's operands: K = 0, never read
    added, stored, further = accumulate or out, store or out, more or out
    batch = launch_batch(out, x1, x2, accumulate, store, more)
    block_r, block_n = _tile(mix_tiles(), out.count, weight_grad)
    arguments = (
        out.arguments(batch),
        added.arguments(batch),
        further.arguments(batch),
        (*a1.arguments(), a1.count if first else 0),
        x1.arguments(batch),
        (*a2.arguments(), a2.count if second else 0),
        x2.arguments(batch),
        stored.arguments(batch),
        (out.count, out.positions, batch),
    )
    constants = dict(
        HAS_ACC=accumulate is not None,
        HAS_MORE=more is not None,
        HAS_STORE=store is not None,
        ACC=accumulator(out.keys.dtype),
        UPCAST=not out.keys.is_cuda,
        BLOCK_R=block_r,
        BLOCK_K=16,
        BLOCK_N=block_n,
        WIDTH=out.width,
    )
    elements, rows = -(-out.positions * out.width // block_n), -(-out.count // block_r)  # tiles, rounded up
    return (elements, rows, 2 * elements * rows), arguments, constants


def weight_grad_splits(halves: Halves, tiles: int) -> int:
    """Splits of the positions for the weight gradient of ``tiles`` output tiles: about four
    programs per multiprocessor on a GPU, two splits in Triton's CPU interpreter (each program
    runs in Python there)."""
    if not halves.keys.is_cuda:
        return min(2, halves.positions)
    return max(1, min(halves.positions, 4 * multiprocessors(halves.keys.device) // max(1, tiles)))


@functools.cache
def multiprocessors(device: torch.device) -> int:
    """The streaming multiprocessors of the CUDA ``device``."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def weight_grad(
    out: torch.Tensor, grads: Halves, rows: Halves, column_start: int | Placement, deterministic: bool, splits: int
) -> None:
    """``out[..., column_start : column_start + rows.count] (+)= grads @ rows^T`` summed over both
    halves and every position (or placed as a ``Placement`` says): with ``deterministic`` ``out``
    is ``[splits, ...]`` (one slice per split, summed by the caller), else added to atomically.
    One launch."""
    grid, arguments, constants = _weight_grad_launch(out, grads, rows, column_start, deterministic, splits)
    launch(routing_kernels().weight_grad_kernel, grid, (arguments,), constants)


@dataclass(slots=True)
class Placement:
    """Where a router-weight gradient ``[M, C]`` lands in its float32 target, whose elements are
    adjacent (``routing_kernels._placed``): its rows in groups of ``group``, group q the matrix
    ``[group, width + q * widen]`` after those of the groups before it (from element ``origin``),
    the product's column j at column ``column_start + q * shift + j`` of it, dropped where that
    lies outside.  One group: the columns ``column_start..`` of a ``[M, width]`` matrix; several:
    a routing block's routers, whose gradients lie one after another (``fused_blocks``)."""

    column_start: int
    width: int
    origin: int = 0
    group: int = 1 << 30
    widen: int = 0
    shift: int = 0

    @staticmethod
    def of(out: torch.Tensor, column_start: int | Placement) -> Placement:
        """``column_start`` as the columns from there of the matrices ``out`` ``[..., M, width]``."""
        if out.stride(-1) != 1:
            raise ValueError("a weight gradient's target needs adjacent elements")
        return column_start if isinstance(column_start, Placement) else Placement(column_start, out.stride(-2))

    def arguments(self) -> tuple[int, ...]:
        """The target's six integers after its pointer and split stride (``_placed``)."""
        return self.origin, self.group, self.width, self.widen, self.column_start, self.shift


def _weight_grad_launch(
    out: torch.Tensor, grads: Halves, rows: Halves, column_start: int | Placement, deterministic: bool, splits: int
) -> tuple[tuple[int, int, int], tuple, dict]:
    """(grid, ``weight_grad_kernel``'s ``weight`` argument, constants) of ``weight_grad``'s launch."""
    block_m, block_c = block(grads.count), block(rows.count)
    grid = (splits, ceil_div(grads.count, block_m), ceil_div(rows.count, block_c))
    placement = Placement.of(out, column_start)
    batch = launch_batch(grads, rows)
    arguments = (
        (out, out.stride(0) if deterministic else 0, *placement.arguments()),
        grads.arguments(batch),
        grads.count,
        rows.arguments(batch),
        rows.count,
        (rows.positions, batch, ceil_div(rows.positions, splits)),
    )
    constants = dict(
        ATOMIC=not deterministic,
        ACC=accumulator(rows.keys.dtype),
        UPCAST=not rows.keys.is_cuda,
        BLOCK_M=block_m,
        BLOCK_C=block_c,
        W_BLOCK_N=mix_tiles().weight_grad_step,
        W_WIDTH=rows.width,
    )
    return grid, arguments, constants


def ceil_div(numerator: int, denominator: int) -> int:
    """``numerator / denominator`` rounded up (grid sizes)."""
    return -(-numerator // denominator)


def weight_grad_sums(
    grads: Halves, terms: list[tuple[int, Halves]], width: int, dtype: torch.dtype, deterministic: bool
) -> torch.Tensor:
    """``[M, width]`` in ``dtype``: ``grads @ rows^T`` of each ``(column_start, rows)`` of ``terms``
    at its columns, zero elsewhere: one launch per term into one result (``weight_grad``), plus one
    sum over the splits when ``deterministic``."""
    out, splits = weight_grad_output(grads, max(rows.count for _, rows in terms), width, dtype, deterministic)
    for column_start, rows in terms:
        weight_grad(out, grads, rows, column_start, deterministic, splits)
    return out.sum(0) if deterministic else out


def weight_grad_output(
    grads: Halves, widest: int, width: int, dtype: torch.dtype, deterministic: bool
) -> tuple[torch.Tensor, int]:
    """(zeros ``[M, width]``, or ``[splits, M, width]`` when ``deterministic``; the position
    splits) for weight-gradient products of ``grads`` over at most ``widest`` rows each
    (``weight_grad_sums``)."""
    splits = weight_grad_splits(grads, ceil_div(grads.count, block(grads.count)) * ceil_div(widest, block(widest)))
    shape = (splits, grads.count, width) if deterministic else (grads.count, width)
    return grads.keys.new_zeros(shape, dtype=dtype), splits
