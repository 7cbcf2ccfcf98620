"""The Triton routing kernels (Triton's CPU interpreter) against torch, operand by operand: random
shapes with ragged tails (positions, heads and sources not multiples of the tiles), every dtype,
strided operands as megatron and attention hand them over, accumulation, the store on the way,
the router-weight gradient both ways (atomic and per-split sums)."""

from __future__ import annotations

import pytest
import torch

from lime_megatron.kernels import operands
from lime_megatron.kernels.operands import (
    INTERPRETED_TILES,
    MIX_TILES,
    Columns,
    Halves,
    MixTiles,
    Placement,
    launches_observed,
    mix,
    mix_and_weight_grad,
    mix_beside_weight_grad,
    use_mix_tiles,
    weight_grad,
    weight_grad_sums,
)


@pytest.fixture(autouse=True)
def gpu_tiles():
    """Every mix here takes the GPU's tiles (``MIX_TILES``, whose ragged tails these shapes reach),
    not the interpreter's (``INTERPRETED_TILES``: one tile a half)."""
    with use_mix_tiles(MIX_TILES):
        yield


TOLERANCE = {torch.float64: 1e-12, torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
"""Relative error allowed against torch: summation order, and one rounding of the output."""

SHAPES = [  # (s, b, heads, d, source rows)
    (3, 2, 3, 8, 5),  # ragged everywhere: 48 positions x elements per half, 3 heads, 5 sources
    (17, 1, 8, 16, 24),  # more than one tile of positions, K over one BLOCK_K
    (5, 3, 2, 4, 1),
]


def as_rows(keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``[s, b, h, d]`` keys and values -> rows ``[h, 2*s*b*d]`` (the reference layout)."""
    return torch.stack((keys.permute(2, 0, 1, 3), values.permute(2, 0, 1, 3)), dim=1).reshape(keys.shape[2], -1)


def relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected.double()).norm() / expected.double().norm()).item()


def strided_keys_values(s, b, h, d, dtype):
    """Keys and values as megatron's QKV split hands them over: views of one ``[s, b, h, 3, d]``."""
    mixed = torch.randn(s, b, h, 3, d, dtype=dtype)
    return mixed[:, :, :, 1], mixed[:, :, :, 2]


@pytest.mark.parametrize("dtype", list(TOLERANCE))
@pytest.mark.parametrize("shape", SHAPES)
def test_store_and_mix_equals_torch(shape, dtype):
    """``out = acc + W1 @ rows + W2 @ own`` in attention's layout, own written to its rows."""
    torch.manual_seed(sum(shape))
    s, b, h, d, sources = shape
    weight_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    rows = torch.randn(sources, 2 * s * b * d, dtype=dtype)
    weight = torch.randn(h, sources + h, dtype=weight_dtype)
    key, value = strided_keys_values(s, b, h, d, dtype)
    earlier = torch.randn(s, b, h, d, dtype=dtype), torch.randn(s, b, h, d, dtype=dtype)
    stored = torch.zeros(h, 2 * s * b * d, dtype=dtype)
    keys, values = torch.empty(s, b, h, d, dtype=dtype), torch.empty(s, b, h, d, dtype=dtype)
    first = (Columns.of(weight, slice(0, h), slice(0, sources)), Halves.of_rows(rows, 0, sources, d))
    own = (Columns.of(weight, slice(0, h), slice(sources, sources + h)), Halves.of_heads(key, value))
    mix(Halves.of_heads(keys, values), first, own, Halves.of_heads(*earlier), Halves.of_rows(stored, 0, h, d))
    expected = weight.to(dtype).double() @ torch.cat([rows, as_rows(key, value)]).double() + as_rows(*earlier).double()
    assert torch.equal(stored, as_rows(key, value))
    assert relative(as_rows(keys, values), expected) <= TOLERANCE[dtype]


@pytest.mark.parametrize(
    "tiles",
    [MixTiles(rows=16), MixTiles(elements=512), MixTiles(rows=16, area=16 * 64), MixTiles(warps=8), INTERPRETED_TILES],
    ids=str,
)
def test_any_tiles_give_the_same_mix(tiles):
    """Tiles divide the output rows and the elements among programs, never a sum across them:
    several row tiles (the store by the first's programs alone), wide and narrow element tiles,
    ragged tails, all equal to the default tiles' result up to float32 rounding (a tile's dot of
    16 products may sum them in another order)."""
    torch.manual_seed(5)
    s, b, h, d, sources = 5, 2, 40, 8, 7
    rows = torch.randn(sources, 2 * s * b * d)
    weight = torch.randn(h, sources + h)
    key, value = strided_keys_values(s, b, h, d, torch.float32)
    first = (Columns.of(weight, slice(0, h), slice(0, sources)), Halves.of_rows(rows, 0, sources, d))
    own = (Columns.of(weight, slice(0, h), slice(sources, sources + h)), Halves.of_heads(key, value))
    results = []
    for chosen in (MixTiles(), tiles):
        keys, values = torch.empty(s, b, h, d), torch.empty(s, b, h, d)
        stored = torch.zeros(h, 2 * s * b * d)
        with use_mix_tiles(chosen):
            mix(Halves.of_heads(keys, values), first, own, store=Halves.of_rows(stored, 0, h, d))
        results.append((as_rows(keys, values), stored))
    assert torch.equal(results[1][1], as_rows(key, value))
    assert relative(results[1][0], results[0][0]) <= 1e-6


def test_the_mixes_launch_with_their_tiles_warps_and_elements():
    """A mix, and a mix beside a weight gradient, launch with the tiles' warps (``num_warps``):
    Triton's default 4 unless a launch profile asks for others; the mix beside the weight gradient
    with its own element tiles (``MixTiles.weight_grad_elements``)."""
    h, d, sources = 2, 8, 3
    rows, weight = torch.randn(sources, 2 * 4 * d), torch.randn(h, sources)
    first = (Columns.of(weight, slice(0, h), slice(0, sources)), Halves.of_rows(rows, 0, sources, d))
    launched = []
    with launches_observed(lambda launch, run: launched.append((launch.warps, launch.constants["BLOCK_N"]))):
        for tiles in (MixTiles(), MixTiles(warps=8, elements=64, weight_grad_elements=32)):
            with use_mix_tiles(tiles):
                out = Halves.of_rows(torch.empty(h, 2 * 4 * d), 0, h, d)
                mix(out, first)
                grads = Halves.of_rows(torch.randn(h, 2 * 4 * d), 0, h, d)
                mix_beside_weight_grad(out, first, torch.zeros(h, sources), grads, first[1], 0, False, 1)
    assert launched == [(4, 128), (4, 512), (8, 64), (8, 32)]


def test_the_interpreter_takes_its_own_tiles(monkeypatch):
    """Unless a launch profile chooses, mixes take ``INTERPRETED_TILES`` in Triton's interpreter
    (every test runs in it) and ``MIX_TILES`` where the kernels compile."""
    monkeypatch.setattr(operands, "_chosen", None)
    assert operands.mix_tiles() is INTERPRETED_TILES
    monkeypatch.setattr(operands, "_interpreted", lambda: False)
    assert operands.mix_tiles() is MIX_TILES
    with use_mix_tiles(INTERPRETED_TILES):
        assert operands.mix_tiles() is INTERPRETED_TILES


@pytest.mark.parametrize(
    "triton_version, numpy_version, refused",
    [("3.6.0", "2.4.6", True), ("3.6.0", "2.5.5", True), ("3.6.0", "2.3.5", False), ("3.7.1", "2.5.5", False)],
)
def test_an_interpreter_that_cannot_run_the_kernels_is_refused_by_name(triton_version, numpy_version, refused):
    """Triton 3.6's interpreter fails the kernels' loop bounds beside numpy 2.4 and later (found
    rehearsing the GPU session on the image's torch 2.11): one message naming both versions and the
    fix, not an ``InterpreterError`` from inside a kernel."""
    if refused:
        with pytest.raises(RuntimeError, match=f"Triton {triton_version}.* numpy {numpy_version}.*numpy<2.4"):
            operands.check_interpreter(triton_version, numpy_version)
    else:
        operands.check_interpreter(triton_version, numpy_version)


def test_launch_observers_nest_and_the_outer_one_comes_back():
    """An observer installed inside another's ``with`` block takes the launches until its block
    ends, an exception included; then the outer one does again, and after it none."""
    h, d, sources = 2, 8, 3
    weight, rows = torch.randn(h, sources), torch.randn(sources, 2 * 4 * d)
    first = (Columns.of(weight, slice(0, h), slice(0, sources)), Halves.of_rows(rows, 0, sources, d))
    seen = []

    def launch_once():
        mix(Halves.of_rows(torch.empty(h, 2 * 4 * d), 0, h, d), first)

    with launches_observed(lambda launch, run: seen.append("outer")):
        launch_once()
        with pytest.raises(ValueError), launches_observed(lambda launch, run: seen.append("inner")):
            launch_once()
            raise ValueError
        launch_once()
    assert seen == ["outer", "inner", "outer"] and operands._OBSERVER is None


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_row_gradient_with_transposed_columns_and_permuted_gradients(dtype):
    """The row gradient's shape of product: a transposed slice of a router stack over kept rows,
    plus the incoming gradient in the layout attention's backward returns (b, h, s, d in memory)."""
    torch.manual_seed(0)
    s, b, h, d, consumers = 7, 2, 3, 8, 4
    stack = torch.randn(consumers * h + h, 5 * h, dtype=dtype)
    kept = torch.randn(consumers * h, 2 * s * b * d, dtype=dtype)
    grads = [torch.randn(b, h, s, d, dtype=dtype).permute(2, 0, 1, 3) for _ in range(2)]
    out = torch.empty(2 * s * b, h, d, dtype=dtype)
    first = (
        Columns.of(stack, slice(h, h + consumers * h), slice(2 * h, 3 * h), transposed=True),
        Halves.of_rows(kept, 0, consumers * h, d),
    )
    own = (Columns.of(stack, slice(0, h), slice(2 * h, 3 * h), transposed=True), Halves.of_heads(*grads))
    mix(Halves.of_heads(out), first, own)
    columns = stack[:, 2 * h : 3 * h].double()
    expected = columns[h:].t() @ kept.double() + columns[:h].t() @ as_rows(*grads).double()
    got = as_rows(*out.view(2, s, b, h, d).unbind(0))
    assert relative(got, expected) <= TOLERANCE[dtype]


@pytest.mark.parametrize("deterministic", [True, False], ids=["per-split sums", "atomic"])
@pytest.mark.parametrize("dtype", list(TOLERANCE))
@pytest.mark.parametrize("shape", SHAPES)
def test_weight_gradient_equals_torch(shape, dtype, deterministic):
    """dW = g @ rows^T over two row blocks placed at their columns, zero between them, in float32
    (float64 for float64 rows), from strided gradients."""
    torch.manual_seed(sum(shape) + 1)
    s, b, h, d, sources = shape
    grads = strided_keys_values(s, b, h, d, dtype)
    rows = torch.randn(sources + h, 2 * s * b * d, dtype=dtype)
    accumulate = torch.float64 if dtype == torch.float64 else torch.float32
    width = sources + h + 2  # two columns no block writes
    terms = [(0, Halves.of_rows(rows, 0, sources, d)), (sources + 2, Halves.of_rows(rows, sources, h, d))]
    got = weight_grad_sums(Halves.of_heads(*grads), terms, width, accumulate, deterministic)
    product = as_rows(*grads).double() @ rows.double().t()
    expected = torch.cat([product[:, :sources], torch.zeros(h, 2, dtype=torch.float64), product[:, sources:]], dim=1)
    assert got.dtype == accumulate and got.shape == (h, width)
    assert torch.equal(got[:, sources : sources + 2], torch.zeros(h, 2, dtype=accumulate))
    assert relative(got, expected) <= (1e-12 if dtype == torch.float64 else 1e-5)


@pytest.mark.parametrize("tiles", [MIX_TILES, INTERPRETED_TILES], ids=["a GPU's tiles", "the interpreter's"])
@pytest.mark.parametrize("deterministic", [True, False], ids=["per-split sums", "atomic"])
@pytest.mark.parametrize("dtype", list(TOLERANCE))
@pytest.mark.parametrize("shape", SHAPES)
def test_backward_in_one_launch(shape, dtype, deterministic, tiles):
    """A layer's backward as one launch: the row gradient ``out = acc + more + W_M^T @ kept +
    W_l^T @ g`` and the weight gradient ``g @ rows^T``, g then kept in the layer's own rows, which
    the weight gradient read first; the other rows untouched.  Under a GPU's tiles (several element
    tiles and weight-gradient steps per half) and the interpreter's (one of each)."""
    torch.manual_seed(sum(shape) + 2)
    s, b, h, d, sources = shape
    grads = [torch.randn(b, h, s, d, dtype=dtype).permute(2, 0, 1, 3) for _ in range(2)]  # attention's
    rows = torch.randn(sources + h, 2 * s * b * d, dtype=dtype)  # sources, then the layer's own rows
    before = rows.clone()
    stack = torch.randn(2 * h, sources + h, dtype=dtype)
    kept = torch.randn(h, 2 * s * b * d, dtype=dtype)
    later, downstream = (torch.randn(s, b, h, d, dtype=dtype) for _ in range(2))
    accumulate = torch.float64 if dtype == torch.float64 else torch.float32
    splits = 2
    weight = torch.zeros((splits, h, sources + h) if deterministic else (h, sources + h), dtype=accumulate)
    keys, values = torch.empty(s, b, h, d, dtype=dtype), torch.empty(s, b, h, d, dtype=dtype)
    own_columns = slice(sources, sources + h)
    first = (Columns.of(stack, slice(h, 2 * h), own_columns, transposed=True), Halves.of_rows(kept, 0, h, d))
    mine = (Columns.of(stack, slice(0, h), own_columns, transposed=True), Halves.of_heads(*grads))
    with use_mix_tiles(tiles):
        mix_and_weight_grad(
            Halves.of_heads(keys, values),
            first,
            mine,
            weight,
            Halves.of_rows(rows, 0, sources + h, d),
            column_start=0,
            own_row=sources,
            deterministic=deterministic,
            splits=splits,
            accumulate=Halves.of_heads(later, later),
            more=Halves.of_heads(downstream, downstream),
        )
    g = as_rows(*grads).double()
    columns = stack[:, own_columns].double()
    sums = as_rows(later, later).double() + as_rows(downstream, downstream).double()
    expected = columns[h:].t() @ kept.double() + columns[:h].t() @ g + sums
    assert relative(as_rows(keys, values), expected) <= TOLERANCE[dtype]
    got = weight.sum(0) if deterministic else weight
    assert relative(got, g @ before.double().t()) <= (1e-12 if dtype == torch.float64 else 1e-5)
    assert torch.equal(rows[sources:], as_rows(*grads)) and torch.equal(rows[:sources], before[:sources])


@pytest.mark.parametrize("deterministic", [True, False], ids=["per-split sums", "atomic"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_two_block_products_in_one_launch(shape, dtype, deterministic):
    """A routing block's backward launch: a row gradient into grouped slots ``out = W^T @ kept``
    and, beside it, a weight gradient ``g @ rows^T`` of nine readers' g (two tiles of rows at 8
    heads) over other rows, placed at a column; nothing kept, no operand written but the two
    outputs."""
    torch.manual_seed(sum(shape) + 5)
    s, b, h, d, sources = shape
    readers, groups = 9, 2
    kept = torch.randn(sources, 2 * s * b * d, dtype=dtype)
    stack = torch.randn(sources, groups * h, dtype=dtype)
    grads = torch.randn(readers * h, 2 * s * b * d, dtype=dtype)
    rows = torch.randn(sources + 1, 2 * s * b * d, dtype=dtype)
    operands = [tensor.clone() for tensor in (kept, grads, rows)]
    slots = torch.full((2 * groups, s, b, h, d), float("nan"), dtype=dtype)
    accumulate = torch.float64 if dtype == torch.float64 else torch.float32
    splits = 2
    weight = torch.zeros((splits, readers * h, sources + 3) if deterministic else (readers * h, sources + 3))
    weight = weight.to(accumulate)
    later = Columns.of(stack, slice(0, sources), slice(0, groups * h), transposed=True)
    mix_beside_weight_grad(
        Halves.of_groups(slots),
        (later, Halves.of_rows(kept, 0, sources, d)),
        weight,
        Halves.of_rows(grads, 0, readers * h, d),
        Halves.of_rows(rows, 1, sources, d),
        column_start=2,
        deterministic=deterministic,
        splits=splits,
    )
    got = torch.cat([as_rows(slots[g], slots[groups + g]) for g in range(groups)])
    assert relative(got, stack.double().t() @ kept.double()) <= TOLERANCE[dtype]
    summed = weight.sum(0) if deterministic else weight
    assert torch.equal(summed[:, :2], torch.zeros_like(summed[:, :2])) and not summed[:, sources + 2 :].any()
    product = grads.double() @ rows[1:].double().t()
    assert relative(summed[:, 2 : sources + 2], product) <= (1e-12 if dtype == torch.float64 else 1e-5)
    assert all(torch.equal(before, after) for before, after in zip(operands, (kept, grads, rows)))


def test_the_fused_backward_needs_its_gradient_rows_in_one_tile():
    grads = torch.randn(2, 1, 65, 4)
    halves = Halves.of_heads(grads, grads)
    with pytest.raises(ValueError, match="65 gradient rows: more than one tile"):
        mix_and_weight_grad(
            halves, None, (Columns.of_view(torch.eye(65)), halves), torch.zeros(65, 65), halves, 0, 0, False, 1
        )


def test_a_mix_needs_a_term_and_stores_only_the_second():
    rows = torch.randn(2, 32)
    halves = Halves.of_rows(rows, 0, 2, 4)
    with pytest.raises(ValueError, match="at least one term"):
        mix(halves, None)
    with pytest.raises(ValueError, match="the second term's"):
        mix(halves, (Columns.of_view(torch.eye(2)), halves), store=halves)


@pytest.mark.parametrize("together", [False, True], ids=["keys and values apart", "one tensor"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_grouped_rows_are_a_blocks_layers(shape, dtype, together):
    """A mix over grouped rows (``Halves.of_groups``: G layers of h heads, ``[G, s, b, h, d]``
    keys and values, or one ``[2G, ...]`` tensor, the values' groups after the keys') reads and
    writes layer g's heads at group g, added to in place."""
    torch.manual_seed(sum(shape) + 7)
    s, b, h, d, sources = shape
    groups = 3
    rows = torch.randn(sources, 2 * s * b * d, dtype=dtype)
    weight = torch.randn(groups * h, sources, dtype=dtype)
    start = torch.randn(2 * groups, s, b, h, d, dtype=dtype)
    grouped = start.clone() if together else None
    keys, values = (None, None) if together else (start[:groups].clone(), start[groups:].clone())
    out = Halves.of_groups(grouped) if together else Halves.of_groups(keys, values)
    mix(out, (Columns.of_view(weight), Halves.of_rows(rows, 0, sources, d)), accumulate=out)
    if together:
        keys, values = grouped[:groups], grouped[groups:]
    got = torch.cat([as_rows(keys[g], values[g]) for g in range(groups)])
    before = torch.cat([as_rows(start[g], start[groups + g]) for g in range(groups)])
    expected = weight.double() @ rows.double() + before.double()
    assert relative(got, expected) <= TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_rank_chunks_are_every_ranks_heads(shape, dtype):
    """A mix written into rank chunks and one read from them (``Halves.of_rank_chunks``: ``[2C, s,
    b, h, d]``, chunk c's keys at 2c and values at 2c + 1, row i head ``i % h`` of chunk ``i //
    h``), the way tensor parallelism's reduce-scatter takes its input and all-gather leaves its
    output; read from a chunk's first row on."""
    torch.manual_seed(sum(shape) + 11)
    s, b, h, d, sources = shape
    chunks = 3
    rows = torch.randn(sources, 2 * s * b * d, dtype=dtype)
    weight = torch.randn(chunks * h, sources, dtype=dtype)
    written = torch.empty(2 * chunks, s, b, h, d, dtype=dtype)
    mix(Halves.of_rank_chunks(written, 0, chunks * h), (Columns.of_view(weight), Halves.of_rows(rows, 0, sources, d)))
    got = torch.cat([as_rows(written[2 * c], written[2 * c + 1]) for c in range(chunks)])
    assert relative(got, weight.double() @ rows.double()) <= TOLERANCE[dtype]
    back = torch.empty((chunks - 1) * h, 2 * s * b * d, dtype=dtype)
    eye = torch.eye((chunks - 1) * h, dtype=dtype)
    read = Halves.of_rank_chunks(written, h, (chunks - 1) * h)
    mix(Halves.of_rows(back, 0, (chunks - 1) * h, d), (Columns.of_view(eye), read))
    assert torch.equal(back, got[h:])
    assert read.bytes == back.numel() * back.element_size()
    with pytest.raises(ValueError, match="row 1 does not begin a chunk"):
        Halves.of_rank_chunks(written, 1, h)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_a_blocks_forward_over_two_row_tiles(dtype):
    """A routing block's forward launch at a deep shape's size (``fused_blocks.mix_earlier``): 9
    readers of 8 heads (72 output rows, two R tiles) into grouped slots, over earlier rows and the
    first reader's own keys/values (strided, as megatron's QKV split hands them over), which the
    launch stores into their rows once, unchanged."""
    torch.manual_seed(3)
    s, b, h, d, sources, readers = 5, 2, 8, 4, 6, 9
    rows = torch.randn(sources, 2 * s * b * d, dtype=dtype)
    weight = torch.randn(readers * h, sources + h, dtype=dtype)
    key, value = strided_keys_values(s, b, h, d, dtype)
    stored = torch.zeros(h, 2 * s * b * d, dtype=dtype)
    keys, values = (torch.empty(readers, s, b, h, d, dtype=dtype) for _ in range(2))
    mix(
        Halves.of_groups(keys, values),
        (Columns.of(weight, slice(0, readers * h), slice(0, sources)), Halves.of_rows(rows, 0, sources, d)),
        (Columns.of(weight, slice(0, readers * h), slice(sources, sources + h)), Halves.of_heads(key, value)),
        store=Halves.of_rows(stored, 0, h, d),
    )
    got = torch.cat([as_rows(keys[q], values[q]) for q in range(readers)])
    expected = weight.double() @ torch.cat([rows, as_rows(key, value)]).double()
    assert relative(got, expected) <= TOLERANCE[dtype]
    assert torch.equal(stored, as_rows(key, value))


@pytest.mark.parametrize("deterministic", [True, False], ids=["per-split sums", "atomic"])
@pytest.mark.parametrize("widen, step", [(2, 0), (0, 1)], ids=["widening (full)", "sliding (last)"])
def test_weight_gradient_of_a_blocks_readers(widen, step, deterministic):
    """One launch places G @ X^T of a block's readers (h rows each) into their gradients laid one
    after another (``Placement`` groups): reader q's ``[h, width + q * widen]`` from its origin,
    column 0 of the product at its column ``start - q * step * h``; columns outside a reader's
    matrix (before its window) are not written."""
    torch.manual_seed(widen + step)
    s, b, h, d, readers, width = 3, 2, 2, 8, 3, 10
    grads = torch.randn(readers * h, 2 * s * b * d, dtype=torch.float64)
    rows = torch.randn(3, 2 * s * b * d, dtype=torch.float64)  # source rows (layers of one head)
    widths = [width + q * widen for q in range(readers)]
    origins = [h * sum(widths[:q]) for q in range(readers)]
    total = h * sum(widths)
    splits = 2
    out = torch.zeros((splits, total) if deterministic else (total,), dtype=torch.float64)
    start = h  # the product's column 0 is reader 0's column h: before reader 2's window when sliding
    placement = Placement(start, width, group=h, widen=widen, shift=-step * h)
    product_rows = Halves.of_rows(grads, 0, readers * h, d)
    weight_grad(out, product_rows, Halves.of_rows(rows, 0, 3, d), placement, deterministic, splits)
    got = out.sum(0) if deterministic else out
    product = grads @ rows.t()
    expected = torch.zeros(total, dtype=torch.float64)
    for q in range(readers):
        matrix = expected[origins[q] : origins[q] + h * widths[q]].view(h, widths[q])
        for j in range(3):
            column = start - q * step * h + j
            if 0 <= column < widths[q]:
                matrix[:, column] = product[q * h : (q + 1) * h, j]
    assert relative(got, expected) <= 1e-12
    assert torch.equal(got[expected == 0], expected[expected == 0])
