"""Route pruning on a trained deep CPU model (v1 §5.4 and Table 5): the share of routes
top-p masks, the validation loss before and after, and the routing reads per step saved.

The main job's arithmetic-expression data (``python -m lime_megatron``'s data stages) trains a
``--num-layers``-deep LIMe twice in this process with the same seed: once without pruning, once
with ``--lime-prune-top-p`` set after iteration ``--prune-iter``.  Both runs evaluate at that
iteration (the pruned run just after its masks are set) and at the end, so the table shows:

- the masked share of the routes in this project's unit (static: router weights; dynamic: (head,
  source) pairs) and in v1 Table 5's (one per kv head and earlier source layer, the own layer not
  counted: ``pruning.RouteCounts``), at ``--prune-iter`` and, from a third run stopped there, at
  iteration 1 ("at start": the dynamic router's prior there is its initialisation's, own layer
  0.9 and 0.1 / l for each earlier one, so top-p 0.9 keeps only the own layer; the static
  weights are one warm-up step from their initialisation), so the trained share reads against
  what the initialisation alone gives;
- validation loss at the pruning iteration, unpruned ("before") and pruned ("after"), and at the
  end of both runs (pruned routes stay masked while training goes on);
- the bytes the routing products read in one forward+backward of the final models
  (``testing.routing_reads``), unpruned and pruned;
- the K/V bytes the pipeline's hops would carry per sequence (float32, forward; the backward
  returns as many) if the final models were split over ``--pipeline`` P x V stages
  (``pipeline.hop_elements`` with the layers the masks leave read, ``pruning.share_route_reads``).

Run (the figures in BENCHMARKS.md):
    python bench/bench_route_pruning.py
"""

from __future__ import annotations

import argparse
import copy
import tempfile
from pathlib import Path

import torch
from tables import field, print_table
from tqdm import tqdm

from lime_megatron.cli import main_job
from lime_megatron.interop.checkpoint_model import load_model
from lime_megatron.models.lime.pruning import RouteCounts, share_route_reads
from lime_megatron.parallel import pipeline
from lime_megatron.parallel.process_groups import initialize_parallel
from lime_megatron.testing.routing_reads import routing_reads
from lime_megatron.training import trainer


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-layers", type=int, default=32)
    parser.add_argument("--routers", nargs="+", default=["full", "dynamic"])
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--train-iters", type=int, default=200)
    parser.add_argument("--prune-iter", type=int, default=100)
    parser.add_argument("--num-samples", type=int, default=20000)
    parser.add_argument(
        "--pipeline",
        type=int,
        nargs=2,
        default=[4, 2],
        metavar=("P", "V"),
        help="pipeline and virtual stages of the split whose hop bytes are reported",
    )
    parser.add_argument("--output-dir", default=None)
    return parser.parse_args(argv)


def trainer_flags(args, data_flags: list[str], router: str, save: Path) -> list[str]:
    options = list(main_job.TRAINER_OPTIONS)
    options[options.index("--num-layers") + 1] = str(args.num_layers)
    options[options.index("--eval-interval") + 1] = str(args.prune_iter)
    return [
        *options,
        *data_flags,
        "--lime",
        "--lime-router",
        router,
        "--train-iters",
        str(args.train_iters),
        "--lr-warmup-iters",
        str(main_job.warmup_iters(args.train_iters)),
        "--lime-routing-block",
        "1",
        "--save",
        str(save),
        "--save-interval",
        str(args.train_iters),
    ]


def final_model_bytes(checkpoint: Path, pipeline_split: tuple[int, int]) -> tuple[int, int]:
    """(bytes the routing products read in one forward+backward of the checkpoint's model on two
    sequences of the main job's length, K/V bytes all hops of a ``pipeline_split`` (P, V) split of
    it carry per sequence in forward)."""
    initialize_parallel()
    model = load_model(str(checkpoint)).model
    seq_length = int(main_job.TRAINER_OPTIONS[main_job.TRAINER_OPTIONS.index("--seq-length") + 1])
    tokens = torch.randint(0, model.vocab_size, (2, seq_length), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(seq_length).expand_as(tokens)
    with routing_reads() as reads:
        model(tokens, positions, None, labels=tokens).mean().backward()
    share_route_reads([model])  # the layers still read (the variant's without masks)
    split = copy.copy(model.config)
    split.pipeline_model_parallel_size, split.virtual_pipeline_model_parallel_size = pipeline_split
    chunks = range(1, pipeline_split[0] * pipeline_split[1])
    hops = sum(pipeline.hop_elements(split, chunk, seq_length, 1)[1] for chunk in chunks)
    return reads.total, hops * model.config.params_dtype.itemsize


def pruning_flags(top_p: float, iteration: int) -> list[str]:
    return ["--lime-prune-top-p", str(top_p), "--lime-prune-iters", str(iteration)]


def masked_at_start(args, data_flags: list[str], out: Path, router: str) -> RouteCounts:
    """The counts top-p gives at iteration 1, where the run stops: the dynamic prior of the
    initial model (iteration 1's forward passes), the static weights after one warm-up step."""
    flags = trainer_flags(args, data_flags, router, out / f"{router}-start") + ["--exit-interval", "1"]
    counts = trainer.train(flags + pruning_flags(args.top_p, 1)).pruned_routes
    assert counts is not None
    return counts


def measure(args, data_flags: list[str], out: Path, router: str) -> dict:
    runs = {}
    for pruned in (False, True):
        save = out / f"{router}-{'pruned' if pruned else 'unpruned'}"
        prune = pruning_flags(args.top_p, args.prune_iter) if pruned else []
        runs[pruned] = (trainer.train(trainer_flags(args, data_flags, router, save) + prune), save)
    (plain, plain_dir), (pruned, pruned_dir) = runs[False], runs[True]
    counts, start = pruned.pruned_routes, masked_at_start(args, data_flags, out, router)
    (reads_plain, hops_plain), (reads_pruned, hops_pruned) = (
        final_model_bytes(save, tuple(args.pipeline)) for save in (plain_dir, pruned_dir)
    )
    return dict(
        router=router,
        share=counts.masked / counts.routes,
        routes=counts.routes,
        v1_share=counts.v1_masked / counts.v1_routes,
        v1_routes=counts.v1_routes,
        start_share=start.masked / start.routes,
        start_v1_share=start.v1_masked / start.v1_routes,
        before=plain.validation[args.prune_iter],
        after=pruned.validation[args.prune_iter],
        end_plain=plain.validation[args.train_iters],
        end_pruned=pruned.validation[args.train_iters],
        reads_plain=reads_plain,
        reads_pruned=reads_pruned,
        hops_plain=hops_plain,
        hops_pruned=hops_pruned,
    )


COLUMNS = [
    ("router", field("router")),
    ("routes", field("routes", ",")),
    ("masked", lambda row: f"{100 * row['share']:.1f}%"),
    ("at start", lambda row: f"{100 * row['start_share']:.1f}%"),
    ("v1 routes", field("v1_routes", ",")),
    ("v1 masked", lambda row: f"{100 * row['v1_share']:.1f}%"),
    ("v1 at start", lambda row: f"{100 * row['start_v1_share']:.1f}%"),
    ("val before", field("before", ".4f")),
    ("val after", field("after", ".4f")),
    ("end unpruned", field("end_plain", ".4f")),
    ("end pruned", field("end_pruned", ".4f")),
    ("reads MiB", field("reads_plain", ".1f", 2**20)),
    ("pruned MiB", field("reads_pruned", ".1f", 2**20)),
    ("hops KiB", field("hops_plain", ".1f", 2**10)),
    ("pruned KiB", field("hops_pruned", ".1f", 2**10)),
]
"""The table's columns: the routes masked, validation losses, routing reads and pipeline hops."""


def print_results(rows: list[dict], args) -> None:
    print(
        f"\n{args.num_layers} layers, top-p {args.top_p} after iteration {args.prune_iter} of {args.train_iters}; "
        f"hops: K/V per sequence over PP{args.pipeline[0]} x VPP{args.pipeline[1]}, forward"
    )
    print_table(COLUMNS, rows)


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    out = Path(args.output_dir or tempfile.mkdtemp(prefix="route-pruning-"))
    data_flags = main_job.prepare_data(out, args.num_samples, 100)
    rows = [measure(args, data_flags, out, router) for router in tqdm(args.routers, desc="routers")]
    print_results(rows, args)
    masked = ", ".join(
        f"{r['router']} {100 * r['share']:.1f}% (v1's unit {100 * r['v1_share']:.1f}%; "
        f"{100 * r['start_share']:.1f}% and {100 * r['start_v1_share']:.1f}% at iteration 1)"
        for r in rows
    )
    change = ", ".join(f"{r['router']} {r['after'] - r['before']:+.4f}" for r in rows)
    saved = ", ".join(f"{r['router']} {100 * (1 - r['hops_pruned'] / r['hops_plain']):.1f}%" for r in rows)
    print(
        f"\nsummary: masked {masked} of the routes; validation loss change at pruning {change}; pipeline "
        f"K/V bytes saved {saved}; written under {out}"
    )
    return rows


if __name__ == "__main__":
    main()
