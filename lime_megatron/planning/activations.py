"""Activation bytes one microbatch keeps for backward, per layer and per model chunk, on one GPU.

The formulas behind the ``--dry-run`` activation memory (``estimate`` replays the pipeline
schedule over them); docs/estimate.md states every term and the measurements that check them
(``saved_tensors.SavedTensorBytes`` in tests/planning/test_estimate.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from lime_megatron.models.config import LimeTransformerConfig
from lime_megatron.models.lime.recompute import drops_routed_kv, te_flash_attention
from lime_megatron.models.lime.router import layer_reads
from lime_megatron.parallel.pipeline import chunk_starting_at, hop_blocks
from lime_megatron.planning.routing_block import chunk_routing_block
from lime_megatron.planning.routing_bytes import chunk_blocks

TRANSFORMER_IMPLS = ("local", "transformer_engine")
RECOMPUTED_MODULES = ("core_attn", "mlp")
FP32 = 4
INT64 = 8


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
    routing_weights: int = 0
    """The dynamic router's per-token weights p_l of the kept layers (v1 Table 6's
    B T H (L(L+1)/2 - 1) term)."""
    router_stack: int = 0
    """The static routers stacked as one matrix (``routing_blocks.RouterStack``), when the chunk's
    forward builds it (``forward_builds_router_stack``): the memory holds it until its backward."""

    @property
    def total(self) -> int:
        return (
            self.layers
            + self.lime_memory
            + self.received_stage
            + self.sent_stage
            + self.embedding
            + self.output
            + self.routing_weights
            + self.router_stack
        )


@dataclass(frozen=True)
class Geometry:
    """Activation sizes of one microbatch on one tensor-parallel rank (docs/estimate.md names them)."""

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
    def of(cls, config: LimeTransformerConfig, seq_length: int, micro_batch_size: int, vocab_size: int) -> Geometry:
        tp = config.tensor_model_parallel_size
        if config.sequence_parallel and seq_length % tp:
            raise ValueError(
                f"seq_length={seq_length} is not divisible by tensor_model_parallel_size={tp} (sequence parallelism)"
            )
        element = 2 if (config.bf16 or config.fp16) else config.params_dtype.itemsize
        return cls(
            seq=seq_length,
            batch=micro_batch_size,
            hidden_rows=seq_length // tp if config.sequence_parallel else seq_length,
            hidden=config.hidden_size,
            heads=config.num_attention_heads // tp,
            kv_heads=max(1, config.kv_heads // tp),
            head_dim=config.kv_channels,
            ffn=config.ffn_hidden_size // tp,
            vocab=vocab_size // tp,
            element=element,
        )

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


def recompute_modules(config: LimeTransformerConfig) -> set[str]:
    """The selectively recomputed modules (empty without selective recompute)."""
    if config.recompute_granularity != "selective":
        return set()
    modules = set(config.recompute_modules or ["core_attn"])
    unknown = sorted(modules - set(RECOMPUTED_MODULES))
    if unknown:
        raise ValueError(f"the dry-run estimate models selective recompute of {RECOMPUTED_MODULES}, not {unknown}")
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
    rebuilt = drops_routed_kv(config, impl)  # routed K/V dropped and rebuilt in backward, as LIMe's attention decides
    if config.lime:  # the routed values [s, b, g_t, d], a tensor of their own
        values = 0 if rebuilt else g.heads_bytes(g.kv_heads)
    else:  # values are a view of the QKV output
        values = g.heads_bytes(heads + 2 * g.kv_heads)
    query = g.heads_bytes(heads)
    keys = 0 if rebuilt else g.heads_bytes(g.kv_heads)
    if "core_attn" in recompute_modules(config):  # the checkpoint keeps q, k, v as passed
        return query + keys + values
    if impl == "transformer_engine" and te_flash_attention(config):
        # bshd copies of q, k, v and of the output (the sbhd output handed on is linear_proj's input)
        # and the fp32 log-sum-exp; the tensors given are not saved
        return g.heads_bytes(2 * heads + 2 * g.kv_heads) + heads * g.batch * g.seq * FP32
    if impl == "transformer_engine":
        return query + keys + values + heads * g.batch * g.seq * FP32
    # Softmax output (fp32 with attention_softmax_in_fp32), its copy in the activation dtype
    # that multiplies the values, and the boolean causal mask.
    softmax = FP32 if config.attention_softmax_in_fp32 else g.element
    copy = g.element if g.element != softmax else 0
    scores = heads * g.batch * g.seq * g.seq * (softmax + copy) + g.seq * g.seq
    if heads > g.kv_heads:  # local attention repeats K/V to the query heads: copies it keeps
        return query + 2 * g.heads_bytes(heads) + scores
    return query + keys + values + scores


def _mlp_bytes(config: LimeTransformerConfig, geometry: Geometry) -> int:
    """What the MLP keeps beyond its FC1 input: FC1 output, activation tensors, FC2 input."""
    if "mlp" in recompute_modules(config):
        return 0
    row = geometry.seq * geometry.batch * geometry.ffn * geometry.element
    if not config.gated_linear_unit:
        return 2 * row
    return (3 if config.bias_activation_fusion else 5) * row


def _hyper_connection_bytes(config: LimeTransformerConfig, geometry: Geometry) -> int:
    """What one hyper-connection and its sublayer's LayerNorm without affine keep (the norm's
    input is a view of the mixed streams), with ``r`` rows ``s_h b`` and one stream ``[s_h, b, h]``:
    the streams n, the mixed streams n+1 and the sublayer's output 1 (multiplied by beta) streams,
    the norm's statistics 2r; dynamic also the LayerNorm of the streams (its output n streams,
    statistics 2rn), tanh and alpha ``[r, n, n+1]`` twice, tanh and beta ``[r, n]`` twice. The
    statistics are counted in the activation dtype, as torch's CPU kernel keeps them (CUDA keeps
    them in fp32 for bf16: 4r(n+1) bytes more per hyper-connection)."""
    n, rows = config.hyper_connections, geometry.hidden_rows * geometry.batch
    small = 2 * rows
    streams = n + (n + 1) + 1
    if not config.hyper_connections_static:
        streams += n
        small += 2 * rows * n + rows * (2 * n * (n + 1) + 2 * n)
    return streams * geometry.hidden_state + small * geometry.element


def _manifold_connection_bytes(config: LimeTransformerConfig, geometry: Geometry) -> int:
    """What one mHC connection keeps (its sublayer's RMSNorm is counted as LLaMA's), with ``r`` rows
    ``s_h b``, ``m = n^2 + 2n`` mappings, the activation element ``e`` and the mappings' element ``c``
    (float32, or the activations' when wider): its input streams n; when ``c > e`` their ``c`` copy
    ``[r, n h]`` and the ``c`` copy of ``mapping_proj`` ``[m, n h]``; the mappings' tensors in ``c``
    (the RMS statistics 3r, the projection and its gated product 2rm, the pre/post sigmoids 2rn, the
    gates m and the mixes rm, whose res part the Sinkhorn keeps: it recomputes its iterations);
    in ``e`` pre rn, res rn^2, post rn and the sublayer output (multiplied by post) one stream."""
    n, rows, e = config.hyper_connections, geometry.hidden_rows * geometry.batch, geometry.element
    c, m = max(e, FP32), n * n + 2 * n
    copies = (rows * n * geometry.hidden + m * n * geometry.hidden) * c if c > e else 0
    mappings = (3 * rows + 2 * rows * m + 2 * rows * n + m + rows * m) * c
    applied = rows * (2 * n + n * n) * e + geometry.hidden_state
    return n * geometry.hidden_state + copies + mappings + applied


def layer_activation_bytes(config: LimeTransformerConfig, geometry: Geometry, impl: str) -> int:
    """Bytes one transformer layer keeps for backward without full recompute (LIMe memory
    excluded); docs/estimate.md lists the terms. Hyper-Connections: two hyper-connections in place
    of the two RMSNorms (layer 0 keeps n - 1 streams less: its streams are the embedding expanded,
    ``chunk_activations`` subtracts them)."""
    if impl not in TRANSFORMER_IMPLS:
        raise ValueError(f"transformer_impl must be one of {TRANSFORMER_IMPLS}, not {impl!r}")
    g = geometry
    rope = 0 if config.apply_rope_fusion else 4 * g.seq * g.head_dim * g.element
    linear_inputs = 2 * g.hidden_state + g.heads_bytes(g.heads)  # QKV, FC1, projection
    if config.hyper_connections_manifold:
        norms = 2 * (_manifold_connection_bytes(config, g) + _norm_bytes(g, impl))
    elif config.hyper_connections:
        norms = 2 * _hyper_connection_bytes(config, g)
    else:
        norms = 2 * _norm_bytes(g, impl)
    return norms + linear_inputs + rope + _attention_bytes(config, g, impl) + _mlp_bytes(config, g)


def routing_weight_bytes(config: LimeTransformerConfig, geometry: Geometry, layers: range) -> int:
    """What the dynamic router of ``layers`` keeps: p_l ``[s, b, g_t, l + 1]`` per layer l >= 1,
    the softmax's output in float32 (at least) and, when the activations are narrower, the
    routing's copy in their dtype (0 for the static routers)."""
    if not (config.lime and config.lime_router == "dynamic"):
        return 0
    element = max(geometry.element, FP32) + (geometry.element if geometry.element < FP32 else 0)
    weights = sum(layer + 1 for layer in layers if layer > 0)
    return geometry.seq * geometry.batch * geometry.kv_heads * weights * element


def router_stack_bytes(config: LimeTransformerConfig, geometry: Geometry, layers: range) -> int:
    """Bytes of the ``RouterStack`` of the chunk of global layers ``layers`` on one rank: every
    static router's rows (all g kv heads) and this rank's columns of every source up to the
    chunk's last layer, ``[len(layers) * g, layers.stop * g_t]`` in the activation dtype; 0 for
    the baseline and the dynamic router, whose products read no stack."""
    if not config.lime or config.lime_router == "dynamic":
        return 0
    return len(layers) * config.kv_heads * layers.stop * geometry.kv_heads * geometry.element


def forward_builds_router_stack(config: LimeTransformerConfig, layers: range, block: int) -> bool:
    """Whether the forward of the chunk of ``layers`` with routing blocks of ``block`` layers
    builds its ``RouterStack`` (then every micro-batch in flight keeps one until its backward):
    some routed layer reads a source before its block (``StaticRouting.blocked``: the
    block's earlier sums are one product of the stacked routers).  Otherwise only backward builds
    it (the row gradients), for the micro-batch whose backward runs."""
    if block == 1 or not config.lime or config.lime_router == "dynamic":
        return False
    return any(
        layer > 0 and min(layer_reads(config, layer), default=layer) < consumers.start
        for consumers in chunk_blocks(layers, block)
        for layer in consumers
    )


def _recompute_groups(config: LimeTransformerConfig, layers: int) -> tuple[int, int, int]:
    """Full recompute of a chunk of ``layers`` layers: ``(kept, checkpoints, group)``, the
    layers keeping all activations, the recomputed groups (each keeps its input) and the
    layers of one group (rebuilt together in backward)."""
    if config.recompute_granularity != "full":
        return layers, 0, 0
    n = config.recompute_num_layers
    if config.recompute_method == "uniform":
        if layers % n:
            raise ValueError(
                f"uniform full recompute needs every chunk's layer count ({layers}) to be "
                f"divisible by recompute_num_layers={n} (megatron recomputes whole groups)"
            )
        return 0, layers // n, n
    recomputed = min(n, layers)  # "block": the chunk's first n layers
    return layers - recomputed, recomputed, 1 if recomputed else 0


def _embedding_bytes(config: LimeTransformerConfig, geometry: Geometry) -> int:
    """Token ids (int64) and, under tensor parallelism, the mask of ids outside the rank's
    vocabulary rows (bool)."""
    tokens = geometry.seq * geometry.batch
    return tokens * INT64 + (tokens if config.tensor_model_parallel_size > 1 else 0)


def _first_layer_streams(config: LimeTransformerConfig, geometry: Geometry, kept: bool, checkpoint: int) -> int:
    """Correction of the streams counted for layer 0 (``kept``: not recomputed; else its group's input
    ``checkpoint``): its n streams are the embedding expanded, one tensor (n - 1 fewer); mHC's mappings
    flatten that broadcast view, which copies all n even where they need no dtype copy."""
    n = config.hyper_connections
    correction = -(n - 1) * (geometry.hidden_state if kept else checkpoint)
    if config.hyper_connections_manifold and kept and geometry.element >= FP32:
        correction += n * geometry.hidden_state
    return correction


def chunk_activations(
    config: LimeTransformerConfig, geometry: Geometry, impl: str, layers: range, pre_process: bool, post_process: bool
) -> tuple[ActivationBytes, int]:
    """(bytes kept per microbatch, backward working set) of one chunk on one GPU: the chunk of
    global layers ``layers``, holding the embedding (``pre_process``) and/or the output layer
    (``post_process``).  The working set is what one micro-batch's backward builds beyond what
    it kept: one full-recompute group's activations, and the ``RouterStack`` where the forward
    did not build it (the chunk's routing block as the model picks it,
    ``routing_block.chunk_routing_block``)."""
    per_layer = layer_activation_bytes(config, geometry, impl)
    kept, checkpoints, group = _recompute_groups(config, len(layers))
    checkpoint = geometry.hidden_state
    if config.distribute_saved_activations and not config.sequence_parallel:
        checkpoint //= config.tensor_model_parallel_size
    layer_bytes = kept * per_layer + checkpoints * checkpoint * config.residual_streams
    if config.hyper_connections and pre_process:
        layer_bytes += _first_layer_streams(config, geometry, kept == len(layers), checkpoint)
    if checkpoints:  # every checkpoint also keeps the rotary frequencies [s, 1, 1, d] (one tensor)
        layer_bytes += geometry.seq * geometry.head_dim * FP32

    received = 0  # the K/V rows of the hop into this chunk, kept until its backward ends
    if not pre_process and config.lime:
        hop = hop_blocks(config, chunk_starting_at(config, layers.start))
        received = sum(len(block.layers) for block in hop) * geometry.kv_rows
    sent = 0 if post_process or config.deallocate_pipeline_outputs else geometry.hidden_state * config.residual_streams
    output = 0
    if post_process:
        loss = geometry.seq * geometry.batch * (geometry.vocab * FP32 + 1 + INT64)
        output = _norm_bytes(geometry, impl) + geometry.hidden_state + loss
    recomputed = len(layers) - kept  # block recompute: the chunk's first layers
    stack = router_stack_bytes(config, geometry, layers)
    block = chunk_routing_block(config, layers, geometry.seq, geometry.batch)
    kept_stack = stack if forward_builds_router_stack(config, layers, block) else 0
    activations = ActivationBytes(
        routing_weights=routing_weight_bytes(config, geometry, layers[recomputed:]),
        layers=layer_bytes,
        lime_memory=len(layers) * geometry.kv_rows if config.lime else 0,
        received_stage=received,
        sent_stage=sent,
        embedding=_embedding_bytes(config, geometry) if pre_process else 0,
        output=output,
        router_stack=kept_stack,
    )
    last_group = layers[max(0, recomputed - group) : recomputed]
    working = group * per_layer + routing_weight_bytes(config, geometry, last_group) + stack - kept_stack
    return activations, working
