"""Layer specs: megatron's GPT layer specs with LIMe's layer and attention swapped in.

``lime_layer_spec`` starts from megatron-core's own spec for the chosen ``transformer_impl``
(megatron's name and values: ``local``: megatron-only modules, runs on CPU;
``transformer_engine``: TransformerEngine linear layers, fused attention, bf16/FP8 on GPU) and
replaces two module classes, so both get identical LIMe wiring:

- the layer: ``LimeTransformerLayer`` (binds the pass's memory to its attention),
- self-attention: ``LimeSelfAttention`` (routes K/V through the memory);

and, for the dynamic router on TransformerEngine, takes the input norm out of ``linear_qkv``
(its logits read the normalised input).

With ``config.lime`` False the untouched megatron spec is returned (the LLaMA baseline);
with ``config.hyper_connections`` the Hyper-Connections layer built from it
(``lime_megatron.models.hyper_connections.spec``).
"""

from __future__ import annotations

import dataclasses

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_layer import TransformerLayer

from lime_megatron.models.config import LimeTransformerConfig
from lime_megatron.models.hyper_connections.spec import hyper_connection_layer_spec, without_fused_norm
from lime_megatron.models.lime.attention import LimeSelfAttention
from lime_megatron.models.lime.memory import LayerIntegratedMemory
from lime_megatron.models.norm import TorchNorm

TRANSFORMER_IMPLS = ("local", "transformer_engine")


class LimeTransformerLayer(TransformerLayer):
    """megatron ``TransformerLayer`` whose attention reads the pass's layer-integrated memory.

    The memory arrives as the handle megatron threads through every layer as ``context``
    (``lime_megatron.models.gpt_model.LimeGPTModel`` puts it there); it is bound to the attention only for
    the duration of the call, so recomputation in backward binds the right pass's memory.
    """

    def forward(self, *args, **kwargs):
        """Same inputs and outputs as ``TransformerLayer.forward``."""
        self.self_attention.memory = LayerIntegratedMemory.from_handle(kwargs.get("context"))
        try:
            return super().forward(*args, **kwargs)
        finally:
            self.self_attention.memory = None


def megatron_layer_spec(config: LimeTransformerConfig, transformer_impl: str) -> ModuleSpec:
    """megatron-core's GPT layer spec for ``transformer_impl`` (the LLaMA baseline layer).

    The local layer's norms are ``TorchNorm`` (megatron's ``WrappedTorchNorm`` refuses
    sequence parallelism); TransformerEngine fuses the input norm into its QKV linear layer.
    """
    if transformer_impl == "local":
        spec = get_gpt_layer_local_spec(normalization=config.normalization)
        submodules = dataclasses.replace(spec.submodules, input_layernorm=TorchNorm, pre_mlp_layernorm=TorchNorm)
        return dataclasses.replace(spec, submodules=submodules)
    if transformer_impl == "transformer_engine":
        # Imported here: TransformerEngine exists on GPU machines only.
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_with_transformer_engine_spec,
        )

        return get_gpt_layer_with_transformer_engine_spec()
    raise ValueError(f"unknown transformer_impl {transformer_impl!r}; choose one of {TRANSFORMER_IMPLS}")


def lime_layer_spec(config: LimeTransformerConfig, transformer_impl: str = "local") -> ModuleSpec:
    """The layer spec for ``config``: LIMe's layer/attention (or the Hyper-Connections layer) on
    megatron's spec for ``transformer_impl``."""
    if config.hyper_connections:
        return hyper_connection_layer_spec(
            transformer_impl,
            lambda: megatron_layer_spec(config, transformer_impl),
            manifold=config.hyper_connections_manifold,
        )
    spec = megatron_layer_spec(config, transformer_impl)
    if not config.lime:
        return spec
    submodules = spec.submodules
    if config.lime_router == "dynamic" and transformer_impl == "transformer_engine":
        submodules = _unfused_input_norm(submodules)
    attention = dataclasses.replace(submodules.self_attention, module=LimeSelfAttention)
    submodules = dataclasses.replace(submodules, self_attention=attention)
    return dataclasses.replace(spec, module=LimeTransformerLayer, submodules=submodules)


def _unfused_input_norm(submodules):
    """TransformerEngine's layer ``submodules`` with the input RMSNorm taken out of ``linear_qkv``
    (``TENorm`` as the layer's ``input_layernorm``): the dynamic router's logits read the
    normalised input the attention receives (``dynamic_router``)."""
    from megatron.core.extensions.transformer_engine import TENorm  # GPU machines only

    attention = without_fused_norm(submodules.self_attention, "linear_qkv", "the dynamic LIMe router")
    return dataclasses.replace(submodules, input_layernorm=TENorm, self_attention=attention)


def lime_block_spec(
    config: LimeTransformerConfig, transformer_impl: str = "local", vp_stage: int | None = None
) -> TransformerBlockSubmodules:
    """The decoder spec of this pipeline rank's chunk ``vp_stage``: ``lime_layer_spec`` for each
    of its layers and the final norm (``TorchNorm`` locally, TransformerEngine's norm on TE)."""
    if transformer_impl == "transformer_engine":
        from megatron.core.extensions.transformer_engine import TENorm as final_norm
    else:
        final_norm = TorchNorm
    layers = [lime_layer_spec(config, transformer_impl)] * get_num_layers_to_build(config, vp_stage=vp_stage)
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=final_norm)
