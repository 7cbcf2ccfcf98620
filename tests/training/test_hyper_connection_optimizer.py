"""The optimizer groups of Hyper-Connections: the official code's (``--weight-decay-grouping
official``: static parameters not decayed, every dynamic one decayed, all at the main learning rate)
and megatron's rule (1-D parameters not decayed); mHC's under both (megatron's rule)."""

from __future__ import annotations

import pytest
import torch
from megatron.core.optimizer import OptimizerConfig

from lime_megatron.models.config import lime_config
from lime_megatron.parallel.process_groups import initialize_parallel
from lime_megatron.training.optimizer import build_optimizer
from lime_megatron.training.trainer import build_model_chunks

OFFICIAL_DECAYED = {
    "static_alpha": False,
    "static_beta": False,
    "dynamic_alpha_fn": True,
    "dynamic_alpha_scale": True,
    "dynamic_beta_fn": True,
    "dynamic_beta_scale": True,
}
MEGATRON_DECAYED = {
    "static_alpha": True,
    "static_beta": False,
    "dynamic_alpha_fn": True,
    "dynamic_alpha_scale": False,
    "dynamic_beta_fn": False,
    "dynamic_beta_scale": False,
}

MANIFOLD_DECAYED = {"weight": True, "alpha_pre": False, "alpha_post": False, "alpha_res": False, "bias": False}
"""mHC under either grouping: megatron's rule (``mapping_proj.weight`` decayed, the 1-D gates and bias not)."""


@pytest.mark.parametrize(
    "grouping,expected,variant",
    [
        ("official", OFFICIAL_DECAYED, {}),
        ("megatron", MEGATRON_DECAYED, {}),
        ("official", MANIFOLD_DECAYED, dict(hyper_connections_manifold=True)),
        ("megatron", MANIFOLD_DECAYED, dict(hyper_connections_manifold=True)),
    ],
)
def test_hyper_connection_weight_decay_and_learning_rate(grouping, expected, variant):
    initialize_parallel()
    config = lime_config(
        num_layers=2,
        hidden_size=16,
        ffn_hidden_size=32,
        num_attention_heads=2,
        lime=False,
        hyper_connections=2,
        use_cpu_initialization=True,
        **variant,
    )
    chunks = build_model_chunks(config, 32, 8)
    optimizer = build_optimizer(
        chunks, OptimizerConfig(optimizer="adam", lr=1e-3, weight_decay=0.1, params_dtype=torch.float32), None, grouping
    )
    names = {id(param): name for chunk in chunks for name, param in chunk.module.named_parameters()}
    groups = {names[id(param)]: group for group in optimizer.param_groups for param in group["params"]}
    connections = {name: group for name, group in groups.items() if ".hc_" in name}
    assert len(connections) == 2 * 2 * len(expected)
    for name, group in connections.items():
        assert (group["wd_mult"] > 0) == expected[name.rpartition(".")[2]], name
        assert group["lr_mult"] == 1.0 and group["max_lr"] == 1e-3, name
    norms = [group for name, group in groups.items() if "layernorm" in name]
    assert norms and all(group["wd_mult"] == 0 for group in norms)
