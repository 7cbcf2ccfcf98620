"""The run's tokenizer as a Hugging Face tokenizer that puts the end-of-document token first.

Training packs documents each followed by the end-of-document token (EOD), so the model sees EOD
before every document, and our decoding prompts with ``[EOD, *tokenize(prompt)]``
(``inference.scoring``, ``tools/generate.py``).  ``write_tokenizer`` writes a ``tokenizer.json``
(loaded by ``AutoTokenizer`` as ``PreTrainedTokenizerFast``, in transformers 4 and 5 alike) whose
post-processor puts EOD before every text, so ``AutoTokenizer.from_pretrained(dir)(text)`` gives
``[EOD, *our tokenize(text)]``; ``tokenizer_config.json`` names EOD the BOS and EOS token and keeps
special-token text inside a text ordinary text (``split_special_tokens``), as our tokenizers
encode it.  Beside it, the files the import reads, unchanged:

- GPT-2 BPE: ``vocab.json`` + ``merges.txt``; tokenizer.json is the same byte-level BPE (GPT-2's
  split pattern, ``<|endoftext|>`` special).
- Hugging Face ``tokenizer.json``: the run's in ``run_tokenizer/`` (with the tokenizer_config.json
  and special_tokens_map.json beside it); the top-level one is it with EOD put first in its
  post-processor (first in the run's own template, if it has one).
- SentencePiece: ``tokenizer.model``; tokenizer.json encodes and decodes as the sentencepiece
  library does (unigram or BPE, byte fallback, the normalization table, the whitespace
  handling), built here from the model file rather than by transformers' conversion, which in
  transformers 5 reads every model as BPE and handles a leading space and unknown characters
  differently.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import struct

from lime_megatron.data.tokenizer import GPT2_EOD_TOKEN, NO_PAD
from lime_megatron.training.data import DataError

RUN_TOKENIZER = "run_tokenizer"
"""Folder of a Hugging Face tokenizer run's own tokenizer files, unchanged (the import reads them)."""
UNIGRAM, BPE = 1, 2
"""SentencePiece model types (``TrainerSpec.model_type``)."""
NORMAL, UNKNOWN, CONTROL, USER_DEFINED = 1, 2, 3, 4
"""SentencePiece piece types (``SentencePiece.type``; 5 is unused, 6 a byte)."""


@dataclasses.dataclass
class ExportedTokenizer:
    """What ``write_tokenizer`` writes, built and checked before anything is written (a tokenizer
    the export refuses leaves no partial directory): ``spec`` the tokenizer.json with EOD put
    first, ``settings`` its tokenizer_config.json, ``copies`` (source file, name in the export)."""

    spec: dict
    settings: dict
    copies: list[tuple[str, str]]


def exported_tokenizer(tokenizer) -> ExportedTokenizer | None:
    """The run's tokenizer as the export writes it (module docstring); None for the mock-data
    vocabulary, which has no files.  Raises ``DataError`` for a tokenizer it cannot write."""
    kind = type(tokenizer).__name__
    sources = getattr(tokenizer, "unique_identifiers", {}).get("files", [])
    if kind == "GPT2BPETokenizer":
        copies = list(zip(sources, ("vocab.json", "merges.txt")))
        spec = _gpt2_spec(*sources)
    elif kind == "HuggingFaceTokenizer":
        copies = _run_tokenizer_files(sources[0])
        with open(sources[0], encoding="utf-8") as handle:
            spec = json.load(handle)
    elif kind == "SentencePieceTokenizer":
        copies = [(sources[0], "tokenizer.model")]
        spec = _sentencepiece_spec(sources[0])
    else:
        return None
    pad = None if getattr(tokenizer, "pad", NO_PAD) == NO_PAD else tokenizer.pad
    return _fast_tokenizer(spec, tokenizer.eod, pad, copies)


def write_tokenizer(exported: ExportedTokenizer | None, directory: str) -> list[str]:
    """Write ``exported`` (``exported_tokenizer``) into ``directory``; returns the files."""
    if exported is None:
        return []
    for source, name in exported.copies:
        os.makedirs(os.path.dirname(os.path.join(directory, name)), exist_ok=True)
        shutil.copyfile(source, os.path.join(directory, name))
    for name, content in (("tokenizer.json", exported.spec), ("tokenizer_config.json", exported.settings)):
        with open(os.path.join(directory, name), "w", encoding="utf-8") as handle:
            json.dump(content, handle, indent=2 if name == "tokenizer_config.json" else None, ensure_ascii=False)
            handle.write("\n" if name == "tokenizer_config.json" else "")
    return ["tokenizer.json", "tokenizer_config.json", *(name for _, name in exported.copies)]


def _gpt2_spec(vocab: str, merges: str) -> dict:
    """tokenizer.json of GPT-2's byte-level BPE from its vocab.json and merges.txt."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    bpe = Tokenizer(models.BPE.from_file(vocab, merges))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)  # GPT-2's split pattern
    bpe.decoder = decoders.ByteLevel()
    bpe.add_special_tokens([GPT2_EOD_TOKEN])
    return json.loads(bpe.to_str())


def _run_tokenizer_files(source: str) -> list[tuple[str, str]]:
    """The run's tokenizer.json ``source`` and the tokenizer_config.json / special_tokens_map.json
    beside it, as copies into ``run_tokenizer/``."""
    names = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
    paths = {
        name: source if name == "tokenizer.json" else os.path.join(os.path.dirname(source), name) for name in names
    }
    return [(path, f"{RUN_TOKENIZER}/{name}") for name, path in paths.items() if os.path.isfile(path)]


def _fast_tokenizer(spec: dict, eod: int, pad: int | None, copies: list[tuple[str, str]]) -> ExportedTokenizer:
    """tokenizer.json ``spec`` with EOD put before every text, and its tokenizer_config.json."""
    from tokenizers import Tokenizer

    vocabulary = Tokenizer.from_str(json.dumps(spec))
    eod_token = vocabulary.id_to_token(eod)
    spec["post_processor"] = _document_post_processor(spec.get("post_processor"), eod_token, eod)
    settings = dict(
        tokenizer_class="PreTrainedTokenizerFast",
        bos_token=eod_token,
        eos_token=eod_token,
        split_special_tokens=True,
    )
    if pad is not None:
        settings["pad_token"] = vocabulary.id_to_token(pad)
    return ExportedTokenizer(spec, settings, copies)


def _document_post_processor(post_processor: dict | None, token: str, token_id: int) -> dict:
    """tokenizer.json's ``post_processor`` with ``token`` put before every text: first in the
    run's template, or (no post-processor, or one adding no tokens such as ``ByteLevel``) a
    template of its own run last.  (A template's output is pieces, which a second template in a
    ``Sequence`` would take for a pair, so the run's template is extended rather than followed.)"""
    prefix = {"SpecialToken": {"id": token, "type_id": 0}}
    special = {token: dict(id=token, ids=[token_id], tokens=[token])}
    members = [] if post_processor is None else post_processor.get("processors", [post_processor])
    kinds = [member["type"] for member in members]
    if set(kinds) - {"TemplateProcessing", "ByteLevel"} or kinds.count("TemplateProcessing") > 1:
        raise DataError(
            f"cannot put the end-of-document token before every text with the run's tokenizer.json "
            f"post-processor ({', '.join(kinds)}): only one TemplateProcessing and ByteLevel ones are supported"
        )
    template = next((member for member in members if member["type"] == "TemplateProcessing"), None)
    if template is not None:
        template["single"] = [prefix, *template["single"]]
        template["pair"] = [prefix, *template["pair"]]
        template["special_tokens"].update(special)
        return post_processor
    own = dict(
        type="TemplateProcessing",
        single=[prefix, {"Sequence": {"id": "A", "type_id": 0}}],
        pair=[prefix, {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        special_tokens=special,
    )
    return own if post_processor is None else dict(type="Sequence", processors=[*members, own])


# --------------------------------------------------------------------------- SentencePiece


def _sentencepiece_spec(model_file: str) -> dict:
    """tokenizer.json of the SentencePiece model ``model_file``, encoding and decoding as the
    sentencepiece library: its pieces and scores as a ``Unigram`` model, or as a ``BPE`` model
    whose merges are ranked by the merged piece's score (sentencepiece merges the adjacent pair
    making the best-scored piece); the normalization table (``Precompiled``), then the extra
    whitespace removed, the dummy prefix ``▁`` and spaces as ``▁``; control and unknown pieces
    special.  Fields read (sentencepiece_model.proto): ModelProto 1 pieces (piece 1, score 2,
    type 3), 2 trainer_spec (model_type 3, treat_whitespace_as_suffix 24, byte_fallback 35,
    unk_surface 44), 3 normalizer_spec (precompiled_charsmap 2, add_dummy_prefix 3,
    remove_extra_whitespaces 4, escape_whitespaces 5)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers

    with open(model_file, "rb") as handle:
        proto = _protobuf(handle.read(), model_file)
    trainer = _protobuf(proto.get(2, [b""])[0], model_file)
    normalizer = _protobuf(proto.get(3, [b""])[0], model_file)
    pieces = [_piece(_protobuf(piece, model_file)) for piece in proto.get(1, [])]
    model_type = trainer.get(3, [UNIGRAM])[0]
    if model_type not in (UNIGRAM, BPE) or trainer.get(24, [0])[0] or not normalizer.get(5, [1])[0]:
        raise DataError(
            f"{model_file}: only unigram and BPE SentencePiece models that mark whitespace with a "
            "leading '▁' (not word/char models, treat_whitespace_as_suffix or unescaped whitespace) "
            "are written as a Hugging Face tokenizer"
        )
    if any(kind == USER_DEFINED for _, _, kind in pieces):
        raise DataError(f"{model_file}: SentencePiece user-defined symbols are not written as a Hugging Face tokenizer")
    byte_fallback = bool(trainer.get(35, [0])[0])
    unknown = next(index for index, (_, _, kind) in enumerate(pieces) if kind == UNKNOWN)
    model: models.Model
    if model_type == UNIGRAM:
        model = models.Unigram([(piece, score) for piece, score, _ in pieces], unknown, byte_fallback)
    else:
        ids = {piece: index for index, (piece, _, _) in enumerate(pieces)}
        model = models.BPE(
            ids, _bpe_merges(pieces, ids), unk_token=pieces[unknown][0], fuse_unk=True, byte_fallback=byte_fallback
        )
    tokenizer = Tokenizer(model)
    steps: list[normalizers.Normalizer] = []
    if normalizer.get(2, [b""])[0]:
        steps.append(normalizers.Precompiled(normalizer[2][0]))
    if normalizer.get(4, [1])[0]:  # remove_extra_whitespaces
        steps += [normalizers.Replace(Regex("^ +| +$"), ""), normalizers.Replace(Regex(" {2,}"), " ")]
    if normalizer.get(3, [1])[0]:  # add_dummy_prefix (not to an empty text)
        steps.append(normalizers.Prepend(" "))
    tokenizer.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "▁")])
    unprefix = [decoders.Strip(" ", 1, 0)] if normalizer.get(3, [1])[0] else []
    unknown_text = trainer.get(44, [" \N{DOUBLE QUESTION MARK} ".encode()])[0].decode("utf-8")
    tokenizer.decoder = decoders.Sequence(
        [
            decoders.Replace(pieces[unknown][0], unknown_text),  # unk_surface
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            *unprefix,
        ]
    )
    tokenizer.add_special_tokens(
        [AddedToken(piece, normalized=False, special=True) for piece, _, kind in pieces if kind in (UNKNOWN, CONTROL)]
    )
    return json.loads(tokenizer.to_str())


def _bpe_merges(pieces: list[tuple[str, float, int]], ids: dict[str, int]) -> list[tuple[str, str]]:
    """Every split of every normal piece into two pieces, best-scored merged piece first."""
    merges = [
        (score, ids[piece[:cut]], ids[piece[cut:]], piece[:cut], piece[cut:])
        for piece, score, kind in pieces
        if kind == NORMAL
        for cut in range(1, len(piece))
        if piece[:cut] in ids and piece[cut:] in ids
    ]
    return [(left, right) for _, _, _, left, right in sorted(merges, key=lambda merge: (-merge[0], *merge[1:3]))]


def _piece(fields: dict[int, list]) -> tuple[str, float, int]:
    """(text, score, type) of a ``SentencePiece`` message (type 1, normal, when absent)."""
    score = struct.unpack("<f", fields[2][0])[0] if 2 in fields else 0.0
    return fields[1][0].decode("utf-8"), score, fields.get(3, [NORMAL])[0]


def _protobuf(message: bytes, path: str) -> dict[int, list]:
    """The fields of a protobuf ``message`` by number, each a list of values (varints as ints,
    the rest as bytes): enough to read a SentencePiece model without the protobuf package."""
    fields: dict[int, list] = {}
    at = 0
    while at < len(message):
        key, at = _varint(message, at, path)
        wire = key & 7
        value: int | bytes
        if wire == 0:
            value, at = _varint(message, at, path)
        elif wire in (1, 2, 5):
            size, at = (8, at) if wire == 1 else (4, at) if wire == 5 else _varint(message, at, path)
            value, at = message[at : at + size], at + size
        else:
            raise DataError(f"{path} is not a SentencePiece model (protobuf wire type {wire})")
        fields.setdefault(key >> 3, []).append(value)
    if at != len(message):
        raise DataError(f"{path} is not a SentencePiece model (a field runs past its end)")
    return fields


def _varint(message: bytes, at: int, path: str) -> tuple[int, int]:
    """The protobuf varint at ``message[at:]`` and the offset after it."""
    value = shift = 0
    while at < len(message):
        byte = message[at]
        value, shift, at = value | (byte & 0x7F) << shift, shift + 7, at + 1
        if byte < 0x80:
            return value, at
    raise DataError(f"{path} is not a SentencePiece model (it ends inside a number)")
