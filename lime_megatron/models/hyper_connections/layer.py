"""megatron's ``TransformerLayer`` with n residual streams joined by two hyper-connections.

The layer (official ``LlamaHCDecoderLayer``) computes, for streams ``H`` ``[s, b, n, hidden]``:
``H = hc_attn(H, attention o LN)``, then ``H = hc_mlp(H, mlp o LN)`` (``connection.HyperConnection``;
LN is the parameter-free LayerNorm that replaces LLaMA's two RMSNorms; with mHC the connections are
``manifold.ManifoldHyperConnection`` and LN the LLaMA RMSNorms). The first layer of the
model expands the embedding ``[s, b, hidden]`` into n equal streams; the last one sums the streams
(``[s, b, hidden]``) for megatron's final norm, as the official model sums them before its norm
(mHC, ``manifold.ManifoldHyperConnection``, averages them, as megatron-core main does).

**Between layers and pipeline stages** the streams are megatron's own hidden-state tensor with the
streams folded into its batch dimension, ``[s, b * n, hidden]`` (the contiguous ``[s, b, n, hidden]``,
a free view either way). Why the batch and not the sequence dimension: megatron derives RoPE's length
from the stage tensor's first dimension on later pipeline stages (``get_rotary_seq_len``), which
folding into the sequence would multiply by n; sequence parallelism splits that first dimension, so
it still splits positions, never streams. The pipeline schedule is told ``micro_batch_size * n``
(``LimeTransformerConfig.residual_streams``, used by ``lime_megatron.training.trainer.run_schedule``),
so megatron's p2p buffers have the right shape and its own send/receive order carries the streams:
no side channel, nothing that could interleave with megatron's messages under NCCL. (megatron
0.16.1 and 0.19.2 use the schedule's ``micro_batch_size`` for nothing but that shape:
``get_tensor_shapes`` and the interleaved schedule's ``tensor_shape``.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules
from megatron.core.utils import make_viewless_tensor

from lime_megatron.models.hyper_connections.connection import HyperConnection

ATTENTION_ARGUMENTS = (
    "attention_mask",
    "inference_context",
    "rotary_pos_emb",
    "rotary_pos_cos",
    "rotary_pos_sin",
    "rotary_pos_cos_sin",
    "attention_bias",
    "packed_seq_params",
    "sequence_len_offset",
)
"""The keyword arguments megatron's block hands a layer that its self-attention takes."""


@dataclass
class HyperConnectionLayerSubmodules(TransformerLayerSubmodules):
    """megatron's layer submodules plus the two hyper-connections (official names)."""

    hc_attn: ModuleSpec | type = HyperConnection
    hc_mlp: ModuleSpec | type = HyperConnection


class HyperConnectionTransformerLayer(TransformerLayer):
    """A decoder layer of the Hyper-Connections model; inputs and outputs as megatron's layer except
    the hidden state: ``[s, b, hidden]`` into the first layer and out of the last, the streams
    ``[s, b * n, hidden]`` everywhere else (see the module docstring)."""

    def __init__(self, config, submodules: HyperConnectionLayerSubmodules, *args, **kwargs):
        super().__init__(config, submodules, *args, **kwargs)
        layer = self.layer_number - 1
        self.hc_attn = build_module(submodules.hc_attn, config=self.config, layer=layer)
        self.hc_mlp = build_module(submodules.hc_mlp, config=self.config, layer=layer)

    def forward(self, hidden_states: torch.Tensor, context=None, **kwargs):
        """One layer on the streams; returns (hidden state, ``context``) as megatron's layer."""
        attention_kwargs = {name: kwargs[name] for name in ATTENTION_ARGUMENTS if name in kwargs}

        def attention(hidden: torch.Tensor) -> torch.Tensor:
            return _without_bias(self.self_attention(self.input_layernorm(hidden), **attention_kwargs))

        def mlp(hidden: torch.Tensor) -> torch.Tensor:
            return _without_bias(self.mlp(self.pre_mlp_layernorm(hidden)))

        streams = self.hc_attn(self._streams_in(hidden_states), attention)
        streams = self.hc_mlp(streams, mlp)
        return self._streams_out(streams), context

    def _streams_in(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[s, b, n, hidden]``: the embedding expanded (first layer) or the folded streams unfolded."""
        streams = self.config.hyper_connections
        if self.layer_number == 1:
            return hidden_states.unsqueeze(2).expand(-1, -1, streams, -1)
        return hidden_states.unflatten(1, (-1, streams))

    def _streams_out(self, streams: torch.Tensor) -> torch.Tensor:
        """The streams contracted to one (last layer: the connection's ``contract``) or folded into the
        batch, as a tensor that is not a view
        (megatron's pipeline frees stage outputs in place)."""
        if self.layer_number == self.config.num_layers:
            return self.hc_mlp.contract(streams)
        return make_viewless_tensor(streams.flatten(1, 2), requires_grad=True, keep_graph=True)


def _without_bias(output_with_bias: tuple[torch.Tensor, torch.Tensor | None]) -> torch.Tensor:
    """A megatron sublayer's (output, bias) as one tensor."""
    output, bias = output_with_bias
    return output if bias is None else output + bias
