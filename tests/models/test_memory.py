"""The routing work of the layer-integrated memory, counted by torch's FlopCounterMode.

Layer 0's routing is the fixed identity (``LimeRouter.identity``): it must run no product, in
forward, in backward, in the rebuild of its routed keys/values or in KV-cache decoding.  Every
other router runs exactly what ``flops.router_flops_per_token`` says per forward, and the same
again per backward product (dW = g R^T and the keys/values' gradient) and per rebuild.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from lime_megatron.inference.decoding import full_logits
from lime_megatron.models.lime.recompute import routed_kv_log
from lime_megatron.planning import flops
from lime_megatron.testing.copied_bytes import CopiedBytes
from lime_megatron.testing.dispatched_operators import DispatchedOperators
from tests.decoding_fixtures import incremental_logits
from tests.lime_fixtures import BATCH, SEQ, VOCAB, batch, loss_of, megatron_logits, tiny_model

pytestmark = [
    pytest.mark.usefixtures("megatron"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]

PREFILL, DECODED = 5, 2
TRAINING_TOKENS = 2 * 12  # lime_fixtures.batch(): 2 sequences of 12 tokens


def training_flops(model) -> int:
    """Matrix-product FLOPs of one forward and backward of ``model`` on ``lime_fixtures.batch()``."""
    tokens, positions, mask = batch()
    with FlopCounterMode(display=False) as counter:
        loss_of(megatron_logits(model, tokens, positions, mask), tokens).backward()
    return counter.get_total_flops()


def decoding_flops(model) -> int:
    """Matrix-product FLOPs of a prefill of ``PREFILL`` tokens and ``DECODED`` one-token steps
    (batch 2) with the KV cache."""
    tokens = torch.randint(0, VOCAB, (2, PREFILL + DECODED), generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter:
        incremental_logits(model, tokens, PREFILL)
    return counter.get_total_flops()


@pytest.mark.parametrize("variant", ["full", "average"])
def test_layer_zero_alone_costs_and_computes_what_the_baseline_does(variant):
    """A 1-layer LIMe model is the baseline with a memory: same logits, bit for bit, and not one
    product more in training (routed K/V dropped and rebuilt) or decoding."""
    lime = tiny_model(num_layers=1, lime_router=variant, lime_recompute_routed_kv=True)
    baseline = tiny_model(num_layers=1, lime=False)
    baseline.load_state_dict(lime.state_dict(), strict=False)
    assert lime.routers()[0].identity
    tokens, _, _ = batch()
    assert torch.equal(full_logits(lime, tokens), full_logits(baseline, tokens))
    routed_kv_log.take()
    assert training_flops(lime) == training_flops(baseline)
    assert routed_kv_log.take()[0].rebuilt["routed"] == 1  # the rebuild ran, without a product
    assert decoding_flops(lime.eval()) == decoding_flops(baseline.eval())


ROUTERS = {  # variant settings, products per routed layer in training: forward, rebuild, backward
    "full": (dict(lime_router="full"), 4),
    "average": (dict(lime_router="average"), 3),  # fixed weights: no weight gradient
    "last-1": (dict(lime_router="last", lime_router_window=1), 4),
    "first-2": (dict(lime_router="first", lime_router_window=2), 4),
}


@pytest.mark.parametrize("variant,products", list(ROUTERS.values()), ids=list(ROUTERS))
def test_routers_run_their_formula_and_layer_zero_nothing(variant, products):
    """LIMe minus baseline, 5 layers, MHA (the routed K/V are dropped and rebuilt): in training
    ``products`` times the forward router FLOPs of the formula (which leaves layer 0 out), in
    decoding once per decoded token."""
    # B = 1: blocked windowed routers stack zero columns (docs/routing.md); full: test_routing_bytes
    lime = tiny_model(num_query_groups=4, lime_routing_block=1, lime_recompute_routed_kv=True, **variant)
    baseline = tiny_model(num_query_groups=4, lime=False)
    assert [router.identity for router in lime.routers()] == [True, False, False, False, False]
    router = flops.router_flops_per_token(lime.config)
    assert training_flops(lime) - training_flops(baseline) == products * router * TRAINING_TOKENS
    decoded_tokens = 2 * (PREFILL + DECODED)
    assert decoding_flops(lime.eval()) - decoding_flops(baseline.eval()) == router * decoded_tokens


def step_copies(model) -> CopiedBytes:
    """The copies of one forward+backward on ``batch()``."""
    tokens, positions, mask = batch()
    with CopiedBytes() as copies:
        loss_of(megatron_logits(model, tokens, positions, mask), tokens).backward()
    return copies


def attention_layout_copies(model) -> int:
    """Bytes copied into tensors of attention's ``[s, b, kv heads, d]`` shape in one forward+backward."""
    return step_copies(model).by_shape[(SEQ, BATCH, model.config.num_query_groups, model.config.kv_channels)]


@pytest.mark.parametrize("block", [1, 2])
def test_routed_products_write_attention_layout_without_a_copy(block):
    """Without tensor parallelism the routing products write attention's keys and values
    ``[s, b, h, d]`` themselves (docs/routing.md, "Copies"): in a forward+backward with the routed K/V
    rebuilt, the only copies of that shape beyond the baseline's are layer 0's, whose identity
    routing rearranges its own rows, in forward and in the rebuild."""
    model = tiny_model(num_layers=4, lime_routing_block=block, lime_recompute_routed_kv=True)  # MHA: dropped
    baseline = tiny_model(num_layers=4, lime=False)
    routed_kv_log.take()
    lime_copies = attention_layout_copies(model)
    assert routed_kv_log.take()[1].rebuilt["routed"] == 1
    keys_bytes = SEQ * BATCH * model.config.num_query_groups * model.config.kv_channels * 8
    assert lime_copies - attention_layout_copies(baseline) == 4 * keys_bytes


def kv_sized_copies(model) -> int:
    """Bytes copied into tensors of at least one layer's keys' size (``[s, b, kv heads, d]``
    elements) in one forward+backward."""
    keys = SEQ * BATCH * model.config.num_query_groups * model.config.kv_channels
    return sum(nbytes for shape, nbytes in step_copies(model).by_shape.items() if math.prod(shape) >= keys)


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_blocking_copies_no_key_value_sized_tensor_more(kv_heads):
    """The block's earlier-source weight gradient reads the g_m rows the memory keeps, so blocked
    routing copies no tensor of the keys' size or larger beyond what per-layer routing copies."""
    per_layer = kv_sized_copies(tiny_model(num_layers=6, num_query_groups=kv_heads, lime_routing_block=1))
    blocked = kv_sized_copies(tiny_model(num_layers=6, num_query_groups=kv_heads, lime_routing_block=3))
    assert blocked == per_layer


def test_weight_columns_are_the_weight_outside_autograd_and_refused_under_it():
    """The routing products' router columns: the parameter itself where they span it, a view of it
    for part of the sources, no ``detach`` dispatched (host work); under grad mode the call is
    refused instead of handing autograd a tracked view."""
    router = tiny_model(num_layers=4).routers()[3]
    with torch.no_grad():
        assert router.weight_columns(0, 4) is router.weight
        part = router.weight_columns(2, 4)
    assert part.data_ptr() == router.weight[:, router.columns(2, 4)].data_ptr()
    assert torch.equal(part, router.weight.detach()[:, -part.shape[1] :])
    with pytest.raises(RuntimeError, match="weight_columns is for the routing products"):
        router.weight_columns(0, 4)


def step_operators(model) -> int:
    """ATen operators dispatched by one forward+backward on ``batch()``, after one uncounted (the
    first step of a process dispatches a one-off operator, which made the count depend on which
    test ran first); Triton launches counted, not run (``DispatchedOperators``: the same count)."""
    tokens, positions, mask = batch()
    with DispatchedOperators(run_launches=False):
        loss_of(megatron_logits(model, tokens, positions, mask), tokens).backward()
    with DispatchedOperators(run_launches=False) as operators:
        loss_of(megatron_logits(model, tokens, positions, mask), tokens).backward()
    return operators.total


HOST_WORK_BUDGETS = {  # id: (settings, operators per layer beyond the baseline's, at most)
    "B=1": (dict(lime_routing_block=1), 39),
    "B=4": (dict(lime_routing_block=4), 54.25),
    "last-2": (dict(lime_routing_block=1, lime_router="last", lime_router_window=2), 39),
}


@pytest.mark.parametrize("name", list(HOST_WORK_BUDGETS))
def test_routing_host_work_grows_linearly_with_depth(name):
    """The operators LIMe dispatches beyond the baseline (the host's work, which sets the pace of a
    deep narrow model on a GPU: there the time ratio is the operator ratio, docs/routing.md) are
    the same for every further block of 4 layers: no per-layer work that grows with the number of
    earlier or later layers (each product takes its router columns as views of one
    ``RouterStack``; stacking them per product was O(L) copies per layer).  Per layer they stay
    within the budget they were cut to (48 -> 39 at B = 1 when the products stopped detaching the
    router weight and the keys' and values' products shared their views): a change that adds
    host work fails here and has to say why."""
    settings, budget = HOST_WORK_BUDGETS[name]
    extra = {}
    for layers in (8, 12, 16):
        baseline = step_operators(tiny_model(num_layers=layers, lime=False))
        extra[layers] = step_operators(tiny_model(num_layers=layers, **settings)) - baseline
    assert extra[16] - extra[12] == extra[12] - extra[8] > 0, extra
    assert (extra[16] - extra[12]) / 4 <= budget, extra


PLACEMENTS = {  # name: (pieces as (first column, width)), weight columns, operators expected
    "one piece spanning": ([(0, 6)], 6, {}),
    "a block's two pieces spanning": ([(4, 2), (0, 4)], 6, {"cat": 1}),
    "one piece with margins": ([(2, 2)], 6, {"constant_pad_nd": 1}),
    "adjoining pieces with a margin": ([(0, 2), (2, 2)], 6, {"cat": 1, "constant_pad_nd": 1}),
    "a gap (a pruned source)": ([(0, 2), (4, 2)], 6, {"zeros_like": 1, "slice": 2, "copy_": 2}),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
@pytest.mark.parametrize("name", list(PLACEMENTS))
def test_weight_gradient_pieces_are_placed_at_their_columns(name, dtype):
    """``placed_columns`` puts each piece at its columns and zeros elsewhere, in float32 (float64 for
    float64 weights), joining adjoining pieces with one ``cat`` and padding only where they do not
    span the weight (a blocked router's earlier and in-block pieces become one gradient)."""
    from lime_megatron.models.lime.routing_products import placed_columns, weight_grad_dtype

    spans, width, expected_operators = PLACEMENTS[name]
    grad_dtype = weight_grad_dtype(torch.empty(0, dtype=dtype))
    weight = torch.zeros(3, width, dtype=dtype)
    pieces = [(slice(start, start + size), torch.randn(3, size, dtype=grad_dtype)) for start, size in spans]
    expected = torch.zeros(3, width, dtype=grad_dtype)
    for columns, piece in pieces:
        expected[:, columns] = piece
    with DispatchedOperators() as operators:
        placed = placed_columns(pieces, weight)
    assert placed.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert torch.equal(placed, expected)
    assert dict(operators.by_name) == expected_operators
