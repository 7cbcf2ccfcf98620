"""Counting the Python calls a step makes: the host's work that the operator count does not see.

On the Triton path LIMe dispatches 8 operators per layer beyond the baseline, yet most of the host
time it adds is the Python around them (docs/routing.md, "Host work per layer"): building each
launch's operands, the memory's bookkeeping.  ``dispatched_operators`` counts the operators; this
counts the calls, which are the same in every run of the same code where the host's time on a
shared VM moves by more than a cut.  So a test can hold LIMe's calls per layer to a budget and
check that they do not grow with depth or with heads (no Python loop over sources or heads), and a
bench can name the functions that make them.  A call is a proxy for time, not a measure of it: a
call of a small helper and one of a large function count alike, and calls of slot wrappers (a
frozen dataclass's ``object.__setattr__``, ``tensor + tensor``) are not seen.
"""

from __future__ import annotations

import sys
from collections import Counter
from types import FrameType
from typing import Any

from lime_megatron.kernels.operands import Launch, launches_observed

PROJECT = __name__.split(".")[0]
"""This project's package: ``total(PROJECT)`` counts its functions and the built-ins they call, the
Python LIMe's tests and benches hold and report (megatron-core's and torch's own calls differ
between their versions)."""


class PythonCalls:
    """Calls made on the calling thread while active: of Python functions (``functions``: (module,
    qualified name) -> calls; a generator's every resumption counts) and of built-in functions and
    methods (``builtins``: (the calling function's module, name) -> calls), forward and autograd's
    backward alike (on a CPU autograd runs a step's backward on the thread that calls
    ``backward``).

    Use ``with PythonCalls() as calls: ...``; read ``calls.total()``, or ``calls.total(package)``
    for the Python of one package: its functions and the built-ins they call, whatever the
    versions of the libraries around it (megatron-core's own calls differ between 0.16 and 0.19).
    Triton kernel launches (``kernels.operands.launch``) are not run, so their outputs hold
    whatever their memory held (``DispatchedOperators(run_launches=False)``'s reasoning: the host
    decides nothing by a routed value), and Triton's own Python (its interpreter on a CPU, its
    launcher's argument binding on a GPU) is not counted: a launch counts as the calls that hand
    it to the observer.
    """

    def __init__(self) -> None:
        self.functions: Counter[tuple[str, str]] = Counter()
        self.builtins: Counter[tuple[str, str]] = Counter()
        self._previous: Any = None

    def __enter__(self) -> PythonCalls:
        self._observing = launches_observed(_not_run)
        self._observing.__enter__()
        self._previous = sys.getprofile()
        sys.setprofile(self._count)
        return self

    def __exit__(self, *exc) -> None:
        sys.setprofile(self._previous)
        self._observing.__exit__(*exc)

    def _count(self, frame: FrameType, event: str, arg: Any) -> None:
        if event == "call":
            self.functions[frame.f_globals.get("__name__", "?"), frame.f_code.co_qualname] += 1
        elif event == "c_call":
            self.builtins[frame.f_globals.get("__name__", "?"), getattr(arg, "__qualname__", type(arg).__name__)] += 1

    def total(self, package: str | None = None) -> int:
        """Calls in all, or of ``package``'s functions and of the built-ins they call."""
        return sum(self.counts(package).values())

    def counts(self, package: str | None = None) -> Counter[str]:
        """Calls by function (``"module.qualname"``; a built-in as ``"builtin:<name>"``), all or
        those ``total(package)`` counts."""
        counts: Counter[str] = Counter()
        for (module, name), calls in self.functions.items():
            if _in_package(module, package):
                counts[f"{module}.{name}"] += calls
        for (module, name), calls in self.builtins.items():
            if _in_package(module, package):
                counts[f"builtin:{name}"] += calls
        return counts


def _in_package(module: str, package: str | None) -> bool:
    return package is None or module == package or module.startswith(package + ".")


def _not_run(launch: Launch, run) -> None:
    """``PythonCalls``' launch observer: the launch is not run."""
