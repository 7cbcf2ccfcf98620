"""CPU stand-ins of TransformerEngine's linear layers and of megatron's TransformerEngine layer spec,
for the tests of the specs built from it (the ``transformer_engine_stand_ins`` fixture of this
folder's ``conftest.py`` installs them)."""

from __future__ import annotations

import dataclasses
from functools import partial

import torch
from megatron.core.tensor_parallel import ColumnParallelLinear


class NormFusedLinear(ColumnParallelLinear):
    """Stand-in of TransformerEngine's ``TELayerNormColumnParallelLinear``: RMSNorm, then the
    column-parallel product (its own ``layer_norm_weight``)."""

    def __init__(self, input_size: int, *args, config, **kwargs):
        super().__init__(input_size, *args, config=config, **kwargs)
        self.layer_norm_weight = torch.nn.Parameter(torch.ones(input_size, dtype=config.params_dtype))

    def forward(self, hidden, *args, **kwargs):
        normed = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + 1e-5) * self.layer_norm_weight
        return super().forward(normed, *args, **kwargs)


class PlainLinear(ColumnParallelLinear):
    """Stand-in of TransformerEngine's ``TEColumnParallelLinear``."""


def install(monkeypatch) -> None:
    """megatron's TransformerEngine spec on CPU: ``megatron.core.extensions.transformer_engine``
    (which imports without TransformerEngine) given the stand-ins above (and the local final norm), and
    ``get_gpt_layer_with_transformer_engine_spec`` shaped as megatron's (the RMSNorms fused into
    ``linear_qkv`` and ``linear_fc1``, the layer's norms ``IdentityOp``)."""
    from megatron.core.extensions import transformer_engine as extension
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer.identity_op import IdentityOp

    from lime_megatron.models.norm import TorchNorm

    stand_ins = {
        "TEColumnParallelLinear": PlainLinear,
        "TELayerNormColumnParallelLinear": NormFusedLinear,
        "TENorm": TorchNorm,
    }
    for name, stand_in in stand_ins.items():
        monkeypatch.setattr(extension, name, stand_in, raising=False)

    def te_spec():
        local = gpt_layer_specs.get_gpt_layer_local_spec()
        attention, mlp = local.submodules.self_attention, local.submodules.mlp
        if isinstance(mlp, partial):  # megatron 0.19: partial(MLP.as_mlp_submodule, submodules=...)
            fused = dataclasses.replace(mlp.keywords["submodules"], linear_fc1=NormFusedLinear)
            mlp = partial(mlp.func, *mlp.args, **{**mlp.keywords, "submodules": fused})
        else:
            mlp = dataclasses.replace(mlp, submodules=dataclasses.replace(mlp.submodules, linear_fc1=NormFusedLinear))
        return dataclasses.replace(
            local,
            submodules=dataclasses.replace(
                local.submodules,
                input_layernorm=IdentityOp,
                pre_mlp_layernorm=IdentityOp,
                mlp=mlp,
                self_attention=dataclasses.replace(
                    attention, submodules=dataclasses.replace(attention.submodules, linear_qkv=NormFusedLinear)
                ),
            ),
        )

    monkeypatch.setattr(gpt_layer_specs, "get_gpt_layer_with_transformer_engine_spec", te_spec)
