"""The main job's own plumbing (``lime_megatron.cli.main_job``): where its outputs go, the
training stages' output relayed above a progress bar, the constant-answer line of its accuracy
plot.  The job end to end is ``tests/training/test_trainer.py::test_main_job_end_to_end`` (slow)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from lime_megatron.cli import main_job

FAKE_TRAINER = """
import sys
path = sys.argv[1]
for iteration in range(1, 4):
    with open(path, "a") as metrics:
        metrics.write("{}\\n")
    print(f"iteration {iteration}", flush=True)
print("a warning", file=sys.stderr, flush=True)
sys.exit(int(sys.argv[2]))
"""


def test_outputs_go_under_the_working_directory_unless_given(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = main_job.output_dir(None)
    assert out.parent == tmp_path / "runs" and out.name.startswith("main-job-") and not out.exists()
    out.mkdir(parents=True)
    assert main_job.output_dir(None) != out  # a second job gets a directory of its own
    assert main_job.output_dir("elsewhere") == tmp_path / "elsewhere"


def test_a_training_stage_relays_its_output_and_fails_with_its_status(tmp_path, capfd):
    metrics = tmp_path / "metrics.jsonl"
    main_job._run_training("training fake", [sys.executable, "-c", FAKE_TRAINER, str(metrics), "0"], metrics, 3)
    out, err = capfd.readouterr()
    assert "iteration 1\niteration 2\niteration 3\n" in out and "a warning" in err
    assert "(training fake: " in out and main_job._completed_iterations(metrics) == 3
    with pytest.raises(SystemExit, match="training fake failed with exit status 3"):
        main_job._run_training("training fake", [sys.executable, "-c", FAKE_TRAINER, str(metrics), "3"], metrics, 3)


def test_accuracy_plot_draws_the_constant_answer_line(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    plt = main_job._pyplot()
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    tier = dict(accuracy=0.5, ci95_low=0.4, ci95_high=0.6)
    scores = {"LLaMA": {2: tier, 3: tier}, "LIMe": {2: tier, 3: tier}}
    main_job._plot_accuracy(scores, [2, 3], {2: 0.1, 3: 0.25}, "operators", Path(tmp_path / "accuracy.png"))
    [axis] = figures[0].axes
    assert axis.get_xlabel() == "operators"
    lines = [collection for collection in axis.collections if collection.get_label() == "constant answer"]
    assert len(lines) == 1 and "constant answer" in [text.get_text() for text in axis.get_legend().get_texts()]
    segments = [segment for collection in axis.collections for segment in collection.get_segments()]
    heights = sorted(float(y0) for (_, y0), (_, y1) in segments if y0 == y1)  # error bars are vertical
    assert heights == [10.0, 25.0] and (tmp_path / "accuracy.png").stat().st_size > 0
