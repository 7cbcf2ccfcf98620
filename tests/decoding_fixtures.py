"""Decoding-test helpers: a character tokenizer that fits the tiny models' 96-token vocabulary,
checkpoints of tiny trainer runs, and incremental (KV-cache) logits."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from lime_megatron.data.tokenizer import GPT2_EOD_TOKEN, HuggingFaceTokenizer
from lime_megatron.inference.decoding import decode_step, kv_cache_context

CHARACTERS = "\n" + "".join(chr(code) for code in range(32, 126))
"""Newline and printable ASCII up to ``}``: 95 characters, plus the end-of-document token = 96."""


def _byte_level(character: str) -> str:
    """GPT-2 byte-level stand-in of an ASCII character (space and newline are remapped)."""
    return {" ": "\u0120", "\n": "\u010a"}.get(character, character)


def char_tokenizer(directory: Path) -> HuggingFaceTokenizer:
    """One token per character of ``CHARACTERS`` (ids 0..94) and ``<|endoftext|>`` (id 95),
    written as a HuggingFace ``tokenizer.json`` under ``directory`` and loaded the project's way."""
    vocab = {_byte_level(character): index for index, character in enumerate(CHARACTERS)}
    vocab[GPT2_EOD_TOKEN] = len(vocab)
    spec = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": len(CHARACTERS),
                "content": GPT2_EOD_TOKEN,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
        ],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "vocab": vocab,
            "merges": [],
        },
    }
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "tokenizer.json"
    path.write_text(json.dumps(spec))
    return HuggingFaceTokenizer(str(path), divisible_by=32)


TINY_RUN = (
    "--num-layers 3 --hidden-size 32 --num-attention-heads 4 --num-query-groups 2 --seq-length 32 "
    "--micro-batch-size 2 --global-batch-size 2 --lr 1e-3 --mock-data --train-iters 1 "
    "--tokenizer-type HuggingFaceTokenizer --make-vocab-size-divisible-by 32"
).split()


def tiny_checkpoint(root: Path, *extra: str) -> tuple[str, HuggingFaceTokenizer]:
    """A weights-only checkpoint of a freshly initialised tiny model (the trainer's options
    ``TINY_RUN`` plus ``extra``, the character tokenizer) under ``root``; returns its directory."""
    from lime_megatron.interop.checkpoint_model import save_model
    from lime_megatron.models.gpt_model import build_model
    from lime_megatron.training import arguments, checkpointing

    tokenizer = char_tokenizer(root / "tokenizer")
    options = arguments.parse_run([*TINY_RUN, "--tokenizer-model", str(root / "tokenizer"), *extra])
    config = arguments.transformer_config(options)
    run = checkpointing.run_description(options, config, tokenizer)
    model = build_model(config, tokenizer.vocab_size, options.model.seq_length, rotary_base=options.model.rotary_base)
    return save_model(model, run, str(root / "checkpoint")), tokenizer


def incremental_logits(model, tokens: torch.Tensor, prefill: int) -> torch.Tensor:
    """Logits ``[b, s, padded vocab]`` of ``tokens`` ``[b, s]`` fed through the KV cache as a
    prefill of ``prefill`` tokens, then one token per step."""
    context = kv_cache_context(model, tokens.shape[0], tokens.shape[1])
    steps = [decode_step(model, context, tokens[:, :prefill])]
    steps += [decode_step(model, context, tokens[:, t : t + 1]) for t in range(prefill, tokens.shape[1])]
    return torch.cat(steps, dim=1)
