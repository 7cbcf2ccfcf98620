"""Command-line arguments of ``pretrain_lime.py``: Megatron-LM's flag names plus the LIMe options.

``parse_args(argv, world_size)`` reads, in increasing priority, the defaults below, the YAML file
given with ``--config FILE.yaml`` (keys are the flag names with underscores: ``num_layers: 16``,
``lime: true``, ``data_path: [0.7, data/a, 0.3, data/b]``) and the command line. It then checks
every combination the trainer cannot run and raises one :class:`ArgumentsError` naming the
problem. ``transformer_config(args)`` turns the result into the ``LimeTransformerConfig`` of the
run (layout, precision, FP8, recompute and LIMe options included).

Boolean options can be switched both ways (``--lime`` / ``--no-lime``), so a command line can
override a config file; Megatron-LM's own negative flags (``--no-load-optim``,
``--no-load-rng``) keep their names.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Sequence

import torch
import yaml
from megatron.core.optimizer import OptimizerConfig

from lime_megatron import fusions
from lime_megatron.compat import cpu_config_overrides
from lime_megatron.config import ROUTER_VARIANTS, WINDOWED_VARIANTS, LimeConfigError, lime_config
from lime_megatron.optimizer import LRSchedule, RouterGroup
from lime_megatron.tokenizer import add_tokenizer_args

PAPER_ROUTER_LR = 1e-2
"""Router learning rate of the paper (Table 2); the default of ``--lime-router-lr``."""

REQUIRED = ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size",
            "train_iters", "lr")
"""Options every training run must set (on the command line or in the config file)."""

MODEL_SHAPE_KEYS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                    "num_query_groups", "kv_channels", "lime", "lime_router", "lime_router_window",
                    "untie_embeddings_and_output_weights")
"""Options that fix the shapes of the model's weights (a checkpoint must agree on all of them)."""


class UsageError(Exception):
    """A problem with how the trainer was invoked or with its inputs; printed as one line."""


class ArgumentsError(UsageError):
    """An invalid option, option value or combination of options."""


class _Parser(argparse.ArgumentParser):
    """``ArgumentParser`` that raises :class:`ArgumentsError` instead of exiting."""

    def error(self, message):
        raise ArgumentsError(message)


def _flag(parser, name: str, **kwargs) -> None:
    """Add ``--name``; booleans (``kwargs['type'] is bool``) get ``--name`` / ``--no-name``."""
    if kwargs.get("type") is bool:
        kwargs.pop("type")
        kwargs.setdefault("default", False)
        parser.add_argument(f"--{name}", action=argparse.BooleanOptionalAction, **kwargs)
    else:
        parser.add_argument(f"--{name}", **kwargs)


def _model_args(parser) -> None:
    group = parser.add_argument_group("model")
    _flag(group, "num-layers", type=int)
    _flag(group, "hidden-size", type=int)
    _flag(group, "ffn-hidden-size", type=int, help="default 4 * hidden size")
    _flag(group, "num-attention-heads", type=int)
    _flag(group, "group-query-attention", type=bool,
          help="grouped-query attention; needs --num-query-groups")
    _flag(group, "num-query-groups", type=int, help="key/value heads (default: attention heads)")
    _flag(group, "kv-channels", type=int, help="head dimension (default hidden / heads)")
    _flag(group, "seq-length", type=int)
    _flag(group, "max-position-embeddings", type=int, help="default: --seq-length")
    _flag(group, "rotary-base", type=int, default=10000)
    _flag(group, "norm-epsilon", type=float, default=1e-5)
    _flag(group, "init-method-std", type=float, default=0.02)
    _flag(group, "hidden-dropout", type=float, default=0.0)
    _flag(group, "attention-dropout", type=float, default=0.0)
    _flag(group, "untie-embeddings-and-output-weights", type=bool)
    _flag(group, "vocab-size", type=int,
          help="vocabulary of --mock-data (real data: the tokenizer's, padded)")
    _flag(group, "transformer-impl", default="local", choices=("local", "transformer_engine"),
          help="local: megatron-only modules (CPU and GPU); transformer_engine: GPU, bf16/FP8")
    _flag(group, "recompute-granularity", choices=("full", "selective"))
    _flag(group, "recompute-method", choices=("uniform", "block"))
    _flag(group, "recompute-num-layers", type=int)


def _lime_args(parser) -> None:
    group = parser.add_argument_group("LIMe")
    _flag(group, "lime", type=bool, help="LIMe attention (without it: the LLaMA baseline)")
    _flag(group, "lime-router", choices=ROUTER_VARIANTS, help="router variant (default full)")
    _flag(group, "lime-router-window", type=int, help="window j of the last/first routers")
    _flag(group, "lime-router-lr", type=float,
          help=f"router learning rate (default {PAPER_ROUTER_LR}, the paper's); the router "
               "schedule is the main one scaled by lime-router-lr / lr")
    _flag(group, "lime-router-weight-decay", type=float, help="router weight decay (default 0)")
    _flag(group, "lime-recompute-routed-kv", type=bool, default=True,
          help="recompute the routed keys/values in backward instead of saving them")


def _parallel_args(parser) -> None:
    group = parser.add_argument_group("parallelism")
    _flag(group, "tensor-model-parallel-size", type=int, default=1)
    _flag(group, "pipeline-model-parallel-size", type=int, default=1)
    _flag(group, "num-layers-per-virtual-pipeline-stage", type=int)
    _flag(group, "num-virtual-stages-per-pipeline-rank", type=int)
    _flag(group, "decoder-first-pipeline-num-layers", type=int)
    _flag(group, "decoder-last-pipeline-num-layers", type=int)
    _flag(group, "sequence-parallel", type=bool)
    _flag(group, "use-distributed-optimizer", type=bool)


def _training_args(parser) -> None:
    group = parser.add_argument_group("training")
    _flag(group, "micro-batch-size", type=int)
    _flag(group, "global-batch-size", type=int, help="default: micro batch x data-parallel size")
    _flag(group, "train-iters", type=int)
    _flag(group, "exit-interval", type=int, help="stop (and save) after this iteration")
    _flag(group, "seed", type=int, default=1234)
    _flag(group, "optimizer", default="adam", choices=("adam", "sgd"),
          help="adam is AdamW (decoupled weight decay)")
    _flag(group, "lr", type=float)
    _flag(group, "min-lr", type=float, default=0.0)
    _flag(group, "lr-decay-style", default="linear",
          choices=("constant", "linear", "cosine", "inverse-square-root"))
    _flag(group, "lr-warmup-iters", type=int, default=0)
    _flag(group, "lr-warmup-init", type=float, default=0.0)
    _flag(group, "lr-decay-iters", type=int, help="default: --train-iters")
    _flag(group, "weight-decay", type=float, default=0.01)
    _flag(group, "clip-grad", type=float, default=1.0)
    _flag(group, "adam-beta1", type=float, default=0.9)
    _flag(group, "adam-beta2", type=float, default=0.999)
    _flag(group, "adam-eps", type=float, default=1e-8)
    _flag(group, "sgd-momentum", type=float, default=0.9)


def _precision_args(parser) -> None:
    group = parser.add_argument_group("mixed precision (GPU)")
    _flag(group, "bf16", type=bool)
    _flag(group, "fp16", type=bool)
    _flag(group, "loss-scale", type=float, help="static fp16 loss scale (default: dynamic)")
    _flag(group, "initial-loss-scale", type=float, default=2.0**32)
    _flag(group, "min-loss-scale", type=float, default=1.0)
    _flag(group, "loss-scale-window", type=float, default=1000)
    _flag(group, "hysteresis", type=int, default=2)
    _flag(group, "fp8-format", choices=("e4m3", "hybrid"),
          help="FP8 through TransformerEngine (needs --transformer-impl transformer_engine)")
    _flag(group, "fp8-recipe", default="delayed",
          choices=("delayed", "tensorwise", "mxfp8", "blockwise"))
    _flag(group, "fp8-margin", type=int, default=0)
    _flag(group, "fp8-amax-history-len", type=int, default=1)
    _flag(group, "fp8-amax-compute-algo", default="most_recent", choices=("most_recent", "max"))


def _data_args(parser) -> None:
    group = add_tokenizer_args(parser)
    group = parser.add_argument_group("data")
    _flag(group, "data-path", nargs="+",
          help="dataset prefixes, optionally weighted: [w1] prefix1 [w2] prefix2 ...")
    _flag(group, "split", default="969,30,1", help="train,valid,test weights of --data-path")
    _flag(group, "train-data-path", nargs="+", help="blend of the train split (instead of --split)")
    _flag(group, "valid-data-path", nargs="+")
    _flag(group, "test-data-path", nargs="+")
    _flag(group, "mock-data", type=bool, help="random tokens from megatron's MockGPTDataset")
    _flag(group, "data-cache-path", help="where GPTDataset index files are cached")
    _flag(group, "eod-mask-loss", type=bool, help="no loss on end-of-document tokens")


def _checkpoint_args(parser) -> None:
    group = parser.add_argument_group("checkpointing")
    _flag(group, "save", help="directory of the distributed checkpoints")
    _flag(group, "load", help="directory to resume from (may be the same as --save)")
    _flag(group, "save-interval", type=int, help="save every N iterations")
    _flag(group, "ckpt-keep-last", type=int,
          help="keep only the newest N checkpoints in --save (default: keep all)")
    group.add_argument("--no-load-optim", action="store_true",
                       help="load the model weights only (fresh optimizer and schedule)")
    group.add_argument("--no-load-rng", action="store_true", help="do not restore RNG states")
    group.add_argument("--exit-on-missing-checkpoint", action="store_true",
                       help="fail when --load holds no checkpoint (always so when --load != --save)")


def _logging_args(parser) -> None:
    group = parser.add_argument_group("logging and evaluation")
    _flag(group, "log-interval", type=int, default=100)
    _flag(group, "eval-interval", type=int, default=1000)
    _flag(group, "eval-iters", type=int, default=100, help="validation batches per evaluation")
    _flag(group, "tensorboard-dir")
    _flag(group, "wandb-project")
    _flag(group, "wandb-exp-name")
    _flag(group, "wandb-save-dir")
    _flag(group, "wandb-mode", choices=("online", "offline", "disabled"),
          help="default: $WANDB_MODE, else online")
    _flag(group, "metrics-file", help="append one JSON object per iteration to this file")
    _flag(group, "gpu-peak-tflops", type=float,
          help="dense bf16 peak of one GPU for MFU (default: known devices)")


def build_parser() -> argparse.ArgumentParser:
    """The trainer's argument parser (raises :class:`ArgumentsError` on bad input)."""
    parser = _Parser(prog="pretrain_lime.py", description="Pretrain LIMe or LLaMA on megatron-core.")
    parser.add_argument("--config", help="YAML file of options; the command line overrides it")
    parser.add_argument("--dry-run", action="store_true",
                        help="print parameters, FLOPs and memory per GPU for the layout; no training")
    parser.add_argument("--dry-run-world-size", type=int,
                        help="GPUs assumed by --dry-run (default $WORLD_SIZE, else TP x PP)")
    for add in (_model_args, _lime_args, _parallel_args, _training_args, _precision_args,
                _data_args, _checkpoint_args, _logging_args):
        add(parser)
    return parser


# --------------------------------------------------------------------------- config files


DATA_SOURCES = ("data_path", "train_data_path", "valid_data_path", "test_data_path", "mock_data")
"""Options that choose the data; one given on the command line replaces all of the file's."""


def _yaml_tokens(parser: argparse.ArgumentParser, path: str, skip=()) -> list[str]:
    """Command-line tokens equivalent to the YAML config ``path`` (keys in ``skip`` left out)."""
    try:
        with open(path, encoding="utf-8") as handle:
            values = yaml.safe_load(handle)
    except OSError as error:
        raise ArgumentsError(f"cannot read config file {path}: {error.strerror}") from None
    except yaml.YAMLError as error:
        raise ArgumentsError(f"config file {path} is not valid YAML: {error}") from None
    if values is None:
        return []
    if not isinstance(values, dict):
        raise ArgumentsError(f"config file {path} must hold a mapping of option: value")
    actions = {action.dest: action for action in parser._actions if action.option_strings}
    tokens = []
    for key, value in values.items():
        action = actions.get(key)
        if action is None or key in ("config", "help"):
            raise ArgumentsError(
                f"config file {path}: unknown option {key!r} (keys are flag names with "
                "underscores, e.g. num_layers)")
        if key not in skip:
            tokens += _tokens_of(action, value, path, key)
    return tokens


def _tokens_of(action: argparse.Action, value: Any, path: str, key: str) -> list[str]:
    """The command-line tokens that set ``action`` to the YAML ``value``."""
    flag = action.option_strings[0]
    if isinstance(action, argparse.BooleanOptionalAction) or isinstance(
            action, argparse._StoreTrueAction):
        if not isinstance(value, bool):
            raise ArgumentsError(f"config file {path}: {key} must be true or false, got {value!r}")
        if isinstance(action, argparse._StoreTrueAction):
            return [flag] if value else []
        return [flag if value else f"--no-{flag[2:]}"]
    if value is None:
        return []
    if isinstance(value, list):
        if action.nargs != "+":
            raise ArgumentsError(f"config file {path}: {key} takes one value, got a list")
        return [flag, *map(str, value)]
    return [flag, str(value)]


def _parse(parser: argparse.ArgumentParser, tokens: list[str], where: str) -> argparse.Namespace:
    try:
        return parser.parse_args(tokens)
    except ArgumentsError as error:
        raise ArgumentsError(f"{where}: {error}") from None


def parse_args(argv: Sequence[str] | None = None, world_size: int | None = None) -> argparse.Namespace:
    """Defaults < ``--config`` file < command line, validated for a world of ``world_size``
    processes (default ``$WORLD_SIZE``, else 1). A data source on the command line replaces the
    file's (``--mock-data`` for a file with ``data_path``). Raises :class:`ArgumentsError`."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    command_line = _parse(parser, argv, "command line")
    tokens = []
    if command_line.config:
        data_given = any(getattr(command_line, key) for key in DATA_SOURCES)
        tokens = _yaml_tokens(parser, command_line.config, DATA_SOURCES if data_given else ())
        _parse(parser, tokens, f"config file {command_line.config}")
    args = _parse(parser, tokens + argv, "command line")
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", 1))
    validate(args, world_size)
    return args


# --------------------------------------------------------------------------- validation


def validate(args: argparse.Namespace, world_size: int) -> None:
    """Fill derived options in ``args`` and raise :class:`ArgumentsError` for the first invalid
    combination. Sets ``data_parallel_size`` (None for a dry run without a world),
    ``num_microbatches``, ``virtual_pipeline_size`` and the resolved LIMe router options."""
    if args.dry_run:
        world_size = args.dry_run_world_size or int(os.environ.get(
            "WORLD_SIZE", args.tensor_model_parallel_size * args.pipeline_model_parallel_size))
    missing = [f"--{name.replace('_', '-')}" for name in REQUIRED
               if getattr(args, name) is None and not (args.dry_run and name in ("train_iters", "lr"))]
    if missing:
        raise ArgumentsError(f"missing required option(s): {', '.join(missing)}")
    for check in (_check_positive, _check_layout, _check_batch, _check_lime, _check_precision,
                  _check_schedule, _check_data, _check_checkpointing):
        check(args, world_size)


def _check_positive(args, world_size) -> None:
    for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                 "micro_batch_size", "train_iters", "tensor_model_parallel_size",
                 "pipeline_model_parallel_size", "log_interval", "eval_interval"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ArgumentsError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    for name in ("eval_iters", "lr_warmup_iters"):
        if getattr(args, name) < 0:
            raise ArgumentsError(f"--{name.replace('_', '-')} must be >= 0")
    if args.group_query_attention and args.num_query_groups is None:
        raise ArgumentsError("--group-query-attention needs --num-query-groups")


def _check_layout(args, world_size) -> None:
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if world_size % (tp * pp):
        raise ArgumentsError(
            f"world size {world_size} is not divisible by tensor x pipeline parallel size "
            f"{tp} x {pp}")
    args.data_parallel_size = world_size // (tp * pp)
    if args.make_vocab_size_divisible_by % tp:
        raise ArgumentsError(
            f"--make-vocab-size-divisible-by {args.make_vocab_size_divisible_by} must be divisible "
            f"by --tensor-model-parallel-size {tp} (the padded vocabulary is split over TP ranks)")
    if args.sequence_parallel and tp == 1:
        raise ArgumentsError("--sequence-parallel needs --tensor-model-parallel-size > 1")
    per_stage, per_rank = (args.num_layers_per_virtual_pipeline_stage,
                           args.num_virtual_stages_per_pipeline_rank)
    if per_stage is not None and per_rank is not None:
        raise ArgumentsError("give one of --num-layers-per-virtual-pipeline-stage and "
                             "--num-virtual-stages-per-pipeline-rank, not both")
    if per_stage is not None:
        if args.num_layers % (per_stage * pp):
            raise ArgumentsError(
                f"--num-layers {args.num_layers} is not divisible by "
                f"--num-layers-per-virtual-pipeline-stage {per_stage} x pipeline size {pp}")
        per_rank = args.num_layers // (per_stage * pp)
    args.virtual_pipeline_size = per_rank if per_rank and per_rank > 1 else None
    if (per_stage is not None or per_rank is not None) and pp == 1:
        raise ArgumentsError("virtual pipeline stages need --pipeline-model-parallel-size > 1")
    uneven = (args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers)
    if any(n is not None for n in uneven) and pp == 1:
        raise ArgumentsError("--decoder-first/last-pipeline-num-layers need pipeline parallelism")
    if args.use_distributed_optimizer and args.optimizer != "adam":
        raise ArgumentsError("--use-distributed-optimizer supports only --optimizer adam")


def _check_batch(args, world_size) -> None:
    dp, mbs = args.data_parallel_size, args.micro_batch_size
    if args.global_batch_size is None:
        args.global_batch_size = mbs * dp
    if args.global_batch_size % (mbs * dp):
        raise ArgumentsError(
            f"--global-batch-size {args.global_batch_size} is not divisible by micro batch size "
            f"{mbs} x data-parallel size {dp}")
    args.num_microbatches = args.global_batch_size // (mbs * dp)
    if args.exit_interval is not None and args.exit_interval < 1:
        raise ArgumentsError("--exit-interval must be >= 1")


def _check_lime(args, world_size) -> None:
    given = [name for name in ("lime_router", "lime_router_window", "lime_router_lr",
                               "lime_router_weight_decay") if getattr(args, name) is not None]
    if not args.lime:
        if given:
            options = ", ".join("--" + name.replace("_", "-") for name in given)
            raise ArgumentsError(f"{options} only apply to LIMe: add --lime (or drop them)")
        return
    args.lime_router = args.lime_router or "full"
    if args.lime_router in WINDOWED_VARIANTS and args.lime_router_window is None:
        raise ArgumentsError(f"--lime-router {args.lime_router} needs --lime-router-window")
    if args.lime_router not in WINDOWED_VARIANTS and args.lime_router_window is not None:
        raise ArgumentsError(
            f"--lime-router-window applies to the {'/'.join(WINDOWED_VARIANTS)} routers, "
            f"not to {args.lime_router}")
    if args.lime_router_lr is None:
        args.lime_router_lr = PAPER_ROUTER_LR
    if args.lime_router_weight_decay is None:
        args.lime_router_weight_decay = 0.0
    if args.lime_router_weight_decay > 0 and args.weight_decay == 0:
        raise ArgumentsError(
            "--lime-router-weight-decay > 0 needs --weight-decay > 0 (megatron scales the decay "
            "of a parameter group relative to --weight-decay)")


def _check_precision(args, world_size) -> None:
    if args.bf16 and args.fp16:
        raise ArgumentsError("choose one of --bf16 and --fp16")
    cuda = torch.cuda.is_available() or args.dry_run
    if (args.bf16 or args.fp16) and not cuda:
        raise ArgumentsError("--bf16/--fp16 need a CUDA GPU (CPU runs train in float32)")
    if args.transformer_impl == "transformer_engine" and not cuda:
        raise ArgumentsError("--transformer-impl transformer_engine needs a CUDA GPU")
    if args.fp8_format is not None:
        if args.transformer_impl != "transformer_engine":
            raise ArgumentsError("--fp8-format needs --transformer-impl transformer_engine")
        if not (args.bf16 or args.fp16):
            raise ArgumentsError("--fp8-format needs --bf16 or --fp16 for the non-FP8 parts")


def _check_schedule(args, world_size) -> None:
    if args.dry_run:
        return
    decay = args.lr_decay_iters if args.lr_decay_iters is not None else args.train_iters
    args.lr_decay_iters = decay
    if args.lr_warmup_iters >= decay:
        raise ArgumentsError(
            f"--lr-warmup-iters {args.lr_warmup_iters} must be smaller than the decay length "
            f"{decay} (--lr-decay-iters, default --train-iters)")
    if not 0 <= args.min_lr <= args.lr:
        raise ArgumentsError(f"--min-lr {args.min_lr} must lie in [0, --lr {args.lr}]")
    if args.lr_warmup_init > args.lr:
        raise ArgumentsError("--lr-warmup-init must not exceed --lr")


def _check_data(args, world_size) -> None:
    per_split = [args.train_data_path, args.valid_data_path, args.test_data_path]
    sources = sum([args.mock_data, args.data_path is not None, any(p is not None for p in per_split)])
    if args.dry_run:
        return
    if sources != 1:
        raise ArgumentsError(
            "give exactly one data source: --data-path, --train-data-path (with optional "
            "--valid-data-path/--test-data-path) or --mock-data")
    if args.train_data_path is None and any(p is not None for p in per_split):
        raise ArgumentsError("--valid-data-path/--test-data-path need --train-data-path")
    if args.vocab_size is not None and not args.mock_data:
        raise ArgumentsError("--vocab-size sets the --mock-data vocabulary; with real data the "
                             "tokenizer decides it")
    for path in [args.data_path] + per_split:
        if path is not None:
            parse_blend(path)


def parse_blend(tokens: Sequence[str]) -> tuple[list[str], list[float] | None]:
    """Megatron-LM's blend syntax ``[w1] prefix1 [w2] prefix2 ...`` -> (prefixes, weights or
    None). Raises :class:`ArgumentsError` when weights are given for some prefixes only."""
    tokens = list(tokens)
    numbers = [_as_float(token) for token in tokens]
    if all(number is None for number in numbers):
        return tokens, None
    pairs = len(tokens) % 2 == 0 and all(
        (number is None) == (i % 2 == 1) for i, number in enumerate(numbers))
    if not pairs:
        raise ArgumentsError(
            f"data path {' '.join(tokens)!r}: give either prefixes only or weight/prefix pairs")
    weights = numbers[::2]
    if any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ArgumentsError(f"data path weights must be >= 0 with a positive sum, got {weights}")
    return tokens[1::2], weights


def _as_float(token: str) -> float | None:
    try:
        return float(token)
    except ValueError:
        return None


def _check_checkpointing(args, world_size) -> None:
    if args.save_interval is not None:
        if args.save is None:
            raise ArgumentsError("--save-interval needs --save")
        if args.save_interval < 1:
            raise ArgumentsError("--save-interval must be >= 1")
    if args.ckpt_keep_last is not None:
        if args.save is None:
            raise ArgumentsError("--ckpt-keep-last needs --save")
        if args.ckpt_keep_last < 1:
            raise ArgumentsError("--ckpt-keep-last must be >= 1")


# --------------------------------------------------------------------------- model config


def params_dtype(args: argparse.Namespace) -> torch.dtype:
    """Parameter dtype of the run: bfloat16, float16 or float32."""
    return torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32


def transformer_config(args: argparse.Namespace):
    """The run's ``LimeTransformerConfig``: LLaMA architecture, layout, precision, FP8, recompute
    and LIMe options (CPU overrides merged), fused kernels as ``lime_megatron.fusions`` decides. Raises :class:`ArgumentsError` for shapes or
    layouts megatron or LIMe reject."""
    dtype = params_dtype(args)
    kwargs = dict(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size or 4 * args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        kv_channels=args.kv_channels,
        layernorm_epsilon=args.norm_epsilon,
        init_method_std=args.init_method_std,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_size,
        num_layers_in_first_pipeline_stage=args.decoder_first_pipeline_num_layers,
        num_layers_in_last_pipeline_stage=args.decoder_last_pipeline_num_layers,
        sequence_parallel=args.sequence_parallel,
        bf16=args.bf16,
        fp16=args.fp16,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        autocast_dtype=dtype,
        recompute_granularity=args.recompute_granularity,
        recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers,
        use_cpu_initialization=not torch.cuda.is_available(),
        transformer_impl=args.transformer_impl,
        lime=args.lime,
        lime_router=args.lime_router or "full",
        lime_router_window=args.lime_router_window,
        lime_recompute_routed_kv=args.lime_recompute_routed_kv,
        **_fp8_options(args),
        **cpu_config_overrides(),
    )
    try:
        config = lime_config(**kwargs)
    except (LimeConfigError, ValueError, AssertionError) as error:
        raise ArgumentsError(f"invalid model configuration: {error}") from None
    return fusions.run_choices(args).apply(config)


def optimizer_config(args: argparse.Namespace) -> OptimizerConfig:
    """megatron ``OptimizerConfig`` from the training flags (Adam is AdamW)."""
    return OptimizerConfig(
        optimizer=args.optimizer, lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
        sgd_momentum=args.sgd_momentum, clip_grad=args.clip_grad, bf16=args.bf16, fp16=args.fp16,
        params_dtype=params_dtype(args), loss_scale=args.loss_scale,
        initial_loss_scale=args.initial_loss_scale, min_loss_scale=args.min_loss_scale,
        loss_scale_window=args.loss_scale_window, hysteresis=args.hysteresis,
        use_distributed_optimizer=args.use_distributed_optimizer,
    )


def router_group(args: argparse.Namespace) -> RouterGroup | None:
    """The LIMe routers' parameter group (None for the LLaMA baseline)."""
    return RouterGroup(args.lime_router_lr, args.lime_router_weight_decay) if args.lime else None


def lr_schedule(args: argparse.Namespace) -> LRSchedule:
    """The learning-rate schedule of the training flags."""
    return LRSchedule(max_lr=args.lr, decay_iters=args.lr_decay_iters, train_iters=args.train_iters,
                      min_lr=args.min_lr, init_lr=args.lr_warmup_init, warmup_iters=args.lr_warmup_iters,
                      decay_style=args.lr_decay_style, weight_decay=args.weight_decay)


def _fp8_options(args) -> dict:
    if args.fp8_format is None:
        return {}
    return dict(fp8=args.fp8_format, fp8_recipe=args.fp8_recipe, fp8_margin=args.fp8_margin,
                fp8_amax_history_len=args.fp8_amax_history_len,
                fp8_amax_compute_algo=args.fp8_amax_compute_algo)
