"""Third-party warnings and log messages known to be harmless here, and the calls that filter them.

``lime_megatron.cli`` calls :func:`ignore` before any command imports megatron-core or torch, so
the commands print none of :data:`HARMLESS` and :data:`HARMLESS_LOGS`;
``lime_megatron.parallel.compat.enable_cpu_support`` calls :func:`ignore_cpu_notices` on CPU runs
only. pyproject.toml's pytest ``filterwarnings`` holds the same warning filters for the test run
(``tests/test_harmless_warnings.py`` checks that they agree). Each entry says why it is harmless.
Warning options set by the user (``python -W``, ``PYTHONWARNINGS``) win: with any of them set
nothing is filtered, so ``PYTHONWARNINGS=default lime-pretrain ...`` shows everything. Anything
not listed here is shown as usual.
"""

from __future__ import annotations

import logging
import sys
import warnings
from typing import NamedTuple


class Harmless(NamedTuple):
    """One filter: the warnings of ``category`` whose text starts with ``message`` (a regular
    expression, case-insensitive) raised from a module whose name starts with ``module``."""

    category: type[Warning]
    message: str
    module: str
    why: str


HARMLESS = (
    Harmless(
        UserWarning,
        "Transformer Engine and Apex are not installed",
        r"megatron\.core",
        "megatron-core falls back to torch's optimizers and multi-tensor kernels, the ones this "
        "project uses with --transformer-impl local; Transformer Engine (the gpu extra) and Apex are "
        "optional GPU speed-ups",
    ),
    Harmless(
        UserWarning,
        "Apex is not installed",
        r"megatron\.core",
        "torch's LayerNorm/RMSNorm replaces Apex's fused kernels: the same norm",
    ),
    Harmless(
        UserWarning,
        "full scope is deprecated",
        r"megatron\.core\.transformer",
        "megatron-core 0.16's own default cuda_graph_scope ('full') deprecated by itself; this "
        "project captures no CUDA graphs",
    ),
    Harmless(
        FutureWarning,
        "`load_state_dict` is deprecated",
        r"megatron\.core\.dist_checkpointing",
        "megatron-core's checkpoint loader calls torch.distributed.checkpoint.load by its old name, "
        "which torch keeps as an alias of the same function",
    ),
    Harmless(
        FutureWarning,
        "Please use DTensor instead and we are deprecating ShardedTensor",
        r"torch\.distributed",
        "torch's checkpoint planner noting that it handles megatron-core's ShardedTensor state "
        "dicts, which megatron-core writes and reads with it",
    ),
    Harmless(
        FutureWarning,
        "`torch.distributed.reduce_scatter_tensor` is deprecated",
        r"torch\.distributed",
        "torch 2.13 renames it reduce_scatter_single; megatron-core and LIMe's head-parallel routing "
        "call the name that every torch >= 2.4 has, the same collective",
    ),
    Harmless(
        FutureWarning,
        "`torch.distributed.all_gather_into_tensor` is deprecated",
        r"torch\.distributed",
        "torch 2.13 renames it all_gather_single; as for reduce_scatter_tensor",
    ),
    Harmless(
        UserWarning,
        "The .grad attribute of a Tensor that is not a leaf Tensor is being accessed",
        r"megatron\.core\.optimizer",
        "the distributed optimizer's zero_grad also visits its fp32 shards, slices of the "
        "parameters that never hold a .grad (megatron-core's own comment there: 'throws "
        "grad-access warning'); the gradients live in the parameters' main_grad buffers",
    ),
    Harmless(
        UserWarning,
        "MimoModelConfig is experimental",
        r"megatron\.core\.models\.mimo",
        "megatron-core 0.19 announces an experimental API of its own as it imports it; this project does not use it",
    ),
    Harmless(
        UserWarning,
        "torch.distributed is disabled, unavailable or uninitialized, assuming the intent is to load",
        r"torch\.distributed\.checkpoint",
        "megatron-core 0.19's checkpoint loader reads each rank's shards without collectives on purpose (no_dist=True)",
    ),
    Harmless(
        UserWarning,
        "The argument order of load has been changed",
        r"torch\.distributed\.checkpoint",
        "megatron-core 0.19 passes the storage reader to torch.distributed.checkpoint.load by "
        "position, which torch maps to the keyword",
    ),
)
"""Filtered in every process of the commands and in the test run."""

CPU_NOTICES = (
    Harmless(
        UserWarning,
        "When using .+ it is recommended to set the environment variable CUDA_DEVICE_MAX_CONNECTIONS",
        r"megatron\.core\.tensor_parallel",
        "a speed hint about the order of CUDA kernels on one hardware queue; a CPU run has no CUDA "
        "queues (on a GPU it is shown: examples/launch.sh sets the variable)",
    ),
)
"""Filtered on CPU runs only (they are about GPUs)."""


class HarmlessLog(NamedTuple):
    """The records of the logger named ``logger`` whose message starts with ``message``."""

    logger: str
    message: str
    why: str

    def filter(self, record: logging.LogRecord) -> bool:
        """The ``logging.Filter`` protocol: False (drop) for a matching record."""
        return not record.getMessage().startswith(self.message)


HARMLESS_LOGS = (
    HarmlessLog(
        "megatron.core.models.gpt.gpt_model",
        "GPTModel IS DEPRECATED",
        "megatron-core 0.19 deprecates GPTModel for HybridModel but keeps it (critical fixes "
        "only); this project's models build on it with 0.16 and 0.19 alike, and moving them is the "
        "project's job, not the user's",
    ),
    HarmlessLog(
        "megatron.core.dist_checkpointing.strategies.torch",
        "MCore's async save is deprecated",
        "megatron-core 0.19's synchronous save runs through its own deprecated asynchronous path; "
        "this project saves synchronously",
    ),
    HarmlessLog(
        "megatron.core.datasets.gpt_dataset",
        "Unable to save MockGPTDataset indexes",
        "--mock-data draws random documents: there is no index worth caching",
    ),
    HarmlessLog(
        "torch.utils.cpp_extension",
        "No CUDA runtime is found",
        "torch's CUDA build on a machine without a GPU (logged when megatron-core imports torch's "
        "extension builder): only building CUDA extensions would need the runtime, and nothing "
        "here builds one",
    ),
)
"""Dropped from megatron-core's and torch's logs in every process of the commands."""


def ignore() -> None:
    """Filter :data:`HARMLESS` and :data:`HARMLESS_LOGS` in this process, unless the user set
    warning options."""
    if sys.warnoptions:
        return
    _ignore(HARMLESS)
    for harmless in HARMLESS_LOGS:
        logging.getLogger(harmless.logger).addFilter(harmless)


def ignore_cpu_notices() -> None:
    """Filter :data:`CPU_NOTICES` in this process, unless the user set warning options."""
    if not sys.warnoptions:
        _ignore(CPU_NOTICES)


def _ignore(filters: tuple[Harmless, ...]) -> None:
    for harmless in filters:
        warnings.filterwarnings("ignore", harmless.message, harmless.category, harmless.module)
