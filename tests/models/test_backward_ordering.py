"""The layer-integrated memory's backward overwrites a layer's raw K/V rows with its gradient rows
(``memory``): every read of those rows must come first, by an autograd edge.

The graph test checks the edges: from every node that reads raw rows of an earlier layer (the
block's ``MixEarlierSources``, a layer's ``RouteKeysValues``), walking ``next_functions`` reaches
the ``RouteKeysValues`` node of that layer, the node that overwrites them.  The behavioural test
runs the real engine with each block's ``MixEarlierSources`` node made the oldest of the graph
(created in a fresh thread, whose autograd sequence numbers start at 0): the engine, which runs
the newest ready node first, then runs it last among the ready nodes, so only an edge keeps it
before the earlier layers' backward; the order and the gradients must not change.
"""

from __future__ import annotations

import threading

import pytest
import torch

from lime_megatron.models.lime.memory import RouteKeysValues
from lime_megatron.models.lime.routing_blocks import MixEarlierSources
from tests.lime_fixtures import batch, loss_of, megatron_logits, relative_error, tiny_model

pytestmark = [
    pytest.mark.usefixtures("megatron"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]

MODELS = {  # 7 layers; B = 3: blocks 0-2, 3-5, 6
    "blocked-gqa": dict(num_query_groups=2, lime_routing_block=3),
    "blocked-rebuilt": dict(lime_routing_block=3, lime_recompute_routed_kv=True),  # MHA: K/V dropped
    "blocked-window": dict(lime_routing_block=3, lime_router="last", lime_router_window=4),
    "dynamic": dict(lime_router="dynamic"),
}


def graph_nodes(root) -> list:
    """Every node of the backward graph below ``root`` (``root`` included)."""
    seen, stack = {root}, [root]
    while stack:
        for child, _ in stack.pop().next_functions:
            if child is not None and child not in seen:
                seen.add(child)
                stack.append(child)
    return list(seen)


def earlier_rows_read(node) -> list[int]:
    """The earlier layers whose raw rows the backward of ``node`` reads: a block's earlier sources,
    or a layer's sources before it (none for other nodes)."""
    if isinstance(node, MixEarlierSources._backward_cls):
        return [layer for start, stop in node.runs for layer in range(start, stop)]
    router = getattr(node, "router", None)  # RouteKeysValues, RouteKeysValuesByToken
    return [] if router is None else [source for source in router.read_sources if source < router.layer]


@pytest.mark.parametrize("settings", list(MODELS.values()), ids=list(MODELS))
def test_every_read_of_raw_rows_is_an_ancestor_of_their_overwrite(settings):
    """The node whose backward overwrites layer j's rows (its ``RouteKeysValues``) is reachable from
    every node whose backward reads them: autograd cannot run it first, on any engine."""
    model = tiny_model(num_layers=7, **settings)
    nodes = graph_nodes(loss_of(megatron_logits(model, *batch()), batch()[0]).grad_fn)
    writers = {node.router.layer: node for node in nodes if hasattr(node, "router")}
    assert sorted(writers) == list(range(7))
    mixes = [node for node in nodes if isinstance(node, MixEarlierSources._backward_cls)]
    assert len(mixes) == (0 if settings.get("lime_router") == "dynamic" else 2)
    for reader in nodes:
        read = earlier_rows_read(reader)
        if read:
            below = set(graph_nodes(reader))
            assert all(writers[layer] in below for layer in read), (reader, read)


def oldest_node(apply):
    """``apply`` of an autograd Function run in a fresh thread (grad mode as here): autograd numbers
    the nodes of each thread from 0, so the node made is older than every other."""

    def in_fresh_thread(*args):
        grad, result = torch.is_grad_enabled(), []

        def run():
            with torch.set_grad_enabled(grad):
                result.append(apply(*args))

        thread = threading.Thread(target=run)
        thread.start()
        thread.join()
        return result[0]

    return in_fresh_thread


def logged(log: list, name: str, backward):
    """``backward`` of an autograd Function, appending ``(name, its node)`` to ``log`` as it starts."""

    def logging_backward(ctx, *grads):
        log.append((name, ctx))
        return backward(ctx, *grads)

    return staticmethod(logging_backward)


def step_gradients(model) -> dict[str, torch.Tensor]:
    """The parameter gradients of one forward+backward on ``batch()``."""
    tokens, positions, mask = batch()
    loss_of(megatron_logits(model, tokens, positions, mask), tokens).backward()
    return {name: param.grad for name, param in model.named_parameters()}


ENGINE_ORDER = {  # 8 layers
    "blocked": dict(lime_routing_block=3),
    "blocked-rebuilt": dict(lime_routing_block=3, lime_recompute_routed_kv=True),
    # full recompute of chunks 0-3, 4-7 (blocks 0-1, 2-3 | 4-5, 6-7): blocks 2-3 and 6-7 need their edge in the rerun
    "blocked-recompute": dict(
        lime_routing_block=2, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=4
    ),
}


@pytest.mark.parametrize("settings", list(ENGINE_ORDER.values()), ids=list(ENGINE_ORDER))
def test_block_weight_gradient_reads_raw_rows_whatever_the_engine_prefers(settings, monkeypatch):
    """Each block's ``MixEarlierSources`` node made the oldest of the graph (``oldest_node``):
    its backward still runs before that of every earlier layer whose rows it reads, and every
    gradient is the one of the engine's usual order."""
    usual = tiny_model(num_layers=8, **settings)
    expected = step_gradients(usual)
    model = tiny_model(num_layers=8, **settings)
    model.load_state_dict(usual.state_dict())
    log = []
    monkeypatch.setattr(MixEarlierSources, "apply", oldest_node(MixEarlierSources.apply))
    monkeypatch.setattr(MixEarlierSources, "backward", logged(log, "mix", MixEarlierSources.backward))
    monkeypatch.setattr(RouteKeysValues, "backward", logged(log, "route", RouteKeysValues.backward))
    gradients = step_gradients(model)
    routes = {node.router.layer: index for index, (name, node) in enumerate(log) if name == "route"}
    mixes = [(index, node) for index, (name, node) in enumerate(log) if name == "mix"]
    assert len(mixes) == len(range(0, 8, settings["lime_routing_block"])) - 1
    oldest_route = min(route._sequence_nr() for name, route in log if name == "route")
    for index, node in mixes:
        assert node._sequence_nr() < oldest_route  # among ready nodes the engine runs it last
        assert all(index < routes[layer] for layer in earlier_rows_read(node)), (node.runs, log)
    for name, gradient in gradients.items():
        assert relative_error(gradient, expected[name]) <= 1e-13, name
