"""megatron-core optimizer and learning-rate schedule, with LIMe's router parameter group.

The paper (App. A, Table 2) trains the routers with their own learning rate (1e-2 against the
model's 1e-3) and without weight decay. megatron-core builds parameter groups from
``ParamKey -> ParamGroupOverride`` entries; the router weights carry the attribute
``is_lime_router`` (``router.ROUTER_PARAM_ATTR``) and get one override:

- ``max_lr`` = ``--lime-router-lr`` and ``min_lr`` = ``--min-lr`` x the same ratio, so the
  router follows the main warmup/decay schedule scaled by ``lr_mult = router lr / lr``;
- ``wd_mult`` = router weight decay / ``--weight-decay`` (0 by default).

Biases and 1-D weights (norms) are not decayed (megatron's rule). ``--weight-decay-grouping
official`` also spares the word embedding, as the paper's own implementation did (its optimizer
groups follow minGPT: decay only the weights of linear layers); megatron decays embeddings. For
Hyper-Connections the official grouping is the official code's too: ``static_alpha`` and
``static_beta`` are not decayed, every ``dynamic_*`` parameter is (the 1-D ``dynamic_beta_fn`` and
the scales included); all of them train at the main learning rate. The ``megatron`` grouping applies
megatron's rule to them (1-D not decayed: ``static_beta``, ``dynamic_beta_fn``, the scales).

The resume trap: megatron-core 0.16 matches saved and current parameter groups only by
``(wd_mult, lr_mult, is_expert_parallel, is_decoupled_lr)``. A router group that differed from
the no-weight-decay group (norms, biases) only in ``max_lr`` would collide with it on resume and
one group's state would silently replace the other's. ``lr_mult`` is therefore set to the real
ratio, which is distinct whenever the router's schedule differs; when the router's settings equal
an existing group's, its override is exactly that group's, and megatron merges them into one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.optimizer import (
    MegatronOptimizer,
    OptimizerConfig,
    ParamKey,
    ParamPredicate,
    get_megatron_optimizer,
)
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.utils import get_model_config

from lime_megatron.choices import WEIGHT_DECAY_GROUPINGS
from lime_megatron.models.hyper_connections.connection import DYNAMIC_PARAM_ATTR, STATIC_PARAM_ATTR
from lime_megatron.models.lime.router import ROUTER_PARAM_ATTR


def _is_router(param: torch.nn.Parameter) -> bool:
    return bool(getattr(param, ROUTER_PARAM_ATTR, False))


NO_WEIGHT_DECAY = ParamKey(
    name="*.bias",
    predicate=ParamPredicate(name="one_dim_not_router", fn=lambda p: p.dim() == 1 and not _is_router(p)),
)
"""megatron's usual no-decay set (biases and 1-D weights such as norms), routers excluded."""

OFFICIAL_NO_WEIGHT_DECAY = ParamKey(
    name="*.bias",
    attr=STATIC_PARAM_ATTR,
    predicate=ParamPredicate(
        name="one_dim_not_router_not_dynamic_hyper_connection",
        fn=lambda p: p.dim() == 1 and not _is_router(p) and not getattr(p, DYNAMIC_PARAM_ATTR, False),
    ),
)
"""The official code's no-decay set: biases, 1-D weights (norms) but the dynamic hyper-connection
parameters, and the static hyper-connection parameters (2-D ``static_alpha`` included)."""

ROUTER = ParamKey(attr=ROUTER_PARAM_ATTR)
"""The LIMe router weights."""

EMBEDDING = ParamKey(name="*embedding.word_embeddings.weight", attr="shared_embedding")
"""The word embedding, and the last pipeline stage's copy of it when the output layer is tied to
it (megatron marks both copies ``shared_embedding``; an untied output layer is not included)."""


@dataclass(frozen=True)
class RouterGroup:
    """The LIMe routers' own learning rate and weight decay (paper Table 2: 1e-2 and 0)."""

    lr: float
    weight_decay: float = 0.0


@dataclass(frozen=True)
class LRSchedule:
    """Linear warmup from ``init_lr`` to ``max_lr`` over ``warmup_iters``, then ``decay_style``
    decay to ``min_lr`` at ``decay_iters`` (megatron's ``OptimizerParamScheduler``); constant
    ``weight_decay`` over the run's ``train_iters`` (megatron records that length in checkpoints;
    default ``decay_iters``)."""

    max_lr: float
    decay_iters: int
    train_iters: int | None = None
    min_lr: float = 0.0
    init_lr: float = 0.0
    warmup_iters: int = 0
    decay_style: str = "linear"
    weight_decay: float = 0.0


def router_override(config: OptimizerConfig, router: RouterGroup) -> dict:
    """The router group's ``ParamGroupOverride`` (empty when it matches the default group)."""
    override = {}
    if router.weight_decay != config.weight_decay:
        override["wd_mult"] = router.weight_decay / config.weight_decay if config.weight_decay else 0.0
    if router.lr != config.lr:
        ratio = router.lr / config.lr
        override.update(max_lr=router.lr, min_lr=config.min_lr * ratio, lr_mult=ratio)
    return override


def param_group_overrides(
    config: OptimizerConfig, router: RouterGroup | None = None, weight_decay_grouping: str = "megatron"
) -> dict:
    """``config_overrides`` for ``get_megatron_optimizer``: no decay on biases and 1-D weights
    (and, for the ``official`` grouping, on the word embedding; the official code's rule for
    hyper-connection parameters), and the LIMe router group
    (``router`` None: the LLaMA baseline, no routers)."""
    if weight_decay_grouping not in WEIGHT_DECAY_GROUPINGS:
        raise ValueError(
            f"unknown weight-decay grouping {weight_decay_grouping!r}; choose one of {WEIGHT_DECAY_GROUPINGS}"
        )
    if weight_decay_grouping == "official":
        overrides = {OFFICIAL_NO_WEIGHT_DECAY: {"wd_mult": 0.0}, EMBEDDING: {"wd_mult": 0.0}}
    else:
        overrides = {NO_WEIGHT_DECAY: {"wd_mult": 0.0}}
    if router is not None:
        routed = router_override(config, router)
        if routed:
            overrides[ROUTER] = routed
    return overrides


def build_optimizer(
    model_chunks: list,
    config: OptimizerConfig,
    router: RouterGroup | None = None,
    weight_decay_grouping: str = "megatron",
) -> MegatronOptimizer:
    """megatron's optimizer over this rank's DDP-wrapped ``model_chunks`` with the parameter
    groups of :func:`param_group_overrides`; the chunks' schedule scales the loss with it (fp16
    loss scaling)."""
    overrides = param_group_overrides(config, router, weight_decay_grouping)
    optimizer = get_megatron_optimizer(config, model_chunks, config_overrides=overrides)
    get_model_config(model_chunks[0]).grad_scale_func = optimizer.scale_loss
    return optimizer


def build_scheduler(optimizer: MegatronOptimizer, schedule: LRSchedule) -> OptimizerParamScheduler:
    """``schedule`` for every parameter group (each with its own max/min lr). One scheduler step
    per iteration."""
    return OptimizerParamScheduler(
        optimizer,
        init_lr=schedule.init_lr,
        max_lr=schedule.max_lr,
        min_lr=schedule.min_lr,
        lr_warmup_steps=schedule.warmup_iters,
        lr_decay_steps=schedule.decay_iters,
        lr_decay_style=schedule.decay_style,
        start_wd=schedule.weight_decay,
        end_wd=schedule.weight_decay,
        wd_incr_steps=schedule.train_iters or schedule.decay_iters,
        wd_incr_style="constant",
    )


def group_learning_rates(optimizer: MegatronOptimizer, max_lr: float) -> dict[str, float]:
    """Current learning rate of the main schedule (``lr``, groups whose peak is ``max_lr``) and
    of the router group if it has its own schedule (``router_lr``)."""
    rates: dict[str, float] = {}
    for group in optimizer.param_groups:
        rates.setdefault("lr" if group["max_lr"] == max_lr else "router_lr", group["lr"])
    return rates
