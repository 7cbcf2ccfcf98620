"""Manifold-constrained Hyper-Connections (mHC, ``--hyper-connections-manifold``) against an
independent float64 reference of megatron-core main's equations (``tests/reference_mhc.py``):
logits, loss and every gradient on the same weights, n = 2 and 4, MHA and GQA; the Sinkhorn
projection; megatron's initial values, drawn the same at every pipeline split; recompute; the
TransformerEngine spec (its fused norms kept); one clear error per invalid configuration."""

from __future__ import annotations

import math
from functools import partial

import pytest
import torch

from lime_megatron.models.config import LimeConfigError, lime_config
from lime_megatron.models.gpt_model import build_model
from lime_megatron.models.hyper_connections.manifold import ManifoldHyperConnection, sinkhorn
from lime_megatron.parallel.process_groups import initialize_parallel
from tests.lime_fixtures import RECOMPUTE, compare_with_reference, recompute_gradient_errors, tiny_model, twin_errors
from tests.models.te_stand_ins import NormFusedLinear
from tests.reference_mhc import forward as reference_forward

TOLERANCE = 1e-10


@pytest.fixture(scope="module", autouse=True)
def megatron():
    initialize_parallel()


def mhc_model(streams: int, **overrides):
    """A tiny mHC model whose gates and biases are moved off their initial values (0.01 and 0
    would make the dynamic mappings nearly constant and hide a wrong path)."""
    model = tiny_model(lime=False, hyper_connections=streams, hyper_connections_manifold=True, **overrides)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("alpha_pre", "alpha_post", "alpha_res", "bias")) and ".hc_" in name:
                param.add_(0.5 * torch.randn(param.shape, generator=generator, dtype=param.dtype))
    return model


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("streams", [2, 4])
def test_matches_the_reference_of_megatrons_equations(kv_heads, streams):
    model = mhc_model(streams, num_query_groups=kv_heads, hyper_connections_sinkhorn_iterations=7)
    result = compare_with_reference(model, reference_forward)
    assert result["logits"] <= TOLERANCE and result["loss"] <= TOLERANCE
    names = result["grads"]
    assert sum(".hc_" in name for name in names) == 2 * 5 * model.config.num_layers
    norms = sum(name.endswith(("input_layernorm.weight", "pre_mlp_layernorm.weight")) for name in names)
    assert norms == 2 * model.config.num_layers  # the LLaMA RMSNorms stay
    for name, (error, size) in result["grads"].items():
        assert size > 0, name
        if name == FLAT_GRADIENT:
            flat = dict(model.named_parameters())[name].grad
            assert (flat - result["reference_grads"][name]).abs().max() <= 1e-13
            continue
        assert error <= TOLERANCE, f"{name}: relative gradient error {error:.2e}"


FLAT_GRADIENT = "decoder.layers.0.hc_attn.alpha_res"
"""Layer 0's streams are n equal copies of the embedding, which a column-stochastic mixing leaves
unchanged: this gate's gradient is zero up to rounding (~1e-15), so it is compared absolutely."""


def test_the_sinkhorn_iterations_change_the_model():
    """The reference follows ``hyper_connections_sinkhorn_iterations`` (7 above); the model with
    another count computes something else."""
    model = mhc_model(4, hyper_connections_sinkhorn_iterations=1)
    assert compare_with_reference(model, reference_forward)["logits"] <= TOLERANCE
    twenty = compare_with_reference(
        model, lambda params, tokens, spec: reference_forward(params, tokens, {**spec, "sinkhorn_iterations": 20})
    )
    assert twenty["logits"] > 1e-6


def test_the_residual_mixing_is_doubly_stochastic():
    logits = torch.randn(64, 4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    matrix = sinkhorn(logits, 20)
    assert (matrix > 0).all()
    ones = torch.ones(64, 4, dtype=torch.float64)
    assert torch.allclose(matrix.sum(-2), ones, atol=1e-5) and torch.allclose(matrix.sum(-1), ones, atol=1e-5)
    assert not torch.allclose(sinkhorn(logits, 1).sum(-1), ones, atol=1e-2)  # one iteration: columns only


@pytest.mark.parametrize("streams", [2, 4])
def test_megatrons_initial_values(streams):
    model = tiny_model(lime=False, hyper_connections=streams, hyper_connections_manifold=True)
    hidden = model.config.hidden_size
    weights = []
    for layer in model.decoder.layers:
        for connection in (layer.hc_attn, layer.hc_mlp):
            assert isinstance(connection, ManifoldHyperConnection)
            for alpha in (connection.alpha_pre, connection.alpha_post, connection.alpha_res):
                assert alpha.item() == pytest.approx(0.01)
            assert connection.bias.shape == (streams * streams + 2 * streams,) and not connection.bias.any()
            weight = connection.mapping_proj.weight
            bound = math.sqrt(6 / (streams * hidden + streams * streams + 2 * streams))  # Xavier-uniform
            assert weight.shape == (streams * streams + 2 * streams, streams * hidden)
            assert 0.9 * bound < weight.abs().max().item() <= bound
            weights.append(weight.detach())
    assert all(not torch.equal(a, b) for a, b in zip(weights, weights[1:]))  # drawn per layer and connection


def test_a_pipeline_chunk_draws_the_single_process_mappings():
    """Virtual stage 1 of PP2 x VPP2 (global layers 3, 4 of 5... here 4 layers: layer 3 at index 0)
    gets the single-process model's mHC weights for those layers (keyed by layer and name)."""
    settings = dict(
        num_layers=4,
        hidden_size=32,
        ffn_hidden_size=48,
        num_attention_heads=4,
        lime=False,
        hyper_connections=2,
        hyper_connections_manifold=True,
        use_cpu_initialization=True,
    )
    full = dict(build_model(lime_config(**settings), 96, 12).named_parameters())
    split = dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2, pipeline_dtype=torch.float32)
    chunk = build_model(lime_config(**settings, **split), 96, 12, pre_process=False, post_process=True, vp_stage=1)
    assert [layer.layer_number for layer in chunk.decoder.layers] == [3]
    for name, param in chunk.named_parameters():
        if ".hc_" in name:
            assert torch.equal(param, full[name.replace("decoder.layers.0.", "decoder.layers.2.")]), name


@pytest.mark.parametrize("recompute", list(RECOMPUTE.values()), ids=list(RECOMPUTE))
def test_activation_recompute_gives_the_same_gradients(recompute):
    errors = recompute_gradient_errors(partial(mhc_model, 4, num_query_groups=2), recompute)
    assert all(error <= TOLERANCE for error in errors.values()), errors


def test_transformer_engine_spec_keeps_the_fused_norms_and_equals_local(transformer_engine_stand_ins):
    """mHC keeps the LLaMA RMSNorms, so TransformerEngine's norm-fused linear layers stay; with the
    local norms' weights moved into them, logits and gradients equal the local spec's."""
    from lime_megatron.models.layer_specs import lime_layer_spec

    local = mhc_model(2, num_query_groups=2)
    spec = lime_layer_spec(local.config, "transformer_engine").submodules
    assert spec.self_attention.submodules.linear_qkv is NormFusedLinear
    engine = build_model(
        local.config, local.vocab_size, local.max_sequence_length, transformer_impl="transformer_engine"
    )
    engine.load_state_dict({fused_norm_name(name): tensor for name, tensor in local.state_dict().items()})
    loss_error, grad_errors = twin_errors(local, engine, fused_norm_name)
    assert loss_error <= TOLERANCE and max(grad_errors.values()) <= TOLERANCE, grad_errors


def fused_norm_name(name: str) -> str:
    """The name of a local-spec parameter in TransformerEngine's spec (the norms inside the linear layers)."""
    return name.replace("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight").replace(
        "pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"
    )


@pytest.mark.parametrize(
    "overrides,message",
    [
        (dict(hyper_connections_manifold=True), "hyper_connections_manifold needs hyper_connections >= 1"),
        (
            dict(hyper_connections=4, hyper_connections_manifold=True, hyper_connections_static=True),
            "choose one Hyper-Connections variant",
        ),
        (
            dict(hyper_connections=4, hyper_connections_manifold=True, hyper_connections_sinkhorn_iterations=0),
            "sinkhorn_iterations must be >= 1; got 0",
        ),
    ],
)
def test_invalid_configurations_raise_one_clear_error(overrides, message):
    with pytest.raises(LimeConfigError, match=message):
        lime_config(lime=False, num_layers=2, hidden_size=32, num_attention_heads=4, **overrides)
