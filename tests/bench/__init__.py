"""Tests of the benches, which are scripts (``python bench/NAME.py``): :func:`load_bench` imports
them by file (``tests.scripts.load_scripts``)."""

from __future__ import annotations

from types import ModuleType

from tests.scripts import ROOT, load_scripts

BENCH = ROOT / "bench"


def load_bench(*names: str) -> list[ModuleType]:
    """``bench/<name>.py`` for each of ``names`` in order, each as module ``name``: a bench's
    siblings (``tables``, ``bench_lime_overhead``) come before it."""
    return load_scripts(BENCH, *names)
