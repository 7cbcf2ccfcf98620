"""The Hyper-Connections layer spec: megatron's LLaMA layer spec with the residual replaced.

From the spec ``lime_megatron.models.layer_specs.megatron_layer_spec`` gives the baseline, the
attention and MLP are kept; the two RMSNorms become ``LayerNormWithoutAffine``, the residual
bias-dropout-adds become megatron's ``IdentityFuncOp`` (the hyper-connections add instead) and the
layer is ``HyperConnectionTransformerLayer`` with its two ``HyperConnection`` submodules.

TransformerEngine's spec fuses each RMSNorm into the linear layer after it
(``TELayerNormColumnParallelLinear`` as ``linear_qkv`` and ``linear_fc1``, the layer's norms
``IdentityOp``); Hyper-Connections normalise a stream mixture the hyper-connection computes first,
with a LayerNorm without parameters, so those two linear layers become TransformerEngine's plain
``TEColumnParallelLinear`` and the norms ``LayerNormWithoutAffine``; TransformerEngine's core
attention and row-parallel layers stay.

mHC (``manifold=True``) keeps the LLaMA RMSNorms (fused or not) and replaces only the residual:
the bias-dropout-adds become ``IdentityFuncOp`` and the connections ``ManifoldHyperConnection``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import partial

from megatron.core.transformer.identity_op import IdentityFuncOp
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules

from lime_megatron.models.config import LimeConfigError
from lime_megatron.models.hyper_connections.connection import HyperConnection, LayerNormWithoutAffine
from lime_megatron.models.hyper_connections.layer import (
    HyperConnectionLayerSubmodules,
    HyperConnectionTransformerLayer,
)
from lime_megatron.models.hyper_connections.manifold import ManifoldHyperConnection


def hyper_connection_layer_spec(
    transformer_impl: str, baseline: Callable[[], ModuleSpec], manifold: bool = False
) -> ModuleSpec:
    """The Hyper-Connections layer built from megatron's baseline layer spec (``baseline()``) for
    ``transformer_impl`` (``local`` or ``transformer_engine``); ``manifold``: mHC."""
    submodules = baseline().submodules
    kept = {field.name: getattr(submodules, field.name) for field in dataclasses.fields(TransformerLayerSubmodules)}
    kept.update(self_attn_bda=IdentityFuncOp, mlp_bda=IdentityFuncOp)
    if manifold:
        return _hyper_connection_layer(kept, ManifoldHyperConnection)
    if transformer_impl == "transformer_engine":
        kept["self_attention"] = without_fused_norm(kept["self_attention"], "linear_qkv", "Hyper-Connections")
        kept["mlp"] = without_fused_norm(kept["mlp"], "linear_fc1", "Hyper-Connections")
    kept.update(input_layernorm=LayerNormWithoutAffine, pre_mlp_layernorm=LayerNormWithoutAffine)
    return _hyper_connection_layer(kept, HyperConnection)


def _hyper_connection_layer(submodules: dict, connection: type) -> ModuleSpec:
    """``HyperConnectionTransformerLayer`` of megatron's layer ``submodules`` and two ``connection``s."""
    return ModuleSpec(
        module=HyperConnectionTransformerLayer,
        submodules=HyperConnectionLayerSubmodules(**submodules, hc_attn=connection, hc_mlp=connection),
    )


def without_fused_norm(spec: ModuleSpec | partial, linear: str, model: str) -> ModuleSpec | partial:
    """``spec`` with its submodule ``linear`` (TransformerEngine's norm-fused column-parallel
    layer) replaced by TransformerEngine's column-parallel layer without a norm; ``model`` names
    who needs it in the error (Hyper-Connections here; ``layer_specs`` for the dynamic LIMe router,
    whose logits read the normalised input).  ``spec`` is a ``ModuleSpec``, or (megatron 0.19's MLP) a
    ``partial`` of a builder taking ``submodules=``."""
    from megatron.core.extensions.transformer_engine import (  # GPU machines only
        TEColumnParallelLinear,
        TELayerNormColumnParallelLinear,
    )

    submodules = spec.keywords["submodules"] if isinstance(spec, partial) else spec.submodules
    fused = getattr(submodules, linear)
    if fused is not TELayerNormColumnParallelLinear:
        raise LimeConfigError(
            f"{model} needs TransformerEngine's norm-fused {linear} in megatron's "
            f"spec, found {getattr(fused, '__name__', fused)!r}"
        )
    submodules = dataclasses.replace(submodules, **{linear: TEColumnParallelLinear})
    if isinstance(spec, partial):
        return partial(spec.func, *spec.args, **{**spec.keywords, "submodules": submodules})
    return dataclasses.replace(spec, submodules=submodules)
