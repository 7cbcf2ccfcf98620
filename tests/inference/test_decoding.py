"""KV-cache decoding (lime_megatron.inference.decoding) against the full forward, float64.

Prefill plus one token at a time gives the logits of one full causal forward (every router
variant, dynamic included, MHA and GQA, LIMe on both routing paths, the baseline and
Hyper-Connections); a batch of different prompt
lengths decoded at one shared position gives each sequence's own unpadded forward; LIMe's cache is the baseline's size
and a decoding step's layer-integrated memory holds only the new tokens.
"""

from __future__ import annotations

import pytest
import torch

from lime_megatron.inference.decoding import decode_step, full_logits, kv_cache_context
from tests.decoding_fixtures import incremental_logits
from tests.lime_fixtures import VOCAB, relative_error, tiny_model

pytestmark = [
    pytest.mark.usefixtures("megatron"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]

TOLERANCE = 1e-10
LENGTH = 12
PREFILL = 5

MODELS = [
    dict(lime_router="full"),
    dict(lime_router="average"),
    dict(lime_router="last", lime_router_window=2),
    dict(lime_router="first", lime_router_window=2),
    dict(lime_router="dynamic"),  # per-token weights of the new tokens only
    dict(lime_router="full", lime_routing_kernel="triton"),  # Eqs. 1-2 in one launch per layer and step
    dict(lime_router="last", lime_router_window=2, lime_routing_block=2, lime_routing_kernel="triton"),
    dict(lime=False),
    dict(lime=False, hyper_connections=4),  # Hyper-Connections: the streams are per position
    dict(lime=False, hyper_connections=4, hyper_connections_manifold=True),  # mHC: so are its mappings
]


def _tokens(batch: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, LENGTH), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("options", MODELS, ids=lambda v: "-".join(map(str, v.values())))
def test_incremental_logits_equal_the_full_forward(kv_heads, options):
    model = tiny_model(num_query_groups=kv_heads, **options).eval()
    tokens = _tokens(2)
    full = full_logits(model, tokens)
    incremental = incremental_logits(model, tokens, PREFILL)
    assert incremental.shape == full.shape
    for position in range(PREFILL - 1, LENGTH):
        assert relative_error(incremental[:, position], full[:, position]) <= TOLERANCE, position
    # the cache is really read: decoding the last token without its prefix changes the logits
    alone = decode_step(model, kv_cache_context(model, 2, 1), tokens[:, -1:])
    assert relative_error(alone[:, 0], full[:, -1]) > 1e-3


@pytest.mark.parametrize(
    "options",
    [MODELS[0], MODELS[2], MODELS[4], dict(lime=False), MODELS[6]],
    ids=["full", "last-2", "dynamic", "baseline", "last-2 triton"],
)
def test_prompts_of_different_lengths_decode_like_each_alone(options):
    """Shared-position decoding (megatron's static engine): prefill to the shortest prompt, then
    one position per step; each sequence's logits equal its own unpadded forward's."""
    model = tiny_model(num_query_groups=2, **options).eval()
    lengths = [PREFILL, LENGTH, 8]
    tokens = _tokens(3, seed=1)
    incremental = incremental_logits(model, tokens, min(lengths))
    for row, length in enumerate(lengths):
        alone = full_logits(model, tokens[row : row + 1, :length])[0]
        assert relative_error(incremental[row, min(lengths) - 1 : length], alone[min(lengths) - 1 :]) <= TOLERANCE


@pytest.mark.parametrize("router", ["full", "dynamic"])
def test_lime_cache_is_the_baselines_and_a_step_buffers_only_new_tokens(router):
    lime, baseline = (tiny_model(num_query_groups=2, lime=flag, lime_router=router).eval() for flag in (True, False))
    shapes = {
        name: [[tuple(t.shape) for t in pair] for pair in caches.values()]
        for name, caches in (
            ("lime", kv_cache_context(lime, 3, LENGTH).key_value_memory_dict),
            ("baseline", kv_cache_context(baseline, 3, LENGTH).key_value_memory_dict),
        )
    }
    assert shapes["lime"] == shapes["baseline"] == [[(LENGTH, 3, 2, 8)] * 2] * 5
    buffers = []
    last = lime.decoder.layers[-1].self_attention
    last.register_forward_hook(
        lambda module, args, output: buffers.append(tuple(module.memory.key_values.buffer.shape))
    )
    context = kv_cache_context(lime, 3, LENGTH)
    tokens = _tokens(3)
    decode_step(lime, context, tokens[:, :PREFILL])
    decode_step(lime, context, tokens[:, PREFILL : PREFILL + 1])
    # rows: layers x kv heads; columns: (k|v) x new tokens x batch x head dim
    assert buffers == [(5 * 2, 2 * PREFILL * 3 * 8), (5 * 2, 2 * 1 * 3 * 8)]


def test_decoding_refuses_autograd_and_overlong_input():
    model = tiny_model(num_query_groups=2).eval()
    context = kv_cache_context(model, 1, 4)
    positions = torch.arange(3)[None]
    with pytest.raises(RuntimeError, match="without autograd"):
        model(_tokens(1)[:, :3], positions, None, inference_context=context, runtime_gather_output=True)
    with pytest.raises(ValueError, match="decoding past the cache"):
        decode_step(model, kv_cache_context(model, 1, 4), _tokens(1)[:, :5])


def test_several_new_tokens_after_the_prefill_are_refused():
    """megatron's decode path has no causal mask over the new tokens: a multi-token step after
    the prefill is refused with one message, and the context is left where it was."""
    model = tiny_model(num_query_groups=2).eval()
    context = kv_cache_context(model, 2, LENGTH)
    tokens = _tokens(2)
    decode_step(model, context, tokens[:, :PREFILL])
    with pytest.raises(ValueError, match="takes one new token per sequence, got 2"):
        decode_step(model, context, tokens[:, PREFILL : PREFILL + 2])
    assert context.sequence_len_offset == PREFILL
