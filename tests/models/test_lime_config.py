"""Configuration checks and the paper's Table 8 parameter counts (built on the meta device)."""

from __future__ import annotations

import pytest
import torch
from lime_fixtures import TABLE_8

from lime_megatron.models.config import PAPER_1B, PAPER_VOCAB_SIZE, LimeConfigError, lime_config
from lime_megatron.models.gpt_model import build_model
from lime_megatron.models.lime.router import router_parameter_count
from lime_megatron.parallel.process_groups import initialize_parallel as init_single_process


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
    config = lime_config(num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                         lime_router="last", lime_router_window=2)
    assert router_parameter_count(config) == 4 * (2 + 2 + 2)
    average = lime_config(num_layers=4, hidden_size=32, num_attention_heads=4, lime_router="average")
    assert router_parameter_count(average) == 0
