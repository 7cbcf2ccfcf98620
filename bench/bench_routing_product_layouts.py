"""GFLOP/s of one routing product in each output layout, on this machine.

A routing product is ``narrow [r, k] @ rows [k, N]`` with N = 2*s*b*d (one buffer row holds a
head's keys and values, ``routing_blocks``).  Its result can be written

- as rows ``[r, N]`` (one matrix product; attention then needs a rearranging copy), or
- in attention's layout ``[2*s*b, r, d]`` (``routing_products.routing_product_attention_layout``:
  one strided-batched product over the 2*s*b positions, no copy after it),

and the router-weight gradient ``g [r, N] @ rows^T`` contracts over N.  Shapes: the bench model's
(kv 8, d 32, seq 256, batch 2; fp32), r = kv (a layer's in-block product) and B*kv = 80 (a block's
earlier-source product at B = 10), k from one block to 127 layers of rows.  Median of ``--repeats``.

Run (the table in BENCHMARKS.md, "Where LIMe's extra time goes"):
    python bench/bench_routing_product_layouts.py
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from tables import field, print_table

from lime_megatron.models.lime.routing_products import routing_product, routing_product_attention_layout


def gflops(product, flops: float, repeats: int) -> float:
    """Median GFLOP/s of ``product()`` over ``repeats`` calls after one warm-up."""
    product()
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        product()
        seconds.append(time.perf_counter() - start)
    return flops / statistics.median(seconds) / 1e9


def measure(outputs: int, sources: int, kv: int, head_dim: int, positions: int, repeats: int) -> dict:
    narrow = torch.randn(outputs, sources * kv)
    rows = torch.randn(sources * kv, positions * head_dim)
    grad = torch.randn(outputs, positions * head_dim)
    flops = 2.0 * outputs * sources * kv * positions * head_dim
    return dict(
        outputs=outputs,
        sources=sources,
        rows=gflops(lambda: routing_product("bench", narrow, rows), flops, repeats),
        attention=gflops(lambda: routing_product_attention_layout("bench", narrow, rows, head_dim), flops, repeats),
        weight_grad=gflops(lambda: grad @ rows.t(), flops, repeats),
    )


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--positions", type=int, default=2 * 256 * 2, help="2 * seq * batch")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    cases = [
        (args.kv_heads, 10),
        (args.kv_heads, 127),
        (10 * args.kv_heads, 10),
        (10 * args.kv_heads, 64),
        (10 * args.kv_heads, 127),
    ]
    rows = [measure(r, k, args.kv_heads, args.head_dim, args.positions, args.repeats) for r, k in cases]
    print_table(
        [
            ("outputs r", field("outputs")),
            ("source layers", field("sources")),
            ("rows [r,N] GF/s", field("rows", ".1f")),
            ("attention [2sb,r,d] GF/s", field("attention", ".1f")),
            ("weight grad GF/s", field("weight_grad", ".1f")),
        ],
        rows,
    )
    gains = [row["attention"] / row["rows"] for row in rows]
    print(
        f"\nsummary: attention layout / rows {min(gains):.2f}-{max(gains):.2f}x over {len(rows)} shapes "
        f"({torch.get_num_threads()} threads)"
    )
    return rows


if __name__ == "__main__":
    main()
