"""Dynamic LIMe (v1, ``models.lime.dynamic_router``) against the plain reference (float64), its
initialisation, parameter count and the options it rejects (its saved bytes: tests/planning)."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from lime_megatron.models.config import LimeConfigError, lime_config
from lime_megatron.models.gpt_model import build_model
from lime_megatron.models.layer_specs import lime_layer_spec
from lime_megatron.models.lime.dynamic_router import DynamicLimeRouter
from lime_megatron.models.lime.router import router_parameter_count
from lime_megatron.parallel.process_groups import initialize_parallel
from lime_megatron.planning.estimate import estimate
from lime_megatron.planning.flops import forward_flops_per_token
from tests.lime_fixtures import (
    RECOMPUTE,
    batch,
    compare_with_reference,
    megatron_logits,
    recompute_gradient_errors,
    tiny_model,
    twin_errors,
)
from tests.reference_lime import forward as reference_forward

TOLERANCE = 1e-10
V1_DYNAMIC_1B = 1_185_583_104
"""v1 Table 6's Dynamic LIMe, 1.1856B: the exact count at the v1 shape (LLaMA 1,176,735,744
plus 2048 * 32 * 135 router weights)."""


@pytest.fixture(scope="module", autouse=True)
def megatron():
    initialize_parallel()


def routers_of(model) -> list[DynamicLimeRouter]:
    return [module for module in model.modules() if isinstance(module, DynamicLimeRouter)]


@pytest.mark.parametrize("rebuild", [False, True], ids=["kept", "rebuilt"])
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_matches_reference_logits_and_gradients(kv_heads, rebuild):
    model = tiny_model(lime_router="dynamic", num_query_groups=kv_heads, lime_recompute_routed_kv=rebuild)
    result = compare_with_reference(model, reference_forward)
    assert result["logits"] <= TOLERANCE and result["loss"] <= TOLERANCE
    assert len(routers_of(model)) == model.config.num_layers - 1
    for name, (error, magnitude) in result["grads"].items():
        assert magnitude > 0, f"{name} has no gradient"
        assert error <= TOLERANCE, f"{name}: relative gradient error {error:.2e}"


@pytest.mark.parametrize("recompute", list(RECOMPUTE.values()), ids=list(RECOMPUTE))
def test_activation_recompute_gives_the_same_gradients(recompute):
    errors = recompute_gradient_errors(partial(tiny_model, lime_router="dynamic", num_query_groups=2), recompute)
    assert all(error <= TOLERANCE for error in errors.values()), errors


def test_initialisation_starts_near_the_plain_transformer():
    """W_l = 0 at any seed: the own layer gets 0.9 of every token's weight, each earlier layer 0.1 / l."""
    config = lime_config(
        num_layers=5,
        hidden_size=32,
        ffn_hidden_size=48,
        num_attention_heads=4,
        num_query_groups=2,
        lime_router="dynamic",
        params_dtype=torch.float64,
    )
    model = build_model(config, vocab_size=96, max_sequence_length=12)
    hidden = torch.randn(3, 2, model.config.hidden_size, dtype=torch.float64)
    for router in routers_of(model):
        assert torch.count_nonzero(router.weight) == 0
        assert getattr(router.weight, "is_lime_router", False)
        probs = router(hidden)
        assert probs.shape == (3, 2, 2, router.layer + 1)
        expected = torch.full((router.layer + 1,), 0.1 / router.layer, dtype=torch.float64)
        expected[-1] = 0.9
        assert torch.allclose(probs, expected.expand_as(probs), rtol=0, atol=1e-15)


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_parameter_count_built_and_estimated(kv_heads):
    config = lime_config(
        num_layers=5,
        hidden_size=32,
        ffn_hidden_size=48,
        num_attention_heads=4,
        num_query_groups=kv_heads,
        lime_router="dynamic",
        use_cpu_initialization=True,
    )
    model = tiny_model(lime_router="dynamic", num_query_groups=kv_heads)
    routers = sum(router.weight.numel() for router in routers_of(model))
    assert routers == 32 * kv_heads * (2 + 3 + 4 + 5) == router_parameter_count(config)
    result = estimate(config, vocab_size=96, seq_length=12, micro_batch_size=2, num_microbatches=1)
    assert result.router_parameters == routers
    assert result.total_parameters == sum(p.numel() for p in model.parameters())


def test_v1_shape_has_the_issue_count():
    from lime_megatron.models.config import PAPER_1B

    config = lime_config(**PAPER_1B, lime_router="dynamic")
    result = estimate(config, vocab_size=50257, seq_length=2048, micro_batch_size=1, num_microbatches=1)
    assert result.total_parameters == V1_DYNAMIC_1B
    assert result.router_parameters == 2048 * 32 * 135
    # forward FLOPs (matrix products): logits 2 h g + mixing 2 * 2 g d per source, +0.76% of LLaMA
    llama = lime_config(**PAPER_1B, lime=False)
    dynamic, baseline = (forward_flops_per_token(c, 2048, 50304) for c in (config, llama))
    assert dynamic - baseline == 135 * (2 * 2048 * 32 + 2 * 2 * 32 * 64)
    assert round(dynamic / baseline - 1, 4) == 0.0076


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(lime_routing_block=2), "lime_routing_block 2 is not supported with the dynamic router"),
        (dict(num_query_groups=1, tensor_model_parallel_size=2), "divisible by the tensor-parallel size"),
    ],
)
def test_unsupported_options_fail_with_one_clear_message(overrides, message):
    with pytest.raises(LimeConfigError, match=message):
        lime_config(num_layers=2, hidden_size=32, num_attention_heads=4, lime_router="dynamic", **overrides)


def test_transformer_engine_spec_unfuses_the_input_norm_and_equals_local(transformer_engine_stand_ins):
    """On TransformerEngine's spec the dynamic router needs the normalised input: the norm leaves
    ``linear_qkv`` (the plain column-parallel layer) for the layer's ``input_layernorm``; the
    model then has the local spec's parameters (the MLP's norm still fused) and gives its loss and
    gradients."""
    from lime_megatron.models.norm import TorchNorm
    from tests.models.te_stand_ins import PlainLinear

    local = tiny_model(lime_router="dynamic", num_query_groups=2)
    spec = lime_layer_spec(local.config, "transformer_engine").submodules
    assert spec.self_attention.submodules.linear_qkv is PlainLinear and spec.input_layernorm is TorchNorm
    engine = build_model(
        local.config, local.vocab_size, local.max_sequence_length, transformer_impl="transformer_engine"
    )

    def in_engine(name):  # the MLP's norm stays fused into linear_fc1
        return name.replace("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight")

    engine.load_state_dict({in_engine(name): value for name, value in local.state_dict().items()})  # strict
    loss_error, grad_errors = twin_errors(local, engine, in_engine)
    assert loss_error <= TOLERANCE and max(grad_errors.values()) <= TOLERANCE, grad_errors


def test_logits_differ_from_the_static_router():
    """The per-token weights matter: the same model with other W_l gives other logits."""
    tokens, positions, mask = batch()
    first, second = tiny_model(lime_router="dynamic", seed=0), tiny_model(lime_router="dynamic", seed=1)
    assert not torch.allclose(
        megatron_logits(first, tokens, positions, mask), megatron_logits(second, tokens, positions, mask)
    )
