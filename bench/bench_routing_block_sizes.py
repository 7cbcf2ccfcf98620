"""The routing block size: the roofline's choice against measured forward+backward time per B.

For each depth and kv-head count it builds the baseline and LIMe at several block sizes (B = 1,
the powers of two below the roofline's limit and the roofline's choice,
``models.lime.routing_blocks.routing_block_size``) and times them interleaved in one process, as
``bench_lime_overhead.py`` does: per round each LIMe model's time over the baseline's in the same
round, the median of these paired ratios and their interquartile range.  Beside each B the
roofline's forward routing time relative to B = 1 (``block_product_seconds``).  The last column
marks the roofline's choice (``<- roofline``) and the measured fastest B (``<- fastest``): a
choice within one IQR of the fastest is as good as this machine can tell.

Run (the table in BENCHMARKS.md):
    python bench/bench_routing_block_sizes.py --repeats 9
``--device cuda`` takes the roofline of ``H100_SXM`` instead of ``CPU_2_CORE``.
"""

from __future__ import annotations

import argparse

from bench_lime_overhead import (
    SHAPE_COLUMNS,
    build,
    element_size,
    machine_balance,
    make_batch,
    measure_cases,
    paired_ratio,
    parse_paired_args,
    round_times,
    shape_parser,
)
from tables import field, print_table

from lime_megatron.models.lime.routing_blocks import (
    block_product_seconds,
    block_size_limit,
    routing_block_size,
)


def parse_args(argv=None) -> argparse.Namespace:
    parser = shape_parser(__doc__, [8, 16, 32])
    parser.set_defaults(repeats=9)
    return parse_paired_args(parser, argv)


def candidate_blocks(num_layers: int, chosen: int) -> list[int]:
    """B = 1, the powers of two up to the roofline's limit (``block_size_limit``), and ``chosen``."""
    limit = block_size_limit(num_layers)
    powers = {2**k for k in range(limit.bit_length()) if 2**k <= limit}
    return sorted(powers | {chosen})


def measure(args, num_layers: int, kv_heads: int) -> list[dict]:
    size, machine = element_size(args), machine_balance(args)
    chosen = routing_block_size(num_layers, kv_heads, size, machine)
    blocks = candidate_blocks(num_layers, chosen)
    models = {"base": build(args, num_layers, kv_heads, False)}
    models.update({block: build(args, num_layers, kv_heads, True, block) for block in blocks})
    times = round_times(args, models, make_batch(args))
    per_layer = block_product_seconds(num_layers, kv_heads, 1, size, machine)
    rows = []
    for block in blocks:
        ratio, spread = paired_ratio(times, block)
        roofline = block_product_seconds(num_layers, kv_heads, block, size, machine) / per_layer
        rows.append(dict(layers=num_layers, kv_heads=kv_heads, block=block, ratio=ratio, spread=spread,
                         roofline=roofline, chosen=block == chosen))
    fastest = min(rows, key=lambda row: row["ratio"])
    for row in rows:
        row["fastest"] = row is fastest
    return rows


def choice_marks(row: dict) -> str:
    """``<- roofline`` on the roofline's B, ``<- fastest`` on the measured fastest, else nothing."""
    return " ".join(mark for mark, on in (("<- roofline", row["chosen"]), ("<- fastest", row["fastest"])) if on)


COLUMNS = SHAPE_COLUMNS + [
    ("roofline fwd vs B=1", field("roofline", ".3f")),
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
    print(f"\nsummary: {len(settings)} settings; the roofline's B is the fastest or within one IQR of it "
          f"in {len(close)}; worst gap {max(chosen[k]['ratio'] - fastest[k]['ratio'] for k in settings):.3f} "
          "of the baseline's time")
    return rows


if __name__ == "__main__":
    main()
