"""Hyper-Connections (the paper's second baseline) against an independent float64 reference of the
official code (``tests/reference_hc.py``): logits, loss and every gradient on the same weights,
dynamic and static, n = 2 and 4, MHA and GQA; the official initial values; recompute; the paper's
Table 8 parameter counts; one clear error per invalid configuration; TransformerEngine's spec
(on CPU stand-ins of its linear layers) equal to the local one."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from lime_megatron.models.config import PAPER_1B, PAPER_VOCAB_SIZE, LimeConfigError, lime_config
from lime_megatron.models.gpt_model import build_model
from lime_megatron.parallel.process_groups import initialize_parallel as init_single_process
from tests.lime_fixtures import (
    RECOMPUTE,
    compare_with_reference,
    recompute_gradient_errors,
    tiny_model,
    twin_errors,
)
from tests.models.te_stand_ins import PlainLinear
from tests.reference_hc import forward as reference_forward

TOLERANCE = 1e-10

# Paper Table 8, the HC rows (1B models): kv heads -> (billions as printed, exact count here).
TABLE_8_HC = {8: (1.07640, 1_076_400_960), 32: (1.17706, 1_177_064_256)}


@pytest.fixture(scope="module", autouse=True)
def megatron():
    init_single_process()


def hc_model(streams: int, static: bool = False, **overrides):
    """A tiny HC model whose hyper-connection parameters are moved off their initial values
    (zero dynamic weights would hide a wrong dynamic path from the logits)."""
    model = tiny_model(lime=False, hyper_connections=streams, hyper_connections_static=static, **overrides)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".hc_" in name:
                param.add_(0.3 * torch.randn(param.shape, generator=generator, dtype=param.dtype))
    return model


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("streams", [2, 4])
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_matches_official_reference(kv_heads, streams, static):
    model = hc_model(streams, static, num_query_groups=kv_heads)
    result = compare_with_reference(model, reference_forward)
    assert result["logits"] <= TOLERANCE and result["loss"] <= TOLERANCE
    per_connection = 2 if static else 6
    assert sum(".hc_" in name for name in result["grads"]) == 2 * per_connection * model.config.num_layers
    for name, (error, size) in result["grads"].items():
        assert size > 0 and error <= TOLERANCE, f"{name}: relative gradient error {error:.2e}, |grad| {size:.1e}"


@pytest.mark.parametrize("streams", [2, 4])
def test_official_initial_values(streams):
    model = tiny_model(lime=False, hyper_connections=streams)
    for layer in model.decoder.layers:
        index = layer.layer_number - 1
        for connection in (layer.hc_attn, layer.hc_mlp):
            expected_alpha = torch.cat([torch.zeros(streams, 1), torch.eye(streams)], dim=1).double()
            expected_alpha[index % streams, 0] = 1.0
            assert torch.equal(connection.static_alpha, expected_alpha)
            assert torch.equal(connection.static_beta, torch.ones(streams, dtype=torch.float64))
            assert not connection.dynamic_alpha_fn.any() and not connection.dynamic_beta_fn.any()
            assert connection.dynamic_alpha_fn.shape == (model.config.hidden_size, streams + 1)
            assert connection.dynamic_alpha_scale.item() == connection.dynamic_beta_scale.item() == 0.01
    assert not any("layernorm" in name for name, _ in model.decoder.layers.named_parameters())


@pytest.mark.parametrize("recompute", list(RECOMPUTE.values()), ids=list(RECOMPUTE))
def test_activation_recompute_gives_the_same_gradients(recompute):
    errors = recompute_gradient_errors(partial(hc_model, 4, num_query_groups=2), recompute)
    assert all(error <= TOLERANCE for error in errors.values()), errors


@pytest.mark.parametrize("kv_heads", list(TABLE_8_HC), ids=["HC-GQA8", "HC-MHA"])
def test_paper_table_8_parameter_counts(kv_heads):
    config = lime_config(
        **PAPER_1B,
        num_query_groups=kv_heads,
        lime=False,
        hyper_connections=4,
        use_cpu_initialization=True,
        perform_initialization=False,
    )
    with torch.device("meta"):
        model = build_model(config, vocab_size=PAPER_VOCAB_SIZE, max_sequence_length=2048)
    count = sum(p.numel() for p in model.parameters())
    paper_billions, exact = TABLE_8_HC[kv_heads]
    assert round(count / 1e9, 5) == paper_billions
    assert count == exact


@pytest.mark.parametrize(
    "overrides,message",
    [
        (dict(hyper_connections=-1), "must be >= 1, or 0"),
        (dict(hyper_connections_static=True), "needs hyper_connections >= 1"),
        (dict(hyper_connections=4, lime=True), "set lime=False"),
        (dict(hyper_connections=4, hidden_dropout=0.1), "without hidden dropout"),
        (
            dict(hyper_connections=4, recompute_granularity="selective", recompute_modules=["core_attn", "mlp"]),
            r"recompute only core_attn selectively, not \['mlp'\]",
        ),
    ],
)
def test_invalid_configurations_raise_one_clear_error(overrides, message):
    settings = dict(lime=False, num_layers=2, hidden_size=32, num_attention_heads=4)
    with pytest.raises(LimeConfigError, match=message):
        lime_config(**{**settings, **overrides})


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_transformer_engine_spec_unfuses_the_norms_and_equals_local(transformer_engine_stand_ins, static):
    """On TransformerEngine's spec the two norm-fused linear layers become the plain ones and the
    norms the parameter-free LayerNorm: same parameters as the local spec, same logits and
    gradients on the same weights."""
    from lime_megatron.models.hyper_connections.connection import LayerNormWithoutAffine
    from lime_megatron.models.layer_specs import lime_layer_spec

    local = hc_model(2, static, num_query_groups=2)
    spec = lime_layer_spec(local.config, "transformer_engine").submodules
    mlp = spec.mlp.keywords["submodules"] if isinstance(spec.mlp, partial) else spec.mlp.submodules
    assert spec.self_attention.submodules.linear_qkv is PlainLinear and mlp.linear_fc1 is PlainLinear
    assert spec.input_layernorm is LayerNormWithoutAffine and spec.pre_mlp_layernorm is LayerNormWithoutAffine
    engine = build_model(
        local.config, local.vocab_size, local.max_sequence_length, transformer_impl="transformer_engine"
    )
    engine.load_state_dict(local.state_dict())  # strict: the same parameters, no fused norm weights
    loss_error, grad_errors = twin_errors(local, engine)
    assert loss_error <= TOLERANCE and max(grad_errors.values()) <= TOLERANCE, grad_errors


def test_transformer_engine_spec_without_a_fused_norm_is_refused(transformer_engine_stand_ins, monkeypatch):
    from megatron.core.models.gpt import gpt_layer_specs

    from lime_megatron.models.layer_specs import lime_layer_spec

    monkeypatch.setattr(
        gpt_layer_specs, "get_gpt_layer_with_transformer_engine_spec", gpt_layer_specs.get_gpt_layer_local_spec
    )
    config = lime_config(lime=False, hyper_connections=2, num_layers=2, hidden_size=32, num_attention_heads=4)
    with pytest.raises(LimeConfigError, match="norm-fused linear_qkv.*'ColumnParallelLinear'"):
        lime_layer_spec(config, "transformer_engine")


@pytest.mark.parametrize("kv_heads", list(TABLE_8_HC), ids=["HC-GQA8", "HC-MHA"])
def test_flags_and_dry_run_count_table_8(kv_heads):
    """``--hyper-connections 4`` through the trainer's flags: the dry run's parameter count is Table 8's
    (the GPT-2 vocabulary unpadded), at PP=1 and over TP2 x PP2 x VPP2 (vocabulary made even)."""
    from lime_megatron.planning import estimate
    from lime_megatron.training import arguments
    from lime_megatron.training.run_config import RunConfig

    shape = [
        "--num-layers",
        "16",
        "--hidden-size",
        "2048",
        "--ffn-hidden-size",
        "8192",
        "--num-attention-heads",
        "32",
        "--seq-length",
        "2048",
        "--micro-batch-size",
        "1",
        "--global-batch-size",
        "4",
        "--mock-data",
        "--hyper-connections",
        "4",
        "--dry-run",
    ]
    if kv_heads == 8:
        shape += ["--group-query-attention", "--num-query-groups", "8"]
    layouts = {
        (): 0,
        (
            "--tensor-model-parallel-size",
            "2",
            "--pipeline-model-parallel-size",
            "2",
            "--num-layers-per-virtual-pipeline-stage",
            "4",
        ): 1,
    }
    for layout, padding in layouts.items():
        run = RunConfig.from_namespace(arguments.parse_args([*shape, *layout, "--dry-run-world-size", "4"]))
        assert run.name == "HC"
        result = estimate.estimate(
            arguments.transformer_config(run),
            vocab_size=PAPER_VOCAB_SIZE + padding,
            seq_length=2048,
            micro_batch_size=1,
            num_microbatches=4,
        )
        assert result.total_parameters == TABLE_8_HC[kv_heads][1] + padding * 2048
