"""Distributed checkpoints (megatron-core ``dist_checkpointing``): save, publish, resume.

Layout of a ``--save`` directory::

    iter_0000200/                     one complete checkpoint (megatron torch_dist format)
    iter_0000400/
    latest_checkpointed_iteration.txt the tracker: the iteration of the newest complete one

A checkpoint is written into ``iter_NNNNNNN.tmp/`` and renamed to ``iter_NNNNNNN/`` only after
every rank finished writing; the tracker is then replaced atomically (write + ``os.replace``).
A save interrupted at any point therefore leaves the latest good checkpoint and the tracker
untouched (its leftover ``.tmp`` directory is removed by the next save). ``--ckpt-keep-last k``
deletes all but the newest k published checkpoints after each save.

A checkpoint holds each model chunk's sharded state (``model0``, ``model1``, ... per virtual
stage; megatron reshards them to any TP/PP/VPP layout), the optimizer state (resharded the same
way; the distributed optimizer in megatron's ``fully_reshardable`` format), the LR scheduler, the
iteration and number of consumed samples (the data position), every rank's RNG states (restored
only when the layout is unchanged) and the run's options (``run``), from which a resume detects
an incompatible vocabulary or model shape before touching any tensor.
"""

from __future__ import annotations

import os
import random
import shutil
from dataclasses import dataclass

import numpy as np
import torch
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.utils import unwrap_model
from torch.distributed.checkpoint.api import CheckpointException as TorchCheckpointException

from lime_megatron.training.arguments import UsageError
from lime_megatron.training.run_config import RunConfig

TRACKER = "latest_checkpointed_iteration.txt"
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}
FORMAT_VERSION = 1
MODEL_SHAPE_KEYS = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "kv_channels",
    "lime",
    "lime_router",
    "lime_router_window",
    "untie_embeddings_and_output_weights",
    "hyper_connections",
    "hyper_connections_static",
    "hyper_connections_manifold",
    "hyper_connections_sinkhorn_iterations",
    "lime_prune_top_p",
)
"""Options that fix the shapes of the model's weights or the function they compute (mHC's Sinkhorn
iterations), or what the checkpoint holds (a pruning run's route masks); a checkpoint must agree on
all of them."""
SHAPE_KEYS_ADDED_LATER = {
    "hyper_connections": 0,
    "hyper_connections_static": False,
    "hyper_connections_manifold": False,
    "hyper_connections_sinkhorn_iterations": 20,
    "lime_prune_top_p": None,
}
"""Shape options that checkpoints written before them lack, with the value those checkpoints had."""


class CheckpointError(UsageError):
    """A missing, corrupt or incompatible checkpoint."""


@dataclass
class TrainingState:
    """Where training stands: completed iterations and training samples consumed so far."""

    iteration: int = 0
    consumed_samples: int = 0


def checkpoint_dir(root: str, iteration: int) -> str:
    """Directory of the published checkpoint of ``iteration`` under ``root``."""
    return os.path.join(root, f"iter_{iteration:07d}")


def run_description(run: RunConfig, config, tokenizer) -> dict:
    """What a checkpoint records about its run: options, model shape, vocabulary, layout."""
    shape = dict(
        num_layers=config.num_layers,
        hidden_size=config.hidden_size,
        ffn_hidden_size=config.ffn_hidden_size,
        num_attention_heads=config.num_attention_heads,
        num_query_groups=config.kv_heads,
        kv_channels=config.kv_channels,
        lime=config.lime,
        lime_router=config.lime_router if config.lime else None,
        lime_router_window=config.lime_router_window,
        untie_embeddings_and_output_weights=run.model.untie_embeddings_and_output_weights,
        hyper_connections=config.hyper_connections,
        hyper_connections_static=config.hyper_connections_static,
        hyper_connections_manifold=config.hyper_connections_manifold,
        hyper_connections_sinkhorn_iterations=config.hyper_connections_sinkhorn_iterations,
        lime_prune_top_p=config.lime_prune_top_p if config.lime else None,  # whether masks are saved
    )
    assert set(shape) == set(MODEL_SHAPE_KEYS)
    return dict(
        shape=shape,
        vocab=dict(tokenizer=type(tokenizer).__name__, size=tokenizer.unpadded_vocab_size, padded=tokenizer.vocab_size),
        layout=_layout(),
        distributed_optimizer=run.parallel.use_distributed_optimizer,
        args={
            key: value
            for key, value in run.as_flat_dict().items()
            if isinstance(value, (int, float, str, bool, list, type(None)))
        },
    )


def _layout() -> dict:
    return dict(
        tp=parallel_state.get_tensor_model_parallel_world_size(),
        pp=parallel_state.get_pipeline_model_parallel_world_size(),
        vpp=parallel_state.get_virtual_pipeline_model_parallel_world_size(),
        dp=parallel_state.get_data_parallel_world_size(),
    )


# --------------------------------------------------------------------------- state dicts


def _rng_state() -> ShardedObject:
    """This rank's RNG states (python, numpy, torch CPU/CUDA, megatron's tracker) as one shard
    of a ``[pp, tp, dp]`` grid."""
    layout = _layout()
    states = dict(
        python=random.getstate(),
        numpy=np.random.get_state(),
        torch=torch.get_rng_state(),
        cuda=torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        tracker=tensor_parallel.get_cuda_rng_tracker().get_states(),
    )
    shape = (layout["pp"], layout["tp"], layout["dp"])
    offset = (
        parallel_state.get_pipeline_model_parallel_rank(),
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_data_parallel_rank(),
    )
    return ShardedObject("rng_state", states, shape, offset, replica_id=0)


def _set_rng_state(states: dict) -> None:
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if states["cuda"] is not None:
        torch.cuda.set_rng_state(states["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(states["tracker"])


def _sharded_state(
    model: list,
    optimizer,
    scheduler,
    state: TrainingState,
    run: dict | None,
    *,
    optim: bool,
    rng: bool,
    is_loading: bool,
) -> dict:
    """The sharded state dict to save (``is_loading`` False) or to load into."""
    sharded = {f"model{i}": unwrap_model(chunk).sharded_state_dict() for i, chunk in enumerate(model)}
    if optim:
        sharded["optimizer"] = optimizer.sharded_state_dict(sharded, is_loading=is_loading, metadata=OPTIMIZER_METADATA)
        sharded["scheduler"] = scheduler.state_dict()
    if rng:
        sharded["rng_state"] = _rng_state()
    sharded.update(
        iteration=state.iteration, consumed_samples=state.consumed_samples, run=run, format_version=FORMAT_VERSION
    )
    return sharded


# --------------------------------------------------------------------------- saving


def save_checkpoint(
    root: str, model: list, optimizer, scheduler, state: TrainingState, run: dict, keep_last: int | None = None
) -> str | None:
    """Save, publish and prune (collective). Returns the published directory, or None when
    this iteration's checkpoint already exists (it holds the same state)."""
    final = checkpoint_dir(root, state.iteration)
    if os.path.isdir(final):
        return None
    staging = final + ".tmp"
    rank0 = torch.distributed.get_rank() == 0
    if rank0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(staging, ignore_errors=True)
        os.makedirs(staging)
    torch.distributed.barrier()
    sharded = _sharded_state(model, optimizer, scheduler, state, run, optim=True, rng=True, is_loading=False)
    dist_checkpointing.save(sharded, staging)
    torch.distributed.barrier()
    if rank0:
        os.rename(staging, final)
        write_tracker(root, state.iteration)
        if keep_last is not None:
            _prune(root, keep_last)
    torch.distributed.barrier()
    return final


def write_tracker(root: str, iteration: int) -> None:
    """Atomically point the tracker at ``iteration``."""
    temporary = os.path.join(root, TRACKER + ".tmp")
    with open(temporary, "w", encoding="utf-8") as handle:
        handle.write(f"{iteration}\n")
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, os.path.join(root, TRACKER))


def published_iterations(root: str) -> list[int]:
    """Iterations of the published checkpoints under ``root``, ascending."""
    found = []
    for name in os.listdir(root) if os.path.isdir(root) else []:
        digits = name[len("iter_") :]
        if name.startswith("iter_") and digits.isdigit() and os.path.isdir(os.path.join(root, name)):
            found.append(int(digits))
    return sorted(found)


def _prune(root: str, keep_last: int) -> None:
    """Delete all but the newest ``keep_last`` published checkpoints."""
    for iteration in published_iterations(root)[:-keep_last]:
        shutil.rmtree(checkpoint_dir(root, iteration))


# --------------------------------------------------------------------------- loading


def latest_checkpoint(root: str) -> tuple[int, str] | None:
    """``(iteration, directory)`` named by the tracker in ``root``, or None when ``root`` holds
    no checkpoint. Raises :class:`CheckpointError` for a corrupt tracker or missing directory."""
    tracker = os.path.join(root, TRACKER)
    if not os.path.isfile(tracker):
        return None
    with open(tracker, encoding="utf-8") as handle:
        text = handle.read().strip()
    if not text.isdigit():
        raise CheckpointError(
            f"corrupt checkpoint tracker {tracker}: expected an iteration number, found {text[:40]!r}"
        )
    directory = checkpoint_dir(root, int(text))
    if not os.path.isdir(directory):
        raise CheckpointError(f"checkpoint tracker {tracker} names iteration {text}, but {directory} does not exist")
    return int(text), directory


def read_common(directory: str) -> dict:
    """The non-sharded part of a checkpoint; :class:`CheckpointError` if it is unreadable."""
    if not os.path.isfile(os.path.join(directory, "metadata.json")):
        raise CheckpointError(f"{directory} is not a complete checkpoint (no metadata.json)")
    try:
        common = dist_checkpointing.load_common_state_dict(directory)
    except (Exception, TorchCheckpointException) as error:  # noqa: BLE001 - any failure to read: corrupt
        # megatron-core 0.19 reads the common state through torch.distributed.checkpoint too
        raise CheckpointError(f"cannot load checkpoint {directory} (corrupt or truncated?): {cause(error)}") from None
    if not isinstance(common, dict) or common.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{directory} is not a checkpoint of this trainer (format {FORMAT_VERSION})")
    return common


def cause(error: Exception) -> str:
    """One line naming what went wrong. torch.distributed.checkpoint wraps each rank's failure
    in a ``CheckpointException`` (a ``BaseException``) whose text is that rank's traceback: its
    last line is the cause."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    last = lines[-1] if lines else ""
    return last if len(lines) > 1 else f"{type(error).__name__}: {last}"


def check_compatible(directory: str, saved: dict, current: dict, load_optim: bool) -> None:
    """Raise :class:`CheckpointError` if the checkpoint's vocabulary or model shape differs, or
    (when its optimizer state is to be loaded) its optimizer kind."""
    if saved["vocab"] != current["vocab"]:
        old, new = saved["vocab"], current["vocab"]
        raise CheckpointError(
            f"vocabulary mismatch: checkpoint {directory} was trained with {old['tokenizer']} "
            f"({old['size']} tokens, padded {old['padded']}), this run uses {new['tokenizer']} "
            f"({new['size']} tokens, padded {new['padded']})"
        )
    saved_shape = {**SHAPE_KEYS_ADDED_LATER, **saved["shape"]}
    differing = [key for key in MODEL_SHAPE_KEYS if saved_shape[key] != current["shape"][key]]
    if differing:
        details = ", ".join(f"{key} {saved_shape[key]} vs {current['shape'][key]}" for key in differing)
        raise CheckpointError(f"model shape mismatch with checkpoint {directory} (checkpoint vs this run): {details}")
    if load_optim and saved.get("weights_only"):
        raise CheckpointError(
            f"checkpoint {directory} holds weights only (no optimizer state): "
            "pass --no-load-optim to start from its weights"
        )
    if load_optim and saved["distributed_optimizer"] != current["distributed_optimizer"]:
        kinds = {True: "the distributed optimizer", False: "the regular optimizer"}
        raise CheckpointError(
            f"checkpoint {directory} holds the state of {kinds[saved['distributed_optimizer']]}, "
            f"this run uses {kinds[current['distributed_optimizer']]}: match "
            "--use-distributed-optimizer, or pass --no-load-optim to load the weights only"
        )


@dataclass
class LoadOutcome:
    """What :func:`load_checkpoint` restored."""

    state: TrainingState
    directory: str
    rng_restored: bool
    optimizer_restored: bool


def load_checkpoint(
    root: str, model: list, optimizer, scheduler, run: dict, *, load_optim: bool = True, load_rng: bool = True
) -> LoadOutcome | None:
    """Resume from the newest checkpoint under ``root`` (collective). Returns None when there is
    none. Without ``load_optim`` only the weights are loaded and training starts at iteration 0;
    RNG states are restored only with ``load_rng``, an unchanged layout and a checkpoint that
    has them (a weights-only one, ``checkpoint_model.save_model``, has not)."""
    found = latest_checkpoint(root)
    if found is None:
        return None
    _, directory = found
    saved = read_common(directory)["run"]
    check_compatible(directory, saved, run, load_optim)
    rng = load_rng and not saved.get("weights_only") and saved["layout"] == run["layout"]
    template = _sharded_state(
        model, optimizer, scheduler, TrainingState(), None, optim=load_optim, rng=rng, is_loading=True
    )
    try:
        loaded = dist_checkpointing.load(template, directory)
    except (Exception, TorchCheckpointException) as error:  # noqa: BLE001 - say which and why
        raise CheckpointError(f"cannot load checkpoint {directory} (corrupt or truncated?): {cause(error)}") from None
    for i, chunk in enumerate(model):
        unwrap_model(chunk).load_state_dict(loaded[f"model{i}"])
    state = TrainingState()
    if load_optim:
        optimizer.load_state_dict(loaded["optimizer"])
        scheduler.load_state_dict(loaded["scheduler"])
        state = TrainingState(loaded["iteration"], loaded["consumed_samples"])
    if rng:
        _set_rng_state(loaded["rng_state"])
    return LoadOutcome(state, directory, rng, load_optim)
