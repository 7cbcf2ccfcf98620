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
rearranging copy and no view operator on the host.

``mix_kernel``: ``out = acc + more + A1 @ X1 + A2 @ X2`` ([R, K1] @ [K1, N] + [R, K2] @ [K2, N]), the
forward mix (Eq. 2), its rebuild and the row gradient (Eq. 2 transposed), with X2 optionally
written to ``store`` on the way (Eq. 1: a layer's own keys/values into the buffer; in backward
g_l into its dead rows).  Grid: (N tiles of a half, R tiles, 2 halves).

``weight_grad_kernel``: ``out[c, :, columns] += G @ X^T`` ([M, N] x [C, N]^T), the router-weight
gradient, accumulated in ``ACC`` (float32, float64 for float64 operands) over a split of the
positions per program.  ``ATOMIC``: programs add their sums into one ``[M, width]`` result
(one launch, summation order not fixed); else each split writes its own slice of
``[splits, M, width]``, summed after (deterministic).

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
def _elements(
    keys, values, value_offset, start, k_row, k_outer, k_inner, v_row, v_outer, v_inner,
    half, rows, outer, inner, element,
):  # fmt: skip
    """Pointers to the elements ``[rows, positions]`` (positions split as ``outer``/``inner``, each
    with its ``element``) of one operand's ``half``: the module docstring's address."""
    if half == 0:
        base, row, outer_stride, inner_stride = keys + start, k_row, k_outer, k_inner
    else:
        base, row, outer_stride, inner_stride = values + value_offset + start, v_row, v_outer, v_inner
    # 64-bit offsets: a deep model's buffer passes 2^31 elements (128 layers x 8 heads x 2M).
    columns = outer.to(tl.int64) * outer_stride + inner.to(tl.int64) * inner_stride + element
    return base + rows.to(tl.int64)[:, None] * row + columns[None, :]


@triton.jit
def mix_kernel(
    out_k, out_v, out_voff, out_start, out_kr, out_ko, out_ki, out_vr, out_vo, out_vi,
    acc_k, acc_v, acc_voff, acc_start, acc_kr, acc_ko, acc_ki, acc_vr, acc_vo, acc_vi,
    more_k, more_v, more_voff, more_start, more_kr, more_ko, more_ki, more_vr, more_vo, more_vi,
    a1, a1_start, a1_row, a1_col, K1,
    x1_k, x1_v, x1_voff, x1_start, x1_kr, x1_ko, x1_ki, x1_vr, x1_vo, x1_vi,
    a2, a2_start, a2_row, a2_col, K2,
    x2_k, x2_v, x2_voff, x2_start, x2_kr, x2_ko, x2_ki, x2_vr, x2_vo, x2_vi,
    st_k, st_v, st_voff, st_start, st_kr, st_ko, st_ki, st_vr, st_vo, st_vi,
    R, P, D, BATCH,
    HAS_ACC: tl.constexpr, HAS_MORE: tl.constexpr, HAS_STORE: tl.constexpr, ACC: tl.constexpr,
    UPCAST: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """One [BLOCK_R, BLOCK_N] tile of ``out = acc + A1 @ X1 + A2 @ X2`` in one half (module docstring)."""
    half = tl.program_id(2)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < P * D
    position, element = n // D, n % D
    outer, inner = position // BATCH, position % BATCH
    i = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    i_ok = i < R
    total = tl.zeros([BLOCK_R, BLOCK_N], dtype=ACC)
    for operand in tl.static_range(2):
        if operand == 0:
            a, a_start, a_row, a_col, K = a1, a1_start, a1_row, a1_col, K1
            x = (x1_k, x1_v, x1_voff, x1_start, x1_kr, x1_ko, x1_ki, x1_vr, x1_vo, x1_vi)
        else:
            a, a_start, a_row, a_col, K = a2, a2_start, a2_row, a2_col, K2
            x = (x2_k, x2_v, x2_voff, x2_start, x2_kr, x2_ko, x2_ki, x2_vr, x2_vo, x2_vi)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < K
            narrow_ok = i_ok[:, None] & k_ok[None, :]
            narrow = tl.load(a + a_start + i[:, None] * a_row + k[None, :] * a_col, mask=narrow_ok, other=0.0)
            wide_ok = k_ok[:, None] & n_ok[None, :]
            wide = tl.load(_elements(*x, half, k, outer, inner, element), mask=wide_ok, other=0.0)
            if HAS_STORE and operand == 1:
                stored = _elements(
                    st_k,
                    st_v,
                    st_voff,
                    st_start,
                    st_kr,
                    st_ko,
                    st_ki,
                    st_vr,
                    st_vo,
                    st_vi,
                    half,
                    k,
                    outer,
                    inner,
                    element,
                )
                tl.store(stored, wide, mask=wide_ok & (tl.program_id(1) == 0))
            narrow = narrow.to(wide.dtype)
            if UPCAST:
                narrow, wide = narrow.to(ACC), wide.to(ACC)
            total += tl.dot(narrow, wide, out_dtype=ACC, input_precision="ieee")
    out_ok = i_ok[:, None] & n_ok[None, :]
    if HAS_ACC:
        added = _elements(
            acc_k,
            acc_v,
            acc_voff,
            acc_start,
            acc_kr,
            acc_ko,
            acc_ki,
            acc_vr,
            acc_vo,
            acc_vi,
            half,
            i,
            outer,
            inner,
            element,
        )
        total += tl.load(added, mask=out_ok, other=0.0).to(ACC)
    if HAS_MORE:
        added = _elements(
            more_k, more_v, more_voff, more_start, more_kr, more_ko, more_ki, more_vr, more_vo, more_vi,
            half, i, outer, inner, element,
        )  # fmt: skip
        total += tl.load(added, mask=out_ok, other=0.0).to(ACC)
    written = _elements(
        out_k,
        out_v,
        out_voff,
        out_start,
        out_kr,
        out_ko,
        out_ki,
        out_vr,
        out_vo,
        out_vi,
        half,
        i,
        outer,
        inner,
        element,
    )
    tl.store(written, total.to(out_k.dtype.element_ty), mask=out_ok)


@triton.jit
def weight_grad_kernel(
    out, out_split, out_row, out_column, column_start,
    g_k, g_v, g_voff, g_start, g_kr, g_ko, g_ki, g_vr, g_vo, g_vi, M,
    x_k, x_v, x_voff, x_start, x_kr, x_ko, x_ki, x_vr, x_vo, x_vi, C,
    P, D, BATCH, positions_per_split,
    ATOMIC: tl.constexpr, ACC: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """``G @ X^T`` over program 0's split of the positions, both halves, into ``out`` at columns
    ``column_start + j`` (module docstring)."""
    split = tl.program_id(0)
    i = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    j = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    i_ok, j_ok = i < M, j < C
    first = split * positions_per_split * D
    stop = tl.minimum(first + positions_per_split * D, P * D)
    total = tl.zeros([BLOCK_M, BLOCK_C], dtype=ACC)
    for half in tl.static_range(2):
        for n0 in range(first, stop, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            n_ok = n < stop
            position, element = n // D, n % D
            outer, inner = position // BATCH, position % BATCH
            grad_at = _elements(
                g_k, g_v, g_voff, g_start, g_kr, g_ko, g_ki, g_vr, g_vo, g_vi, half, i, outer, inner, element
            )
            grad = tl.load(grad_at, mask=i_ok[:, None] & n_ok[None, :], other=0.0)
            rows_at = _elements(
                x_k, x_v, x_voff, x_start, x_kr, x_ko, x_ki, x_vr, x_vo, x_vi, half, j, outer, inner, element
            )
            rows = tl.load(rows_at, mask=j_ok[:, None] & n_ok[None, :], other=0.0)
            if UPCAST:
                grad, rows = grad.to(ACC), rows.to(ACC)
            total += tl.dot(grad, tl.trans(rows), out_dtype=ACC, input_precision="ieee")
    target = out + i[:, None] * out_row + (column_start + j[None, :]) * out_column
    if ATOMIC:
        tl.atomic_add(target, total, mask=i_ok[:, None] & j_ok[None, :])
    else:
        tl.store(target + split * out_split, total, mask=i_ok[:, None] & j_ok[None, :])
