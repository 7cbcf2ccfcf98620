"""Counting the operators a step dispatches: the host's share of a step, which sets its pace where
kernels are short (a deep narrow model on a GPU, docs/routing.md "Host work per layer");
``bench/bench_lime_overhead.py`` reports LIMe's per layer, tests check it grows linearly in depth."""

from __future__ import annotations

from collections import Counter

from torch.utils._python_dispatch import TorchDispatchMode

from lime_megatron.kernels.operands import Launch, launches_observed


class DispatchedOperators(TorchDispatchMode):
    """ATen operators dispatched while active (views and other metadata-only ones included), in
    forward and in autograd's backward.

    Use ``with DispatchedOperators() as operators: ...``; read ``operators.total`` or
    ``operators.by_name`` (operator name, e.g. ``"bmm"``, -> calls).  A Triton kernel launch
    (``kernels.operands.launch``) counts as one, named ``"triton:<kernel>"``; what Triton's CPU
    interpreter dispatches to run it is not counted (on a GPU a launch dispatches nothing).

    ``run_launches=False`` counts the launches without running them, so their outputs hold
    whatever their memory held: the same count in a fraction of the time in Triton's interpreter,
    since the host decides nothing by a routed value (``tests/models/test_fused_routing.py``
    checks that a step reads no value back, and that both counts agree).  For counting only: the
    step's values are then meaningless.
    """

    def __init__(self, run_launches: bool = True):
        super().__init__()
        self.by_name: Counter[str] = Counter()
        self._launching = False
        self._run_launches = run_launches

    def __enter__(self):
        self._observing = launches_observed(self._count_launch)
        self._observing.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        self._observing.__exit__(*exc)
        return super().__exit__(*exc)

    def _count_launch(self, launch: Launch, run) -> None:
        self.by_name[f"triton:{launch.name}"] += 1
        if not self._run_launches:
            return
        self._launching = True
        try:
            run()
        finally:
            self._launching = False

    @property
    def total(self) -> int:
        """Operators dispatched in all."""
        return sum(self.by_name.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self._launching:
            self.by_name[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))
