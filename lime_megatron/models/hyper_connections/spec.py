"""The Hyper-Connections layer spec: megatron's LLaMA layer spec with the residual replaced.

From the spec ``lime_megatron.models.layer_specs.megatron_layer_spec`` gives the baseline, the
attention and MLP are kept; the two RMSNorms become ``LayerNormWithoutAffine``, the residual
bias-dropout-adds become megatron's ``IdentityFuncOp`` (the hyper-connections add instead) and the
layer is ``HyperConnectionTransformerLayer`` with its two ``HyperConnection`` submodules.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from megatron.core.transformer.identity_op import IdentityFuncOp
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules

from lime_megatron.models.config import LimeConfigError
from lime_megatron.models.hyper_connections.connection import HyperConnection, LayerNormWithoutAffine
from lime_megatron.models.hyper_connections.layer import (
    HyperConnectionLayerSubmodules,
    HyperConnectionTransformerLayer,
)


def hyper_connection_layer_spec(transformer_impl: str, baseline: Callable[[], ModuleSpec]) -> ModuleSpec:
    """The Hyper-Connections layer built from megatron's baseline layer spec (``baseline()``); one
    ``LimeConfigError`` for TransformerEngine, whose spec fuses the RMSNorms into the linear layers."""
    if transformer_impl != "local":
        raise LimeConfigError(
            f"Hyper-Connections are built on megatron's local layer spec, not transformer_impl {transformer_impl!r}")
    submodules = baseline().submodules
    kept = {field.name: getattr(submodules, field.name) for field in dataclasses.fields(TransformerLayerSubmodules)}
    submodules = HyperConnectionLayerSubmodules(
        **{**kept, "input_layernorm": LayerNormWithoutAffine, "pre_mlp_layernorm": LayerNormWithoutAffine,
           "self_attn_bda": IdentityFuncOp, "mlp_bda": IdentityFuncOp},
        hc_attn=HyperConnection, hc_mlp=HyperConnection)
    return ModuleSpec(module=HyperConnectionTransformerLayer, submodules=submodules)
