"""Tests of the benches.  The benches are scripts (``python bench/NAME.py``) that import their
siblings by plain name (``from tables import ...``); :func:`load_bench` imports them by file, under
those names, leaving the import path as it is."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[2] / "bench"


def load_bench(*names: str) -> list[ModuleType]:
    """``bench/<name>.py`` for each of ``names`` in order, each as module ``name``: a bench's
    siblings (``tables``, ``bench_lime_overhead``) come before it."""
    modules = []
    for name in names:
        path = BENCH / f"{name}.py"
        module = sys.modules.get(name)
        if module is None or getattr(module, "__file__", None) != str(path):
            spec = importlib.util.spec_from_file_location(name, path)
            module = sys.modules[name] = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        modules.append(module)
    return modules
