"""Host time LIMe adds per layer over the LLaMA baseline: the Python and dispatching around its
routing, on the torch path and on the Triton path a GPU runs.

Where kernels are short (a deep narrow model, micro batch 1), a GPU step lasts as long as the host
takes to queue it, so LIMe's overhead there is its host time per layer over the baseline's, not
its FLOPs (docs/routing.md, "Host work per layer").  The operator counts
(``bench_lime_overhead.py``, "ops/layer over base") count what LIMe dispatches; this bench times
what the host spends, Python included, at a shape where every kernel costs next to nothing.

For each depth it builds the baseline and LIMe at each block size of ``--blocks`` on each routing
path of ``--paths`` and times one forward+backward of each per round, in an order rotated by one
each round (``bench_lime_overhead.round_times``).  Per model the table gives the median over rounds
of its time minus the baseline's in the same round, per layer, in microseconds, and the baseline's
own time per layer.  On a CPU the Triton path's launches are not run (``kernels.operands``' launch
observer drops them; in Triton's interpreter a launch costs a thousand times a GPU's): its figure
is the host's work around the launches, the launches' own cost on a GPU host (Triton's argument
binding and the driver call) not included.  With ``--device cuda`` every launch runs.

Run (the figures in BENCHMARKS.md, "Host time per layer"):
    python bench/bench_host_time.py
"""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Iterator

import cpu_triton  # noqa: F401 - before the package: Triton's interpreter on a CPU
from bench_lime_overhead import build_shape, make_batch, measure_cases, parse_paired_args, round_times, shape_parser
from tables import field, print_table

from lime_megatron.kernels.operands import set_launch_observer


def parse_args(argv=None):
    parser = shape_parser(__doc__, [32, 128])
    parser.set_defaults(
        kv_heads=[4],
        hidden_size=32,
        num_attention_heads=4,
        ffn_hidden_size=64,
        seq_length=4,
        micro_batch_size=1,
        vocab_size=64,
        repeats=15,
    )
    parser.add_argument("--blocks", type=int, nargs="+", default=[1, 4], help="routing block sizes B")
    parser.add_argument("--paths", nargs="+", choices=("torch", "triton"), default=["torch", "triton"])
    return parse_paired_args(parser, argv)


@contextlib.contextmanager
def launches_dropped(device: str) -> Iterator[None]:
    """On a CPU, the routing kernels' launches not run for the ``with`` block (their outputs hold
    whatever their memory held: the host's work is what is timed); on a GPU nothing changes."""
    if device != "cpu":
        yield
        return
    set_launch_observer(lambda launch, run: None)
    try:
        yield
    finally:
        set_launch_observer(None)


def model_name(path: str, block: int) -> str:
    return f"{path} B={block}"


def measure(args, num_layers: int, kv_heads: int) -> dict:
    """One row: the baseline's microseconds per layer and each LIMe model's extra per layer."""
    models = {"base": build_shape(args, num_layers, kv_heads, lime=False)}
    for path in args.paths:
        for block in args.blocks:
            models[model_name(path, block)] = build_shape(
                args, num_layers, kv_heads, lime=True, lime_routing_kernel=path, lime_routing_block=block
            )
    with launches_dropped(args.device):
        times = round_times(args, models, make_batch(args))
    row = dict(layers=num_layers, kv_heads=kv_heads, base_us=1e6 * statistics.median(times["base"]) / num_layers)
    for name in models.keys() - {"base"}:
        extra = [lime - base for lime, base in zip(times[name], times["base"])]
        row[f"{name} us"] = 1e6 * statistics.median(extra) / num_layers
    return row


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    rows = measure_cases(args, measure)
    names = [model_name(path, block) for path in args.paths for block in args.blocks]
    columns = [
        ("layers", field("layers")),
        ("kv", field("kv_heads")),
        ("base us/layer", field("base_us", ".0f")),
        *((f"{name}: extra us/layer", field(f"{name} us", ".0f")) for name in names),
    ]
    print_table(columns, rows, markdown=True)
    return rows


if __name__ == "__main__":
    main()
