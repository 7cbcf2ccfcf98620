"""Projected LIMe routing overhead on an H100-class GPU (a roofline projection, not a measurement).

For the paper's 1B shapes (16 layers, hidden 2048, 32 heads of 64, FFN 8192, vocabulary 50k,
seq 2048; MHA and GQA with 8 kv heads) and a deep 128-layer variant, bf16: the routing products'
time per step is the roofline max(bytes read / bandwidth, FLOPs / peak) of each kind of product
(``planning.routing_bytes``: forward, router-weight gradient, row gradient, and with
``lime_recompute_routed_kv`` the rebuild under TransformerEngine's fused attention), the baseline
time the model's training FLOPs at ``--mfu`` of the peak.  Printed per layer (B = 1) and blocked
(B from ``planning.routing_block.routing_block_size`` on the H100's figures without host time:
a step at that MFU is kernel-bound, the host's operators hidden behind the kernels) with the routed
K/V kept (the default), and blocked with them rebuilt, beside the paper's Table 9.

A second table projects each routing path (``--lime-routing-kernel``: torch operators or the
Triton kernels) on an H100 and an H200 with the block-size chooser's own step model
(``planning.routing_block``: the baseline's host operators and its kernels at the local spec's
16% of peak, LIMe's products at the roofline and its host operators per path, the step the longer
of host and device): the 1B shapes at micro batch 4 and the deep-narrow 128-layer shape (hidden
512, 8 heads of 64, FFN 2048) at micro batch 1 and 4, the block size each path's chooser takes,
LIMe's step over the baseline's and which side sets the pace.

Run (the tables in docs/routing.md):
    python bench/roofline_routing.py
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import torch
from tables import field, print_table

from lime_megatron.models.config import lime_config
from lime_megatron.planning.flops import forward_flops_per_token, router_flops_per_token
from lime_megatron.planning.routing_block import (
    H100_SXM,
    H200,
    TORCH_OPERATORS,
    TRITON_OPERATORS,
    baseline_work,
    routing_block_size,
    routing_step_seconds,
)
from lime_megatron.planning.routing_bytes import routing_bytes_per_step

KERNEL_BOUND_H100 = replace(H100_SXM, seconds_per_operator=0.0)

PAPER_TABLE_9 = {(16, 32): "+10.5%", (16, 8): "+1.2-1.6%"}  # LIMe step-time overhead over LLaMA, H100

PATH_SHAPES = {  # name: (model settings, micro batch)
    "1B MHA": (dict(num_layers=16, hidden_size=2048, num_attention_heads=32, ffn_hidden_size=8192), 4),
    "1B GQA-8": (
        dict(num_layers=16, hidden_size=2048, num_attention_heads=32, num_query_groups=8, ffn_hidden_size=8192),
        4,
    ),
    "deep-128 mb1": (dict(num_layers=128, hidden_size=512, num_attention_heads=8, ffn_hidden_size=2048), 1),
    "deep-128 mb4": (dict(num_layers=128, hidden_size=512, num_attention_heads=8, ffn_hidden_size=2048), 4),
}
"""The shapes of the per-path projection (bf16, seq 2048); deep-128 is the one the H200 measured."""

PATHS = {"torch": TORCH_OPERATORS, "triton": TRITON_OPERATORS}


def projected_overhead(
    num_layers: int, kv_heads: int, block: int, seq: int, mfu: float, rebuild: bool = False
) -> float:
    config = lime_config(
        num_layers=num_layers,
        hidden_size=2048,
        num_attention_heads=32,
        num_query_groups=kv_heads,
        ffn_hidden_size=8192,
        params_dtype=torch.bfloat16,
        use_cpu_initialization=True,
        lime_recompute_routed_kv=rebuild,
    )
    vocab = 50304
    routing_flops = router_flops_per_token(config)
    base_flops = forward_flops_per_token(config, seq, vocab) - routing_flops
    seconds = 0.0
    for read in routing_bytes_per_step(config, seq, 1, block, transformer_impl="transformer_engine").values():
        if read:
            seconds += max(read / H100_SXM.bytes_per_s, routing_flops * seq / H100_SXM.flops_per_s)
    base_seconds = 3 * base_flops * seq / (mfu * H100_SXM.flops_per_s)
    return seconds / base_seconds


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--mfu", type=float, default=0.4, help="baseline model FLOP utilisation assumed")
    args = parser.parse_args(argv)
    print(f"machine: {H100_SXM.name}; baseline at {args.mfu:.0%} MFU; seq {args.seq_length}")
    rows = []
    for layers in (16, 128):
        for kv in (32, 8):
            block = routing_block_size(range(layers), kv, 2 * args.seq_length * 64, 2, KERNEL_BOUND_H100)  # head dim 64
            per_layer, blocked = (projected_overhead(layers, kv, b, args.seq_length, args.mfu) for b in (1, block))
            rebuilt = projected_overhead(layers, kv, block, args.seq_length, args.mfu, rebuild=True)
            rows.append(
                dict(
                    layers=layers,
                    kv_heads=kv,
                    block=block,
                    per_layer=per_layer,
                    blocked=blocked,
                    rebuilt=rebuilt,
                    paper=PAPER_TABLE_9.get((layers, kv), "-"),
                )
            )
    print_table(
        [
            ("layers", field("layers")),
            ("kv", field("kv_heads")),
            ("B", field("block")),
            ("B=1 overhead", field("per_layer", ".1%")),
            ("blocked", field("blocked", ".1%")),
            ("blocked, rebuilt", field("rebuilt", ".1%")),
            ("paper Table 9", field("paper")),
        ],
        rows,
    )
    print_paths(args.seq_length)


def path_projection(name: str, machine, path: str, seq: int) -> dict:
    """One row of the per-path table: the chooser's block size for ``path`` on ``machine`` and
    LIMe's projected step over the baseline's (``routing_step_seconds`` with ``baseline_work``)."""
    settings, micro_batch = PATH_SHAPES[name]
    config = lime_config(params_dtype=torch.bfloat16, use_cpu_initialization=True, **settings)
    layers, machine = range(config.num_layers), replace(machine, operators=PATHS[path])
    row, kv = 2 * seq * micro_batch * config.kv_channels, config.kv_heads
    baseline = baseline_work(config, layers, seq, micro_batch, machine)
    block = routing_block_size(layers, kv, row, 2, machine, baseline=baseline)
    step = routing_step_seconds(layers, kv, block, row, 2, machine, baseline=baseline)
    return dict(
        shape=name,
        machine=machine.name.split(" (")[0],
        path=path,
        block=block,
        overhead=step / max(baseline) - 1,
        pace="host" if baseline[0] > baseline[1] else "device",
    )


def print_paths(seq: int) -> None:
    print("\nper routing path, the chooser's step model (baseline at the local spec's 16% of peak):")
    rows = [
        path_projection(name, machine, path, seq)
        for name in PATH_SHAPES
        for machine in (H100_SXM, H200)
        for path in PATHS
    ]
    columns = [("shape", field("shape")), ("machine", field("machine")), ("path", field("path"))]
    columns += [
        ("B", field("block")),
        ("LIMe over baseline", field("overhead", "+.1%")),
        ("baseline pace", field("pace")),
    ]
    print_table(columns, rows)


if __name__ == "__main__":
    main()
