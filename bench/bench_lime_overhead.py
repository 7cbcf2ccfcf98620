"""LIMe overhead over the LLaMA baseline: forward+backward time and bytes saved for backward.

For each depth and kv-head count it builds the baseline and LIMe with the same shape, LIMe three
times: routing per layer (B = 1) and blocked with the block size the roofline picks
(``planning.routing_block.chunk_routing_block``), both keeping the routed K/V for attention's
backward (the default), and blocked rebuilding them in backward instead
(``lime_recompute_routed_kv``: one more router product per layer, less memory); then measures in
the same process, interleaving the four models:

- time: per round (after ``--warmup``; ``--repeats`` rounds, each model once per round, in an
  order rotated by one each round) each LIMe model's forward+backward wall time over the
  baseline's in the same round; the tables give the median of these paired ratios and, for
  blocked LIMe, their interquartile range ("IQR", over the floor like the ratio): the spread of
  this machine, against which a gap to the floor is read;
- routing reads: bytes the routing products read per step (``planning.routing_bytes``), B = 1
  and blocked;
- saved: bytes autograd keeps for backward (saved-tensor hooks, unique storages, parameters
  excluded), from one forward;
- FLOP floor: 1 + router FLOPs / baseline FLOPs (``lime_megatron.planning.flops``; causal attention
  counted at half), the time ratio an implementation costing exactly the router's FLOPs would get;
- copies: bytes written by copy operators (``copy_``, ``clone``, ``_to_copy``, ``stack``:
  ``contiguous`` and copying ``reshape`` included) in one forward+backward, counted by
  ``testing.copied_bytes``, blocked LIMe minus the baseline, beside the routing reads: the buffer
  rows rearranged to and from attention's ``[s, b, heads, d]`` layout, the store into the buffer
  and the rotated-key copy (docs/routing.md, "Copies").
  Counted, not timed: one step's copy time is below this VM's noise.

A second table says where the blocked model's time over the baseline goes, from extra rounds of
those two models with the products counted (``routing_reads`` times each product and counts its
FLOPs and the bytes it reads; on a GPU it synchronises around each product, so the paired ratios
above come from uncounted rounds): per round the products' time and the rest of the difference
(the store into the buffer, the row rearrangements, the partial-sum adds, the Python around them);
medians over rounds.  Beside them the rate the products ran at (GFLOP/s, GB/s of rows read) and
what they would take at the baseline's own rate (its FLOPs over its time), which is what the FLOP
floor assumes.  Last, the host's work: the ATen operators LIMe dispatches per layer beyond the
baseline in one forward+backward (``testing.dispatched_operators``; views included), per layer
(B = 1) and blocked, on the torch path and on the Triton path (a launch counted as one; on a CPU
the kernels run in Triton's interpreter at a small shape: counts only), which sets the pace where
kernels are short (the deep narrow shape on a GPU) and which a tiny shape times on this CPU:
    python bench/bench_lime_overhead.py --depths 32 128 --hidden-size 64 --ffn-hidden-size 128 \
        --seq-length 16 --micro-batch-size 1 --repeats 9

On a GPU "rest ms" is inflated: it comes from those counted rounds, whose synchronisations around
each product idle the device and expose the host's launches.  The GPU's own breakdown is
``--kernel-profile N``: after the timed rounds one forward+backward of the baseline and of blocked
LIMe under ``torch.profiler`` (CUDA activity on a GPU, CPU activity on a CPU), self device time
(CPU: self CPU time) summed by kernel or operator name, and a table of the N names with the most
LIMe-minus-baseline time (LIMe and baseline ms and calls) and the totals over all names, then the
N names the baseline spends the most time in (which kernels the attention ran as, in both); the
JSON row holds them as ``kernel_profile`` (lists of those entries), ``kernel_profile_total`` and
``kernel_profile_base``; then, from unprofiled steps, each model's host time (until its last
kernel is queued), wall time and the device's idle time in it (wall minus the profiled busy
time: ``host_and_idle``), which says where LIMe's wall time beyond its device time goes; and with
``--idle-profile``, from the profiled steps (the host's activity recorded beside the device's),
where the device waited: its idle ms before the work of each operator, the N names with the most
LIMe-minus-baseline idle ms, and the host's calls that wait for the device (synchronisations,
allocations; ``testing.device_idle``), as ``idle_profile``, ``idle_profile_total`` and
``blocking_calls`` (on a CPU none).  ``--launch-profile`` splits the routing kernels' share by
what each launch does (``testing.kernel_launches``): one forward+backward of blocked LIMe with
every launch timed between CUDA events, per kind (a mix with the store, the partial sums, the
weight gradient beside it; the weight gradient alone) the launches, their ms, the least bytes
they must move and the rate that gives, against the device's bandwidth (``launch_profile`` in the
JSON row); element counts after it and ``--launch-profile-warps W ...`` time the same step under
other mix tiles (``launch_profile_tiles``).  The JSON row is written after the timed rounds and
after each phase, so a run stopped at a time budget keeps what it measured.

What runs: ``--skip`` drops quantities, any of ``rebuilt`` (the model rebuilding the routed K/V:
not built nor timed), ``counts`` (the dispatched operators, torch and Triton), ``copies``,
``saved``, ``split`` (the counted rounds and the time split); a skipped quantity is absent from
the row and the JSON and its cells print as "-".  The paired timing of the baseline, B = 1 and
blocked always runs.  Each row records the wall seconds of each phase it ran (``phase_s``: build,
timed, the optional phases), printed as the last table, so a run under a time budget shows where
its time went.  Each timed step follows a full garbage collection and runs with the collector off
(``collector_paused``), the models built before frozen out of the collector's sight
(``frozen_heap``).

Run (the figures in BENCHMARKS.md):
    python bench/bench_lime_overhead.py
On a GPU (``--device cuda``; the block size then comes from the H100 roofline, ``H100_SXM``; the
H200 figures in BENCHMARKS.md):
    python bench/bench_lime_overhead.py --device cuda --dtype bfloat16 --hidden-size 512 \
        --ffn-hidden-size 2048 --seq-length 2048 --micro-batch-size 1 --repeats 7
(megatron's unfused attention keeps every layer's s x s probabilities: about 30 GiB per sequence
at 128 layers of this shape.)
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import math
import statistics
import time
from collections.abc import Callable, Iterator

import cpu_triton  # noqa: F401 - before the package: Triton's interpreter on a CPU
import torch
from tables import Column, field, print_table, ratio, write_json
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile
from tqdm import tqdm

from lime_megatron.choices import ROUTING_KERNELS
from lime_megatron.kernels.operands import MIX_TILES, MixTiles, use_mix_tiles
from lime_megatron.models.config import lime_config
from lime_megatron.models.gpt_model import build_model
from lime_megatron.parallel import fusions
from lime_megatron.parallel.fusions import Platform
from lime_megatron.parallel.process_groups import initialize_parallel
from lime_megatron.planning.flops import forward_flops_per_token, router_flops_per_token
from lime_megatron.planning.routing_block import CPU_2_CORE, MachineBalance, chunk_routing_block, present_machine
from lime_megatron.planning.routing_bytes import routing_bytes_per_step
from lime_megatron.testing.copied_bytes import CopiedBytes
from lime_megatron.testing.device_idle import (
    Totals,
    TraceEvent,
    blocking_calls,
    device_work,
    idle_gaps,
    trace_events,
)
from lime_megatron.testing.dispatched_operators import DispatchedOperators
from lime_megatron.testing.kernel_launches import KernelLaunches
from lime_megatron.testing.routing_reads import RoutingReads, routing_reads, synchronize_device_of
from lime_megatron.testing.saved_tensors import SavedTensorBytes


def shape_parser(description: str, depths: list[int]) -> argparse.ArgumentParser:
    """The model-shape and timing options of the overhead benches (``--depths`` default ``depths``)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--depths", type=int, nargs="+", default=depths)
    parser.add_argument("--kv-heads", type=int, nargs="+", default=[8, 2])
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--num-attention-heads", type=int, default=8)
    parser.add_argument("--ffn-hidden-size", type=int, default=1024)
    parser.add_argument("--seq-length", type=int, default=256)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument(
        "--vocab-size", type=int, default=256, help="small so that the transformer layers, not the logits, dominate"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    add_device_options(parser)
    return parser


def add_device_options(parser: argparse.ArgumentParser) -> None:
    """``--device``, ``--dtype``, ``--transformer-impl`` and ``--lime-routing-kernel``: where a
    bench's models run, in which dtype, with which layer spec and routing path (``device_config``
    and ``build_on_device`` apply them)."""
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--dtype", choices=("float32", "bfloat16"), default="float32", help="the parameters' and activations' dtype"
    )
    parser.add_argument(
        "--transformer-impl",
        choices=("local", "transformer_engine"),
        default="local",
        help="the layer spec (transformer_engine: GPU with TransformerEngine); on CUDA the models use the "
        "fused kernels a training run of that spec uses (lime_megatron.parallel.fusions)",
    )
    parser.add_argument(
        "--lime-routing-kernel",
        choices=ROUTING_KERNELS,
        default="auto",
        help="LIMe's routing path (auto: Triton on CUDA, torch on a CPU; kernels.routing_path)",
    )


def device_config(args, **fields):
    """The LIMe/LLaMA config of ``fields`` in ``args``' dtype and spec, with the fused kernels a
    training run on ``args.device`` uses (none on a CPU; none that needs megatron's DDP)."""
    dtype = getattr(torch, args.dtype)
    config = lime_config(
        bf16=dtype is torch.bfloat16,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        use_cpu_initialization=args.device == "cpu",
        transformer_impl=args.transformer_impl,
        **{"lime_routing_kernel": args.lime_routing_kernel, **fields},
    )
    platform = Platform.detect() if args.device == "cuda" else Platform(cuda=False)
    return fusions.without_ddp(fusions.resolve(platform, args.transformer_impl, 1)).apply(config)


def build_on_device(args, config, max_sequence_length: int):
    """The model of ``config`` (seed 0) with ``args``' spec on ``args.device``."""
    torch.manual_seed(0)
    model = build_model(config, args.vocab_size, max_sequence_length, transformer_impl=args.transformer_impl)
    return model.to(args.device)


def parse_paired_args(parser: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    """``parser``'s arguments for a bench reporting ``paired_ratio``: at least 2 timed rounds."""
    args = parser.parse_args(argv)
    if args.repeats < 2:
        parser.error(f"--repeats {args.repeats}: at least 2 timed rounds are needed for the spread of the ratios")
    return args


def parse_args(argv=None) -> argparse.Namespace:
    parser = shape_parser(__doc__, [8, 16, 32, 64, 128])
    parser.add_argument("--json", metavar="PATH", help="also write the measured rows to PATH, after each case")
    parser.add_argument(
        "--skip",
        nargs="+",
        choices=SKIP_CHOICES,
        default=[],
        help="quantities not to measure (absent from the rows, '-' in the tables): the rebuilt-K/V model, the "
        "operator counts, the copied bytes, the saved bytes, the counted rounds' time split",
    )
    parser.add_argument(
        "--kernel-profile",
        type=int,
        default=0,
        metavar="N",
        help="after the timed rounds, profile one forward+backward of the baseline and blocked LIMe and print "
        "the N kernels (CPU: operators) with the most LIMe-minus-baseline self time (0: off)",
    )
    parser.add_argument(
        "--idle-profile",
        action="store_true",
        help="with --kernel-profile on a GPU, record the host's activity beside the device's and print where "
        "the device waited: its idle ms before each operator's work and the host's blocking calls "
        "(testing.device_idle; the profile's post-processing takes seconds per 10,000 operators)",
    )
    parser.add_argument(
        "--launch-profile",
        nargs="*",
        type=int,
        metavar="ELEMENTS",
        help="after the timed rounds, time each routing-kernel launch of one forward+backward of blocked LIMe "
        "and print, per kind of launch, the launches, their ms, the GB they must move and the rate "
        "(testing.kernel_launches; the Triton path only); each ELEMENTS given: the same step again with the "
        "mixes' tiles at up to that many elements of a half in every launch (kernels.operands.MixTiles), beside the "
        "default's",
    )
    parser.add_argument(
        "--launch-profile-warps",
        nargs="+",
        type=int,
        default=[],
        metavar="WARPS",
        help="with --launch-profile, the same step again for each WARPS: the mixes' launches with that many "
        f"warps per program (Triton's num_warps; the default {MIX_TILES.warps})",
    )
    args = parse_paired_args(parser, argv)
    if args.kernel_profile < 0:
        parser.error(f"--kernel-profile {args.kernel_profile}: a count of names, 0 for none")
    if args.launch_profile_warps and args.launch_profile is None:
        parser.error("--launch-profile-warps varies the launch profile's step: give --launch-profile too")
    if args.idle_profile and not args.kernel_profile:
        parser.error("--idle-profile reads the kernel profile's steps: give --kernel-profile N too")
    return args


def shape_config(args, num_layers: int, kv_heads: int, **overrides):
    """The config of ``args``' shape and dtype with ``num_layers`` layers and ``kv_heads`` kv heads;
    ``overrides`` choose the model (``lime``, ``hyper_connections``, the routing options...)."""
    return device_config(
        args,
        num_layers=num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=kv_heads,
        ffn_hidden_size=args.ffn_hidden_size,
        **overrides,
    )


def build_shape(args, num_layers: int, kv_heads: int, **overrides):
    """A model of ``shape_config`` (seed 0) on ``args.device``."""
    return build_on_device(args, shape_config(args, num_layers, kv_heads, **overrides), args.seq_length)


def build(
    args,
    num_layers: int,
    kv_heads: int,
    lime: bool,
    block: int | None = None,
    router: str = "full",
    rebuild: bool = False,
):
    """The baseline (``lime=False``) or LIMe with ``router``, routing blocks of ``block`` layers
    (None: the cost model's, ``chosen_block``) and the routed K/V kept or rebuilt in backward."""
    if lime and block is None:
        block = chosen_block(args, num_layers, kv_heads, lime_router=router)
    return build_shape(
        args,
        num_layers,
        kv_heads,
        lime=lime,
        lime_router=router,
        lime_routing_block=block,
        lime_recompute_routed_kv=rebuild,
    )


def element_size(args) -> int:
    """Bytes per element of ``--dtype``."""
    return torch.empty(0, dtype=getattr(torch, args.dtype)).element_size()


def machine_balance(args) -> MachineBalance:
    """The figures the block size is chosen on: the GPU present for ``--device cuda``
    (``routing_block.present_machine``), else ``CPU_2_CORE``."""
    return present_machine() if args.device == "cuda" else CPU_2_CORE


def row_elements(args) -> int:
    """Elements of one kv head's routing row at the bench's shape: 2 * s * b * head dim."""
    return 2 * args.seq_length * args.micro_batch_size * (args.hidden_size // args.num_attention_heads)


def chosen_block(args, num_layers: int, kv_heads: int, **overrides) -> int:
    """The block size the trainer builds ``num_layers`` layers on one stage with at the bench's
    shape and device (``routing_block.chunk_routing_block``)."""
    config = shape_config(args, num_layers, kv_heads, lime=True, **overrides)
    return chunk_routing_block(config, range(num_layers), args.seq_length, args.micro_batch_size, machine_balance(args))


def make_batch(args):
    """(tokens, positions, attention mask) of one micro batch; the mask is None, as the trainer
    passes it: the causal layers make their own (TransformerEngine's fused attention never
    materialises one)."""
    tokens = torch.randint(0, args.vocab_size, (args.micro_batch_size, args.seq_length))
    positions = torch.arange(args.seq_length).expand_as(tokens)
    return tokens.to(args.device), positions.to(args.device), None


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """A full garbage collection, then Python's cyclic collector off for the ``with`` block and back
    to its state before after it, also when the block raises (megatron's ``--manual-gc``, for one
    step).  Why: a process holding megatron, TransformerEngine and 128 layers' autograd graphs
    tracks hundreds of thousands of objects, and a generation-2 collection over them (0.3 s on the
    2-core VM) starts whenever the allocation counts say so, i.e. at a random point of a random
    step; where the host sets the pace (128 layers, micro batch 1) that lands in some timed steps
    and not others and widens the spread of the paired ratios.  With the collector off inside the
    step the counts wait for the next collection outside it."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """The objects alive at entry (the modules imported, the models built) moved out of the
    collector's sight for the ``with`` block (``gc.freeze``) and back after it: the collection
    before each step then scans only what the steps made (at 128 layers on the 2-core VM 0.3 s
    without, under 1 ms with), and the models are collected as usual after the block."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def train_step(model, batch) -> float:
    """One forward+backward with the collector paused (``collector_paused``); returns its wall time
    in seconds (on a GPU, until its kernels end)."""
    return host_and_wall_step(model, batch)[1]


def host_and_wall_step(model, batch) -> tuple[float, float]:
    """``train_step``'s (host seconds: until the host has queued the step's last kernel, wall
    seconds: until the kernels end).  On a CPU the two are one."""
    with collector_paused():
        synchronize_device_of(batch[0])
        start = time.perf_counter()
        forward_backward(model, batch)
        host = time.perf_counter() - start
        synchronize_device_of(batch[0])
        return host, time.perf_counter() - start


def forward_backward(model, batch) -> torch.Tensor:
    """The bench's step: gradients cleared, the mean token loss of ``batch`` (tokens, positions,
    mask; the tokens as labels) and its backward; the loss."""
    tokens, positions, mask = batch
    for param in model.parameters():
        param.grad = None
    loss = model(tokens, positions, mask, labels=tokens).mean()
    loss.backward()
    return loss


def saved_bytes(model, batch) -> int:
    tokens, positions, mask = batch
    with SavedTensorBytes(model) as saved:
        loss = model(tokens, positions, mask, labels=tokens).mean()
    loss.backward()
    return saved.bytes


def dispatched_operators(model, batch) -> int:
    """ATen operators dispatched in one forward+backward (the host's work; a Triton launch one)."""
    train_step(model, batch)  # a first step dispatches one-off operators
    with DispatchedOperators() as counter:
        train_step(model, batch)
    return counter.total


TRITON_COUNT_SHAPE = dict(seq_length=8, micro_batch_size=1)
"""The shape the Triton path's operators are counted at: they do not depend on the sequence or
the batch, and on a CPU the kernels run in Triton's interpreter, a program at a time in Python."""


def triton_operators(args, num_layers: int, kv_heads: int, blocks: tuple[int, ...]) -> list[float]:
    """Operators per layer LIMe dispatches beyond the baseline on the Triton path at each block
    size of ``blocks``, counted at ``TRITON_COUNT_SHAPE`` (on a CPU in Triton's interpreter)."""
    tiny = argparse.Namespace(**{**vars(args), **TRITON_COUNT_SHAPE, "lime_routing_kernel": "triton"})
    batch = make_batch(tiny)
    base = dispatched_operators(build_shape(tiny, num_layers, kv_heads, lime=False), batch)
    lime = [build_shape(tiny, num_layers, kv_heads, lime=True, lime_routing_block=block) for block in blocks]
    return [(dispatched_operators(model, batch) - base) / num_layers for model in lime]


def copied_bytes(model, batch) -> int:
    """Bytes written by copies in one forward+backward."""
    with CopiedBytes() as counter:
        train_step(model, batch)
    return counter.bytes


def measure_cases(args, measure, json_path: str | None = None) -> list:
    """``measure(args, layers, kv_heads)`` for each of ``args.kv_heads`` and, inside, each of
    ``args.depths``, in one process with megatron's parallel state set up and a progress bar;
    with ``json_path`` the rows so far are written there (``tables.write_json``) after each case
    and while one runs: ``measure`` is then called with ``publish``, a function of the case's row so
    far that writes the rows before it and that one (a bench stopped mid-case keeps what it
    measured)."""
    initialize_parallel()
    cases = [(layers, kv) for kv in args.kv_heads for layers in args.depths]
    rows = []
    for layers, kv in tqdm(cases, desc="depth x kv-heads"):
        if json_path:
            rows.append(measure(args, layers, kv, publish=lambda row: write_json(json_path, args, [*rows, row])))
            write_json(json_path, args, rows)
        else:
            rows.append(measure(args, layers, kv))
    return rows


def round_times(
    args, models: dict, batch, products: dict[str, list[RoutingReads]] | None = None, untimed_before: int = 0
) -> dict[str, list[float]]:
    """Forward+backward seconds of each model in each of ``args.repeats`` rounds after
    ``args.warmup``, the models run one after another within a round, their order rotated by one
    each round (what ran just before a model moves its time on a CPU: at 128 layers by as much as
    LIMe's gap to its FLOP floor, benchmarks/blocked-routing-cpu-2026-11-26.md); with
    ``untimed_before`` each timed step follows that many untimed steps of the same model (as a
    training step follows the last).
    ``products`` (when given) gets each model's ``routing_reads`` counter of each timed round
    (counting synchronises a GPU around each product: rounds for ratios run uncounted)."""
    times = {name: [] for name in models}
    names = list(models)
    for run in range(args.warmup + args.repeats):
        for name in names[run % len(names) :] + names[: run % len(names)]:
            model = models[name]
            for _ in range(untimed_before):
                train_step(model, batch)
            with routing_reads() if products is not None else contextlib.nullcontext() as counter:
                elapsed = train_step(model, batch)
            if run >= args.warmup:
                times[name].append(elapsed)
                if products is not None:
                    products.setdefault(name, []).append(counter)
    return times


def median_times(args, models: dict, batch) -> dict[str, float]:
    """Median forward+backward seconds of each model over ``round_times``."""
    return {name: statistics.median(seconds) for name, seconds in round_times(args, models, batch).items()}


def paired_ratio(times: dict[str, list[float]], name: str, reference: str = "base") -> tuple[float, float]:
    """Median over rounds of ``name``'s time over ``reference``'s in the same round (the two ran
    seconds apart, so the machine's slow drifts cancel), and the interquartile range of those
    ratios (the spread of this VM)."""
    ratios = [seconds / base for seconds, base in zip(times[name], times[reference])]
    quartiles = statistics.quantiles(ratios, n=4, method="inclusive")
    return statistics.median(ratios), quartiles[2] - quartiles[0]


def median_interval(values: list[float], confidence: float = 0.95) -> tuple[float, float]:
    """A distribution-free ``confidence`` interval of the median of ``values``: the order statistics
    ``(x_(j), x_(n+1-j))`` with the largest j such that a Binomial(n, 1/2) count falls below j with
    probability at most (1 - confidence) / 2 (e.g. the 2nd and 8th of 9 values hold the median
    with probability 96%); the extremes when n is too small for ``confidence``."""
    ordered, n = sorted(values), len(values)
    tail, below, j = (1.0 - confidence) / 2, 0.0, 0
    while j < n // 2 and below + math.comb(n, j) / 2**n <= tail:
        below += math.comb(n, j) / 2**n
        j += 1
    j = max(j, 1)
    return ordered[j - 1], ordered[n - j]


def time_split(args, config, times: dict[str, list[float]], counters: list[RoutingReads]) -> dict:
    """Where the blocked model's time over the baseline's goes, per round (medians over rounds):
    the routing products' seconds (``counters``), the rest of the difference, the products' rate,
    and their seconds at the baseline's rate (its FLOPs per step over its step time)."""
    product_s = [sum(counter.seconds_by_kind.values()) for counter in counters]
    weight_grad_s = [counter.seconds_by_kind.get("weight_grad", 0.0) for counter in counters]
    extra_s = [lime - base for lime, base in zip(times["blocked"], times["base"])]
    router_flops = sum(counters[0].flops_by_kind.values())
    base_flops = 3 * args.seq_length * args.micro_batch_size * baseline_flops_per_token(args, config)
    base_rate = base_flops / statistics.median(times["base"])
    products = statistics.median(product_s)
    return dict(
        extra_ms=1e3 * statistics.median(extra_s),
        products_ms=1e3 * products,
        weight_grad_ms=1e3 * statistics.median(weight_grad_s),
        rest_ms=1e3 * statistics.median(extra - product for extra, product in zip(extra_s, product_s)),
        products_gflops=router_flops / products / 1e9,
        products_gbs=counters[0].total / products / 1e9,
        base_gflops=base_rate / 1e9,
        at_base_rate_ms=1e3 * router_flops / base_rate,
    )


def baseline_flops_per_token(args, config) -> float:
    """Forward FLOPs per token of ``config``'s model without its routers (the baseline's)."""
    return forward_flops_per_token(config, args.seq_length, args.vocab_size) - router_flops_per_token(config)


def flop_floor(args, config) -> float:
    """1 + router FLOPs / baseline FLOPs of ``config``: the time ratio of an implementation that
    costs exactly the router's FLOPs."""
    return 1.0 + router_flops_per_token(config) / baseline_flops_per_token(args, config)


@dataclasses.dataclass
class Setting:
    """One measured setting: the bench's ``args``, the depth, kv heads and routing block size, the
    built ``models`` (``base``, ``per_layer``, ``blocked`` and, unless ``--skip rebuilt``,
    ``rebuilt``) and the micro ``batch`` (tokens, positions, mask) they run on."""

    args: argparse.Namespace
    num_layers: int
    kv_heads: int
    block: int
    models: dict
    batch: tuple

    @property
    def config(self):
        """Blocked LIMe's config."""
        return self.models["blocked"].config


def build_setting(args, num_layers: int, kv_heads: int) -> Setting:
    """The baseline and the LIMe models of the setting at the roofline's block size, and a batch."""
    block = chosen_block(args, num_layers, kv_heads)
    models = {
        "base": build(args, num_layers, kv_heads, False),
        "per_layer": build(args, num_layers, kv_heads, True, 1),
        "blocked": build(args, num_layers, kv_heads, True, block),
    }
    if "rebuilt" not in args.skip:
        models["rebuilt"] = build(args, num_layers, kv_heads, True, block, rebuild=True)
    return Setting(args, num_layers, kv_heads, block, models, make_batch(args))


def timing_fields(setting: Setting, times: dict[str, list[float]]) -> dict:
    """The baseline's median seconds and each LIMe model's median paired ratio over it (``times``:
    ``round_times``); blocked LIMe's ratios' interquartile range."""
    ratios = {name: paired_ratio(times, name) for name in setting.models if name != "base"}
    fields = dict(
        base_s=statistics.median(times["base"]),
        per_layer_x=ratios["per_layer"][0],
        lime_x=ratios["blocked"][0],
        lime_spread=ratios["blocked"][1],
    )
    if "rebuilt" in ratios:
        fields["rebuilt_x"] = ratios["rebuilt"][0]
    return fields


def plan_fields(setting: Setting) -> dict:
    """The FLOP floor and the bytes the routing products read per step at B = 1 and blocked: from
    the plan, not measured."""
    args, config = setting.args, setting.config
    reads = {
        b: sum(routing_bytes_per_step(config, args.seq_length, args.micro_batch_size, b).values())
        for b in (1, setting.block)
    }
    return dict(floor=flop_floor(args, config), reads_per_layer=reads[1], reads_blocked=reads[setting.block])


SAVED_KEYS = {"base": "base_saved", "blocked": "lime_saved", "rebuilt": "rebuilt_saved"}
"""The row's key of each model's saved bytes."""


def saved_fields(setting: Setting) -> dict:
    """Bytes autograd saves for backward in one forward of the baseline, blocked and rebuilt LIMe."""
    return {
        key: saved_bytes(setting.models[name], setting.batch)
        for name, key in SAVED_KEYS.items()
        if name in setting.models
    }


def copy_fields(setting: Setting) -> dict:
    """Bytes copied in one forward+backward, blocked LIMe minus the baseline."""
    base, blocked = (copied_bytes(setting.models[name], setting.batch) for name in ("base", "blocked"))
    return dict(extra_copies=blocked - base)


def count_fields(setting: Setting) -> dict:
    """Operators per layer LIMe dispatches beyond the baseline at B = 1 and blocked, on the torch
    path (at the bench's shape) and the Triton path (``triton_operators``)."""
    models, batch, layers = setting.models, setting.batch, setting.num_layers
    operators = {name: dispatched_operators(models[name], batch) for name in ("base", "per_layer", "blocked")}
    triton = triton_operators(setting.args, layers, setting.kv_heads, (1, setting.block))
    return dict(
        per_layer_operators=(operators["per_layer"] - operators["base"]) / layers,
        blocked_operators=(operators["blocked"] - operators["base"]) / layers,
        triton_operators=triton[0],
        triton_blocked_operators=triton[1],
    )


def split_fields(setting: Setting) -> dict:
    """``time_split`` of extra rounds of the baseline and blocked LIMe with the products counted."""
    products: dict[str, list[RoutingReads]] = {}
    models = {name: setting.models[name] for name in ("base", "blocked")}
    counted = round_times(setting.args, models, setting.batch, products)
    return time_split(setting.args, setting.config, counted, products["blocked"])


ProfiledTimes = Totals
"""Self milliseconds and calls of each kernel (GPU) or operator (CPU) name in one profiled step."""


@dataclasses.dataclass(frozen=True)
class ProfiledStep:
    """What one profiled forward+backward says (``profiled_step``)."""

    self_times: ProfiledTimes
    trace: list[TraceEvent] | None
    """The profile's Chrome-trace events, host and device (``device_idle.trace_events``; None where
    the host's activity was not asked for)."""


def profiled_step(model, batch, idle: bool = False) -> ProfiledStep:
    """``model``'s one forward+backward under ``torch.profiler``: as ``self_times`` each CUDA
    kernel's (and copy's) device time on a GPU, each operator's self CPU time on a CPU (ATen
    operators, LIMe's autograd functions and their backward nodes), summed by name, annotated ranges
    left out (on a GPU they span the kernels they hold); with ``idle`` the host's activity recorded
    beside the device's, and the profile's trace kept (``idle_fields`` reads it)."""
    cuda = batch[0].is_cuda
    activities = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    activities += [ProfilerActivity.CPU] if cuda and idle else []
    with profile(activities=activities) as profiler:
        train_step(model, batch)
    return ProfiledStep(self_times(profiler.key_averages(), cuda), trace_events(profiler) if idle else None)


def self_times(averages, cuda: bool) -> ProfiledTimes:
    """``profiled_step``'s ``self_times`` from the profile's ``key_averages()``."""
    device = DeviceType.CUDA if cuda else DeviceType.CPU
    times: ProfiledTimes = {}
    for event in averages:
        if event.device_type == device and not event.is_user_annotation:
            self_us = event.self_device_time_total if cuda else event.self_cpu_time_total
            ms, count = times.get(event.key, (0.0, 0))
            times[event.key] = (ms + self_us / 1e3, count + event.count)
    return times


def profile_entry(name: str, lime: tuple[float, int], base: tuple[float, int]) -> dict:
    """One line of the kernel profile: ``name``'s LIMe and baseline ms and calls, and the
    difference in ms."""
    return dict(
        name=name, lime_ms=lime[0], base_ms=base[0], diff_ms=lime[0] - base[0], lime_count=lime[1], base_count=base[1]
    )


def kernel_differences(lime: ProfiledTimes, base: ProfiledTimes, top: int, by: str = "diff_ms") -> list[dict]:
    """``profile_entry`` of the ``top`` names with the largest ``by`` (the LIMe-minus-baseline time,
    or e.g. ``base_ms``: what both spend most on, which kernels the attention runs as), largest
    first (a name one model lacks at 0 ms and 0 calls there)."""
    entries = [profile_entry(name, lime.get(name, (0.0, 0)), base.get(name, (0.0, 0))) for name in lime | base]
    return sorted(entries, key=lambda entry: entry[by], reverse=True)[:top]


def profile_total(times: ProfiledTimes) -> tuple[float, int]:
    """Milliseconds and calls over all names of ``times``."""
    return sum(ms for ms, _ in times.values()), sum(count for _, count in times.values())


def kernel_profile_fields(setting: Setting) -> dict:
    """Where blocked LIMe's extra device time goes: ``kernel_differences`` of one profiled step of
    each model (``--kernel-profile`` names) and the totals over all names; where the device waited
    in those steps: the operators before whose work it sat idle (``idle_profile``, the names with the
    most LIMe-minus-baseline idle ms; on a CPU none) and the host's blocking calls (all of them);
    where the profiler cannot run (e.g. a GPU image without CUPTI), ``kernel_profile_error`` says
    why instead, so that the setting's timings, measured before, are not lost with it."""
    args = setting.args
    try:
        lime, base = (
            profiled_step(setting.models[name], setting.batch, args.idle_profile) for name in ("blocked", "base")
        )
    except RuntimeError as error:
        print(f"kernel profile: {error}", flush=True)
        return dict(kernel_profile_error=f"{type(error).__name__}: {error}")
    total = profile_entry("all names", profile_total(lime.self_times), profile_total(base.self_times))
    fields = dict(
        kernel_profile=kernel_differences(lime.self_times, base.self_times, args.kernel_profile),
        kernel_profile_base=kernel_differences(lime.self_times, base.self_times, args.kernel_profile, by="base_ms"),
        kernel_profile_total=total,
        host_and_idle=host_and_idle(setting, total),
    )
    return fields | (idle_fields(lime, base, args.kernel_profile) if args.idle_profile else {})


def idle_fields(lime: ProfiledStep, base: ProfiledStep, top: int) -> dict:
    """``--idle-profile``'s fields from the two steps' traces (``testing.device_idle``): the ``top``
    operators with the most LIMe-minus-baseline idle ms before their work, the totals over all gaps,
    and every blocking call of either step; where a trace lacks what they read (another torch's
    format), ``idle_profile_error`` says what instead, the kernel profile kept."""
    try:
        idle = [idle_gaps(device_work(step.trace)) for step in (lime, base)]
        blocking = [blocking_calls(step.trace) for step in (lime, base)]
    except (KeyError, TypeError, ValueError) as error:
        print(f"idle profile: {type(error).__name__}: {error}", flush=True)
        return dict(idle_profile_error=f"the profile's trace could not be read: {type(error).__name__}: {error}")
    return dict(
        idle_profile=kernel_differences(*idle, top),
        idle_profile_total=profile_entry("all gaps", profile_total(idle[0]), profile_total(idle[1])),
        blocking_calls=kernel_differences(*blocking, len(blocking[0] | blocking[1])),
    )


HOST_STEPS = 5
"""Unprofiled step pairs (LIMe, then the baseline) whose medians ``host_and_idle`` takes."""


def host_and_idle(setting: Setting, total: dict) -> dict:
    """Per model (``lime``: blocked, ``base``) the medians over ``HOST_STEPS`` unprofiled steps of
    the host's ms (``host_and_wall_step``) and the wall ms, and the device's idle ms: wall minus
    the profiled step's busy time (``total``: all kernels' device time; on a CPU operator time,
    which says nothing); and ``host_diff_ms``, the median of LIMe's host ms minus the baseline's
    over the pairs.  The two models' steps alternate, so a host whose pace drifts (the lent H200's
    moved by 10-20% between rounds at 128 layers) moves both members of a pair alike.  Where LIMe's
    wall time over the baseline exceeds its extra device time, this says whether the host (its ms)
    or waiting (idle) holds the rest."""
    pairs = [
        tuple(host_and_wall_step(setting.models[name], setting.batch) for name in ("blocked", "base"))
        for _ in range(HOST_STEPS)
    ]
    fields = dict(host_diff_ms=1e3 * statistics.median(lime[0] - base[0] for lime, base in pairs))
    for index, key in enumerate(("lime", "base")):
        host, wall = (1e3 * statistics.median(values) for values in zip(*(pair[index] for pair in pairs)))
        fields |= {f"{key}_host_ms": host, f"{key}_wall_ms": wall, f"{key}_idle_ms": wall - total[f"{key}_ms"]}
    return fields


def launch_profile_fields(setting: Setting) -> dict:
    """Each routing-kernel launch of one forward+backward of blocked LIMe timed, by kind
    (``testing.kernel_launches``): ``launch_profile``, a list of ``LaunchKind.as_row`` (empty on
    the torch path, which launches none), under the default tiles; ``launch_profile_tiles``, per
    other tiles of ``--launch-profile`` (element counts) and ``--launch-profile-warps``
    (``other_tiles``), the same under those tiles (after one untimed step under them: their
    kernels compile in it, not in the timed launches) with the step's largest relative difference
    from the default's in the loss and in each parameter's gradient (the same products: only the
    order of a tile dot's sums and of the router-weight gradient's atomic sums may differ).  The
    default tiles are a GPU's (``MIX_TILES``) in Triton's interpreter too."""
    model, batch = setting.models["blocked"], setting.batch
    with use_mix_tiles(MIX_TILES), KernelLaunches() as launches:
        reference = step_outcome(model, batch)
    fields = dict(launch_profile=launches.kinds(), launch_profile_tiles=[])
    for tiles in other_tiles(setting.args):
        with use_mix_tiles(tiles):
            step_outcome(model, batch)  # compiles the tiles' kernels, untimed
            with KernelLaunches() as launches:
                outcome = step_outcome(model, batch)
        difference = outcome_difference(outcome, reference)
        fields["launch_profile_tiles"].append(
            dict(tiles=tiles_name(tiles), kinds=launches.kinds(), difference=difference)
        )
    return fields


def other_tiles(args) -> list[MixTiles]:
    """The launch profile's tiles beside the default's: each element count of ``--launch-profile``
    (in every launch, those beside a weight gradient too), then each warp count of
    ``--launch-profile-warps`` (the rest as the default's)."""
    elements = [
        dataclasses.replace(MIX_TILES, elements=count, weight_grad_elements=count) for count in args.launch_profile
    ]
    warps = [dataclasses.replace(MIX_TILES, warps=count) for count in args.launch_profile_warps]
    return [*elements, *warps]


def tiles_name(tiles: MixTiles) -> str:
    """How the launch profile names ``tiles``."""
    elements = f"{tiles.elements}"
    if tiles.weight_grad_elements != tiles.elements:
        elements += f" ({tiles.weight_grad_elements} beside a weight gradient)"
    return f"tiles of up to {elements} elements, {tiles.warps} warps"


def step_outcome(model, batch) -> torch.Tensor:
    """``forward_backward``'s loss and each parameter's gradient norm, one float64 vector."""
    loss = forward_backward(model, batch)
    norms = [param.grad.double().norm() for param in model.parameters() if param.grad is not None]
    return torch.stack([loss.detach().double(), *norms]).cpu()


def outcome_difference(outcome: torch.Tensor, reference: torch.Tensor) -> float:
    """The largest relative difference between two ``step_outcome`` vectors."""
    return ((outcome - reference).abs() / reference.abs().clamp_min(1e-30)).max().item()


SKIPPABLE_PHASES: dict[str, Callable[[Setting], dict]] = {
    "counts": count_fields,
    "saved": saved_fields,
    "copies": copy_fields,
    "split": split_fields,
}
"""The phases of ``measure`` after the timed rounds that ``--skip`` can drop, each a function from
the setting to the row's fields it measures."""

SKIP_CHOICES = ("rebuilt", *SKIPPABLE_PHASES)
"""``--skip``'s choices: the rebuilt-K/V model (neither built nor timed) and the skippable phases."""

PHASE_NAMES = ("build", "timed", *SKIPPABLE_PHASES, "kernel_profile", "launch_profile")
"""The phases of ``measure`` in order, as ``phase_s`` names them."""


def optional_phases(args) -> dict[str, Callable[[Setting], dict]]:
    """The phases after the timed rounds ``args`` asks for: those not in ``--skip`` and, with
    ``--kernel-profile N`` (N > 0), the kernel profile, with ``--launch-profile`` the launches'."""
    phases = {name: run for name, run in SKIPPABLE_PHASES.items() if name not in args.skip}
    if args.kernel_profile:
        phases["kernel_profile"] = kernel_profile_fields
    if args.launch_profile is not None:
        phases["launch_profile"] = launch_profile_fields
    return phases


@contextlib.contextmanager
def phase_clock(phase_s: dict[str, float], name: str) -> Iterator[None]:
    """Records the ``with`` block's wall seconds as ``phase_s[name]``."""
    start = time.perf_counter()
    yield
    phase_s[name] = time.perf_counter() - start


def measure(args, num_layers: int, kv_heads: int, publish: Callable[[dict], None] = lambda row: None) -> dict:
    """The row of one setting: the paired timing, the plan's floor and reads, the optional phases'
    fields (``optional_phases``) and ``phase_s``, the wall seconds of each phase run; the row so far
    handed to ``publish`` after the timed rounds and after each optional phase."""
    phase_s: dict[str, float] = {}
    with phase_clock(phase_s, "build"):
        setting = build_setting(args, num_layers, kv_heads)
    with frozen_heap():
        with phase_clock(phase_s, "timed"):
            times = round_times(args, setting.models, setting.batch)
        row = dict(layers=num_layers, kv_heads=kv_heads, block=setting.block, phase_s=phase_s)
        row |= timing_fields(setting, times) | plan_fields(setting)
        publish(row)
        for name, run in optional_phases(args).items():
            with phase_clock(phase_s, name):
                row |= run(setting)
            publish(row)
    return row


SHAPE_COLUMNS = [("layers", field("layers")), ("kv", field("kv_heads")), ("B", field("block"))]
"""The columns that name a measured setting: depth, kv heads and the roofline's block size."""

OVERHEAD_COLUMNS = SHAPE_COLUMNS + [
    ("base s", field("base_s", ".3f")),
    ("B=1 x", field("per_layer_x", ".3f")),
    ("B x", field("lime_x", ".3f")),
    ("floor", field("floor", ".3f")),
    ("B=1/fl", ratio("per_layer_x", "floor")),
    ("B/fl", ratio("lime_x", "floor")),
    ("B/fl IQR", ratio("lime_spread", "floor")),
    ("saved x", ratio("lime_saved", "base_saved")),
    ("rk/fl", ratio("rebuilt_x", "floor")),
    ("rk saved", ratio("rebuilt_saved", "base_saved")),
    ("read B=1 GiB", field("reads_per_layer", ".2f", 2**30)),
    ("read B GiB", field("reads_blocked", ".2f", 2**30)),
    ("copies+ MiB", field("extra_copies", ".1f", 2**20)),
]
"""The first table: time over the baseline and the floor, saved bytes, routing reads, copies."""

TIME_SPLIT_COLUMNS = SHAPE_COLUMNS + [
    ("LIMe-base ms", field("extra_ms", ".1f")),
    ("products ms", field("products_ms", ".1f")),
    ("rest ms", field("rest_ms", ".1f")),
    ("prod GFLOP/s", field("products_gflops", ".1f")),
    ("prod GB/s", field("products_gbs", ".2f")),
    ("base GFLOP/s", field("base_gflops", ".1f")),
    ("prod at base rate ms", field("at_base_rate_ms", ".1f")),
    ("ops+/layer B=1", field("per_layer_operators", ".1f")),
    ("ops+/layer B", field("blocked_operators", ".1f")),
    ("ops+/layer Triton B=1", field("triton_operators", ".1f")),
    ("ops+/layer Triton B", field("triton_blocked_operators", ".1f")),
]
"""The second table: where blocked LIMe's time over the baseline goes, and the host's operators."""


def phase_cell(name: str) -> Callable[[dict], str]:
    """The cell of a row's seconds in phase ``name`` ("-" where it did not run)."""
    cell = field(name, ".1f")
    return lambda row: cell(row["phase_s"])


PHASE_COLUMNS = (
    SHAPE_COLUMNS
    + [(f"{name} s", phase_cell(name)) for name in PHASE_NAMES]
    + [("total s", lambda row: format(sum(row["phase_s"].values()), ".1f"))]
)
"""The third table: the wall seconds of each phase of a setting (``phase_s``)."""

KERNEL_COLUMNS: list[Column] = [
    ("LIMe-base ms", field("diff_ms", ".3f")),
    ("LIMe ms", field("lime_ms", ".3f")),
    ("base ms", field("base_ms", ".3f")),
    ("LIMe calls", field("lime_count")),
    ("base calls", field("base_count")),
    ("kernel (GPU) / operator (CPU)", field("name")),
]
"""The kernel profile's columns, one line per name (``profile_entry``)."""

IDLE_COLUMNS: list[Column] = KERNEL_COLUMNS[:-1] + [("operator (gaps) / call in operator", field("name"))]
"""The idle profile's and the blocking calls' columns (``print_idle_profile``)."""


LAUNCH_COLUMNS: list[Column] = [
    ("launch kind", field("kind")),
    ("launches", field("launches")),
    ("ms", field("ms", ".3f")),
    ("GB moved", field("gb", ".3f")),
    ("GB/s", field("gb_per_s", ".1f")),
]
"""The launch profile's columns, one line per kind (``KernelLaunches.kinds``)."""


HOST_COLUMNS: list[Column] = [
    (f"{label} {what}", field(f"{key}_{what.split()[0]}_ms", ".1f"))
    for key, label in (("lime", "LIMe"), ("base", "base"))
    for what in ("host ms", "wall ms", "idle ms")
] + [("LIMe - base host ms, paired", field("host_diff_ms", ".2f"))]
"""``host_and_idle``'s columns: per model the host's, the wall's and the idle device's ms; LIMe's
host ms over the baseline's, the median of the pairs."""


def print_launch_profiles(rows: list[dict]) -> None:
    """Each row's launch profile: per kind of routing-kernel launch, its time against the bytes it
    must move, under the default tiles and under each other element count profiled."""
    for row in rows:
        if not row.get("launch_profile"):
            continue
        print(
            f"\nL{row['layers']} kv {row['kv_heads']} B {row['block']}: the routing kernels' launches in one "
            f"forward+backward of blocked LIMe, by kind (GB: the least each must read and write), "
            f"{tiles_name(MIX_TILES)}:"
        )
        print_table(LAUNCH_COLUMNS, row["launch_profile"])
        for tiled in row["launch_profile_tiles"]:
            print(
                f"\nthe same with {tiled['tiles']} (largest relative difference "
                f"in the loss and the gradients: {tiled['difference']:.1e}):"
            )
            print_table(LAUNCH_COLUMNS, tiled["kinds"])


def print_kernel_profiles(rows: list[dict]) -> None:
    """Each profiled row's kernel profile and its totals over all names."""
    for row in rows:
        if "kernel_profile" in row:
            print(
                f"\nL{row['layers']} kv {row['kv_heads']} B {row['block']}: self time of one forward+backward "
                f"(torch.profiler), the {len(row['kernel_profile'])} names with the most LIMe-minus-baseline time:"
            )
            print_table(KERNEL_COLUMNS, row["kernel_profile"] + [row["kernel_profile_total"]])
            print(f"\nthe {len(row['kernel_profile_base'])} names the baseline spends the most time in:")
            print_table(KERNEL_COLUMNS, row["kernel_profile_base"])
            print("\nunprofiled steps (medians): the host's ms to queue the step, its wall ms, the device idle in it:")
            print_table(HOST_COLUMNS, [row["host_and_idle"]])
        if "idle_profile" in row:
            print_idle_profile(row)


def print_idle_profile(row: dict) -> None:
    """Where the profiled steps' device waited: its idle ms before each operator's work (the names
    with the most LIMe-minus-baseline idle ms, "calls" counting gaps), and every host call that waits
    for the device."""
    print(
        f"\nthe device idle in the profiled steps before the work of each operator, the {len(row['idle_profile'])} "
        "names with the most LIMe-minus-baseline idle ms (calls: gaps):"
    )
    print_table(IDLE_COLUMNS, row["idle_profile"] + [row["idle_profile_total"]])
    print("\nthe host's calls that wait for the device, in the profiled steps (none: no row):")
    print_table(IDLE_COLUMNS, row["blocking_calls"])


def summary(rows: list[dict]) -> str:
    """One line: the worst blocked time over its floor and, where measured, the largest saved-bytes
    ratio."""
    worst = max(rows, key=lambda r: r["lime_x"] / r["floor"])
    line = (
        f"summary: {len(rows)} settings; worst blocked time vs FLOP floor {worst['lime_x'] / worst['floor']:.3f} "
        f"(L{worst['layers']}, kv {worst['kv_heads']}, B {worst['block']})"
    )
    saved = [r["lime_saved"] / r["base_saved"] for r in rows if "lime_saved" in r]
    return line + (f"; max saved-bytes ratio {max(saved):.3f}" if saved else "")


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    rows = measure_cases(args, measure, args.json)
    print_table(OVERHEAD_COLUMNS, rows)
    print("\nwhere blocked LIMe's time over the baseline goes (medians over counted rounds of those two models):")
    print_table(TIME_SPLIT_COLUMNS, rows)
    print_kernel_profiles(rows)
    print_launch_profiles(rows)
    print("\nwall seconds of each phase of a setting (- not run):")
    print_table(PHASE_COLUMNS, rows)
    print("\n" + summary(rows))
    return rows


if __name__ == "__main__":
    main()
