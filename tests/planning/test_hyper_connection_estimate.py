"""The dry run's activation bytes for Hyper-Connections against what autograd really saves
(``SavedTensorBytes``, one forward with loss of a built model, in-process at TP=1)."""

from __future__ import annotations

import pytest
import torch
from test_estimate import SAVED_BYTES_SLACK, one_chunk, saved_bytes, tiny_config

from lime_megatron.parallel.process_groups import initialize_parallel

HC = dict(lime=False, hyper_connections=4)
SAVED_CASES = {
    "hc4": HC,
    "hc2": dict(HC, hyper_connections=2),
    "hc4-static-gqa": dict(HC, hyper_connections_static=True, num_query_groups=2),
    "hc4-one-layer": dict(HC, num_layers=1),
    "hc4-selective": dict(HC, recompute_granularity="selective"),
    "hc4-full-uniform": dict(HC, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    "hc4-full-block": dict(HC, recompute_granularity="full", recompute_method="block", recompute_num_layers=2),
    "hc4-bf16": dict(HC, bf16=True, params_dtype=torch.bfloat16),
}


@pytest.mark.parametrize("overrides", SAVED_CASES.values(), ids=SAVED_CASES.keys())
def test_activation_estimate_equals_saved_tensor_bytes(overrides):
    initialize_parallel()
    config = tiny_config(**overrides)
    _, chunk = one_chunk(config)
    llama = one_chunk(tiny_config(**{**overrides, "hyper_connections": 0, "hyper_connections_static": False}))[1]
    measured = saved_bytes(config)
    assert abs(chunk.activations.total - measured) <= SAVED_BYTES_SLACK
    assert measured > llama.activations.total  # the streams cost something
