"""Hyper-Connections and LIMe over the LLaMA baseline: forward+backward time, bytes saved for
backward, and the bytes each pipeline rank receives per micro-batch.

For each depth it builds LLaMA, LIMe (full router), HC (n = 4, dynamic: the paper's) and mHC
(n = 4, manifold-constrained, megatron-core main's) with the same shape and measures them in the
same process, interleaved (``bench_lime_overhead``'s step and saved-bytes helpers): median
forward+backward wall time over ``--repeats`` runs after ``--warmup``, and the bytes autograd keeps
from one forward; ratios over LLaMA, beside the paper's Table 9 ratios (1B, H100, PyTorch
Inductor: step time and peak memory, GQA and full attention, default mode).

Pipeline: per micro-batch (forward direction; backward returns as many) the bytes the hop into each
rank carries at PP=4 without virtual stages: LLaMA, HC and mHC megatron's stage tensor (HC's and
mHC's hold the n streams, ``[s, b * n, hidden]``), LIMe the stage tensor plus the K/V rows of its side channel
(``lime_megatron.parallel.pipeline.hop_bytes``).

Run (the figures in BENCHMARKS.md):
    python bench/bench_hc_overhead.py
"""

from __future__ import annotations

import argparse

from bench_lime_overhead import build_shape, make_batch, median_times, saved_bytes, shape_config, shape_parser
from tables import field, print_table
from tqdm import tqdm

from lime_megatron.parallel.pipeline import hop_bytes
from lime_megatron.parallel.process_groups import initialize_parallel

MODELS = {
    "LLaMA": dict(lime=False),
    "LIMe": dict(lime=True),
    "HC": dict(lime=False, hyper_connections=4),
    "mHC": dict(lime=False, hyper_connections=4, hyper_connections_manifold=True),
}
OTHERS = [name for name in MODELS if name != "LLaMA"]
# Paper Table 9 (default mode): step time and peak memory over LLaMA, GQA and full attention.
TABLE_9 = {
    ("LIMe", "time"): "+1.57% / +10.46%",
    ("LIMe", "memory"): "+0.00% / +0.01%",
    ("HC", "time"): "+25.39% / +22.85%",
    ("HC", "memory"): "+5.88% / +2.87%",
}
PIPELINE_STAGES = 4
ELEMENT_BYTES = 2  # bf16 stage tensors, as on GPU


def parse_args(argv=None) -> argparse.Namespace:
    parser = shape_parser(__doc__, [16, 32, 64, 128])
    parser.set_defaults(kv_heads=[8])
    return parser.parse_args(argv)


def measure(args, num_layers: int, kv_heads: int) -> dict:
    models = {name: build_shape(args, num_layers, kv_heads, **overrides) for name, overrides in MODELS.items()}
    batch = make_batch(args)
    return dict(
        layers=num_layers,
        kv_heads=kv_heads,
        time=median_times(args, models, batch),
        saved={name: saved_bytes(model, batch) for name, model in models.items()},
    )


def received_bytes(args, num_layers: int, kv_heads: int) -> dict[str, list[int]]:
    """Bytes each pipeline rank 1..3 receives per micro-batch at PP=4 (rank 0 receives nothing)."""
    stage = args.seq_length * args.micro_batch_size * args.hidden_size * ELEMENT_BYTES
    lime = shape_config(args, num_layers, kv_heads, **MODELS["LIMe"], pipeline_model_parallel_size=PIPELINE_STAGES)
    received = {
        name: [stage * shape_config(args, num_layers, kv_heads, **MODELS[name]).residual_streams]
        * (PIPELINE_STAGES - 1)
        for name in MODELS
        if name != "LIMe"
    }
    received["LIMe"] = [
        hop_bytes(lime, rank, args.seq_length, args.micro_batch_size, ELEMENT_BYTES)
        for rank in range(1, PIPELINE_STAGES)
    ]
    return received


def over_llama(measure: str, name: str):
    """The cell of model ``name``'s ``measure`` ("time" or "saved") over LLaMA's."""
    return lambda row: f"{row[measure][name] / row[measure]['LLaMA']:.3f}"


def print_tables(rows: list[dict], args) -> None:
    print(
        f"forward+backward on {args.device} in {args.dtype}, hidden {args.hidden_size}, {args.num_attention_heads} "
        f"heads, seq {args.seq_length}, micro batch {args.micro_batch_size}; ratios over LLaMA"
    )
    columns = [
        ("layers", field("layers")),
        ("kv", field("kv_heads")),
        ("LLaMA s", lambda row: f"{row['time']['LLaMA']:.3f}"),
    ]
    columns += [(f"{name} x", over_llama("time", name)) for name in OTHERS]
    columns += [("LLaMA MiB", lambda row: f"{row['saved']['LLaMA'] / 2**20:.1f}")]
    columns += [(f"{name} x", over_llama("saved", name)) for name in OTHERS]
    print_table(columns, rows)
    print(
        "paper Table 9 (1B, H100, default mode; GQA / full): "
        + "; ".join(f"{model} {kind} {value}" for (model, kind), value in TABLE_9.items())
    )
    print(f"\nbytes received per micro-batch at PP={PIPELINE_STAGES} (bf16; ranks 1..{PIPELINE_STAGES - 1}), MiB")
    for r in rows:
        received = received_bytes(args, r["layers"], r["kv_heads"])
        print(
            f"{r['layers']:>6} layers, kv {r['kv_heads']}: "
            + "; ".join(f"{name} {', '.join(f'{b / 2**20:.2f}' for b in values)}" for name, values in received.items())
        )


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    initialize_parallel()
    rows = []
    cases = [(kv_heads, layers) for kv_heads in args.kv_heads for layers in args.depths]
    for kv_heads, layers in tqdm(cases, desc="depth x kv-heads"):
        rows.append(measure(args, layers, kv_heads))
        tqdm.write(f"L{layers} kv {kv_heads}: seconds {rows[-1]['time']}, saved bytes {rows[-1]['saved']}")
    print_tables(rows, args)
    print(
        f"\nsummary: {len(rows)} settings; over LLaMA, time / saved bytes up to: "
        + "; ".join(
            f"{name} {max(r['time'][name] / r['time']['LLaMA'] for r in rows):.3f} / "
            f"{max(r['saved'][name] / r['saved']['LLaMA'] for r in rows):.3f}"
            for name in OTHERS
        )
    )
    return rows


if __name__ == "__main__":
    main()
