"""The dependency direction of docs/architecture.md: a subpackage imports only from the ones
below it (lazy imports inside functions included), without exception."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "lime_megatron"

# Lowest first: each may import from itself and from anything before it.
LAYERS = [
    "extras",
    "choices",
    "kernels",
    "data",
    "models.config",
    "models.lime",
    "models.hyper_connections",
    "models",
    "parallel",
    "planning",
    "training",
    "interop",
    "inference",
    "analysis",
    "testing",
    "cli",
]


def _layer(module: str) -> int:
    """Index in LAYERS of the most specific prefix of ``module`` (dotted, without the package)."""
    matches = [i for i, name in enumerate(LAYERS) if module == name or module.startswith(name + ".")]
    return max(matches, key=lambda i: len(LAYERS[i]))


def _imports(path: Path) -> set[str]:
    """Package modules ``path`` imports (``from lime_megatron.x import y`` names ``x.y`` if it is a module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lime_megatron."):
            base = node.module.removeprefix("lime_megatron.")
            for alias in node.names:
                is_module = (PACKAGE / base.replace(".", "/") / f"{alias.name}.py").exists()
                found.add(f"{base}.{alias.name}" if is_module else base)
        elif isinstance(node, ast.Import):
            found |= {a.name.removeprefix("lime_megatron.") for a in node.names if a.name.startswith("lime_megatron.")}
    return found


def test_subpackages_import_downwards():
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
        if "." not in module:  # entry points at the top (__main__, gpu_check) sit above everything
            continue
        for target in _imports(path):
            if _layer(target) > _layer(module):
                wrong.append(f"{module} -> {target}")
    assert not wrong, "imports against docs/architecture.md's direction:\n" + "\n".join(wrong)


def test_layers_cover_every_subpackage():
    folders = {
        ".".join(p.relative_to(PACKAGE).parts)
        for p in PACKAGE.rglob("*")
        if p.is_dir() and (p / "__init__.py").exists()
    }
    assert folders <= set(LAYERS), f"subpackages missing from the layer order: {folders - set(LAYERS)}"


def subpackage_imports() -> dict[tuple[str, str], int]:
    """``(importer, imported) -> number of modules`` between the layers of ``LAYERS`` (module-level
    and lazy imports; a layer's imports of itself left out)."""
    edges: dict[tuple[str, str], int] = {}
    for module, targets in _package_modules():
        importer = LAYERS[_layer(module)]
        for imported in {LAYERS[_layer(target)] for target in targets} - {importer}:
            edges[importer, imported] = edges.get((importer, imported), 0) + 1
    return edges


def _package_modules() -> list[tuple[str, set[str]]]:
    """``(module, the package modules it imports)`` for every module inside ``LAYERS``."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
        if "." in module or module == "extras":
            found.append((module, _imports(path)))
    return found


def _print_structure(inside: str | None) -> None:
    """Layers and their imports, top first; with ``inside`` (a layer), its modules' imports instead."""
    if inside is not None:
        for module, targets in _package_modules():
            if LAYERS[_layer(module)] == inside:
                print(f"{module:42s} -> " + ", ".join(sorted(targets)))
        return
    edges = subpackage_imports()
    for importer in reversed(LAYERS):
        targets = sorted((imported for source, imported in edges if source == importer), key=LAYERS.index)
        counted = (f"{target} ({edges[importer, target]})" for target in reversed(targets))
        print(f"{importer:26s} -> " + ", ".join(counted))


if __name__ == "__main__":  # python -m tests.test_architecture [LAYER]: the import structure
    import sys

    _print_structure(sys.argv[1] if len(sys.argv) > 1 else None)
