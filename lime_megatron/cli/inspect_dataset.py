"""Describe a megatron-core indexed dataset: counts, length statistics, histogram, samples.

    python tools/inspect_dataset.py data/fwe_text_document --decode 3

Decoding uses the same tokenizer flags as preprocess_data.py (default: GPT-2 BPE).
"""

import argparse
import os
import sys

import numpy as np

from lime_megatron.data.corpus import dataset_paths, dataset_prefix, require_dataset
from lime_megatron.data.tokenizer import add_tokenizer_args, build_tokenizer, tokenizer_kwargs
from lime_megatron.training.arguments import CommandParser

BAR_WIDTH = 40


def parse_args(argv=None) -> argparse.Namespace:
    """Command-line flags."""
    parser = CommandParser(description=__doc__.split("\n")[0])
    parser.add_argument("prefix", help="dataset prefix (a .bin/.idx suffix is accepted)")
    parser.add_argument("--decode", type=int, default=0, metavar="N", help="print the text of the first N documents")
    parser.add_argument("--max-chars", type=int, default=1000, help="cut each decoded document to this many characters")
    add_tokenizer_args(parser)
    return parser.parse_args(argv)


def histogram(lengths: np.ndarray) -> list[str]:
    """Text histogram of document lengths in power-of-two buckets."""
    if not len(lengths):
        return []
    edges = 2 ** np.arange(0, int(np.log2(max(1, int(np.max(lengths))))) + 2)
    counts = np.bincount(np.searchsorted(edges, lengths, side="right"), minlength=len(edges) + 1)
    rows, peak = [], int(np.max(counts))
    for low, high, count in zip([0, *edges], [*edges, None], counts):
        if count:
            span = f"[{low:,}, {high:,})" if high else f">= {low:,}"
            rows.append(f"  {span:>22} {count:>12,} {'#' * max(1, BAR_WIDTH * int(count) // peak)}")
    return rows


def describe(prefix: str) -> list[str]:
    """Counts, length statistics and histogram of the dataset at `prefix`."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(prefix)
    docs = dataset.document_indices
    doc_lengths = np.add.reduceat(dataset.sequence_lengths, docs[:-1]) if len(docs) > 1 else np.zeros(0, dtype=np.int64)
    bin_size = os.path.getsize(dataset_paths(prefix)[0])
    lines = [
        f"dataset: {prefix}",
        f"token dtype: {dataset.index.dtype.__name__}, .bin size: {bin_size / 1e6:,.1f} MB",
        f"documents: {len(docs) - 1:,}, sequences: {len(dataset):,}, tokens: {int(dataset.sequence_lengths.sum()):,}",
    ]
    if len(doc_lengths):
        q = np.percentile(doc_lengths, [50, 90, 99])
        lines.append(
            f"tokens per document: min {np.min(doc_lengths):,}, median {q[0]:,.0f}, "
            f"mean {doc_lengths.mean():,.1f}, p90 {q[1]:,.0f}, p99 {q[2]:,.0f}, "
            f"max {np.max(doc_lengths):,}"
        )
        lines.append("length histogram (tokens per document):")
        lines += histogram(doc_lengths)
    return lines


def decode_documents(prefix: str, count: int, tokenizer, max_chars: int) -> list[str]:
    """Decoded text of the first `count` documents, each cut to `max_chars` characters."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(prefix)
    docs = dataset.document_indices
    lines = []
    for i in range(min(count, len(docs) - 1)):
        ids = [t for j in range(docs[i], docs[i + 1]) for t in dataset[int(j)].tolist()]
        text = tokenizer.detokenize(ids)
        cut = f"... [{len(text) - max_chars:,} more characters]" if len(text) > max_chars else ""
        lines += [f"--- document {i} ({len(ids):,} tokens) ---", text[:max_chars] + cut]
    return lines


def main(argv=None) -> int:
    """Entry point; returns the process exit status."""
    args = parse_args(argv)
    prefix = dataset_prefix(args.prefix)
    try:
        require_dataset(prefix)
    except FileNotFoundError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print("\n".join(describe(prefix)))
    if args.decode:
        tokenizer = build_tokenizer(**tokenizer_kwargs(args))
        print("\n".join(decode_documents(prefix, args.decode, tokenizer, args.max_chars)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
