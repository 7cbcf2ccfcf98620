"""pretrain_lime.py in one process: options and config files, the router parameter group, loss
going down on the main job's data, exact resume, signals, checkpoint and data errors, metrics
sinks and the dry run. Runs call the trainer in-process (``trainer.train``/``main``).
"""

import importlib
import json
import os
import re
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from lime_megatron.cli import main_job
from lime_megatron.training import arguments, trainer
from lime_megatron.training.arguments import ArgumentsError, parse_args
from lime_megatron.training.checkpointing import TRACKER, CheckpointError, published_iterations
from lime_megatron.training.data import DataError, tokenizer_of
from lime_megatron.training.optimizer import (
    EMBEDDING,
    NO_WEIGHT_DECAY,
    param_group_overrides,
    router_override,
)
from lime_megatron.training.run_config import RunConfig
from lime_megatron.training.trainer import optimizer_config, router_group

ROOT = Path(__file__).resolve().parents[2]
# megatron-core's notices on CPU (no apex/TE, deprecated defaults) repeat for every model built.
pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]

TINY = (
    "--num-layers 4 --hidden-size 64 --num-attention-heads 4 --num-query-groups 2 "
    "--seq-length 32 --micro-batch-size 2 --global-batch-size 4 --lr 1e-3 --mock-data "
    "--vocab-size 128 --log-interval 100 --eval-iters 0"
).split()
# LIMe with its own router schedule (lr 1e-2) and dropout, so that resuming needs the optimizer's
# router group, the scheduler and the RNG states to come back exactly.
RESUMABLE = TINY + "--lime --hidden-dropout 0.1 --train-iters 6".split()


def flatten(parts) -> list[str]:
    """Command-line tokens from strings, paths and (nested) lists of them."""
    return [token for part in parts for token in (flatten(part) if isinstance(part, list) else [str(part)])]


def run(*argv):
    """``trainer.train`` on the flags ``argv`` (strings, paths, lists of them)."""
    return trainer.train(flatten(argv))


def metrics(path) -> list:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


# --------------------------------------------------------------------------- options


def test_config_file_command_line_and_defaults(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text(
        "num_layers: 8\nhidden_size: 64\nlime: true\nlime_router: last\n"
        "lime_router_window: 2\ndata_path: [0.3, data/a, 0.7, data/b]\n"
        "sequence_parallel: false\nlr: 1.0e-3\n"
    )
    args = parse_args(
        [
            "--config",
            str(config),
            "--num-layers",
            "4",
            "--num-attention-heads",
            "4",
            "--seq-length",
            "16",
            "--micro-batch-size",
            "2",
            "--train-iters",
            "5",
        ],
        world_size=2,
    )
    assert (args.num_layers, args.hidden_size, args.lime, args.lime_router) == (4, 64, True, "last")
    assert args.data_path == ["0.3", "data/a", "0.7", "data/b"] and args.lr == 1e-3
    assert (args.data_parallel_size, args.global_batch_size, args.num_microbatches) == (2, 4, 1)
    assert args.lime_router_lr == arguments.PAPER_ROUTER_LR and args.lime_router_weight_decay == 0.0
    assert args.lr_decay_iters == 5 and args.split == "969,30,1"
    rest = ["--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "2", "--train-iters", "5"]
    with pytest.raises(ArgumentsError, match="--lime-router, --lime-router-window only apply to LIMe"):
        parse_args(["--config", str(config), "--no-lime", *rest], world_size=1)
    config.write_text("num_layers: 8\nhidden_size: 64\nlime: true\nmock_data: true\nlr: 1.0e-3\n")
    baseline = parse_args(["--config", str(config), "--no-lime", *rest], world_size=1)
    assert not baseline.lime and baseline.lime_router is None and baseline.mock_data
    # A data source on the command line replaces the file's (not a second source).
    real = parse_args(["--config", str(config), "--data-path", "data/x", *rest], world_size=1)
    assert real.data_path == ["data/x"] and not real.mock_data


BASE = [
    "--num-layers",
    "4",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "16",
    "--micro-batch-size",
    "2",
    "--train-iters",
    "10",
    "--lr",
    "1e-3",
    "--mock-data",
]
INVALID = [
    ([], 1, "missing required option.*--num-layers.*--lr"),
    (BASE + ["--sequence-parallel"], 1, "--sequence-parallel needs --tensor-model-parallel-size > 1"),
    (BASE + ["--tensor-model-parallel-size", "2"], 3, "world size 3 is not divisible"),
    (BASE + ["--global-batch-size", "6"], 2, "--global-batch-size 6 is not divisible by micro batch"),
    (BASE + ["--num-virtual-stages-per-pipeline-rank", "2"], 1, "virtual pipeline stages need"),
    (
        BASE
        + [
            "--pipeline-model-parallel-size",
            "2",
            "--num-virtual-stages-per-pipeline-rank",
            "2",
            "--num-layers-per-virtual-pipeline-stage",
            "1",
        ],
        2,
        "give one of",
    ),
    (BASE + ["--lime-router", "last"], 1, "only apply to LIMe: add --lime"),
    (BASE + ["--lime", "--lime-router", "first"], 1, "--lime-router first needs --lime-router-window"),
    (BASE + ["--lime", "--lime-router-window", "2"], 1, "applies to the last/first routers, not to full"),
    (BASE + ["--lime", "--lime-router-weight-decay", "0.1", "--weight-decay", "0"], 1, "needs --weight-decay > 0"),
    (BASE + ["--lime", "--lime-prune-top-p", "0.9"], 1, "needs both --lime-prune-top-p and --lime-prune-iters"),
    (
        BASE + ["--lime", "--lime-prune-top-p", "0.9", "--lime-prune-iters", "11"],
        1,
        r"--lime-prune-iters \[11\] are outside the run's iterations 1..10",
    ),
    (BASE + ["--lime-prune-top-p", "0.9", "--lime-prune-iters", "2"], 1, "only apply to LIMe"),
    (BASE + ["--bf16", "--fp16"], 1, "choose one of --bf16 and --fp16"),
    (BASE + ["--fp8-format", "e4m3"], 1, "--fp8-format needs --transformer-impl transformer_engine"),
    (BASE + ["--attention-backend", "flash"], 1, "--attention-backend flash needs --transformer-impl"),
    (BASE + ["--data-path", "data/x"], 1, "give exactly one data source"),
    (BASE[:-1], 1, "give exactly one data source"),
    (BASE[:-1] + ["--valid-data-path", "data/v"], 1, "--valid-data-path/--test-data-path need --train"),
    (BASE[:-1] + ["--data-path", "0.5", "a", "b"], 1, "give either prefixes only or weight/prefix pairs"),
    (BASE[:-1] + ["--data-path", "a", "--vocab-size", "64"], 1, "--vocab-size sets the --mock-data"),
    (BASE + ["--save-interval", "5"], 1, "--save-interval needs --save"),
    (BASE + ["--lr-warmup-iters", "10"], 1, "--lr-warmup-iters 10 must be smaller than the decay"),
    (BASE + ["--min-lr", "1"], 1, "--min-lr 1.0 must lie in"),
    (
        BASE + ["--tensor-model-parallel-size", "3", "--num-attention-heads", "6"],
        3,
        "--make-vocab-size-divisible-by 128 must be divisible by --tensor-model-parallel-size 3",
    ),
    (BASE + ["--use-distributed-optimizer", "--optimizer", "sgd"], 1, "supports only --optimizer adam"),
    (BASE + ["--num-layers", "x"], 1, "command line: argument --num-layers: invalid int value"),
    (BASE + ["--lime-router", "middle"], 1, "invalid choice: 'middle'"),
    (BASE + ["--tokenizer-type", "NullTokenizer"], 1, "--tokenizer-type NullTokenizer needs --vocab-size"),
    (BASE + ["--use-pytorch-profiler"], 1, "--use-pytorch-profiler needs --profile"),
    (BASE + ["--profile", "--use-pytorch-profiler"], 1, "needs --profile-dir or --tensorboard-dir"),
    (
        BASE
        + [
            "--profile",
            "--use-pytorch-profiler",
            "--profile-dir",
            "p",
            "--profile-step-start",
            "3",
            "--profile-step-end",
            "3",
        ],
        1,
        "--profile-step-end 3 must be larger than --profile-step-start 3",
    ),
]


@pytest.mark.parametrize(
    "argv, world_size, message", INVALID, ids=[f"{i}-{m.split()[0]}" for i, (_, _, m) in enumerate(INVALID)]
)
def test_invalid_options_fail_with_one_clear_message(argv, world_size, message):
    if "--bf16" in argv and "--fp16" not in argv and torch.cuda.is_available():
        pytest.skip("bf16 is valid on GPU")
    with pytest.raises(ArgumentsError, match=message):
        parse_args(argv, world_size=world_size)


def test_gpu_only_options_fail_on_cpu():
    if torch.cuda.is_available():
        pytest.skip("CPU-only check")
    for flags, message in (
        (["--fp16"], "--fp16 needs a CUDA GPU"),
        (["--transformer-impl", "transformer_engine"], "needs a CUDA GPU"),
    ):
        with pytest.raises(ArgumentsError, match=message):
            parse_args(BASE + flags, world_size=1)


@pytest.mark.slow  # two command-line runs: ~75 s; bf16 layouts stay in tests/parallel/test_bf16_layouts.py
def test_bf16_command_line_run_trains_on_cpu_near_the_float32_run():
    """``--bf16`` on CPU (``Float16Module``, fp32 main parameters): the losses of the float32 run
    within ``test_bf16_layouts.LOSS_TOLERANCE`` (u/2 = 2^-9, relative; derived there)."""
    flags = BASE + ["--lime", "--train-iters", "3", "--global-batch-size", "4"]
    fp32, bf16 = run(flags).losses, run(flags + ["--bf16"]).losses
    assert sorted(bf16) == sorted(fp32) == [1, 2, 3]
    assert all(abs(bf16[i] - fp32[i]) <= 2.0**-9 * fp32[i] for i in fp32), (fp32, bf16)
    assert bf16 != fp32  # the run did change precision


def test_invalid_model_shape_fails_at_start(capsys):
    assert trainer.main(BASE + ["--num-query-groups", "3", "--train-iters", "2"]) == 2
    error = capsys.readouterr().err
    assert "pretrain_lime.py: error: invalid model configuration" in error and "must divide" in error


@pytest.mark.parametrize(
    "content, message",
    [
        ("num_layerz: 4\n", "unknown option 'num_layerz'"),
        ("lime: yes please\n", "lime must be true or false"),
        ("num_layers: [1, 2]\n", "num_layers takes one value"),
        ("num_layers: four\n", "argument --num-layers: invalid int value: 'four'"),
        ("- 1\n- 2\n", "must hold a mapping"),
        ("a: [\n", "is not valid YAML"),
    ],
)
def test_config_file_errors(tmp_path, content, message):
    config = tmp_path / "bad.yaml"
    config.write_text(content)
    with pytest.raises(ArgumentsError, match=f"config file .*{message}"):
        parse_args(["--config", str(config)], world_size=1)
    with pytest.raises(ArgumentsError, match="cannot read config file"):
        parse_args(["--config", str(tmp_path / "missing.yaml")], world_size=1)


# --------------------------------------------------------------------------- optimizer groups


def _groups(args):
    """The optimizer config and router group of parsed ``args``."""
    run = RunConfig.from_namespace(args)
    return optimizer_config(run), router_group(run)


def test_router_group_is_distinct_or_merged():
    paper = parse_args(BASE + ["--lime", "--weight-decay", "0.1", "--min-lr", "1e-6"], world_size=1)
    assert router_override(*_groups(paper)) == dict(
        wd_mult=0.0, max_lr=1e-2, min_lr=pytest.approx(1e-5), lr_mult=pytest.approx(10.0)
    )
    # Same lr and no decay: exactly the no-weight-decay group's override, so megatron merges them
    # (a group differing only in max_lr would collide with it when a checkpoint is loaded).
    same_lr = parse_args(BASE + ["--lime", "--lime-router-lr", "1e-3"], world_size=1)
    assert router_override(*_groups(same_lr)) == param_group_overrides(*_groups(same_lr))[NO_WEIGHT_DECAY]
    default = parse_args(
        BASE + ["--lime", "--lime-router-lr", "1e-3", "--weight-decay", "0.05", "--lime-router-weight-decay", "0.05"],
        world_size=1,
    )
    assert router_override(*_groups(default)) == {} and len(param_group_overrides(*_groups(default))) == 1
    halved = parse_args(
        BASE + ["--lime", "--lime-router-lr", "1e-3", "--weight-decay", "0.1", "--lime-router-weight-decay", "0.05"],
        world_size=1,
    )
    assert router_override(*_groups(halved)) == {"wd_mult": 0.5}


def _decayed(*flags) -> dict[str, bool]:
    """Whether the trainer's optimizer decays each parameter (by name) of a tiny LIMe run."""
    return {name: group["weight_decay"] > 0 for name, group in _param_groups(*flags).items()}


def _param_groups(*flags) -> dict[str, dict]:
    """The trainer's optimizer group of each parameter (by name) of a tiny LIMe run."""
    from megatron.core.utils import unwrap_model

    run = arguments.parse_run(TINY + ["--lime", "--weight-decay", "0.1", "--train-iters", "1", *flags], world_size=1)
    with trainer.distributed(run):
        built = trainer.build_trainer(run)
        built.metrics.close()
        names = {id(param): name for chunk in built.model for name, param in unwrap_model(chunk).named_parameters()}
        return {names[id(param)]: group for group in built.optimizer.param_groups for param in group["params"]}


def test_weight_decay_groupings():
    megatron = _decayed()
    official = _decayed("--weight-decay-grouping", "official", "--untie-embeddings-and-output-weights")
    for decayed in (megatron, official):
        assert sum("linear" in name for name in decayed) > 4 and sum("norm" in name for name in decayed) > 4
        assert not any(decayed[name] for name in decayed if "norm" in name or "router" in name)
        assert all(decayed[name] for name in decayed if "linear" in name)
    assert megatron["embedding.word_embeddings.weight"] and "output_layer.weight" not in megatron  # tied
    assert not official["embedding.word_embeddings.weight"] and official["output_layer.weight"]  # untied
    # The last pipeline stage's copy of a tied embedding (megatron marks it shared_embedding).
    copy, untied = torch.nn.Parameter(torch.ones(2, 2)), torch.nn.Parameter(torch.ones(2, 2))
    copy.shared_embedding = True
    assert EMBEDDING.matches(copy, "module.output_layer.weight")
    assert not EMBEDDING.matches(untied, "module.output_layer.weight")


def test_dynamic_router_weights_train_in_the_router_group():
    """W_l of the dynamic router: the router's learning rate (1e-2, App. A) and no weight decay."""
    groups = _param_groups("--lime-router", "dynamic", "--lr", "1e-3")
    routers = [name for name in groups if name.endswith("router.logits.weight")]
    assert routers and all(groups[name]["weight_decay"] == 0 for name in routers)
    assert all(groups[name]["max_lr"] == pytest.approx(1e-2) for name in routers)
    assert all(groups[name]["max_lr"] == pytest.approx(1e-3) for name in groups if "linear_qkv" in name)


# --------------------------------------------------------------------------- training


@pytest.fixture(scope="module")
def arithmetic_data(tmp_path_factory):
    """The main job's data (fewer samples), made in-process by the real tools."""
    out = tmp_path_factory.mktemp("arith")
    for _, tool, tool_args in main_job.data_steps(out, num_samples=3000, test_samples=60):
        module = importlib.import_module(f"lime_megatron.cli.{tool}")
        assert module.main(tool_args) in (0, None)
    return out


def test_loss_decreases_on_the_main_jobs_data(arithmetic_data, tmp_path):
    result = run(
        main_job.TRAINER_OPTIONS,
        main_job.trainer_data_flags(arithmetic_data),
        "--lime --train-iters 20 --global-batch-size 16 --lr-warmup-iters 5 --eval-interval 20 --eval-iters 1".split(),
        "--metrics-file",
        tmp_path / "m.jsonl",
    )
    losses = [result.losses[i] for i in sorted(result.losses)]
    # From log(vocabulary) (random guessing) to clearly below: ~4.2 -> ~3.3 nats in 20 steps.
    assert len(losses) == 20 and losses[0] > 3.5
    assert sum(losses[-5:]) / 5 < losses[0] - 0.6, losses
    assert result.validation[20] < losses[0] - 0.6
    records = metrics(tmp_path / "m.jsonl")
    assert [r["iteration"] for r in records] == list(range(1, 21))
    assert records[-1]["validation_ppl"] == pytest.approx(torch.tensor(result.validation[20]).exp().item())
    assert all(r["router_lr"] == pytest.approx(r["lr"] * 10 / 3) for r in records)  # lr 3e-3


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Six iterations of ``RESUMABLE`` in one go: (result, metrics records)."""
    path = tmp_path_factory.mktemp("uninterrupted") / "metrics.jsonl"
    return run(RESUMABLE, "--metrics-file", path), metrics(path)


def test_resume_reproduces_the_uninterrupted_run(uninterrupted, tmp_path):
    reference, reference_records = uninterrupted
    save = tmp_path / "ckpt"
    flags = [
        RESUMABLE,
        "--save",
        save,
        "--load",
        save,
        "--save-interval",
        "2",
        "--ckpt-keep-last",
        "2",
        "--metrics-file",
        tmp_path / "m.jsonl",
    ]
    first = run(flags, "--exit-interval", "3")
    assert sorted(first.losses) == [1, 2, 3] and published_iterations(save) == [2, 3]
    (save / "iter_0000004.tmp").mkdir()  # a save that was killed half-way
    (save / "iter_0000004.tmp" / "__0_0.distcp").write_bytes(b"partial")
    second = run(flags)
    assert second.resumed_from == str(save / "iter_0000003")
    assert {**first.losses, **second.losses} == reference.losses  # bit-identical
    assert published_iterations(save) == [4, 6] and (save / TRACKER).read_text() == "6\n"
    assert not [p for p in save.iterdir() if p.name.endswith(".tmp")]
    records = metrics(tmp_path / "m.jsonl")
    assert [r["iteration"] for r in records] == list(range(1, 7))
    assert [r["lr"] for r in records] == [r["lr"] for r in reference_records]
    assert [r["grad_norm"] for r in records] == [r["grad_norm"] for r in reference_records]
    # The test can fail: without the RNG states, dropout draws differ after the resume.
    shutil.rmtree(save / "iter_0000006")
    (save / TRACKER).write_text("4\n")
    without_rng = run(RESUMABLE, "--load", save, "--no-load-rng")
    assert without_rng.losses[5] != reference.losses[5]


@pytest.mark.parametrize("router", ["full", pytest.param("dynamic", marks=pytest.mark.slow)])
def test_route_pruning_resumes_exactly_with_its_masks(router, tmp_path):
    """Routes pruned after iteration 2 of 6 (v1 §5.4): the run reports the masked share, masked
    static weights end at zero, and a run resumed from iteration 3 (the masks come from the
    checkpoint, and the layers read, ``config.lime_route_reads``, from them) reproduces the
    uninterrupted losses bit for bit."""
    from megatron.core.utils import unwrap_model

    from lime_megatron.models.lime.pruning import routers_of

    flags = [RESUMABLE, "--lime-router", router, "--lime-prune-top-p", "0.9", "--lime-prune-iters", "2"]
    reference = run(flags)
    routes, masked, v1_routes, v1_masked = reference.pruned_routes
    assert 0 < masked < routes and 0 <= v1_masked <= v1_routes
    save = tmp_path / "ckpt"
    first = run(flags, "--save", save, "--save-interval", "3", "--exit-interval", "3")
    second = run(flags, "--load", save)
    assert second.resumed_from == str(save / "iter_0000003") and second.pruned_routes is None
    assert {**first.losses, **second.losses} == reference.losses
    run_flags = arguments.parse_run(flatten([flags, "--load", save]), world_size=1)
    with trainer.distributed(run_flags):
        built = trainer.build_trainer(run_flags)
        built.metrics.close()
        routers = routers_of(unwrap_model(chunk) for chunk in built.model)
        assert sum(int((~r.route_mask).sum()) for r in routers) == masked  # the checkpoint's masks
        reads = unwrap_model(built.model[0]).config.lime_route_reads  # the pipeline's plan follows them
        assert all(reads[r.layer] == tuple(r.read_sources) for r in routers) and reads[0] == (0,)
        if router == "full":
            assert all(torch.all(r.weight[~r.route_mask] == 0) for r in routers)
    with pytest.raises(CheckpointError, match="model shape mismatch.*lime_prune_top_p 0.9 vs None"):
        run(RESUMABLE, "--lime-router", router, "--load", save)  # a run that does not prune


def test_signal_stops_with_a_checkpoint_and_resume_continues(uninterrupted, tmp_path):
    """SIGINT (in-process; SIGTERM is handled the same way) ends the run at an iteration
    boundary with a checkpoint; resuming reproduces the uninterrupted run."""
    reference, _ = uninterrupted
    save, path = tmp_path / "ckpt", tmp_path / "m.jsonl"

    def interrupt_after_first_iteration():
        while not path.exists() or not path.read_text():
            time.sleep(0.005)
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=interrupt_after_first_iteration, daemon=True).start()
    stopped = run(RESUMABLE, "--save", save, "--metrics-file", path)
    assert stopped.stopped_by == "SIGINT" and 1 <= stopped.iteration < 6
    assert published_iterations(save) == [stopped.iteration]
    resumed = run(RESUMABLE, "--load", save)
    assert {**stopped.losses, **resumed.losses} == reference.losses


# --------------------------------------------------------------------------- errors


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A one-iteration checkpoint of ``RESUMABLE`` (its root directory)."""
    root = tmp_path_factory.mktemp("checkpoint") / "ckpt"
    run(RESUMABLE, "--save", root, "--exit-interval", "1")
    return root


def _break(root: Path, how: str) -> None:
    directory = root / "iter_0000001"
    if how == "tracker":
        (root / TRACKER).write_text("latest\n")
    elif how == "missing":
        (root / TRACKER).write_text("7\n")
    elif how == "incomplete":
        (directory / "metadata.json").unlink()
    elif how == "truncated":
        for shard in directory.glob("*.distcp"):
            shard.write_bytes(shard.read_bytes()[:100])


@pytest.mark.parametrize(
    "how, flags, message",
    [
        ("tracker", [], "corrupt checkpoint tracker .*found 'latest'"),
        ("missing", [], "names iteration 7, but .*iter_0000007 does not exist"),
        ("incomplete", [], "is not a complete checkpoint"),
        ("truncated", [], "cannot load checkpoint .*iter_0000001"),
        (None, ["--vocab-size", "200"], "vocabulary mismatch: .*128 tokens, padded 128.*200 tokens, padded 256"),
        (
            None,
            ["--num-layers", "2", "--hidden-size", "32"],
            "model shape mismatch.*num_layers 4 vs 2, hidden_size 64 vs 32",
        ),
        (None, ["--use-distributed-optimizer"], "state of the regular optimizer, this run uses the distributed"),
    ],
)
def test_bad_checkpoints_fail_with_one_clear_message(checkpoint, tmp_path, capsys, how, flags, message):
    root = tmp_path / "ckpt"
    shutil.copytree(checkpoint, root)
    if how:
        _break(root, how)
    argv = flatten([RESUMABLE, "--load", root, flags])
    assert trainer.main(argv) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("pretrain_lime.py: error: ") and len(error.splitlines()) == 1
    assert re.search(message, error), error


def test_missing_checkpoint_and_data(tmp_path, checkpoint):
    with pytest.raises(CheckpointError, match="no checkpoint in --load .*nowhere"):
        run(RESUMABLE, "--load", tmp_path / "nowhere")
    with pytest.raises(CheckpointError, match="no checkpoint in --load"):
        run(RESUMABLE, "--load", tmp_path / "a", "--save", tmp_path / "a", "--exit-on-missing-checkpoint")
    weights_only = run(RESUMABLE, "--load", checkpoint, "--no-load-optim", "--train-iters", "2")
    assert sorted(weights_only.losses) == [1, 2]
    argv = [a for a in RESUMABLE if a not in ("--mock-data", "--vocab-size", "128")]
    with pytest.raises(DataError, match="data path '.*nothing': .*nothing.bin and .*nothing.idx not found"):
        run(argv, "--data-path", tmp_path / "nothing")
    with pytest.raises(DataError, match="cannot build the SentencePieceTokenizer tokenizer"):
        run(
            argv,
            "--data-path",
            tmp_path / "nothing",
            "--tokenizer-type",
            "SentencePieceTokenizer",
            "--tokenizer-model",
            tmp_path / "none.model",
        )


def test_finetune_and_pretrained_checkpoint(tmp_path, checkpoint):
    """``--finetune`` is ``--no-load-optim --no-load-rng``; ``--pretrained-checkpoint`` starts an empty
    ``--load`` from those weights, and a later run resumes from ``--load`` (not the pretrained
    weights again), bit for bit as one uninterrupted fine-tuning run."""
    reference = run(RESUMABLE, "--load", checkpoint, "--finetune", "--train-iters", "4")
    weights_only = run(RESUMABLE, "--load", checkpoint, "--no-load-optim", "--no-load-rng", "--train-iters", "4")
    assert sorted(reference.losses) == [1, 2, 3, 4] and reference.losses == weights_only.losses
    scratch = run(RESUMABLE, "--train-iters", "4")
    assert scratch.losses[1] != reference.losses[1]  # the pretrained weights made a difference
    tuned = tmp_path / "tuned"
    flags = [RESUMABLE, "--pretrained-checkpoint", checkpoint, "--save", tuned, "--load", tuned, "--train-iters", "4"]
    first = run(flags, "--save-interval", "2", "--exit-interval", "2")
    second = run(flags)
    assert sorted(first.losses) == [1, 2] and second.resumed_from.endswith("iter_0000002")
    assert {**first.losses, **second.losses} == reference.losses
    with pytest.raises(CheckpointError, match="no checkpoint in --pretrained-checkpoint .*nowhere"):
        run(RESUMABLE, "--pretrained-checkpoint", tmp_path / "nowhere")
    with pytest.raises(ArgumentsError, match="--finetune needs --load"):
        run(RESUMABLE, "--finetune")


# --------------------------------------------------------------------------- sinks and dry run


def test_tensorboard_wandb_and_metrics_file(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    result = run(
        TINY,
        "--train-iters 3 --eval-iters 1 --eval-interval 2 --log-interval 1".split(),
        "--tensorboard-dir",
        tmp_path / "tb",
        "--wandb-project",
        "lime-test",
        "--wandb-save-dir",
        tmp_path / "wandb",
        "--metrics-file",
        tmp_path / "m.jsonl",
    )
    records = metrics(tmp_path / "m.jsonl")
    assert [r["iteration"] for r in records] == [1, 2, 3]
    assert {"iteration", "lm_loss", "lr", "grad_norm", "tokens_per_sec"} <= set(records[0])
    assert "validation_loss" in records[1] and "validation_loss" not in records[0]
    assert [r["lm_loss"] for r in records] == [result.losses[i] for i in (1, 2, 3)]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [e.value for e in events.Scalars("lm_loss")] == pytest.approx([r["lm_loss"] for r in records])
    assert list((tmp_path / "wandb" / "wandb").glob("offline-run-*"))


def test_null_tokenizer_is_megatrons_mock_data_vocabulary():
    run = arguments.parse_run(BASE + ["--tokenizer-type", "NullTokenizer", "--vocab-size", "100"], world_size=1)
    tokenizer = tokenizer_of(run.data, run.model.vocab_size)
    assert (tokenizer.unpadded_vocab_size, tokenizer.vocab_size, tokenizer.eod) == (100, 128, 99)
    # pre-tokenized real data with a known vocabulary
    real = arguments.parse_run(
        BASE[:-1] + ["--data-path", "data/x", "--tokenizer-type", "NullTokenizer", "--vocab-size", "64"], world_size=1
    )
    assert real.data.data_path == ["data/x"] and tokenizer_of(real.data, real.model.vocab_size).vocab_size == 128


def test_profile_without_the_pytorch_profiler_needs_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("CPU-only check")
    with pytest.raises(ArgumentsError, match="drives nsys and needs a CUDA GPU"):
        parse_args(BASE + ["--profile"], world_size=1)


def test_pytorch_profiler_traces_the_window_and_throughput_is_logged_on_request(tmp_path, capsys):
    run(
        TINY,
        "--tokenizer-type NullTokenizer --train-iters 3 --log-interval 1 --profile --use-pytorch-profiler "
        "--profile-step-start 1 --profile-step-end 2 --profile-dir".split(),
        tmp_path / "profile",
    )
    [trace] = (tmp_path / "profile").iterdir()
    assert trace.name == "rank0.iterations2-2.pt.trace.json"
    events = json.loads(trace.read_text())["traceEvents"]
    assert any("aten::" in event.get("name", "") for event in events)
    output = capsys.readouterr().out
    assert "iteration       3/      3 | lm loss" in output and "tokens/s 1" not in output.split("summary")[0]
    run(TINY, "--train-iters 1 --log-interval 1 --log-throughput".split())
    assert re.search(r"iteration       1/      1 \| .* \| tokens/s [\d,]+", capsys.readouterr().out)


def test_dry_run_needs_no_distributed(capsys, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the dry run must not start torch.distributed")

    monkeypatch.setattr(torch.distributed, "init_process_group", refuse)
    assert (
        trainer.main(
            BASE[:-1]
            + [
                "--lime",
                "--dry-run",
                "--tensor-model-parallel-size",
                "2",
                "--pipeline-model-parallel-size",
                "2",
                "--vocab-size",
                "96",
                "--global-batch-size",
                "8",
            ]
        )
        == 0
    )
    report = capsys.readouterr().out
    assert "TP 2, PP 2" in report and "parameters" in report


# --------------------------------------------------------------------------- the main job


@pytest.mark.slow
def test_main_job_end_to_end(tmp_path):
    """``python -m lime_megatron`` (shortened): both models train on 2 processes, are scored by
    generation on the held-out expressions; report and plots written."""
    import subprocess

    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "lime_megatron",
            "--output-dir",
            str(tmp_path),
            "--train-iters",
            "8",
            "--num-samples",
            "2000",
            "--test-samples",
            "40",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert "LIMe - LLaMA validation loss" in completed.stdout
    assert (tmp_path / "loss.png").stat().st_size > 0 and (tmp_path / "accuracy.png").stat().st_size > 0
    assert "generation accuracy on held-out expressions" in completed.stdout and "constant" in completed.stdout
    for name in ("lime", "llama"):
        scores = json.loads((tmp_path / f"{name}_scores.json").read_text())
        assert sum(tier["total"] for tier in scores["tiers"]) == 40 and scores["iteration"] == 8
        assert len(scores["generations"]) == 40
    held_out = {json.loads(line)["expression"] for line in (tmp_path / "arith_test.jsonl").read_text().splitlines()}
    trained = {json.loads(line)["expression"] for line in (tmp_path / "arith.jsonl").read_text().splitlines()}
    assert len(held_out) == 40 and not held_out & trained
    assert len(metrics(tmp_path / "lime.jsonl")) == 8 and len(metrics(tmp_path / "llama.jsonl")) == 8


def test_constant_answer_baseline_of_the_main_jobs_table():
    def record(operators: int, answer: int) -> dict:
        return {"num_operators": operators, "num_operands": operators + 1, "tier_unit": "operators", "answer": answer}

    train = [record(2, 1)] * 3 + [record(2, 5), record(3, 7)]
    test = [record(2, 1), record(2, 4), record(2, 5), record(3, 7), record(3, 8)]
    assert main_job.constant_answer_accuracy(train, test) == {2: (1, 1 / 3), 3: (7, 0.5)}
    by_operands = [{**r, "tier_unit": "operands"} for r in train], [{**r, "tier_unit": "operands"} for r in test]
    assert main_job.constant_answer_accuracy(*by_operands) == {3: (1, 1 / 3), 4: (7, 0.5)}


def test_flops_per_iteration_include_the_router_and_console_line_shows_gpu_figures():
    from lime_megatron.planning import flops
    from lime_megatron.training.metrics import IterationMetrics, console_line

    def config(*flags):
        return arguments.transformer_config(
            arguments.parse_run(BASE + ["--global-batch-size", "8", *flags], world_size=1)
        )

    lime, baseline = config("--lime"), config()
    extra = flops.training_flops_per_iteration(lime, 16, 128, 8) - flops.training_flops_per_iteration(
        baseline, 16, 128, 8
    )
    # BASE: 4 layers, 4 heads of dim 16, no GQA. Full router: layer l >= 1 mixes l + 1 sources, 2 + 3 + 4 = 9;
    # per token and source, keys and values: 2 * (4 x 4 weights x 16 dims) multiply-adds, 2 FLOPs each;
    # 3x forward over 8 sequences of 16 tokens.
    assert extra == 3 * 8 * 16 * 9 * 2 * 4 * 4 * 16 * 2
    line = console_line(
        IterationMetrics(
            iteration=5,
            lm_loss=2.5,
            lr=1e-3,
            grad_norm=0.5,
            tokens_per_sec=1234.0,
            router_lr=1e-2,
            tflops_per_gpu=400.0,
            mfu=0.4,
            loss_scale=1024.0,
        ),
        10,
        throughput=True,
    )
    assert (
        "iteration       5/     10 | lm loss 2.500000E+00 | lr 1.000E-03 | router lr 1.000E-02 | "
        "grad norm 0.500 | tokens/s 1,234 | TFLOP/s/GPU 400.0 | MFU 40.0% | loss scale 1024.0"
    ) in line


def test_overlap_p2p_communication_default_and_refusal():
    layout = BASE + ["--num-layers", "8", "--pipeline-model-parallel-size", "2"]
    interleaved = layout + ["--num-virtual-stages-per-pipeline-rank", "2"]
    config = arguments.transformer_config(arguments.parse_run(interleaved, world_size=2))
    assert config.overlap_p2p_comm and not config.batch_p2p_comm  # megatron: one or the other
    off = arguments.transformer_config(
        arguments.parse_run(interleaved + ["--no-overlap-p2p-communication"], world_size=2)
    )
    assert not off.overlap_p2p_comm and off.batch_p2p_comm  # megatron's GPU default, on CPU too
    plain = arguments.transformer_config(arguments.parse_run(layout, world_size=2))
    assert not plain.overlap_p2p_comm and plain.batch_p2p_comm and plain.batch_p2p_sync
    with pytest.raises(ArgumentsError, match="needs virtual pipeline stages"):
        parse_args(layout + ["--overlap-p2p-communication"], world_size=2)
