"""Dry-run estimates for a parallel layout: parameters, FLOPs and activation memory per stage.

``dry_run_report(config, vocab_size=, seq_length=, micro_batch_size=, num_microbatches=)``
returns the text printed by ``pretrain_lime.py --dry-run``; ``estimate(...)`` returns the data
behind it (a ``StageEstimate`` per pipeline rank, a ``ChunkEstimate`` per model chunk). Neither
needs ``torch.distributed`` nor more than one process.

Parameters are counted on chunks megatron builds on the meta device (routers built as
``router.LimeRouter``), FLOPs come from ``flops``, activation bytes per microbatch from
``activations``, and the microbatches in flight from replaying megatron's schedule.
docs/estimate.md is the specification: every counting rule, formula and what checks it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from megatron.core import parallel_state
from megatron.core.process_groups_config import ProcessGroupCollection

from lime_megatron.models.config import LimeTransformerConfig, pipeline_layer_split
from lime_megatron.models.gpt_model import LimeGPTModel
from lime_megatron.models.layer_specs import lime_block_spec
from lime_megatron.models.lime.head_parallel import HeadSharding
from lime_megatron.models.lime.pruning import v1_route_count
from lime_megatron.models.lime.router import LimeRouter, router_source_count, router_weights_per_source
from lime_megatron.parallel.fusions import replace_config
from lime_megatron.planning.activations import (
    TRANSFORMER_IMPLS,
    ActivationBytes,
    Geometry,
    chunk_activations,
    recompute_modules,
    router_stack_bytes,
)
from lime_megatron.planning.flops import chunk_forward_flops_per_token, forward_flops_per_token
from lime_megatron.planning.routing_block import TRITON_OPERATORS, chunk_routing_block, path_machine, routing_machine
from lime_megatron.planning.routing_bytes import routing_bytes_per_step
from lime_megatron.planning.schedule_model import (
    DEFAULT_COMPUTE_TFLOPS,
    INFINIBAND,
    NVLINK,
    Link,
    rank_operations,
    step_time_lines,
)

# Process groups a GPTModel reads while it is built.
_GROUPS = ("tp", "pp", "mp", "embd", "pos_embd", "cp", "tp_cp", "dp", "dp_cp", "tp_dp_cp")


# ------------------------------------------------------------------------------ results


@dataclass(frozen=True)
class ChunkEstimate:
    """One model chunk (a pipeline stage, or one virtual stage of it)."""

    pp_rank: int
    vp_stage: int | None
    layers: range
    """Global 0-based layers of the chunk."""
    pre_process: bool
    post_process: bool
    parameters: int
    """Parameters on one GPU (one tensor-parallel rank), LIMe routers included."""
    router_parameters: int
    """Learned LIMe router weights among ``parameters``."""
    unique_parameters: int
    """Parameters of the chunk over all its tensor-parallel ranks, replicated ones once."""
    unique_router_parameters: int
    """Learned LIMe router weights among ``unique_parameters``."""
    forward_flops_per_token: float
    """Forward FLOPs per token of the whole chunk (all tensor-parallel ranks)."""
    activations: ActivationBytes
    """One microbatch on one GPU."""
    backward_working_bytes: int
    """What one microbatch's backward builds beyond what it kept: the activations of one recompute
    group rebuilt (full recompute), LIMe's router stack where the forward did not build it."""


@dataclass(frozen=True)
class StageEstimate:
    """One pipeline rank: its chunks and its peak activation memory per GPU."""

    pp_rank: int
    chunks: tuple[ChunkEstimate, ...]
    microbatches_in_flight: int
    """Chunk-microbatches whose activations are kept at the peak."""
    peak_activation_bytes: int
    """Activation memory per GPU at the peak, the backward working set included."""

    @property
    def parameters(self) -> int:
        """Parameters per GPU."""
        return sum(chunk.parameters for chunk in self.chunks)

    @property
    def forward_flops_per_token(self) -> float:
        """Forward FLOPs per token of the stage (all its tensor-parallel ranks)."""
        return sum(chunk.forward_flops_per_token for chunk in self.chunks)


@dataclass(frozen=True)
class DryRunEstimate:
    """Everything ``dry_run_report`` prints."""

    config: LimeTransformerConfig
    vocab_size: int
    seq_length: int
    micro_batch_size: int
    num_microbatches: int
    transformer_impl: str
    stages: tuple[StageEstimate, ...]
    total_parameters: int
    """Parameters of the model (a tied output weight counted once)."""
    forward_flops_per_token: float

    @property
    def training_flops_per_token(self) -> float:
        """Model FLOPs of forward and backward: 3x forward."""
        return 3.0 * self.forward_flops_per_token

    @property
    def tokens_per_iteration(self) -> int:
        """Tokens of one iteration of one data-parallel replica."""
        return self.seq_length * self.micro_batch_size * self.num_microbatches

    @property
    def router_parameters(self) -> int:
        """Learned LIMe router weights of the model."""
        return sum(chunk.unique_router_parameters for stage in self.stages for chunk in stage.chunks)


# ------------------------------------------------------------------------------ layout


@dataclass(frozen=True)
class _Chunk:
    """Where a chunk sits: pipeline rank, virtual stage, its layers, embedding/output."""

    pp_rank: int
    vp_stage: int | None
    layers: range
    pre_process: bool
    post_process: bool


def chunk_layout(config: LimeTransformerConfig) -> list[list[_Chunk]]:
    """Per pipeline rank, its chunks in virtual-stage order (``config.pipeline_layer_split``:
    megatron's layer assignment)."""
    if config.pipeline_model_parallel_layout is not None:
        raise ValueError(
            "the dry-run estimate does not support pipeline_model_parallel_layout; "
            "use num_layers_in_first/last_pipeline_stage"
        )
    pp, vpp = config.pipeline_model_parallel_size, config.virtual_pipeline_model_parallel_size
    split = pipeline_layer_split(config)
    last = (vpp or 1) - 1
    return [
        [
            _Chunk(rank, vp, split[rank, vp], rank == 0 and vp in (None, 0), rank == pp - 1 and vp in (None, last))
            for vp in (range(vpp) if vpp else [None])
        ]
        for rank in range(pp)
    ]


# ------------------------------------------------------------------------------ parameters


class _OneRankGroup:
    """Stands in for every process group while a chunk is built on meta: one rank."""

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


def _one_rank_groups() -> ProcessGroupCollection:
    groups = ProcessGroupCollection()
    for name in _GROUPS:
        setattr(groups, name, _OneRankGroup())
    return groups


@contextmanager
def _pipeline_rank(rank: int) -> Iterator[None]:
    """megatron's parallel state reports pipeline rank ``rank``; restored afterwards."""
    previous = parallel_state._MPU_PIPELINE_MODEL_PARALLEL_RANK
    parallel_state.set_pipeline_model_parallel_rank(rank)
    try:
        yield
    finally:
        parallel_state.set_pipeline_model_parallel_rank(previous)


def _shard_numel(name: str, param: torch.Tensor, tp: int) -> int:
    """Elements of ``param`` (built at TP=1) on one of ``tp`` tensor-parallel ranks."""
    if not getattr(param, "tensor_model_parallel", False):
        return param.numel()
    size = param.shape[param.partition_dim]
    if size % tp:
        raise ValueError(
            f"{name} has {size} rows along its tensor-parallel dimension, "
            f"not divisible by tensor_model_parallel_size={tp}"
        )
    return param.numel() // tp


def _baseline_chunk(
    config: LimeTransformerConfig, chunk: _Chunk, vocab_size: int, seq_length: int, tied: bool
) -> LimeGPTModel:
    """The chunk without LIMe routers, built on meta at TP=1 for its pipeline rank.

    Embeddings are tied only in a chunk holding both ends (no pipeline parallelism): under
    pipeline parallelism the last stage gets an untied output weight, the same shape as
    megatron's tied copy, without the copy's cross-stage set-up.
    """
    build = replace_config(
        config,
        lime=False,
        tensor_model_parallel_size=1,
        sequence_parallel=False,
        use_cpu_initialization=True,
        perform_initialization=True,
        apply_rope_fusion=False,
    )
    with _pipeline_rank(chunk.pp_rank), torch.device("meta"):
        return LimeGPTModel(
            config=build,
            transformer_layer_spec=lime_block_spec(build, "local", chunk.vp_stage),
            vocab_size=vocab_size,
            max_sequence_length=seq_length,
            pre_process=chunk.pre_process,
            post_process=chunk.post_process,
            share_embeddings_and_output_weights=tied and chunk.pre_process and chunk.post_process,
            position_embedding_type="rope",
            vp_stage=chunk.vp_stage,
            pg_collection=_one_rank_groups(),
        )


def router_parameters(config: LimeTransformerConfig, layers: range, tp: int = 1) -> int:
    """Learned router weights of ``layers`` on one of ``tp`` tensor-parallel ranks."""
    if not config.lime:
        return 0
    if config.lime_router == "dynamic":  # W_l split by head (dynamic_router)
        return router_weights_per_source(config) * router_source_count(config, layers) // tp
    sharding = HeadSharding(config.kv_heads, 0, tp)
    with torch.device("meta"):
        routers = [LimeRouter(config, layer, sharding) for layer in layers]
    return sum(router.weight.numel() for router in routers if router.learned)


@dataclass(frozen=True)
class _Parameters:
    per_gpu: int
    routers_per_gpu: int
    unique: int
    unique_routers: int


def _chunk_parameters(config, chunk: _Chunk, vocab_size, seq_length, tied) -> _Parameters:
    """Parameters of the chunk: on one tensor-parallel rank, and over all of them."""
    model = _baseline_chunk(config, chunk, vocab_size, seq_length, tied)
    tp = config.tensor_model_parallel_size
    dense = sum(_shard_numel(name, p, tp) for name, p in model.named_parameters())
    routers = router_parameters(config, chunk.layers, tp)
    unique_routers = router_parameters(config, chunk.layers)
    unique = sum(p.numel() for p in model.parameters()) + unique_routers
    return _Parameters(dense + routers, routers, unique, unique_routers)


# ------------------------------------------------------------------------------ schedules


def peak_in_flight(
    config: LimeTransformerConfig, pp_rank: int, num_microbatches: int, chunk_bytes: list[int]
) -> tuple[int, int]:
    """(chunk-microbatches in flight, their bytes) at the peak of megatron's schedule on
    ``pp_rank`` (``schedule_model.rank_operations`` replayed); ``chunk_bytes[c]`` is one
    microbatch of chunk c."""
    pp = config.pipeline_model_parallel_size
    in_flight = [0] * len(chunk_bytes)
    peak = (0, 0)
    for op in rank_operations(
        pp,
        config.virtual_pipeline_model_parallel_size or 1,
        pp_rank,
        num_microbatches,
        config.microbatch_group_size_per_vp_stage or pp,
    ):
        in_flight[op.chunk] += 1 if op.forward else -1
        if op.forward:
            peak = max(peak, (sum(n * size for n, size in zip(in_flight, chunk_bytes)), sum(in_flight)))
    return peak[1], peak[0]


# ------------------------------------------------------------------------------ estimate


def estimate(
    config: LimeTransformerConfig,
    *,
    vocab_size: int,
    seq_length: int,
    micro_batch_size: int,
    num_microbatches: int,
    transformer_impl: str | None = None,
    share_embeddings_and_output_weights: bool = True,
) -> DryRunEstimate:
    """Parameters, FLOPs and activation memory of ``config``'s layout (docs/estimate.md).

    ``vocab_size`` is the padded vocabulary the model is built with; ``transformer_impl``
    (``local`` or ``transformer_engine``, Megatron-LM's ``--transformer-impl``) defaults to
    ``config.transformer_impl``.
    """
    transformer_impl = transformer_impl or config.transformer_impl
    for name, value in (
        ("vocab_size", vocab_size),
        ("seq_length", seq_length),
        ("micro_batch_size", micro_batch_size),
        ("num_microbatches", num_microbatches),
    ):
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    if transformer_impl not in TRANSFORMER_IMPLS:
        raise ValueError(f"transformer_impl must be one of {TRANSFORMER_IMPLS}, not {transformer_impl!r}")
    geometry = Geometry.of(config, seq_length, micro_batch_size, vocab_size)
    stages = []
    for chunks in chunk_layout(config):
        estimates = [
            _chunk_estimate(
                config, chunk, geometry, transformer_impl, vocab_size, seq_length, share_embeddings_and_output_weights
            )
            for chunk in chunks
        ]
        count, peak = peak_in_flight(
            config, chunks[0].pp_rank, num_microbatches, [chunk.activations.total for chunk in estimates]
        )
        working = max(chunk.backward_working_bytes for chunk in estimates)
        stages.append(StageEstimate(chunks[0].pp_rank, tuple(estimates), count, peak + working))
    total = sum(chunk.unique_parameters for stage in stages for chunk in stage.chunks)
    if share_embeddings_and_output_weights and config.pipeline_model_parallel_size > 1:
        total -= vocab_size * config.hidden_size  # the last stage's copy of the embedding
    return DryRunEstimate(
        config,
        vocab_size,
        seq_length,
        micro_batch_size,
        num_microbatches,
        transformer_impl,
        tuple(stages),
        total,
        forward_flops_per_token(config, seq_length, vocab_size),
    )


def _chunk_estimate(config, chunk: _Chunk, geometry, impl, vocab_size, seq_length, tied) -> ChunkEstimate:
    counts = _chunk_parameters(config, chunk, vocab_size, seq_length, tied)
    activations, working = chunk_activations(
        config, geometry, impl, chunk.layers, chunk.pre_process, chunk.post_process
    )
    return ChunkEstimate(
        chunk.pp_rank,
        chunk.vp_stage,
        chunk.layers,
        chunk.pre_process,
        chunk.post_process,
        counts.per_gpu,
        counts.routers_per_gpu,
        counts.unique,
        counts.unique_routers,
        chunk_forward_flops_per_token(config, chunk.layers, seq_length, vocab_size, chunk.post_process),
        activations,
        working,
    )


# ------------------------------------------------------------------------------ report


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def _layers(layers: range) -> str:
    return f"{layers.start}-{layers.stop - 1}" if len(layers) > 1 else str(layers.start) if layers else "-"


def _model_name(config: LimeTransformerConfig) -> str:
    """The family of ``config``: LIMe with its router, Hyper-Connections (dynamic or static), mHC, or
    the LLaMA baseline."""
    if config.lime:
        window = f"-{config.lime_router_window}" if config.lime_router_window else ""
        return f"LIMe ({config.lime_router}{window} router)"
    if config.hyper_connections_manifold:
        return f"mHC ({config.hyper_connections} streams)"
    if config.hyper_connections:
        kind = "static" if config.hyper_connections_static else "dynamic"
        return f"Hyper-Connections ({kind}, {config.hyper_connections} streams)"
    return "LLaMA baseline"


def _describe(config: LimeTransformerConfig) -> str:
    model = _model_name(config)
    return (
        f"{model}: {config.num_layers} layers, hidden {config.hidden_size}, FFN "
        f"{config.ffn_hidden_size}, {config.num_attention_heads} heads ({config.kv_heads} kv)"
    )


def _layout(result: DryRunEstimate) -> str:
    c = result.config
    parts = [f"TP {c.tensor_model_parallel_size}", f"PP {c.pipeline_model_parallel_size}"]
    if c.virtual_pipeline_model_parallel_size:
        parts.append(f"VPP {c.virtual_pipeline_model_parallel_size}")
    if c.sequence_parallel:
        parts.append("sequence parallel")
    recompute = c.recompute_granularity or "none"
    if recompute == "selective":
        recompute += f" ({', '.join(sorted(recompute_modules(c)))})"
    elif recompute == "full":
        recompute += f" ({c.recompute_method}, {c.recompute_num_layers} layers)"
    gpus = c.tensor_model_parallel_size * c.pipeline_model_parallel_size
    return (
        f"layout: {', '.join(parts)} ({gpus} GPU{'s' if gpus > 1 else ''} per model replica); micro batch "
        f"{result.micro_batch_size} x {result.num_microbatches} microbatches, seq "
        f"{result.seq_length}; recompute: {recompute}; {result.transformer_impl}"
    )


def _pruning_lines(config: LimeTransformerConfig) -> list[str]:
    """The routes route pruning chooses among, in this project's unit and in v1 Table 5's
    (``pruning.RouteCounts``); which are masked depends on the trained weights: the trainer prints
    the count, the analyses report it."""
    if not (config.lime and config.lime_prune_top_p is not None):
        return []
    per_source = config.kv_heads if config.lime_router == "dynamic" else config.kv_heads**2
    routes = per_source * router_source_count(config)
    unit = "(head, source) routes" if config.lime_router == "dynamic" else "router weights"
    return [
        f"route pruning: top-p {config.lime_prune_top_p} at --lime-prune-iters over {routes:,} {unit}, "
        f"{v1_route_count(config):,} routes in v1 Table 5's unit (one per kv head and earlier source layer, "
        f"the own layer not counted); the masked count depends on the trained weights (printed by the "
        f"trainer in both units, reported by the analyses)"
    ]


def _routing_lines(result: DryRunEstimate) -> list[str]:
    """LIMe's routing block size per chunk (``routing_block.chunk_routing_block``, the model's
    chooser, on the figures of ``config.lime_machine``) and the bytes its products read per
    micro-batch (``routing_bytes``: each chunk's own products, no TP split); for
    the dynamic router the bytes its per-token weights keep."""
    config = result.config
    if not config.lime:
        return []
    if config.lime_router == "dynamic":
        weights = sum(chunk.activations.routing_weights for stage in result.stages for chunk in stage.chunks)
        return [
            "",
            f"LIMe routing: dynamic router, per token and not blocked (B = 1); its weights p_l keep "
            f"{_gib(weights)} per microbatch (in the activations above)",
        ]
    chunks = sorted((chunk for stage in result.stages for chunk in stage.chunks), key=lambda chunk: chunk.layers.start)
    blocks = [chunk_routing_block(config, chunk.layers, result.seq_length, result.micro_batch_size) for chunk in chunks]
    per_chunk = ", ".join(f"layers {_layers(chunk.layers)}: {block}" for chunk, block in zip(chunks, blocks))
    chosen_by = "--lime-routing-block" if config.lime_routing_block else f"cost model on {routing_machine(config).name}"
    reads = {
        name: sum(
            sum(
                routing_bytes_per_step(
                    config, result.seq_length, result.micro_batch_size, block, chunk.layers, result.transformer_impl
                ).values()
            )
            for chunk, block in zip(chunks, blocks)
        )
        for name, blocks in (("per layer", [1] * len(chunks)), ("blocked", blocks))
    }
    geometry = Geometry.of(config, result.seq_length, result.micro_batch_size, result.vocab_size)
    stack = max(router_stack_bytes(config, geometry, chunk.layers) for chunk in chunks)
    return [
        "",
        f"LIMe routing: block size B per chunk {per_chunk} ({chosen_by}; --lime-routing-block sets it, "
        f"--lime-machine names the machine); bytes its products read per microbatch: "
        f"per layer (B=1) {_gib(reads['per layer'])}, "
        f"blocked {_gib(reads['blocked'])}; the routers stacked for its products: up to "
        f"{stack / 2**20:.2f} MiB per chunk (kept per microbatch where the forward mixes a "
        f"block's earlier sources, else in the backward working set; on the Triton path one per chunk)",
        f"LIMe routing products: {_routing_path(config)} (--lime-routing-kernel {config.lime_routing_kernel})",
    ]


def _routing_path(config) -> str:
    """Which path the routing products take on the machine the block size is chosen for."""
    machine = path_machine(config, routing_machine(config))
    path = "Triton kernels" if machine.operators == TRITON_OPERATORS else "torch operators"
    return f"{path} on {machine.name.split(' (')[0]}"


def report_lines(result: DryRunEstimate) -> list[str]:
    """The dry-run report, line by line."""
    lines = [
        f"dry run: {_describe(result.config)}, vocab {result.vocab_size}",
        _layout(result),
        "",
        f"{'stage':>5} {'layers':>14} {'params/GPU':>15} {'GFLOP/token':>12} "
        f"{'act/microbatch':>15} {'in flight':>9} {'peak act/GPU':>13}",
    ]
    for stage in result.stages:
        layers = ", ".join(_layers(chunk.layers) for chunk in stage.chunks)
        per_microbatch = max(chunk.activations.total for chunk in stage.chunks)
        lines.append(
            f"{stage.pp_rank:>5} {layers:>14} {stage.parameters:>15,} "
            f"{stage.forward_flops_per_token / 1e9:>12.3f} {_gib(per_microbatch):>15} "
            f"{stage.microbatches_in_flight:>9} {_gib(stage.peak_activation_bytes):>13}"
        )
    lines.append("")
    for stage in result.stages:
        for chunk in stage.chunks:
            a = chunk.activations
            name = f"stage {chunk.pp_rank}" + (f" chunk {chunk.vp_stage}" if chunk.vp_stage is not None else "")
            lines.append(
                f"  {name}, layers {_layers(chunk.layers)}, one microbatch: layers {_gib(a.layers)}, "
                f"LIMe memory {_gib(a.lime_memory)}, router stack {a.router_stack / 2**20:.2f} MiB, "
                f"received K/V {_gib(a.received_stage)}, "
                f"sent stage tensor {_gib(a.sent_stage)}, embedding/output "
                f"{_gib(a.embedding + a.output)}, backward working set "
                f"{_gib(chunk.backward_working_bytes)}"
            )
    flops = result.training_flops_per_token
    lines += _routing_lines(result) + _pruning_lines(result.config)
    lines += [
        "",
        f"parameters: {result.total_parameters:,} (LIMe routers {result.router_parameters:,}); "
        f"most on one GPU: {max(stage.parameters for stage in result.stages):,}",
        f"FLOPs per token: forward {result.forward_flops_per_token / 1e9:.3f} GFLOP, training "
        f"(3x forward) {flops / 1e9:.3f} GFLOP; per iteration of one data-parallel replica "
        f"({result.tokens_per_iteration:,} tokens): {flops * result.tokens_per_iteration / 1e12:,.1f} TFLOP",
        f"peak activation memory per GPU: {_gib(max(s.peak_activation_bytes for s in result.stages))} "
        "(parameters, gradients and optimizer state not included)",
    ]
    return lines


def dry_run_report(
    config: LimeTransformerConfig,
    *,
    vocab_size: int,
    seq_length: int,
    micro_batch_size: int,
    num_microbatches: int,
    transformer_impl: str | None = None,
    share_embeddings_and_output_weights: bool = True,
    compute_tflops: float = DEFAULT_COMPUTE_TFLOPS,
    link_bandwidth_gbps: float | None = None,
    link_latency_us: float = 5.0,
) -> str:
    """The ``--dry-run`` report of ``config``'s layout (see ``estimate``), with the step-time
    model's table (``schedule_model``) over one link of ``link_bandwidth_gbps`` Gb/s, or over
    the NVLink-like and InfiniBand-like links when it is None."""
    result = estimate(
        config,
        vocab_size=vocab_size,
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        num_microbatches=num_microbatches,
        transformer_impl=transformer_impl,
        share_embeddings_and_output_weights=share_embeddings_and_output_weights,
    )
    links: tuple[Link, ...] = (NVLINK, INFINIBAND)
    if link_bandwidth_gbps is not None:
        links = (Link("link", link_bandwidth_gbps, link_latency_us),)
    step_times = step_time_lines(
        config,
        vocab_size=vocab_size,
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        num_microbatches=num_microbatches,
        compute_tflops=compute_tflops,
        links=links,
    )
    return "\n".join(report_lines(result) + [""] + step_times)
