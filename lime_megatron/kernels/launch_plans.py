"""A layer's routing launches of the pass before, launched again with this pass's tensors.

Pass after pass a layer launches the same kernels with the same grids, constants and integer
arguments; only the tensors are new (its keys and values, the pass's buffer, the gradients).
Building a launch (``kernels.operands``: the ``Halves`` and ``Columns`` of its operands, their
argument tuples, and the choices of ``fused_routing`` before them) was a third of the Python the
Triton path adds per layer, 81 of 236 calls at B = 1 (BENCHMARKS.md, "Host time per layer").
``LaunchPlans.launch`` runs a site's build once and records its launches; at the site's next
call with the same signature (the caller's facts, the shape, strides, dtype and device of each of
its tensors, and the mix tiles in use) it launches the recorded ones with the new tensors
in place of the old, each found by its position among the site's tensors, and never runs the
build.  So a site's build must be a function of those facts and tensors alone, and do nothing but
launch: allocations and bookkeeping stay outside it.

A recorded launch whose arguments hold a tensor that is not among the site's tensors (a copy made
inside the build) is built again at every call.  Records keep no tensor: the arguments are
rebuilt by a function compiled from the recorded tuples (as ``dataclasses`` compiles its
``__init__``) that reads the tensors by position and every other leaf from a tuple of constants.
With ``LIME_VERIFY_LAUNCH_PLANS=1`` (the test suite sets it, spawned ranks included) every
replay first runs the build without launching and fails unless it makes the same launches.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from lime_megatron.kernels import operands
from lime_megatron.kernels.operands import Launch

VERIFY = os.environ.get("LIME_VERIFY_LAUNCH_PLANS") == "1"
"""Whether each replay is checked against a build of the same launches (module docstring)."""


@dataclass(frozen=True, slots=True)
class Replay:
    """One recorded launch: ``arguments(tensors)`` rebuilds its argument tuple from a site's tensors."""

    kernel: Any
    grid: tuple[int, ...]
    arguments: Callable[[tuple], tuple]
    constants: dict
    warps: int | None


@dataclass(frozen=True, slots=True)
class Plan:
    """A site's launches for one ``signature``; ``launches`` None where a launch reads a tensor
    the site did not name (built every time); ``aliases`` the pairs of positions that held one
    tensor when recorded (a replay needs them to hold one still: the recorded launch read it
    through the first)."""

    signature: tuple
    launches: tuple[Replay, ...] | None
    aliases: tuple[tuple[int, int], ...]

    def fits(self, signature: tuple, tensors: tuple) -> bool:
        if signature != self.signature:
            return False
        return not self.aliases or all(tensors[i] is tensors[j] for i, j in self.aliases)


class LaunchPlans:
    """A model chunk's recorded launches, one ``Plan`` per site (a layer's forward, its backward),
    kept across passes (module docstring)."""

    def __init__(self):
        self._plans: dict[Any, Plan] = {}
        self.replays = 0
        """Calls answered by a recorded plan so far."""

    def launch(self, site: Any, facts: tuple, tensors: tuple, build: Callable[..., None], *arguments: Any) -> None:
        """``build(*arguments)``, which launches kernels reading ``tensors`` (any of them None) and
        otherwise only ``facts``, or its launches as recorded at ``site`` for the same signature."""
        signature = (facts, layouts(tensors), operands.mix_tiles())
        plan = self._plans.get(site)
        if plan is None or not plan.fits(signature, tensors):
            self._plans[site] = record(signature, tensors, build, arguments)
        elif plan.launches is None:
            build(*arguments)
        else:
            if VERIFY:
                verify(site, plan, tensors, build, arguments)
            self.replays += 1
            for replay in plan.launches:
                operands.launch(replay.kernel, replay.grid, replay.arguments(tensors), replay.constants, replay.warps)


class Unplanned:
    """Sites built at every call (a memory with no ``LaunchPlans`` kept across passes)."""

    @staticmethod
    def launch(site: Any, facts: tuple, tensors: tuple, build: Callable[..., None], *arguments: Any) -> None:
        build(*arguments)


def layouts(tensors: tuple) -> list:
    """Shape, strides, dtype and device of each of ``tensors`` (None for None)."""
    return [None if t is None else (t.shape, t.stride(), t.dtype, t.device) for t in tensors]


def record(signature: tuple, tensors: tuple, build: Callable[..., None], arguments: tuple) -> Plan:
    """``build(*arguments)``, its launches run as they are made and recorded as a ``Plan``."""
    with _launches(run=True) as launches:
        build(*arguments)
    positions: dict[int, int] = {}  # a tensor's first position among ``tensors``, by id
    for index, tensor in enumerate(tensors):
        if tensor is not None:
            positions.setdefault(id(tensor), index)
    aliases = tuple(
        (positions[id(tensor)], index)
        for index, tensor in enumerate(tensors)
        if tensor is not None and positions[id(tensor)] != index
    )
    try:
        replays = tuple(
            Replay(made.kernel, made.grid, _rebuilder(made.args, positions), made.constants, made.warps)
            for made in launches
        )
    except _Unnamed:
        replays = None
    return Plan(signature, replays, aliases)


class _Unnamed(Exception):
    """A launch reads a tensor that is not among its site's."""


def _rebuilder(args: tuple, positions: dict[int, int]) -> Callable[[tuple], tuple]:
    """A function of a site's tensors ``t`` returning ``args`` with each tensor ``t[i]`` where the
    recorded one held position i (``positions``: by ``id``), compiled once: tuples holding no
    tensor are taken whole from its constants."""
    constants: list = []

    def source(node) -> str:
        if isinstance(node, torch.Tensor):
            if id(node) not in positions:
                raise _Unnamed
            return f"t[{positions[id(node)]}]"
        if isinstance(node, tuple) and _holds_tensor(node):
            return "(" + "".join(f"{source(item)}, " for item in node) + ")"
        constants.append(node)
        return f"c[{len(constants) - 1}]"

    body = source(args)
    return eval(f"lambda t: {body}", {"c": tuple(constants)})  # noqa: S307 - our own tuple's source, no input


def _holds_tensor(node: tuple) -> bool:
    return any(isinstance(item, torch.Tensor) or (isinstance(item, tuple) and _holds_tensor(item)) for item in node)


@contextlib.contextmanager
def _launches(run: bool) -> Iterator[list[Launch]]:
    """The launches made inside the ``with`` block, in order; with ``run`` each also launched
    through the observer in place before (if any), else none launched."""
    made: list[Launch] = []
    outer = operands.current_observer()

    def observe(launch: Launch, launch_it: Callable[[], None]) -> None:
        made.append(launch)
        if run:
            outer(launch, launch_it) if outer is not None else launch_it()

    with operands.launches_observed(observe):
        yield made


def verify(site: Any, plan: Plan, tensors: tuple, build: Callable[..., None], arguments: tuple) -> None:
    """Fail, naming ``site``, unless ``build(*arguments)`` makes ``plan``'s launches with ``tensors``."""
    with _launches(run=False) as launches:
        build(*arguments)
    replayed = [
        (replay.kernel, replay.grid, replay.arguments(tensors), replay.constants, replay.warps)
        for replay in plan.launches
    ]
    built = [(made.kernel, made.grid, made.args, made.constants, made.warps) for made in launches]
    if len(built) != len(replayed) or not all(map(_same, built, replayed)):
        raise RuntimeError(f"the launches recorded at {site!r} differ from a build of them: a fact is missing")


def _same(built, replayed) -> bool:
    """Whether two launch tuples are equal, tensors by identity."""
    if isinstance(built, torch.Tensor) or isinstance(replayed, torch.Tensor):
        return built is replayed
    if isinstance(built, tuple) and isinstance(replayed, tuple):
        return len(built) == len(replayed) and all(map(_same, built, replayed))
    return type(built) is type(replayed) and built == replayed
