"""LIMe self-attention: megatron's ``SelfAttention`` attending with routed keys/values (paper §4).

Per layer l (``layer_number - 1``), with X the layer input ``[s, b, hidden]``:

1. Q, K_l, V_l = linear_qkv(X)                        (megatron, unchanged; Eq. 1)
2. write K_l, V_l into the layer-integrated memory   (``lime_megatron.models.lime.memory``)
3. K~, V~ = R^(l) . buffer[sources(l)]                (Eq. 2, one router for K and V)
4. RoPE on Q and on the routed K~                      (positions after routing)
5. out = linear_proj(attention(Q, K~, V~))            (megatron's core attention, unchanged)

Queries are the layer's own.  The core attention is whatever the spec gives (megatron's
``DotProductAttention`` on CPU, TransformerEngine's fused attention on GPU), so LIMe keeps
flash/fused kernels.

KV-cache decoding (``inference_context``: megatron's ``StaticInferenceContext``) runs steps 1-3 on
the step's new tokens only (``memory.route_new_tokens``: the pass's memory holds just their raw
K/V of all layers) and hands the routed K~, V~ to megatron's own ``_adjust_key_value_for_inference``,
which appends them to the layer's cache and returns the cached sequence; RoPE and attention then
run as in megatron's ``SelfAttention``.  Routing mixes heads at one position and RoPE rotates all
heads of a position alike, so caching routed keys before RoPE (megatron's cache layout) gives the
full forward's keys: the cache is the baseline's size, ``[max length, batch, kv_heads, d]`` per
layer.  Packed sequences, fused RoPE and flash decode are rejected with a clear error.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.enums import AttnMaskType

from lime_megatron.models.config import reject_options_bypassing_lime
from lime_megatron.models.lime.dynamic_router import (
    DynamicLimeRouter,
    route_keys_values_by_token,
    route_new_tokens_by_token,
)
from lime_megatron.models.lime.head_parallel import HeadSharding
from lime_megatron.models.lime.memory import LayerIntegratedMemory, route_keys_values, route_new_tokens
from lime_megatron.models.lime.recompute import Rebuilt, recompute_in_backward, routed_kv_log
from lime_megatron.models.lime.router import LimeRouter


class LimeSelfAttention(SelfAttention):
    """``SelfAttention`` with a ``LimeRouter``; reads ``self.memory``, which the enclosing
    ``LimeTransformerLayer`` binds for the duration of each call."""

    def __init__(self, config, submodules, layer_number, attn_mask_type=AttnMaskType.causal, **kwargs):
        super().__init__(config, submodules, layer_number, attn_mask_type=attn_mask_type, **kwargs)
        reject_options_bypassing_lime(config)  # again here: options set after the config was made
        sharding = HeadSharding(
            config.kv_heads, self.tp_group.rank() if self.world_size > 1 else 0, self.world_size, self.tp_group
        )
        layer = layer_number - 1
        dynamic = config.lime_router == "dynamic" and layer > 0
        self.router = (
            DynamicLimeRouter(config, layer, sharding, self.tp_group)
            if dynamic
            else LimeRouter(config, layer, sharding)
        )
        self.memory: LayerIntegratedMemory | None = None

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None,
        key_value_states=None,
        inference_context=None,
        rotary_pos_emb=None,
        rotary_pos_cos=None,
        rotary_pos_sin=None,
        rotary_pos_cos_sin=None,
        attention_bias=None,
        packed_seq_params=None,
        sequence_len_offset=None,
        **unsupported,
    ):
        """[s, b, hidden] -> (output [s, b, hidden], bias); see the module docstring."""
        _reject_unsupported(
            key_value_states=key_value_states,
            packed_seq_params=packed_seq_params,
            rotary_pos_cos=rotary_pos_cos,
            rotary_pos_sin=rotary_pos_sin,
            rotary_pos_cos_sin=rotary_pos_cos_sin,
            attention_bias=attention_bias,
            sequence_len_offset=sequence_len_offset,
            **unsupported,
        )
        if inference_context is not None:
            return self._decoding_forward(hidden_states, attention_mask, inference_context, rotary_pos_emb)
        query, key, value = self.get_query_key_value_tensors(hidden_states)
        if self.router.dynamic:
            (key, value), probs = route_keys_values_by_token(self.memory, self.router, hidden_states, key, value)
        else:
            (key, value), probs = route_keys_values(self.memory, self.router, key, value), None
        routed_keys = key
        if rotary_pos_emb is not None:
            q_freqs, k_freqs = rotary_pos_emb if isinstance(rotary_pos_emb, tuple) else (rotary_pos_emb,) * 2
            query = self._rotate(query, q_freqs)
            key = self._rotate(key, k_freqs)
        else:
            k_freqs = None
        with self._recompute_routed(routed_keys, key, value, k_freqs, probs):
            context = self._attend(query, key, value, attention_mask)
        return self.linear_proj(context)

    def _decoding_forward(self, hidden_states, attention_mask, inference_context, rotary_pos_emb):
        """One KV-cache decoding step on the new tokens ``hidden_states`` [s_new, b, hidden]:
        route their K/V (Eq. 2), append them to the cache (megatron), attend over the cache."""
        if not inference_context.is_static_batching():
            raise NotImplementedError(
                "LIMe decodes with megatron's StaticInferenceContext; dynamic batching "
                "(paged KV cache) is not supported"
            )
        if self.config.flash_decode:
            raise NotImplementedError("LIMe decoding does not support flash_decode")
        query, key, value = self.get_query_key_value_tensors(hidden_states)
        if self.router.dynamic:
            key, value = route_new_tokens_by_token(self.memory, self.router, hidden_states, key, value)
        else:
            key, value = route_new_tokens(self.memory, self.router, key, value)
        if rotary_pos_emb is not None and not isinstance(rotary_pos_emb, tuple):
            rotary_pos_emb = (rotary_pos_emb,) * 2
        query, key, value, rotary_pos_emb, attn_mask_type, _ = self._adjust_key_value_for_inference(
            inference_context, query, key, value, rotary_pos_emb
        )
        if rotary_pos_emb is not None:
            query = self._rotate(query, rotary_pos_emb[0])
            key = self._rotate(key, rotary_pos_emb[1])
        context = self.core_attention(query, key, value, attention_mask, attn_mask_type=attn_mask_type)
        return self.linear_proj(context)

    def _rotate(self, tensor: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        """RoPE on ``[s, b, heads, d]``: TransformerEngine's fused kernel with
        ``config.apply_rope_fusion`` (``lime_megatron.parallel.fusions``; it takes the fp32 ``[s, 1, 1, d]``
        frequencies megatron's ``RotaryEmbedding`` gives and saves only them for backward, so the
        rebuilt rotated keys of ``_recompute_routed`` come out of the same kernel with the same
        layout), else megatron's unfused one."""
        return apply_rotary_pos_emb(tensor, freqs, config=self.config, cp_group=self.pg_collection.cp)

    def _attend(self, query, key, value, attention_mask) -> torch.Tensor:
        """megatron's core attention (selectively recomputed when the config asks for it)."""
        if self.checkpoint_core_attention and self.training:
            return self._checkpointed_attention_forward(
                query, key, value, attention_mask, attn_mask_type=self.attn_mask_type
            )
        return self.core_attention(query, key, value, attention_mask, attn_mask_type=self.attn_mask_type)

    def _recompute_routed(
        self, routed_keys: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_freqs, probs: torch.Tensor | None
    ):
        """With ``config.lime_recompute_routed_kv``, drop the routed keys/values and the rotated keys
        from attention's saved tensors; backward rebuilds them from the memory buffer (a dynamic
        router's from its weights ``probs``, which its backward keeps anyway).  What was dropped and
        rebuilt is counted in ``recompute.routed_kv_log`` (which warns once if the core attention
        kept copies)."""
        if not (self.config.lime_recompute_routed_kv and torch.is_grad_enabled()):
            return nullcontext()
        log, layer = routed_kv_log, self.router.layer
        routed_again = Rebuilt(self._routed_rebuild(probs), log.rebuilt(layer, "routed"))
        rebuilds = {
            routed_keys: Rebuilt(lambda: routed_again.value()[0]),
            value: Rebuilt(lambda: routed_again.value()[1]),
        }
        if k_freqs is not None:
            rebuilds[key] = Rebuilt(
                lambda: self._rotate(routed_again.value()[0], k_freqs), log.rebuilt(layer, "rotated keys")
            )
        return log.recording(
            layer, type(self.core_attention).__name__, recompute_in_backward(rebuilds, {"keys": key, "values": value})
        )

    def _routed_rebuild(self, probs: torch.Tensor | None):
        """The recipe of this layer's routed keys and values (``[s, b, local kv heads, d]`` each) from
        the memory buffer, for backward (no autograd graph held)."""
        memory, router = self.memory, self.router
        kept_probs = None if probs is None else probs.detach()

        def rebuild():
            if router.dynamic:
                return memory.by_token.mix_by_token(router, kept_probs, "rebuild")
            return memory.routing.mix(router, memory.stacked.rebuilt_earlier_partial(router), "rebuild")

        return rebuild


def _reject_unsupported(**arguments) -> None:
    """Raise for any megatron attention feature LIMe's forward does not implement."""
    given = sorted(name for name, value in arguments.items() if value is not None)
    if given:
        raise NotImplementedError(
            f"LIMe self-attention does not support {', '.join(given)} "
            "(no cross-attention, packed sequences, precomputed RoPE cos/sin or flash decode)"
        )
