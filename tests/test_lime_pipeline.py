"""LIMe under pipeline parallelism equals the PP=1 run (CPU, gloo).

One 4-process launch checks, against the single-stage model from the same initial weights (loss and
every gradient, routers included, over two SGD steps): PP=2 x TP=2 with virtual stages and SP,
PP=4, PP=4 with virtual stages, an uneven split (shorter first and last stage), full and selective
recompute, MHA and GQA, the ``last``/``first`` routers whose stage tensors carry fewer layers, a
128-layer tiny model over 4 stages, and a checkpoint saved at PP=2 loaded at PP=1 and PP=4.
A slow 8-process launch splits the 128-layer model over 8 stages.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

from distributed import (
    Layout,
    data_parallel_share,
    gather_full,
    initialize_layout,
    layout_config_kwargs,
    make_batches,
    run_distributed,
)
from test_lime_tensor_parallel import build_chunks, router_rule, sgd

VOCAB, SEQ, MICRO_BATCHES, STEPS, LR = 64, 16, 4, 2, 0.5
TOLERANCE = 1e-5


def make_config(layout: Layout, **model):
    from lime_megatron.config import lime_config

    settings = dict(num_layers=8, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_query_groups=4)
    settings.update(model)
    return lime_config(use_cpu_initialization=True, **settings, **layout_config_kwargs(layout))


def train(layout: Layout, model: dict, weights=None, steps: int = STEPS, seq: int = SEQ,
          stages: dict | None = None, micro_batches: int = MICRO_BATCHES):
    """``steps`` SGD steps; returns (losses, [full grads per step], initial full weights).
    ``stages``: config options of the pipeline split (left out of the single-stage reference)."""
    from lime_megatron.training import train_step

    initialize_layout(layout)
    config = make_config(layout, **model, **(stages or {}))
    rules = partial(router_rule, config)
    torch.manual_seed(7)
    chunks = build_chunks(config, weights, rules)
    optimizer, scheduler = sgd(chunks, LR, steps)
    initial = gather_full(chunks, extra_shard_rules=rules)
    batches = data_parallel_share(make_batches(micro_batches, 2, seq, VOCAB))
    losses, grads = [], []
    for _ in range(steps):
        losses.append(train_step(chunks, optimizer, scheduler, batches)[0])
        grads.append(gather_full(chunks, select=lambda p: p.main_grad, extra_shard_rules=rules))
    return losses, grads, initial


def compare(layout: Layout, model: dict, reference, **train_kwargs) -> dict:
    """Worst loss and relative gradient differences of ``layout`` against ``reference``."""
    ref_losses, ref_grads, weights = reference
    losses, grads, _ = train(layout, model, weights, **train_kwargs)
    return dict(
        loss=max(abs(a - b) for a, b in zip(losses, ref_losses)),
        grad=max(((g[n] - r[n]).norm() / r[n].norm()).item() for g, r in zip(grads, ref_grads) for n in r),
        routers=sum("router" in name for name in ref_grads[0]),
        names=set(grads[0]) == set(ref_grads[0]),
    )


UNEVEN = dict(num_layers_in_first_pipeline_stage=1, num_layers_in_last_pipeline_stage=1)
FULL_RECOMPUTE = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
CASES = [  # (name, model settings, layouts[, pipeline split options])
    ("mha", {}, [Layout(tp=2, pp=2, vpp=2, sp=True), Layout(pp=4), Layout(pp=4, vpp=2)]),
    ("gqa", dict(num_query_groups=2), [Layout(tp=2, pp=2, vpp=2, sp=True), Layout(pp=4, vpp=2)]),
    ("mha-uneven", {}, [Layout(pp=4)], UNEVEN),
    ("gqa-full-recompute", dict(num_query_groups=2, **FULL_RECOMPUTE), [Layout(pp=2, vpp=2), Layout(pp=4)]),
    ("mha-selective-recompute", dict(recompute_granularity="selective"), [Layout(tp=2, pp=2, sp=True)]),
    ("last-3", dict(lime_router="last", lime_router_window=3), [Layout(pp=4, vpp=2)]),
    ("first-2", dict(lime_router="first", lime_router_window=2), [Layout(pp=4)]),
]
DEEP = dict(num_layers=128, hidden_size=16, ffn_hidden_size=32, num_attention_heads=2, num_query_groups=2)


def pipeline_checks(directory: str) -> dict:
    """On every rank of 4: every case of ``CASES``, the deep model over 4 stages, resharding."""
    report = {}
    for name, model, layouts, *stages in CASES:
        reference = train(Layout(), model)
        for layout in layouts:
            report[f"{name} {layout.name}"] = compare(layout, model, reference, stages=stages[0] if stages else None)
    deep = train(Layout(), DEEP, steps=1, seq=8)
    report["deep-128 tp1-pp4"] = compare(Layout(pp=4), DEEP, deep, steps=1, seq=8)
    return dict(cases=report, checkpoint=reshard_checkpoint(directory))


def loss_after_loading(layout: Layout, checkpoint: str) -> float:
    """Loss of a freshly initialised model at ``layout`` after loading ``checkpoint`` (if any)."""
    from megatron.core import dist_checkpointing

    from lime_megatron.training import forward_backward

    initialize_layout(layout)
    config = make_config(layout, num_query_groups=2)
    torch.manual_seed(100 + layout.pp)
    chunks = build_chunks(config)
    if checkpoint:
        state = {}
        for index, chunk in enumerate(chunks):
            state[f"model{index}"] = chunk.module.sharded_state_dict()
        loaded = dist_checkpointing.load(state, checkpoint)
        for index, chunk in enumerate(chunks):
            chunk.module.load_state_dict(loaded[f"model{index}"])
    return forward_backward(chunks, data_parallel_share(make_batches(MICRO_BATCHES, 2, SEQ, VOCAB)))


def reshard_checkpoint(directory: str):
    """Save at PP=2 (TP=2), load at PP=1 and PP=4 (with virtual stages): (saved, loaded, fresh)."""
    from megatron.core import dist_checkpointing

    from lime_megatron.training import forward_backward

    layout = Layout(tp=2, pp=2)
    initialize_layout(layout)
    config = make_config(layout, num_query_groups=2)
    torch.manual_seed(11)
    chunks = build_chunks(config)
    saved = forward_backward(chunks, data_parallel_share(make_batches(MICRO_BATCHES, 2, SEQ, VOCAB)))
    dist_checkpointing.save({"model0": chunks[0].module.sharded_state_dict()}, directory)
    torch.distributed.barrier()
    loaded = [loss_after_loading(target, directory) for target in (Layout(), Layout(pp=4, vpp=2))]
    return saved, loaded, loss_after_loading(Layout(), "")


def check_report(report: dict) -> None:
    for case, result in report.items():
        print(f"{case}: |loss diff| {result['loss']:.1e}, relative grad error {result['grad']:.1e}, "
              f"{result['routers']} router weights compared")
        assert result["names"], case
        assert result["routers"] > 0, case
        assert result["loss"] <= TOLERANCE, case
        assert result["grad"] <= TOLERANCE, case


def test_pipeline_layouts_equal_single_stage(tmp_path):
    result = run_distributed(pipeline_checks, 4, str(tmp_path), timeout=900)[0]
    check_report(result["cases"])
    assert result["cases"]["mha tp1-pp4"]["routers"] == 7
    assert result["cases"]["deep-128 tp1-pp4"]["routers"] == 127
    saved, loaded, fresh = result["checkpoint"]
    print(f"checkpoint saved at tp2-pp2 with loss {saved:.6f}; loaded at pp1, pp4-vpp2: {loaded}")
    assert all(abs(loss - saved) <= 1e-5 for loss in loaded)
    assert abs(fresh - saved) > 1e-3  # a model that loaded nothing differs


def deep_eight_stages() -> dict:
    settings = dict(steps=1, seq=8, micro_batches=8)
    reference = train(Layout(), DEEP, **settings)
    return {layout.name: compare(layout, DEEP, reference, **settings)
            for layout in (Layout(pp=8), Layout(pp=4, vpp=2))}


@pytest.mark.slow
def test_deep_model_over_eight_stages():
    check_report(run_distributed(deep_eight_stages, 8, timeout=1800)[0])


def test_layouts_that_cannot_split_fail_clearly():
    from lime_megatron.config import LimeConfigError

    with pytest.raises(LimeConfigError, match="divisible by pipeline_model_parallel_size"):
        make_config(Layout(pp=4), num_layers=6)
    with pytest.raises(LimeConfigError, match="divisible by vp_size"):
        make_config(Layout(pp=2, vpp=3), num_layers=8)
