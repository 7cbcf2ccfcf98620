"""Hyper-Connections under every parallel layout equal the single-stage run (CPU, gloo, 4 processes).

In float64 (weights, activations, stage tensors and megatron's gradient buffers): in float32 the
gradients of the 1-element dynamic scales, sums over positions that cancel, differ by ~2e-4
between a float32 and a float64 single process already.
The streams cross pipeline stages as megatron's own stage tensor ``[s, b * n, hidden]``, are
sequence-sharded under SP, and the hyper-connection parameters are replicated across TP. Against
the single-stage model from the same initial weights (loss and every gradient, hyper-connection
parameters included, over two SGD steps; replicated copies must agree across ranks): TP=2 + SP,
PP=2, PP=2 x VPP=2, PP=4, TP=2 x PP=2 x VPP=2 + SP (with megatron's overlap_p2p_comm too), full and
selective recompute, dynamic and static, n = 4 and 2, MHA and GQA; mHC (manifold-constrained, n = 4,
GQA) at the same layouts and recomputes. DP=2 with megatron's distributed optimizer (Adam) against
the plain optimizer, HC and mHC: losses and weights over three steps (every weight matrix moved; the
1-element gates' float32 updates, their gradients being cancelling sums, can round away). A
distributed checkpoint saved at TP=2 x PP=2 x VPP=2 loads at PP=1 and PP=4 x VPP=2 with the same loss.
The default suite runs ``CASES`` (each model and recompute, most at TP=2 x PP=2 x VPP=2 + SP);
the slow suite the rest of the matrix, ``SLOW_CASES``.
"""

from __future__ import annotations

import pytest
import torch

from lime_megatron.testing.distributed import (
    Layout,
    data_parallel_share,
    gather_full,
    initialize_layout,
    layout_config_kwargs,
    make_batches,
    run_distributed,
)
from tests.parallel import layout_cases
from tests.parallel.test_lime_tensor_parallel import build_chunks, sgd

VOCAB, SEQ, MICRO_BATCHES, STEPS, LR = 64, 16, 4, 2, 0.5
TOLERANCE = 1e-5
SCALE_TOLERANCE = 1e-3
"""For the 1-element ``dynamic_*_scale`` gradients only: sums over every position that cancel, fed by
megatron's float32 cross-entropy (``vocab_parallel_cross_entropy`` casts the logits to float32, and
TP splits its vocabulary reductions), so they carry float32 rounding even in a float64 model."""

FULL_RECOMPUTE = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
HC4 = dict(hyper_connections=4)
HC2_STATIC_GQA = dict(hyper_connections=2, hyper_connections_static=True, num_query_groups=2)
MHC4_GQA = dict(hyper_connections=4, hyper_connections_manifold=True, num_query_groups=2)
TP2_PP2_VPP2_SP = Layout(tp=2, pp=2, vpp=2, sp=True)
CASES = [  # (name, model settings, layouts[, pipeline options left out of the single-stage reference])
    ("hc4", HC4, [TP2_PP2_VPP2_SP, Layout(pp=4)]),
    ("hc4-overlap", HC4, [TP2_PP2_VPP2_SP], dict(overlap_p2p_comm=True, batch_p2p_comm=False)),
    ("hc2-static-gqa", HC2_STATIC_GQA, [Layout(pp=4)]),
    ("hc4-gqa-full-recompute", dict(HC4, num_query_groups=2, **FULL_RECOMPUTE), [Layout(pp=2, vpp=2)]),
    ("mhc4-gqa", MHC4_GQA, [TP2_PP2_VPP2_SP]),
    ("mhc4-gqa-full-recompute", dict(MHC4_GQA, **FULL_RECOMPUTE), [Layout(pp=2, vpp=2)]),
]
SLOW_CASES = [  # the rest of the matrix, in the slow suite
    ("hc4", HC4, [Layout(tp=2, sp=True), Layout(pp=2), Layout(pp=2, vpp=2)]),
    ("hc2-static-gqa", HC2_STATIC_GQA, [TP2_PP2_VPP2_SP]),
    ("hc4-gqa-full-recompute", dict(HC4, num_query_groups=2, **FULL_RECOMPUTE), [Layout(pp=4)]),
    ("hc4-selective-recompute", dict(HC4, recompute_granularity="selective"), [TP2_PP2_VPP2_SP]),
    ("mhc4-gqa", MHC4_GQA, [Layout(tp=2, sp=True), Layout(pp=2), Layout(pp=2, vpp=2), Layout(pp=4)]),
    ("mhc4-gqa-selective-recompute", dict(MHC4_GQA, recompute_granularity="selective"), [TP2_PP2_VPP2_SP]),
]


def make_config(layout: Layout, dtype: torch.dtype = torch.float64, **model):
    from lime_megatron.models.config import lime_config

    settings = dict(
        num_layers=8,
        hidden_size=32,
        ffn_hidden_size=64,
        num_attention_heads=4,
        num_query_groups=4,
        lime=False,
        deallocate_pipeline_outputs=layout.pp > 1,
    )
    settings.update(model)
    precision = dict(params_dtype=dtype, pipeline_dtype=dtype)
    return lime_config(use_cpu_initialization=True, **{**layout_config_kwargs(layout), **precision, **settings})


def perturbed(chunks) -> None:
    """Move the hyper-connection parameters off their initial values (the same on every rank:
    seeded by name), so the dynamic weights and every mixing coefficient matter."""
    from lime_megatron.testing.distributed import global_names

    with torch.no_grad():
        for chunk in chunks:
            for name, param in global_names(chunk).items():
                if ".hc_" in name:
                    generator = torch.Generator().manual_seed(sum(map(ord, name)))
                    param.add_(0.3 * torch.randn(param.shape, generator=generator))


def train(layout: Layout, model: dict, weights=None, stages: dict | None = None):
    """``STEPS`` SGD steps; returns (losses, [full grads per step], initial full weights)."""
    from lime_megatron.training.trainer import train_step

    initialize_layout(layout)
    chunks = build_chunks(make_config(layout, **model, **(stages or {})), weights)
    if weights is None:
        perturbed(chunks)
    optimizer, scheduler = sgd(chunks, LR, STEPS)
    initial = gather_full(chunks)
    batches = data_parallel_share(make_batches(MICRO_BATCHES, 2, SEQ, VOCAB))
    losses, grads = [], []
    for _ in range(STEPS):
        losses.append(train_step(chunks, optimizer, scheduler, batches)[0])
        grads.append(gather_full(chunks, select=lambda p: p.main_grad))
    return losses, grads, initial


def compare(layout: Layout, model: dict, reference, stages: dict | None = None) -> dict:
    """Worst loss and relative gradient differences of ``layout`` against ``reference``."""
    ref_losses, ref_grads, weights = reference
    losses, grads, _ = train(layout, model, weights, stages)
    errors = {
        n: max(((g[n] - r[n]).norm() / r[n].norm()).item() for g, r in zip(grads, ref_grads)) for n in ref_grads[0]
    }
    return dict(
        loss=max(abs(a - b) for a, b in zip(losses, ref_losses)),
        grad=max(error for n, error in errors.items() if not is_scale(n)),
        scale=max((error for n, error in errors.items() if is_scale(n) and n != FLAT_GRADIENT), default=0.0),
        flat=max(
            (
                (g[FLAT_GRADIENT] - r[FLAT_GRADIENT]).abs().max().item()
                for g, r in zip(grads, ref_grads)
                if FLAT_GRADIENT in r
            ),
            default=0.0,
        ),
        connections=sum(".hc_" in name for name in ref_grads[0]),
        names=set(grads[0]) == set(ref_grads[0]),
    )


FLAT_GRADIENT = "decoder.layers.0.hc_attn.alpha_res"
"""mHC's first residual gate: layer 0's streams are equal copies, which a column-stochastic mixing
leaves unchanged, so its gradient is zero up to rounding and is compared absolutely."""


def is_scale(name: str) -> bool:
    """The 1-element gates: HC's dynamic scales, mHC's ``alpha_pre``/``alpha_post``/``alpha_res``."""
    return name.endswith(("dynamic_alpha_scale", "dynamic_beta_scale", "alpha_pre", "alpha_post", "alpha_res"))


def adam_run(layout: Layout, distributed_optimizer: bool, model: dict, weights=None):
    """Three Adam steps (eps 1: an update smooth in the gradient, so float32 rounding stays small);
    (losses, final full weights, initial full weights)."""
    from megatron.core.optimizer import OptimizerConfig

    from lime_megatron.training.optimizer import LRSchedule, build_optimizer, build_scheduler
    from lime_megatron.training.trainer import build_model_chunks, train_step

    initialize_layout(layout)
    config = make_config(layout, torch.float32, **model)
    chunks = build_model_chunks(config, VOCAB, SEQ, use_distributed_optimizer=distributed_optimizer)
    if weights is None:
        perturbed(chunks)
    else:
        from lime_megatron.testing.distributed import load_full

        load_full(chunks, weights)
    initial = gather_full(chunks)
    settings = OptimizerConfig(
        optimizer="adam",
        lr=0.01,
        adam_eps=1.0,
        weight_decay=0.0,
        clip_grad=0.0,
        params_dtype=torch.float32,
        use_distributed_optimizer=distributed_optimizer,
    )
    optimizer = build_optimizer(chunks, settings)
    scheduler = build_scheduler(optimizer, LRSchedule(max_lr=0.01, decay_iters=3, decay_style="constant"))
    batches = data_parallel_share(make_batches(MICRO_BATCHES, 2, SEQ, VOCAB))
    losses = [train_step(chunks, optimizer, scheduler, batches)[0] for _ in range(3)]
    return losses, gather_full(chunks), initial


def distributed_optimizer_checks(name: str, model: dict) -> dict:
    """DP=2 (with TP=2 + SP, and with PP=2) under the distributed optimizer against the plain one."""
    ref_losses, ref_weights, initial = adam_run(Layout(), False, model)
    report = {}
    for layout in (Layout(tp=2, sp=True), Layout(pp=2)):
        losses, weights, _ = adam_run(layout, True, model, initial)
        report[f"{name} {layout.name}-dp2 distributed optimizer"] = dict(
            loss=max(abs(a - b) for a, b in zip(losses, ref_losses)),
            weights=max(((weights[n] - ref_weights[n]).norm() / ref_weights[n].norm()).item() for n in ref_weights),
            unmoved=[n for n in ref_weights if ref_weights[n].dim() > 1 and torch.equal(ref_weights[n], initial[n])],
        )
    return report


def loss_after_loading(layout: Layout, checkpoint: str) -> float:
    """Loss of a fresh HC model at ``layout`` (other initial weights) after loading ``checkpoint``."""
    from megatron.core import dist_checkpointing

    from lime_megatron.training.trainer import forward_backward

    initialize_layout(layout)
    chunks = build_chunks(make_config(layout, **HC4, init_seed=100 + layout.pp))
    if checkpoint:
        state = {f"model{index}": chunk.module.sharded_state_dict() for index, chunk in enumerate(chunks)}
        loaded = dist_checkpointing.load(state, checkpoint)
        for index, chunk in enumerate(chunks):
            chunk.module.load_state_dict(loaded[f"model{index}"])
    else:
        perturbed(chunks)
    return forward_backward(chunks, data_parallel_share(make_batches(MICRO_BATCHES, 2, SEQ, VOCAB)))


def reshard_checkpoint(directory: str):
    """Save at TP=2 x PP=2 x VPP=2 (hyper-connections off their initial values), load at PP=1 and
    PP=4 x VPP=2: (saved loss, [loaded losses], fresh-model loss)."""
    from megatron.core import dist_checkpointing

    from lime_megatron.training.trainer import forward_backward

    layout = Layout(tp=2, pp=2, vpp=2)
    initialize_layout(layout)
    chunks = build_chunks(make_config(layout, **HC4))
    perturbed(chunks)
    saved = forward_backward(chunks, data_parallel_share(make_batches(MICRO_BATCHES, 2, SEQ, VOCAB)))
    dist_checkpointing.save(
        {f"model{index}": chunk.module.sharded_state_dict() for index, chunk in enumerate(chunks)}, directory
    )
    torch.distributed.barrier()
    loaded = [loss_after_loading(target, directory) for target in (Layout(), Layout(pp=4, vpp=2))]
    return saved, loaded, loss_after_loading(Layout(), "")


def run_cases(cases: list) -> dict:
    """Each case's layouts against its single-stage run (trained once per model)."""
    return layout_cases.run_cases(cases, lambda model: train(Layout(), model), compare)[0]


def layout_checks(directory: str) -> dict:
    optimizer = {**distributed_optimizer_checks("hc4", HC4), **distributed_optimizer_checks("mhc4-gqa", MHC4_GQA)}
    return dict(cases=run_cases(CASES), optimizer=optimizer, checkpoint=reshard_checkpoint(directory))


def check_cases(report: dict, cases: list) -> None:
    """Every layout of ``cases`` equals its single stage: loss, every gradient, the scales' at
    ``SCALE_TOLERANCE``, mHC's flat gate exactly."""
    for case, outcome in report.items():
        print(
            f"{case}: |loss diff| {outcome['loss']:.1e}, relative grad error {outcome['grad']:.1e} "
            f"(scales {outcome['scale']:.1e}, mHC's flat gate {outcome['flat']:.0e}), "
            f"{outcome['connections']} hyper-connection parameters compared"
        )
        assert outcome["names"] and outcome["connections"] >= 2 * 2 * 8, case
        assert outcome["loss"] <= TOLERANCE, case
        assert outcome["grad"] <= TOLERANCE and outcome["scale"] <= SCALE_TOLERANCE, case
        assert outcome["flat"] <= 1e-12, case
    assert len(report) == sum(len(layouts) for _, _, layouts, *_ in cases)


def test_hyper_connections_layouts_equal_single_stage(tmp_path):
    result = run_distributed(layout_checks, 4, str(tmp_path), timeout=1200, nccl_rules=True)[0]
    check_cases(result["cases"], CASES)
    assert len(result["optimizer"]) == 4
    for case, outcome in result["optimizer"].items():
        print(f"{case}: |loss diff| {outcome['loss']:.1e}, relative weight error {outcome['weights']:.1e}")
        assert outcome["loss"] <= TOLERANCE and outcome["weights"] <= TOLERANCE, case
        assert not outcome["unmoved"], (case, outcome["unmoved"])
    saved, loaded, fresh = result["checkpoint"]
    print(f"checkpoint saved at tp2-pp2-vpp2 with loss {saved:.6f}; loaded at pp1, pp4-vpp2: {loaded}")
    assert all(abs(loss - saved) <= TOLERANCE for loss in loaded)
    assert abs(fresh - saved) > 1e-3  # a model that loaded nothing differs


@pytest.mark.slow
def test_rest_of_the_hyper_connection_layouts_equal_single_stage():
    check_cases(run_distributed(run_cases, 4, SLOW_CASES, timeout=1200, nccl_rules=True)[0], SLOW_CASES)
