"""lime_megatron.generation and tools/generate.py: the KV cache generates what recomputing the
full sequence per token generates (greedy and sampled), sampling is reproducible with a seed,
top-k/top-p restrict the choice, and generation stops at stop strings and the end of document."""

from __future__ import annotations

import pytest
import torch
from decoding_fixtures import char_tokenizer
from lime_fixtures import tiny_model

from lime_megatron.generation import Generator, SamplingOptions, sample_next
from lime_megatron.parallel import initialize_parallel

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]

PROMPTS = ["1 + 2 = ", "(7 + 5) x 3", "ab"]


@pytest.fixture(scope="module", autouse=True)
def megatron():
    initialize_parallel()


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return char_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="module")
def lime():
    return tiny_model(num_query_groups=2, lime_router="full").eval()


@pytest.mark.parametrize("lime_flag", [True, False], ids=["lime", "baseline"])
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_cache_generates_what_full_recomputation_generates(tokenizer, lime_flag, temperature):
    model = tiny_model(num_query_groups=2, lime=lime_flag).eval()
    options = SamplingOptions(max_new_tokens=10, temperature=temperature, seed=3, stop_at_eod=False)
    cached = Generator(model, tokenizer).generate(PROMPTS, options)
    recomputed = Generator(model, tokenizer, use_cache=False).generate(PROMPTS, options)
    assert [len(tokens) for tokens in cached.tokens] == [10] * len(PROMPTS)
    assert cached.tokens == recomputed.tokens and cached.texts == recomputed.texts
    assert cached.stopped_by == ["length"] * len(PROMPTS)


def test_a_prompts_continuation_does_not_depend_on_its_batch(tokenizer, lime):
    options = SamplingOptions(max_new_tokens=6)
    batched = Generator(lime, tokenizer).generate(PROMPTS, options)
    for index, prompt in enumerate(PROMPTS):
        assert Generator(lime, tokenizer).generate([prompt], options).tokens[0] == batched.tokens[index]


def test_sampling_is_reproducible_with_a_seed(tokenizer, lime):
    def run(**kwargs):
        options = SamplingOptions(max_new_tokens=12, temperature=1.5, stop_at_eod=False, **kwargs)
        return Generator(lime, tokenizer).generate(PROMPTS, options).tokens

    assert run(seed=5) == run(seed=5)
    assert run(seed=5) != run(seed=6)
    greedy = Generator(lime, tokenizer).generate(PROMPTS, SamplingOptions(max_new_tokens=12, stop_at_eod=False))
    assert run(seed=5, top_k=1) == greedy.tokens
    assert run(seed=5, top_p=1e-6) == greedy.tokens


def test_top_k_and_top_p_keep_only_the_most_likely_tokens():
    logits = torch.log(torch.tensor([[0.5, 0.1, 0.3, 0.1]] * 2000))
    generator = torch.Generator().manual_seed(0)
    top2 = sample_next(logits, SamplingOptions(temperature=1.0, top_k=2), generator)
    assert set(top2.tolist()) == {0, 2}
    # 0.5 alone does not reach 0.7, 0.5 + 0.3 does: {0, 2}
    nucleus = sample_next(logits, SamplingOptions(temperature=1.0, top_p=0.7), generator)
    assert set(nucleus.tolist()) == {0, 2}
    share = (nucleus == 0).double().mean().item()
    assert abs(share - 0.5 / 0.8) < 0.05


def test_stop_strings_and_end_of_document(tokenizer, lime):
    options = SamplingOptions(max_new_tokens=12, stop_at_eod=False)
    free = Generator(lime, tokenizer).generate(PROMPTS[:1], options)
    text, tokens = free.texts[0], free.tokens[0]
    stop = text[4:6]
    cut = text.find(stop)
    stopped = Generator(lime, tokenizer).generate(PROMPTS[:1], SamplingOptions(max_new_tokens=12, stop_strings=(stop,)))
    assert stopped.texts == [text[:cut]] and stopped.stopped_by == ["stop string"]
    assert stopped.tokens[0] == tokens[: cut + len(stop)]
    eod = tokens[5]
    first = tokens.index(eod)
    ended = Generator(lime, tokenizer, eod=eod).generate(PROMPTS[:1], SamplingOptions(max_new_tokens=12))
    assert ended.tokens == [tokens[:first]] and ended.stopped_by == ["eod"]


def test_bad_options_and_prompts_fail_with_one_message(tokenizer, lime):
    with pytest.raises(ValueError, match="top_p must be in"):
        SamplingOptions(top_p=0)
    with pytest.raises(ValueError, match="empty prompt"):
        Generator(lime, tokenizer).generate([""], SamplingOptions())
    with pytest.raises(ValueError, match="need a tokenizer"):
        Generator(lime).generate(["text"], SamplingOptions())
