"""lime_megatron.inference.generation and lime_megatron.cli.generate: the KV cache generates what recomputing the
full sequence per token generates (greedy and sampled), sampling is reproducible with a seed,
top-k/top-p restrict the choice, generation stops at stop strings and the end of document, and
the command line generates from a checkpoint what the module generates from the loaded model for
the prompt after the end-of-document token (or alone, ``--no-eod-prefix``), printing prompt and
continuation apart.

Tensor parallelism (2 gloo ranks, one launch): a checkpoint saved by one process, read at TP=2,
decodes with the KV cache to the one-process full forward's logits (float64) and generates the
one-process tokens, greedy and sampled, identically on both ranks, for LIMe (MHA, GQA, and one
key/value head shared by both ranks) and the baseline; the command line does the same.
"""

from __future__ import annotations

import contextlib
import io
import json

import pytest
import torch

from lime_megatron.cli import generate as tool
from lime_megatron.inference.decoding import full_logits
from lime_megatron.inference.generation import Generator, SamplingOptions, sample_next
from lime_megatron.interop.checkpoint_model import load_model
from lime_megatron.testing.distributed import run_distributed
from tests.decoding_fixtures import incremental_logits, tiny_checkpoint
from tests.lime_fixtures import relative_error, tiny_model

pytestmark = [
    pytest.mark.usefixtures("megatron"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]

PROMPTS = ["1 + 2 = ", "(7 + 5) x 3", "ab"]
TOLERANCE = 1e-10
PREFILL = 5
GREEDY = SamplingOptions(max_new_tokens=8, stop_at_eod=False)
SAMPLED = SamplingOptions(max_new_tokens=8, temperature=1.3, top_k=40, top_p=0.95, seed=11, stop_at_eod=False)
TENSOR_PARALLEL_MODELS = {
    "lime-mha": ("--lime", "--num-query-groups", "4"),
    "lime-gqa": ("--lime", "--lime-router", "last", "--lime-router-window", "2"),
    "lime-one-kv-head": ("--lime", "--num-query-groups", "1"),
    "baseline": (),
}


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


def test_generate_tool_reads_a_checkpoint_and_prompt_file(tmp_path, capsys):
    checkpoint, tokenizer = tiny_checkpoint(tmp_path, "--lime")
    (tmp_path / "prompts.txt").write_text("1 + 2 =\nab\n")
    output = tmp_path / "out.jsonl"
    status = tool.run(
        [
            checkpoint,
            "--prompt",
            "x = ",
            "--prompt-file",
            str(tmp_path / "prompts.txt"),
            "--max-new-tokens",
            "5",
            "--output",
            str(output),
        ]
    )
    assert status == 0 and "tokens/s (KV cache" in capsys.readouterr().out
    records = [json.loads(line) for line in output.read_text().splitlines()]
    prompts = ["x = ", "1 + 2 =", "ab"]
    expected = Generator(load_model(checkpoint).model, tokenizer).generate(
        [[tokenizer.eod, *tokenizer.tokenize(prompt)] for prompt in prompts], SamplingOptions(max_new_tokens=5)
    )
    assert [record["generation"] for record in records] == expected.texts
    assert tool.run([checkpoint]) == 1 and "no prompts" in capsys.readouterr().err


def test_generate_tool_prompts_after_the_end_of_document_token_and_prints_apart(tmp_path, capsys):
    """As scoring does (training puts EOD before every document), unless --no-eod-prefix; the
    prompt and its continuation are printed on their own labelled lines."""
    checkpoint, tokenizer = tiny_checkpoint(tmp_path)
    generator = Generator(load_model(checkpoint).model, tokenizer)
    options = SamplingOptions(max_new_tokens=6)
    for flags, prompt in (([], [tokenizer.eod, *tokenizer.tokenize("7 + 5 =")]), (["--no-eod-prefix"], "7 + 5 =")):
        assert tool.run([checkpoint, "--prompt", "7 + 5 =", "--max-new-tokens", "6", *flags]) == 0
        result = generator.generate([prompt], options)
        printed = capsys.readouterr().out.splitlines()
        assert printed[:4] == [
            "=== 1",
            "prompt:       '7 + 5 ='",
            f"continuation: {result.texts[0]!r}",
            f"({len(result.tokens[0])} new tokens, stopped by {result.stopped_by[0]})",
        ]
    assert tool.prompt_tokens(tokenizer, "") == [tokenizer.eod]  # an empty prompt starts a document


# --------------------------------------------------------------------------- tensor parallelism
def _tensor_parallel_decoding(checkpoints: dict[str, str], tokens: torch.Tensor, tool_argv: list[str]) -> dict:
    """On each of 2 ranks: every checkpoint read at TP=2 in float64; its cached and full logits,
    greedy and sampled tokens, local key/value heads, the cached logits with the two ranks'
    router shards swapped (LIMe), and ``tools/generate.py --tensor-parallel 2`` (status, stdout)."""
    results = {}
    for name, path in checkpoints.items():
        loaded = load_model(path, dtype=torch.float64, tensor_parallel=2)
        model, tokenizer = loaded.model, loaded.tokenizer()
        result = dict(
            incremental=incremental_logits(model, tokens, PREFILL),
            full=full_logits(model, tokens),
            greedy=Generator(model, tokenizer).generate(PROMPTS, GREEDY).tokens,
            sampled=Generator(model, tokenizer).generate(PROMPTS, SAMPLED).tokens,
            local_kv_heads=model.decoder.layers[0].self_attention.num_query_groups_per_partition,
        )
        routers = [router.weight for router in model.routers() if router.learned and router.sharding.replicas == 1]
        if routers:
            for weight in routers:  # each rank takes the other rank's input-head columns
                shards = [torch.empty_like(weight) for _ in range(2)]
                torch.distributed.all_gather(shards, weight.contiguous())
                weight.data.copy_(shards[1 - torch.distributed.get_rank()])
            result["swapped_routers"] = incremental_logits(model, tokens, PREFILL)
        results[name] = result
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        results["tool"] = (tool.run(tool_argv), printed.getvalue())
    return results


@pytest.mark.slow  # ~45 s; TP2 decoding on the Triton path stays in tests/parallel/test_lime_tensor_parallel.py
def test_tensor_parallel_decoding_equals_one_process(tmp_path, tokenizer):
    checkpoints = {name: tiny_checkpoint(tmp_path / name, *flags)[0] for name, flags in TENSOR_PARALLEL_MODELS.items()}
    tokens = torch.randint(0, tokenizer.unpadded_vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    output = tmp_path / "tool.jsonl"
    tool_argv = [
        checkpoints["lime-gqa"],
        "--tensor-parallel",
        "2",
        "--prompt",
        "x = ",
        "--prompt",
        "ab",
        "--max-new-tokens",
        "5",
        "--temperature",
        "0.8",
        "--seed",
        "2",
        "--output",
        str(output),
    ]
    ranks = run_distributed(_tensor_parallel_decoding, 2, checkpoints, tokens, tool_argv)
    for name, flags in TENSOR_PARALLEL_MODELS.items():
        loaded = load_model(checkpoints[name], dtype=torch.float64)
        one_process = dict(
            full=full_logits(loaded.model, tokens),
            greedy=Generator(loaded.model, tokenizer).generate(PROMPTS, GREEDY).tokens,
            sampled=Generator(loaded.model, tokenizer).generate(PROMPTS, SAMPLED).tokens,
        )
        kv_heads = loaded.config.kv_heads
        for rank in ranks:
            result = rank[name]
            assert result["local_kv_heads"] == max(1, kv_heads // 2), name
            assert relative_error(result["full"], one_process["full"]) <= TOLERANCE, name
            error = relative_error(result["incremental"][:, PREFILL - 1 :], one_process["full"][:, PREFILL - 1 :])
            assert error <= TOLERANCE, (name, error)
            assert result["greedy"] == one_process["greedy"] and result["sampled"] == one_process["sampled"], name
            if "--lime" in flags and kv_heads >= 2:  # (one head: both ranks hold the same columns)
                assert relative_error(result["swapped_routers"], one_process["full"]) > 1e-3, name
        assert one_process["greedy"] != one_process["sampled"], name
        assert ranks[0][name]["greedy"] == ranks[1][name]["greedy"]
    (status, printed), (other_status, other_printed) = ranks[0]["tool"], ranks[1]["tool"]
    assert status == other_status == 0 and "TP=2" in printed and other_printed == ""
    expected = Generator(load_model(checkpoints["lime-gqa"]).model, tokenizer).generate(
        [[tokenizer.eod, *tokenizer.tokenize(prompt)] for prompt in ("x = ", "ab")],
        SamplingOptions(max_new_tokens=5, temperature=0.8, seed=2),
    )
    assert [json.loads(line)["generation"] for line in output.read_text().splitlines()] == expected.texts


def test_tensor_parallel_sizes_that_do_not_fit_fail_with_one_message(tmp_path, capsys):
    checkpoint, _ = tiny_checkpoint(tmp_path)
    with pytest.raises(ValueError, match="4 attention heads are not divisible by 3;.*; 2 key/value heads neither"):
        load_model(checkpoint, tensor_parallel=3)
    with pytest.raises(ValueError, match="needs a multiple of 2 processes"):
        load_model(checkpoint, tensor_parallel=2)
    assert tool.run([checkpoint, "--prompt", "a", "--tensor-parallel", "2"]) == 1
    assert "needs exactly 2 processes (torchrun --nproc-per-node 2); this launch has 1" in capsys.readouterr().err
