"""The code passes the project's checks as pyproject.toml configures them: ``ruff check`` (line
length, import order, one typing style), ``ruff format`` (one layout) and ``mypy`` on the package;
part of the test command, so ``.ci/run`` checks them, and ``.pre-commit-config.yaml`` runs the same
three before each commit.  Each tool runs as a module of the Python running the tests
(``python -m mypy``), so that a CI leg checks with its own environment's tools and libraries: the
Python 3.12 leg, whose venv is not on ``PATH``, once ran the 3.11 tools found there and never saw
its own numpy's stubs."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

CHECKS = {
    "ruff check": ["ruff", "check", "--no-cache", "."],
    "ruff format": ["ruff", "format", "--check", "--no-cache", "."],
    "mypy": ["mypy", "--no-incremental"],
}


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_check_passes(name):
    program, *arguments = CHECKS[name]
    installed = importlib.util.find_spec(program) is not None
    assert installed, f"{program} is part of the test extra: pip install torch==2.13.0 -e '.[test]'"
    command = [sys.executable, "-m", program, *arguments]
    completed = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    assert completed.returncode == 0, completed.stdout[-4000:] + completed.stderr[-2000:]


def test_pre_commit_runs_the_same_checks():
    """``.pre-commit-config.yaml`` runs each check above with the environment's tools, nothing else."""
    import yaml

    config = yaml.safe_load((ROOT / ".pre-commit-config.yaml").read_text(encoding="utf-8"))
    hooks = [hook for repo in config["repos"] for hook in repo["hooks"]]
    assert {repo["repo"] for repo in config["repos"]} == {"local"}, "hooks must not download tools"
    entries = {
        " ".join(hook["entry"].split()[:2]) if hook["entry"].startswith("ruff") else hook["entry"] for hook in hooks
    }
    assert entries == set(CHECKS), f"pre-commit runs {sorted(entries)}, the lint test {sorted(CHECKS)}"
