"""Command-line arguments of ``pretrain_lime.py``: Megatron-LM's flag names plus the LIMe options.

The flags are declared once, as the fields of the option groups in ``lime_megatron.training.run_config``
(:func:`build_parser` adds one flag per field). ``parse_args(argv, world_size)`` reads, in
increasing priority, their defaults, the YAML file given with ``--config FILE.yaml`` (keys are the
flag names with underscores: ``num_layers: 16``, ``lime: true``, ``data_path: [0.7, data/a, 0.3,
data/b]``) and the command line. It then checks every combination the trainer cannot run and
raises one :class:`ArgumentsError` naming the problem. ``parse_run`` returns the result as the
typed ``RunConfig``; ``transformer_config(run)`` turns that into the ``LimeTransformerConfig`` of
the run (layout, precision, FP8, recompute and LIMe options included).

Boolean options can be switched both ways (``--lime`` / ``--no-lime``), so a command line can
override a config file; Megatron-LM's own negative flags (``--no-load-optim``,
``--no-load-rng``) keep their names. An empty value on the command line (``--save ""``,
``--save-interval ""``) sets an option back to its default: it turns a config file's setting
off. As in Megatron-LM, a flag is never abbreviated; an unknown one is answered with the closest
known flag.

Parsing and validation import neither torch nor megatron-core (torch only to ask for CUDA where
an option needs a GPU), so that ``--help`` and a wrong option or data path are answered before the
trainer is imported; :func:`transformer_config` imports the model code it builds.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import sys
from collections.abc import Sequence
from typing import Any

import yaml

from lime_megatron.choices import DEFAULT_ROUTER, LimeConfigError, validate_router
from lime_megatron.data.tokenizer import add_tokenizer_args
from lime_megatron.training.run_config import (
    GROUPS,
    NULL_TOKENIZER,
    PAPER_ROUTER_LR,
    DataOptions,
    RunConfig,
)

REQUIRED = ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size", "train_iters", "lr")
"""Options every training run must set (on the command line or in the config file)."""

NOT_REQUIRED_FOR_DRY_RUN = ("train_iters", "lr")
"""The options of ``REQUIRED`` a ``--dry-run`` (which trains nothing) does without."""

DESCRIPTION = """Pretrain LIMe or LLaMA on megatron-core. Options marked required must be set on the
command line or in the --config file, and so must one data source (--data-path, --train-data-path
or --mock-data); the command line overrides the file."""


class UsageError(Exception):
    """A problem with how the trainer was invoked or with its inputs; printed as one line."""


class ArgumentsError(UsageError):
    """An invalid option, option value or combination of options."""


class _Parser(argparse.ArgumentParser):
    """``ArgumentParser`` that raises :class:`ArgumentsError` instead of exiting."""

    def error(self, message):
        raise ArgumentsError(message)


def _option_strings(parser: argparse.ArgumentParser) -> list[str]:
    """Every flag of ``parser`` and of its subcommands' parsers."""
    strings: list[str] = []
    for action in parser._actions:
        strings += action.option_strings
        if isinstance(action.choices, dict):  # subcommands: their parsers by name
            strings += [string for sub in action.choices.values() for string in _option_strings(sub)]
    return strings


def did_you_mean(unknown: str, known: Sequence[str]) -> str:
    """``"; did you mean X?"`` with the entry of ``known`` closest to ``unknown``, or ``""``
    when none is close."""
    close = difflib.get_close_matches(unknown, known, n=1)
    return f"; did you mean {close[0]}?" if close else ""


def unrecognized_arguments(parser: argparse.ArgumentParser, unknown: list[str]) -> str:
    """argparse's message for the ``unknown`` tokens, with the flag closest to the first unknown
    flag among them."""
    flags = [token.split("=", 1)[0] for token in unknown if token.startswith("-")]
    hint = did_you_mean(flags[0], _option_strings(parser)) if flags else ""
    return f"unrecognized arguments: {' '.join(unknown)}{hint}"


class CommandParser(argparse.ArgumentParser):
    """The other commands' parser (``lime_megatron.cli``): argparse's, with an unknown argument
    reported as the trainer's are, the closest known flag named (exit status 2)."""

    def parse_args(self, args: Sequence[str] | None = None, namespace=None):  # type: ignore[override]
        parsed, unknown = self.parse_known_args(args, namespace)
        if unknown:
            self.error(unrecognized_arguments(self, unknown))
        return parsed


def _add_flag(group, spec: dataclasses.Field) -> None:
    """Add the flag of the :func:`run_config.option` field ``spec`` to ``group``; booleans
    (``type=bool``) get ``--name`` / ``--no-name``."""
    kwargs = {key: value for key, value in spec.metadata["argparse"].items() if value is not None}
    flag = f"--{spec.name.replace('_', '-')}"
    if kwargs.get("type") is bool:
        kwargs.pop("type")
        group.add_argument(flag, action=argparse.BooleanOptionalAction, default=spec.default, **kwargs)
    else:
        group.add_argument(flag, default=spec.default, **kwargs)


def _add_group(parser, options: type[Any]) -> None:
    """One ``--help`` section with the flags of the option group ``options`` (a dataclass of
    ``GROUPS``, its class attribute ``group`` the section's title)."""
    if options is DataOptions:
        tokenizer_flags = add_tokenizer_args(parser)
        tokenizer_type = next(action for action in tokenizer_flags._group_actions if action.dest == "tokenizer_type")
        tokenizer_type.choices = [*tokenizer_type.choices, NULL_TOKENIZER]
    group = parser.add_argument_group(options.group)
    for spec in dataclasses.fields(options):
        if spec.metadata.get("flag"):
            _add_flag(group, spec)


def build_parser() -> argparse.ArgumentParser:
    """The trainer's argument parser (raises :class:`ArgumentsError` on bad input)."""
    parser = _Parser(prog="pretrain_lime.py", description=DESCRIPTION, allow_abbrev=False)
    run = parser.add_argument_group("config file and dry run")
    run.add_argument("--config", help="YAML file of options; the command line overrides it")
    run.add_argument(
        "--dry-run", action="store_true", help="print parameters, FLOPs and memory per GPU for the layout; no training"
    )
    run.add_argument(
        "--dry-run-world-size", type=int, help="GPUs assumed by --dry-run (default: $WORLD_SIZE, else TP x PP)"
    )
    for options in GROUPS.values():
        _add_group(parser, options)
    for action in parser._actions:
        action.help = _help_of(action)
    return parser


def _help_of(action: argparse.Action) -> str | None:
    """``action``'s help followed by ``(required)`` for the options of ``REQUIRED`` and by
    ``(default: X)`` where the option has a default; not for flags that only switch on
    (``store_true``, whose ``const`` is True: ``--dry-run`` given means on)."""
    if action.dest in REQUIRED:
        note = "required, but not with --dry-run" if action.dest in NOT_REQUIRED_FOR_DRY_RUN else "required"
    elif action.default is None or action.default is argparse.SUPPRESS or action.const is not None:
        return action.help
    elif action.help and "%(default)" in action.help:  # argparse's BooleanOptionalAction adds it (Python < 3.13)
        return action.help
    else:
        default = action.default
        text = " ".join(map(str, default)) if isinstance(default, list | tuple) else str(default)
        note = "default: " + text.replace("%", "%%")
    return f"{action.help} ({note})" if action.help else note


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
            keys = [dest for dest in actions if dest not in ("config", "help")]
            raise ArgumentsError(
                f"config file {path}: unknown option {key!r} (keys are flag names with underscores, e.g. "
                f"num_layers){did_you_mean(key, keys)}"
            )
        if key not in skip:
            tokens += _tokens_of(action, value, path, key)
    return tokens


def _tokens_of(action: argparse.Action, value: Any, path: str, key: str) -> list[str]:
    """The command-line tokens that set ``action`` to the YAML ``value``."""
    flag = action.option_strings[0]
    if isinstance(action, argparse.BooleanOptionalAction) or isinstance(action, argparse._StoreTrueAction):
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
        args, unknown = parser.parse_known_args(tokens)
        if unknown:
            raise ArgumentsError(unrecognized_arguments(parser, unknown))
    except ArgumentsError as error:
        raise ArgumentsError(f"{where}: {error}") from None
    return args


def _without_emptied(parser: argparse.ArgumentParser, argv: list[str]) -> tuple[list[str], list[str]]:
    """``argv`` without its ``--flag ""`` pairs, and the options those flags set: an empty value
    sets an option back to its default (``--save ""`` turns a config file's ``save`` off)."""
    actions = {option: action for action in parser._actions for option in action.option_strings}
    kept, emptied, index = [], [], 0
    while index < len(argv):
        action = actions.get(argv[index])
        if action is not None and action.nargs is None and argv[index + 1 : index + 2] == [""]:
            emptied.append(action.dest)
            index += 2
        else:
            kept.append(argv[index])
            index += 1
    return kept, emptied


def parse_args(argv: Sequence[str] | None = None, world_size: int | None = None) -> argparse.Namespace:
    """Defaults < ``--config`` file < command line, validated for a world of ``world_size``
    processes (default ``$WORLD_SIZE``, else 1). A data source on the command line replaces the
    file's (``--mock-data`` for a file with ``data_path``). Raises :class:`ArgumentsError`."""
    parser = build_parser()
    argv, emptied = _without_emptied(parser, list(sys.argv[1:] if argv is None else argv))
    command_line = _parse(parser, argv, "command line")
    tokens = []
    if command_line.config:
        data_given = any(getattr(command_line, key) for key in DATA_SOURCES)
        tokens = _yaml_tokens(parser, command_line.config, DATA_SOURCES if data_given else ())
        _parse(parser, tokens, f"config file {command_line.config}")
    args = _parse(parser, tokens + argv, "command line")
    for name in emptied:
        setattr(args, name, parser.get_default(name))
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
        world_size = args.dry_run_world_size or int(
            os.environ.get("WORLD_SIZE", args.tensor_model_parallel_size * args.pipeline_model_parallel_size)
        )
    missing = [
        f"--{name.replace('_', '-')}"
        for name in REQUIRED
        if getattr(args, name) is None and not (args.dry_run and name in NOT_REQUIRED_FOR_DRY_RUN)
    ]
    if missing:
        raise ArgumentsError(f"missing required option(s): {', '.join(missing)}")
    for check in (
        _check_positive,
        _check_layout,
        _check_batch,
        _check_lime,
        _check_precision,
        _check_schedule,
        _check_data,
        _check_checkpointing,
        _check_profiling,
        _check_generation,
    ):
        check(args, world_size)


def _check_positive(args, world_size) -> None:
    for name in (
        "num_layers",
        "hidden_size",
        "num_attention_heads",
        "seq_length",
        "micro_batch_size",
        "train_iters",
        "tensor_model_parallel_size",
        "pipeline_model_parallel_size",
        "log_interval",
        "eval_interval",
    ):
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
        raise ArgumentsError(f"world size {world_size} is not divisible by tensor x pipeline parallel size {tp} x {pp}")
    args.data_parallel_size = world_size // (tp * pp)
    if args.make_vocab_size_divisible_by % tp:
        raise ArgumentsError(
            f"--make-vocab-size-divisible-by {args.make_vocab_size_divisible_by} must be divisible "
            f"by --tensor-model-parallel-size {tp} (the padded vocabulary is split over TP ranks)"
        )
    if args.sequence_parallel and tp == 1:
        raise ArgumentsError("--sequence-parallel needs --tensor-model-parallel-size > 1")
    per_stage, per_rank = (args.num_layers_per_virtual_pipeline_stage, args.num_virtual_stages_per_pipeline_rank)
    if per_stage is not None and per_rank is not None:
        raise ArgumentsError(
            "give one of --num-layers-per-virtual-pipeline-stage and --num-virtual-stages-per-pipeline-rank, not both"
        )
    if per_stage is not None:
        if args.num_layers % (per_stage * pp):
            raise ArgumentsError(
                f"--num-layers {args.num_layers} is not divisible by "
                f"--num-layers-per-virtual-pipeline-stage {per_stage} x pipeline size {pp}"
            )
        per_rank = args.num_layers // (per_stage * pp)
    args.virtual_pipeline_size = per_rank if per_rank and per_rank > 1 else None
    if (per_stage is not None or per_rank is not None) and pp == 1:
        raise ArgumentsError("virtual pipeline stages need --pipeline-model-parallel-size > 1")
    uneven = (args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers)
    if any(n is not None for n in uneven) and pp == 1:
        raise ArgumentsError("--decoder-first/last-pipeline-num-layers need pipeline parallelism")
    if args.use_distributed_optimizer and args.optimizer != "adam":
        raise ArgumentsError("--use-distributed-optimizer supports only --optimizer adam")
    _check_overlap(args)


def _check_overlap(args) -> None:
    """Resolve ``--overlap-p2p-communication`` (default: on with virtual stages, as in Megatron-LM)."""
    if args.overlap_p2p_communication is None:
        args.overlap_p2p_communication = bool(args.virtual_pipeline_size)
    elif args.overlap_p2p_communication and not args.virtual_pipeline_size:
        raise ArgumentsError(
            "--overlap-p2p-communication needs virtual pipeline stages (megatron overlaps "
            "pipeline transfers only in the interleaved schedule)"
        )


def _check_batch(args, world_size) -> None:
    dp, mbs = args.data_parallel_size, args.micro_batch_size
    if args.global_batch_size is None:
        args.global_batch_size = mbs * dp
    if args.global_batch_size % (mbs * dp):
        raise ArgumentsError(
            f"--global-batch-size {args.global_batch_size} is not divisible by micro batch size "
            f"{mbs} x data-parallel size {dp}"
        )
    args.num_microbatches = args.global_batch_size // (mbs * dp)
    if args.exit_interval is not None and args.exit_interval < 1:
        raise ArgumentsError("--exit-interval must be >= 1")


def _check_lime(args, world_size) -> None:
    given = [
        name
        for name in (
            "lime_router",
            "lime_router_window",
            "lime_router_lr",
            "lime_router_weight_decay",
            "lime_prune_top_p",
            "lime_prune_iters",
        )
        if getattr(args, name) is not None
    ]
    if not args.lime:
        if given:
            options = ", ".join("--" + name.replace("_", "-") for name in given)
            raise ArgumentsError(f"{options} only apply to LIMe: add --lime (or drop them)")
        return
    args.lime_router = args.lime_router or DEFAULT_ROUTER
    try:
        validate_router(args.lime_router, args.lime_router_window, flags=True)
    except LimeConfigError as error:
        raise ArgumentsError(str(error)) from None
    if args.lime_router_lr is None:
        args.lime_router_lr = PAPER_ROUTER_LR
    if args.lime_router_weight_decay is None:
        args.lime_router_weight_decay = 0.0
    if args.lime_router_weight_decay > 0 and args.weight_decay == 0:
        raise ArgumentsError(
            "--lime-router-weight-decay > 0 needs --weight-decay > 0 (megatron scales the decay "
            "of a parameter group relative to --weight-decay)"
        )
    _check_pruning(args)


def _check_pruning(args) -> None:
    """--lime-prune-top-p and --lime-prune-iters come together; iterations within the run."""
    if (args.lime_prune_top_p is None) != (args.lime_prune_iters is None):
        raise ArgumentsError("route pruning needs both --lime-prune-top-p and --lime-prune-iters")
    if args.lime_prune_iters is not None and args.train_iters is not None:
        outside = [i for i in args.lime_prune_iters if not 1 <= i <= args.train_iters]
        if outside:
            raise ArgumentsError(f"--lime-prune-iters {outside} are outside the run's iterations 1..{args.train_iters}")


def _cuda(args) -> bool:
    """Whether the run has CUDA GPUs: a dry run plans for them; else torch is asked (imported
    here, for the options that need a GPU only)."""
    if args.dry_run:
        return True
    import torch

    return torch.cuda.is_available()


def _check_precision(args, world_size) -> None:
    if args.bf16 and args.fp16:
        raise ArgumentsError("choose one of --bf16 and --fp16")
    if args.fp16 and not _cuda(args):
        raise ArgumentsError("--fp16 needs a CUDA GPU (CPU runs train in float32 or --bf16)")
    if args.transformer_impl == "transformer_engine" and not _cuda(args):
        raise ArgumentsError("--transformer-impl transformer_engine needs a CUDA GPU")
    if args.attention_backend != "auto" and args.transformer_impl != "transformer_engine":
        raise ArgumentsError(
            f"--attention-backend {args.attention_backend} needs --transformer-impl transformer_engine"
        )
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
            f"{decay} (--lr-decay-iters, default --train-iters)"
        )
    if not 0 <= args.min_lr <= args.lr:
        raise ArgumentsError(f"--min-lr {args.min_lr} must lie in [0, --lr {args.lr}]")
    if args.lr_warmup_init > args.lr:
        raise ArgumentsError("--lr-warmup-init must not exceed --lr")


def _check_data(args, world_size) -> None:
    per_split = [args.train_data_path, args.valid_data_path, args.test_data_path]
    sources = sum([args.mock_data, args.data_path is not None, any(p is not None for p in per_split)])
    null_tokenizer = args.tokenizer_type == NULL_TOKENIZER
    if null_tokenizer and args.vocab_size is None:
        raise ArgumentsError(f"--tokenizer-type {NULL_TOKENIZER} needs --vocab-size")
    if args.dry_run:
        return
    if sources != 1:
        raise ArgumentsError(
            "give exactly one data source: --data-path, --train-data-path (with optional "
            "--valid-data-path/--test-data-path) or --mock-data"
        )
    if args.train_data_path is None and any(p is not None for p in per_split):
        raise ArgumentsError("--valid-data-path/--test-data-path need --train-data-path")
    if args.sft and args.mock_data:
        raise ArgumentsError(
            "--sft reads prompt/response data (tools/preprocess_data.py --prompt-key): not --mock-data"
        )
    if args.vocab_size is not None and not (args.mock_data or null_tokenizer):
        raise ArgumentsError(
            f"--vocab-size sets the --mock-data vocabulary; with real data the "
            f"tokenizer decides it (pre-tokenized ids: --tokenizer-type {NULL_TOKENIZER})"
        )
    for path in [args.data_path] + per_split:
        if path is not None:
            parse_blend(path)


def missing_dataset(prefix: str) -> str | None:
    """The error for the data path ``prefix`` when its .bin/.idx pair is missing, else None."""
    missing = [prefix + ext for ext in (".bin", ".idx") if not os.path.isfile(prefix + ext)]
    if not missing:
        return None
    return (
        f"data path {prefix!r}: {' and '.join(missing)} not found (a data path is the "
        "prefix of a .bin/.idx pair written by tools/preprocess_data.py, e.g. "
        "data/fwe_text_document)"
    )


def check_data_paths(options: DataOptions) -> None:
    """Raise :class:`ArgumentsError` for the first data path whose files are missing: the command
    line's check before the trainer is imported (the trainer checks again when it reads them)."""
    for tokens in (options.data_path, options.train_data_path, options.valid_data_path, options.test_data_path):
        for prefix in parse_blend(tokens)[0] if tokens is not None else ():
            problem = missing_dataset(prefix)
            if problem:
                raise ArgumentsError(problem)


def parse_blend(tokens: Sequence[str]) -> tuple[list[str], list[float] | None]:
    """Megatron-LM's blend syntax ``[w1] prefix1 [w2] prefix2 ...`` -> (prefixes, weights or
    None). Raises :class:`ArgumentsError` when weights are given for some prefixes only."""
    tokens = list(tokens)
    numbers = [_as_float(token) for token in tokens]
    if all(number is None for number in numbers):
        return tokens, None
    pairs = len(tokens) % 2 == 0 and all((number is None) == (i % 2 == 1) for i, number in enumerate(numbers))
    if not pairs:
        raise ArgumentsError(f"data path {' '.join(tokens)!r}: give either prefixes only or weight/prefix pairs")
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
    if args.finetune and args.load is None:
        raise ArgumentsError("--finetune needs --load (the checkpoint whose weights to start from)")
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


def _check_generation(args, world_size) -> None:
    """--eval-generation-file: generation runs in the training model, on one pipeline stage."""
    if args.eval_generation_file is None or args.dry_run:
        return
    if not os.path.isfile(args.eval_generation_file):
        raise ArgumentsError(f"--eval-generation-file {args.eval_generation_file}: no such file")
    if args.pipeline_model_parallel_size > 1 or args.sequence_parallel:
        raise ArgumentsError(
            "--eval-generation-file decodes with the KV cache, which needs "
            "--pipeline-model-parallel-size 1 and no --sequence-parallel; score the "
            "checkpoints with tools/score_generation.py instead"
        )
    if args.mock_data or args.tokenizer_type == NULL_TOKENIZER:
        raise ArgumentsError("--eval-generation-file needs a text tokenizer (not --mock-data or NullTokenizer)")


def _check_profiling(args, world_size) -> None:
    if args.use_pytorch_profiler and not args.profile:
        raise ArgumentsError("--use-pytorch-profiler needs --profile")
    if not args.profile:
        return
    if not 0 <= args.profile_step_start < args.profile_step_end:
        raise ArgumentsError(
            f"--profile-step-end {args.profile_step_end} must be larger than "
            f"--profile-step-start {args.profile_step_start} (>= 0)"
        )
    if args.use_pytorch_profiler and not (args.profile_dir or args.tensorboard_dir):
        raise ArgumentsError("--use-pytorch-profiler needs --profile-dir or --tensorboard-dir for its trace")
    if not args.use_pytorch_profiler and not _cuda(args):
        raise ArgumentsError("--profile without --use-pytorch-profiler drives nsys and needs a CUDA GPU")


# --------------------------------------------------------------------------- model config


def parse_run(argv: Sequence[str] | None = None, world_size: int | None = None) -> RunConfig:
    """:func:`parse_args` as a typed :class:`RunConfig`."""
    return RunConfig.from_namespace(parse_args(argv, world_size))


def transformer_config(run: RunConfig):
    """The run's ``LimeTransformerConfig``: the LLaMA architecture, the options the run config
    declares as ``TransformerConfig`` fields (``RunConfig.transformer_options``) and the values
    computed from options below; fused kernels as ``lime_megatron.parallel.fusions`` decides.
    Raises :class:`ArgumentsError` for shapes or layouts megatron or LIMe reject."""
    import torch
    from megatron.core.transformer.enums import AttnBackend

    from lime_megatron.models.config import lime_config
    from lime_megatron.parallel import fusions

    options = run.transformer_options()
    if run.precision.fp8_format is None:  # megatron's FP8 settings apply only with FP8: keep its defaults
        options = {name: value for name, value in options.items() if not name.startswith("fp8")}
    dtype = run.precision.params_dtype
    computed = dict(
        params_dtype=dtype,
        pipeline_dtype=dtype,
        autocast_dtype=dtype,
        batch_p2p_comm=not run.parallel.overlap_p2p_communication,  # megatron: one or the other
        use_cpu_initialization=not torch.cuda.is_available(),
        attention_backend=AttnBackend[run.model.attention_backend],
        # --sft: gradients of the loss reported, the mean over the global batch's response tokens
        # (megatron's default averages the per-microbatch means, which differ when masks do).
        calculate_per_token_loss=run.data.sft,
    )
    try:
        config = lime_config(**options, **computed)
    except (LimeConfigError, ValueError, AssertionError) as error:
        raise ArgumentsError(f"invalid model configuration: {error}") from None
    return fusions.run_choices(run).apply(config)
