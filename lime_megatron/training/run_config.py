"""The typed configuration of one training run: every option of ``pretrain_lime.py``, grouped.

Each group is a frozen dataclass whose fields are the options of one ``--help`` section; a field
declared with :func:`option` *is* the flag: ``arguments.build_parser`` adds ``--field-name`` from
its metadata (type, default, choices, help), the YAML key is the field name, and
:meth:`RunConfig.from_namespace` copies the parsed, validated value into the field. Adding an
option is therefore one field in one group (plus its validation rule, if it has one). Fields made
with :func:`derived` are not flags: validation fills them from the others (the data-parallel
size, the number of microbatches, the virtual pipeline size).

A field that sets a field of the model's ``TransformerConfig`` says which (``transformer=True``:
the config field of its own name; ``transformer="layernorm_epsilon"``: that one), and
:meth:`RunConfig.transformer_options` collects them all, as Megatron-LM's
``core_transformer_config_from_args`` does; ``arguments.transformer_config`` adds only the values
it computes (dtypes, the attention backend, ...).

Modules read the group they need (``run.training.lr``, ``run.parallel.tensor_model_parallel_size``)
instead of the argparse ``Namespace``.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from lime_megatron.choices import (
    ATTENTION_BACKENDS,
    DEFAULT_ROUTER,
    GENERATION_TASKS,
    INIT_STYLES,
    MACHINE_NAMES,
    ROUTER_VARIANTS,
    ROUTING_KERNELS,
    WEIGHT_DECAY_GROUPINGS,
)

if TYPE_CHECKING:
    import torch

PAPER_ROUTER_LR = 1e-2
"""Router learning rate of the paper (Table 2); the default of ``--lime-router-lr``."""

NULL_TOKENIZER = "NullTokenizer"
"""``--tokenizer-type`` of Megatron-LM's vocabulary-only tokenizer (ids ``0..--vocab-size - 1``)."""


def option(
    default: Any = None,
    *,
    type: Any = None,
    help: str | None = None,
    transformer: str | bool = False,
    **argparse_kwargs,
) -> Any:
    """A field that is also a command-line flag ``--<name-with-dashes>``; ``type=bool`` makes a
    ``--name`` / ``--no-name`` switch (default False). Other keywords go to ``add_argument``.
    ``transformer``: the ``TransformerConfig`` field the option sets (True: the one of its own name;
    see :func:`transformer_field`)."""
    if type is bool and default is None:
        default = False
    argparse_kwargs = dict(type=type, help=help, **argparse_kwargs)
    return field(default=default, metadata=dict(flag=True, transformer=transformer, argparse=argparse_kwargs))


def external(default: Any = None) -> Any:
    """A field whose flag another module defines (the tokenizer flags of
    ``lime_megatron.data.tokenizer.add_tokenizer_args``)."""
    return field(default=default, metadata=dict(flag=False))


def derived(default: Any = None, *, transformer: str | bool = False) -> Any:
    """A field filled in by validation from other options (no flag); ``transformer`` as in :func:`option`."""
    return field(default=default, metadata=dict(flag=False, derived=True, transformer=transformer))


def transformer_field(spec: dataclasses.Field) -> str | None:
    """The ``TransformerConfig`` field that the run option ``spec`` sets (None: it sets none)."""
    target = spec.metadata.get("transformer", False)
    return spec.name if target is True else target or None


@dataclass(frozen=True)
class ModelOptions:
    """The model's shape and architecture (paper Table 3)."""

    group = "model shape and architecture"

    num_layers: int | None = option(type=int, help="transformer layers", transformer=True)
    hidden_size: int | None = option(type=int, help="width of the residual stream", transformer=True)
    ffn_hidden_size: int | None = option(
        type=int, help="width of the MLP (default: 4 x --hidden-size)", transformer=True
    )
    num_attention_heads: int | None = option(type=int, help="attention (query) heads", transformer=True)
    group_query_attention: bool = option(type=bool, help="grouped-query attention; needs --num-query-groups")
    num_query_groups: int | None = option(
        type=int, help="key/value heads (default: --num-attention-heads)", transformer=True
    )
    kv_channels: int | None = option(
        type=int, help="head dimension (default: --hidden-size / --num-attention-heads)", transformer=True
    )
    seq_length: int | None = option(type=int, help="tokens per sample")
    max_position_embeddings: int | None = option(type=int, help="positions the model supports (default: --seq-length)")
    rotary_base: int = option(10000, type=int)
    norm_epsilon: float = option(1e-5, type=float, transformer="layernorm_epsilon")
    init_method_std: float = option(0.02, type=float, transformer=True)
    hidden_dropout: float = option(0.0, type=float, transformer=True)
    attention_dropout: float = option(0.0, type=float, transformer=True)
    untie_embeddings_and_output_weights: bool = option(type=bool)
    vocab_size: int | None = option(
        type=int, help="vocabulary of --mock-data / --tokenizer-type NullTokenizer (real data: the tokenizer's, padded)"
    )
    transformer_impl: str = option(
        "local",
        choices=("local", "transformer_engine"),
        help="local: megatron-only modules (CPU and GPU); transformer_engine: GPU, bf16/FP8",
        transformer=True,
    )
    attention_backend: str = option(
        "auto",
        choices=ATTENTION_BACKENDS,
        help="TransformerEngine's attention backend (megatron's config.attention_backend, "
        "which sets NVTE_FLASH_ATTN/NVTE_FUSED_ATTN): fused (cuDNN) saves the "
        "routed K/V it is given, so LIMe drops them; flash saves bshd copies; auto "
        "lets TransformerEngine choose (estimated as fused, its choice on Hopper)",
    )
    init_style: str = option(
        "megatron",
        choices=INIT_STYLES,
        help="initial weight distributions: megatron's defaults or the paper's released "
        "code (lime_megatron.models.initialization); drawn the same at every layout",
        transformer=True,
    )
    hyper_connections: int = option(
        0,
        type=int,
        help="Hyper-Connections with N residual streams (the paper's HC baseline; 0: none; needs --no-lime)",
        transformer=True,
    )
    hyper_connections_static: bool = option(
        type=bool, help="static Hyper-Connections (off: dynamic ones)", transformer=True
    )
    hyper_connections_manifold: bool = option(
        type=bool,
        help="manifold-constrained Hyper-Connections (mHC: "
        "Sinkhorn-projected residual mixing, as megatron-core "
        "main; off: the paper's dynamic HC)",
        transformer=True,
    )
    hyper_connections_sinkhorn_iterations: int = option(
        20, type=int, help="Sinkhorn-Knopp iterations of mHC", transformer=True
    )
    recompute_granularity: str | None = option(choices=("full", "selective"), transformer=True)
    recompute_method: str | None = option(choices=("uniform", "block"), transformer=True)
    recompute_num_layers: int | None = option(type=int, transformer=True)

    @property
    def max_sequence_length(self) -> int:
        """Positions the model supports (``--max-position-embeddings``, default ``--seq-length``)."""
        return self.max_position_embeddings or self.seq_length


@dataclass(frozen=True)
class LimeOptions:
    """LIMe's switches (paper §4, App. D) and the routers' optimizer group (Table 2).

    Their meaning and their defaults as model options are ``LimeTransformerConfig``'s: an option
    left at None here (not given) takes the config's default there."""

    group = "LIMe: the layer-integrated memory and its routers"

    lime: bool = option(type=bool, help="LIMe attention (without it: the LLaMA baseline)", transformer=True)
    lime_router: str | None = option(
        choices=ROUTER_VARIANTS, help=f"router variant (default: {DEFAULT_ROUTER})", transformer=True
    )
    lime_router_window: int | None = option(type=int, help="window j of the last/first routers", transformer=True)
    lime_router_lr: float | None = option(
        type=float,
        help=f"router learning rate (default: {PAPER_ROUTER_LR}, the paper's); the router schedule "
        "is the main one scaled by lime-router-lr / lr",
    )
    lime_router_weight_decay: float | None = option(type=float, help="router weight decay (default: 0)")
    lime_routing_block: int | None = option(
        type=int,
        help="routing block size B: the routing products of B "
        "consecutive layers read each source row once (1: per layer; "
        "default: the cost model of the chunk's layers on the machine of "
        "--lime-machine)",
        transformer=True,
    )
    lime_machine: str | None = option(
        choices=("auto", *MACHINE_NAMES),
        help="the machine whose figures (peak, "
        "bandwidth, host time per operator) choose the routing block size "
        "(default: auto, the GPU present, else the CPU VM's)",
        transformer=True,
    )
    lime_routing_kernel: str | None = option(
        choices=ROUTING_KERNELS,
        help="how the routing products run: triton (fused kernels), torch (operators, the "
        "reference) or auto (default: Triton on CUDA where the kernels cover the run, else torch)",
        transformer=True,
    )
    lime_recompute_routed_kv: bool = option(
        type=bool,
        help="rebuild the routed keys/values in backward instead of saving "
        "them: 2 x kv heads less saved per layer for one more router "
        "product per layer (off: saves no more than the baseline)",
        transformer=True,
    )
    lime_prune_top_p: float | None = option(
        type=float,
        help="route pruning (v1 §5.4): per consumer layer and "
        "head keep the largest routes up to this share (|weight|, or the "
        "dynamic prior) and mask the rest, at --lime-prune-iters",
        transformer=True,
    )
    lime_prune_iters: Sequence[int] | None = option(
        type=int, nargs="+", help="iterations after whose update the route masks are set (with --lime-prune-top-p)"
    )


@dataclass(frozen=True)
class ParallelOptions:
    """The parallel layout: tensor, pipeline (virtual stages, uneven split), sequence and data
    parallelism."""

    group = "parallel layout: tensor, pipeline, sequence and data parallelism"

    tensor_model_parallel_size: int = option(1, type=int, transformer=True)
    pipeline_model_parallel_size: int = option(1, type=int, transformer=True)
    num_layers_per_virtual_pipeline_stage: int | None = option(type=int)
    num_virtual_stages_per_pipeline_rank: int | None = option(type=int)
    decoder_first_pipeline_num_layers: int | None = option(type=int, transformer="num_layers_in_first_pipeline_stage")
    decoder_last_pipeline_num_layers: int | None = option(type=int, transformer="num_layers_in_last_pipeline_stage")
    sequence_parallel: bool = option(type=bool, transformer=True)
    overlap_p2p_communication: bool | None = option(
        action=argparse.BooleanOptionalAction,
        help="overlap pipeline sends/receives with compute (megatron's overlap_p2p_comm, interleaved schedule "
        "only; default: on with virtual stages)",
        transformer="overlap_p2p_comm",
    )
    use_distributed_optimizer: bool = option(type=bool)
    data_parallel_size: int | None = derived()
    """World size / (TP x PP); None for a dry run."""
    virtual_pipeline_size: int | None = derived(transformer="virtual_pipeline_model_parallel_size")
    """Virtual stages per pipeline rank (None without interleaving)."""


@dataclass(frozen=True)
class TrainingOptions:
    """Batch, length of the run, optimizer and learning-rate schedule."""

    group = "batch, length of the run, optimizer and learning-rate schedule"

    micro_batch_size: int | None = option(type=int, help="samples per forward-backward pass of one data-parallel rank")
    global_batch_size: int | None = option(
        type=int, help="samples per iteration (default: --micro-batch-size x data-parallel size)"
    )
    train_iters: int | None = option(type=int, help="iterations of the run")
    exit_interval: int | None = option(type=int, help="stop (and save) after this iteration")
    seed: int = option(1234, type=int, transformer="init_seed")
    optimizer: str = option("adam", choices=("adam", "sgd"), help="adam is AdamW (decoupled weight decay)")
    lr: float | None = option(type=float, help="peak learning rate")
    min_lr: float = option(0.0, type=float)
    lr_decay_style: str = option("linear", choices=("constant", "linear", "cosine", "inverse-square-root"))
    lr_warmup_iters: int = option(0, type=int)
    lr_warmup_init: float = option(0.0, type=float)
    lr_decay_iters: int | None = option(type=int, help="iterations of the decay (default: --train-iters)")
    weight_decay: float = option(0.01, type=float)
    weight_decay_grouping: str = option(
        "megatron",
        choices=WEIGHT_DECAY_GROUPINGS,
        help="megatron: no decay on biases and norms; official (the paper's runs): nor on the word embedding",
    )
    clip_grad: float = option(1.0, type=float)
    adam_beta1: float = option(0.9, type=float)
    adam_beta2: float = option(0.999, type=float)
    adam_eps: float = option(1e-8, type=float)
    sgd_momentum: float = option(0.9, type=float)
    num_microbatches: int | None = derived()
    """Microbatches per iteration on each data-parallel rank."""

    @property
    def last_iteration(self) -> int:
        """Where the run stops: ``--train-iters``, or ``--exit-interval`` when that is earlier."""
        return min(self.train_iters, self.exit_interval or self.train_iters)


@dataclass(frozen=True)
class PrecisionOptions:
    """Mixed precision (bf16 on CPU and GPU, fp16 on GPU) and FP8 (GPU)."""

    group = "precision: bf16 (CPU and GPU), fp16 and FP8 (GPU)"

    bf16: bool = option(type=bool, help="bfloat16 weights and compute (CPU and GPU; off: float32)", transformer=True)
    fp16: bool = option(type=bool, help="float16 weights and compute with loss scaling (GPU)", transformer=True)
    loss_scale: float | None = option(type=float, help="static fp16 loss scale (default: dynamic)")
    initial_loss_scale: float = option(2.0**32, type=float)
    min_loss_scale: float = option(1.0, type=float)
    loss_scale_window: float = option(1000, type=float)
    hysteresis: int = option(2, type=int)
    fp8_format: str | None = option(
        choices=("e4m3", "hybrid"),
        help="FP8 through TransformerEngine (needs --transformer-impl transformer_engine)",
        transformer="fp8",
    )
    fp8_recipe: str = option("delayed", choices=("delayed", "tensorwise", "mxfp8", "blockwise"), transformer=True)
    fp8_margin: int = option(0, type=int, transformer=True)
    fp8_amax_history_len: int = option(1, type=int, transformer=True)
    fp8_amax_compute_algo: str = option("most_recent", choices=("most_recent", "max"), transformer=True)

    @property
    def params_dtype(self) -> torch.dtype:
        """Parameter dtype of the run: bfloat16, float16 or float32."""
        import torch

        return torch.bfloat16 if self.bf16 else torch.float16 if self.fp16 else torch.float32


@dataclass(frozen=True)
class DataOptions:
    """Tokenizer and datasets."""

    group = "training data"

    tokenizer_type: str = external("GPT2BPETokenizer")
    tokenizer_model: str | None = external()
    vocab_file: str | None = external()
    merge_file: str | None = external()
    make_vocab_size_divisible_by: int = external(128)
    data_path: list[str] | None = option(
        nargs="+", help="dataset prefixes, optionally weighted: [w1] prefix1 [w2] prefix2 ..."
    )
    split: str = option("969,30,1", help="train,valid,test weights of --data-path")
    train_data_path: list[str] | None = option(nargs="+", help="blend of the train split (instead of --split)")
    valid_data_path: list[str] | None = option(nargs="+")
    test_data_path: list[str] | None = option(nargs="+")
    mock_data: bool = option(type=bool, help="random tokens from megatron's MockGPTDataset")
    data_cache_path: str | None = option(help="where GPTDataset index files are cached")
    eod_mask_loss: bool = option(type=bool, help="no loss on end-of-document tokens")
    sft: bool = option(
        type=bool,
        help="supervised fine-tuning on prompt/response data (preprocess_data.py "
        "--prompt-key): one example per sample, the loss on the response only",
    )


@dataclass(frozen=True)
class CheckpointOptions:
    """Saving and resuming."""

    group = "saving and resuming checkpoints"

    save: str | None = option(help="directory of the distributed checkpoints")
    load: str | None = option(help="directory to resume from (may be the same as --save)")
    save_interval: int | None = option(type=int, help="save every N iterations")
    ckpt_keep_last: int | None = option(
        type=int, help="keep only the newest N checkpoints in --save (default: keep all)"
    )
    no_load_optim: bool = option(
        False, action="store_true", help="load the model weights only (fresh optimizer and schedule)"
    )
    no_load_rng: bool = option(False, action="store_true", help="do not restore RNG states")
    finetune: bool = option(
        False,
        action="store_true",
        help="load only the model weights from --load (Megatron-LM's --finetune): fresh "
        "optimizer, schedule and RNG, iteration 0; any layout",
    )
    pretrained_checkpoint: str | None = option(
        help="weights to start from when --load holds no checkpoint yet, or without --load (Megatron-LM's "
        "name): loaded as --finetune loads, at any layout; later runs resume from --load"
    )
    exit_on_missing_checkpoint: bool = option(
        False, action="store_true", help="fail when --load holds no checkpoint (always so when --load != --save)"
    )


@dataclass(frozen=True)
class LoggingOptions:
    """Metrics sinks, evaluation and profiling."""

    group = "logging, evaluation and profiling"

    log_interval: int = option(100, type=int)
    eval_interval: int = option(1000, type=int)
    eval_iters: int = option(100, type=int, help="validation batches per evaluation")
    eval_generation_file: str | None = option(
        help="also score greedy generation on this test file at every "
        "evaluation (tools/score_generation.py's --test-file)"
    )
    eval_generation_task: str = option(
        "arithmetic", choices=GENERATION_TASKS, help="the task of --eval-generation-file"
    )
    tensorboard_dir: str | None = option()
    wandb_project: str | None = option()
    wandb_exp_name: str | None = option()
    wandb_save_dir: str | None = option()
    wandb_mode: str | None = option(
        choices=("online", "offline", "disabled"), help="wandb's mode (default: $WANDB_MODE, else online)"
    )
    metrics_file: str | None = option(help="append one JSON object per iteration to this file")
    gpu_peak_tflops: float | None = option(
        type=float, help="dense bf16 peak of one GPU for MFU (default: known devices)"
    )
    log_throughput: bool = option(
        type=bool,
        help="show tokens/s (and, on GPU, TFLOP/s per GPU and MFU) in the "
        "console line; the metrics sinks always record them",
    )
    profile: bool = option(
        type=bool,
        help="profile the iterations after --profile-step-start up to "
        "--profile-step-end (GPU: nsys ranges; see --use-pytorch-profiler)",
    )
    profile_step_start: int = option(10, type=int, help="iterations completed before profiling starts")
    profile_step_end: int = option(12, type=int, help="iteration after which profiling stops")
    profile_ranks: Sequence[int] = option((0,), type=int, nargs="+", help="global ranks that profile")
    use_pytorch_profiler: bool = option(
        type=bool, help="with --profile: a torch.profiler trace (CPU and GPU) under --profile-dir"
    )
    profile_dir: str | None = option(help="where --use-pytorch-profiler writes its trace (default: --tensorboard-dir)")

    @property
    def trace_dir(self) -> str | None:
        """Directory of the torch.profiler trace (``--profile-dir``, else ``--tensorboard-dir``)."""
        return self.profile_dir or self.tensorboard_dir


@dataclass(frozen=True)
class StepTimeOptions:
    """``--dry-run``'s step-time model of the pipeline schedule (``lime_megatron.planning.schedule_model``)."""

    group = "--dry-run's step-time model"

    compute_tflops: float = option(
        400.0, type=float, help="achieved TFLOP/s per GPU the step-time model converts FLOPs with"
    )
    link_bandwidth_gbps: float | None = option(
        type=float, help="pipeline link bandwidth in Gb/s (default: both NVLink-like 3600 and InfiniBand-like 400)"
    )
    link_latency_us: float = option(5.0, type=float, help="pipeline link latency in microseconds")


GROUPS = dict(
    model=ModelOptions,
    lime=LimeOptions,
    parallel=ParallelOptions,
    training=TrainingOptions,
    precision=PrecisionOptions,
    data=DataOptions,
    checkpointing=CheckpointOptions,
    logging=LoggingOptions,
    step_time=StepTimeOptions,
)
"""The option groups of :class:`RunConfig`, by attribute name, in ``--help`` order."""


@dataclass(frozen=True)
class RunConfig:
    """Every option of one run, validated (``arguments.parse_run``)."""

    model: ModelOptions = field(default_factory=ModelOptions)
    lime: LimeOptions = field(default_factory=LimeOptions)
    parallel: ParallelOptions = field(default_factory=ParallelOptions)
    training: TrainingOptions = field(default_factory=TrainingOptions)
    precision: PrecisionOptions = field(default_factory=PrecisionOptions)
    data: DataOptions = field(default_factory=DataOptions)
    checkpointing: CheckpointOptions = field(default_factory=CheckpointOptions)
    logging: LoggingOptions = field(default_factory=LoggingOptions)
    step_time: StepTimeOptions = field(default_factory=StepTimeOptions)
    dry_run: bool = False
    dry_run_world_size: int | None = None

    @classmethod
    def from_namespace(cls, args: argparse.Namespace) -> RunConfig:
        """The run of validated parsed arguments (each field takes the attribute of its name)."""
        groups = {
            name: group(**{f.name: getattr(args, f.name) for f in dataclasses.fields(group)})
            for name, group in GROUPS.items()
        }
        return cls(**groups, dry_run=args.dry_run, dry_run_world_size=args.dry_run_world_size)

    @classmethod
    def from_flat_dict(cls, flat: dict[str, Any]) -> RunConfig:
        """The run of :meth:`as_flat_dict`'s output (a checkpoint's saved options); options missing
        from ``flat`` keep their defaults."""
        groups = {
            name: group(**{f.name: flat[f.name] for f in dataclasses.fields(group) if f.name in flat})
            for name, group in GROUPS.items()
        }
        return cls(**groups, dry_run=flat.get("dry_run", False), dry_run_world_size=flat.get("dry_run_world_size"))

    def transformer_options(self) -> dict[str, Any]:
        """The ``TransformerConfig`` keyword arguments of the options declared with ``transformer=``,
        by config field; an option at None (not given) is left out, so the config's own default
        applies (``LimeTransformerConfig``'s ``full`` router, megatron's 4 x hidden MLP)."""
        groups = [getattr(self, name) for name in GROUPS]
        return {
            transformer_field(spec): getattr(group, spec.name)
            for group in groups
            for spec in dataclasses.fields(group)
            if transformer_field(spec) and getattr(group, spec.name) is not None
        }

    def as_flat_dict(self) -> dict[str, Any]:
        """Every option by its flag's name (``num_layers``, ``lr``, ...): for checkpoints and wandb."""
        flat = {key: value for name in GROUPS for key, value in dataclasses.asdict(getattr(self, name)).items()}
        return {**flat, "dry_run": self.dry_run, "dry_run_world_size": self.dry_run_world_size}

    @property
    def name(self) -> str:
        """``LIMe``, ``HC`` (Hyper-Connections) or ``LLaMA``."""
        return "LIMe" if self.lime.lime else "HC" if self.model.hyper_connections else "LLaMA"
