"""bf16 training on CPU follows the float32 run (gloo; 1 and 4 processes).

What a GPU run does in bf16, run here on CPU through the trainer's functions
(``build_model_chunks``: megatron's ``Float16Module``; ``build_optimizer`` with ``bf16=True``:
megatron's mixed-precision optimizers with fp32 main parameters, plain and distributed): LIMe and
the LLaMA baseline, single process, TP=2 + SP (data-parallel 2), PP=2 x VPP=2 (data-parallel 2)
and TP=2 + SP with the distributed optimizer, three Adam steps each, from the float32 run's
initial weights, against the single-process float32 run.

Dtypes checked: model parameters are bf16 (``Float16Module`` casts the whole model, as on GPU)
but the learned LIMe routers, which the trainer keeps in float32 (``keep_routers_in_float32``: their
gradient is accumulated in float32 and reaches ``main_grad`` unrounded); every parameter the
optimizer updates is an fp32 main copy; the gradients are reduced into fp32 ``main_grad`` buffers
(``grad_reduce_in_fp32``); the routed keys/values reaching the core attention, and so the memory
buffer they are mixed from, are bf16.

Tolerances (bf16 keeps 8 significant bits: unit roundoff u = 2^-8 ~ 3.9e-3):

- gradient, relative Frobenius error at the first step (same weights up to bf16 rounding):
  ``GRAD_TOLERANCE`` = 5u ~ 2e-2.  Every gradient is a sum over tokens of products of factors that
  each went through a few bf16 roundings (the activation, the incoming gradient, the product's
  output), each off by up to u/2 relative; a few such stages give a few u (measured: 1.2e-2 to
  1.3e-2 in every layout, LIMe and the baseline alike, ``BENCHMARKS.md``).
- loss, relative, every step: ``LOSS_TOLERANCE`` = u/2 ~ 2e-3, one rounding of the loss itself.
  The mean over the batch's 256 tokens averages per-token errors of a few u with independent signs,
  which shrinks them by about sqrt(256) = 16 (measured: 1e-4 to 7e-4 over the three steps).

A mutation (the routed keys/values rounded to 4 significant bits instead of 8, one eighth of
bf16's precision on LIMe's own path) must exceed them (measured: gradient error 2.6e-2).
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

from lime_megatron.testing import distributed as dist
from lime_megatron.testing.distributed import Layout
from tests.parallel.test_lime_tensor_parallel import router_rule

VOCAB, SEQ, MICRO_BATCHES, STEPS, LR = 64, 16, 4, 3, 1e-2
UNIT_ROUNDOFF = 2.0**-8
LOSS_TOLERANCE = UNIT_ROUNDOFF / 2
GRAD_TOLERANCE = 5 * UNIT_ROUNDOFF
MODELS = {"lime": dict(lime=True), "llama": dict(lime=False)}
LAYOUTS = [(Layout(tp=2, sp=True), False), (Layout(pp=2, vpp=2), False), (Layout(tp=2, sp=True), True)]
"""(layout, distributed optimizer); the distributed optimizer's reduce-scattered gradients are not
gathered (each data-parallel rank holds its shard only): its runs compare losses and dtypes."""
CASES = [f"{layout.name}{'-distopt' if distributed else ''}" for layout, distributed in [(Layout(), False), *LAYOUTS]]


def make_config(layout: Layout, bf16: bool, **model):
    from lime_megatron.models.config import lime_config

    precision = dict(bf16=True, pipeline_dtype=torch.bfloat16) if bf16 else {}
    settings = dict(
        num_layers=4,
        hidden_size=32,
        ffn_hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        deallocate_pipeline_outputs=layout.pp > 1,
    )
    return lime_config(
        use_cpu_initialization=True, **settings, **model, **{**dist.layout_config_kwargs(layout), **precision}
    )


def adam(chunks, bf16: bool, distributed: bool):
    """The trainer's optimizer (megatron's, with the LIMe router group) as Adam at a constant lr."""
    from megatron.core.optimizer import OptimizerConfig

    from lime_megatron.training.optimizer import LRSchedule, RouterGroup, build_optimizer, build_scheduler

    config = OptimizerConfig(
        optimizer="adam",
        lr=LR,
        min_lr=0.0,
        weight_decay=0.0,
        clip_grad=0.0,
        bf16=bf16,
        params_dtype=torch.float32,
        use_distributed_optimizer=distributed,
    )
    optimizer = build_optimizer(chunks, config, RouterGroup(lr=LR))
    return optimizer, build_scheduler(optimizer, LRSchedule(max_lr=LR, decay_iters=STEPS, decay_style="constant"))


def optimized_dtypes(optimizer) -> set:
    """Dtypes of every parameter the optimizer's inner torch optimizers update (the main params)."""
    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    return {param.dtype for part in inner for group in part.optimizer.param_groups for param in group["params"]}


def attention_key_dtypes(chunks) -> set:
    """Hook every core attention; the returned set fills with the dtypes of the keys it receives."""
    from megatron.core.utils import unwrap_model

    seen = set()
    for chunk in chunks:
        for module in unwrap_model(chunk).modules():
            if hasattr(module, "core_attention"):
                module.core_attention.register_forward_pre_hook(lambda _, args: seen.add(args[1].dtype))
    return seen


def train(layout: Layout, model: dict, bf16: bool, distributed: bool = False, weights=None) -> dict:
    """``STEPS`` Adam steps; the losses, the first step's full gradients, the initial weights and the dtypes."""
    from lime_megatron.training.trainer import build_model_chunks, train_step

    dist.initialize_layout(layout)
    config = make_config(layout, bf16, **model)
    rules = partial(router_rule, config)
    chunks = build_model_chunks(config, VOCAB, SEQ, use_distributed_optimizer=distributed)
    if weights is not None:
        dist.load_full(chunks, weights, rules)
    optimizer, scheduler = adam(chunks, bf16, distributed)
    initial = dist.gather_full(chunks, extra_shard_rules=rules)
    keys = attention_key_dtypes(chunks)
    batches = dist.data_parallel_share(dist.make_batches(MICRO_BATCHES, 2, SEQ, VOCAB))
    losses, grads = [], None
    for _ in range(STEPS):
        losses.append(train_step(chunks, optimizer, scheduler, batches)[0])
        if grads is None and not distributed:
            grads = dist.gather_full(chunks, select=lambda p: p.main_grad, extra_shard_rules=rules)
    routers = [p for chunk in chunks for p in chunk.parameters() if getattr(p, "is_lime_router", False)]
    return dict(
        losses=losses,
        grads=grads,
        initial=initial,
        keys=keys,
        params={p.dtype for chunk in chunks for p in chunk.parameters() if all(p is not r for r in routers)},
        routers={p.dtype for p in routers},
        main_grads={p.main_grad.dtype for chunk in chunks for p in chunk.parameters()},
        optimized=optimized_dtypes(optimizer),
    )


def differences(run: dict, reference: dict) -> dict:
    """Worst relative loss difference over the steps and relative gradient error at the first step."""
    ref, grads = reference["grads"], run["grads"] or reference["grads"]
    return dict(
        loss=max(abs(a - b) / abs(b) for a, b in zip(run["losses"], reference["losses"])),
        grad=max(((grads[n] - ref[n]).norm() / ref[n].norm()).item() for n in ref) if run["grads"] else None,
        names=set(grads) == set(ref),
        dtypes=dict(
            params=run["params"],
            routers=run["routers"],
            main_grads=run["main_grads"],
            optimized=run["optimized"],
            keys=run["keys"],
        ),
    )


def single_process_runs() -> dict:
    """fp32 references and the single-process bf16 runs (and the mutation) of both models."""
    from lime_megatron.models.lime.static_routing import StaticRouting

    runs = {}
    for name, model in MODELS.items():
        runs[f"{name} fp32"] = train(Layout(), model, bf16=False)
        weights = runs[f"{name} fp32"]["initial"]
        runs[f"{name} bf16 tp1-pp1"] = train(Layout(), model, bf16=True, weights=weights)
    mix = StaticRouting.mix
    StaticRouting.mix = lambda self, *args: tuple(map(round_to_4_bits, mix(self, *args)))
    try:
        runs["mutation"] = train(Layout(), MODELS["lime"], bf16=True, weights=runs["lime fp32"]["initial"])
    finally:
        StaticRouting.mix = mix
    return runs


def round_to_4_bits(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` with 4 significant bits (bf16 keeps 8), through the graph unchanged."""
    mantissa, exponent = torch.frexp(tensor.detach().float())
    rounded = torch.ldexp(torch.round(mantissa * 16) / 16, exponent).to(tensor.dtype)
    return tensor + (rounded - tensor).detach()


def layout_runs(references: dict) -> dict:
    return {
        f"{name} bf16 {case}": train(layout, model, bf16=True, distributed=distributed, weights=references[name])
        for name, model in MODELS.items()
        for case, (layout, distributed) in zip(CASES[1:], LAYOUTS)
    }


@pytest.fixture(scope="module")
def runs() -> dict:
    single = dist.run_distributed(single_process_runs, 1)[0]
    weights = {name: single[f"{name} fp32"]["initial"] for name in MODELS}
    launched = dist.run_distributed(layout_runs, 4, weights, timeout=900, nccl_rules=True)[0]
    return {**single, **launched}


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("case", CASES)
def test_bf16_run_follows_the_fp32_run(runs, model, case):
    result = differences(runs[f"{model} bf16 {case}"], runs[f"{model} fp32"])
    print(f"{model} {case}: relative loss difference {result['loss']:.1e}, relative gradient error {result['grad']}")
    assert result["names"]
    assert result["loss"] <= LOSS_TOLERANCE
    assert ("distopt" in case) == (result["grad"] is None)
    assert result["grad"] is None or result["grad"] <= GRAD_TOLERANCE
    routers = {torch.float32} if model == "lime" else set()  # ``keep_routers_in_float32``
    assert result["dtypes"] == dict(
        params={torch.bfloat16},
        routers=routers,
        main_grads={torch.float32},
        optimized={torch.float32},
        keys={torch.bfloat16},
    )


def test_fp32_run_keeps_fp32_everywhere(runs):
    result = differences(runs["lime fp32"], runs["lime fp32"])
    assert result["dtypes"] == dict(
        params={torch.float32},
        routers={torch.float32},
        main_grads={torch.float32},
        optimized={torch.float32},
        keys={torch.float32},
    )


def test_coarser_routed_keys_values_exceed_the_tolerance(runs):
    result = differences(runs["mutation"], runs["lime fp32"])
    print(
        f"routed K/V with 4 significant bits: relative loss difference {result['loss']:.1e}, "
        f"relative gradient error {result['grad']:.1e}"
    )
    assert result["loss"] > LOSS_TOLERANCE or result["grad"] > GRAD_TOLERANCE
