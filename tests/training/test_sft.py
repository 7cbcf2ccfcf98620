"""``pretrain_lime.py --sft``: the loss and every gradient are those of the mean negative
log-likelihood of the response tokens, computed here by hand from the model's logits on each
unpadded example; parallel layouts reproduce the single-process losses.

The hand computation: for every example ``[eod] prompt response`` of the global batch, one forward
of the model on exactly those tokens (no padding), ``-log softmax(logits)`` at each response token
(its closing end-of-document token included), summed over the batch and divided by the number of
response tokens. The trainer's path (``build_trainer``, ``data.microbatches``, ``forward_backward``:
megatron's schedule over padded microbatches with the loss mask) must give the same loss and the
same gradient of every parameter. The microbatches hold different numbers of response tokens, so
megatron's default normalisation (the mean of per-microbatch means) would give other gradients:
``--sft`` turns on per-token normalisation over the global batch, and this test fails without it.
"""

import importlib
import json
from pathlib import Path

import pytest
import torch

from lime_megatron.inference import scoring
from lime_megatron.inference.scoring import generation_evaluator, score_model
from lime_megatron.testing.distributed import run_distributed
from lime_megatron.training import arguments, data, trainer

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]
LOSS_TOLERANCE = 1e-6  # float32, absolute on a mean of ~3 nats
GRAD_TOLERANCE = 1e-5  # relative Frobenius error per parameter
LAYOUT_TOLERANCE = 1e-5  # absolute, as tests/training/test_trainer_layouts.py
MODEL = (
    "--num-layers 4 --hidden-size 32 --ffn-hidden-size 64 --num-attention-heads 4 --num-query-groups 2 "
    "--seq-length 48 --lr 3e-3 --log-interval 100 --eval-iters 0 --split 1,0,0 --lime"
).split()


@pytest.fixture(scope="module")
def sft_data(tmp_path_factory) -> list[str]:
    """The trainer's data flags for arithmetic prompt/response data made by the real tools."""
    out = tmp_path_factory.mktemp("sft")
    tokenizer = [
        "--tokenizer-type",
        "SentencePieceTokenizer",
        "--tokenizer-model",
        str(out / "tok" / "tokenizer.model"),
        "--make-vocab-size-divisible-by",
        "64",
    ]
    steps = [
        (
            "make_arithmetic_data",
            [
                "--output",
                str(out / "a.jsonl"),
                "--num-samples",
                "400",
                "--min-operands",
                "2",
                "--max-operands",
                "4",
                "--no-progress",
                "--test-output",
                str(out / "test.jsonl"),
                "--test-samples",
                "24",
            ],
        ),
        (
            "train_tokenizer",
            [
                "--input",
                str(out / "a.jsonl"),
                "--kind",
                "sentencepiece",
                "--vocab-size",
                "48",
                "--character-coverage",
                "1.0",
                "--no-byte-fallback",
                "--output-dir",
                str(out / "tok"),
                "--no-progress",
            ],
        ),
        (
            "preprocess_data",
            [
                "--input",
                str(out / "a.jsonl"),
                "--output-prefix",
                str(out / "a"),
                "--prompt-key",
                "prompt",
                "--json-keys",
                "response",
                "--no-progress",
                *tokenizer,
            ],
        ),
    ]
    for tool, tool_args in steps:
        assert importlib.import_module(f"lime_megatron.cli.{tool}").main(tool_args) in (0, None)
    return [
        "--sft",
        "--data-path",
        str(out / "a_response_document"),
        "--data-cache-path",
        str(out / "cache"),
        *tokenizer,
    ]


def held_out_file(data_flags: list[str]) -> Path:
    return Path(data_flags[2]).parent / "test.jsonl"


def hand_loss(model, dataset, samples: range) -> torch.Tensor:
    """Mean negative log-likelihood of the response tokens of ``samples``, one unpadded forward
    per example (module docstring)."""
    eod = dataset.eod
    total, count = torch.zeros((), dtype=torch.float64), 0
    for sample in samples:
        prompt, response = dataset.example(dataset.example_of(sample))
        tokens = torch.tensor([eod, *prompt.tolist(), *response.tolist()])
        inputs = tokens[:-1][None]
        logits = model(inputs, torch.arange(inputs.shape[1])[None], None)[0]
        log_probs = torch.log_softmax(logits.double(), dim=-1)
        start = len(prompt)  # logits[start] predicts the first response token
        targets = tokens[start + 1 :]
        total = total - log_probs[start:, :][torch.arange(len(targets)), targets].sum()
        count += len(targets)
    return total / count


def test_loss_and_every_gradient_are_those_of_the_response_tokens(sft_data):
    run = arguments.parse_run(
        [*MODEL, *sft_data, "--micro-batch-size", "2", "--global-batch-size", "6", "--train-iters", "1"], world_size=1
    )
    with trainer.distributed(run):
        built = trainer.build_trainer(run)
        batches = data.microbatches(built.datasets.train, 0, run.training)
        counts = [int(batch["loss_mask"].sum()) for batch in batches]
        assert len(set(counts)) > 1, counts  # unequal microbatches: the normalisation matters
        loss = trainer.forward_backward(built.model, batches)
        params = [p for p in built.model[0].module.parameters() if p.requires_grad]
        trained = [p.main_grad.clone() for p in params]
        expected = hand_loss(built.model[0].module, built.datasets.train, range(6))
        grads = torch.autograd.grad(expected.float(), params)
    assert abs(loss - expected.item()) <= LOSS_TOLERANCE
    errors = [((got - want).norm() / want.norm()).item() for got, want in zip(trained, grads)]
    assert max(errors) <= GRAD_TOLERANCE, errors


def _train_runs(runs: list) -> list:
    return [trainer.train(argv).losses for argv in runs]


def test_layouts_reproduce_the_single_process_losses(sft_data, tmp_path):
    sft = [*MODEL, *sft_data, "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "4"]
    runs = [sft, sft + ["--save", str(tmp_path / "ckpt"), "--exit-interval", "1"]]
    reference, _ = run_distributed(_train_runs, 1, runs, nccl_rules=True)[0]
    layouts = {
        "dp2": [],
        "tp2-sp": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
        "pp2-from-checkpoint": ["--pipeline-model-parallel-size", "2", "--load", str(tmp_path / "ckpt")],
    }
    launched = run_distributed(_train_runs, 2, [sft + flags for flags in layouts.values()], nccl_rules=True)[0]
    for name, losses in zip(layouts, launched):
        first = 2 if "--load" in layouts[name] else 1
        assert sorted(losses) == list(range(first, 5)), name
        errors = [abs(losses[i] - reference[i]) for i in losses]
        assert max(errors) <= LAYOUT_TOLERANCE, (name, errors)


def test_generation_accuracy_at_evaluations_equals_the_scoring_tool(sft_data, tmp_path, monkeypatch):
    """``--eval-generation-file`` through ``pretrain_lime.py``'s evaluator: the generations and the
    accuracy per tier the trainer logs at its last evaluation are what ``lime_megatron.cli.score_generation``
    finds on the checkpoint saved at that iteration (same weights, greedy, new tokens capped at the
    sequence length)."""
    from lime_megatron.cli import score_generation

    generated = []

    def recording(*args, **kwargs):
        tiers, rows = score_model(*args, **kwargs)
        generated.append([row["generated"] for row in rows])
        return tiers, rows

    monkeypatch.setattr(scoring, "score_model", recording)

    flags = [
        *MODEL,
        *sft_data,
        "--micro-batch-size",
        "4",
        "--global-batch-size",
        "8",
        "--train-iters",
        "60",
        "--lr",
        "1e-2",
        "--eval-interval",
        "30",
        "--eval-generation-file",
        str(held_out_file(sft_data)),
        "--save",
        str(tmp_path / "ckpt"),
        "--metrics-file",
        str(tmp_path / "m.jsonl"),
    ]
    with pytest.raises(arguments.UsageError, match="needs the generation evaluator"):
        trainer.train(flags)
    trainer.train(flags, evaluators=[generation_evaluator])
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    logged = {r["iteration"]: r["evaluations"] for r in records if "evaluations" in r}
    assert sorted(logged) == [30, 60] and set(logged[60]) == {f"generation_accuracy/{n}" for n in (2, 3, 4)}
    assert (
        score_generation.main(
            [
                str(tmp_path / "ckpt"),
                "--test-file",
                str(held_out_file(sft_data)),
                "--output",
                str(tmp_path / "s.json"),
                "--max-new-tokens",
                "48",
                "--no-progress",
            ]
        )
        == 0
    )
    tiers = json.loads((tmp_path / "s.json").read_text())["tiers"]
    assert logged[60] == {f"generation_accuracy/{t['group']}": t["accuracy"] for t in tiers}
    trainer_last, tool = generated[1:]  # the trainer's two evaluations, then the tool
    written = json.loads((tmp_path / "s.json").read_text())["generations"]
    assert trainer_last == tool == [row["generated"] for row in written]
    assert len(set(tool)) > 1, tool  # not one degenerate string for every prompt


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--pipeline-model-parallel-size", "2"], "needs --pipeline-model-parallel-size 1"),
        (["--tensor-model-parallel-size", "2", "--sequence-parallel"], "no --sequence-parallel"),
        (["--eval-generation-file", "missing.jsonl"], "missing.jsonl: no such file"),
    ],
)
def test_generation_evaluation_refuses_what_decoding_cannot_do(sft_data, flags, message):
    argv = [
        *MODEL,
        *sft_data,
        "--micro-batch-size",
        "4",
        "--train-iters",
        "2",
        "--eval-generation-file",
        str(held_out_file(sft_data)),
        *flags,
    ]
    with pytest.raises(arguments.ArgumentsError, match=message):
        arguments.parse_run(argv, world_size=2)
