"""Dry-run estimates for a parallel layout: parameters, FLOPs and activation memory per stage.

``dry_run_report(config, vocab_size=, seq_length=, micro_batch_size=, num_microbatches=)``
returns the text printed by ``pretrain_lime.py --dry-run``; ``estimate(...)`` returns the data
behind it (a ``StageEstimate`` per pipeline rank, a ``ChunkEstimate`` per model chunk). Neither
needs ``torch.distributed`` nor more than one process.

**Parameters** are counted on models that megatron builds on the meta device, one pipeline
stage / virtual chunk at a time: ``config.pipeline_layer_split`` (megatron's own
``get_num_layers_to_build`` and ``get_transformer_layer_offset``) says which layers each chunk
holds (uneven first/last stages included), and the chunk is built for its pipeline rank with a one-rank stand-in for the process
groups (nothing communicates while building on meta). Chunks are built at tensor-parallel size 1
and divided exactly by megatron's sharding rules: a parameter that megatron marks
tensor-parallel (``tensor_model_parallel``, ``partition_dim``) holds 1/TP of its
``partition_dim`` on every rank, the others (norms) are replicated. The non-router parameters
of LIMe and of the baseline are the same; each chunk's LIMe routers are built as
``router.LimeRouter`` for their true layer and the rank's ``head_parallel.HeadSharding`` (split by input kv
head). Under pipeline parallelism the last stage holds its own output weight (megatron's copy
of the tied embedding); the model total counts it once when embeddings are tied.

**FLOPs** per token come from ``accounting`` (matrix products, router included); training
FLOPs are 3x forward (model FLOPs, recomputation not counted). A stage's share is its layers'
FLOPs, its routers' (``accounting.router_flops_per_token`` split over layers in proportion to
their number of sources) and, on the last stage, the logits.

**Activation memory** per GPU is what one microbatch keeps for backward on one
tensor-parallel rank, summed over the microbatches in flight. Per layer, in the style of
megatron's estimate (Korthikanti et al. 2022, Table 2) but for the LLaMA layer (RMSNorm,
SwiGLU, RoPE, GQA, no dropout), with s the sequence, b the micro batch, h hidden, a/g/d query
heads, kv heads and head dim, f the FFN size, t the TP size, a_t = a/t, g_t = max(1, g/t),
f_t = f/t, s_h = s/t under sequence parallelism (else s), e the element size (2 for bf16/fp16):

- norms (2): fp32 statistics s_h*b and the input s_h*b*h (``transformer_engine``), or
  (``local``: torch's composite RMSNorm, computed in fp32) an fp32 copy of the input and the
  fp32 normalized input;
- linear-layer inputs: QKV s_h*b*h, output projection s*b*a_t*d, FC1 s_h*b*h, FC2 s*b*f_t;
- RoPE tables (unfused RoPE): 4 * s*d;
- core attention: queries s*b*a_t*d, keys, values and scores:
  ``local`` (megatron's DotProductAttention): keys s*b*a_t*d (expanded to the query heads),
  values s*b*a_t*d when expanded (GQA) or else the whole QKV output s*b*(a_t+2g_t)*d they are a
  view of, softmax probabilities a_t*b*s^2; ``transformer_engine`` (fused/flash attention):
  keys s*b*g_t*d, values the QKV output as above (a view), fp32 softmax statistics a_t*b*s;
- MLP: FC1 output s*b*2f_t, plus (unfused SwiGLU) the activation output and the up half, s*b*f_t
  each (no gate: FC1 output s*b*f_t).

Recompute: ``selective`` of ``core_attn`` keeps the queries, keys and values the core
attention is called with (keys s*b*g_t*d) instead of its saved tensors; of ``mlp`` keeps the MLP
input only; ``full`` keeps each recomputed group's input s_h*b*h (divided by t with
``distribute_saved_activations``) and the fp32 rotary frequencies s*d, and adds, at the peak,
one group's activations rebuilt in backward.

LIMe adds, per layer, its raw keys and values in the layer-integrated memory,
2*s*b*g_t*d (the full sequence also under sequence parallelism; live whatever the recompute
setting). With ``lime_recompute_routed_kv`` (default) the routed keys/values that attention saves
are rebuilt in backward: attention keeps no keys/values except copies it makes itself (local
GQA expansion) and no QKV output; without it, the routed tensor 2*s*b*g_t*d replaces the QKV
output as the values' storage. Pipeline stages exchange the hidden state [s_h, b, hidden] and,
on ``pipeline``'s side channel, the K/V rows the receiving rank lacks (``pipeline.hop_blocks``:
every row crosses to a rank once per micro-batch; the layers still read at or after the chunk,
``pipeline.carried_layers``), 2*s*b*g_t*d each; a rank keeps the rows received at the hop into a
chunk until that chunk's backward ends (its own rows are its chunks' LIMe memory). A chunk keeps,
until its backward, the hidden state it sent (unless ``deallocate_pipeline_outputs``).

Per chunk also: token ids (first chunk; with TP also the bool mask of ids outside the rank's
vocabulary rows); the final norm, the output layer's input and the
fp32 softmax of the loss s*b*V/t (last chunk). Microbatches in flight follow megatron's
schedules: min(p - r, m) on pipeline rank r of p for 1F1B; the interleaved schedule is replayed
(its warm-up of 2(p - r - 1) + (v - 1) * group chunk-microbatches, then one forward and one
backward at a time, chunks in megatron's order) and its peak taken.

Not included: parameters, gradients and optimizer state, communication buffers, the rotary
frequencies, allocator fragmentation. ``local`` matches torch's saved tensors on CPU (tests); the
``transformer_engine`` terms follow TransformerEngine's fused modules and are not measured here.
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch
from megatron.core import parallel_state
from megatron.core.pipeline_parallel.schedules import get_schedule_table
from megatron.core.process_groups_config import ProcessGroupCollection

from lime_megatron.accounting import forward_flops_per_token, layer_flops_per_token, router_flops_per_token
from lime_megatron.config import LimeTransformerConfig, pipeline_layer_split
from lime_megatron.layer_spec import lime_block_spec
from lime_megatron.model import LimeGPTModel
from lime_megatron.pipeline import hop_blocks
from lime_megatron.head_parallel import HeadSharding
from lime_megatron.router import LimeRouter, routing_sources

TRANSFORMER_IMPLS = ("local", "transformer_engine")
RECOMPUTED_MODULES = ("core_attn", "mlp")
FP32 = 4
INT64 = 8
# Process groups a GPTModel reads while it is built.
_GROUPS = ("tp", "pp", "mp", "embd", "pos_embd", "cp", "tp_cp", "dp", "dp_cp", "tp_dp_cp")


# ------------------------------------------------------------------------------ results


@dataclass(frozen=True)
class ActivationBytes:
    """Bytes one microbatch of one model chunk keeps for backward on one GPU, by part."""

    layers: int
    """Transformer layers (after recomputation)."""
    lime_memory: int = 0
    """The chunk's own raw keys/values in the layer-integrated memory."""
    received_stage: int = 0
    """K/V rows received at the hop into this chunk (``pipeline.hop_blocks``), kept by the rank
    until the chunk's backward ends."""
    sent_stage: int = 0
    """The hidden state sent on, kept until backward (0 with deallocate_pipeline_outputs)."""
    embedding: int = 0
    """Token ids (first chunk)."""
    output: int = 0
    """Final norm, output layer input and the loss's softmax (last chunk)."""

    @property
    def total(self) -> int:
        return (self.layers + self.lime_memory + self.received_stage + self.sent_stage
                + self.embedding + self.output)


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
    recompute_peak_bytes: int
    """Activations of one recompute group rebuilt in backward (0 without full recompute)."""


@dataclass(frozen=True)
class StageEstimate:
    """One pipeline rank: its chunks and its peak activation memory per GPU."""

    pp_rank: int
    chunks: tuple[ChunkEstimate, ...]
    microbatches_in_flight: int
    """Chunk-microbatches whose activations are kept at the peak."""
    peak_activation_bytes: int
    """Activation memory per GPU at the peak, the recompute working set included."""

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
        raise ValueError("the dry-run estimate does not support pipeline_model_parallel_layout; "
                         "use num_layers_in_first/last_pipeline_stage")
    pp, vpp = config.pipeline_model_parallel_size, config.virtual_pipeline_model_parallel_size
    split = pipeline_layer_split(config)
    last = (vpp or 1) - 1
    return [[_Chunk(rank, vp, split[rank, vp], rank == 0 and vp in (None, 0),
                    rank == pp - 1 and vp in (None, last))
             for vp in (range(vpp) if vpp else [None])]
            for rank in range(pp)]


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
        raise ValueError(f"{name} has {size} rows along its tensor-parallel dimension, "
                         f"not divisible by tensor_model_parallel_size={tp}")
    return param.numel() // tp


def _baseline_chunk(config: LimeTransformerConfig, chunk: _Chunk, vocab_size: int,
                    seq_length: int, tied: bool) -> LimeGPTModel:
    """The chunk without LIMe routers, built on meta at TP=1 for its pipeline rank.

    Embeddings are tied only in a chunk holding both ends (no pipeline parallelism): under
    pipeline parallelism the last stage gets an untied output weight, the same shape as
    megatron's tied copy, without the copy's cross-stage set-up.
    """
    build = dataclasses.replace(config, lime=False, tensor_model_parallel_size=1,
                                sequence_parallel=False, use_cpu_initialization=True,
                                perform_initialization=True, apply_rope_fusion=False)
    with _pipeline_rank(chunk.pp_rank), torch.device("meta"):
        return LimeGPTModel(
            config=build, transformer_layer_spec=lime_block_spec(build, "local", chunk.vp_stage),
            vocab_size=vocab_size, max_sequence_length=seq_length,
            pre_process=chunk.pre_process, post_process=chunk.post_process,
            share_embeddings_and_output_weights=tied and chunk.pre_process and chunk.post_process,
            position_embedding_type="rope", vp_stage=chunk.vp_stage,
            pg_collection=_one_rank_groups())


def router_parameters(config: LimeTransformerConfig, layers: range, tp: int = 1) -> int:
    """Learned router weights of ``layers`` on one of ``tp`` tensor-parallel ranks."""
    if not config.lime:
        return 0
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


# ------------------------------------------------------------------------------ FLOPs


def _chunk_forward_flops(config: LimeTransformerConfig, chunk: _Chunk, seq_length: int,
                         vocab_size: int) -> float:
    """Forward FLOPs per token of the chunk's layers, routers and (last chunk) logits."""
    flops = len(chunk.layers) * layer_flops_per_token(config, seq_length)
    if config.lime:
        def sources(layers):
            return sum(len(routing_sources(layer, config.lime_router, config.lime_router_window))
                       for layer in layers if layer > 0)

        total = sources(range(config.num_layers))
        flops += router_flops_per_token(config) * sources(chunk.layers) / total if total else 0.0
    if chunk.post_process:
        flops += 2.0 * config.hidden_size * vocab_size
    return flops


# ------------------------------------------------------------------------------ activations


@dataclass(frozen=True)
class Geometry:
    """Activation sizes of one microbatch on one tensor-parallel rank (see module docstring)."""

    seq: int
    """s: sequence length."""
    batch: int
    """b: micro batch size."""
    hidden_rows: int
    """s_h: sequence rows of hidden-state tensors (s/t under sequence parallelism)."""
    hidden: int
    heads: int
    """a_t: query heads per rank."""
    kv_heads: int
    """g_t: key/value heads per rank."""
    head_dim: int
    ffn: int
    """f_t: FFN width per rank."""
    vocab: int
    """V/t: vocabulary rows per rank."""
    element: int
    """Bytes per activation element."""

    @classmethod
    def of(cls, config: LimeTransformerConfig, seq_length: int, micro_batch_size: int,
           vocab_size: int) -> "Geometry":
        tp = config.tensor_model_parallel_size
        if config.sequence_parallel and seq_length % tp:
            raise ValueError(f"seq_length={seq_length} is not divisible by "
                             f"tensor_model_parallel_size={tp} (sequence parallelism)")
        element = 2 if (config.bf16 or config.fp16) else config.params_dtype.itemsize
        return cls(seq=seq_length, batch=micro_batch_size,
                   hidden_rows=seq_length // tp if config.sequence_parallel else seq_length,
                   hidden=config.hidden_size, heads=config.num_attention_heads // tp,
                   kv_heads=max(1, config.kv_heads // tp), head_dim=config.kv_channels,
                   ffn=config.ffn_hidden_size // tp, vocab=vocab_size // tp, element=element)

    @property
    def hidden_state(self) -> int:
        """Bytes of one hidden-state tensor [s_h, b, h]."""
        return self.hidden_rows * self.batch * self.hidden * self.element

    def heads_bytes(self, heads: int) -> int:
        """Bytes of a [s, b, heads, d] tensor."""
        return self.seq * self.batch * heads * self.head_dim * self.element

    @property
    def kv_rows(self) -> int:
        """Bytes of one layer's raw keys and values (the LIMe memory rows of one layer)."""
        return 2 * self.heads_bytes(self.kv_heads)


def _recompute_modules(config: LimeTransformerConfig) -> set[str]:
    """The selectively recomputed modules (empty without selective recompute)."""
    if config.recompute_granularity != "selective":
        return set()
    modules = set(config.recompute_modules or ["core_attn"])
    unknown = sorted(modules - set(RECOMPUTED_MODULES))
    if unknown:
        raise ValueError(f"the dry-run estimate models selective recompute of {RECOMPUTED_MODULES}, "
                         f"not {unknown}")
    return modules


def _norm_bytes(geometry: Geometry, impl: str) -> int:
    """One norm and its statistics: ``local`` (torch's composite RMSNorm, computed in fp32)
    keeps an fp32 copy of its input and the fp32 normalized input; ``transformer_engine`` keeps
    its input (its output is the next linear layer's input)."""
    rows = geometry.hidden_rows * geometry.batch
    if impl == "local":
        return 2 * rows * geometry.hidden * FP32 + rows * FP32
    return geometry.hidden_state + rows * FP32


def _attention_bytes(config: LimeTransformerConfig, geometry: Geometry, impl: str) -> int:
    """What self-attention keeps for backward beyond its linear layers' inputs."""
    g, heads = geometry, geometry.heads
    rebuilt = config.lime and config.lime_recompute_routed_kv  # routed K/V rebuilt in backward
    if config.lime:  # values are a view of the routed [2, s, b, g_t, d] keys/values
        values = 0 if rebuilt else g.kv_rows
    else:  # values are a view of the QKV output
        values = g.heads_bytes(heads + 2 * g.kv_heads)
    query = g.heads_bytes(heads)
    if "core_attn" in _recompute_modules(config):  # the checkpoint keeps q, k, v as passed
        return query + (0 if rebuilt else g.heads_bytes(g.kv_heads)) + values
    if impl == "transformer_engine":
        keys = 0 if rebuilt else g.heads_bytes(g.kv_heads)
        return query + keys + values + heads * g.batch * g.seq * FP32
    # Softmax output (fp32 with attention_softmax_in_fp32), its copy in the activation dtype
    # that multiplies the values, and the boolean causal mask.
    softmax = FP32 if config.attention_softmax_in_fp32 else g.element
    copy = g.element if g.element != softmax else 0
    scores = heads * g.batch * g.seq * g.seq * (softmax + copy) + g.seq * g.seq
    if heads > g.kv_heads:  # local attention repeats K/V to the query heads: copies it keeps
        return query + 2 * g.heads_bytes(heads) + scores
    return query + (0 if rebuilt else g.heads_bytes(heads)) + values + scores


def _mlp_bytes(config: LimeTransformerConfig, geometry: Geometry) -> int:
    """What the MLP keeps beyond its FC1 input: FC1 output, activation tensors, FC2 input."""
    if "mlp" in _recompute_modules(config):
        return 0
    row = geometry.seq * geometry.batch * geometry.ffn * geometry.element
    if not config.gated_linear_unit:
        return 2 * row
    return (3 if config.bias_activation_fusion else 5) * row


def layer_activation_bytes(config: LimeTransformerConfig, geometry: Geometry, impl: str) -> int:
    """Bytes one transformer layer keeps for backward without full recompute (LIMe memory
    excluded); see the module docstring."""
    if impl not in TRANSFORMER_IMPLS:
        raise ValueError(f"transformer_impl must be one of {TRANSFORMER_IMPLS}, not {impl!r}")
    g = geometry
    rope = 0 if config.apply_rope_fusion else 4 * g.seq * g.head_dim * g.element
    linear_inputs = 2 * g.hidden_state + g.heads_bytes(g.heads)  # QKV, FC1, projection
    return (2 * _norm_bytes(g, impl) + linear_inputs + rope + _attention_bytes(config, g, impl)
            + _mlp_bytes(config, g))


def _recompute_groups(config: LimeTransformerConfig, layers: int) -> tuple[int, int]:
    """Full recompute of a chunk of ``layers`` layers: ``(kept, checkpoints, group)``, the
    layers keeping all activations, the recomputed groups (each keeps its input) and the
    layers of one group (rebuilt together in backward)."""
    if config.recompute_granularity != "full":
        return layers, 0, 0
    n = config.recompute_num_layers
    if config.recompute_method == "uniform":
        if layers % n:
            raise ValueError(f"uniform full recompute needs every chunk's layer count ({layers}) to be "
                             f"divisible by recompute_num_layers={n} (megatron recomputes whole groups)")
        return 0, layers // n, n
    recomputed = min(n, layers)  # "block": the chunk's first n layers
    return layers - recomputed, recomputed, 1 if recomputed else 0


def _embedding_bytes(config: LimeTransformerConfig, geometry: Geometry) -> int:
    """Token ids (int64) and, under tensor parallelism, the mask of ids outside the rank's
    vocabulary rows (bool)."""
    tokens = geometry.seq * geometry.batch
    return tokens * INT64 + (tokens if config.tensor_model_parallel_size > 1 else 0)


def chunk_activations(config: LimeTransformerConfig, chunk: _Chunk, geometry: Geometry,
                      impl: str) -> tuple[ActivationBytes, int]:
    """(bytes kept per microbatch, recompute working set) of one chunk on one GPU."""
    per_layer = layer_activation_bytes(config, geometry, impl)
    kept, checkpoints, group = _recompute_groups(config, len(chunk.layers))
    checkpoint = geometry.hidden_state
    if config.distribute_saved_activations and not config.sequence_parallel:
        checkpoint //= config.tensor_model_parallel_size
    layers = kept * per_layer + checkpoints * checkpoint
    if checkpoints:  # every checkpoint also keeps the rotary frequencies [s, 1, 1, d] (one tensor)
        layers += geometry.seq * geometry.head_dim * FP32

    received = 0  # the K/V rows of the hop into this chunk, kept until its backward ends
    if not chunk.pre_process and config.lime:
        index = (chunk.vp_stage or 0) * config.pipeline_model_parallel_size + chunk.pp_rank
        received = sum(len(block.layers) for block in hop_blocks(config, index)) * geometry.kv_rows
    sent = 0 if chunk.post_process or config.deallocate_pipeline_outputs else geometry.hidden_state
    output = 0
    if chunk.post_process:
        loss = geometry.seq * geometry.batch * (geometry.vocab * FP32 + 1 + INT64)
        output = _norm_bytes(geometry, impl) + geometry.hidden_state + loss
    activations = ActivationBytes(
        layers=layers,
        lime_memory=len(chunk.layers) * geometry.kv_rows if config.lime else 0,
        received_stage=received,
        sent_stage=sent,
        embedding=_embedding_bytes(config, geometry) if chunk.pre_process else 0,
        output=output,
    )
    return activations, group * per_layer


# ------------------------------------------------------------------------------ schedules


def _interleaved_chunk_order(config: LimeTransformerConfig, num_microbatches: int) -> list[int]:
    """Model chunk of each forward, in the interleaved schedule's order (megatron's table);
    the same checks as megatron's schedule."""
    pp, group = config.pipeline_model_parallel_size, config.microbatch_group_size_per_vp_stage
    if not pp <= group <= num_microbatches:
        raise ValueError(f"the interleaved schedule needs pipeline_model_parallel_size={pp} <= "
                         f"microbatch_group_size_per_vp_stage={group} <= num_microbatches={num_microbatches}")
    if 0 < num_microbatches % group < pp:
        raise ValueError(f"the interleaved schedule needs num_microbatches={num_microbatches} to leave "
                         f"0 or at least {pp} microbatches after whole groups of {group}")
    table = get_schedule_table(num_microbatches, config.virtual_pipeline_model_parallel_size, group)
    return [chunk for _, chunk in table]


def peak_in_flight(config: LimeTransformerConfig, pp_rank: int, num_microbatches: int,
                   chunk_bytes: list[int]) -> tuple[int, int]:
    """(chunk-microbatches in flight, their bytes) at the peak of megatron's schedule on
    ``pp_rank``; ``chunk_bytes[c]`` is one microbatch of chunk c."""
    pp, vpp = config.pipeline_model_parallel_size, config.virtual_pipeline_model_parallel_size
    if not vpp:
        count = min(pp - pp_rank, num_microbatches)
        return count, count * chunk_bytes[0]
    order = _interleaved_chunk_order(config, num_microbatches)
    total = len(order)
    warmup = min(total, 2 * (pp - pp_rank - 1) + (vpp - 1) * config.microbatch_group_size_per_vp_stage)
    in_flight = [0] * vpp
    peak = (0, 0)

    def forward(k):
        nonlocal peak
        in_flight[order[k]] += 1
        current = sum(n * size for n, size in zip(in_flight, chunk_bytes))
        peak = max(peak, (current, sum(in_flight)))

    for k in range(warmup):
        forward(k)
    for k in range(total - warmup):
        forward(warmup + k)
        in_flight[vpp - 1 - order[k]] -= 1
    return peak[1], peak[0]


# ------------------------------------------------------------------------------ estimate


def estimate(config: LimeTransformerConfig, *, vocab_size: int, seq_length: int,
             micro_batch_size: int, num_microbatches: int,
             transformer_impl: str | None = None,
             share_embeddings_and_output_weights: bool = True) -> DryRunEstimate:
    """Parameters, FLOPs and activation memory of ``config``'s layout (see module docstring).

    ``vocab_size`` is the padded vocabulary the model is built with; ``transformer_impl``
    (``local`` or ``transformer_engine``, Megatron-LM's ``--transformer-impl``) defaults to
    ``config.transformer_impl``.
    """
    transformer_impl = transformer_impl or config.transformer_impl
    for name, value in (("vocab_size", vocab_size), ("seq_length", seq_length),
                        ("micro_batch_size", micro_batch_size), ("num_microbatches", num_microbatches)):
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    if transformer_impl not in TRANSFORMER_IMPLS:
        raise ValueError(f"transformer_impl must be one of {TRANSFORMER_IMPLS}, not {transformer_impl!r}")
    geometry = Geometry.of(config, seq_length, micro_batch_size, vocab_size)
    stages = []
    for chunks in chunk_layout(config):
        estimates = [_chunk_estimate(config, chunk, geometry, transformer_impl, vocab_size,
                                     seq_length, share_embeddings_and_output_weights)
                     for chunk in chunks]
        count, peak = peak_in_flight(config, chunks[0].pp_rank, num_microbatches,
                                     [chunk.activations.total for chunk in estimates])
        working = max(chunk.recompute_peak_bytes for chunk in estimates)
        stages.append(StageEstimate(chunks[0].pp_rank, tuple(estimates), count, peak + working))
    total = sum(chunk.unique_parameters for stage in stages for chunk in stage.chunks)
    if share_embeddings_and_output_weights and config.pipeline_model_parallel_size > 1:
        total -= vocab_size * config.hidden_size  # the last stage's copy of the embedding
    return DryRunEstimate(config, vocab_size, seq_length, micro_batch_size, num_microbatches,
                          transformer_impl, tuple(stages), total,
                          forward_flops_per_token(config, seq_length, vocab_size))


def _chunk_estimate(config, chunk: _Chunk, geometry, impl, vocab_size, seq_length, tied) -> ChunkEstimate:
    counts = _chunk_parameters(config, chunk, vocab_size, seq_length, tied)
    activations, working = chunk_activations(config, chunk, geometry, impl)
    return ChunkEstimate(chunk.pp_rank, chunk.vp_stage, chunk.layers, chunk.pre_process,
                         chunk.post_process, counts.per_gpu, counts.routers_per_gpu, counts.unique,
                         counts.unique_routers,
                         _chunk_forward_flops(config, chunk, seq_length, vocab_size),
                         activations, working)


# ------------------------------------------------------------------------------ report


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def _layers(layers: range) -> str:
    return f"{layers.start}-{layers.stop - 1}" if len(layers) > 1 else str(layers.start) if layers else "-"


def _describe(config: LimeTransformerConfig) -> str:
    model = "LLaMA baseline"
    if config.lime:
        window = f"-{config.lime_router_window}" if config.lime_router_window else ""
        model = f"LIMe ({config.lime_router}{window} router)"
    return (f"{model}: {config.num_layers} layers, hidden {config.hidden_size}, FFN "
            f"{config.ffn_hidden_size}, {config.num_attention_heads} heads ({config.kv_heads} kv)")


def _layout(result: DryRunEstimate) -> str:
    c = result.config
    parts = [f"TP {c.tensor_model_parallel_size}", f"PP {c.pipeline_model_parallel_size}"]
    if c.virtual_pipeline_model_parallel_size:
        parts.append(f"VPP {c.virtual_pipeline_model_parallel_size}")
    if c.sequence_parallel:
        parts.append("sequence parallel")
    recompute = c.recompute_granularity or "none"
    if recompute == "selective":
        recompute += f" ({', '.join(sorted(_recompute_modules(c)))})"
    elif recompute == "full":
        recompute += f" ({c.recompute_method}, {c.recompute_num_layers} layers)"
    gpus = c.tensor_model_parallel_size * c.pipeline_model_parallel_size
    return (f"layout: {', '.join(parts)} ({gpus} GPU{'s' if gpus > 1 else ''} per model replica); micro batch "
            f"{result.micro_batch_size} x {result.num_microbatches} microbatches, seq "
            f"{result.seq_length}; recompute: {recompute}; {result.transformer_impl}")


def report_lines(result: DryRunEstimate) -> list[str]:
    """The dry-run report, line by line."""
    lines = [f"dry run: {_describe(result.config)}, vocab {result.vocab_size}", _layout(result), "",
             f"{'stage':>5} {'layers':>14} {'params/GPU':>15} {'GFLOP/token':>12} "
             f"{'act/microbatch':>15} {'in flight':>9} {'peak act/GPU':>13}"]
    for stage in result.stages:
        layers = ", ".join(_layers(chunk.layers) for chunk in stage.chunks)
        per_microbatch = max(chunk.activations.total for chunk in stage.chunks)
        lines.append(f"{stage.pp_rank:>5} {layers:>14} {stage.parameters:>15,} "
                     f"{stage.forward_flops_per_token / 1e9:>12.3f} {_gib(per_microbatch):>15} "
                     f"{stage.microbatches_in_flight:>9} {_gib(stage.peak_activation_bytes):>13}")
    lines.append("")
    for stage in result.stages:
        for chunk in stage.chunks:
            a = chunk.activations
            name = f"stage {chunk.pp_rank}" + (f" chunk {chunk.vp_stage}" if chunk.vp_stage is not None else "")
            lines.append(f"  {name}, layers {_layers(chunk.layers)}, one microbatch: layers {_gib(a.layers)}, "
                         f"LIMe memory {_gib(a.lime_memory)}, received K/V {_gib(a.received_stage)}, "
                         f"sent stage tensor {_gib(a.sent_stage)}, embedding/output "
                         f"{_gib(a.embedding + a.output)}, recompute working set "
                         f"{_gib(chunk.recompute_peak_bytes)}")
    flops = result.training_flops_per_token
    lines += ["",
              f"parameters: {result.total_parameters:,} (LIMe routers {result.router_parameters:,}); "
              f"most on one GPU: {max(stage.parameters for stage in result.stages):,}",
              f"FLOPs per token: forward {result.forward_flops_per_token / 1e9:.3f} GFLOP, training "
              f"(3x forward) {flops / 1e9:.3f} GFLOP; per iteration of one data-parallel replica "
              f"({result.tokens_per_iteration:,} tokens): {flops * result.tokens_per_iteration / 1e12:,.1f} TFLOP",
              f"peak activation memory per GPU: {_gib(max(s.peak_activation_bytes for s in result.stages))} "
              "(parameters, gradients and optimizer state not included)"]
    return lines


def dry_run_report(config: LimeTransformerConfig, *, vocab_size: int, seq_length: int,
                   micro_batch_size: int, num_microbatches: int,
                   transformer_impl: str | None = None,
                   share_embeddings_and_output_weights: bool = True) -> str:
    """The ``--dry-run`` report of ``config``'s layout (see ``estimate``)."""
    result = estimate(config, vocab_size=vocab_size, seq_length=seq_length,
                      micro_batch_size=micro_batch_size, num_microbatches=num_microbatches,
                      transformer_impl=transformer_impl,
                      share_embeddings_and_output_weights=share_embeddings_and_output_weights)
    return "\n".join(report_lines(result))
