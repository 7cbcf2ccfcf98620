"""The private megatron-core / torch APIs the project relies on (``compat.PRIVATE_APIS`` and the
module docstring) have the signatures and behaviour the code expects under the installed versions
(a difference fails with the API's name), and every private name the package's source reaches
into is registered there with a probe."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import lime_megatron
from lime_megatron.parallel import compat

PACKAGE = Path(lime_megatron.__file__).parent
# The library's sources: the test harnesses of lime_megatron/testing (the NCCL-rules mode patches
# torch.distributed's internals) are not what a run relies on.
SOURCES = sorted(path for path in PACKAGE.rglob("*.py") if path.relative_to(PACKAGE).parts[0] != "testing")
ATTRIBUTE_LOOKUPS = {"getattr", "hasattr", "setattr", "getattr_static"}


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _called_name(call: ast.Call) -> str | None:
    """``f`` for ``f(...)`` and ``module.f(...)``."""
    return getattr(call.func, "id", getattr(call.func, "attr", None))


def project_definitions(trees) -> set[str]:
    """Names the project itself defines: functions, classes, module names, arguments and
    attributes it assigns on ``self``/``cls``."""
    names = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name)
                and node.value.id in ("self", "cls")
            ):
                names.add(node.attr)
    return names


def spelled_private_names(tree) -> set[str]:
    """Private names ``tree`` reaches into: attributes (read or assigned), names imported from
    torch or megatron, and string names handed to getattr/hasattr/setattr/getattr_static."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _is_private(node.attr):
            names.add(node.attr)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in ("torch", "megatron"):
            names.update(alias.name for alias in node.names if _is_private(alias.name))
        elif isinstance(node, ast.Call) and _called_name(node) in ATTRIBUTE_LOOKUPS:
            names.update(
                arg.value
                for arg in node.args[1:2]
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and _is_private(arg.value)
            )
    return names


def foreign_private_names(trees) -> set[str]:
    """Private names the code reaches into that the project does not define itself."""
    return set().union(*map(spelled_private_names, trees)) - project_definitions(trees)


def test_every_private_name_the_package_spells_is_registered_with_a_probe():
    trees = [ast.parse(path.read_text(), str(path)) for path in SOURCES]
    foreign = foreign_private_names(trees)
    assert foreign - set(compat.PRIVATE_APIS) == set(), "private names used but not in compat.PRIVATE_APIS"
    assert set(compat.PRIVATE_APIS) - foreign == set(), "compat.PRIVATE_APIS lists names no code uses"


def test_the_scan_finds_an_unregistered_private_name():
    code = ast.parse(
        "import torch\n"
        "from megatron.core.parallel_state import _HIDDEN_GROUP\n"
        "def f(module):\n"
        "    module._seen = 1\n"
        "    return torch._dynamo, getattr(module, '_by_string'), hasattr(module, 'public')\n"
        "class Mine:\n"
        "    def __init__(self):\n"
        "        self._own = 0\n"
        "    def read(self):\n"
        "        return self._own\n"
    )
    assert foreign_private_names([code]) == {"_HIDDEN_GROUP", "_seen", "_dynamo", "_by_string"}


@pytest.mark.parametrize("patched", [False, True], ids=["as-installed", "after-enable_cpu_support"])
def test_private_apis_hold(patched):
    if patched:
        compat.enable_cpu_support()
    assert compat.private_api_problems() == []


def test_a_changed_signature_names_the_api():
    def communicate(self, *, tensor_send_next, recv_prev, tensor_shape, recv_next=False):
        pass

    problem = compat.missing_parameters(
        "schedules.function", communicate, "tensor_send_next", "tensor_send_prev", "recv_prev", keyword_only=True
    )
    assert problem.startswith("schedules.function:") and "tensor_send_prev" in problem

    def positional(self, recv_prev, recv_next):
        pass

    problem = compat.missing_parameters("schedules.function", positional, "recv_prev", keyword_only=True)
    assert "not keyword-only: ['recv_prev']" in problem
    assert compat.missing_parameters("x", communicate, "recv_next", keyword_only=True) is None
