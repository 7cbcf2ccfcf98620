"""Dynamic LIMe (v1) against static LIMe and LLaMA: forward+backward time, saved bytes
and FLOP floors, the three models of one shape built and timed interleaved in one process.

- time: median forward+backward wall time over ``--repeats`` runs (after ``--warmup``), as
  ``bench_lime_overhead.py`` measures it (static LIMe with the roofline's routing block);
- floor: 1 + router FLOPs / baseline FLOPs (``planning.flops``) for each router;
- saved: bytes autograd keeps for backward, from one forward (the dynamic router's per-token
  weights p_l included).

Run (the figures in BENCHMARKS.md):
    python bench/bench_dynamic_router.py
"""

from __future__ import annotations

import argparse

from bench_lime_overhead import build, flop_floor, make_batch, measure_cases, median_times, saved_bytes, shape_parser
from tables import field, print_table, ratio


def parse_args(argv=None) -> argparse.Namespace:
    return shape_parser(__doc__, [8, 16, 32, 64]).parse_args(argv)


def measure(args, num_layers: int, kv_heads: int) -> dict:
    models = {
        "base": build(args, num_layers, kv_heads, False),
        "static": build(args, num_layers, kv_heads, True),
        "dynamic": build(args, num_layers, kv_heads, True, router="dynamic"),
    }
    batch = make_batch(args)
    times = median_times(args, models, batch)
    row = dict(layers=num_layers, kv_heads=kv_heads)
    for name, model in models.items():
        row[f"{name}_s"] = times[name]
        row[f"{name}_saved"] = saved_bytes(model, batch)
        row[f"{name}_floor"] = flop_floor(args, model.config) if name != "base" else 1.0
    return row


COLUMNS = [
    ("layers", field("layers")),
    ("kv", field("kv_heads")),
    ("base s", field("base_s", ".3f")),
    ("static x", ratio("static_s", "base_s")),
    ("dynamic x", ratio("dynamic_s", "base_s")),
    ("dyn/static", ratio("dynamic_s", "static_s")),
    ("floor st", field("static_floor", ".3f")),
    ("floor dyn", field("dynamic_floor", ".3f")),
    ("saved st x", ratio("static_saved", "base_saved")),
    ("saved dyn x", ratio("dynamic_saved", "base_saved")),
]
"""The table's columns: static and dynamic LIMe's time and saved bytes over the baseline's."""


def main(argv=None) -> list[dict]:
    rows = measure_cases(parse_args(argv), measure)
    print_table(COLUMNS, rows)
    worst = max(rows, key=lambda r: r["dynamic_s"] / r["static_s"])
    print(
        f"\nsummary: {len(rows)} settings; dynamic over static LIMe time at most "
        f"{worst['dynamic_s'] / worst['static_s']:.3f} (L{worst['layers']}, kv {worst['kv_heads']}); dynamic saved "
        f"bytes at most {max(r['dynamic_saved'] / r['base_saved'] for r in rows):.3f}x the baseline's"
    )
    return rows


if __name__ == "__main__":
    main()
