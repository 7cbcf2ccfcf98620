"""megatron-core optimizer and learning-rate schedule, with LIMe's router parameter group.

The paper (App. A, Table 2) trains the routers with their own learning rate (1e-2 against the
model's 1e-3) and without weight decay. megatron-core builds parameter groups from
``ParamKey -> ParamGroupOverride`` entries; the router weights carry the attribute
``is_lime_router`` (``router.ROUTER_PARAM_ATTR``) and get one override:

- ``max_lr`` = ``--lime-router-lr`` and ``min_lr`` = ``--min-lr`` x the same ratio, so the
  router follows the main warmup/decay schedule scaled by ``lr_mult = router lr / lr``;
- ``wd_mult`` = router weight decay / ``--weight-decay`` (0 by default).

The resume trap: megatron-core 0.16 matches saved and current parameter groups only by
``(wd_mult, lr_mult, is_expert_parallel, is_decoupled_lr)``. A router group that differed from
the no-weight-decay group (norms, biases) only in ``max_lr`` would collide with it on resume and
one group's state would silently replace the other's. ``lr_mult`` is therefore set to the real
ratio, which is distinct whenever the router's schedule differs; when the router's settings equal
an existing group's, its override is exactly that group's, and megatron merges them into one.
"""

from __future__ import annotations

import argparse

import torch
from megatron.core.optimizer import (
    MegatronOptimizer,
    OptimizerConfig,
    ParamKey,
    ParamPredicate,
    get_megatron_optimizer,
)
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from lime_megatron.arguments import params_dtype
from lime_megatron.router import ROUTER_PARAM_ATTR


def _is_router(param: torch.nn.Parameter) -> bool:
    return bool(getattr(param, ROUTER_PARAM_ATTR, False))


NO_WEIGHT_DECAY = ParamKey(
    name="*.bias",
    predicate=ParamPredicate(name="one_dim_not_router", fn=lambda p: p.dim() == 1 and not _is_router(p)),
)
"""megatron's usual no-decay set (biases and 1-D weights such as norms), routers excluded."""

ROUTER = ParamKey(attr=ROUTER_PARAM_ATTR)
"""The LIMe router weights."""


def optimizer_config(args: argparse.Namespace) -> OptimizerConfig:
    """megatron ``OptimizerConfig`` from the training flags (Adam is AdamW)."""
    dtype = params_dtype(args)
    return OptimizerConfig(
        optimizer=args.optimizer,
        lr=args.lr,
        min_lr=args.min_lr,
        weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2,
        adam_eps=args.adam_eps,
        sgd_momentum=args.sgd_momentum,
        clip_grad=args.clip_grad,
        bf16=args.bf16,
        fp16=args.fp16,
        params_dtype=dtype,
        loss_scale=args.loss_scale,
        initial_loss_scale=args.initial_loss_scale,
        min_loss_scale=args.min_loss_scale,
        loss_scale_window=args.loss_scale_window,
        hysteresis=args.hysteresis,
        use_distributed_optimizer=args.use_distributed_optimizer,
    )


def router_override(args: argparse.Namespace) -> dict:
    """The router group's ``ParamGroupOverride`` (empty when it matches the default group)."""
    override = {}
    if args.lime_router_weight_decay != args.weight_decay:
        override["wd_mult"] = args.lime_router_weight_decay / args.weight_decay if args.weight_decay else 0.0
    if args.lime_router_lr != args.lr:
        ratio = args.lime_router_lr / args.lr
        override.update(max_lr=args.lime_router_lr, min_lr=args.min_lr * ratio, lr_mult=ratio)
    return override


def param_group_overrides(args: argparse.Namespace) -> dict:
    """``config_overrides`` for ``get_megatron_optimizer``: no decay on biases and 1-D weights,
    and the LIMe router group."""
    overrides = {NO_WEIGHT_DECAY: {"wd_mult": 0.0}}
    if args.lime:
        routed = router_override(args)
        if routed:
            overrides[ROUTER] = routed
    return overrides


def build_optimizer(args: argparse.Namespace, model_chunks: list) -> MegatronOptimizer:
    """megatron's optimizer over this rank's DDP-wrapped ``model_chunks``."""
    return get_megatron_optimizer(optimizer_config(args), model_chunks,
                                  config_overrides=param_group_overrides(args))


def build_scheduler(args: argparse.Namespace, optimizer: MegatronOptimizer) -> OptimizerParamScheduler:
    """Warmup then ``--lr-decay-style`` decay to ``--min-lr`` (per group: its own max/min lr),
    constant weight decay. One scheduler step per iteration."""
    return OptimizerParamScheduler(
        optimizer,
        init_lr=args.lr_warmup_init,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters,
        lr_decay_steps=args.lr_decay_iters,
        lr_decay_style=args.lr_decay_style,
        start_wd=args.weight_decay,
        end_wd=args.weight_decay,
        wd_incr_steps=args.train_iters,
        wd_incr_style="constant",
    )


def group_learning_rates(optimizer: MegatronOptimizer, max_lr: float) -> dict[str, float]:
    """Current learning rate of the main schedule (``lr``, groups whose peak is ``max_lr``) and
    of the router group if it has its own schedule (``router_lr``)."""
    rates = {}
    for group in optimizer.param_groups:
        rates.setdefault("lr" if group["max_lr"] == max_lr else "router_lr", group["lr"])
    return rates
