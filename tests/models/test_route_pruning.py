"""Route pruning (v1 §5.4, ``models.lime.pruning``): the top-p rule, masked routes against the plain
reference (static and dynamic, float64), skipped reads, blocked routing and the checkpointed mask."""

from __future__ import annotations

import pytest
import torch

from lime_megatron.models.config import LimeConfigError, lime_config
from lime_megatron.models.lime.pruning import (
    collect_dynamic_prior,
    enforce_route_masks,
    pruned_counts,
    routers_of,
    set_route_masks,
    top_p_mask,
    v1_route_count,
)
from lime_megatron.parallel.process_groups import initialize_parallel
from lime_megatron.testing.routing_reads import routing_reads
from tests.lime_fixtures import (
    batch,
    loss_of,
    megatron_logits,
    reference_params,
    reference_spec,
    relative_error,
    tiny_model,
    twin_errors,
)
from tests.reference_lime import forward as reference_forward

TOLERANCE = 1e-10


@pytest.fixture(scope="module", autouse=True)
def megatron():
    initialize_parallel()


def test_top_p_keeps_the_largest_routes_until_the_share_is_reached():
    scores = torch.tensor([[0.05, 0.5, 0.15, 0.3], [1.0, 0.0, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25]])
    assert top_p_mask(scores, 0.9).tolist() == [
        [False, True, True, True],
        [True, False, False, False],
        [True, True, True, True],
    ]
    assert top_p_mask(scores, 0.5).tolist() == [
        [False, True, False, False],
        [True, False, False, False],
        [True, True, False, False],
    ]  # ties: the earlier kept
    assert top_p_mask(scores * 7.0, 0.5).tolist() == top_p_mask(scores, 0.5).tolist()  # shares, not values
    with pytest.raises(ValueError, match="top-p must be in"):
        top_p_mask(scores, 0.0)


def pruned_model(top_p: float, **overrides):
    """A tiny model with route masks set at ``top_p`` (dynamic: by the prior of one training pass)."""
    model = tiny_model(lime_prune_top_p=top_p, **overrides)
    if model.config.lime_router == "dynamic":
        collect_dynamic_prior([model])
        tokens, positions, mask = batch(seed=3)
        megatron_logits(model, tokens, positions, mask)
    set_route_masks([model], top_p)
    return model


def reference_gradients(model):
    """Loss-gradients of the model and of the reference on the same (pruned) weights."""
    tokens, positions, mask = batch()
    logits = megatron_logits(model, tokens, positions, mask)
    loss_of(logits, tokens).backward()
    params, leaves = reference_params(model)
    for router in routers_of([model]):
        if router.dynamic:
            params["layers"][router.layer]["dynamic_mask"] = router.route_mask
    ref_logits = reference_forward(params, tokens, reference_spec(model))
    loss_of(ref_logits, tokens).backward()
    return relative_error(logits, ref_logits), leaves


@pytest.mark.parametrize("block", [1, 3], ids=["B1", "B3"])
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_static_masked_weights_are_zero_and_get_no_gradient(kv_heads, block):
    model = pruned_model(0.6, num_query_groups=kv_heads, num_layers=7, lime_routing_block=block)
    routers = routers_of([model])
    routes, masked, _, _ = pruned_counts([model])
    assert routes == sum(router.weight.numel() for router in routers) and 0 < masked < routes
    assert all(torch.all(router.weight[~router.route_mask] == 0) for router in routers)
    error, leaves = reference_gradients(model)
    assert error <= TOLERANCE
    for name, param in model.named_parameters():
        expected = leaves[name].grad
        if name.endswith("router.weight"):
            mask = dict(model.named_buffers())[name.replace("weight", "route_mask")]
            assert torch.all(param.grad[~mask] == 0) and torch.any(expected[~mask] != 0), name
            expected = expected * mask
        assert relative_error(param.grad, expected) <= TOLERANCE, name


def test_dynamic_masked_routes_have_weight_zero():
    model = pruned_model(0.6, lime_router="dynamic", num_query_groups=2)
    routes, masked, _, _ = pruned_counts([model])
    assert routes == 2 * (2 + 3 + 4 + 5) and 0 < masked < routes
    error, leaves = reference_gradients(model)
    assert error <= TOLERANCE
    for name, param in model.named_parameters():
        assert relative_error(param.grad, leaves[name].grad) <= TOLERANCE, name
    for router in routers_of([model]):
        hidden = torch.randn(3, 2, 32, dtype=torch.float64)
        assert torch.all(router(hidden)[..., ~router.route_mask] == 0)


def test_a_source_no_head_reads_is_not_read():
    """Forward reads: one row block per source a router still reads, not per source it had."""
    model = pruned_model(0.3, num_layers=7, lime_routing_block=1)
    routers = routers_of([model])
    assert sum(len(r.read_sources) for r in routers) < sum(len(r.sources) for r in routers)
    tokens, positions, mask = batch()
    with torch.no_grad(), routing_reads() as reads:
        megatron_logits(model, tokens, positions, mask)
    row = 2 * tokens.numel() * model.config.kv_channels * model.config.kv_heads * 8  # float64
    assert reads.by_kind["forward"] == row * sum(len(r.read_sources) for r in routers)


def test_blocked_routing_with_masks_equals_per_layer():
    per_layer = pruned_model(0.5, num_layers=7, lime_routing_block=1)
    blocked = tiny_model(num_layers=7, lime_routing_block=3, lime_prune_top_p=0.5)
    blocked.load_state_dict(per_layer.state_dict())  # weights and masks (read sources refreshed)
    assert [r.read_sources for r in routers_of([blocked])] == [r.read_sources for r in routers_of([per_layer])]
    loss_error, grad_errors = twin_errors(per_layer, blocked)
    assert loss_error <= 1e-13 and max(grad_errors.values()) <= 1e-13, grad_errors


def test_masks_survive_an_optimizer_step_and_are_in_the_state_dict():
    model = pruned_model(0.6, num_query_groups=2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    tokens, positions, mask = batch()
    for _ in range(2):  # Adam's moments from before pruning would move the masked weights
        loss_of(megatron_logits(model, tokens, positions, mask), tokens).backward()
        optimizer.step()
        enforce_route_masks([model])
    for router in routers_of([model]):
        assert torch.all(router.weight[~router.route_mask] == 0)
    state = model.state_dict()
    assert sum(name.endswith("route_mask") for name in state) == 4
    unpruned = tiny_model(num_query_groups=2)
    assert not any(name.endswith("route_mask") for name in unpruned.state_dict())  # not a pruning run


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(lime_prune_top_p=1.5), "lime_prune_top_p must be in"),
        (dict(lime_prune_top_p=0.9, lime_router="average"), "needs learned routers"),
    ],
)
def test_bad_pruning_options_fail_with_one_clear_message(overrides, message):
    with pytest.raises(LimeConfigError, match=message):
        lime_config(num_layers=2, hidden_size=32, num_attention_heads=4, **overrides)


def test_a_blocked_layer_reading_only_sources_before_its_block_equals_per_layer():
    """Layer 4 of a block 3..5 whose kept routes all read layer 0: it runs no in-block product,
    its routed keys/values are the block's earlier sums alone."""
    models = [tiny_model(num_layers=7, lime_routing_block=block, lime_prune_top_p=0.5) for block in (1, 3)]
    models[1].load_state_dict(models[0].state_dict())
    for model in models:
        router = routers_of([model])[4]
        mask = torch.zeros_like(router.route_mask)
        mask[:, router.columns(0, 1)] = True
        router.set_route_mask(mask)
        assert router.read_sources == [0]
    loss_error, grad_errors = twin_errors(*models)
    assert loss_error <= 1e-13 and max(grad_errors.values()) <= 1e-13, grad_errors


@pytest.mark.parametrize("num_layers, v1_total", [(32, 7936), (64, 32256), (128, 130048)], ids=["32", "64", "128"])
def test_v1_unit_reproduces_v1_table_5_totals(num_layers, v1_total):
    """v1 Table 5's "total router weights" at 16 heads: 16 L(L-1)/2, one per head and earlier source."""
    config = lime_config(num_layers=num_layers, hidden_size=256, num_attention_heads=16, lime_prune_top_p=0.9)
    assert v1_route_count(config) == v1_total
    assert v1_route_count(lime_config(**{**config.__dict__, "lime_router": "dynamic"})) == v1_total


def v1_masked_by_loops(router) -> int:
    """Masked (head, earlier source) pairs of a router at TP=1, entry by entry: a pair is masked
    when no route of the head from that source is kept."""
    mask, sources = router.route_mask, router.sources
    per_source = mask.shape[1] // len(sources)
    return sum(
        not any(bool(mask[head, j * per_source + k]) for k in range(per_source))
        for head in range(mask.shape[0])
        for j in range(len(sources) - 1)
    )


@pytest.mark.parametrize(
    "top_p, overrides",
    [(0.6, dict(num_query_groups=4)), (0.6, dict(num_query_groups=2)), (0.95, dict(lime_router="dynamic"))],
    ids=["static-mha", "static-gqa", "dynamic"],
)
def test_counts_in_v1_unit(top_p, overrides):
    """v1's unit counted by ``pruned_counts`` against the masks read entry by entry (some pairs
    masked, some kept: the dynamic router's own layer takes most of each prior, hence its top-p)."""
    model = pruned_model(top_p, num_layers=7, **overrides)
    counts = pruned_counts([model])
    assert counts.v1_routes == v1_route_count(model.config) == model.config.kv_heads * 7 * 6 // 2
    assert counts.v1_masked == sum(v1_masked_by_loops(router) for router in routers_of([model]))
    assert 0 < counts.v1_masked < counts.v1_routes


def test_dynamic_pruning_at_initialisation_keeps_the_own_layer():
    """W_l = 0: every token's p_l is the initialisation's (own layer 0.9, each earlier one 0.1 / l),
    so top-p 0.9 keeps the own layer and at most one earlier source per head (which one, if any,
    depends on the rounding of the own share around 0.9); in v1's unit at least (l-1)/l of the
    routes of layer l are masked."""
    model = tiny_model(lime_router="dynamic", num_layers=7, num_query_groups=2, lime_prune_top_p=0.9)
    with torch.no_grad():
        for router in routers_of([model]):
            router.logits.weight.zero_()
    collect_dynamic_prior([model])
    tokens, positions, mask = batch(seed=3)
    megatron_logits(model, tokens, positions, mask)
    set_route_masks([model], 0.9)
    for router in routers_of([model]):
        kept = router.route_mask
        assert kept[:, -1].all() and (kept[:, :-1].sum(dim=1) <= 1).all(), (router.layer, kept)
    counts = pruned_counts([model])
    print(f"at initialisation: {counts}")
    assert counts.v1_masked >= counts.v1_routes - 2 * 6
