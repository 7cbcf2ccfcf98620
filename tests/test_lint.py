"""The code passes the project's ruff configuration (``[tool.ruff]`` in pyproject.toml: line length,
import order, one typing style); part of the test command, so ``.ci/run`` checks it."""

import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_passes():
    ruff = shutil.which("ruff")
    assert ruff, "ruff is part of the test extra: pip install torch==2.13.0 -e '.[test]'"
    completed = subprocess.run([ruff, "check", "--no-cache", "."], cwd=ROOT, capture_output=True, text=True)
    assert completed.returncode == 0, completed.stdout[-4000:] + completed.stderr[-2000:]
