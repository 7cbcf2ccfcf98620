"""examples/: every YAML config goes through the trainer's --config parsing and
``pretrain_lime.py --dry-run``, carries the paper's hyperparameters (Table 2) and shapes (Table 3,
App. D, §5.5), and the launch scripts pass the launch environment on to torchrun."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lime_megatron.cli import pretrain
from lime_megatron.planning import estimate
from lime_megatron.training import arguments
from lime_megatron.training.data import tokenizer_of
from lime_megatron.training.run_config import RunConfig
from tests.example_configs import CONFIGS, parsed, world_size
from tests.lime_fixtures import TABLE_8

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"

# Paper Table 2 (and App. A for the router), as the trainer's parsed options.
TABLE_2 = dict(
    optimizer="adam",
    lr=1e-3,
    min_lr=1e-6,
    lr_decay_style="cosine",
    lr_warmup_iters=200,
    weight_decay=0.1,
    adam_beta1=0.9,
    adam_beta2=0.95,
    adam_eps=1e-8,
    clip_grad=1.0,
    bf16=True,
    seq_length=2048,
    global_batch_size=1024,
    train_iters=20000,
)
LIME_ROUTER = dict(lime_router_lr=1e-2, lime_router_weight_decay=0.0)
# What the paper's runs (the official implementation) used beyond Table 2.
OFFICIAL = dict(norm_epsilon=1e-6, weight_decay_grouping="official", init_style="official")
GPT2_VOCAB = 50257
SHAPE = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups")


def shape(args) -> tuple:
    return tuple(getattr(args, key) for key in SHAPE)


@pytest.fixture(scope="module")
def configs() -> dict:
    """Every example's parsed options, by file stem."""
    return {path.stem: parsed(path) for path in CONFIGS}


def test_every_config_has_the_paper_hyperparameters(configs):
    assert len(configs) == 22
    for name, args in configs.items():
        expected = {**TABLE_2, "train_iters": 5000} if "_deep" in name else TABLE_2  # official deep config
        assert {key: getattr(args, key) for key in TABLE_2} == expected, name
        assert {key: getattr(args, key) for key in OFFICIAL} == OFFICIAL, name
        if args.lime:
            assert {key: getattr(args, key) for key in LIME_ROUTER} == LIME_ROUTER, name
        assert args.tokenizer_type == "GPT2BPETokenizer" and args.data_path, name
        assert not args.untie_embeddings_and_output_weights, name
        assert args.save == args.load == f"checkpoints/{name}" and args.wandb_exp_name == name
        assert name.startswith("lime_" if args.lime else "hc_" if args.hyper_connections else "llama_"), name
        assert args.num_microbatches * args.micro_batch_size * args.data_parallel_size == 1024


def test_1b_configs_are_table_3_and_count_table_8(configs):
    """The 1B runs: Table 3's shape, GQA (8 kv heads) or MHA, and Table 8's parameter counts
    (plus the rows Megatron pads the GPT-2 vocabulary with)."""
    for (_name, lime, kv_heads), (_, exact) in TABLE_8.items():
        stem = f"{'lime' if lime else 'llama'}_1b_{'gqa8' if kv_heads == 8 else 'mha'}"
        args = configs[stem]
        assert shape(args) == (16, 2048, 8192, 32, 8 if kv_heads == 8 else None), stem
        run = RunConfig.from_namespace(args)
        vocab = tokenizer_of(run.data, run.model.vocab_size).vocab_size
        result = estimate.estimate(
            arguments.transformer_config(run),
            vocab_size=vocab,
            seq_length=2048,
            micro_batch_size=args.micro_batch_size,
            num_microbatches=args.num_microbatches,
            transformer_impl=args.transformer_impl,
        )
        assert result.total_parameters == exact + (vocab - GPT2_VOCAB) * 2048, stem


def test_v1_dynamic_config_counts_v1_table_6(configs):
    """The first version's dynamic LIMe 1.2B: the static 1B MHA shape and router, v1 Table 6's
    1.1856B (1,185,583,104 with the unpadded vocabulary)."""
    args, static = configs["lime_1b_dynamic"], configs["lime_1b_mha"]
    assert shape(args) == shape(static) and args.lime_router == "dynamic" and static.lime_router == "full"
    run = RunConfig.from_namespace(args)
    vocab = tokenizer_of(run.data, run.model.vocab_size).vocab_size
    result = estimate.estimate(
        arguments.transformer_config(run),
        vocab_size=vocab,
        seq_length=2048,
        micro_batch_size=args.micro_batch_size,
        num_microbatches=args.num_microbatches,
        transformer_impl=args.transformer_impl,
    )
    assert result.total_parameters == 1_185_583_104 + (vocab - GPT2_VOCAB) * 2048


# Paper Table 8's HC rows (1B, n = 4 dynamic): kv heads -> exact count of the unpadded vocabulary.
TABLE_8_HC = {8: 1_076_400_960, 32: 1_177_064_256}


def test_hc_1b_configs_count_table_8(configs):
    for kv_heads, exact in TABLE_8_HC.items():
        stem = f"hc_1b_{'gqa8' if kv_heads == 8 else 'mha'}"
        args = configs[stem]
        assert shape(args) == (16, 2048, 8192, 32, 8 if kv_heads == 8 else None), stem
        assert args.hyper_connections == 4 and not args.hyper_connections_static and not args.lime, stem
        run = RunConfig.from_namespace(args)
        vocab = tokenizer_of(run.data, run.model.vocab_size).vocab_size
        result = estimate.estimate(
            arguments.transformer_config(run),
            vocab_size=vocab,
            seq_length=2048,
            micro_batch_size=args.micro_batch_size,
            num_microbatches=args.num_microbatches,
            transformer_impl=args.transformer_impl,
        )
        assert result.total_parameters == exact + (vocab - GPT2_VOCAB) * 2048, stem


def test_ablation_configs_cover_app_d(configs):
    ablation = {name: args for name, args in configs.items() if "_150m" in name}
    routers = {(args.lime_router, args.lime_router_window) for args in ablation.values() if args.lime}
    assert routers == {
        ("full", None),
        ("average", None),
        ("last", 2),
        ("last", 4),
        ("last", 6),
        ("first", 2),
        ("first", 4),
        ("first", 6),
    }
    assert {shape(args) for args in ablation.values()} == {(12, 768, 3072, 12, None)}
    assert sum(not args.lime for args in ablation.values()) == 1


def test_deep_configs_pair_lime_and_llama_with_pipeline_layouts(configs):
    for depth in (32, 64, 128):
        lime, llama = configs[f"lime_deep{depth}"], configs[f"llama_deep{depth}"]
        assert shape(lime) == shape(llama) == (depth, 256, 1024, 8, None)  # the official deep config
        assert lime.lime_router == "full" and not llama.lime
        layout = (
            "pipeline_model_parallel_size",
            "virtual_pipeline_size",
            "decoder_first_pipeline_num_layers",
            "decoder_last_pipeline_num_layers",
        )
        assert [getattr(lime, key) for key in layout] == [getattr(llama, key) for key in layout]
        assert lime.pipeline_model_parallel_size > 1


def dry_run(path: Path, capsys) -> str:
    """The dry run's report of ``path``, whose parameters and peak activations are those
    examples/README.md's table states for it."""
    argv = ["--config", str(path), "--dry-run", "--dry-run-world-size", str(world_size(path))]
    assert pretrain.main(argv) == 0
    report = capsys.readouterr().out
    assert "parameters:" in report and "peak activation memory per GPU" in report
    assert readme_figures(path.name) == report_figures(report), f"examples/README.md's row of {path.name}"
    return report


def readme_figures(config: str) -> tuple[str, ...]:
    """Parameters, GPUs per model replica, micro batch and peak activations per GPU in
    examples/README.md's row of ``config``."""
    rows = [line for line in (EXAMPLES / "README.md").read_text().splitlines() if line.startswith(f"| `{config}` |")]
    assert len(rows) == 1, f"examples/README.md has {len(rows)} rows for {config}"
    cells = [cell.strip() for cell in rows[0].strip("|").split("|")]
    return cells[3], cells[4].rsplit("(", 1)[1].rstrip(")"), cells[5], cells[6]


def report_figures(report: str) -> tuple[str, ...]:
    """The same figures of a dry run's report (peak activations to 0.1 GiB)."""
    parameters = report.split("\nparameters: ")[1].split()[0]
    layout = report.split("\nlayout: ")[1].split("\n")[0]
    gpus = layout.split(" GPU")[0].rsplit("(", 1)[1]
    micro_batch = layout.split("micro batch ")[1].split()[0]
    peak = float(report.split("peak activation memory per GPU: ")[1].split()[0])
    return parameters, gpus, micro_batch, f"{peak:.1f} GiB"


REPRESENTATIVE = ["lime_1b_gqa8", "lime_1b_dynamic", "lime_150m_first2", "lime_deep128", "hc_1b_gqa8"]


@pytest.mark.parametrize("stem", REPRESENTATIVE)
def test_dry_run_of_representative_configs(stem, capsys):
    report = dry_run(EXAMPLES / f"{stem}.yaml", capsys)
    if stem == "lime_deep128":  # 4 stages x 4 virtual stages of 8 layers, interleaved
        assert "    0 0-7, 32-39, 64-71, 96-103 " in report and "    3 24-31, 56-63, 88-95, 120-127 " in report


@pytest.mark.slow
@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_dry_run_of_every_config(path, capsys):
    dry_run(path, capsys)


# ------------------------------------------------------------------------------ scripts


@pytest.fixture
def stub_torchrun(tmp_path):
    """A ``torchrun`` on PATH that records its arguments; returns (environment, log file)."""
    log = tmp_path / "torchrun.log"
    stub = tmp_path / "bin" / "torchrun"
    stub.parent.mkdir()
    stub.write_text('#!/bin/sh\necho "$CUDA_DEVICE_MAX_CONNECTIONS $*" >> "$STUB_LOG"\n')
    stub.chmod(0o755)
    env = {
        key: value
        for key, value in os.environ.items()
        if key
        not in (
            "GPUS_PER_NODE",
            "NNODES",
            "NODE_RANK",
            "MASTER_ADDR",
            "MASTER_PORT",
            "SLURM_NNODES",
            "SLURM_NODEID",
            "CUDA_DEVICE_MAX_CONNECTIONS",
        )
    }
    env.update(PATH=f"{stub.parent}:{env['PATH']}", STUB_LOG=str(log))
    return env, log


def run_script(script: str, *args, env) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(EXAMPLES / script), *map(str, args)], env=env, capture_output=True, text=True, timeout=60
    )


def test_launch_passes_the_environment_to_torchrun(stub_torchrun):
    env, log = stub_torchrun
    config = EXAMPLES / "lime_1b_gqa8.yaml"
    multi_node = dict(env, GPUS_PER_NODE="8", NNODES="4", NODE_RANK="2", MASTER_ADDR="node0", MASTER_PORT="29500")
    assert run_script("launch.sh", config, "--train-iters", "10", env=multi_node).returncode == 0
    slurm = dict(env, GPUS_PER_NODE="4", SLURM_NNODES="2", SLURM_NODEID="1")
    assert run_script("launch.sh", config, env=slurm).returncode == 0
    script = ROOT / "pretrain_lime.py"
    assert log.read_text().splitlines() == [
        f"1 --nproc-per-node 8 --nnodes 4 --node-rank 2 --master-addr node0 --master-port 29500 "
        f"{script} --config {config} --train-iters 10",
        f"1 --nproc-per-node 4 --nnodes 2 --node-rank 1 --master-addr localhost --master-port 6000 "
        f"{script} --config {config}",
    ]


def test_launch_without_a_config_fails_with_usage(stub_torchrun):
    env, log = stub_torchrun
    result = run_script("launch.sh", EXAMPLES / "missing.yaml", env=env)
    assert result.returncode == 2 and "usage:" in result.stderr and "missing.yaml" in result.stderr
    assert not log.exists()


def test_run_paper_launches_every_config_once(stub_torchrun):
    env, log = stub_torchrun
    assert run_script("run_paper.sh", "all", "--dry-run", env=env).returncode == 0
    launched = [line.split("--config ")[1].split()[0] for line in log.read_text().splitlines()]
    assert sorted(launched) == [str(path) for path in CONFIGS]
    assert all(line.endswith("--dry-run") for line in log.read_text().splitlines())
    assert run_script("run_paper.sh", "tables", env=env).returncode == 2
    log.unlink()
    assert run_script("run_paper.sh", "v1", env=env).returncode == 0
    assert [line.split("--config ")[1].split()[0].rsplit("/", 1)[1] for line in log.read_text().splitlines()] == [
        "llama_1b_mha.yaml",
        "lime_1b_mha.yaml",
        "lime_1b_dynamic.yaml",
        "hc_1b_mha.yaml",
    ]


def test_readme_lists_every_config():
    readme = (EXAMPLES / "README.md").read_text()
    assert all(f"`{path.name}`" in readme for path in CONFIGS)


def test_prosqa_finetune_launches_the_papers_schedule_and_scores(stub_torchrun, tmp_path):
    """examples/prosqa_finetune.sh on a small published-format set: the launch is the 150M config
    with --sft on the prompt/response data, EPOCHS epochs at batch 128 with one epoch of warm-up
    (a valid command line: it passes the trainer's parsing), then scoring, which here finds no
    checkpoint (the stub torchrun trains nothing) and says so."""
    env, log = stub_torchrun
    published = tmp_path / "published"
    made = subprocess.run(
        [
            sys.executable,
            "-m",
            "lime_megatron.cli.make_prosqa_data",
            "--output-dir",
            str(published),
            "--train-samples",
            "300",
            "--test-samples",
            "5",
        ],
        cwd=ROOT,
        capture_output=True,
    )
    assert made.returncode == 0
    out = tmp_path / "out"
    script = ["bash", str(EXAMPLES / "prosqa_finetune.sh"), "lime", str(tmp_path / "base"), "3", str(out)]
    result = subprocess.run(
        script, env=dict(env, PUBLISHED=str(published), EPOCHS="2"), capture_output=True, text=True, timeout=300
    )
    examples = len(json.loads((published / "prosqa_train.json").read_text()))
    argv = log.read_text().split(f"{ROOT / 'pretrain_lime.py'} ")[1].split()
    run = arguments.parse_run([*argv, "--dry-run"])
    assert run.data.sft and run.lime.lime and run.training.global_batch_size == 128
    assert run.training.train_iters == -(-2 * examples // 128) and run.training.lr_warmup_iters == -(-examples // 128)
    assert (run.training.lr, run.training.lr_decay_style, run.training.seed) == (1e-4, "linear", 3)
    assert run.checkpointing.pretrained_checkpoint == str(tmp_path / "base")
    assert result.returncode != 0 and "no checkpoint" in result.stderr + result.stdout
