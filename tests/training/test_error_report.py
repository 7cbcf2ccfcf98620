"""A usage error is printed once per launch, as one line: by rank 0 for a wrong command line, by
the first rank to fail for a file found missing later; torchrun adds only its own summary."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lime_megatron.training import error_report
from lime_megatron.training.error_report import print_usage_error

ROOT = Path(__file__).resolve().parents[2]
MODEL = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --micro-batch-size 2 "
    "--global-batch-size 4 --lr 1e-3 --train-iters 2"
).split()
PREFIX = "pretrain_lime.py: error: "
MAX_LINES = 50  # torchrun's summary of two failed processes (its traceback included) is ~40 lines


@pytest.mark.parametrize(
    ("rank", "first_to_fail", "printed"),
    [("0", None, True), ("1", None, False), ("1", True, True), ("0", False, False)],
)
def test_one_process_prints_a_usage_error(monkeypatch, capsys, rank, first_to_fail, printed):
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("WORLD_SIZE", "1")
    print_usage_error(ValueError("--data-path x: not found"), first_to_fail)
    assert capsys.readouterr().err == (f"{PREFIX}--data-path x: not found\n" if printed else "")


@pytest.mark.parametrize(("world_size", "waits"), [("2", True), ("1", False)])
def test_a_launched_process_that_does_not_print_waits_for_the_one_that_does(monkeypatch, world_size, waits):
    """torchrun stops every process at the first failure: the silent ones hold their exit."""
    slept = []
    monkeypatch.setattr(error_report.time, "sleep", slept.append)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", world_size)
    print_usage_error(ValueError("--data-path x: not found"))
    assert slept == ([error_report.REPORTER_GRACE_S] if waits else [])


def _torchrun(*flags) -> tuple[int, str]:
    """``torchrun --nproc-per-node 2 -m lime_megatron.cli.pretrain FLAGS``: exit status and output."""
    completed = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
        + ["-m", "lime_megatron.cli.pretrain", *MODEL, *map(str, flags)],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    return completed.returncode, completed.stdout + completed.stderr


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        # Found by the command-line check, before the processes talk: rank 0 prints it.
        (["--data-path", "nowhere/corpus"], "data path 'nowhere/corpus': nowhere/corpus.bin and "),
        # Found by the trainer on every rank after torch.distributed started: the first prints it.
        (["--mock-data", "--vocab-size", "64", "--load", "nowhere"], "no checkpoint in --load nowhere"),
    ],
)
def test_a_usage_error_under_torchrun_is_printed_once(flags, message):
    status, output = _torchrun(*flags)
    assert status != 0, output
    errors = [line for line in output.splitlines() if line.startswith(PREFIX)]
    assert len(errors) == 1 and message in errors[0], output
    assert len(output.splitlines()) < MAX_LINES, output
