"""A trained model from a distributed checkpoint, on one process: for decoding, export and analysis.

``pretrain_lime.py`` saves megatron distributed checkpoints (``lime_megatron.checkpointing``) at
whatever layout the run used.  Every tensor in them is keyed by its global name and offsets, so
one process can read any of them into the single-process model (TP=1, PP=1, no virtual stages):

    loaded = load_model("ckpt/lime-1b")            # a --save root (newest) or one iter_NNNNNNN dir
    logits = loaded.model(tokens, positions, None)  # [b, s, padded vocab]
    tokenizer = loaded.tokenizer()

The model shape, LIMe options, RoPE base, norm epsilon and vocabulary come from the run
description the checkpoint carries (``checkpointing.run_description``).  ``save_model`` writes a
single-process model back as a weights-only checkpoint that ``pretrain_lime.py --load`` accepts
(with ``--no-load-optim``) at any layout.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from megatron.core import dist_checkpointing

from lime_megatron import arguments, checkpointing, data
from lime_megatron.config import LimeTransformerConfig
from lime_megatron.model import LimeGPTModel, build_model
from lime_megatron.parallel import initialize_parallel
from lime_megatron.run_config import RunConfig

SINGLE_PROCESS_LAYOUT = dict(
    tensor_model_parallel_size=1, pipeline_model_parallel_size=1, virtual_pipeline_size=None,
    decoder_first_pipeline_num_layers=None, decoder_last_pipeline_num_layers=None,
    sequence_parallel=False, recompute_granularity=None, recompute_method=None,
    recompute_num_layers=None, fp8_format=None, transformer_impl="local",
)
"""Run options replaced when a checkpoint is read into one CPU process."""


@dataclass
class CheckpointModel:
    """A checkpoint's model on one process, with what it was trained with."""

    model: LimeGPTModel
    """The single-process model (eval mode), in ``dtype`` of :func:`load_model`."""
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
    digits = name[len("iter_"):]
    if name.startswith("iter_") and digits.isdigit():
        return int(digits), path
    raise checkpointing.CheckpointError(
        f"no checkpoint at {path}: neither a --save directory (no {checkpointing.TRACKER}) nor an "
        "iter_NNNNNNN checkpoint directory")


def single_process_config(run: dict, dtype: torch.dtype) -> LimeTransformerConfig:
    """The model config of ``run`` (a checkpoint's run description) for one process."""
    options = {**run["args"], **SINGLE_PROCESS_LAYOUT, "dry_run": False,
               "bf16": dtype == torch.bfloat16, "fp16": dtype == torch.float16}
    return arguments.transformer_config(RunConfig.from_flat_dict(options))


def load_model(path: str, *, dtype: torch.dtype | None = None) -> CheckpointModel:
    """Read the checkpoint at ``path`` (see :func:`resolve_checkpoint`) into the single-process
    model, weights in ``dtype`` (default: the dtype the run trained in).  Initialises a one-process
    ``torch.distributed`` world if none exists (megatron's checkpoint reader needs one)."""
    iteration, directory = resolve_checkpoint(path)
    run = checkpointing.read_common(directory)["run"]
    initialize_parallel()
    saved_dtype = RunConfig.from_flat_dict(run["args"]).precision.params_dtype
    config = single_process_config(run, saved_dtype)
    model = _build(config, run)
    template = {"model0": model.sharded_state_dict()}
    try:
        loaded = dist_checkpointing.load(template, directory)
    except Exception as error:  # noqa: BLE001 - say which checkpoint and why
        raise checkpointing.CheckpointError(
            f"cannot read the model of checkpoint {directory}: {checkpointing.cause(error)}") from None
    model.load_state_dict(loaded["model0"])
    if dtype is not None and dtype != saved_dtype:
        model.to(dtype)
        config = single_process_config(run, dtype)
        model.config.params_dtype = dtype
    return CheckpointModel(model.eval(), config, run, directory, iteration)


def _build(config: LimeTransformerConfig, run: dict) -> LimeGPTModel:
    """The single-process model of ``run`` (padded vocabulary, RoPE base and tying as trained)."""
    options = run["args"]
    return build_model(
        config, run["vocab"]["padded"], options["max_position_embeddings"] or options["seq_length"],
        share_embeddings_and_output_weights=not options["untie_embeddings_and_output_weights"],
        rotary_base=options["rotary_base"],
    )


def new_model(run: dict, dtype: torch.dtype) -> LimeGPTModel:
    """An uninitialised single-process model of ``run`` in ``dtype``, to be filled (e.g. by a
    Hugging Face import, ``lime_megatron.hf_export``) and written with :func:`save_model`."""
    initialize_parallel()
    config = single_process_config(run, dtype)
    config.perform_initialization = False
    return _build(config, run)


def save_model(model: LimeGPTModel, run: dict, root: str, iteration: int = 0) -> str:
    """Write the single-process ``model`` as a weights-only checkpoint under ``root`` (published
    and tracked like the trainer's) with the run description ``run``; returns its directory.
    ``pretrain_lime.py --load root --no-load-optim`` starts from it at any layout."""
    initialize_parallel()
    run = {**run, "layout": dict(tp=1, pp=1, vpp=None, dp=1), "weights_only": True,
           "distributed_optimizer": False}
    directory = checkpointing.checkpoint_dir(root, iteration)
    if os.path.exists(directory):
        raise checkpointing.CheckpointError(f"{directory} exists already: refusing to overwrite it")
    staging = directory + ".tmp"
    os.makedirs(staging)
    state = {"model0": model.sharded_state_dict(), "iteration": iteration, "consumed_samples": 0,
             "run": run, "format_version": checkpointing.FORMAT_VERSION}
    dist_checkpointing.save(state, staging)
    os.rename(staging, directory)
    checkpointing.write_tracker(root, iteration)
    return directory
