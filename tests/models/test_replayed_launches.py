"""Steps whose routing launches replay the first step's (``kernels.launch_plans``, the Triton path in
Triton's CPU interpreter) against the same model building every launch: the same losses and
gradients, bit for bit, after a step that changed the weights, and after route pruning changes
which sources are read.  Every replay is also checked against a build
(``LIME_VERIFY_LAUNCH_PLANS=1``, tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from lime_megatron.models import gpt_model
from tests.lime_fixtures import RECOMPUTE, batch, loss_of, megatron_logits, prune_by_hand, tiny_model

pytestmark = pytest.mark.usefixtures("megatron")

VARIANTS = {
    "full B=1": dict(lime_routing_block=1),
    "full B=3": dict(lime_routing_block=3),
    "gqa B=2": dict(lime_routing_block=2, num_query_groups=2),
    "last-2 B=2": dict(lime_routing_block=2, lime_router="last", lime_router_window=2),
    "deterministic B=2": dict(lime_routing_block=2, deterministic_mode=True),
    "full recompute B=3": dict(lime_routing_block=3, **{**RECOMPUTE["full-uniform"], "recompute_num_layers": 3}),
}


def step(model, seed: int) -> tuple[float, dict[str, torch.Tensor]]:
    """Loss and gradients of one batch, then the weights moved along them (plain SGD)."""
    tokens, positions, mask = batch(seed)
    loss = loss_of(megatron_logits(model, tokens, positions, mask), tokens)
    loss.backward()
    grads = {name: param.grad.clone() for name, param in model.named_parameters()}
    with torch.no_grad():
        for param in model.parameters():
            param.sub_(0.05 * param.grad)
            param.grad = None
    return loss.item(), grads


def planned_and_built(monkeypatch, **settings):
    """The Triton-path model with its chunk's launch plans and a twin building every launch, after
    one step each (the plans recorded)."""
    planned = tiny_model(num_layers=6, lime_routing_kernel="triton", **settings)
    built = tiny_model(num_layers=6, lime_routing_kernel="triton", **settings)
    first = step(planned, 0)
    with monkeypatch.context() as patch:
        patch.setattr(gpt_model, "LaunchPlans", lambda: None)  # the twin's chunk keeps none
        assert_same(first, step(built, 0))
    return planned, built


def assert_same(planned, built) -> None:
    (loss, grads), (built_loss, built_grads) = planned, built
    assert loss == built_loss
    assert all(torch.equal(grads[name], built_grads[name]) for name in grads), "gradients differ"


def replays(model) -> int:
    """Calls answered by the model's launch plans."""
    (settings,) = model._routing_kernel_of.values()
    return settings["launch_plans"].replays


DEFAULT_SUITE = ("full B=3", "gqa B=2")
"""The variants of the default suite (a fused block's every site; a GQA model's position splits);
the others run in the slow suite, which CI runs once (tests/conftest.py's verification covers
replays in the rest of the suite on both Pythons)."""


@pytest.mark.parametrize(
    "name", [name if name in DEFAULT_SUITE else pytest.param(name, marks=pytest.mark.slow) for name in VARIANTS]
)
def test_replayed_steps_equal_built_steps(name, monkeypatch):
    planned, built = planned_and_built(monkeypatch, **VARIANTS[name])
    before = replays(planned)
    assert_same(step(planned, 1), step(built, 1))  # the weights moved since the first step
    assert replays(planned) > before


def test_pruning_records_the_launches_again(monkeypatch):
    """Pruned sources between steps: the plans recorded before are recorded anew (a pruned
    router reads other rows), and the steps still equal the built ones."""
    planned, built = planned_and_built(monkeypatch, lime_routing_block=2, lime_prune_top_p=1.0)
    for model in (planned, built):
        prune_by_hand([model], lambda layer, source: source == layer or source % 2 == 1)
    before = replays(planned)
    assert_same(step(planned, 1), step(built, 1))
    assert replays(planned) == before  # every site recorded again
    assert_same(step(planned, 2), step(built, 2))
    assert replays(planned) > before
