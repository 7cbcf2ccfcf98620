"""Configuration: megatron's ``TransformerConfig`` extended with the LIMe options.

``LimeTransformerConfig`` adds the switches of paper §4 and App. D on top of every megatron-core
transformer option, so one config object describes both LIMe and the LLaMA baseline
(``lime=False``).  ``llama_architecture`` fills in the paper's Table 3 architecture (RMSNorm,
SwiGLU, RoPE, no biases); ``PAPER_1B`` holds the 1B shape of Table 3.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.nn.functional as F
from megatron.core.transformer.transformer_block import get_num_layers_to_build
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from lime_megatron.choices import DEFAULT_ROUTER, ROUTING_KERNELS, LimeConfigError, validate_router


@dataclass
class LimeTransformerConfig(TransformerConfig):
    """megatron ``TransformerConfig`` plus the LIMe options (paper §4, App. D).

    ``num_query_groups`` is the number of key/value heads (GQA); it defaults to the number of
    attention heads (full MHA), as in megatron.
    """

    lime: bool = True
    """Route keys and values through the layer-integrated memory (False: LLaMA baseline)."""

    lime_router: str = DEFAULT_ROUTER
    """Router variant: one of ``lime_megatron.choices.ROUTER_VARIANTS``."""

    lime_router_window: int | None = None
    """Window j of the ``last``/``first`` variants (App. D); must be None for the others."""

    lime_recompute_routed_kv: bool = False
    """Drop the routed K/V and the rotated keys from attention's saved tensors and rebuild them in
    backward from the memory buffer (``models.lime.recompute``): 2 x kv heads fewer saved per layer,
    for one more router product per layer.  Off (default), LIMe saves no more than the baseline:
    the baseline keeps its QKV output and rotated keys, LIMe its buffer of raw K/V, the rotated keys
    and the routed values (the routed keys, a tensor of their own, only RoPE reads)."""

    lime_routing_block: int | None = None
    """Routing block size B: the routing products of B consecutive layers read each source row
    once (``lime_megatron.models.lime.routing_blocks``); 1 runs every product per layer; None
    picks B once per model chunk from the cost model of ``lime_megatron.planning.routing_block``
    (its layers, the earlier layers' rows it reads, the machine of ``lime_machine``)."""

    lime_machine: str = "auto"
    """The machine whose figures choose the routing block size: ``auto`` (the device present) or a
    key of ``planning.routing_block.MACHINES`` (``h100``, ``h200``, ``a100``, ``cpu``, ...)."""

    lime_routing_kernel: str = "auto"
    """How the routing products run: ``triton`` (fused kernels, ``lime_megatron.kernels``),
    ``torch`` (torch operators, the reference) or ``auto`` (Triton on CUDA where the kernels cover
    the run, else torch; ``kernels.routing_path.routing_kernel`` decides per model chunk)."""

    lime_prune_top_p: float | None = None
    """Route pruning (v1 §5.4, ``models.lime.pruning``): the kept share of each head's routes once
    the trainer sets the masks; None: the run does not prune (no mask in its checkpoints)."""

    lime_route_reads: tuple[tuple[int, ...], ...] | None = None
    """Not an option: after route pruning, the source layers each layer reads with some kept
    route of any head, the same on every rank (``pruning.share_route_reads`` sets it when masks are
    set or loaded; the pipeline carries only those rows).  None: every source of the variant."""

    # Initialisation (``lime_megatron.models.initialization``).
    init_style: str = "megatron"
    """Initial weight distributions: ``megatron`` (megatron's defaults) or ``official`` (the paper's
    released code); see ``lime_megatron.models.initialization.INIT_STYLES``."""

    init_seed: int = 1234
    """Seed of the layout-invariant initial weights (the run's ``--seed``)."""

    # Hyper-Connections (``lime_megatron.models.hyper_connections``), the paper's second baseline.
    hyper_connections: int = 0
    """Residual streams n of Hyper-Connections (Zhu et al. 2024; 0: off, the plain residual)."""

    hyper_connections_static: bool = False
    """Static Hyper-Connections (fixed alpha/beta) instead of the dynamic ones of the official code."""

    hyper_connections_manifold: bool = False
    """Manifold-constrained Hyper-Connections (mHC, Xie et al. 2025, as megatron-core main builds
    them): per-position mixing with a doubly stochastic residual matrix (Sinkhorn projection), the
    LLaMA norms kept; see ``lime_megatron.models.hyper_connections.manifold``."""

    hyper_connections_sinkhorn_iterations: int = 20
    """Sinkhorn-Knopp iterations of mHC's residual matrix (megatron's ``mhc_sinkhorn_iterations``)."""

    def __post_init__(self) -> None:
        validate_lime_options(self)
        super().__post_init__()
        pipeline_layer_split(self)

    @property
    def residual_streams(self) -> int:
        """Copies of the residual stream a decoder layer carries (n of Hyper-Connections, else 1):
        the factor megatron's pipeline stage tensor ``[s, b * streams, hidden]`` has on its batch."""
        return self.hyper_connections or 1

    @property
    def kv_heads(self) -> int:
        """Number of key/value heads (megatron's ``num_query_groups``)."""
        return self.num_query_groups or self.num_attention_heads


def validate_lime_options(config: LimeTransformerConfig) -> None:
    """Raise one ``LimeConfigError`` naming the first invalid LIMe option of ``config``."""
    heads = config.num_attention_heads
    kv_heads = config.num_query_groups or heads
    if kv_heads < 1 or heads % kv_heads != 0:
        raise LimeConfigError(
            f"num_query_groups (key/value heads) = {kv_heads} must divide num_attention_heads = {heads}"
        )
    validate_router(config.lime_router, config.lime_router_window)
    if config.lime_routing_block is not None and config.lime_routing_block < 1:
        raise LimeConfigError(
            f"lime_routing_block must be >= 1 (or None for the cost model), got {config.lime_routing_block}"
        )
    if config.lime_routing_kernel not in ROUTING_KERNELS:
        raise LimeConfigError(
            f"unknown lime_routing_kernel {config.lime_routing_kernel!r}; choose one of {ROUTING_KERNELS}"
        )
    validate_hyper_connections(config)
    block_recompute = config.recompute_granularity == "full" and config.recompute_method == "block"
    if config.lime and (config.lime_routing_block or 1) > 1 and block_recompute and config.recompute_num_layers:
        raise LimeConfigError(
            f"lime_routing_block {config.lime_routing_block} cannot be honoured with "
            f"recompute_method='block': it recomputes each of the first recompute_num_layers layers "
            f"on its own, and a block of routing products must lie inside one recomputed chunk; use "
            f"lime_routing_block 1 (or leave it unset) or recompute_method='uniform'"
        )
    if config.lime:
        reject_options_bypassing_lime(config)
        if config.lime_router == "dynamic":
            validate_dynamic_router(config, kv_heads)
        if config.lime_prune_top_p is not None:
            validate_pruning(config)


def validate_pruning(config: LimeTransformerConfig) -> None:
    """Route pruning needs learned routers and a kept share in (0, 1]."""
    if not 0.0 < config.lime_prune_top_p <= 1.0:
        raise LimeConfigError(f"lime_prune_top_p must be in (0, 1], got {config.lime_prune_top_p}")
    if config.lime_router == "average":
        raise LimeConfigError("route pruning needs learned routers; the average router has none")


def validate_dynamic_router(config: LimeTransformerConfig, kv_heads: int) -> None:
    """What the dynamic router does not support yet: blocked routing (its products are per
    token; B must be 1 or the cost model's choice, which is 1) and tensor parallelism beyond the
    key/value heads (each rank's logits are its own heads')."""
    if config.lime_routing_block not in (None, 1):
        raise LimeConfigError(
            f"lime_routing_block {config.lime_routing_block} is not supported with the dynamic "
            "router: its routing is per token, read once per layer (use 1 or leave it unset)"
        )
    if kv_heads % config.tensor_model_parallel_size:
        raise LimeConfigError(
            f"the dynamic router needs key/value heads ({kv_heads}) divisible by the "
            f"tensor-parallel size ({config.tensor_model_parallel_size})"
        )


def validate_hyper_connections(config: LimeTransformerConfig) -> None:
    """Hyper-Connections need n >= 1 streams, one variant, the LLaMA attention (not LIMe's), no hidden dropout
    (the official code has none) and, for selective recompute, only megatron's ``core_attn``
    (the layer's norms and MLP run inside the hyper-connections)."""
    streams = config.hyper_connections
    if streams < 0:
        raise LimeConfigError(f"hyper_connections (residual streams) must be >= 1, or 0 for none; got {streams}")
    if not streams:
        for variant in ("hyper_connections_static", "hyper_connections_manifold"):
            if getattr(config, variant):
                raise LimeConfigError(f"{variant} needs hyper_connections >= 1")
        return
    if config.hyper_connections_static and config.hyper_connections_manifold:
        raise LimeConfigError(
            "choose one Hyper-Connections variant: hyper_connections_static or hyper_connections_manifold, not both"
        )
    if config.hyper_connections_sinkhorn_iterations < 1:
        raise LimeConfigError(
            f"hyper_connections_sinkhorn_iterations must be >= 1; got {config.hyper_connections_sinkhorn_iterations}"
        )
    if config.lime:
        raise LimeConfigError("Hyper-Connections are a baseline of their own: set lime=False with hyper_connections")
    if config.hidden_dropout:
        raise LimeConfigError(
            f"Hyper-Connections are built without hidden dropout; got hidden_dropout {config.hidden_dropout}"
        )
    recomputed = set(config.recompute_modules or ["core_attn"]) - {"core_attn"}
    if config.recompute_granularity == "selective" and recomputed:
        raise LimeConfigError(f"Hyper-Connections recompute only core_attn selectively, not {sorted(recomputed)}")


OPTIONS_BYPASSING_LIME: dict[str, tuple[Any, str]] = {
    # option: (its off value, what it would do to LIMe); probed by name, so options newer than the
    # installed megatron-core (absent attributes) pass.
    "cuda_graph_impl": (
        "none",
        "CUDA-graph capture runs TransformerLayer._forward_attention directly, so the "
        "layer-integrated memory is never bound, and the memory is built per pass, not as the "
        "static buffers per micro-batch slot a replayed graph reads (docs/routing.md, 'CUDA graphs')",
    ),
    "enable_cuda_graph": (
        False,
        "CUDA-graph capture (deprecated flag of cuda_graph_impl='local') runs "
        "TransformerLayer._forward_attention directly, so the memory is never bound",
    ),
    "external_cuda_graph": (
        False,
        "CUDA-graph capture (deprecated flag of cuda_graph_impl='transformer_engine') "
        "runs TransformerLayer._forward_attention directly, so the memory is never bound",
    ),
    "overlap_moe_expert_parallel_comm": (
        False,
        "the expert-parallel overlap schedule calls "
        "TransformerLayer._forward_attention directly, so the memory is "
        "never bound",
    ),
    "context_parallel_size": (
        1,
        "context parallelism splits the sequence; the memory and the routed K/V are not split with it",
    ),
    "attention_output_gate": (False, "LimeSelfAttention does not apply the output gate"),
    "no_rope_freq": (None, "LimeSelfAttention applies RoPE on every layer"),
    "qk_clip": (
        False,
        "qk-clip rescales the query/key projections from attention logits LimeSelfAttention does "
        "not record, and routed keys are not the projections it clips",
    ),
    "fine_grained_activation_offloading": (
        False,
        "LimeSelfAttention does not offload, and the routed K/V recompute keeps its own saved tensors",
    ),
    "fused_single_qkv_rope": (
        False,
        "the fused QKV+RoPE kernel rotates the keys before the memory routes them (LIMe rotates the routed keys)",
    ),
    "multi_latent_attention": (False, "LIMe's layer spec builds LimeSelfAttention, not multi-latent attention"),
    "experimental_attention_variant": (None, "LIMe's layer spec builds LimeSelfAttention, not the variant"),
    "yarn_rotary_scaling_factor": (
        None,
        "YaRN's attention mscale is applied by megatron's SelfAttention.forward, which LimeSelfAttention replaces",
    ),
}
"""megatron-core options (0.16 to 0.19) that skip LIMe's memory binding or change attention semantics in a
way ``LimeSelfAttention.forward`` does not implement."""


def reject_options_bypassing_lime(config: TransformerConfig) -> None:
    """Raise one ``LimeConfigError`` naming the first option of ``OPTIONS_BYPASSING_LIME`` set on ``config``
    (an attribute it lacks counts as off)."""
    for option, (off, reason) in OPTIONS_BYPASSING_LIME.items():
        value = getattr(config, option, off)
        if value != off:
            raise LimeConfigError(f"{option}={value!r} is not supported with LIMe: {reason}")


def pipeline_layer_split(config: TransformerConfig) -> dict[tuple[int, int | None], range]:
    """The layers of every pipeline chunk, ``{(pipeline rank, virtual stage or None): range}``,
    by megatron's own rules (even split, ``num_layers_in_first/last_pipeline_stage``,
    ``account_for_embedding/loss_in_pipeline_split``); one ``LimeConfigError`` if the layers
    cannot be split that way."""
    stages = config.virtual_pipeline_model_parallel_size
    keys = [
        (rank, vp)
        for rank in range(config.pipeline_model_parallel_size)
        for vp in (range(stages) if stages else [None])
    ]
    try:
        split = {key: _chunk_range(config, *key) for key in keys}
    except AssertionError as error:
        # one wording on every megatron-core version (0.19 writes "config.<field>", wraps lines)
        reason = " ".join(str(error).replace("config.", "").split())
        raise LimeConfigError(f"cannot split the layers over the pipeline: {reason}") from error
    if sum(len(layers) for layers in split.values()) != config.num_layers:
        raise LimeConfigError(
            f"{config.num_layers} layers do not split over {config.pipeline_model_parallel_size} pipeline "
            f"stages x {stages or 1} virtual stages: megatron would build {[len(r) for r in split.values()]}"
        )
    return split


def _chunk_range(config: TransformerConfig, rank: int, vp_stage: int | None) -> range:
    """Global layers of pipeline rank ``rank``'s chunk ``vp_stage`` (megatron's offsets)."""
    first = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=rank)
    return range(first, first + get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=rank))


# Paper Table 3 (1B scale).  kv heads: 8 (GQA) or 32 (full MHA).
PAPER_1B: dict[str, Any] = dict(
    num_layers=16,
    hidden_size=2048,
    ffn_hidden_size=8192,
    num_attention_heads=32,
)
PAPER_VOCAB_SIZE = 50257


def llama_architecture(**overrides: Any) -> dict[str, Any]:
    """Keyword arguments for a LLaMA-style megatron config (paper Table 3).

    RMSNorm, SwiGLU MLP, no biases; RoPE and tied embeddings are model-level options (see
    ``lime_megatron.models.gpt_model``).  Fused kernels are off so the same config runs on CPU; GPU
    launches switch them on.  ``overrides`` win over every default.
    """
    arch: dict[str, Any] = dict(
        normalization="RMSNorm",
        layernorm_epsilon=1e-5,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=0.02,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
    )
    arch.update(overrides)
    return arch


def lime_config(**kwargs: Any) -> LimeTransformerConfig:
    """``LimeTransformerConfig`` with the LLaMA architecture defaults and ``kwargs`` applied."""
    return LimeTransformerConfig(**llama_architecture(**kwargs))
