"""The Python LIMe runs per layer beyond the baseline, counted (``testing.python_calls``): the same for
every further layer (no Python loop over earlier or later layers), the same at twice the heads (no
loop over heads), and within a budget per routing path (docs/routing.md, "Host work per layer").
The operator counts (``test_memory.py``, ``test_fused_routing.py``) see what is dispatched; these
see the Python around it, most of the host time the Triton path adds."""

from __future__ import annotations

import functools
import math

import pytest
import torch

from lime_megatron.kernels import launch_plans, operands
from lime_megatron.testing.python_calls import PROJECT, PythonCalls
from tests.lime_fixtures import batch, loss_of, megatron_logits, tiny_model

pytestmark = [pytest.mark.usefixtures("megatron")]


@pytest.fixture(autouse=True)
def unverified_launch_plans(monkeypatch):
    """Replayed launches not checked against a build (which would count the build's calls)."""
    monkeypatch.setattr(launch_plans, "VERIFY", False)


PATHS = {  # id: (settings, LIMe's Python calls per layer beyond the baseline's, at most)
    "triton B=1": (dict(lime_routing_kernel="triton", lime_routing_block=1), 154),
    "triton B=4": (dict(lime_routing_kernel="triton", lime_routing_block=4), 200.5),
    "triton last-2": (dict(lime_routing_kernel="triton", lime_router="last", lime_router_window=2), 156),
    "torch B=1": (dict(lime_routing_kernel="torch", lime_routing_block=1), 164),
    "torch B=4": (dict(lime_routing_kernel="torch", lime_routing_block=4), 235.25),
}
"""Budgets: the counts on Python 3.11 (kv heads = heads; a GQA model splits positions otherwise for
a few operands: 9-11 calls more), 283 and 340 at B = 1 and 4 on the Triton path before the cuts of
docs/routing.md ("Host work per layer"), 267 and 323.25 before the launch-building cuts of
2026-11-30, 255 and 309 before launch plans (``kernels.launch_plans``: the step counted is a
model's second, whose launches replay its first's); Python 3.12 inlines comprehensions and makes
4-10 fewer.  A change that adds Python to a layer's routing fails here and has to say why."""


def step_calls(model) -> PythonCalls:
    """The calls of one forward+backward after one uncounted (gradients reset between)."""
    tokens, positions, mask = batch()
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        with PythonCalls() as calls:
            loss_of(megatron_logits(model, tokens, positions, mask), tokens).backward()
    return calls


def extra_calls(settings: dict, layers: int, heads: int = 4, kv_heads: int = 4) -> int:
    """LIMe's calls in a step beyond the baseline's, at ``layers`` layers."""
    return model_calls(layers, heads, kv_heads, **settings) - baseline_calls(layers, heads, kv_heads)


@functools.cache
def baseline_calls(layers: int, heads: int, kv_heads: int) -> int:
    """The baseline's calls in a step (one model per shape for every path compared with it)."""
    return model_calls(layers, heads, kv_heads, lime=False)


def model_calls(layers: int, heads: int, kv_heads: int, **settings) -> int:
    """``PROJECT``'s calls in a step of a tiny model of that shape and ``settings``."""
    shape = dict(num_layers=layers, num_attention_heads=heads, num_query_groups=kv_heads)
    return step_calls(tiny_model(**shape, **settings)).total(PROJECT)


@pytest.mark.parametrize("name", list(PATHS))
def test_python_calls_per_layer_do_not_grow_with_depth(name):
    """8, 12 and 16 layers: LIMe's extra calls lie on a line whose slope is within the budget."""
    settings, budget = PATHS[name]
    extra = {layers: extra_calls(settings, layers) for layers in (8, 12, 16)}
    assert extra[16] - extra[12] == extra[12] - extra[8] > 0, extra
    assert (extra[16] - extra[12]) / 4 <= budget, extra


@pytest.mark.parametrize("name", ["triton B=1", "triton B=4", "torch B=1"])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2)], ids=["MHA", "GQA"])
def test_python_calls_per_layer_do_not_grow_with_heads(name, heads, kv_heads):
    """Twice the heads (and kv heads), the same calls per layer: nothing loops over heads."""
    settings, _ = PATHS[name]
    per_layer = [
        (extra_calls(settings, 12, h, kv) - extra_calls(settings, 8, h, kv)) / 4
        for h, kv in ((heads, kv_heads), (2 * heads, 2 * kv_heads))
    ]
    assert per_layer[0] == per_layer[1] > 0, per_layer


def test_counting_sees_forward_and_backward_and_runs_no_launch():
    """Python functions and built-ins called in forward and in autograd's backward are counted;
    a Triton launch is handed to an observer that does not run it, removed afterwards."""
    ran = []

    class Twice(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            return grad * math.comb(2, 1)

    x = torch.ones(3, requires_grad=True)
    with PythonCalls() as calls:
        Twice.apply(x).sum().backward()
        operands._OBSERVER(None, lambda: ran.append(True))
    counts = calls.counts()
    assert counts[f"{__name__}.{Twice.forward.__qualname__}"] == 1
    assert counts[f"{__name__}.{Twice.backward.__qualname__}"] == 1
    assert calls.total() == sum(counts.values()) > 4  # torch's own Python (Function.apply, backward)
    # this module's: its two functions and the built-ins called from its code
    expected = {f"{__name__}.{Twice.forward.__qualname__}": 1, f"{__name__}.{Twice.backward.__qualname__}": 1}
    assert calls.counts(__name__) == expected | {"builtin:comb": 1, "builtin:Tensor.sum": 1}
    assert calls.total(__name__) == 4
    assert ran == [] and operands._OBSERVER is None
