"""``python -m lime_megatron``: the project's pipeline end to end on data it makes itself.

Each stage is one of the package's commands (``lime_megatron.cli``), run by module name as a
subprocess, so the job runs wherever the package is installed:

1. ``make_arithmetic_data`` writes the paper's arithmetic-expression task (App. B):
   expressions (the prompt) with their step-by-step solutions (the response), as JSONL;
2. ``train_tokenizer`` trains a tiny SentencePiece tokenizer on it (offline);
3. ``preprocess_data --prompt-key`` turns it into a prompt/response indexed dataset;
4. ``pretrain --sft`` trains a tiny LIMe and the LLaMA baseline on it from scratch, the
   loss on the solutions only, each launched with ``torch.distributed.run`` on 2 CPU processes over
   gloo, pipeline-parallel (PP=2; ``--layout tp2`` for tensor parallelism), same seed, data,
   schedule and paper optimizer settings;
5. ``score_generation`` scores each trained checkpoint by greedy generation with the KV
   cache on held-out expressions (none of them in the training data): exact-match accuracy of
   the final answer per tier (operator count), with 95% Wilson intervals, beside the accuracy of always
   answering the tier's most frequent training answer;
6. their losses and accuracies are printed side by side with a summary, and plotted to
   ``loss.png`` and ``accuracy.png`` (with the ``plots`` extra; without it the job says so once).

Everything is written under ``--output-dir`` (default: ``runs/main-job-<date>-<time>`` in the
working directory), said at the start. Training shows a progress bar of the iterations (read from
the metrics file the trainer appends to) under the trainer's own lines, scoring the bar of
``score_generation``; both bars only on a terminal.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import IO

import numpy as np
from tqdm import tqdm

from lime_megatron.data.arithmetic_task import tier_of
from lime_megatron.extras import install_command, requires_extra
from lime_megatron.training.arguments import CommandParser

LAYOUTS = {"pp2": ["--pipeline-model-parallel-size", "2"], "tp2": ["--tensor-model-parallel-size", "2"]}
MODELS = {"LLaMA": [], "LIMe": ["--lime"]}

# The tiny model and schedule (paper optimizer settings of Table 2, shorter and smaller).
TRAINER_OPTIONS = [
    "--num-layers",
    "6",
    "--hidden-size",
    "64",
    "--ffn-hidden-size",
    "256",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "48",
    "--micro-batch-size",
    "16",
    "--global-batch-size",
    "64",
    "--lr",
    "3e-3",
    "--min-lr",
    "1e-5",
    "--lr-decay-style",
    "cosine",
    "--weight-decay",
    "0.1",
    "--adam-beta1",
    "0.9",
    "--adam-beta2",
    "0.95",
    "--adam-eps",
    "1e-8",
    "--clip-grad",
    "1.0",
    "--split",
    "95,5,0",
    "--eval-interval",
    "100",
    "--eval-iters",
    "2",
    "--log-interval",
    "100",
    "--seed",
    "1234",
]


def parse_args(argv=None) -> argparse.Namespace:
    parser = CommandParser(prog="python -m lime_megatron", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--output-dir",
        help="where data, tokenizer, checkpoints, metrics and plots go (default: runs/main-job-<date>-<time>)",
    )
    parser.add_argument("--num-samples", type=int, default=20000, help="arithmetic expressions (default: %(default)s)")
    parser.add_argument(
        "--test-samples",
        type=int,
        default=400,
        help="held-out expressions scored by generation (default: %(default)s)",
    )
    parser.add_argument("--train-iters", type=int, default=600, help="iterations of each model (default: %(default)s)")
    parser.add_argument(
        "--layout",
        choices=sorted(LAYOUTS),
        default="pp2",
        help="parallel layout of the 2 processes (default: %(default)s)",
    )
    return parser.parse_args(argv)


def output_dir(given: str | None) -> Path:
    """The job's directory: ``given``, else a new ``runs/main-job-<date>-<time>`` in the working
    directory (a second one started in the same second waits for the next)."""
    if given:
        return Path(given).resolve()
    while True:
        out = Path("runs", time.strftime("main-job-%Y%m%d-%H%M%S")).resolve()
        if not out.exists():
            return out
        time.sleep(0.2)


def tool_command(tool: str, *arguments: str) -> list[str]:
    """The command line that runs ``lime_megatron.cli.<tool>`` with this Python."""
    return [sys.executable, "-m", f"lime_megatron.cli.{tool}", *arguments]


def _run(step: str, command: list[str]) -> None:
    """Run one stage as a subprocess (its output passes through); exit if it fails."""
    print(f"\n=== {step}\n$ {' '.join(command)}", flush=True)
    start = time.perf_counter()
    completed = subprocess.run(command)
    if completed.returncode:
        sys.exit(f"{step} failed with exit status {completed.returncode}")
    print(f"({step}: {time.perf_counter() - start:.1f} s)", flush=True)


def _relay(stream: IO[str], destination: IO[str]) -> None:
    """Copy ``stream``'s lines to ``destination`` above the progress bars."""
    for line in stream:
        tqdm.write(line, file=destination, end="")


def _completed_iterations(metrics_file: Path) -> int:
    """Iterations the trainer has recorded so far (one line each in ``--metrics-file``)."""
    try:
        return metrics_file.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def _run_training(step: str, command: list[str], metrics_file: Path, iterations: int) -> None:
    """:func:`_run` for a training stage: its output passes through above a bar of the iterations
    in ``metrics_file`` (on a terminal)."""
    print(f"\n=== {step}\n$ {' '.join(command)}", flush=True)
    start = time.perf_counter()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # the trainer's lines as they come
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    relays = [
        threading.Thread(target=_relay, args=(process.stdout, sys.stdout)),
        threading.Thread(target=_relay, args=(process.stderr, sys.stderr)),
    ]
    for relay in relays:
        relay.start()
    with tqdm(total=iterations, desc=step.split(" (")[0], unit="it", disable=None, leave=False) as bar:
        while process.poll() is None:
            time.sleep(0.5)
            bar.update(_completed_iterations(metrics_file) - bar.n)
    for relay in relays:
        relay.join()
    if process.returncode:
        sys.exit(f"{step} failed with exit status {process.returncode}")
    print(f"({step}: {time.perf_counter() - start:.1f} s)", flush=True)


TOKENIZER_VOCAB = 48  # SentencePiece pieces: the task's 18 characters and frequent merges


def data_steps(
    out: Path, num_samples: int, test_samples: int, tiers: tuple[str, ...] = ()
) -> list[tuple[str, str, list[str]]]:
    """The data stages as ``(name, tool, its arguments)``, the tool a module of ``lime_megatron.cli``:
    generate (with the held-out test expressions; ``tiers``: ``make_arithmetic_data``'s tier flags,
    default its own), train the tokenizer, preprocess. The one AET protocol: the main job and
    ``bench/bench_reasoning.py`` (so ``examples/aet_paper.sh``) make their data here and train
    with :func:`trainer_data_flags` (``--sft``)."""
    jsonl, tokenizer = out / "arith.jsonl", out / "tokenizer"
    return [
        (
            "arithmetic data",
            "make_arithmetic_data",
            [
                "--output",
                str(jsonl),
                "--num-samples",
                str(num_samples),
                "--seed",
                "0",
                "--no-progress",
                "--test-output",
                str(test_file(out)),
                "--test-samples",
                str(test_samples),
                *tiers,
            ],
        ),
        (
            "tokenizer",
            "train_tokenizer",
            [
                "--input",
                str(jsonl),
                "--kind",
                "sentencepiece",
                "--vocab-size",
                str(TOKENIZER_VOCAB),
                "--character-coverage",
                "1.0",
                "--no-byte-fallback",
                "--output-dir",
                str(tokenizer),
                "--no-progress",
            ],
        ),
        (
            "preprocessing",
            "preprocess_data",
            [
                "--input",
                str(jsonl),
                "--output-prefix",
                str(out / "arith"),
                "--prompt-key",
                "prompt",
                "--json-keys",
                "response",
                "--no-progress",
                *tokenizer_flags(out),
            ],
        ),
    ]


def test_file(out: Path) -> Path:
    """The held-out expressions scored by generation."""
    return out / "arith_test.jsonl"


def tokenizer_flags(out: Path) -> list[str]:
    """Tokenizer flags shared by the preprocessing tool and the trainer."""
    return [
        "--tokenizer-type",
        "SentencePieceTokenizer",
        "--tokenizer-model",
        str(out / "tokenizer" / "tokenizer.model"),
        "--make-vocab-size-divisible-by",
        "64",
    ]


def trainer_data_flags(out: Path) -> list[str]:
    """The trainer's data and tokenizer flags for the data of :func:`data_steps`."""
    return [
        "--sft",
        "--data-path",
        str(out / "arith_response_document"),
        "--data-cache-path",
        str(out / "cache"),
        *tokenizer_flags(out),
    ]


def prepare_data(out: Path, num_samples: int, test_samples: int) -> list[str]:
    """Run the data stages; the trainer's data flags."""
    for name, tool, tool_args in data_steps(out, num_samples, test_samples):
        _run(name, tool_command(tool, *tool_args))
    return trainer_data_flags(out)


def warmup_iters(train_iters: int) -> int:
    """Linear warmup over the first fifteenth of the run (40 of the default 600 iterations)."""
    return max(1, train_iters // 15)


def train_models(out: Path, data_flags: list[str], args: argparse.Namespace) -> dict[str, list[dict]]:
    """Train each model with torchrun on 2 processes; per-iteration metrics of each."""
    metrics = {}
    for name, model_flags in MODELS.items():
        path = out / f"{name.lower()}.jsonl"
        path.unlink(missing_ok=True)
        _run_training(
            f"training {name} ({args.layout}, 2 processes)",
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node",
                "2",
                "-m",
                "lime_megatron.cli.pretrain",
                *TRAINER_OPTIONS,
                *LAYOUTS[args.layout],
                *data_flags,
                *model_flags,
                "--train-iters",
                str(args.train_iters),
                "--lr-warmup-iters",
                str(warmup_iters(args.train_iters)),
                "--metrics-file",
                str(path),
                "--save",
                str(checkpoint_dir(out, name)),
            ],
            path,
            args.train_iters,
        )
        metrics[name] = [json.loads(line) for line in path.read_text().splitlines()]
    return metrics


def checkpoint_dir(out: Path, name: str) -> Path:
    return out / f"checkpoint-{name.lower()}"


def score_models(out: Path, names: list[str]) -> dict[str, list[dict]]:
    """Score each trained checkpoint by generation on the held-out expressions; per-tier
    accuracies of each (``Accuracy.as_dict``)."""
    scores = {}
    for name in names:
        path = out / f"{name.lower()}_scores.json"
        _run(
            f"scoring {name} by generation",
            tool_command(
                "score_generation",
                str(checkpoint_dir(out, name)),
                "--test-file",
                str(test_file(out)),
                "--output",
                str(path),
                *([] if sys.stderr.isatty() else ["--no-progress"]),
            ),
        )
        scores[name] = json.loads(path.read_text())["tiers"]
    return scores


def _smoothed(records: list[dict], last: int = 10) -> float:
    return float(np.mean([r["lm_loss"] for r in records[-last:]]))


def report(metrics: dict[str, list[dict]], out: Path) -> None:
    """Print the losses side by side and a summary; plot the curves."""
    names = list(metrics)
    iterations = len(metrics[names[0]])
    step = max(1, iterations // 12)
    shown = sorted(
        set(range(step, iterations + 1, step))
        | {iterations}
        | {r["iteration"] for r in metrics[names[0]] if "validation_loss" in r}
    )
    print(
        f"\n{'iteration':>9} "
        + " ".join(f"{n + ' loss':>11}" for n in names)
        + " "
        + " ".join(f"{n + ' val':>10}" for n in names)
    )
    for iteration in shown:
        rows = [metrics[n][iteration - 1] for n in names]
        losses = " ".join(f"{r['lm_loss']:>11.4f}" for r in rows)
        vals = " ".join(f"{r['validation_loss']:>10.4f}" if "validation_loss" in r else f"{'':>10}" for r in rows)
        print(f"{iteration:>9} {losses} {vals}")
    speed = {n: float(np.median([r["tokens_per_sec"] for r in metrics[n][1:]])) for n in names}
    final_val = {
        n: next((r["validation_loss"] for r in reversed(metrics[n]) if "validation_loss" in r), float("nan"))
        for n in names
    }
    print("\nsummary (arithmetic-expression task, App. B; 2 CPU processes):")
    for n in names:
        print(
            f"  {n:>5}: train loss (mean of last 10 iterations) {_smoothed(metrics[n]):.4f}, "
            f"validation loss {final_val[n]:.4f} (ppl {np.exp(final_val[n]):.3f}), "
            f"median {speed[n]:,.0f} tokens/s"
        )
    if {"LIMe", "LLaMA"} <= set(names):
        print(
            f"  LIMe - LLaMA validation loss: {final_val['LIMe'] - final_val['LLaMA']:+.4f}; "
            f"LIMe throughput {speed['LIMe'] / speed['LLaMA']:.2f}x LLaMA's"
        )
    if can_plot():
        _plot(metrics, out / "loss.png")
    print(f"  outputs (data, tokenizer, metrics{', loss.png' if can_plot() else ''}): {out}")


def can_plot() -> bool:
    """Whether matplotlib (the ``plots`` extra) is installed; without it the job plots nothing."""
    return importlib.util.find_spec("matplotlib") is not None


def _pyplot():
    with requires_extra("plots"):
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    return plt


def _plot(metrics: dict[str, list[dict]], path: Path) -> None:
    plt = _pyplot()
    figure, axis = plt.subplots(figsize=(7, 4))
    for name, records in metrics.items():
        (line,) = axis.plot(
            [r["iteration"] for r in records], [r["lm_loss"] for r in records], label=f"{name} train", alpha=0.8
        )
        val = [(r["iteration"], r["validation_loss"]) for r in records if "validation_loss" in r]
        axis.plot(*zip(*val), "o--", color=line.get_color(), label=f"{name} validation")
    axis.set(xlabel="iteration", ylabel="loss (nats/token)", title="LIMe vs LLaMA, arithmetic task")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def constant_answer_accuracy(train: list[dict], test: list[dict]) -> dict[int, tuple[int, float]]:
    """Per tier (``arithmetic_task.tier_of``): the most frequent answer of the training expressions
    and the accuracy of always answering it on the test expressions (what a model that ignores the
    expression reaches)."""
    baseline = {}
    for count in sorted({tier_of(record) for record in test}):
        answers = Counter(record["answer"] for record in train if tier_of(record) == count)
        answer = answers.most_common(1)[0][0] if answers else None
        tier = [record["answer"] for record in test if tier_of(record) == count]
        baseline[count] = (answer, sum(value == answer for value in tier) / len(tier))
    return baseline


def report_accuracy(scores: dict[str, list[dict]], out: Path) -> None:
    """Print the generation accuracies per tier side by side with the constant-answer baseline;
    plot them."""
    names = list(scores)
    tiers = sorted({tier["group"] for name in names for tier in scores[name]})
    by_tier = {name: {tier["group"]: tier for tier in scores[name]} for name in names}
    test = _records(test_file(out))
    unit = test[0]["tier_unit"]
    constant = constant_answer_accuracy(_records(out / "arith.jsonl"), test)
    print(
        "\ngeneration accuracy on held-out expressions (greedy, KV cache; exact match of the final answer, "
        "95% Wilson interval; constant: always the tier's most frequent training answer):"
    )
    print(f"{unit:>9} " + " ".join(f"{name + ' accuracy':>28}" for name in names) + f"{'constant':>16}")
    for count in tiers:
        cells = []
        for name in names:
            tier = by_tier[name][count]
            cells.append(
                f"{tier['accuracy']:>7.1%} [{tier['ci95_low']:.1%}, {tier['ci95_high']:.1%}] of {tier['total']:>3}"
            )
        answer, accuracy = constant[count]
        print(f"{count:>9} " + " ".join(f"{cell:>28}" for cell in cells) + f"{accuracy:>8.1%} ({answer:>3})")
    if can_plot():
        _plot_accuracy(by_tier, tiers, {count: constant[count][1] for count in tiers}, unit, out / "accuracy.png")
        print(f"  accuracy plot: {out / 'accuracy.png'}")


def _plot_accuracy(
    by_tier: dict[str, dict[int, dict]], tiers: list[int], constant: dict[int, float], unit: str, path: Path
) -> None:
    """Bars of each model's accuracy per tier with their intervals; over each tier's bars, a line
    at the accuracy of always answering its most frequent training answer (``constant``)."""
    plt = _pyplot()
    figure, axis = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(by_tier)
    for index, (name, tier_scores) in enumerate(by_tier.items()):
        rows = [tier_scores[count] for count in tiers]
        accuracy = np.array([row["accuracy"] for row in rows])
        errors = [accuracy - [row["ci95_low"] for row in rows], [row["ci95_high"] for row in rows] - accuracy]
        axis.bar(
            np.arange(len(tiers)) + index * width,
            100 * accuracy,
            width,
            yerr=100 * np.array(errors),
            capsize=3,
            label=name,
        )
    for position, count in enumerate(tiers):
        axis.hlines(
            100 * constant[count],
            position - width / 2,
            position + width * (len(by_tier) - 0.5),
            colors="black",
            linestyles="dashed",
            label="constant answer" if position == 0 else None,
        )
    axis.set_xticks(np.arange(len(tiers)) + width * (len(by_tier) - 1) / 2, [str(count) for count in tiers])
    axis.set(
        xlabel=unit,
        ylabel="exact-match accuracy (%)",
        title="LIMe vs LLaMA, arithmetic task: generation accuracy (95% Wilson CI)",
    )
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv=None) -> int:
    args = parse_args(argv)
    out = output_dir(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    print(f"main job: every output goes to {out} (--output-dir to change)", flush=True)
    if not can_plot():
        print(f"matplotlib is not installed: the results are printed, not plotted ({install_command('plots')})")
    start = time.perf_counter()
    data_flags = prepare_data(out, args.num_samples, args.test_samples)
    metrics = train_models(out, data_flags, args)
    scores = score_models(out, list(metrics))
    report(metrics, out)
    report_accuracy(scores, out)
    print(f"  total time {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
