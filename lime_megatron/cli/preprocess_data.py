"""Tokenize a corpus into megatron-core indexed datasets for GPTDataset.

    python tools/preprocess_data.py --input data/fineweb-edu/ --output-prefix data/fwe \\
        --tokenizer-type GPT2BPETokenizer --append-eod --workers 8

writes ``{output-prefix}_{key}_document.bin/.idx`` for each ``--json-keys`` key (default
``text``). With ``--prompt-key P`` (supervised fine-tuning data for ``pretrain_lime.py --sft``)
each record becomes one document of two sequences, the prompt's tokens (field ``P`` tokenized
alone, as generation sees it) and the response's: the tokens of ``prompt + response`` after the
prompt's, then the end-of-document token, written to ``{output-prefix}_{key}_document`` for the one
``--json-keys`` key (``lime_megatron.data.sft_dataset``). A record whose joint tokens do not begin
with the prompt's (a token spanning the boundary) is reported and skipped.
Inputs: JSONL (also .gz/.zst), parquet, plain text files, directories or globs of
them, several at once. Flags follow Megatron-LM's tools/preprocess_data.py.

The main process reads the inputs in chunks of about ``--chunk-mb`` and writes the results in
input order; ``--workers`` processes parse and tokenize, one encoding thread each. Output is
therefore identical for any worker count. Bad records are counted, reported and skipped (or end
the run with ``--strict``); outputs appear under their final names only when complete.
"""

import argparse
import multiprocessing
import signal
import sys
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from multiprocessing.pool import AsyncResult
from typing import Any

import numpy as np
from tqdm import tqdm

from lime_megatron.data.corpus import (
    BadInputError,
    Chunk,
    DatasetWriter,
    InputReport,
    Record,
    add_input_args,
    check_strict,
    iter_chunks,
    location,
    parse_chunk,
    sources_from_args,
    token_dtype,
    total_disk_bytes,
)
from lime_megatron.data.tokenizer import add_tokenizer_args, build_tokenizer, tokenizer_kwargs
from lime_megatron.training.arguments import CommandParser

# Megatron-LM flags that change nothing here (progress is a bar, order is always kept).
IGNORED_MEGATRON_FLAGS: dict[str, dict[str, Any]] = {
    "--log-interval": {},
    "--partitions": {},
    "--dataset-impl": {},
    "--keep-sequential-samples": {"action": "store_true"},
}


def parse_args(argv=None) -> argparse.Namespace:
    """Command-line flags (Megatron-LM names where they exist)."""
    parser = CommandParser(description=__doc__.split("\n")[0])
    add_input_args(parser)
    group = add_tokenizer_args(parser)
    group.add_argument(
        "--tensor-model-parallel-size",
        type=int,
        default=1,
        help="vocabulary padding multiple (only the token dtype depends on it)",
    )
    group.add_argument("--append-eod", action="store_true", help="append the end-of-document token to every document")
    group.add_argument(
        "--prompt-key",
        help="SFT data: the field holding each record's prompt; the "
        "single --json-keys field is its response (end-of-document token appended)",
    )
    group = parser.add_argument_group("output")
    group.add_argument("--output-prefix", required=True)
    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=int, default=1, help="tokenizing processes (one encoding thread each)")
    group.add_argument("--chunk-mb", type=float, default=4.0, help="input handed to a worker at a time, in MB")
    group.add_argument("--no-progress", action="store_true", help="no progress bar")
    for flag, kwargs in IGNORED_MEGATRON_FLAGS.items():
        group.add_argument(flag, default=None, help="Megatron-LM flag, accepted and ignored", **kwargs)
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error("--workers must be at least 1")
    if args.prompt_key and len(args.json_keys) != 1:
        parser.error("--prompt-key takes exactly one --json-keys key: the response")
    return args


@dataclass
class Encoded:
    """Tokens of one chunk: per key, the concatenated documents and their lengths."""

    tokens: list[np.ndarray]
    lengths: list[np.ndarray]
    documents: int
    input_bytes: int
    disk_bytes: int
    report: InputReport


_WORKER: dict[str, Any] = {}


def _tokenizer(build_kwargs: dict):
    """The tokenizer for `build_kwargs`, built once per process (forked workers inherit it)."""
    if _WORKER.get("build_kwargs") != build_kwargs:
        _WORKER.update(build_kwargs=build_kwargs, tokenizer=build_tokenizer(**build_kwargs))
    return _WORKER["tokenizer"]


def _init_worker(build_kwargs: dict, keys: Sequence[str], dtype: type, append_eod: bool, prompt_response: bool) -> None:
    """Get this worker's tokenizer (one encoding thread) and remember the job settings.

    Ctrl-C is left to the main process, which stops the workers and removes partial output.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    tokenizer = _tokenizer(build_kwargs)
    _WORKER.update(
        keys=list(keys), dtype=dtype, eod=tokenizer.eod if append_eod else None, prompt_response=prompt_response
    )


def _drop_tokenless(records: list[Record], per_key: list[list], chunk: Chunk, report: InputReport) -> list[list]:
    """Remove (and report) documents that encode to no tokens under any key."""
    empty = np.zeros(len(records), dtype=bool)
    for seqs in per_key:
        empty |= np.array([len(s) == 0 for s in seqs], dtype=bool)
    for i in np.flatnonzero(empty):
        report.add("empty_document", location(chunk, records[i][0]), "encodes to no tokens")
    if not empty.any():
        return per_key
    return [[s for s, drop in zip(seqs, empty) if not drop] for seqs in per_key]


def _pack(seqs: list, eod, dtype: type):
    """Concatenate token arrays (each followed by `eod` unless None) and list their lengths."""
    tail = [np.array([eod])] if eod is not None else []
    parts = [part for s in seqs for part in (s, *tail)]
    lengths = np.array([len(s) + len(tail) for s in seqs], dtype=np.int64)
    tokens: np.ndarray = np.concatenate(parts).astype(dtype) if parts else np.empty(0, dtype=dtype)
    return tokens, lengths


def _prompt_response_tokens(
    records: list[Record],
    tokenizer,
    prompts: Sequence[str],
    responses: Sequence[str],
    chunk: Chunk,
    report: InputReport,
) -> list[list]:
    """``[prompt tokens, response tokens]`` of the records: the prompt tokenized alone, the
    response as the tokens of ``prompt + response`` after the prompt's. A record whose joint
    tokens do not start with the prompt's, or with an empty prompt or response, is reported and
    dropped."""
    kept: list[Record] = []
    columns: tuple[list, list] = ([], [])
    joint = tokenizer.tokenize_batch([p + r for p, r in zip(prompts, responses)])
    for record, prompt, tokens in zip(records, tokenizer.tokenize_batch(prompts), joint):
        if list(tokens[: len(prompt)]) != list(prompt):
            report.add("prompt_boundary", location(chunk, record[0]), "a token spans the prompt's end")
            continue
        kept.append(record)
        columns[0].append(prompt)
        columns[1].append(tokens[len(prompt) :])
    return _drop_tokenless(kept, list(columns), chunk, report)


def _pack_prompt_response(prompts: list, responses: list, eod: int, dtype: type):
    """Concatenate each prompt with its response and an end-of-document token; lengths
    ``[documents, 2]`` (the two sequences of each document)."""
    parts = [part for p, r in zip(prompts, responses) for part in (p, r, [eod])]
    lengths = np.array([[len(p), len(r) + 1] for p, r in zip(prompts, responses)], dtype=np.int64)
    return np.concatenate([[], *parts]).astype(dtype), lengths.reshape(-1, 2)


def encode_chunk(chunk: Chunk) -> Encoded:
    """Parse and tokenize one chunk (runs in a worker process)."""
    report = InputReport()
    keys, tokenizer = _WORKER["keys"], _WORKER["tokenizer"]
    records = parse_chunk(chunk, keys, report)
    columns = list(zip(*(texts for _, texts in records))) or [()] * len(keys)
    if _WORKER["prompt_response"]:
        prompts, responses = columns  # keys are [prompt key, response key] (see main)
        per_key = _prompt_response_tokens(records, tokenizer, prompts, responses, chunk, report)
        prompt_tokens, response_tokens = per_key
        packed = [_pack_prompt_response(prompt_tokens, response_tokens, tokenizer.eod, _WORKER["dtype"])]
    else:
        per_key = _drop_tokenless(records, [tokenizer.tokenize_batch(texts) for texts in columns], chunk, report)
        packed = [_pack(seqs, _WORKER["eod"], _WORKER["dtype"]) for seqs in per_key]
    return Encoded(
        [t for t, _ in packed], [n for _, n in packed], len(per_key[0]), chunk.nbytes, chunk.disk_bytes, report
    )


def encode_in_workers(chunks: Iterator[Chunk], workers: int, initargs: tuple) -> Iterator[Encoded]:
    """Results of `encode_chunk` in input order, with at most ``2 * workers + 1`` in flight.

    Workers are forked on Linux (they inherit this process's tokenizer and start at once)
    and spawned elsewhere.
    """
    method = "fork" if sys.platform.startswith("linux") else "spawn"
    with multiprocessing.get_context(method).Pool(workers, initializer=_init_worker, initargs=initargs) as pool:
        pending: deque[AsyncResult[Encoded]] = deque()
        for chunk in chunks:
            pending.append(pool.apply_async(encode_chunk, (chunk,)))
            if len(pending) > 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


@dataclass
class Throughput:
    """Running totals and rates of a run."""

    start: float = field(default_factory=time.perf_counter)
    documents: int = 0
    tokens: int = 0
    input_bytes: int = 0

    def add(self, result: Encoded) -> None:
        self.documents += result.documents
        self.tokens += int(sum(len(t) for t in result.tokens))
        self.input_bytes += result.input_bytes

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self.start

    def rates(self) -> str:
        """docs/s, tokens/s and MB/s of (uncompressed) input so far."""
        s = max(self.seconds, 1e-9)
        return (
            f"{self.documents / s:,.0f} docs/s, {self.tokens / s / 1e6:.2f}M tok/s, "
            f"{self.input_bytes / s / 1e6:.1f} MB/s"
        )


def run(args: argparse.Namespace) -> dict:
    """Preprocess as `args` says; return the totals (documents, tokens, seconds, ...)."""
    build_kwargs = tokenizer_kwargs(args, num_threads=1)
    tokenizer = _tokenizer(build_kwargs)
    sources, ignored = sources_from_args(args)
    prefixes = [f"{args.output_prefix}_{key}_document" for key in args.json_keys]
    keys = [args.prompt_key, *args.json_keys] if args.prompt_key else args.json_keys
    dtype = token_dtype(tokenizer.vocab_size)
    # Problems found while parsing (in workers, merged in input order) and while reading files.
    report, reading, totals = InputReport(), InputReport(), Throughput()
    initargs = (build_kwargs, keys, dtype, args.append_eod, bool(args.prompt_key))
    chunks = iter_chunks(sources, keys, int(args.chunk_mb * 1e6), reading)
    with (
        DatasetWriter(prefixes, dtype) as writer,
        tqdm(
            total=total_disk_bytes(sources), unit="B", unit_scale=True, desc="tokenizing", disable=args.no_progress
        ) as bar,
    ):
        for result in encode_in_workers(chunks, args.workers, initargs):
            for index, (tokens, lengths) in enumerate(zip(result.tokens, result.lengths)):
                writer.add_documents(index, tokens, lengths)
            report.merge(result.report)
            check_strict(args.strict, report)
            check_strict(args.strict, reading)
            totals.add(result)
            bar.update(result.disk_bytes)
            bar.set_postfix_str(totals.rates(), refresh=False)
        check_strict(args.strict, reading)
        report.merge(reading)
        if not totals.documents:
            raise BadInputError("no documents to write: every input record was skipped")
        writer.commit()
    return dict(
        documents=totals.documents,
        tokens=totals.tokens,
        input_bytes=totals.input_bytes,
        seconds=totals.seconds,
        rates=totals.rates(),
        report=report,
        ignored=ignored,
        tokenizer=tokenizer,
        outputs=prefixes,
        sources=len(sources),
    )


def summary(args: argparse.Namespace, result: dict) -> list[str]:
    """Closing summary lines of a run."""
    lines = [
        f"wrote {result['documents']:,} documents, {result['tokens']:,} tokens from "
        f"{result['input_bytes'] / 1e6:,.1f} MB of input in {result['seconds']:.1f} s "
        f"({result['sources']} input files)",
        f"throughput: {result['rates']} (workers={args.workers}, {result['tokenizer'].name})",
    ]
    lines += result["report"].lines()
    if result["ignored"]:
        lines.append(f"ignored {len(result['ignored'])} files of no known format, e.g. {result['ignored'][0]}")
    lines += [f"output: {prefix}.bin / .idx" for prefix in result["outputs"]]
    return lines


def main(argv=None) -> int:
    """Entry point; returns the process exit status."""
    args = parse_args(argv)
    given = [f for f in IGNORED_MEGATRON_FLAGS if getattr(args, f[2:].replace("-", "_"))]
    if given:
        print(f"note: ignoring Megatron-LM flags that change nothing here: {' '.join(given)}")
    try:
        result = run(args)
    except (OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: nothing was written", file=sys.stderr)
        return 130
    print("\n".join(summary(args, result)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
