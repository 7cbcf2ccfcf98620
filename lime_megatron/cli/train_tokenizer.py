"""Train a SentencePiece or byte-level BPE tokenizer on the inputs preprocess_data.py reads.

    python tools/train_tokenizer.py --input data/fineweb-edu/ --kind sentencepiece \\
        --vocab-size 32000 --output-dir tokenizers/fwe-sp32k

writes ``tokenizer.model`` (SentencePiece; load with ``--tokenizer-type SentencePieceTokenizer
--tokenizer-model DIR/tokenizer.model``) or ``tokenizer.json`` (byte-level BPE with GPT-2's
pre-tokenization and ``<|endoftext|>``; load with ``--tokenizer-type HuggingFaceTokenizer
--tokenizer-model DIR``). Training reads the first ``--max-mb`` MB of text of the inputs in
order; bad records are skipped and reported as in preprocess_data.py.
"""

import argparse
import io
import os
import sys
import time
from collections.abc import Iterator

from tqdm import tqdm

from lime_megatron.data.corpus import (
    PARTIAL,
    InputReport,
    add_input_args,
    check_strict,
    iter_documents,
    sources_from_args,
    total_disk_bytes,
)
from lime_megatron.data.tokenizer import GPT2_EOD_TOKEN
from lime_megatron.training.arguments import CommandParser

KINDS = {  # kind: (output file, how to load it)
    "sentencepiece": ("tokenizer.model", "--tokenizer-type SentencePieceTokenizer --tokenizer-model {output}"),
    "byte-bpe": ("tokenizer.json", "--tokenizer-type HuggingFaceTokenizer --tokenizer-model {output}"),
}


def parse_args(argv=None) -> argparse.Namespace:
    """Command-line flags."""
    parser = CommandParser(description=__doc__.split("\n")[0])
    add_input_args(parser)
    group = parser.add_argument_group("model")
    group.add_argument("--kind", default="sentencepiece", choices=KINDS)
    group.add_argument("--vocab-size", type=int, required=True)
    group.add_argument("--sentencepiece-model-type", default="bpe", choices=("bpe", "unigram"))
    group.add_argument(
        "--character-coverage",
        type=float,
        default=0.9995,
        help="SentencePiece: share of characters covered by the vocabulary",
    )
    group.add_argument(
        "--no-byte-fallback", action="store_true", help="SentencePiece: map unknown characters to <unk>, not to bytes"
    )
    group = parser.add_argument_group("run")
    group.add_argument("--output-dir", required=True)
    group.add_argument(
        "--max-mb", type=float, default=100.0, help="train on at most this many MB of text (the first ones)"
    )
    group.add_argument("--workers", type=int, default=1, help="SentencePiece training threads")
    group.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser.parse_args(argv)


def read_texts(args: argparse.Namespace, report: InputReport, bar: tqdm) -> Iterator[str]:
    """Texts of the input documents (every key), up to ``--max-mb`` MB of UTF-8."""
    sources, _ = sources_from_args(args)
    budget = int(args.max_mb * 1e6)
    bar.reset(total=min(budget, total_disk_bytes(sources)))
    documents = 0
    for texts in iter_documents(sources, args.json_keys, report):
        check_strict(args.strict, report)
        documents += 1
        for text in texts:
            size = len(text.encode("utf-8"))
            bar.update(size)
            yield text
            budget -= size
            if budget <= 0:
                return
    check_strict(args.strict, report)
    if not documents:
        raise ValueError("no documents to train on: every input record was skipped")


def _lines(texts: Iterator[str]) -> Iterator[str]:
    """Non-blank lines: SentencePiece trains on sentences, not whole documents."""
    for text in texts:
        yield from (line for line in text.split("\n") if line.strip())


def train_sentencepiece(texts: Iterator[str], args: argparse.Namespace) -> bytes:
    """Serialized SentencePiece model (unk 0, bos 1, eos 2 = end of document, no pad).

    Text is kept as it is (no normalization, whitespace runs kept), as language models want;
    newlines and rare characters become byte pieces unless ``--no-byte-fallback``.
    """
    import sentencepiece

    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=_lines(texts),
        model_writer=model,
        vocab_size=args.vocab_size,
        model_type=args.sentencepiece_model_type,
        character_coverage=args.character_coverage,
        byte_fallback=not args.no_byte_fallback,
        max_sentence_length=1 << 14,
        num_threads=max(1, args.workers),
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True,
        minloglevel=1,
    )
    return model.getvalue()


def train_byte_bpe(texts: Iterator[str], args: argparse.Namespace) -> bytes:
    """tokenizer.json of a GPT-2-style byte-level BPE with ``<|endoftext|>`` as token 0."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=args.vocab_size,
        special_tokens=[GPT2_EOD_TOKEN],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer.to_str().encode("utf-8")


def write_atomic(path: str, data: bytes) -> None:
    """Write `data` to a temporary name beside `path`, then rename it into place."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + PARTIAL, "wb") as f:
        f.write(data)
    os.replace(path + PARTIAL, path)


def run(args: argparse.Namespace) -> dict:
    """Train and write the tokenizer; return what was done."""
    report, start = InputReport(), time.perf_counter()
    train = train_sentencepiece if args.kind == "sentencepiece" else train_byte_bpe
    with tqdm(unit="B", unit_scale=True, desc="reading", disable=args.no_progress) as bar:
        model = train(read_texts(args, report, bar), args)
        text_bytes = bar.n
    output = os.path.join(args.output_dir, KINDS[args.kind][0])
    write_atomic(output, model)
    return dict(output=output, report=report, text_bytes=text_bytes, seconds=time.perf_counter() - start)


def main(argv=None) -> int:
    """Entry point; returns the process exit status."""
    args = parse_args(argv)
    try:
        result = run(args)
    except (OSError, ValueError, RuntimeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(
        f"trained a {args.kind} tokenizer (vocab {args.vocab_size}) on "
        f"{result['text_bytes'] / 1e6:,.1f} MB of text in {result['seconds']:.1f} s"
    )
    print("\n".join(result["report"].lines()))
    print(f"output: {result['output']}")
    print(
        "use it with: "
        + KINDS[args.kind][1].format(output=result["output"] if args.kind == "sentencepiece" else args.output_dir)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
