"""Dynamic LIMe (v1, issue 24) against static LIMe and LLaMA: forward+backward time, saved bytes
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


def parse_args(argv=None) -> argparse.Namespace:
    return shape_parser(__doc__, [8, 16, 32, 64]).parse_args(argv)


def measure(args, num_layers: int, kv_heads: int) -> dict:
    models = {"base": build(args, num_layers, kv_heads, False), "static": build(args, num_layers, kv_heads, True),
              "dynamic": build(args, num_layers, kv_heads, True, router="dynamic")}
    batch = make_batch(args)
    times = median_times(args, models, batch)
    row = dict(layers=num_layers, kv_heads=kv_heads)
    for name, model in models.items():
        row[f"{name}_s"] = times[name]
        row[f"{name}_saved"] = saved_bytes(model, batch)
        row[f"{name}_floor"] = flop_floor(args, model.config) if name != "base" else 1.0
    return row


def print_table(rows: list[dict]) -> None:
    header = (f"{'layers':>6} {'kv':>3} {'base s':>8} {'static x':>9} {'dynamic x':>10} {'dyn/static':>10} "
              f"{'floor st':>9} {'floor dyn':>10} {'saved st x':>10} {'saved dyn x':>11}")
    print(header)
    print("-" * len(header))
    for r in rows:
        static, dynamic = r["static_s"] / r["base_s"], r["dynamic_s"] / r["base_s"]
        print(f"{r['layers']:>6} {r['kv_heads']:>3} {r['base_s']:>8.3f} {static:>9.3f} {dynamic:>10.3f} "
              f"{dynamic / static:>10.3f} {r['static_floor']:>9.3f} {r['dynamic_floor']:>10.3f} "
              f"{r['static_saved'] / r['base_saved']:>10.3f} {r['dynamic_saved'] / r['base_saved']:>11.3f}")


def main(argv=None) -> list[dict]:
    rows = measure_cases(parse_args(argv), measure)
    print_table(rows)
    worst = max(rows, key=lambda r: r["dynamic_s"] / r["static_s"])
    print(f"\nsummary: {len(rows)} settings; dynamic over static LIMe time at most "
          f"{worst['dynamic_s'] / worst['static_s']:.3f} (L{worst['layers']}, kv {worst['kv_heads']}); dynamic saved "
          f"bytes at most {max(r['dynamic_saved'] / r['base_saved'] for r in rows):.3f}x the baseline's")
    return rows


if __name__ == "__main__":
    main()
