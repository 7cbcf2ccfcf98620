"""Bytes each tensor-parallel rank sends per layer: LIMe routing vs megatron's own TP traffic.

Runs one forward+backward of LIMe and of the baseline at TP=2 without sequence parallelism (gloo,
2 processes; megatron's sequence-parallel collectives are bound at import time and would escape
the count) for several depths and counts
every collective actually issued, by wrapping ``torch.distributed``'s collectives during the step.
A collective is attributed to LIMe routing when it is issued from LIMe's model code
(``lime_megatron.models.lime``: the routing's reduce-scatter and all-gather in ``head_parallel``), to
megatron otherwise.  Bytes sent per rank use the ring cost of each collective on n ranks:
all-reduce 2(n-1)/n x size, reduce-scatter (n-1)/n x input, all-gather (n-1)/n x output.

Run (the figures in BENCHMARKS.md):
    python bench/bench_tp_communication.py
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter

import torch
import torch.distributed as dist
from tables import field, print_table

# Counted collectives and their ring cost per rank, as a multiple of (n - 1) / n x tensor bytes.
_COST = {
    "all_reduce": 2,
    "reduce_scatter_tensor": 1,
    "_reduce_scatter_base": 1,
    "all_gather_into_tensor": 1,
    "_all_gather_base": 1,
}
_SIZE_ARG = {
    "all_reduce": 0,
    "reduce_scatter_tensor": 1,
    "_reduce_scatter_base": 1,
    "all_gather_into_tensor": 0,
    "_all_gather_base": 0,
}


def count_collectives(counter: Counter):
    """Wrap torch.distributed's collectives so each call adds its bytes to ``counter``."""
    originals = {name: getattr(dist, name) for name in _COST if hasattr(dist, name)}

    def wrap(name, function):
        def counted(*args, **kwargs):
            tensor = args[_SIZE_ARG[name]]
            group = kwargs.get("group")
            n = dist.get_world_size(group)
            caller = sys._getframe(1).f_globals.get("__name__", "")
            owner = "lime" if caller.startswith("lime_megatron.models.lime.") else "megatron"
            counter[owner] += _COST[name] * (n - 1) / n * tensor.numel() * tensor.element_size()
            return function(*args, **kwargs)

        return counted

    for name, function in originals.items():
        setattr(dist, name, wrap(name, function))
    return originals


def measure(depths, hidden: int, heads: int, kv_heads: int, seq: int, batch: int):
    from lime_megatron.models.config import lime_config
    from lime_megatron.models.gpt_model import build_model
    from lime_megatron.testing.distributed import Layout, initialize_layout, layout_config_kwargs

    rows = []
    for lime in (False, True):
        for depth in depths:
            layout = Layout(tp=2)
            initialize_layout(layout)
            config = lime_config(
                num_layers=depth,
                hidden_size=hidden,
                num_attention_heads=heads,
                num_query_groups=kv_heads,
                use_cpu_initialization=True,
                lime=lime,
                **layout_config_kwargs(layout),
            )
            model = build_model(config, vocab_size=128, max_sequence_length=seq)
            tokens = torch.randint(0, 128, (batch, seq))
            positions = torch.arange(seq).expand(batch, seq)
            counter: Counter = Counter()
            originals = count_collectives(counter)
            try:
                model(tokens, positions, None, labels=tokens).mean().backward()
            finally:
                for name, function in originals.items():
                    setattr(dist, name, function)
            rows.append(
                dict(lime=lime, depth=depth, megatron=counter["megatron"] / depth, routing=counter["lime"] / depth)
            )
    return rows


def print_results(rows: list[dict], args) -> None:
    base = {r["depth"]: r["megatron"] for r in rows if not r["lime"]}
    print(
        f"TP=2, hidden {args.hidden_size}, {args.num_attention_heads} heads, "
        f"{args.kv_heads} kv heads, seq {args.seq_length}, batch {args.micro_batch_size}, fp32; "
        "KiB sent per rank per layer, forward+backward"
    )
    print_table(
        [
            ("layers", field("depth")),
            ("baseline TP", lambda row: f"{base[row['depth']] / 1024:.1f}"),
            ("LIMe: megatron", field("megatron", ".1f", 1024)),
            ("LIMe: routing", field("routing", ".1f", 1024)),
            ("routing/base", lambda row: f"{row['routing'] / base[row['depth']]:.3f}"),
        ],
        [r for r in rows if r["lime"]],
    )


def worker(args):
    rows = measure(
        args.depths, args.hidden_size, args.num_attention_heads, args.kv_heads, args.seq_length, args.micro_batch_size
    )
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--depths", type=int, nargs="+", default=[8, 32, 128])
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--num-attention-heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--seq-length", type=int, default=32)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    args = parser.parse_args(argv)
    from lime_megatron.testing.distributed import run_distributed

    rows = run_distributed(worker, 2, args)[0]
    print_results(rows, args)
    print(
        "\nsummary: LIMe routing sends one reduce-scatter of the partial routed K/V per layer "
        "(forward, and again when backward rebuilds them) and one all-gather of their gradient; "
        "the amount per layer does not depend on depth."
    )


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
