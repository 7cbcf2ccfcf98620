"""A step-time model of megatron's pipeline schedules (1F1B and interleaved), LIMe and baseline.

One training iteration on the p pipeline ranks is simulated from per-chunk forward/backward
compute times and the bytes each pipeline hop carries over a link of given bandwidth and
latency. It gives the iteration time, the pipeline bubble and how much transfer stays exposed.

**Order of work on rank r** (megatron-core's ``forward_backward_pipelining_without_interleaving``
and ``_with_interleaving``; ``rank_operations``), m microbatches:

- 1F1B: min(p - r - 1, m) warm-up forwards, then a forward and a backward at a time, then the
  remaining backwards;
- interleaved, v chunks per rank: megatron's ``get_schedule_table(m, v, group)`` gives the
  (microbatch, chunk) of the k-th forward, in groups of ``microbatch_group_size_per_vp_stage``
  microbatches per chunk; the k-th backward runs the same microbatch on chunk v - 1 - chunk; the
  warm-up is min(m v, 2(p - r - 1) + (v - 1) group) forwards, then pairs, then backwards.

**Dependencies.** Chunk c of rank r is virtual stage q = c p + r. Its forward of microbatch i
starts once stage q - 1's output for i has arrived, its backward once stage q + 1's gradient for
i has arrived (the last stage: after its own forward). A hop q -> q + 1 carries ``hop_bytes`` in
forward and the same number of gradient bytes back; a transfer takes latency + bytes / bandwidth,
and the transfers on one directed link (rank r to its next or to its previous rank) go one at a
time, in the order they are sent.

**Overlap.** With ``overlap`` (megatron's ``overlap_p2p_comm``: asynchronous sends) the sender
computes on while its transfer is in flight; without it, the sender waits until its transfer
has finished (blocking p2p). Receivers always wait for their input. Not modelled: the rendezvous
of a blocking send with its receive, tensor- and data-parallel communication, the optimizer step.

**Figures.** ``bubble`` = T_free / C - 1, with T_free the iteration with free transfer and C the
busiest rank's compute: (p - 1)/m for 1F1B and (p - 1)/(v m) interleaved with uniform chunks
(``tests/planning/test_schedule_model.py``). ``exposed`` = T - T_free, the transfer time the schedule does
not hide. Compute time is FLOPs (``flops``) / (``compute_tflops`` x TP) per GPU; backward costs
2x forward, 3x with full recompute.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from megatron.core.pipeline_parallel.schedules import get_schedule_table

from lime_megatron.models.config import LimeTransformerConfig, pipeline_layer_split
from lime_megatron.parallel.fusions import replace_config
from lime_megatron.parallel.pipeline import exact_stage_width
from lime_megatron.planning.activations import Geometry
from lime_megatron.planning.flops import chunk_forward_flops_per_token


@dataclass(frozen=True)
class Link:
    """A point-to-point link between neighbouring pipeline ranks, one direction."""

    name: str
    bandwidth_gbps: float
    """Gigabits per second."""
    latency_us: float

    def __post_init__(self):
        if not self.bandwidth_gbps > 0 or not self.latency_us >= 0:
            raise ValueError(
                f"link bandwidth must be positive and latency non-negative, got "
                f"{self.bandwidth_gbps} Gb/s and {self.latency_us} us"
            )

    def seconds(self, nbytes: int) -> float:
        """Time of one transfer of ``nbytes``."""
        return self.latency_us * 1e-6 + 8 * nbytes / (self.bandwidth_gbps * 1e9)


NVLINK = Link("NVLink-like", 3600.0, 3.0)
"""450 GB/s each way (H100 NVLink 4: 18 links x 25 GB/s per direction), 3 us."""
INFINIBAND = Link("InfiniBand-like", 400.0, 5.0)
"""One 400 Gb/s NDR port per GPU, 5 us (pipeline ranks on different nodes)."""
DEFAULT_COMPUTE_TFLOPS = 400.0
"""Achieved dense bf16 TFLOP/s per GPU: about 40% of an H100/H200's 989 peak."""


class Operation(NamedTuple):
    """One forward or backward of one microbatch on one model chunk of a rank."""

    forward: bool
    chunk: int
    microbatch: int


def rank_operations(pp: int, vpp: int, rank: int, num_microbatches: int, group: int) -> list[Operation]:
    """The order megatron's schedule runs forwards and backwards on pipeline rank ``rank`` of
    ``pp``, with ``vpp`` chunks per rank (1: 1F1B) and ``group`` microbatches per chunk group."""
    m = num_microbatches
    if vpp == 1:
        order = [(i, 0) for i in range(m)]
        warmup = min(pp - rank - 1, m)
    else:
        if not pp <= group <= m:
            raise ValueError(
                f"the interleaved schedule needs pipeline_model_parallel_size={pp} <= "
                f"microbatch_group_size_per_vp_stage={group} <= num_microbatches={m}"
            )
        if 0 < m % group < pp:
            raise ValueError(
                f"the interleaved schedule needs num_microbatches={m} to leave 0 or at least "
                f"{pp} microbatches after whole groups of {group}"
            )
        order = get_schedule_table(m, vpp, group)
        warmup = min(len(order), 2 * (pp - rank - 1) + (vpp - 1) * group)

    def forward(k):
        return Operation(True, order[k][1], order[k][0])

    def backward(k):
        return Operation(False, vpp - 1 - order[k][1], order[k][0])

    operations = [forward(k) for k in range(warmup)]
    for k in range(len(order) - warmup):
        operations += [forward(warmup + k), backward(k)]
    return operations + [backward(k) for k in range(len(order) - warmup, len(order))]


@dataclass(frozen=True)
class PipelineWork:
    """What one iteration asks of the pipeline, by virtual stage q = chunk * pp + rank."""

    pp: int
    vpp: int
    num_microbatches: int
    group: int
    """Microbatches per chunk group of the interleaved schedule."""
    forward_s: tuple[float, ...]
    """Forward time of one microbatch on each virtual stage."""
    backward_s: tuple[float, ...]
    hop_bytes: tuple[int, ...]
    """Bytes stage q sends to stage q + 1 per microbatch (and receives back as gradient)."""

    def compute_s(self, rank: int) -> float:
        """Compute time of ``rank`` over the iteration."""
        stages = range(rank, self.pp * self.vpp, self.pp)
        return self.num_microbatches * sum(self.forward_s[q] + self.backward_s[q] for q in stages)


def simulate(work: PipelineWork, link: Link | None, overlap: bool) -> float:
    """Iteration time (seconds) of ``work`` with transfers over ``link`` (None: free)."""
    pp, stages = work.pp, work.pp * work.vpp
    plans = [rank_operations(pp, work.vpp, r, work.num_microbatches, work.group) for r in range(pp)]
    done, clock = [0] * pp, [0.0] * pp
    arrived: dict[tuple[bool, int, int], float] = {}  # (forward, stage, microbatch) -> input ready
    forward_end: dict[tuple[int, int], float] = {}
    link_free: dict[tuple[int, int], float] = {}  # (sending rank, +1 or -1) -> free from

    def send(rank: int, step: int, stage: int, op: Operation, end: float) -> None:
        seconds = link.seconds(work.hop_bytes[min(stage, stage + step)]) if link else 0.0
        start = max(end, link_free.get((rank, step), 0.0))
        link_free[rank, step] = start + seconds
        arrived[op.forward, stage + step, op.microbatch] = start + seconds
        if not overlap:
            clock[rank] = start + seconds

    def ready(stage: int, op: Operation) -> float | None:
        if op.forward:
            return 0.0 if stage == 0 else arrived.get((True, stage, op.microbatch))
        if stage == stages - 1:
            return forward_end[stage, op.microbatch]
        return arrived.get((False, stage, op.microbatch))

    progress = True
    while progress:
        progress = False
        for rank, plan in enumerate(plans):
            while done[rank] < len(plan):
                op = plan[done[rank]]
                stage = op.chunk * pp + rank
                start = ready(stage, op)
                if start is None:
                    break
                start = max(start, clock[rank])
                clock[rank] = start + (work.forward_s if op.forward else work.backward_s)[stage]
                if op.forward:
                    forward_end[stage, op.microbatch] = clock[rank]
                    if stage < stages - 1:
                        send(rank, 1, stage, op, clock[rank])
                elif stage > 0:
                    send(rank, -1, stage, op, clock[rank])
                done[rank] += 1
                progress = True
    if any(count < len(plan) for count, plan in zip(done, plans)):
        raise RuntimeError("the simulated pipeline schedule deadlocked")  # an inconsistent plan
    return max(clock)


@dataclass(frozen=True)
class StepTime:
    """Simulated iteration of one model at one layout over one link."""

    iteration_s: float
    """With transfers overlapped with compute (``overlap_p2p_comm``)."""
    blocking_s: float
    """With blocking transfers."""
    free_s: float
    """With free transfers."""
    compute_s: float
    """Compute of the busiest rank."""

    @property
    def bubble(self) -> float:
        return self.free_s / self.compute_s - 1

    @property
    def exposed_s(self) -> float:
        """Transfer time not hidden behind compute (overlapped)."""
        return self.iteration_s - self.free_s

    @property
    def exposed_blocking_s(self) -> float:
        return self.blocking_s - self.free_s

    def as_run(self, overlapped: bool) -> tuple[float, float]:
        """(iteration, exposed transfer) in seconds as a run communicates: overlapped or blocking
        (``overlaps_transfers``)."""
        return (self.iteration_s, self.exposed_s) if overlapped else (self.blocking_s, self.exposed_blocking_s)


def overlaps_transfers(config: LimeTransformerConfig) -> bool:
    """Whether a run of ``config`` overlaps its pipeline transfers with compute: megatron's
    interleaved schedule does with ``overlap_p2p_comm`` (the K/V rows are posted with the hidden
    state, ``pipeline.PipelineCommunicator``, so they overlap alike); its 1F1B schedule without
    virtual stages always waits for each transfer."""
    return bool(config.overlap_p2p_comm and config.virtual_pipeline_model_parallel_size)


def hop_bytes(config: LimeTransformerConfig, boundary: int, geometry: Geometry) -> int:
    """Bytes of the hop into the chunk starting at layer ``boundary``, one microbatch on one
    tensor-parallel rank: the hidden state and the K/V rows the receiving rank lacks
    (``pipeline.exact_stage_width``, no padding). The one source of hop sizes here."""
    return geometry.hidden_rows * geometry.batch * exact_stage_width(config, boundary) * geometry.element


def backward_factor(config: LimeTransformerConfig) -> float:
    """Backward time over forward time: 2, or 3 with full recompute (the forward is rerun)."""
    return 3.0 if config.recompute_granularity == "full" else 2.0


def pipeline_work(
    config: LimeTransformerConfig,
    *,
    vocab_size: int,
    seq_length: int,
    micro_batch_size: int,
    num_microbatches: int,
    compute_tflops: float,
) -> PipelineWork:
    """Per-stage compute times and hop bytes of ``config``'s layout on one tensor-parallel rank."""
    if not compute_tflops > 0:
        raise ValueError(f"compute_tflops must be positive, got {compute_tflops}")
    pp = config.pipeline_model_parallel_size
    vpp = config.virtual_pipeline_model_parallel_size or 1
    split = pipeline_layer_split(config)
    stages = [split[q % pp, q // pp if config.virtual_pipeline_model_parallel_size else None] for q in range(pp * vpp)]
    tokens = seq_length * micro_batch_size
    per_gpu = compute_tflops * 1e12 * config.tensor_model_parallel_size
    forward = tuple(
        tokens * chunk_forward_flops_per_token(config, layers, seq_length, vocab_size, q == len(stages) - 1) / per_gpu
        for q, layers in enumerate(stages)
    )
    geometry = Geometry.of(config, seq_length, micro_batch_size, vocab_size)
    return PipelineWork(
        pp,
        vpp,
        num_microbatches,
        config.microbatch_group_size_per_vp_stage or pp,
        forward,
        tuple(backward_factor(config) * f for f in forward),
        tuple(hop_bytes(config, layers.stop, geometry) for layers in stages[:-1]),
    )


def step_time(work: PipelineWork, link: Link) -> StepTime:
    """The iteration of ``work`` over ``link``: overlapped, blocking and free transfers."""
    return StepTime(
        simulate(work, link, overlap=True),
        simulate(work, link, overlap=False),
        simulate(work, None, overlap=True),
        max(work.compute_s(r) for r in range(work.pp)),
    )


def step_time_lines(
    config: LimeTransformerConfig,
    *,
    vocab_size: int,
    seq_length: int,
    micro_batch_size: int,
    num_microbatches: int,
    compute_tflops: float,
    links: Sequence[Link],
) -> list[str]:
    """The ``--dry-run`` step-time table: LIMe (or the configured model) and its baseline over each link."""
    models = {"baseline": replace_config(config, lime=False)}
    if config.lime:
        models = {"LIMe": config, **models}
    works = {
        name: pipeline_work(
            model,
            vocab_size=vocab_size,
            seq_length=seq_length,
            micro_batch_size=micro_batch_size,
            num_microbatches=num_microbatches,
            compute_tflops=compute_tflops,
        )
        for name, model in models.items()
    }
    lines = [
        f"step time (schedule model, {compute_tflops:g} TFLOP/s per GPU, backward "
        f"{backward_factor(config):g}x forward; blocking: without overlap_p2p_comm):",
        f"  {'link':<30} {'model':<9} {'iteration':>10} {'blocking':>10} {'bubble':>7} {'exposed':>9} {'max hop':>10}",
    ]
    for link in links:
        times = {name: step_time(work, link) for name, work in works.items()}
        for name, t in times.items():
            widest = max(works[name].hop_bytes, default=0)
            lines.append(
                f"  {_link_name(link):<30} {name:<9} {_ms(t.iteration_s):>10} {_ms(t.blocking_s):>10} "
                f"{100 * t.bubble:>6.1f}% {_ms(t.exposed_s):>9} {widest / 2**20:>7.1f} MiB"
            )
        if "LIMe" in times:
            ratio = times["LIMe"].iteration_s / times["baseline"].iteration_s - 1
            lines.append(
                f"  {'':<30} LIMe over baseline: {100 * ratio:+.2f}% (overlapped), "
                f"{100 * (times['LIMe'].blocking_s / times['baseline'].blocking_s - 1):+.2f}% (blocking)"
            )
    lines.append(
        f"  this run's transfers: {'overlapped' if overlaps_transfers(config) else 'blocking'} "
        "(overlapped only in the interleaved schedule with overlap_p2p_comm)"
    )
    return lines


def _link_name(link: Link) -> str:
    return f"{link.name} {link.bandwidth_gbps:g} Gb/s {link.latency_us:g} us"


def _ms(seconds: float) -> str:
    return f"{1e3 * seconds:.1f} ms"
