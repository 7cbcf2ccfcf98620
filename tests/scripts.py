"""Scripts as modules: the benches (``bench/``) and the GPU kit (``tools/gpu/``) are scripts that
import their siblings by plain name (``from tables import ...``); :func:`load_scripts` imports
them by file, under those names, leaving the import path as it is."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load_scripts(folder: Path, *names: str) -> list[ModuleType]:
    """``folder/<name>.py`` for each of ``names`` in order, each as module ``name``: a script's
    siblings come before it."""
    modules = []
    for name in names:
        path = folder / f"{name}.py"
        module = sys.modules.get(name)
        if module is None or getattr(module, "__file__", None) != str(path):
            spec = importlib.util.spec_from_file_location(name, path)
            module = sys.modules[name] = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        modules.append(module)
    return modules
