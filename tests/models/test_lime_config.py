"""Configuration checks and the paper's Table 8 parameter counts (built on the meta device)."""

from __future__ import annotations

import pytest
import torch

from lime_megatron.models.config import PAPER_1B, PAPER_VOCAB_SIZE, LimeConfigError, lime_config
from lime_megatron.models.gpt_model import build_model
from lime_megatron.models.lime.router import router_parameter_count
from lime_megatron.parallel.process_groups import initialize_parallel as init_single_process
from tests.lime_fixtures import TABLE_8


@pytest.mark.parametrize("name,lime,kv_heads", list(TABLE_8), ids=[k[0] for k in TABLE_8])
def test_paper_table_8_parameter_counts(name, lime, kv_heads):
    init_single_process()
    config = lime_config(
        **PAPER_1B,
        num_query_groups=kv_heads,
        lime=lime,
        use_cpu_initialization=True,
        perform_initialization=False,
    )
    with torch.device("meta"):
        model = build_model(config, vocab_size=PAPER_VOCAB_SIZE, max_sequence_length=2048)
    count = sum(p.numel() for p in model.parameters())
    print(f"{name}: {count:,} parameters")
    paper_billions, exact = TABLE_8[(name, lime, kv_heads)]
    assert round(count / 1e9, 5) == paper_billions
    assert count == exact
    assert router_parameter_count(config) == (kv_heads**2 * (16 * 17 // 2 - 1) if lime else 0)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (dict(num_query_groups=3), "must divide num_attention_heads"),
        (dict(lime_router="softmax"), "unknown LIMe router variant"),
        (dict(lime_router="last", lime_router_window=0), "needs lime_router_window >= 1"),
        (dict(lime_router="first"), "needs lime_router_window >= 1"),
        (dict(lime_router="full", lime_router_window=2), "only applies to"),
    ],
)
def test_invalid_configurations_raise_one_clear_error(overrides, message):
    with pytest.raises(LimeConfigError, match=message):
        lime_config(num_layers=2, hidden_size=32, num_attention_heads=4, **overrides)


def test_router_count_for_windowed_variants():
    # last-2 over 4 layers: layers 1..3 read 2 layers each; first-1: layers 1..3 read 2 each too
    config = lime_config(
        num_layers=4,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=2,
        lime_router="last",
        lime_router_window=2,
    )
    assert router_parameter_count(config) == 4 * (2 + 2 + 2)
    average = lime_config(num_layers=4, hidden_size=32, num_attention_heads=4, lime_router="average")
    assert router_parameter_count(average) == 0


BYPASSING = {  # every option of OPTIONS_BYPASSING_LIME that is a TransformerConfig field, switched on
    "cuda_graph_impl": "local",
    "enable_cuda_graph": True,
    "external_cuda_graph": True,
    "overlap_moe_expert_parallel_comm": True,
    "context_parallel_size": 2,
    "attention_output_gate": True,
    "no_rope_freq": 2,
    "qk_clip": True,
    "fine_grained_activation_offloading": True,
    "fused_single_qkv_rope": True,
    "multi_latent_attention": True,
    "experimental_attention_variant": "gated_delta_net",
}


def test_every_bypassing_option_is_tested():
    from lime_megatron.models.config import OPTIONS_BYPASSING_LIME

    assert set(OPTIONS_BYPASSING_LIME) == {*BYPASSING, "yarn_rotary_scaling_factor"}


@pytest.mark.parametrize("option, value", BYPASSING.items(), ids=list(BYPASSING))
def test_options_that_bypass_lime_fail_naming_the_option(option, value):
    with pytest.raises(LimeConfigError, match=rf"^{option}={value!r} is not supported with LIMe: "):
        lime_config(num_layers=2, hidden_size=32, num_attention_heads=4, **{option: value})


def test_yarn_scaling_set_after_the_config_fails_when_the_attention_is_built():
    """megatron reads YaRN's mscale from ``yarn_rotary_scaling_factor`` if the config has that
    attribute (not a TransformerConfig field: probed by name); LimeSelfAttention checks again."""
    init_single_process()
    config = lime_config(num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True)
    build_model(config, vocab_size=64, max_sequence_length=8)  # builds without it
    config.yarn_rotary_scaling_factor = 4.0
    with pytest.raises(LimeConfigError, match="^yarn_rotary_scaling_factor=4.0 is not supported with LIMe: YaRN"):
        build_model(config, vocab_size=64, max_sequence_length=8)


def test_the_baseline_keeps_megatron_attention_options():
    config = lime_config(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        lime=False,
        attention_output_gate=True,
        qk_clip=True,
        no_rope_freq=2,
    )
    assert config.attention_output_gate and config.qk_clip and config.no_rope_freq == [0, 1]
