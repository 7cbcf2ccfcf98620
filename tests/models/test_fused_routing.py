"""The Triton path of the routing (``kernels``, ``models.lime.fused_routing``; Triton's CPU
interpreter) against the torch path: the same model, losses and every gradient; which path a run
takes; the host work it dispatches per layer; and what a captured step would need (no host
synchronisation, the buffer allocated once per pass)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lime_megatron.choices import LimeConfigError
from lime_megatron.inference.decoding import decode_step, kv_cache_context
from lime_megatron.kernels.routing_path import routing_kernel
from lime_megatron.models.config import lime_config
from lime_megatron.models.lime.fused_routing import gathers_heads
from lime_megatron.models.lime.head_parallel import HeadSharding
from lime_megatron.models.lime.key_value_rows import KeyValueRows
from lime_megatron.models.lime.static_routing import StaticRouting
from lime_megatron.testing.dispatched_operators import DispatchedOperators
from tests.lime_fixtures import (
    RECOMPUTE,
    batch,
    loss_of,
    megatron_logits,
    prune_by_hand,
    tiny_model,
    twin_errors,
)

pytestmark = pytest.mark.usefixtures("megatron")

VARIANTS = {  # id: model settings, run by both paths
    "full B=1": dict(lime_routing_block=1),
    "full B=3": dict(lime_routing_block=3),
    "gqa B=2": dict(lime_routing_block=2, num_query_groups=2),
    "last-2 B=2": dict(lime_routing_block=2, lime_router="last", lime_router_window=2),
    "first-2": dict(lime_routing_block=1, lime_router="first", lime_router_window=2),
    "average": dict(lime_routing_block=1, lime_router="average"),
    "routed K/V rebuilt B=2": dict(lime_routing_block=2, lime_recompute_routed_kv=True),
    "full recompute": dict(lime_routing_block=1, **RECOMPUTE["full-uniform"]),
    "full recompute B=3": dict(lime_routing_block=3, **{**RECOMPUTE["full-uniform"], "recompute_num_layers": 3}),
    "deterministic": dict(lime_routing_block=1, deterministic_mode=True),
    "deterministic B=3": dict(lime_routing_block=3, deterministic_mode=True),
    "last-3 B=3": dict(lime_routing_block=3, lime_router="last", lime_router_window=3),
    # B = 2 over 6 layers: the third block's backward launch computes the second's G as well
    "deterministic B=2": dict(lime_routing_block=2, deterministic_mode=True),
    "full recompute B=2": dict(lime_routing_block=2, **{**RECOMPUTE["full-uniform"], "recompute_num_layers": 2}),
    "average B=2": dict(lime_routing_block=2, lime_router="average"),  # fixed routers: G alone
}


def both_paths(dtype=torch.float64, **settings):
    """The model on the torch path and its twin (same weights) on the Triton path."""
    return (
        tiny_model(dtype, num_layers=6, lime_routing_kernel="torch", **settings),
        tiny_model(dtype, num_layers=6, lime_routing_kernel="triton", **settings),
    )


@pytest.mark.parametrize("name", list(VARIANTS))
def test_triton_path_equals_the_torch_path(name):
    """Loss and every gradient in float64, at summation-order tolerance."""
    loss_error, grad_errors = twin_errors(*both_paths(**VARIANTS[name]))
    assert loss_error <= 1e-13
    assert max(grad_errors.values()) <= 1e-12, grad_errors


@pytest.mark.parametrize(
    "settings, fused",
    [
        (dict(lime_routing_block=3), [3]),
        (dict(lime_routing_block=2, lime_router="last", lime_router_window=3), [2, 4]),
        (dict(lime_routing_block=3, lime_router="first", lime_router_window=2), []),
    ],
    ids=["full", "last-3", "first-2 (sources not a run)"],
)
def test_which_blocks_route_as_one(settings, fused, monkeypatch):
    """A block whose layers all route on the fused path, its readers' sources whole runs stepping
    evenly, runs as one (``fused_blocks.MixEarlierRows``); another takes the general blocked path
    (``routing_blocks``): the same gradients either way."""
    from lime_megatron.models.lime.fused_blocks import MixEarlierRows

    ran, forward = [], MixEarlierRows.forward

    def recorded(ctx, blocks, block, *args):
        ran.append(block.start)
        return forward(ctx, blocks, block, *args)

    monkeypatch.setattr(MixEarlierRows, "forward", staticmethod(recorded))
    loss_error, grad_errors = twin_errors(*both_paths(**settings))
    assert sorted(set(ran)) == fused
    assert loss_error <= 1e-13 and max(grad_errors.values()) <= 1e-12, grad_errors


@pytest.mark.parametrize("block", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_a_fused_block_keeps_nothing_alive_without_the_garbage_collector(block):
    """With Python's cyclic collector off, no memory, block state or key/value rows of a step
    survives it on the Triton path with fused blocks (the block's node holds the blocks, which
    hold its output until every reader took its slots: a cycle that must end within the pass);
    at B = 2 a block's G is handed out by the next block's backward launch."""
    import gc

    from lime_megatron.models.lime.fused_blocks import FusedBlocks
    from lime_megatron.models.lime.memory import LayerIntegratedMemory

    model = tiny_model(num_layers=6, lime_routing_kernel="triton", lime_routing_block=block)
    tokens, positions, mask = batch()
    kinds = (LayerIntegratedMemory, FusedBlocks, KeyValueRows)

    def live() -> list[int]:  # other tests' objects still referenced count too: no growth is asked
        return [sum(isinstance(o, kind) for o in gc.get_objects()) for kind in kinds]

    gc.collect()
    gc.disable()
    try:
        before, after = live(), []
        for _ in range(2):
            loss_of(megatron_logits(model, tokens, positions, mask), tokens).backward()
            after.append(live())
    finally:
        gc.enable()
    assert after[0] == after[1] and all(now <= then for now, then in zip(after[0], before)), (before, after)


@pytest.mark.parametrize("block", [1, 2])
def test_a_backward_beyond_one_tile_takes_two_launches(block, monkeypatch):
    """Where g_l's rows do not fit one tile (over 64 kv heads) a layer's backward runs the weight
    gradient and the row gradient as two launches, the row gradient keeping g_l: the same
    gradients (forced here on the tiny model)."""
    from lime_megatron.kernels import operands

    asked, fits_one_tile = [], operands.fits_one_tile
    monkeypatch.setattr(operands, "fits_one_tile", lambda grads: asked.append(fits_one_tile(grads)) or False)
    loss_error, grad_errors = twin_errors(*both_paths(lime_routing_block=block))
    assert asked and all(asked), "no layer's backward would have been one launch"
    assert loss_error <= 1e-13 and max(grad_errors.values()) <= 1e-12, grad_errors


def test_pruned_routers_on_the_triton_path():
    """Hand-pruned routers (sources skipped, windows of reads): the same gradients both ways."""
    torch_model, triton_model = both_paths(lime_routing_block=2, lime_prune_top_p=1.0)
    for model in (torch_model, triton_model):
        prune_by_hand([model], lambda layer, source: source == layer or source % 2 == 1)
    loss_error, grad_errors = twin_errors(torch_model, triton_model)
    assert loss_error <= 1e-13 and max(grad_errors.values()) <= 1e-12, grad_errors


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("block", [1, 2, 3])
def test_triton_path_in_training_dtypes(dtype, tolerance, block):
    """float32 and bf16 (routers in the rows' dtype, the weight gradient accumulated in float32);
    6 layers in blocks of 2 run a block's backward launch that computes the block before's G."""
    loss_error, grad_errors = twin_errors(*both_paths(dtype, lime_routing_block=block))
    assert loss_error <= tolerance
    assert max(grad_errors.values()) <= tolerance, grad_errors


def test_the_triton_path_runs_every_routing_product_as_a_launch():
    """No matrix product is dispatched on the Triton path beyond the baseline's."""

    def products(model) -> dict:
        tokens, positions, mask = batch()
        with DispatchedOperators() as operators:
            loss_of(megatron_logits(model, tokens, positions, mask), tokens).backward()
        return {name: n for name, n in operators.by_name.items() if name in ("mm", "bmm", "baddbmm", "addmm")}

    baseline = products(tiny_model(num_layers=4, lime=False))
    triton = tiny_model(num_layers=4, lime_routing_block=2, lime_routing_kernel="triton")
    assert products(triton) == baseline


def config_with(**settings):
    return lime_config(num_layers=2, hidden_size=32, num_attention_heads=4, **settings)


def test_cuda_defaults_to_triton_and_the_cpu_to_torch():
    assert routing_kernel(config_with(), torch.device("cuda")) == "triton"
    assert routing_kernel(config_with(), torch.device("cpu")) == "torch"
    assert routing_kernel(config_with(lime_routing_kernel="torch"), torch.device("cuda")) == "torch"
    assert routing_kernel(config_with(lime_router="dynamic"), torch.device("cuda")) == "torch"
    assert routing_kernel(config_with(params_dtype=torch.float64), torch.device("cuda")) == "torch"
    assert routing_kernel(config_with(lime=False), torch.device("cuda")) == "torch"


@pytest.mark.parametrize(
    "settings, device, message",
    [
        (dict(lime_router="dynamic"), "cuda", "the dynamic router's per-token products have no Triton kernel"),
        (dict(params_dtype=torch.float64), "cuda", "not torch.float64"),
        ({}, "cpu", "only in Triton's interpreter"),
    ],
    ids=["dynamic", "float64 on a GPU", "CPU without the interpreter"],
)
def test_triton_refuses_what_it_cannot_honour(settings, device, message, monkeypatch):
    if device == "cpu":
        monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(LimeConfigError, match=f"^--lime-routing-kernel triton: .*{message}"):
        routing_kernel(config_with(lime_routing_kernel="triton", **settings), torch.device(device))


def test_an_unknown_routing_kernel_is_refused():
    with pytest.raises(LimeConfigError, match="unknown lime_routing_kernel 'cuda'"):
        config_with(lime_routing_kernel="cuda")


def step_operators(model, run_launches: bool = False) -> DispatchedOperators:
    """The operators of one forward+backward after one uncounted (gradients reset between, as an
    optimizer's ``zero_grad`` does); Triton launches counted, run only with ``run_launches``."""
    tokens, positions, mask = batch()
    with DispatchedOperators(run_launches):
        loss_of(megatron_logits(model, tokens, positions, mask), tokens).backward()
    model.zero_grad(set_to_none=True)
    with DispatchedOperators(run_launches) as operators:
        loss_of(megatron_logits(model, tokens, positions, mask), tokens).backward()
    return operators


def extra_per_layer(count=None, **settings) -> dict[str, float]:
    """Operators LIMe (the Triton path unless ``settings`` say otherwise) dispatches per layer
    beyond the baseline in what ``count`` counts (default ``step_operators``), by name: the
    difference of the extra counts at 12 and 8 layers over 4 (what a pass costs once cancels)."""
    count = count or step_operators
    settings = dict(lime_routing_kernel="triton") | settings
    extra = {}
    for layers in (8, 12):
        lime = count(tiny_model(num_layers=layers, **settings)).by_name
        base = count(tiny_model(num_layers=layers, lime=False)).by_name
        extra[layers] = {name: lime[name] - base[name] for name in lime.keys() | base.keys()}
    names = extra[12].keys() | extra[8].keys()
    change = {name: (extra[12].get(name, 0) - extra[8].get(name, 0)) / 4 for name in names}
    return {name: count for name, count in change.items() if count}


PER_LAYER = {"new_empty": 4, "new_zeros": 1, "triton:mix_kernel": 2, "detach": 1}
"""B = 1: forward 2 allocations and a launch, backward 3 allocations and a launch, autograd's
accumulation of the router's gradient."""

PER_FUSED_BLOCK_LAYER = {"triton:mix_kernel": 2, "as_strided": 1, "detach": 1}
"""A fused block's layer: its two launches, the view of the block's buffer that is its router's
gradient and the accumulation of it."""

PER_FUSED_BLOCK = {"new_empty": 3, "unbind": 3, "new_zeros": 1, "triton:mix_kernel": 1}
"""A fused block: its sums over earlier sources (keys, values), its row gradients and its readers'
weight gradients allocated, the first two handed out by one ``unbind`` each; its product over
earlier sources, which is its first reader's forward launch too (one launch less), and in backward
its readers' earlier weight columns in the launch of the block before's later consumers' share."""


def fused_blocks_of(size: int) -> dict[str, float]:
    """Operators per layer in fused blocks of ``size`` layers."""
    names = PER_FUSED_BLOCK | PER_FUSED_BLOCK_LAYER
    return {name: PER_FUSED_BLOCK_LAYER.get(name, 0) + PER_FUSED_BLOCK.get(name, 0) / size for name in names}


TRITON_HOST_WORK = {  # id: (settings, operators per layer beyond the baseline's)
    "B=1": (dict(lime_routing_block=1), PER_LAYER),
    "last-2": (dict(lime_routing_block=1, lime_router="last", lime_router_window=2), PER_LAYER),
    "B=2": (dict(lime_routing_block=2), fused_blocks_of(2)),
    "B=4": (dict(lime_routing_block=4), fused_blocks_of(4)),
}


@pytest.mark.parametrize(  # the window and B = 2 in the slow suite: B = 1 and B = 4 bound them
    "name",
    [pytest.param(name, marks=pytest.mark.slow) if name in ("last-2", "B=2") else name for name in TRITON_HOST_WORK],
)
def test_triton_host_work_per_layer(name):
    """The host work LIMe adds per layer on the Triton path, a launch counted as one, exactly
    (by difference of depths: blocks after the first): at B = 1 ``PER_LAYER``, 8 (the torch path
    dispatches 38: docs/routing.md); in fused blocks ``PER_FUSED_BLOCK_LAYER`` per layer and
    ``PER_FUSED_BLOCK`` per block, 4 + 8 / B: 8 at B = 2, 6 at B = 4."""
    settings, expected = TRITON_HOST_WORK[name]
    per_layer = extra_per_layer(**settings)
    assert per_layer == expected
    assert sum(per_layer.values()) == {"B=2": 8, "B=4": 6}.get(name, 8)


def decoding_step_operators(model, run_launches: bool = False) -> DispatchedOperators:
    """The operators of one KV-cache decoding step of one token per sequence, after a prefill;
    Triton launches counted, run only with ``run_launches``."""
    model.eval()
    tokens = batch()[0]
    context = kv_cache_context(model, tokens.shape[0], tokens.shape[1])
    with DispatchedOperators(run_launches):
        decode_step(model, context, tokens[:, :-1])
    with DispatchedOperators(run_launches) as operators:
        decode_step(model, context, tokens[:, -1:])
    return operators


@pytest.mark.parametrize("kernel, expected", [("triton", 3), ("torch", 15)])
def test_decoding_host_work_per_layer(kernel, expected):
    """Operators a KV-cache decoding step dispatches per layer beyond the baseline's: on the
    Triton path Eqs. 1-2 as one launch and its two outputs (``memory.route_new_tokens``), blocked
    or not; the torch path's store and product with their views (docs/routing.md)."""
    for block in (1, 2):
        per_layer = extra_per_layer(decoding_step_operators, lime_routing_kernel=kernel, lime_routing_block=block)
        assert sum(per_layer.values()) == expected, per_layer
        if kernel == "triton":
            assert per_layer == {"new_empty": 2, "triton:mix_kernel": 1}


@pytest.mark.parametrize("count", [step_operators, decoding_step_operators], ids=["training", "decoding"])
@pytest.mark.parametrize("block", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_counting_without_running_the_launches_counts_the_same(count, block):
    """``DispatchedOperators(run_launches=False)``, which the host-work counts use (Triton's
    interpreter is the slow part of a step on a CPU), counts what a step that runs its launches
    counts, in training and in decoding: no host decision waits for a routed value."""
    model = tiny_model(num_layers=6, lime_routing_kernel="triton", lime_routing_block=block)
    ran, skipped = count(model, run_launches=True), count(model)
    assert ran.by_name == skipped.by_name and ran.by_name["triton:mix_kernel"] > 0


SYNCHRONISING = ("_local_scalar_dense", "item", "nonzero", "is_nonzero", "equal", "allclose")
"""Operators that make the host wait for the device (a value read back)."""


@pytest.mark.parametrize("kernel", ["triton", "torch"])
def test_a_step_adds_no_host_synchronisation_and_one_buffer(kernel, monkeypatch):
    """What a CUDA-graph capture of a step would need of LIMe and CPU tests can check: no operator
    that reads a value back and no tensor made from host data but the memory's handle (beyond the
    baseline's), and the memory's buffer allocated once per pass (one ``empty`` of its shape: B is
    static per micro-batch)."""
    counts, buffers = {}, []
    allocate = KeyValueRows.allocate

    def counted(rows, key):
        buffers.append(rows.buffer is None)
        allocate(rows, key)

    for lime in (False, True):
        model = tiny_model(num_layers=6, lime=lime, lime_routing_kernel=kernel, lime_routing_block=2)
        monkeypatch.setattr(KeyValueRows, "allocate", counted)
        counts[lime] = step_operators(model).by_name
        monkeypatch.setattr(KeyValueRows, "allocate", allocate)
    assert {name: counts[True][name] - counts[False][name] for name in SYNCHRONISING} == dict.fromkeys(SYNCHRONISING, 0)
    # a tensor from host data is, on a GPU, a copy after which the host waits: one, the memory's
    # handle, which stays on the host
    assert counts[True]["lift_fresh"] - counts[False]["lift_fresh"] == 1
    assert sum(buffers) == 2  # one buffer per pass: the uncounted step's and the counted one's


def test_standing_router_stack_follows_the_weights():
    """The Triton path keeps its router stack across passes, refreshed per pass: after the weights
    change (an optimizer step), the gradients still equal the torch path's, which builds its stack
    per pass (a stale stack would give the row gradients of the old weights)."""
    torch_model, triton_model = both_paths(lime_routing_block=1)
    for _ in range(2):
        loss_error, grad_errors = twin_errors(torch_model, triton_model)
        assert loss_error <= 1e-13 and max(grad_errors.values()) <= 1e-12
        with torch.no_grad():
            for model in (torch_model, triton_model):
                for param in model.parameters():
                    param.sub_(0.1 * param.grad)
                model.zero_grad(set_to_none=True)


def routers_of(kv_heads: int, ranks: int, reads: list[int] | None = None) -> dict:
    """Three layers' routers (as ``gathers_heads`` reads them) sharded over ``ranks``, the full
    router's, the last one reading ``reads`` (route pruning) when given."""
    sharding = HeadSharding(kv_heads, 0, ranks, group="tp")
    local = len(sharding.local_heads)
    return {
        layer: SimpleNamespace(
            layer=layer,
            identity=layer == 0,
            sources=list(range(layer + 1)),
            read_sources=reads if reads is not None and layer == 2 else list(range(layer + 1)),
            sharding=sharding,
            local_heads=local,
            weight=torch.empty(kv_heads, (layer + 1) * local),
        )
        for layer in range(3)
    }


@pytest.mark.parametrize(
    "routers, triton, block, gathers",
    [
        (routers_of(4, 2), True, 1, True),
        (routers_of(4, 4), True, 1, True),
        (routers_of(4, 2), True, 2, True),  # blocked: its block of layer 2 routes as one
        (routers_of(4, 1), True, 1, False),  # no tensor parallelism: g_l kept in the dead rows
        (routers_of(4, 2), False, 1, False),  # the torch path
        (routers_of(2, 4), True, 1, False),  # heads shared by rank pairs: the general path
        (routers_of(4, 2, reads=[0, 1]), True, 1, False),  # a router not reading its own layer
        (routers_of(4, 2, reads=[0, 2]), True, 2, False),  # blocked, a source pruned: not one block
    ],
    ids=["tp2", "tp4", "blocked", "tp1", "torch", "shared heads", "own layer pruned", "blocked, pruned"],
)
def test_which_chunks_gather_heads(routers, triton, block, gathers):
    """Which chunks route every layer on the gathered tensor-parallel path (``gathers_heads``)."""
    routing = StaticRouting(KeyValueRows(range(3), triton), block)
    assert (gathers_heads(routers, triton, routing) == "tp") is gathers
