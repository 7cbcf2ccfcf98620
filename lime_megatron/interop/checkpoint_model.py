"""A trained model from a distributed checkpoint, for decoding, export and analysis.

``pretrain_lime.py`` saves megatron distributed checkpoints (``lime_megatron.training.checkpointing``) at
whatever layout the run used.  Every tensor in them is keyed by its global name and offsets, so
they read into a model of any tensor-parallel size (PP=1, no virtual stages, no sequence
parallelism): one process by default,

    loaded = load_model("ckpt/lime-1b")            # a --save root (newest) or one iter_NNNNNNN dir
    logits = loaded.model(tokens, positions, None)  # [b, s, padded vocab]
    tokenizer = loaded.tokenizer()

or N tensor-parallel ranks under ``torchrun --nproc-per-node N`` (each rank holds its shard of the
heads, MLP and vocabulary; megatron's ``dist_checkpointing`` reshards; LIMe routers load their
input-head columns, ``lime_megatron.models.lime.router``):

    loaded = load_model("ckpt/lime-1b", tensor_parallel=N)
    logits = loaded.model(tokens, positions, None, runtime_gather_output=True)  # full vocab, every rank

The model is built by the trainer's own builder (``model.build_model``) from the run description
the checkpoint carries (``checkpointing.run_description``: shape, LIMe options, RoPE base, norm
epsilon, vocabulary), with the layout replaced by ``INFERENCE_LAYOUT``.  ``save_model`` writes a
single-process model back as a weights-only checkpoint that ``pretrain_lime.py --load`` accepts
(with ``--no-load-optim``) at any layout.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from megatron.core import dist_checkpointing, parallel_state

from lime_megatron.models.config import LimeTransformerConfig
from lime_megatron.models.gpt_model import LimeGPTModel, build_model
from lime_megatron.parallel.process_groups import initialize_parallel, launch_world_size
from lime_megatron.training import arguments, checkpointing, data
from lime_megatron.training.run_config import RunConfig

INFERENCE_LAYOUT = dict(
    pipeline_model_parallel_size=1,
    virtual_pipeline_size=None,
    decoder_first_pipeline_num_layers=None,
    decoder_last_pipeline_num_layers=None,
    sequence_parallel=False,
    recompute_granularity=None,
    recompute_method=None,
    recompute_num_layers=None,
    fp8_format=None,
    transformer_impl="local",
)
"""Run options replaced when a checkpoint is read for inference (the tensor-parallel size is
:func:`load_model`'s ``tensor_parallel``)."""


@dataclass
class CheckpointModel:
    """A checkpoint's model on this process, with what it was trained with."""

    model: LimeGPTModel
    """The model (eval mode) in ``dtype`` of :func:`load_model`: the whole model, or this rank's
    tensor-parallel shard of it."""
    config: LimeTransformerConfig
    run: dict
    """The run description saved with the checkpoint (``shape``, ``vocab``, ``layout``, ``args``)."""
    directory: str
    iteration: int

    @property
    def options(self) -> RunConfig:
        """The training run's options."""
        return RunConfig.from_flat_dict(self.run["args"])

    def tokenizer(self):
        """The tokenizer the run trained with (``data.tokenizer_of`` on its options)."""
        return data.tokenizer_of(self.options.data, self.options.model.vocab_size)


def resolve_checkpoint(path: str) -> tuple[int, str]:
    """``(iteration, directory)`` of ``path``: a ``--save`` root (its newest published checkpoint)
    or one ``iter_NNNNNNN`` directory.  Raises ``CheckpointError`` naming what is missing."""
    if not os.path.isdir(path):
        raise checkpointing.CheckpointError(f"no checkpoint at {path}: not a directory")
    found = checkpointing.latest_checkpoint(path)
    if found is not None:
        return found
    name = os.path.basename(os.path.normpath(path))
    digits = name[len("iter_") :]
    if name.startswith("iter_") and digits.isdigit():
        return int(digits), path
    raise checkpointing.CheckpointError(
        f"no checkpoint at {path}: neither a --save directory (no {checkpointing.TRACKER}) nor an "
        "iter_NNNNNNN checkpoint directory"
    )


def inference_config(run: dict, dtype: torch.dtype, tensor_parallel: int = 1) -> LimeTransformerConfig:
    """The model config of ``run`` (a checkpoint's run description) at ``INFERENCE_LAYOUT`` with
    ``tensor_parallel`` tensor-parallel ranks."""
    options = {
        **run["args"],
        **INFERENCE_LAYOUT,
        "tensor_model_parallel_size": tensor_parallel,
        "dry_run": False,
        "bf16": dtype == torch.bfloat16,
        "fp16": dtype == torch.float16,
    }
    return arguments.transformer_config(RunConfig.from_flat_dict(options))


def check_tensor_parallel(run: dict, size: int) -> None:
    """Raise ``ValueError`` naming every part of ``run``'s model that does not split over
    ``size`` tensor-parallel ranks (attention heads, key/value heads, MLP width, padded vocabulary)."""
    if size < 1:
        raise ValueError(f"the tensor-parallel size must be >= 1, got {size}")
    shape, padded = run["shape"], run["vocab"]["padded"]
    problems = [
        f"{count} {what} are not divisible by {size}"
        for what, count in (
            ("attention heads", shape["num_attention_heads"]),
            ("MLP channels", shape["ffn_hidden_size"]),
            ("padded vocabulary entries", padded),
        )
        if count % size
    ]
    kv_heads = shape["num_query_groups"]
    if kv_heads % size and size % kv_heads:
        problems.append(f"{kv_heads} key/value heads neither divide nor are divisible by {size}")
    if problems:
        raise ValueError(
            f"the checkpoint's model cannot be split over {size} tensor-parallel ranks: " + "; ".join(problems)
        )


def _initialize_tensor_parallel(size: int) -> None:
    """torch.distributed and megatron's parallel state with ``size`` tensor-parallel ranks (PP=1;
    the world's other factor is data parallelism), created if needed.  Raises ``ValueError`` when
    the world does not fit or megatron's state was initialised with another layout."""
    world = launch_world_size()
    if world % size:
        raise ValueError(
            f"tensor_parallel={size} needs a multiple of {size} processes "
            f"(torchrun --nproc-per-node {size}); this world has {world}"
        )
    if parallel_state.model_parallel_is_initialized():
        layout = (
            parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_pipeline_model_parallel_world_size(),
        )
        if layout != (size, 1):
            raise ValueError(
                f"megatron's parallel state is initialised with TP={layout[0]}, PP={layout[1]}; "
                f"reading a model at TP={size}, PP=1 needs that layout"
            )
    if torch.cuda.is_available() and not torch.distributed.is_initialized():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    initialize_parallel(tensor_model_parallel_size=size)


def load_model(path: str, *, dtype: torch.dtype | None = None, tensor_parallel: int = 1) -> CheckpointModel:
    """Read the checkpoint at ``path`` (see :func:`resolve_checkpoint`), whatever its layout, into
    the model at ``tensor_parallel`` tensor-parallel ranks (PP=1), weights in ``dtype`` (default:
    the dtype the run trained in).

    Initialises torch.distributed and megatron's parallel state if needed: a one-process world,
    or under ``torchrun`` the launched world (its size a multiple of ``tensor_parallel``; the
    rest is data parallelism).  Every rank of the world must call it.  Raises ``ValueError`` when
    the model or the world does not split over ``tensor_parallel`` ranks and ``CheckpointError``
    when the checkpoint cannot be read."""
    iteration, directory = resolve_checkpoint(path)
    run = checkpointing.read_common(directory)["run"]
    check_tensor_parallel(run, tensor_parallel)
    _initialize_tensor_parallel(tensor_parallel)
    saved_dtype = RunConfig.from_flat_dict(run["args"]).precision.params_dtype
    config = inference_config(run, saved_dtype, tensor_parallel)
    model = _build(config, run)
    template = {"model0": model.sharded_state_dict()}
    try:
        loaded = dist_checkpointing.load(template, directory)
    except Exception as error:  # noqa: BLE001 - say which checkpoint and why
        raise checkpointing.CheckpointError(
            f"cannot read the model of checkpoint {directory}: {checkpointing.cause(error)}"
        ) from None
    model.load_state_dict(loaded["model0"])
    if dtype is not None and dtype != saved_dtype:
        model.to(dtype)
        config = inference_config(run, dtype, tensor_parallel)
        model.config.params_dtype = dtype
    return CheckpointModel(model.eval(), config, run, directory, iteration)


def _build(config: LimeTransformerConfig, run: dict) -> LimeGPTModel:
    """The model of ``run`` at ``config``'s layout, built by the trainer's ``build_model`` (padded
    vocabulary, RoPE base and tying as trained)."""
    options = run["args"]
    return build_model(
        config,
        run["vocab"]["padded"],
        options["max_position_embeddings"] or options["seq_length"],
        share_embeddings_and_output_weights=not options["untie_embeddings_and_output_weights"],
        rotary_base=options["rotary_base"],
    )


def new_model(run: dict, dtype: torch.dtype) -> LimeGPTModel:
    """An uninitialised single-process model of ``run`` in ``dtype``, to be filled (e.g. by a
    Hugging Face import, ``lime_megatron.interop.hf_export``) and written with :func:`save_model`."""
    initialize_parallel()
    config = inference_config(run, dtype)
    config.perform_initialization = False
    return _build(config, run)


def save_model(model: LimeGPTModel, run: dict, root: str, iteration: int = 0) -> str:
    """Write the single-process ``model`` as a weights-only checkpoint under ``root`` (published
    and tracked like the trainer's) with the run description ``run``; returns its directory.
    ``pretrain_lime.py --load root --no-load-optim`` starts from it at any layout."""
    initialize_parallel()
    run = {**run, "layout": dict(tp=1, pp=1, vpp=None, dp=1), "weights_only": True, "distributed_optimizer": False}
    directory = checkpointing.checkpoint_dir(root, iteration)
    if os.path.exists(directory):
        raise checkpointing.CheckpointError(f"{directory} exists already: refusing to overwrite it")
    staging = directory + ".tmp"
    os.makedirs(staging)
    state = {
        "model0": model.sharded_state_dict(),
        "iteration": iteration,
        "consumed_samples": 0,
        "run": run,
        "format_version": checkpointing.FORMAT_VERSION,
    }
    dist_checkpointing.save(state, staging)
    os.rename(staging, directory)
    checkpointing.write_tracker(root, iteration)
    return directory
