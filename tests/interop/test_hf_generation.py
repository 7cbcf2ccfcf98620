"""Exported models generate in stock transformers code what our greedy decoding generates.

Training puts the end-of-document token (EOD) before every document, and our decoding prompts
with ``[EOD, *tokenize(prompt)]`` (``inference.scoring``, ``tools/generate.py``); the exported
tokenizer must do the same.

- The exported tokenizer of every kind the export writes (GPT-2 BPE, Hugging Face tokenizer.json
  with no post-processor, with its own template and with a ``ByteLevel`` one, SentencePiece BPE
  without byte fallback and unigram with it) loads in ``AutoTokenizer`` and encodes a text as
  ``[EOD, *our tokenize(text)]``, EOD its BOS and EOS token, and decodes the text's tokens back.
- A tiny LLaMA trained for a few steps on arithmetic documents (a Hugging Face and a
  SentencePiece tokenizer, padded vocabulary), exported: ``AutoTokenizer`` +
  ``AutoModelForCausalLM.generate`` (greedy, its generation_config.json) produce our greedy
  decoding token for token, stopping at EOD.  The same for LIMe, whose layout is the official
  code's: the official-semantics reader and the paper's reference forward
  (``tests.reference_lime``) decode greedily with the exported tokenizer and generation config.
- A Hugging Face tokenizer run imported back tokenizes as the run did (the run's own files).
"""

import json
import random

import pytest
import tokenizers
import torch

pytest.importorskip("safetensors")  # the hf extra: pip install torch==2.13.0 -e .[hf]
transformers = pytest.importorskip("transformers")

from lime_megatron.cli import train_tokenizer  # noqa: E402
from lime_megatron.cli.convert_checkpoint import main as convert  # noqa: E402
from lime_megatron.data.tokenizer import GPT2BPETokenizer, HuggingFaceTokenizer, SentencePieceTokenizer  # noqa: E402
from lime_megatron.inference.generation import Generator, SamplingOptions  # noqa: E402
from lime_megatron.interop.checkpoint_model import load_model, save_model  # noqa: E402
from lime_megatron.interop.hf_export import export_checkpoint  # noqa: E402
from lime_megatron.interop.hf_tokenizer import exported_tokenizer, write_tokenizer  # noqa: E402
from lime_megatron.models.gpt_model import build_model  # noqa: E402
from lime_megatron.training import arguments, checkpointing, data  # noqa: E402
from lime_megatron.training.data import DataError  # noqa: E402
from tests import reference_lime  # noqa: E402
from tests.decoding_fixtures import TINY_RUN, char_tokenizer  # noqa: E402
from tests.interop.test_hf_export import read_official  # noqa: E402

pytestmark = [
    pytest.mark.usefixtures("megatron"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]

SEQ = 32
DOCUMENTS = [f"{a} + {b} = {a + b}" for a in range(0, 40, 3) for b in range(0, 30, 4)]
PROMPTS = ["3 + 4 =", "12 + 8 = ", "27 + 0 = 2", "9 +"]
TEXTS = PROMPTS + [" leading", "two  spaces", "new\nline\n\n", "trailing ", "é ü ☃", "", "a<|endoftext|>b"]
"""Texts for the tokenizer tests (in every vocabulary that has byte fallback)."""
MAX_NEW_TOKENS = 8


# --------------------------------------------------------------------------- tokenizers


def _sentencepiece(directory, *flags: str) -> SentencePieceTokenizer:
    """A SentencePiece tokenizer trained by tools/train_tokenizer.py on ``DOCUMENTS``."""
    directory.mkdir(parents=True, exist_ok=True)
    corpus = directory / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": document}) + "\n" for document in DOCUMENTS))
    argv = ["--input", str(corpus), "--kind", "sentencepiece", "--character-coverage", "1.0", *flags]
    assert train_tokenizer.main([*argv, "--output-dir", str(directory), "--no-progress"]) == 0
    return SentencePieceTokenizer(str(directory / "tokenizer.model"))


def _with_post_processor(directory, post_processor) -> HuggingFaceTokenizer:
    """The character tokenizer with ``post_processor`` (a ``tokenizers.processors`` object)."""
    char_tokenizer(directory)
    spec = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
    spec.post_processor = post_processor
    spec.save(str(directory / "tokenizer.json"))
    return HuggingFaceTokenizer(str(directory))


BOS_TEMPLATE = tokenizers.processors.TemplateProcessing(single="# $A", pair="# $A $B:1", special_tokens=[("#", 4)])
"""A run tokenizer's own template: ``#`` (id 4 of the character tokenizer) before every text."""


TOKENIZERS = {  # name: (build it under a directory, the texts it encodes like ours in transformers)
    "gpt2": (lambda directory: GPT2BPETokenizer(), [*TEXTS, "a</s>b"]),
    "hugging-face": (char_tokenizer, [text for text in TEXTS if "é" not in text]),
    "hugging-face-template": (
        lambda directory: _with_post_processor(directory, BOS_TEMPLATE),
        PROMPTS + ["two  spaces", "x"],
    ),
    "hugging-face-byte-level": (
        lambda directory: _with_post_processor(directory, tokenizers.processors.ByteLevel(trim_offsets=True)),
        PROMPTS,
    ),
    "sentencepiece-bpe": (
        lambda directory: _sentencepiece(directory, "--vocab-size", "40", "--no-byte-fallback"),
        PROMPTS + [" 1  +  2", "5 = ", ""],
    ),
    "sentencepiece-unigram-bytes": (
        lambda directory: _sentencepiece(
            directory, "--vocab-size", "290", "--sentencepiece-model-type", "unigram", "--workers", "1"
        ),
        TEXTS,
    ),
}


@pytest.mark.parametrize("kind", TOKENIZERS)
def test_exported_tokenizer_puts_the_end_of_document_token_first(tmp_path, kind):
    build, texts = TOKENIZERS[kind]
    ours = build(tmp_path / "source")
    (tmp_path / "hf").mkdir()
    write_tokenizer(exported_tokenizer(ours), str(tmp_path / "hf"))
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    assert theirs.bos_token_id == theirs.eos_token_id == ours.eod
    for text in texts:
        encoded = theirs(text)["input_ids"]
        assert encoded == [ours.eod, *ours.tokenize(text)], text
        assert theirs.decode(encoded[1:]) == ours.detokenize(ours.tokenize(text)), text


def test_a_tokenizer_the_export_cannot_write_is_refused_before_any_file(tmp_path):
    """A post-processor EOD cannot be put before (two templates) fails in ``exported_tokenizer``,
    which the export calls before it writes anything, with one message naming the problem."""
    two_templates = tokenizers.processors.Sequence([BOS_TEMPLATE, BOS_TEMPLATE])
    ours = _with_post_processor(tmp_path / "source", two_templates)
    with pytest.raises(DataError, match="cannot put the end-of-document token before every text"):
        exported_tokenizer(ours)


# --------------------------------------------------------------------------- generation


def _train(model, tokenizer, steps: int = 120) -> None:
    """Adam steps on ``DOCUMENTS`` packed as the trainer packs them (each followed by EOD), until
    greedy decoding continues the prompts with sums."""
    documents = random.Random(0).sample(DOCUMENTS, len(DOCUMENTS))
    stream = [token for document in documents for token in [*tokenizer.tokenize(document), tokenizer.eod]]
    windows = torch.tensor(stream[: len(stream) // (SEQ + 1) * (SEQ + 1)]).view(-1, SEQ + 1)
    positions = torch.arange(SEQ).expand(8, SEQ)
    optimizer = torch.optim.Adam(model.parameters(), lr=5e-3)
    model.train()
    for step in range(steps):
        batch = windows[torch.arange(step * 8, step * 8 + 8) % windows.shape[0]]
        model(batch[:, :-1], positions, None, labels=batch[:, 1:]).mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def _hugging_face_flags(root) -> list[str]:
    char_tokenizer(root / "tokenizer")
    return ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(root / "tokenizer")]


def _sentencepiece_flags(root) -> list[str]:
    _sentencepiece(root / "tokenizer", "--vocab-size", "40", "--no-byte-fallback")
    return ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", str(root / "tokenizer/tokenizer.model")]


RUNS = {  # tokenizer kind: its trainer flags (files written under a directory); GPT-2's tokenizer.json
    # goes the same way as the Hugging Face one and is checked above (its vocabulary makes training slow)
    "hugging-face": _hugging_face_flags,
    "sentencepiece": _sentencepiece_flags,
}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """``exported(kind, lime)``: (checkpoint, tokenizer, Hugging Face directory) of a tiny model
    (``TINY_RUN``, padded vocabulary) with the ``kind`` tokenizer trained by ``_train``, saved
    and exported in float64; built once per module."""
    built = {}

    def export(kind: str, lime: bool):
        if (kind, lime) not in built:
            root = tmp_path_factory.mktemp(kind)
            options = arguments.parse_run(
                [*TINY_RUN, *RUNS[kind](root), "--make-vocab-size-divisible-by", "64", "--seq-length", str(SEQ)]
                + ["--lime" if lime else "--no-lime"]
            )
            tokenizer = data.tokenizer_of(options.data)
            config = arguments.transformer_config(options)
            model = build_model(config, tokenizer.vocab_size, SEQ, rotary_base=options.model.rotary_base)
            _train(model, tokenizer)
            run = checkpointing.run_description(options, config, tokenizer)
            checkpoint = save_model(model, run, str(root / "checkpoint"))
            export_checkpoint(checkpoint, str(root / "hf"), dtype=torch.float64, progress=False)
            built[kind, lime] = checkpoint, tokenizer, root / "hf"
        return built[kind, lime]

    return export


def _ours(checkpoint: str, tokenizer) -> list[list[int]]:
    """Our greedy decoding (KV cache, float64) of ``PROMPTS`` after EOD, with EOD appended
    where it stopped there (as transformers returns it); checked to be non-trivial."""
    model = load_model(checkpoint, dtype=torch.float64).model
    prompts = [[tokenizer.eod, *tokenizer.tokenize(prompt)] for prompt in PROMPTS]
    result = Generator(model, tokenizer).generate(prompts, SamplingOptions(max_new_tokens=MAX_NEW_TOKENS))
    generations = [tokens + [tokenizer.eod] * (why == "eod") for tokens, why in zip(result.tokens, result.stopped_by)]
    assert len(set(map(tuple, generations))) > 1 and max(map(len, result.tokens)) > 1, result.texts
    return generations


@pytest.mark.parametrize("kind", RUNS)
def test_transformers_generate_equals_our_greedy_decoding(exported, kind):
    checkpoint, tokenizer, directory = exported(kind, lime=False)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(str(directory))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float64).eval()
    assert model.generation_config.eos_token_id == model.config.bos_token_id == tokenizer.eod
    assert model.generation_config.suppress_tokens == list(range(tokenizer.unpadded_vocab_size, tokenizer.vocab_size))
    for prompt, expected in zip(PROMPTS, _ours(checkpoint, tokenizer)):
        inputs = hf_tokenizer(prompt, return_tensors="pt")
        assert inputs["input_ids"][0].tolist() == [tokenizer.eod, *tokenizer.tokenize(prompt)]
        with torch.no_grad():
            output = model.generate(**inputs, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
        assert output[0, inputs["input_ids"].shape[1] :].tolist() == expected, prompt


def _reference_greedy(directory, prompt_ids: list[int]) -> list[int]:
    """Greedy decoding by the paper's reference forward on the official layout read from
    ``directory``, as its generation_config.json says: suppressed ids never chosen, stop after
    the EOS token."""
    params, spec = read_official(str(directory))
    settings = json.loads((directory / "generation_config.json").read_text())
    sequence = list(prompt_ids)
    for _ in range(MAX_NEW_TOKENS):
        logits = reference_lime.forward(params, torch.tensor([sequence]), spec)[0, -1]
        logits[settings.get("suppress_tokens", [])] = float("-inf")
        sequence.append(int(logits.argmax()))
        if sequence[-1] == settings["eos_token_id"]:
            break
    return sequence[len(prompt_ids) :]


def test_lime_reference_generates_our_greedy_decoding_from_the_export(exported):
    checkpoint, tokenizer, directory = exported("hugging-face", lime=True)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(str(directory))
    for prompt, expected in zip(PROMPTS, _ours(checkpoint, tokenizer)):
        assert _reference_greedy(directory, hf_tokenizer(prompt)["input_ids"]) == expected, prompt


def test_an_imported_hugging_face_tokenizer_tokenizes_as_the_run(exported, tmp_path):
    _, tokenizer, directory = exported("hugging-face", lime=False)
    assert convert(["import", str(directory), str(tmp_path / "back")]) == 0
    imported = load_model(str(tmp_path / "back")).tokenizer()
    assert imported.unique_identifiers["files"] == [str(directory / "run_tokenizer" / "tokenizer.json")]
    for prompt in PROMPTS:
        assert imported.tokenize(prompt) == tokenizer.tokenize(prompt)
