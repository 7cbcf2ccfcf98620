"""Counting the operators a step dispatches: the host's share of a step, which sets its pace where
kernels are short (a deep narrow model on a GPU, docs/routing.md "Host work per layer");
``bench/bench_lime_overhead.py`` reports LIMe's per layer, tests check it grows linearly in depth."""

from __future__ import annotations

from collections import Counter

from torch.utils._python_dispatch import TorchDispatchMode


class DispatchedOperators(TorchDispatchMode):
    """ATen operators dispatched while active (views and other metadata-only ones included), in
    forward and in autograd's backward.

    Use ``with DispatchedOperators() as operators: ...``; read ``operators.total`` or
    ``operators.by_name`` (operator name, e.g. ``"bmm"``, -> calls).
    """

    def __init__(self):
        super().__init__()
        self.by_name: Counter[str] = Counter()

    @property
    def total(self) -> int:
        """Operators dispatched in all."""
        return sum(self.by_name.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.by_name[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))
