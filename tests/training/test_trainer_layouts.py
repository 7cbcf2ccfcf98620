"""pretrain_lime.py on several gloo ranks: parallel layouts reproduce the single-process losses,
checkpoints move between layouts, a SIGTERM to one rank of a torchrun launch stops all of them
with a checkpoint.

megatron initialises weights per pipeline stage (and, on GPU, per tensor-parallel rank), so
layouts with pipeline parallelism start from a checkpoint written by the single-process run
after its first iteration; tensor and data parallelism on CPU initialise identically and are
compared from scratch. float32 throughout; losses must agree within ``TOLERANCE``.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from lime_megatron.testing.distributed import run_distributed
from lime_megatron.training.checkpointing import published_iterations

ROOT = Path(__file__).resolve().parents[2]
TOLERANCE = 1e-5  # absolute, on the mean loss per token
# LIMe, 4 layers, 4 microbatches of 2 per iteration (8 samples), its own router schedule.
LIME = (
    "--num-layers 4 --hidden-size 64 --num-attention-heads 4 --num-query-groups 2 "
    "--seq-length 32 --micro-batch-size 2 --global-batch-size 8 --lr 1e-3 --mock-data "
    "--vocab-size 128 --log-interval 100 --eval-iters 0 --lime --train-iters 6"
).split()
pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]


def _train_runs(runs: list) -> list:
    """Train each argv of ``runs`` in turn on every rank; the per-iteration losses of each."""
    from lime_megatron.training.trainer import train

    return [train(argv).losses for argv in runs]


def _launch(world_size: int, runs: list) -> list:
    return run_distributed(_train_runs, world_size, [[str(a) for a in argv] for argv in runs], nccl_rules=True)[0]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Single process: the uninterrupted losses (iterations 1-6) and checkpoints after
    iteration 1 with the regular (``regular``) and the distributed (``distributed``) optimizer."""
    root = tmp_path_factory.mktemp("reference")
    uninterrupted, *_ = _launch(
        1,
        [
            LIME,
            LIME + ["--save", root / "regular", "--exit-interval", "1"],
            LIME + ["--save", root / "distributed", "--exit-interval", "1", "--use-distributed-optimizer"],
        ],
    )
    return uninterrupted, root


def _assert_same_losses(got: dict, expected: dict, iterations) -> None:
    assert sorted(got) == list(iterations)
    errors = {i: abs(got[i] - expected[i]) for i in iterations}
    assert max(errors.values()) <= TOLERANCE, errors


CASES = {
    "default": [
        # (id, flags, checkpoint to start from or None, first iteration)
        (
            "tp2-pp2-from-tp1-pp1-checkpoint",
            ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"],
            "regular",
            2,
        ),
        ("tp2-sp-dp2-from-scratch", ["--tensor-model-parallel-size", "2", "--sequence-parallel"], None, 1),
    ],
    "slow": [
        (
            "pp2-vpp2-dp2-distributed-optimizer-from-checkpoint",
            [
                "--pipeline-model-parallel-size",
                "2",
                "--num-virtual-stages-per-pipeline-rank",
                "2",
                "--use-distributed-optimizer",
            ],
            "distributed",
            2,
        ),
        (
            "pp2-uneven-dp2-from-checkpoint",
            [
                "--pipeline-model-parallel-size",
                "2",
                "--decoder-first-pipeline-num-layers",
                "1",
                "--decoder-last-pipeline-num-layers",
                "3",
            ],
            "regular",
            2,
        ),
        ("llama-tp2-dp2-from-scratch", ["--tensor-model-parallel-size", "2", "--no-lime"], None, 1),
    ],
}


@pytest.fixture(scope="module")
def launched(reference):
    """``launched(group)``: losses of ``CASES[group]`` from one 4-rank launch."""
    _, root = reference
    cache = {}

    def results(group):
        if group not in cache:
            runs = [LIME + flags + (["--load", root / ckpt] if ckpt else []) for _, flags, ckpt, _ in CASES[group]]
            cache[group] = dict(zip([case[0] for case in CASES[group]], _launch(4, runs)))
        return cache[group]

    return results


@pytest.mark.parametrize(
    "group, case",
    [pytest.param("default", case, id=case[0]) for case in CASES["default"]]
    + [pytest.param("slow", case, id=case[0], marks=pytest.mark.slow) for case in CASES["slow"]],
)
def test_layout_reproduces_the_single_process_losses(reference, launched, group, case):
    uninterrupted, _ = reference
    name, flags, _, first = case
    if "--no-lime" in flags:
        baseline = _launch(1, [LIME + ["--no-lime"]])[0]
        _assert_same_losses(launched(group)[name], baseline, range(first, 7))
        return
    _assert_same_losses(launched(group)[name], uninterrupted, range(first, 7))


@pytest.mark.slow
def test_checkpoint_from_tp2_pp2_resumes_in_one_process(reference, tmp_path):
    uninterrupted, root = reference
    save = tmp_path / "tp2pp2"
    _launch(
        4,
        [
            LIME
            + [
                "--tensor-model-parallel-size",
                "2",
                "--pipeline-model-parallel-size",
                "2",
                "--load",
                root / "regular",
                "--save",
                save,
                "--exit-interval",
                "4",
            ]
        ],
    )
    resumed = _launch(1, [LIME + ["--load", save]])[0]
    _assert_same_losses(resumed, uninterrupted, range(5, 7))


@pytest.mark.slow
def test_sigterm_to_one_torchrun_rank_stops_every_rank_with_a_checkpoint(reference, tmp_path):
    uninterrupted, _ = reference
    save, path = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    flags = [str(a) for a in LIME + ["--pipeline-model-parallel-size", "2", "--train-iters", "200"]]
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "pretrain_lime.py",
            *flags,
            "--save",
            str(save),
            "--metrics-file",
            str(path),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 300
    while (not path.exists() or not path.read_text()) and time.monotonic() < deadline:
        assert launcher.poll() is None, launcher.stdout.read()
        time.sleep(0.05)
    workers = psutil.Process(launcher.pid).children()
    assert len(workers) == 2
    os.kill(workers[0].pid, signal.SIGTERM)
    output, _ = launcher.communicate(timeout=300)
    assert launcher.returncode == 0, output[-3000:]
    assert "SIGTERM received: stopped after iteration" in output
    [stopped_at] = published_iterations(save)
    assert 1 <= stopped_at < 200
    # The same launch resumed for a few iterations continues the uninterrupted 200-iteration run.
    resumed = _launch(2, [flags + ["--load", str(save), "--exit-interval", str(stopped_at + 2)]])[0]
    reference_run = _launch(2, [flags + ["--exit-interval", str(stopped_at + 2)]])[0]
    _assert_same_losses(resumed, reference_run, range(stopped_at + 1, stopped_at + 3))
