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
own time per layer; then, from further steps of each LIMe model alone, the medians of the
seconds spent inside LIMe's routing autograd functions (``RouteKeysValues`` and the blocks'
``MixEarlierSources``/``MixEarlierRows``, forward and backward, timed around each call:
``routing_timers``), per layer: the part of LIMe's extra host time that is its routing code, free of
the paired difference's spread; and, on a CPU, LIMe's Python calls per layer beyond the
baseline's in one step (this project's functions and the built-ins they call,
``testing.python_calls``: the same in every run, where the times move by more than a cut does).
On a CPU the Triton path's launches are not run (``kernels.operands``' launch observer drops them;
in Triton's interpreter a launch costs a thousand times a GPU's): its figure is the host's work
around the launches, the launches' own cost on a GPU host (Triton's argument binding and the
driver call) not included.  With ``--device cuda`` every launch runs.

Run (the figures in BENCHMARKS.md, "Host time per layer: the Triton path's Python"):
    python bench/bench_host_time.py
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator

import cpu_triton  # noqa: F401 - before the package: Triton's interpreter on a CPU
from bench_lime_overhead import (
    build_shape,
    frozen_heap,
    make_batch,
    measure_cases,
    parse_paired_args,
    round_times,
    shape_parser,
    train_step,
)
from tables import field, print_table, write_json

from lime_megatron.kernels.operands import launches_observed
from lime_megatron.models.lime.fused_blocks import MixEarlierRows
from lime_megatron.models.lime.memory import RouteKeysValues
from lime_megatron.models.lime.routing_blocks import MixEarlierSources
from lime_megatron.testing.python_calls import PROJECT, PythonCalls

ROUTING_FUNCTIONS = (RouteKeysValues, MixEarlierSources, MixEarlierRows)
"""LIMe's autograd functions of static routing: a layer's Eqs. 1-2 and a block's earlier sums."""

PHASES = ("forward", "backward")
"""What ``routing_timers`` times of each of them."""

TIMED = (*PHASES, "launches")
"""What ``routing_seconds`` reports per step: the phases, and the launches' share (``launch_timer``)."""


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
    parser.add_argument("--json", metavar="PATH", help="also write the measured rows to PATH")
    return parse_paired_args(parser, argv)


@contextlib.contextmanager
def launches_dropped(device: str) -> Iterator[None]:
    """On a CPU, the routing kernels' launches not run for the ``with`` block (their outputs hold
    whatever their memory held: the host's work is what is timed); on a GPU nothing changes."""
    if device != "cpu":
        yield
        return
    with launches_observed(lambda launch, run: None):
        yield


@contextlib.contextmanager
def routing_timers(seconds: dict[str, float]) -> Iterator[None]:
    """For the ``with`` block, the seconds spent inside the ``forward`` and the ``backward`` of each
    of ``ROUTING_FUNCTIONS`` added into ``seconds["forward"]`` and ``seconds["backward"]``."""
    originals = [(function, phase, function.__dict__[phase]) for function in ROUTING_FUNCTIONS for phase in PHASES]
    for function, phase, original in originals:
        setattr(function, phase, staticmethod(_timed(original.__func__, seconds, phase)))
    try:
        yield
    finally:
        for function, phase, original in originals:
            setattr(function, phase, original)


def _timed(call: Callable, seconds: dict[str, float], phase: str) -> Callable:
    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return call(*args, **kwargs)
        finally:
            seconds[phase] = seconds.get(phase, 0.0) + time.perf_counter() - start

    return timed


def launch_timer(seconds: dict[str, float], device: str) -> contextlib.AbstractContextManager:
    """For a ``with`` block, the host's seconds inside the routing kernels' launches (Triton's
    argument binding and the driver call; the kernels run asynchronously) added into
    ``seconds["launches"]`` on a GPU; on a CPU the launches are dropped (``launches_dropped``).  The
    observer adds its own ``Launch`` record per launch (about 2 us) to the routing functions' times."""
    if device == "cpu":
        return contextlib.nullcontext()

    def timed(launch, run) -> None:
        start = time.perf_counter()
        run()
        seconds["launches"] += time.perf_counter() - start

    return launches_observed(timed)


def routing_seconds(args, model, batch) -> dict[str, float]:
    """Median seconds per step spent inside the routing functions (``routing_timers``), forward and
    backward, and, on a GPU, inside the routing kernels' launches (``launch_timer``), over
    ``args.repeats`` steps of ``model`` after ``args.warmup``."""
    steps = []
    for run in range(args.warmup + args.repeats):
        seconds = dict.fromkeys(TIMED, 0.0)
        with routing_timers(seconds), launch_timer(seconds, args.device):
            train_step(model, batch)
        if run >= args.warmup:
            steps.append(seconds)
    return {phase: statistics.median(step[phase] for step in steps) for phase in TIMED}


def python_calls(model, batch) -> int:
    """The calls of ``PROJECT`` in one forward+backward of ``model`` on a CPU (the launches not run;
    on a GPU autograd's backward runs on a thread of its own, which ``PythonCalls`` does not see)."""
    with PythonCalls() as calls:
        train_step(model, batch)
    return calls.total(PROJECT)


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
    batch = make_batch(args)
    with frozen_heap(), launches_dropped(args.device):
        times = round_times(args, models, batch)
        routing = {name: routing_seconds(args, models[name], batch) for name in models.keys() - {"base"}}
    calls = {name: python_calls(model, batch) for name, model in models.items()} if args.device == "cpu" else {}
    row = dict(layers=num_layers, kv_heads=kv_heads, base_us=1e6 * statistics.median(times["base"]) / num_layers)
    for name in models.keys() - {"base"}:
        extra = [lime - base for lime, base in zip(times[name], times["base"])]
        row[f"{name} us"] = 1e6 * statistics.median(extra) / num_layers
        for phase in TIMED:
            row[f"{name} {phase} us"] = 1e6 * routing[name][phase] / num_layers
        if calls:
            row[f"{name} calls"] = (calls[name] - calls["base"]) / num_layers
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
    print("\nInside the routing functions, us per layer (forward / backward):\n")
    inside = [
        (f"{name}", lambda row, name=name: f"{row[f'{name} forward us']:.0f} / {row[f'{name} backward us']:.0f}")
        for name in names
    ]
    print_table(columns[:2] + inside, rows, markdown=True)
    if args.device != "cpu":
        print("\nOf which inside the routing kernels' launches (Triton and the driver), us per layer:\n")
        launches = [(name, field(f"{name} launches us", ".0f")) for name in names]
        print_table(columns[:2] + launches, rows, markdown=True)
    print(f"\nPython calls per layer beyond the baseline's ({PROJECT}'s functions and the built-ins they call):\n")
    print_table(columns[:2] + [(name, field(f"{name} calls", ".1f")) for name in names], rows, markdown=True)
    if args.json:
        write_json(args.json, args, rows)
    return rows


if __name__ == "__main__":
    main()
