"""KV-cache decoding with megatron-core's ``StaticInferenceContext``, for LIMe and the baseline.

The context holds, per layer, megatron's key/value cache ``[max_length, batch, kv_heads, d]``
(``key_value_memory_dict``, keyed by layer number) and the number of positions already cached
(``sequence_len_offset``).  A decoding step feeds only the new tokens ``[b, s_new]``; every
attention layer appends its keys/values to its cache and attends over the cached prefix (the
prefill takes any number of tokens, every later step one token per sequence):

- the baseline through megatron's own ``SelfAttention`` inference path;
- LIMe through ``LimeSelfAttention``'s decoding branch, which routes the new tokens' keys/values
  (the step's layer-integrated memory holds only their raw K/V of all layers) and caches the
  routed ones: the same cache size as the baseline.

Batches of different prompt lengths are decoded the way megatron's static engine does it: every
sequence of the batch is at the same position (one shared ``sequence_len_offset``, RoPE positions
as in an unpadded forward, no padding masks); the prompt is prefilled up to the shortest prompt's
length and, while a longer prompt still has tokens, the step feeds that prompt token instead of a
generated one (``lime_megatron.inference.generation``).

The caches are allocated here on the model's device (megatron's lazy allocation calls
``torch.cuda.current_device()``), and the context is told to return the logits of every new
token (the default keeps only the last one).

Tensor parallelism (``checkpoint_model.load_model(..., tensor_parallel=N)``): every rank feeds the
same tokens; its cache holds its own key/value heads (``num_query_groups_per_partition``; LIMe
routes its input-head columns and reduce-scatters the routed heads, as in training,
``lime_megatron.models.lime.head_parallel``), and the logits are gathered over the vocabulary shards
(``runtime_gather_output``), so every rank returns the full ``[b, s, padded vocab]``.
"""

from __future__ import annotations

import torch
from megatron.core.inference.contexts import StaticInferenceContext

from lime_megatron.models.gpt_model import LimeGPTModel


def kv_cache_context(model: LimeGPTModel, batch_size: int, max_length: int) -> StaticInferenceContext:
    """A static inference context with an empty cache of ``max_length`` positions for
    ``batch_size`` sequences in every attention layer of ``model`` (its device and dtype)."""
    if not (model.pre_process and model.post_process):
        raise NotImplementedError("KV-cache decoding runs on a model without pipeline stages (PP=1)")
    context = StaticInferenceContext(batch_size, max_length)
    _materialize_all_logits(context)
    weight = next(model.parameters())
    for layer in model.decoder.layers:
        attention = layer.self_attention
        shape = (max_length, batch_size, attention.num_query_groups_per_partition)
        context.key_value_memory_dict[attention.layer_number] = (
            weight.new_empty(*shape, attention.key_hidden_size),
            weight.new_empty(*shape, attention.val_hidden_size),
        )
    return context


def _materialize_all_logits(context: StaticInferenceContext) -> None:
    """Have the model return logits for every new token, not just the last (megatron 0.16 keeps
    the flag on the context, 0.19 on its ``config``)."""
    holder = getattr(context, "config", None)
    if holder is None or not hasattr(holder, "materialize_only_last_token_logits"):
        holder = context
    holder.materialize_only_last_token_logits = False


@torch.no_grad()
def decode_step(model: LimeGPTModel, context: StaticInferenceContext, tokens: torch.Tensor) -> torch.Tensor:
    """Feed the new tokens ``[b, s_new]`` (positions ``offset .. offset + s_new - 1``); returns their
    logits ``[b, s_new, padded vocab]`` and advances the context by ``s_new``.

    The prefill (offset 0) takes any ``s_new``; after it, a step takes one token per sequence:
    megatron's decode path attends every new query to the whole cache without a causal mask over
    the new tokens, so several new tokens after a prefill are refused (ValueError)."""
    offset = context.sequence_len_offset
    batch, new = tokens.shape
    if offset + new > context.max_sequence_length:
        raise ValueError(f"decoding past the cache: positions up to {offset + new} of {context.max_sequence_length}")
    if offset > 0 and new != 1:
        raise ValueError(
            f"decode_step after the prefill takes one new token per sequence, got {new} "
            f"(at offset {offset}); feed them one step at a time"
        )
    if offset > 0:
        context.enable_decode_mode()
    positions = torch.arange(offset, offset + new, device=tokens.device).expand(batch, new)
    logits = model(tokens, positions, None, inference_context=context, runtime_gather_output=True)
    context.increment_sequence_len_offset(new)
    return logits


@torch.no_grad()
def full_logits(model: LimeGPTModel, tokens: torch.Tensor) -> torch.Tensor:
    """Logits ``[b, s, padded vocab]`` (gathered over tensor-parallel ranks) of a full causal
    forward over ``tokens`` ``[b, s]`` (no cache)."""
    batch, length = tokens.shape
    positions = torch.arange(length, device=tokens.device).expand(batch, length)
    return model(tokens, positions, None, runtime_gather_output=True)
