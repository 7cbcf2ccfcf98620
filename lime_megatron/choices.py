"""The values the run's options choose among, and the rule of the router options: what the
command-line parsers need from the model, planning and training modules, without those modules'
imports (torch, megatron-core), so that ``--help`` and a wrong option are answered at once.

Each module that acts on a choice imports it from here (``models.config`` the router rule,
``models.initialization`` the init styles, ``planning.routing_block`` the machine names,
``training.optimizer`` the weight-decay groupings); ``inference.scoring.TASKS`` holds one entry per
generation task (``tests/training/test_arguments.py`` checks). This module imports nothing of the
package.
"""

from __future__ import annotations

ROUTER_VARIANTS = ("full", "average", "last", "first", "dynamic")
"""Router variants of App. D: ``full`` (learned, all earlier layers), ``average`` (fixed uniform
average, no parameters), ``last`` (learned, the last ``window`` layers up to and including the
current one) and ``first`` (learned, the first ``window`` layers plus the current one); and v1's
``dynamic`` (per-token softmax weights over all earlier layers, ``models.lime.dynamic_router``)."""

DEFAULT_ROUTER = "full"
"""The router variant of a LIMe model that names none (``LimeTransformerConfig.lime_router``)."""

WINDOWED_VARIANTS = ("last", "first")

INIT_STYLES = ("megatron", "official")
"""Initial weight distributions (``lime_megatron.models.initialization``)."""

ATTENTION_BACKENDS = ("auto", "fused", "flash")
"""TransformerEngine attention backends a run may ask for (megatron's ``AttnBackend`` names)."""

MACHINE_NAMES = ("h100", "h100-pcie", "h200", "a100", "a100-40gb", "cpu")
"""Machines ``--lime-machine`` names besides ``auto`` (``planning.routing_block.MACHINES``)."""

ROUTING_KERNELS = ("auto", "triton", "torch")
"""``--lime-routing-kernel``: the routing products as Triton kernels (``lime_megatron.kernels``) or
as torch operators; ``auto`` takes Triton on CUDA where the kernels cover the run
(``kernels.routing_path``)."""

WEIGHT_DECAY_GROUPINGS = ("megatron", "official")
"""``--weight-decay-grouping``: ``megatron`` decays every weight but biases and 1-D weights (norms),
embedding included; ``official`` (the paper's implementation, minGPT's rule) also spares the
word embedding (and so a tied output layer)."""

GENERATION_TASKS = ("arithmetic", "prosqa")
"""Tasks scored by generation (``inference.scoring.TASKS``)."""


class LimeConfigError(ValueError):
    """A LIMe configuration that cannot be built."""


def validate_router(router: str, window: int | None, *, flags: bool = False) -> None:
    """The rules of the router options, for the config and the trainer's flags alike: a known
    variant (``ROUTER_VARIANTS``), a window >= 1 for the windowed ones and none for the others.
    Raises one ``LimeConfigError``; ``flags`` names the options as command-line flags."""
    router_name, window_name = (
        ("--lime-router", "--lime-router-window") if flags else ("LIMe router", "lime_router_window")
    )
    if router not in ROUTER_VARIANTS:
        raise LimeConfigError(f"unknown LIMe router variant {router!r}; choose one of {ROUTER_VARIANTS}")
    if router in WINDOWED_VARIANTS:
        if window is None or window < 1:
            raise LimeConfigError(f"{router_name} {router} needs {window_name} >= 1, got {window}")
    elif window is not None:
        raise LimeConfigError(
            f"{window_name} {window} only applies to the {'/'.join(WINDOWED_VARIANTS)} routers, not to {router}"
        )
