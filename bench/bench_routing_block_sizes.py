"""The routing block size: the cost model's choice against measured forward+backward time per B.

For each depth and kv-head count it builds the baseline and LIMe at several block sizes (B = 1,
the powers of two up to the chooser's limit and its choice for one stage,
``planning.routing_block.chunk_routing_block``) and times them interleaved in one process, as
``bench_lime_overhead.py`` does: per round each LIMe model's time over the baseline's in the same
round, the median of these paired ratios and their interquartile range.  Beside each B the cost
model's step time relative to B = 1 (``routing_step_seconds`` with the baseline's work,
``baseline_work``: roofline and host time).  The
last column marks the cost model's choice (``<- roofline``) and the measured fastest B
(``<- fastest``): a choice within one IQR of the fastest is as good as this machine can tell.

Run (the table in BENCHMARKS.md):
    python bench/bench_routing_block_sizes.py --repeats 9
``--device cuda`` takes the figures of the GPU present instead of ``CPU_2_CORE``.
"""

from __future__ import annotations

import argparse

from bench_lime_overhead import (
    SHAPE_COLUMNS,
    build,
    chosen_block,
    element_size,
    machine_balance,
    make_batch,
    measure_cases,
    paired_ratio,
    parse_paired_args,
    round_times,
    row_elements,
    shape_config,
    shape_parser,
)
from tables import field, print_table

from lime_megatron.planning.routing_block import baseline_work, block_size_limit, routing_step_seconds


def parse_args(argv=None) -> argparse.Namespace:
    parser = shape_parser(__doc__, [8, 16, 32])
    parser.set_defaults(repeats=9)
    return parse_paired_args(parser, argv)


def candidate_blocks(num_layers: int, chosen: int) -> list[int]:
    """B = 1, the powers of two up to the roofline's limit (``block_size_limit``), and ``chosen``."""
    limit = block_size_limit(range(num_layers))
    powers = {2**k for k in range(limit.bit_length()) if 2**k <= limit}
    return sorted(powers | {chosen})


def measure(args, num_layers: int, kv_heads: int) -> list[dict]:
    chosen = chosen_block(args, num_layers, kv_heads)
    layers, row, size, machine = range(num_layers), row_elements(args), element_size(args), machine_balance(args)
    baseline = baseline_work(
        shape_config(args, num_layers, kv_heads, lime=True), layers, args.seq_length, args.micro_batch_size, machine
    )
    blocks = candidate_blocks(num_layers, chosen)
    models = {"base": build(args, num_layers, kv_heads, False)}
    models.update({block: build(args, num_layers, kv_heads, True, block) for block in blocks})
    times = round_times(args, models, make_batch(args))
    per_layer = routing_step_seconds(layers, kv_heads, 1, row, size, machine, baseline=baseline)
    rows = []
    for block in blocks:
        ratio, spread = paired_ratio(times, block)
        roofline = routing_step_seconds(layers, kv_heads, block, row, size, machine, baseline=baseline) / per_layer
        rows.append(
            dict(
                layers=num_layers,
                kv_heads=kv_heads,
                block=block,
                ratio=ratio,
                spread=spread,
                roofline=roofline,
                chosen=block == chosen,
            )
        )
    fastest = min(rows, key=lambda row: row["ratio"])
    for row in rows:
        row["fastest"] = row is fastest
    return rows


def choice_marks(row: dict) -> str:
    """``<- roofline`` on the roofline's B, ``<- fastest`` on the measured fastest, else nothing."""
    return " ".join(mark for mark, on in (("<- roofline", row["chosen"]), ("<- fastest", row["fastest"])) if on)


COLUMNS = SHAPE_COLUMNS + [
    ("model vs B=1", field("roofline", ".3f")),
    ("LIMe / base", field("ratio", ".3f")),
    ("IQR", field("spread", ".3f")),
    ("choice", choice_marks),
]
"""The table's columns: per B the roofline's forward time, the measured ratio and its spread."""


def main(argv=None) -> list[dict]:
    rows = [row for rows_of_case in measure_cases(parse_args(argv), measure) for row in rows_of_case]
    print_table(COLUMNS, rows)
    settings = {(r["layers"], r["kv_heads"]) for r in rows}
    chosen = {(r["layers"], r["kv_heads"]): r for r in rows if r["chosen"]}
    fastest = {(r["layers"], r["kv_heads"]): r for r in rows if r["fastest"]}
    close = [key for key in settings if chosen[key]["ratio"] - fastest[key]["ratio"] <= chosen[key]["spread"]]
    print(
        f"\nsummary: {len(settings)} settings; the roofline's B is the fastest or within one IQR of it "
        f"in {len(close)}; worst gap {max(chosen[k]['ratio'] - fastest[k]['ratio'] for k in settings):.3f} "
        "of the baseline's time"
    )
    return rows


if __name__ == "__main__":
    main()
