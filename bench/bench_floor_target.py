"""The overhead targets, decided with an interval: blocked LIMe within 1.05x of its FLOP floor in
time, within 1.02x of the baseline in saved bytes.

For each depth and kv-head count it builds the baseline and LIMe with the roofline's block
(``planning.routing_block.chunk_routing_block``), nothing else, and times the two as a training
run steps them: each timed forward+backward follows an untimed step of the same model
(``round_times(..., untimed_before=1)``), the pair's order rotated each round.  Per round LIMe's
time over the baseline's in the same round; the median of these paired ratios over the FLOP floor
(``bench_lime_overhead.flop_floor``) and a distribution-free 95% interval of that median
(``median_interval``, from the rounds' order statistics).  The verdict per cell: **met** when the
whole interval lies at or below 1.05, **missed** when it lies above, **open** when it straddles
1.05 (more rounds narrow it).  Saved bytes as ``bench_lime_overhead`` counts them (deterministic).

Why only these two models: in ``bench_lime_overhead.py``'s rounds of four a model's time depends on
which ran before it (after the B = 1 model's 24 GiB of routing reads per step, the blocked model's
ratio at 128 layers, MHA, read 1.08x its floor; after itself or the baseline 1.01-1.03x,
benchmarks/blocked-routing-cpu-2026-11-26.md), and in training a step follows a step of the same model.

Run (the table in BENCHMARKS.md, "The 1.05x target, decided with intervals"):
    python bench/bench_floor_target.py --repeats 21
"""

from __future__ import annotations

import argparse
import statistics

from bench_lime_overhead import (
    SHAPE_COLUMNS,
    build,
    chosen_block,
    flop_floor,
    make_batch,
    measure_cases,
    median_interval,
    parse_paired_args,
    round_times,
    saved_bytes,
    shape_parser,
)
from tables import field, print_table

TIME_TARGET = 1.05
"""Blocked LIMe's time over the baseline's, relative to the FLOP floor: at most this."""

SAVED_TARGET = 1.02
"""Blocked LIMe's saved bytes over the baseline's: at most this."""


def parse_args(argv=None) -> argparse.Namespace:
    parser = shape_parser(__doc__, [8, 16, 32, 64, 128])
    parser.set_defaults(repeats=21)
    return parse_paired_args(parser, argv)


def verdict(low: float, high: float, target: float = TIME_TARGET) -> str:
    """``met`` (the interval at or below ``target``), ``missed`` (above it) or ``open``."""
    if high <= target:
        return "met"
    return "missed" if low > target else "open"


def measure(args, num_layers: int, kv_heads: int) -> dict:
    block = chosen_block(args, num_layers, kv_heads)
    models = {
        "base": build(args, num_layers, kv_heads, False),
        "blocked": build(args, num_layers, kv_heads, True, block),
    }
    batch = make_batch(args)
    times = round_times(args, models, batch, untimed_before=1)
    floor = flop_floor(args, models["blocked"].config)
    over_floor = [lime / base / floor for lime, base in zip(times["blocked"], times["base"])]
    low, high = median_interval(over_floor)
    return dict(
        layers=num_layers,
        kv_heads=kv_heads,
        block=block,
        base_s=statistics.median(times["base"]),
        floor=floor,
        over_floor=statistics.median(over_floor),
        low=low,
        high=high,
        verdict=verdict(low, high),
        saved_x=saved_bytes(models["blocked"], batch) / saved_bytes(models["base"], batch),
    )


COLUMNS = SHAPE_COLUMNS + [
    ("base s", field("base_s", ".3f")),
    ("floor", field("floor", ".3f")),
    ("B / floor", field("over_floor", ".3f")),
    ("95% interval", lambda row: f"{row['low']:.3f}-{row['high']:.3f}"),
    ("time", field("verdict")),
    ("saved x", field("saved_x", ".3f")),
]
"""The table's columns: a cell's verdict on the time, with the interval it rests on."""


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    rows = measure_cases(args, measure)
    print_table(COLUMNS, rows)
    counts = {name: sum(r["verdict"] == name for r in rows) for name in ("met", "open", "missed")}
    print(
        f"\nsummary: {len(rows)} settings, {args.repeats} rounds each; time within {TIME_TARGET}x of the "
        f"FLOP floor: met {counts['met']}, open {counts['open']}, missed {counts['missed']}; saved bytes "
        f"within {SAVED_TARGET}x of the baseline in {sum(r['saved_x'] <= SAVED_TARGET for r in rows)}"
    )
    return rows


if __name__ == "__main__":
    main()
