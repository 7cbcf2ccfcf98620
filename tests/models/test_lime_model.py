"""The megatron LIMe model against the plain reference of the paper's equations (float64)."""

from __future__ import annotations

import math
from functools import partial

import pytest
import torch

from lime_megatron.models.lime.router import routing_sources
from lime_megatron.parallel.process_groups import initialize_parallel as init_single_process
from tests.lime_fixtures import (
    RECOMPUTE,
    batch,
    loss_of,
    megatron_logits,
    recompute_gradient_errors,
    reference_params,
    reference_spec,
    relative_error,
    tiny_model,
)
from tests.reference_lime import average_router
from tests.reference_lime import forward as reference_forward

TOLERANCE = 1e-10

VARIANTS = [
    dict(lime_router="full"),
    dict(lime_router="average"),
    dict(lime_router="last", lime_router_window=2),
    dict(lime_router="first", lime_router_window=2),
]


@pytest.fixture(scope="module", autouse=True)
def megatron():
    init_single_process()


def run_both(model):
    """Loss-gradients of the megatron model and of the reference on the same weights."""
    tokens, positions, mask = batch()
    logits = megatron_logits(model, tokens, positions, mask)
    loss_of(logits, tokens).backward()
    params, leaves = reference_params(model)
    spec = reference_spec(model)
    if spec["lime"] and spec["variant"] == "average":
        for i, layer in enumerate(params["layers"][1:], start=1):
            layer["router"] = average_router(i, spec["kv_heads"])
    ref_logits = reference_forward(params, tokens, spec)
    loss_of(ref_logits, tokens).backward()
    return logits, ref_logits, leaves


@pytest.mark.parametrize("rebuild", [False, True], ids=["kept", "rebuilt"])
@pytest.mark.parametrize("block", [1, 2, 3], ids=lambda b: f"B{b}")
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "-".join(map(str, v.values())))
def test_matches_reference_logits_and_gradients(kv_heads, variant, block, rebuild):
    """MHA ``rebuild``: megatron's attention drops the routed K/V, and backward rebuilds them."""
    model = tiny_model(num_query_groups=kv_heads, lime_routing_block=block, lime_recompute_routed_kv=rebuild, **variant)
    logits, ref_logits, leaves = run_both(model)
    assert relative_error(logits, ref_logits) <= TOLERANCE
    named = dict(model.named_parameters())
    routers = [name for name in named if "router" in name]
    assert len(routers) == (0 if variant["lime_router"] == "average" else 4)
    for name, param in named.items():
        assert param.grad is not None and param.grad.abs().sum() > 0, name
        err = relative_error(param.grad, leaves[name].grad)
        assert err <= TOLERANCE, f"{name}: relative gradient error {err:.2e}"


def test_baseline_matches_reference():
    model = tiny_model(num_query_groups=2, lime=False)
    logits, ref_logits, leaves = run_both(model)
    assert relative_error(logits, ref_logits) <= TOLERANCE
    for name, param in model.named_parameters():
        assert relative_error(param.grad, leaves[name].grad) <= TOLERANCE, name


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_identity_routers_equal_baseline(kv_heads):
    """Zeroing every router weight outside the own-layer identity slice gives the baseline."""
    lime = tiny_model(num_query_groups=kv_heads)
    baseline = tiny_model(num_query_groups=kv_heads, lime=False)
    baseline.load_state_dict(lime.state_dict(), strict=False)
    with torch.no_grad():
        for router in lime.routers():
            if router.learned:
                router.weight[:, :-kv_heads].zero_()
    tokens, positions, mask = batch()
    assert torch.equal(
        megatron_logits(lime, tokens, positions, mask),
        megatron_logits(baseline, tokens, positions, mask),
    )
    # ... and the untouched initialisation is not the baseline.
    assert not torch.equal(
        megatron_logits(tiny_model(num_query_groups=kv_heads), tokens, positions, mask),
        megatron_logits(baseline, tokens, positions, mask),
    )


@pytest.mark.parametrize("block", [1, 2], ids=lambda b: f"B{b}")
@pytest.mark.parametrize("recompute", list(RECOMPUTE.values()), ids=list(RECOMPUTE))
@pytest.mark.parametrize("kv_heads,rebuild", [(2, False), (4, False), (4, True)], ids=["gqa", "mha", "mha-rebuilt"])
def test_activation_recompute_gives_the_same_gradients(recompute, block, kv_heads, rebuild):
    """Against the plain model at B = 1 (uniform recompute of 1 layer with B = 2 runs blocks of 1;
    the block method, which recomputes each of its 3 layers alone, refuses B = 2: a block's product
    over earlier sources would run in two recomputed chunks and count its gradient twice); MHA
    ``rebuild``: megatron's attention drops the routed K/V, also inside recomputed layers."""
    from lime_megatron.models.config import LimeConfigError

    build = partial(tiny_model, num_query_groups=kv_heads, lime_routing_block=1, lime_recompute_routed_kv=rebuild)
    if recompute.get("recompute_method") == "block" and block > 1:
        with pytest.raises(LimeConfigError, match="recompute_method='block'"):
            build(**recompute, lime_routing_block=block)
        return
    errors = recompute_gradient_errors(build, {**recompute, "lime_routing_block": block})
    assert all(error <= TOLERANCE for error in errors.values()), errors


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "-".join(map(str, v.values())))
def test_blocked_routing_equals_per_layer_routing(kv_heads, variant):
    """7 layers, B = 3 (blocks 0-2, 3-5, 6) against B = 1: loss and every gradient at the
    level of float64 summation order (the routed K/V rebuilt in backward: its blocked product too)."""
    per_layer = tiny_model(num_layers=7, num_query_groups=kv_heads, lime_routing_block=1, **variant)
    blocked = tiny_model(
        num_layers=7, num_query_groups=kv_heads, lime_routing_block=3, lime_recompute_routed_kv=True, **variant
    )
    blocked.load_state_dict(per_layer.state_dict())
    tokens, positions, mask = batch()
    losses = [loss_of(megatron_logits(model, tokens, positions, mask), tokens) for model in (per_layer, blocked)]
    for loss in losses:
        loss.backward()
    assert abs(losses[1].item() - losses[0].item()) <= 1e-13 * abs(losses[0].item())
    for (name, a), (_, b) in zip(per_layer.named_parameters(), blocked.named_parameters()):
        assert relative_error(b.grad, a.grad) <= 1e-13, name


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_rebuilding_routed_kv_leaves_the_gradients(kv_heads):
    """``lime_recompute_routed_kv`` rebuilds the routed K/V and rotated keys instead of keeping
    them (MHA: megatron's attention drops them; GQA: it keeps its own copies): the same gradients."""
    kept, rebuilt = (tiny_model(num_query_groups=kv_heads, lime_recompute_routed_kv=flag) for flag in (False, True))
    rebuilt.load_state_dict(kept.state_dict())
    tokens, positions, mask = batch()
    for model in (kept, rebuilt):
        loss_of(megatron_logits(model, tokens, positions, mask), tokens).backward()
    for (name, a), (_, b) in zip(kept.named_parameters(), rebuilt.named_parameters()):
        assert relative_error(b.grad, a.grad) <= 1e-14, name


def test_router_initialisation():
    kv_heads = 4
    model = tiny_model(num_query_groups=kv_heads, num_layers=5)
    routers = model.routers()
    assert [r.layer for r in routers] == [0, 1, 2, 3, 4]
    assert not routers[0].learned and torch.equal(routers[0].weight, torch.eye(kv_heads, dtype=torch.float64))
    for router in routers[1:]:
        weight = router.weight.detach()
        layer = router.layer
        assert weight.shape == (kv_heads, (layer + 1) * kv_heads)
        assert torch.equal(weight[:, -kv_heads:], torch.eye(kv_heads, dtype=weight.dtype))
        bound = math.sqrt(3.0 / ((layer + 1) * kv_heads))
        rest = weight[:, :-kv_heads]
        assert rest.abs().max() <= bound
        assert rest.abs().max() > 0.5 * bound  # really drawn from the whole interval
        assert getattr(router.weight, "is_lime_router", False)


@pytest.mark.parametrize("num_layers,kv_heads", [(2, 4), (5, 2), (7, 4)])
def test_router_parameter_count(num_layers, kv_heads):
    model = tiny_model(num_query_groups=kv_heads, num_layers=num_layers)
    count = sum(r.weight.numel() for r in model.routers() if r.learned)
    assert count == kv_heads**2 * (num_layers * (num_layers + 1) // 2 - 1)


@pytest.mark.parametrize("variant,window", [("last", 1), ("last", 3), ("first", 1), ("first", 3)])
def test_windowed_sources(variant, window):
    """App. D: last-j reads the min(l+1, j) most recent layers; first-j the first j plus its own."""
    for layer in range(8):
        sources = routing_sources(layer, variant, window)
        assert sources[-1] == layer
        if variant == "last":
            assert sources == list(range(layer + 1))[-window:]
        else:
            assert sources == sorted(set(range(min(layer, window))) | {layer})


def test_routed_kv_are_rebuilt_not_saved():
    """With the routed K/V rebuilt, autograd keeps neither the rotated keys nor the routed values
    [s, b, h, d] of any layer (the routed keys, a tensor of their own, are saved by no one either
    way), and nothing else changes."""
    from lime_megatron.testing.saved_tensors import SavedTensorBytes

    tokens, positions, mask = batch()
    saved = {}
    for recompute in (True, False):
        model = tiny_model(num_query_groups=4, lime_recompute_routed_kv=recompute)
        with SavedTensorBytes(model) as counter:
            megatron_logits(model, tokens, positions, mask)
        saved[recompute] = counter.bytes
    cfg = model.config
    heads = tokens.numel() * cfg.kv_heads * cfg.kv_channels * 8  # one [s, b, h, d] float64 tensor
    assert saved[False] - saved[True] == cfg.num_layers * 2 * heads


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_saved_bytes_against_the_baseline(kv_heads):
    """By default LIMe saves what the baseline saves at MHA (its buffer of raw K/V, the rotated keys
    and the routed values in place of the QKV output and the rotated keys); under megatron's local
    GQA attention, which keeps its repeated K/V copies in both, the baseline's plus the buffer."""
    from lime_megatron.testing.saved_tensors import SavedTensorBytes

    tokens, positions, mask = batch()
    saved = {}
    for lime in (True, False):
        model = tiny_model(num_query_groups=kv_heads, lime=lime)
        with SavedTensorBytes(model) as counter:
            megatron_logits(model, tokens, positions, mask)
        saved[lime] = counter.bytes
    cfg = model.config
    buffer = cfg.num_layers * 2 * tokens.numel() * kv_heads * cfg.kv_channels * 8  # float64 rows
    assert saved[True] - saved[False] == (0 if kv_heads == cfg.num_attention_heads else buffer)


def test_full_recompute_keeps_its_savings():
    """After the forward under megatron's full recompute, LIMe keeps what the baseline keeps (the
    checkpointed layer inputs; LIMe's memory handle adds 8 bytes) and, outside autograd, its
    buffer of raw K/V, which recomputed layers read: a small part of what full recompute drops."""
    from lime_megatron.models.lime.key_value_rows import KeyValueRows
    from lime_megatron.testing.saved_tensors import SavedTensorBytes

    tokens, positions, mask = batch()
    saved, buffers = {}, []
    original_allocate = KeyValueRows.allocate

    def allocate(key_values, key):
        original_allocate(key_values, key)
        buffers.append(key_values.buffer.numel() * key_values.buffer.element_size())

    for lime in (False, True):
        for recompute in ({}, RECOMPUTE["full-uniform"]):
            model = tiny_model(num_query_groups=2, lime=lime, **recompute)
            KeyValueRows.allocate = allocate
            try:
                with SavedTensorBytes(model) as counter:
                    logits = megatron_logits(model, tokens, positions, mask)
                logits.sum().backward()
            finally:
                KeyValueRows.allocate = original_allocate
            saved[lime, bool(recompute)] = counter.bytes
    assert saved[True, True] <= saved[False, True] + 8
    assert saved[True, True] + buffers[0] < 0.5 * saved[True, False]


@pytest.mark.usefixtures("megatron")
def test_a_pipeline_chunk_runs_only_with_the_side_channel_the_schedule_handed_it():
    """A chunk before the last stage sends K/V rows on: without this call's side channel (handed to
    the chunk by ``parallel.pipeline.schedule_arguments``) or with another config's, one message."""
    from types import SimpleNamespace

    from lime_megatron.models.config import lime_config
    from lime_megatron.models.gpt_model import build_model
    from tests.lime_fixtures import SEQ, VOCAB

    config = lime_config(num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True)
    first_stage = build_model(config, VOCAB, SEQ, post_process=False)
    tokens, positions, mask = batch()
    for side_channel in (
        None,
        SimpleNamespace(config=lime_config(num_layers=2, hidden_size=32, num_attention_heads=4)),
    ):
        first_stage.side_channel = side_channel
        with pytest.raises(RuntimeError, match=r"needs lime_megatron\.parallel\.pipeline\.schedule_arguments"):
            first_stage(tokens, positions, mask)
