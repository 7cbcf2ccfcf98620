"""Process-group and megatron parallel-state initialisation for entry points, tools and tests,
and the one place where a run's random generators are seeded."""

from __future__ import annotations

import gc
import os
import random

import numpy as np
import torch
from megatron.core import parallel_state, tensor_parallel

from lime_megatron.parallel.compat import distributed_backend, enable_cpu_support


def initialize_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: int | None = None,
    seed: int = 1234,
) -> None:
    """Initialise torch.distributed and megatron's parallel state (idempotent), then seed with
    :func:`set_random_seed` when the parallel state is new.

    Under ``torchrun`` (``MASTER_PORT`` set) the rank, world size and rendezvous come from the
    environment; otherwise a world of one process is created on an in-process store, so that no
    TCP port is taken (picking a "free" port and binding it later races with every other process
    on the machine: a CI run lost a scoring step to ``EADDRINUSE`` that way).  On machines
    without CUDA, megatron's CPU support is enabled first.
    """
    enable_cpu_support()
    if not torch.distributed.is_initialized():
        if "MASTER_PORT" in os.environ:
            torch.distributed.init_process_group(
                distributed_backend(),
                rank=int(os.environ.get("RANK", 0)),
                world_size=int(os.environ.get("WORLD_SIZE", 1)),
            )
        else:
            torch.distributed.init_process_group(
                distributed_backend(), store=torch.distributed.HashStore(), rank=0, world_size=1
            )
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size,
            pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
        )
        set_random_seed(seed)


def launch_world_size() -> int:
    """Processes in this launch: torch.distributed's world if initialised, else ``WORLD_SIZE``
    (torchrun's), else 1."""
    if torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return int(os.environ.get("WORLD_SIZE", 1))


def destroy_parallel() -> None:
    """Tear down megatron's parallel state and every process group but the default one (megatron's
    and the pipeline side channel's), so that another layout can be initialised in this process.

    A gloo group keeps an event-loop thread, woken about 100 times a second, and two worker threads
    until its last reference goes (models of earlier layouts can hold some in reference cycles,
    hence the collection): a test process that built twenty layouts without this kept ~1,400
    threads, a load average of ~800 on 2 cores.
    """
    from torch.distributed import distributed_c10d

    from lime_megatron.parallel import pipeline

    if torch.distributed.is_initialized():
        default = distributed_c10d._get_default_group()
        for group in list(distributed_c10d._world.pg_map):
            if group is not default:
                torch.distributed.destroy_process_group(group)
    parallel_state.destroy_model_parallel()
    pipeline.reset_side_channel()
    gc.collect()


def set_random_seed(seed: int) -> None:
    """Seed python, numpy, torch and megatron's model-parallel RNG tracker as Megatron-LM does:
    with ``seed + 100 x pipeline rank`` (the tracker adds its own tensor-parallel offsets), so
    pipeline stages draw different weights and dropout masks. Needs megatron's parallel state."""
    seed += 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
