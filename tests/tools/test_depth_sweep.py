"""lime_megatron.cli.depth_sweep (``tools/depth_sweep.py``): the plan of a sweep YAML, torchrun's node
flags, skipping finished and resuming interrupted runs, and the results table and plots (no
training: launches are faked)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from lime_megatron.cli import depth_sweep

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]


def _sweep_file(tmp_path, **changes) -> Path:
    spec = dict(
        output_dir=str(tmp_path / "out"),
        data={"mock_data": True, "vocab_size": 128},
        tokens=4096,
        families={"LIMe": {"lime": True}, "LLaMA": {"lime": False}},
        depths=[{"num_layers": 2, "nproc": 1}, {"num_layers": 4, "nproc": 2, "pipeline_model_parallel_size": 2}],
        common=dict(
            hidden_size=32,
            num_attention_heads=4,
            seq_length=16,
            micro_batch_size=4,
            global_batch_size=16,
            lr=1e-3,
            eval_interval=4,
            eval_iters=1,
        ),
    )
    spec.update(changes)
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_the_cpu_sweep_plans_six_runs():
    sweep = depth_sweep.load_sweep(str(ROOT / "tools" / "depth_sweep_cpu.yaml"), "/tmp/unused")
    assert [run.name for run in sweep.runs] == ["LIMe-L2", "LLaMA-L2", "LIMe-L4", "LLaMA-L4", "LIMe-L8", "LLaMA-L8"]
    assert [run.nproc for run in sweep.runs] == [1, 1, 2, 2, 2, 2]
    lime8 = sweep.runs[4]
    options = lime8.options
    assert (lime8.nproc, options["train_iters"], options["num_virtual_stages_per_pipeline_rank"]) == (2, 100, 2)
    assert lime8.options["save"] == lime8.options["load"] == "/tmp/unused/runs/LIMe-L8/checkpoints"
    assert sweep.runs[5].options["lime"] is False


def test_the_run_config_resolves_through_the_trainers_arguments(tmp_path):
    from lime_megatron.training import arguments

    sweep = depth_sweep.load_sweep(str(_sweep_file(tmp_path)))
    run = sweep.runs[3]  # LLaMA, 4 layers, PP 2
    args = arguments.parse_args(depth_sweep.trainer_argv(sweep, run, []), world_size=2)
    assert (args.num_layers, args.pipeline_model_parallel_size, args.lime, args.train_iters) == (4, 2, False, 16)
    assert args.mock_data and args.metrics_file == str(run.metrics_file)


def test_a_hyper_connections_family_resolves_at_a_pipeline_layout(tmp_path):
    """Families are trainer options: Hyper-Connections sweep like LIMe and LLaMA (their streams
    cross megatron's pipeline stages)."""
    from lime_megatron.training import arguments

    families = {"HC": {"lime": False, "hyper_connections": 4}, "LLaMA": {"lime": False}}
    sweep = depth_sweep.load_sweep(str(_sweep_file(tmp_path, families=families)))
    assert [run.name for run in sweep.runs] == ["HC-L2", "LLaMA-L2", "HC-L4", "LLaMA-L4"]
    args = arguments.parse_args(depth_sweep.trainer_argv(sweep, sweep.runs[2], []), world_size=2)
    assert (args.num_layers, args.pipeline_model_parallel_size, args.hyper_connections) == (4, 2, 4)


def test_node_flags_come_from_the_environment():
    assert depth_sweep.node_flags({}) == ["--standalone"]
    env = {"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "node0", "MASTER_PORT": "6000"}
    assert depth_sweep.node_flags(env) == [
        "--nnodes",
        "2",
        "--node-rank",
        "1",
        "--master-addr",
        "node0",
        "--master-port",
        "6000",
    ]
    with pytest.raises(depth_sweep.SweepError, match="needs NODE_RANK and MASTER_ADDR"):
        depth_sweep.node_flags({"NNODES": "2"})


def test_bad_sweeps_are_named(tmp_path):
    with pytest.raises(depth_sweep.SweepError, match="less than one iteration"):
        depth_sweep.load_sweep(str(_sweep_file(tmp_path, tokens=100)))
    with pytest.raises(depth_sweep.SweepError, match="missing 'depths'"):
        path = tmp_path / "bad.yaml"
        path.write_text(yaml.safe_dump({"families": {}, "tokens": 1}))
        depth_sweep.load_sweep(str(path))


def _metrics(run, losses, validation_every=4):
    run.directory.mkdir(parents=True, exist_ok=True)
    with open(run.metrics_file, "a") as file:
        for iteration, loss in losses:
            record = {"iteration": iteration, "lm_loss": loss, "tokens_per_sec": 1000.0 + iteration}
            if iteration % validation_every == 0:
                record["validation_loss"] = loss + 0.1
            file.write(json.dumps(record) + "\n")


def test_interrupted_runs_resume_and_finished_runs_are_skipped(tmp_path):
    sweep = depth_sweep.load_sweep(str(_sweep_file(tmp_path)))
    run = sweep.runs[0]
    launches = []

    def interrupted(command):
        launches.append(command)
        return subprocess.CompletedProcess(command, 1)

    def stopped(command):  # a SIGTERM: the trainer saves a checkpoint and exits 0 early
        launches.append(command)
        _metrics(run, [(1, 4.0), (2, 3.9)])
        return subprocess.CompletedProcess(command, 0)

    def finishing(command):
        launches.append(command)
        _metrics(run, [(i, 4.0 - 0.1 * i) for i in range(3, run.options["train_iters"] + 1)])
        return subprocess.CompletedProcess(command, 0)

    with pytest.raises(SystemExit, match="LIMe-L2 failed"):
        depth_sweep.execute(sweep, run, [], {}, launch=interrupted)
    assert not run.done_file.exists()
    with pytest.raises(SystemExit, match="LIMe-L2 stopped at iteration 2 of 16"):
        depth_sweep.execute(sweep, run, [], {}, launch=stopped)
    assert not run.done_file.exists()
    assert depth_sweep.execute(sweep, run, [], {}, launch=finishing) == "resumed"
    assert launches[0] == launches[1] == launches[2] and "--standalone" in launches[0]
    assert json.loads(run.done_file.read_text())["attempts"] == 3
    assert depth_sweep.execute(sweep, run, [], {}, launch=finishing) == "skipped"
    assert len(launches) == 3


def test_results_table_and_plots(tmp_path):
    sweep = depth_sweep.load_sweep(str(_sweep_file(tmp_path)))
    for index, run in enumerate(sweep.runs):
        _metrics(run, [(i, 5.0 - 0.1 * i - 0.05 * index) for i in range(1, 17)])
        _metrics(run, [(15, 9.0), (16, 3.0)])  # a resumed run repeats iterations: the last record counts
        run.done_file.write_text(json.dumps({"wall_seconds": 10.0 + index, "attempts": 1}))
    rows = depth_sweep.summarize(sweep, [])
    by_name = {(row["family"], row["depth"]): row for row in rows}
    lime2 = by_name[("LIMe", 2)]
    assert lime2["final_validation_loss"] == pytest.approx(3.1)
    assert lime2["best_validation_loss"] == pytest.approx(3.1)
    assert lime2["tokens"] == 16 * 16 * 16 and lime2["iterations"] == 16
    # Router FLOPs are counted: LIMe costs more than LLaMA at the same depth; depth costs more.
    assert lime2["training_flops"] > by_name[("LLaMA", 2)]["training_flops"] > 0
    assert by_name[("LIMe", 4)]["training_flops"] > lime2["training_flops"]
    paths = depth_sweep.write_results(rows, sweep.output_dir)
    assert "| LIMe | 2 | 1 | 3.1000 |" in (sweep.output_dir / "results.md").read_text()
    for path in paths:
        if path.suffix == ".png":
            assert path.read_bytes()[:4] == b"\x89PNG" and path.stat().st_size > 5000, path


def test_the_paper_sweep_resolves_at_its_layouts(tmp_path):
    """examples/sweeps/depth_paper.yaml: six runs of 5,000 iterations whose configs the trainer
    accepts (dry run, one 8-GPU node) with the layouts of examples/*_deep*.yaml."""
    from lime_megatron.training import arguments

    sweep = depth_sweep.load_sweep(str(ROOT / "examples" / "sweeps" / "depth_paper.yaml"), str(tmp_path))
    assert [run.name for run in sweep.runs] == [
        "LIMe-L32",
        "LLaMA-L32",
        "LIMe-L64",
        "LLaMA-L64",
        "LIMe-L128",
        "LLaMA-L128",
    ]
    for run in sweep.runs:
        args = arguments.parse_args(
            [*depth_sweep.trainer_argv(sweep, run, []), "--dry-run", "--dry-run-world-size", str(run.nproc)]
        )
        shape = (args.num_layers, args.hidden_size, args.ffn_hidden_size, args.train_iters)
        assert shape == (run.depth, 256, 1024, 5000)
        example = yaml.safe_load((ROOT / "examples" / f"{run.family.lower()}_deep{run.depth}.yaml").read_text())
        for key in (
            "pipeline_model_parallel_size",
            "decoder_first_pipeline_num_layers",
            "decoder_last_pipeline_num_layers",
            "num_virtual_stages_per_pipeline_rank",
        ):
            assert run.options.get(key) == example.get(key), (run.name, key)


def test_the_pruned_sweep_adds_pruned_lime_at_every_depth(tmp_path):
    """examples/sweeps/depth_pruned.yaml: the paper sweep's runs plus LIMe pruned at top-p 0.9 after
    iteration 2,500, which the trainer accepts at each depth's layout (dry run)."""
    from lime_megatron.training import arguments

    sweep = depth_sweep.load_sweep(str(ROOT / "examples" / "sweeps" / "depth_pruned.yaml"), str(tmp_path))
    assert [run.name for run in sweep.runs if run.depth == 32] == ["LIMe-L32", "LIMe-pruned-L32", "LLaMA-L32"]
    for run in sweep.runs:
        args = arguments.parse_args(
            [*depth_sweep.trainer_argv(sweep, run, []), "--dry-run", "--dry-run-world-size", str(run.nproc)]
        )
        pruned = run.family == "LIMe-pruned"
        assert (args.lime_prune_top_p, args.lime_prune_iters) == ((0.9, [2500]) if pruned else (None, None))
