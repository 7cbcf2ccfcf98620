"""Prompt/response data for ``--sft``: ``preprocess_data.py --prompt-key`` writes each record as a
prompt and a response sequence; ``SFTDataset`` (built by the trainer's ``build_datasets``) turns
them into samples whose loss mask covers exactly the response, one example per sample, every
example once per epoch."""

import json
from pathlib import Path

import pytest
import torch

from lime_megatron.cli import preprocess_data
from lime_megatron.data.tokenizer import build_tokenizer
from lime_megatron.training import arguments, data
from lime_megatron.training.data import DataError

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning")]
PAIRS = [
    ("Question: what is two plus two?", " Four."),
    ("Name a colour.", " Blue, like the sky."),
    ("Count to three:", " one, two, three"),
    ("Say hello", " hello there, friend"),
    ("Is ice cold?", " Yes."),
    ("Capital of France?", " Paris is the capital of France."),
]
SEQ = 16
MODEL = "--num-layers 1 --hidden-size 16 --num-attention-heads 2 --lr 1e-3".split()


@pytest.fixture(scope="module")
def gpt2():
    return build_tokenizer("GPT2BPETokenizer")


def write_jsonl(path: Path, pairs) -> Path:
    path.write_text("".join(json.dumps({"prompt": p, "response": r}) + "\n" for p, r in pairs))
    return path


def preprocess(path: Path, prefix: Path, *flags) -> int:
    return preprocess_data.main(
        [
            "--input",
            str(path),
            "--output-prefix",
            str(prefix),
            "--no-progress",
            "--prompt-key",
            "prompt",
            "--json-keys",
            "response",
            *flags,
        ]
    )


@pytest.fixture(scope="module")
def sft_prefix(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sft")
    assert preprocess(write_jsonl(out / "pairs.jsonl", PAIRS), out / "pairs") == 0
    return out / "pairs_response_document"


def build(prefix: Path, *flags, seq: int = SEQ, samples: int = 12):
    """The trainer's datasets for ``--sft`` on ``prefix`` (all of it in the training split)."""
    run = arguments.parse_run(
        [
            "--sft",
            "--data-path",
            str(prefix),
            "--split",
            "1,0,0",
            "--seq-length",
            str(seq),
            "--micro-batch-size",
            "1",
            "--global-batch-size",
            "1",
            "--train-iters",
            str(samples),
            "--eval-iters",
            "0",
            *MODEL,
            *flags,
        ],
        world_size=1,
    )
    return data.build_datasets(run, data.tokenizer_of(run.data))


def test_each_record_is_a_prompt_and_a_response_sequence(sft_prefix, gpt2):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(str(sft_prefix))
    assert list(dataset.document_indices) == list(range(0, 2 * len(PAIRS) + 1, 2))
    for index, (prompt, response) in enumerate(PAIRS):
        assert dataset[2 * index].tolist() == gpt2.tokenize(prompt)  # the prompt alone, as generation sees it
        joint = dataset[2 * index].tolist() + dataset[2 * index + 1].tolist()
        assert joint == gpt2.tokenize(prompt + response) + [gpt2.eod]


def test_a_token_across_the_prompts_end_is_reported_and_skipped(tmp_path, gpt2, capsys):
    pairs = [("Hello wor", "ld, how are you"), *PAIRS[:2]]  # GPT-2 reads " world" as one token
    assert gpt2.tokenize("Hello world")[:2] != gpt2.tokenize("Hello wor")
    assert preprocess(write_jsonl(tmp_path / "p.jsonl", pairs), tmp_path / "p") == 0
    assert "prompt_boundary: 1 prompt/response records whose joint tokens" in capsys.readouterr().out
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    assert len(IndexedDataset(str(tmp_path / "p_response_document"))) == 4  # two records kept
    assert preprocess(tmp_path / "p.jsonl", tmp_path / "q", "--strict") == 1
    assert "a token spans the prompt's end" in capsys.readouterr().err


def test_prompt_key_takes_one_response_key(tmp_path, capsys):
    with pytest.raises(SystemExit):
        preprocess(write_jsonl(tmp_path / "p.jsonl", PAIRS), tmp_path / "p", "--json-keys", "a", "b")
    assert "--prompt-key takes exactly one --json-keys key" in capsys.readouterr().err


def test_samples_carry_the_loss_on_the_response_only(sft_prefix, gpt2):
    train = build(sft_prefix).train
    for sample in range(len(PAIRS)):
        prompt, response = PAIRS[train.example_of(sample)]
        item = train[sample]
        prompt_tokens = gpt2.tokenize(prompt)
        response_tokens = gpt2.tokenize(prompt + response)[len(prompt_tokens) :] + [gpt2.eod]
        used = 1 + len(prompt_tokens) + len(response_tokens)
        padded = [gpt2.eod, *prompt_tokens, *response_tokens] + [gpt2.eod] * (SEQ + 1 - used)
        assert item["tokens"].tolist() == padded[:-1] and item["labels"].tolist() == padded[1:]
        masked = [label for label, keep in zip(item["labels"].tolist(), item["loss_mask"].tolist()) if keep]
        assert masked == response_tokens
        assert item["loss_mask"].sum() == len(response_tokens)
        assert torch.equal(item["position_ids"], torch.arange(SEQ))


def test_every_epoch_shows_every_example_once(sft_prefix):
    datasets = build(sft_prefix, samples=3 * len(PAIRS))
    train, n = datasets.train, len(PAIRS)
    orders = [[train.example_of(e * n + i) for i in range(n)] for e in range(3)]
    assert all(sorted(order) == list(range(n)) for order in orders)
    assert orders[0] != orders[1] or orders[1] != orders[2]  # each epoch draws its own order
    again = build(sft_prefix, samples=3 * n).train
    assert [again.example_of(i) for i in range(3 * n)] == sum(orders, [])
    other_seed = build(sft_prefix, "--seed", "7", samples=3 * n).train
    assert [other_seed.example_of(i) for i in range(3 * n)] != sum(orders, [])
    assert datasets.epochs(0) == 0 and datasets.epochs(n) == 1 and datasets.epochs(n + n // 2) == 1.5


def test_splits_divide_examples(sft_prefix):
    run = arguments.parse_run(
        [
            "--sft",
            "--data-path",
            str(sft_prefix),
            "--split",
            "2,1,0",
            "--seq-length",
            str(SEQ),
            "--micro-batch-size",
            "1",
            "--global-batch-size",
            "1",
            "--train-iters",
            "4",
            "--eval-iters",
            "1",
            *MODEL,
        ],
        world_size=1,
    )
    datasets = data.build_datasets(run, data.tokenizer_of(run.data))
    assert datasets.train.examples_per_epoch == 4 and datasets.valid.examples_per_epoch == 2
    assert not set(datasets.train.indices) & set(datasets.valid.indices)


def test_pretraining_data_and_long_examples_are_refused(tmp_path, sft_prefix):
    plain = tmp_path / "plain.jsonl"
    plain.write_text("".join(json.dumps({"text": p + r}) + "\n" for p, r in PAIRS))
    assert (
        preprocess_data.main(
            ["--input", str(plain), "--output-prefix", str(tmp_path / "plain"), "--append-eod", "--no-progress"]
        )
        == 0
    )
    with pytest.raises(DataError, match="--sft: .* has 1 sequences, not a prompt and a response .*--prompt-key"):
        build(tmp_path / "plain_text_document")
    longest = max(len(build_tokenizer("GPT2BPETokenizer").tokenize(p + r)) for p, r in PAIRS) + 1
    with pytest.raises(DataError, match=f"more than --seq-length {longest - 1} allows"):
        build(sft_prefix, seq=longest - 1)
    assert len(build(sft_prefix, seq=longest).train) == 12


def test_sft_needs_real_data():
    with pytest.raises(arguments.ArgumentsError, match="--sft reads prompt/response data"):
        arguments.parse_run(
            [
                "--sft",
                "--mock-data",
                "--vocab-size",
                "64",
                "--seq-length",
                "8",
                "--micro-batch-size",
                "1",
                "--train-iters",
                "1",
                *MODEL,
            ],
            world_size=1,
        )
