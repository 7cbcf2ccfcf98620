"""Triton kernels of LIMe's routing products (docs/routing.md, "Fused routing kernels").

Every operand of a routing product is a set of rows of N = 2 * P * D elements: a keys half and a
values half of P positions (``s * b``, position p = ``s_p * BATCH + b_p``) of D elements (the head
dimension).  A kernel addresses element e of position p of row i of a half as

    base(half) + start + i * row + s_p * outer + b_p * inner + e    (base(values) = values + value_offset;
                                                                  each half its own three strides)

so one kernel reads buffer rows ``[k, N]`` (row N, outer BATCH * D, inner D, the values half
P * D further), attention's layout ``[s, b, heads, d]`` (row, outer, inner: the strides of heads,
s and b; the keys and the values two tensors), the strided keys/values megatron's QKV split hands
over and the gradients attention's backward returns in any order of s, b and heads, with no
rearranging copy and no view operator on the host.  Rows may come in groups (a routing block's
layers, ``[G, s, b, heads, d]``): row i is row ``i % group`` of group ``i // group``, which lies
``group_stride`` after the one before (``i * row`` above is then ``(i // group) * group_stride +
(i % group) * row``).  An operand travels as one tuple ``(keys, values, value_offset, start, keys'
row, outer, inner, values' row, outer, inner, group, group_stride)`` (``operands.Halves.arguments``).

``mix_kernel``: ``out = acc + more + A1 @ X1 + A2 @ X2`` ([R, K1] @ [K1, N] + [R, K2] @ [K2, N]), the
forward mix (Eq. 2), its rebuild and the row gradient (Eq. 2 transposed), with X2 optionally
written to ``store`` on the way (Eq. 1: a layer's own keys/values into the buffer).  Programs on
one axis: (N tiles of a half, R tiles, 2 halves); with ``WEIGHT_GRAD`` the weight gradient's
programs after them, which may write G over X's rows ``keep_first..`` once they have read them (a
layer's backward in one launch: g_l into its dead rows after dW_l has read them), or keep nothing
(two of a routing block's backward products in one launch).

``weight_grad_kernel``: ``out[c, :, columns] += G @ X^T`` ([M, N] x [C, N]^T), the router-weight
gradient, accumulated in ``ACC`` (float32, float64 for float64 operands) over a split of the
positions per program, placed as ``_placed`` says (``operands.Placement``: the columns of one
matrix, or a routing block's routers' gradients one after another, each row group its router's).
``ATOMIC``: programs add their sums into the target (one launch, summation order not fixed); else
each split writes its own slice of ``[splits, ...]``, summed after (deterministic).  Grid: (splits, M tiles, C tiles).

Products use ``tl.dot`` with ``input_precision="ieee"``: float32 operands are multiplied in
float32, never silently in TF32 (Triton's default on a GPU); bf16/fp16 operands accumulate in
float32.  The router columns ``A`` are cast to the rows' dtype first, as the torch path does.
``UPCAST`` (Triton's CPU interpreter only) multiplies in ``ACC`` instead: the interpreter's
``tl.dot`` multiplies bf16 operands as their uint16 storage.  Products of bf16 (or fp16) values
are exact in float32, so the upcast changes nothing but the order of the sums; what the CPU tests
cannot vouch for is the GPU's own dot (tensor cores, bf16 in, float32 accumulation).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _elements(operand, half, rows, outer, inner, element):
    """Pointers to the elements ``[rows, positions]`` (positions split as ``outer``/``inner``, each
    with its ``element``) of ``half`` of an ``operand``: the module docstring's address, the operand
    ``(keys, values, value_offset, start, keys' row, outer, inner, values' row, outer, inner, group,
    group_stride)``."""
    keys, values, value_offset, start, k_row, k_outer, k_inner, v_row, v_outer, v_inner, group, group_stride = operand
    if half == 0:
        base, row, outer_stride, inner_stride = keys + start, k_row, k_outer, k_inner
    else:
        base, row, outer_stride, inner_stride = values + value_offset + start, v_row, v_outer, v_inner
    # 64-bit offsets: a deep model's buffer passes 2^31 elements (128 layers x 8 heads x 2M); the
    # row's group and place in it in 32 bits (a 64-bit division is a long emulated sequence).
    columns = outer.to(tl.int64) * outer_stride + inner.to(tl.int64) * inner_stride + element
    grouped, within = (rows // group).to(tl.int64), (rows % group).to(tl.int64)
    return base + (grouped * group_stride + within * row)[:, None] + columns[None, :]


@triton.jit
def mix_kernel(
    out, acc, more, a1, x1, a2, x2, store, shape, weight, tiles,
    HAS_ACC: tl.constexpr, HAS_MORE: tl.constexpr, HAS_STORE: tl.constexpr, ACC: tl.constexpr,
    UPCAST: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
    WEIGHT_GRAD: tl.constexpr, ATOMIC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr,
    W_BLOCK_N: tl.constexpr, KEEP: tl.constexpr, WIDTH: tl.constexpr, W_WIDTH: tl.constexpr,
):  # fmt: skip
    """``out = acc + more + A1 @ X1 + A2 @ X2`` (``_mix_tile``; ``a1``/``a2``: ``(matrix, start,
    row, column, K)``, ``shape``: ``(R, P, BATCH)``, ``WIDTH`` = D) by the first ``mix_programs`` programs of
    ``tiles = (tiles_n, tiles_r, mix_programs, splits, tiles_m, keep_first)``; with
    ``WEIGHT_GRAD`` the rest run ``weight_grad_kernel``'s tiles of ``weight`` (its arguments),
    with ``KEEP`` keeping G over X's rows from ``keep_first`` on once read (module docstring)."""
    tiles_n, tiles_r, mix_programs, splits, tiles_m, keep_first = tiles
    program = tl.program_id(0)
    if program < mix_programs:
        tile_n, tile_r, half = program % tiles_n, program // tiles_n % tiles_r, program // (tiles_n * tiles_r)
        _mix_tile(
            tile_n, tile_r, half, out, acc, more, a1, x1, a2, x2, store, shape,
            HAS_ACC, HAS_MORE, HAS_STORE, ACC, UPCAST, BLOCK_R, BLOCK_K, BLOCK_N, WIDTH,
        )  # fmt: skip
    elif WEIGHT_GRAD:
        rest = program - mix_programs
        split, tile_m, tile_c = rest % splits, rest // splits % tiles_m, rest // (splits * tiles_m)
        _weight_grad_tile(
            split, tile_m, tile_c, weight, keep_first, ATOMIC, ACC, UPCAST, BLOCK_M, BLOCK_C, W_BLOCK_N, KEEP, W_WIDTH
        )


@triton.jit
def _mix_tile(
    tile_n, tile_r, half, out, acc, more, a1, x1, a2, x2, store, shape,
    HAS_ACC: tl.constexpr, HAS_MORE: tl.constexpr, HAS_STORE: tl.constexpr, ACC: tl.constexpr,
    UPCAST: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
    WIDTH: tl.constexpr,
):  # fmt: skip
    """Tile ``(tile_n, tile_r)`` [BLOCK_R, BLOCK_N] of ``out = acc + more + A1 @ X1 + A2 @ X2`` in
    one half (module docstring), X2 written to ``store`` by the programs of row tile 0."""
    R, P, BATCH = shape
    n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < P * WIDTH
    position, element = n // WIDTH, n % WIDTH
    outer, inner = position // BATCH, position % BATCH
    i = tile_r * BLOCK_R + tl.arange(0, BLOCK_R)
    i_ok = i < R
    total = tl.zeros([BLOCK_R, BLOCK_N], dtype=ACC)
    for operand in tl.static_range(2):
        if operand == 0:
            columns, x = a1, x1
        else:
            columns, x = a2, x2
        a, a_start, a_row, a_col, K = columns
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < K
            narrow_ok = i_ok[:, None] & k_ok[None, :]
            narrow = tl.load(a + a_start + i[:, None] * a_row + k[None, :] * a_col, mask=narrow_ok, other=0.0)
            wide_ok = k_ok[:, None] & n_ok[None, :]
            wide = tl.load(_elements(x, half, k, outer, inner, element), mask=wide_ok, other=0.0)
            if HAS_STORE and operand == 1:
                tl.store(_elements(store, half, k, outer, inner, element), wide, mask=wide_ok & (tile_r == 0))
            narrow = narrow.to(wide.dtype)
            if UPCAST:
                narrow, wide = narrow.to(ACC), wide.to(ACC)
            total += tl.dot(narrow, wide, out_dtype=ACC, input_precision="ieee")
    out_ok = i_ok[:, None] & n_ok[None, :]
    if HAS_ACC:
        total += tl.load(_elements(acc, half, i, outer, inner, element), mask=out_ok, other=0.0).to(ACC)
    if HAS_MORE:
        total += tl.load(_elements(more, half, i, outer, inner, element), mask=out_ok, other=0.0).to(ACC)
    tl.store(_elements(out, half, i, outer, inner, element), total.to(out[0].dtype.element_ty), mask=out_ok)


@triton.jit
def weight_grad_kernel(
    weight, ATOMIC: tl.constexpr, ACC: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, W_BLOCK_N: tl.constexpr, W_WIDTH: tl.constexpr,
):  # fmt: skip
    """``G @ X^T`` by ``_weight_grad_tile`` per program: ``weight`` = ``(target, G, M, X, C,
    positions)``, ``target`` ``(out, split stride, origin, group, width, widen, column start,
    shift)`` (``_placed``), ``positions`` ``(P, BATCH, positions per split)``, ``W_WIDTH`` = D
    (module docstring)."""
    tile = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    _weight_grad_tile(*tile, weight, 0, ATOMIC, ACC, UPCAST, BLOCK_M, BLOCK_C, W_BLOCK_N, False, W_WIDTH)


@triton.jit
def _weight_grad_tile(
    split, tile_m, tile_c, weight, keep_first, ATOMIC: tl.constexpr, ACC: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, W_BLOCK_N: tl.constexpr, KEEP: tl.constexpr,
    WIDTH: tl.constexpr,
):  # fmt: skip
    """Tile ``(tile_m, tile_c)`` of ``G @ X^T`` over ``split``'s positions, both halves, into the
    target (``weight_grad_kernel``'s ``weight``); with ``KEEP`` G's rows then written over X's
    rows ``keep_first..+M-1`` that this program read (the caller launches one M tile, so no other
    program reads them)."""
    target, g, M, x, C, positions = weight
    out, split_stride, origin, group, width, widen, column_start, shift = target
    P, BATCH, positions_per_split = positions
    i = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    j = tile_c * BLOCK_C + tl.arange(0, BLOCK_C)
    i_ok, j_ok = i < M, j < C
    first = split * positions_per_split * WIDTH
    stop = tl.minimum(first + positions_per_split * WIDTH, P * WIDTH)
    total = tl.zeros([BLOCK_M, BLOCK_C], dtype=ACC)
    for half in tl.static_range(2):
        for n0 in range(first, stop, W_BLOCK_N):
            n = n0 + tl.arange(0, W_BLOCK_N)
            n_ok = n < stop
            position, element = n // WIDTH, n % WIDTH
            outer, inner = position // BATCH, position % BATCH
            grad = tl.load(_elements(g, half, i, outer, inner, element), mask=i_ok[:, None] & n_ok[None, :], other=0.0)
            rows_at = _elements(x, half, j, outer, inner, element)
            rows = tl.load(rows_at, mask=j_ok[:, None] & n_ok[None, :], other=0.0)
            if KEEP:  # g_l into the rows just read (this program's alone): ``keep_first`` is l's first
                own = j - keep_first
                kept_ok = ((own >= 0) & (own < M) & j_ok)[:, None] & n_ok[None, :]
                kept = tl.load(_elements(g, half, own, outer, inner, element), mask=kept_ok, other=0.0)
                tl.store(rows_at, tl.where(kept_ok, kept, rows).to(rows.dtype), mask=kept_ok)
            if UPCAST:
                grad, rows = grad.to(ACC), rows.to(ACC)
            total += tl.dot(grad, tl.trans(rows), out_dtype=ACC, input_precision="ieee")
    sums, placed = _placed(out, i, j, origin, group, width, widen, column_start, shift)
    placed = placed & i_ok[:, None] & j_ok[None, :]
    if ATOMIC:
        tl.atomic_add(sums, total, mask=placed)
    else:
        tl.store(sums + split * split_stride, total, mask=placed)


@triton.jit
def _placed(out, i, j, origin, group, width, widen, column_start, shift):
    """(pointers, mask) of product element (i, j) in a target of consecutive matrices, ``group``
    rows each (module docstring): matrix q = i // group is ``[group, width + q * widen]`` from
    ``out + origin + group * (q * width + widen * q * (q - 1) / 2)``, the product's column j its
    column ``column_start + q * shift + j``, placed where that lies in the matrix."""
    q, h = i // group, i % group
    rows_width = width + q * widen
    column = column_start + q * shift
    matrix = origin + group * (q * width + widen * (q * (q - 1) // 2))
    offsets = (matrix + h * rows_width + column)[:, None] + j[None, :]
    placed = (column[:, None] + j[None, :] >= 0) & (column[:, None] + j[None, :] < rows_width[:, None])
    return out + offsets, placed
