"""One-process megatron set-up for model tests: a world of one gloo (or nccl) rank."""

from __future__ import annotations

import os
import socket

import torch
from megatron.core import parallel_state

from lime_megatron.compat import distributed_backend, enable_cpu_support


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_single_process() -> None:
    """Initialise torch.distributed (world size 1) and megatron's parallel state, once."""
    enable_cpu_support()
    if not torch.distributed.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        torch.distributed.init_process_group(distributed_backend(), rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
