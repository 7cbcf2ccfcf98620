"""Analyse trained LIMe / LLaMA / Hyper-Connections checkpoints (paper §5.2-5.4) on one CPU process.

    python tools/analyze_checkpoint.py LIMe=ckpt/lime LLaMA=ckpt/llama \\
        --data-path data/fineweb_text_document --num-sequences 64 --output-dir analysis/

Each checkpoint (a ``--save`` directory or one ``iter_NNNNNNN`` directory, saved at any parallel
layout) is read into the single-process model (``checkpoint_model.load_model``); ``--num-sequences``
sequences of the tokenized corpus (a megatron indexed dataset; default: the first run's
``--data-path``) go through every model.  Written to ``--output-dir``: ``analysis.json`` (router
weights, Fig. 5 shares, self-retrieval, expected depth, entropy and probe accuracy per layer, the
seconds each analysis took) and the PNG plots of ``lime_megatron.analysis.plots``.  See
docs/analysis.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import TYPE_CHECKING

from lime_megatron.training.arguments import CommandParser

if TYPE_CHECKING:
    import torch


def parse_args(argv=None) -> argparse.Namespace:
    parser = CommandParser(description=__doc__.split("\n")[1])
    parser.add_argument(
        "checkpoints",
        nargs="+",
        metavar="[NAME=]PATH",
        help="checkpoints to compare; NAME defaults to the directory name",
    )
    parser.add_argument("--data-path", help="megatron indexed dataset prefix (default: the first run's data)")
    parser.add_argument("--num-sequences", type=int, default=64)
    parser.add_argument("--seq-length", type=int, help="tokens per sequence (default: the first run's)")
    parser.add_argument(
        "--words",
        help="comma-separated tokens for the probe and t-SNE (default: is,are,was,were, the paper's)",
    )
    parser.add_argument("--per-word", type=int, help="at most this many occurrences per word")
    parser.add_argument("--alpha", type=float, help="Rényi entropy order (default: 0.5, the paper's)")
    parser.add_argument("--tsne-layers", help="comma-separated 1-based layers (default: first, middle, last)")
    parser.add_argument("--no-probe", action="store_true", help="skip the probe and t-SNE")
    parser.add_argument("--output-dir", required=True)
    return parser.parse_args(argv)


def named_checkpoints(specs: list[str]) -> dict[str, str]:
    """``{name: path}`` from ``NAME=PATH`` or ``PATH`` arguments."""
    named = {}
    for spec in specs:
        name, _, path = spec.rpartition("=")
        named[name or os.path.basename(os.path.normpath(path))] = path
    return named


def corpus_sequences(prefix: str, num_sequences: int, seq_length: int) -> torch.Tensor:
    """The first ``num_sequences * seq_length`` tokens of the indexed dataset ``prefix`` (documents
    concatenated in order) as ``[num_sequences, seq_length]``."""
    import numpy as np
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(prefix)
    needed, pieces, have = num_sequences * seq_length, [], 0
    for index in range(len(dataset)):
        pieces.append(np.asarray(dataset[index], dtype=np.int64))
        have += len(pieces[-1])
        if have >= needed:
            break
    if have < needed:
        sys.exit(f"{prefix} holds {have} tokens, fewer than {num_sequences} x {seq_length}")
    return torch.from_numpy(np.concatenate(pieces)[:needed]).view(num_sequences, seq_length)


def main(argv=None) -> int:
    args = parse_args(argv)
    checkpoints = named_checkpoints(args.checkpoints)
    missing = [path for path in checkpoints.values() if not os.path.exists(path)]
    if missing:  # before the model code is imported
        print(f"error: no checkpoint at {missing[0]}", file=sys.stderr)
        return 1
    import torch

    from lime_megatron.analysis import measures
    from lime_megatron.interop.checkpoint_model import load_model

    start = time.perf_counter()
    loaded = {name: load_model(path, dtype=torch.float32) for name, path in checkpoints.items()}
    first = next(iter(loaded.values()))
    data_path = args.data_path or (first.options.data.data_path or [None])[-1]
    if not data_path:
        sys.exit("no corpus: the first run trained on mock data; pass --data-path")
    tokens = corpus_sequences(data_path, args.num_sequences, args.seq_length or first.options.model.seq_length)
    load_seconds = time.perf_counter() - start
    options = measures.AnalysisOptions(
        alpha=measures.DEFAULT_ALPHA if args.alpha is None else args.alpha,
        words=tuple(args.words.split(",")) if args.words else measures.DEFAULT_WORDS,
        per_word=args.per_word,
        tsne_layers=tuple(int(layer) - 1 for layer in args.tsne_layers.split(",")) if args.tsne_layers else None,
    )
    tokenizer = None if args.no_probe else first.tokenizer()
    results = measures.analyze(
        {name: c.model for name, c in loaded.items()}, tokens, tokenizer, args.output_dir, options
    )
    print(f"\nanalysis of {', '.join(loaded)} on {tokens.shape[0]} x {tokens.shape[1]} tokens of {data_path}")
    print(f"  loading checkpoints and corpus: {load_seconds:.1f} s")
    for name, numbers in results["models"].items():
        timings = ", ".join(f"{key} {value:.1f} s" for key, value in numbers["seconds"].items())
        print(f"  {name} ({numbers['num_layers']} layers): {timings}")
        entropy = numbers["entropy_values"]["mean"]
        print(f"    value entropy first/last layer {entropy[0]:.3f} / {entropy[-1]:.3f}")
        if "probe_values" in numbers:
            print(f"    value probe accuracy last layer {numbers['probe_values']['mean'][-1]:.3f}")
        if "pruning" in numbers:  # v1 Table 5's columns
            pruned = numbers["pruning"]
            print(
                f"    route pruning (top-p {pruned['top_p']}): {pruned['masked']:,} of {pruned['routes']:,} routes "
                f"masked ({100 * pruned['share']:.1f}%); in v1 Table 5's unit {pruned['v1_masked']:,} of "
                f"{pruned['v1_routes']:,} ({100 * pruned['v1_share']:.1f}%)"
            )
        for circuit in numbers.get("circuits", [])[:5]:  # dynamic LIMe: v1 Table 2's L, R, H (1-based)
            print(
                f"    circuit: token {circuit['token']} (sequence {circuit['sequence']}, position "
                f"{circuit['position']}): layer {circuit['layer'] + 1} reads layer {circuit['source'] + 1} "
                f"with head {circuit['head'] + 1} at weight {circuit['weight']:.3f}"
            )
    print(f"  written to {args.output_dir} (total {time.perf_counter() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
