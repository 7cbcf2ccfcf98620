"""The dry run's activation bytes for Hyper-Connections (HC and mHC) against what autograd really saves
(``SavedTensorBytes``, one forward with loss of a built model, in-process at TP=1)."""

from __future__ import annotations

import pytest
import torch

from lime_megatron.parallel.process_groups import initialize_parallel
from tests.planning.test_estimate import SAVED_BYTES_SLACK, one_chunk, saved_bytes, tiny_config

HC = dict(lime=False, hyper_connections=4)
MHC = dict(HC, hyper_connections_manifold=True)
SAVED_CASES = {
    "hc4": HC,
    "hc2": dict(HC, hyper_connections=2),
    "hc4-static-gqa": dict(HC, hyper_connections_static=True, num_query_groups=2),
    "hc4-one-layer": dict(HC, num_layers=1),
    "hc4-selective": dict(HC, recompute_granularity="selective"),
    "hc4-full-uniform": dict(HC, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    "hc4-full-block": dict(HC, recompute_granularity="full", recompute_method="block", recompute_num_layers=2),
    "hc4-bf16": dict(HC, bf16=True, params_dtype=torch.bfloat16),
    "mhc4": dict(MHC),
    "mhc2-gqa": dict(MHC, hyper_connections=2, num_query_groups=2),
    "mhc4-one-layer": dict(MHC, num_layers=1),
    "mhc4-selective": dict(MHC, recompute_granularity="selective"),
    "mhc4-full-uniform": dict(MHC, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    "mhc4-full-block": dict(MHC, recompute_granularity="full", recompute_method="block", recompute_num_layers=2),
    "mhc4-bf16": dict(MHC, bf16=True, params_dtype=torch.bfloat16),
    "mhc4-bf16-one-layer": dict(MHC, bf16=True, params_dtype=torch.bfloat16, num_layers=1),
}


@pytest.mark.parametrize("overrides", SAVED_CASES.values(), ids=SAVED_CASES.keys())
def test_activation_estimate_equals_saved_tensor_bytes(overrides):
    initialize_parallel()
    config = tiny_config(**overrides)
    _, chunk = one_chunk(config)
    plain = dict(hyper_connections=0, hyper_connections_static=False, hyper_connections_manifold=False)
    llama = one_chunk(tiny_config(**{**overrides, **plain}))[1]
    measured = saved_bytes(config)
    assert abs(chunk.activations.total - measured) <= SAVED_BYTES_SLACK
    assert measured > llama.activations.total  # the streams cost something
