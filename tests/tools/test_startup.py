"""The commands answer ``--help`` and a wrong path before they import torch or megatron-core
(``bench/bench_startup.py`` times them): each case runs a command's ``main`` in a fresh
interpreter and lists the heavy modules loaded by the time it returned."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "megatron.core", "transformers")

RUN_MAIN = """
import importlib, json, sys

module, argv, heavy = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3].split(",")
try:
    status = importlib.import_module(module).main(argv)
except SystemExit as exit:
    status = exit.code
print(json.dumps({"status": status, "loaded": [name for name in heavy if name in sys.modules]}))
"""

TINY_RUN = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32"]
TINY_RUN += ["--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-3"]
TINY_RUN += ["--tokenizer-type", "NullTokenizer", "--vocab-size", "128"]


def run_main(module: str, argv: list[str], cwd: Path) -> tuple[dict, str]:
    """(``{"status", "loaded"}``, stderr) of ``module.main(argv)`` in a fresh interpreter."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    completed = subprocess.run(
        [sys.executable, "-c", RUN_MAIN, module, json.dumps(argv), ",".join(HEAVY)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return json.loads(completed.stdout.splitlines()[-1]), completed.stderr


@pytest.mark.parametrize(
    "module,argv,status,error",
    [
        ("lime_megatron.cli.pretrain", ["--help"], 0, None),
        ("lime_megatron.cli.pretrain", [*TINY_RUN, "--data-path", "missing/x"], 2, "data path 'missing/x'"),
        ("lime_megatron.cli.pretrain", [*TINY_RUN, "--lime", "--data-path", "missing/x"], 2, "missing/x.bin"),
        ("lime_megatron.cli.pretrain", ["--config", "missing.yaml"], 2, "cannot read config file missing.yaml"),
        ("lime_megatron.cli.pretrain", [*TINY_RUN, "--mock-data", "--num-layer", "2"], 2, "--num-layers?"),
        ("lime_megatron.cli.main_job", ["--help"], 0, None),
        ("lime_megatron.cli.score_generation", ["--help"], 0, None),
        ("lime_megatron.cli.score_generation", ["missing", "--test-file", "missing.jsonl"], 1, "no test file at"),
        ("lime_megatron.cli.analyze_checkpoint", ["--help"], 0, None),
        ("lime_megatron.cli.analyze_checkpoint", ["missing", "--output-dir", "out"], 1, "no checkpoint at missing"),
        ("lime_megatron.cli.preprocess_data", ["--input", "missing.jsonl", "--output-prefix", "out"], 1, "missing"),
    ],
)
def test_help_and_wrong_paths_come_before_the_heavy_imports(tmp_path, module, argv, status, error):
    result, stderr = run_main(module, argv, tmp_path)
    assert result == {"status": status, "loaded": []}, stderr[-2000:]
    if error:
        assert error in stderr, stderr[-2000:]


def test_a_valid_command_line_goes_on_to_the_trainer(tmp_path):
    """The early checks pass a runnable command line to the trainer (which imports megatron-core)."""
    result, stderr = run_main("lime_megatron.cli.pretrain", [*TINY_RUN, "--mock-data", "--dry-run"], tmp_path)
    assert result["status"] == 0 and "megatron.core" in result["loaded"], stderr[-2000:]


def test_analyze_checkpoint_help_states_the_analysis_defaults(capsys):
    from lime_megatron.analysis.measures import DEFAULT_ALPHA, DEFAULT_WORDS
    from lime_megatron.cli import analyze_checkpoint

    with pytest.raises(SystemExit):
        analyze_checkpoint.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert f"(default: {','.join(DEFAULT_WORDS)}, the paper's)" in text
    assert f"(default: {DEFAULT_ALPHA}, the paper's)" in text
