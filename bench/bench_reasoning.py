"""LIMe against LLaMA on a reasoning task, trained from scratch with the loss on the solutions
(``pretrain_lime.py --sft``) and scored by greedy generation (``tools/score_generation.py``):
accuracy per tier (AET, LIMe paper §5.3.2) or answer and step accuracy (ProsQA-style, §5.3.1),
per seed, with the mean over seeds, its 95% interval (Student's t over the seeds) and the
LIMe - LLaMA gap with its 95% interval (Welch's t).

    python bench/bench_reasoning.py --task aet --seeds 1 2 --train-iters 1500      # the paper's shape
    python bench/bench_reasoning.py --task aet --models LIMe --seeds 1 --epochs 200  # examples/aet_paper.sh
    python bench/bench_reasoning.py --task prosqa --seeds 1 2 --train-iters 1200 --batch-size 32
    python bench/bench_reasoning.py --task prosqa --pretrain-samples 4000 --pretrain-epochs 2 --epochs 2.5 \
        --train-samples 4000 --test-samples 500 --batch-size 32 --seeds 1 2 3   # pretrain, then fine-tune

The data are made once under ``--output-dir`` by the project's tools, with a SentencePiece
tokenizer trained on the training file; every run is one process on this machine. AET: the main
job's data stages (``main_job.data_steps``) with the paper's tiers, 4, 5 and 6 operators (App. B's
example is one of 6 operators), 50,000 expressions per tier, one example per sequence and the loss
on the solution (``--sft``): the protocol the paper implies (it counts epochs over 50,000 samples
per tier and scores the solution generated from the expression), shared by the main job and
``examples/aet_paper.sh``. ProsQA: ``make_prosqa_data.py`` (Coconut's graph sizes by default);
with ``--pretrain-samples P`` each model is first pretrained on the whole texts of P further
questions, packed, the loss on every token (``--pretrain-epochs`` passes), then fine-tuned from those
weights (``--pretrained-checkpoint``) with ``--sft``: the paper's protocol (§5.3.1, App. C: a
pretrained 150M fine-tuned on ProsQA) with an in-domain corpus in place of FineWeb-Edu, which this
machine does not have.
Models: AET at the paper's shape (4 layers, width 32, 4 heads, FFN 128, lr 1e-3 with linear
decay); ProsQA at a small one (4 layers, width 64, 4 heads, FFN 256, lr 1e-3 linear). The
sequence is the longest example rounded up to a multiple of 8. Each run's log, metrics, checkpoint,
generations and result stay under ``--output-dir``; a run whose result is there is read back, so
seeds can run in separate processes and one more call prints them together.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

from tqdm import tqdm

from lime_megatron.cli import main_job
from lime_megatron.cli.main_job import tokenizer_flags, tool_command

MODELS = {"LLaMA": [], "LIMe": ["--lime"]}
PAPER_TIERS = ("--min-operators", "4", "--max-operators", "6")
"""The paper's AET tiers, 4, 5 and 6 operators (``make_arithmetic_data``'s module docstring)."""
SHAPES = {
    "aet": "--num-layers 4 --hidden-size 32 --ffn-hidden-size 128 --num-attention-heads 4",
    "prosqa": "--num-layers 4 --hidden-size 64 --ffn-hidden-size 256 --num-attention-heads 4",
}
SCHEDULE = (
    "--lr 1e-3 --min-lr 0 --lr-decay-style linear --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 "
    "--clip-grad 1.0 --split 100,0,0 --eval-iters 0 --log-interval 100"
)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--task", choices=sorted(SHAPES), required=True)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    budget = parser.add_mutually_exclusive_group(required=True)
    budget.add_argument("--train-iters", type=int)
    budget.add_argument("--epochs", type=float, help="passes over the training examples (the paper: 200 for AET)")
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=sorted(MODELS))
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--train-samples", type=int, help="default: AET 150,000 (50,000 per tier), ProsQA 6,000")
    parser.add_argument("--test-samples", type=int, default=300)
    parser.add_argument(
        "--pretrain-samples",
        type=int,
        default=0,
        help="ProsQA: questions of a separate pretraining split, their whole text packed with the loss on "
        "every token, trained before fine-tuning (the paper's protocol); default 0: from scratch",
    )
    parser.add_argument("--pretrain-epochs", type=float, default=1.0, help="passes over the pretraining tokens")
    parser.add_argument(
        "--coconut-dir",
        help="ProsQA: Coconut's data directory (prosqa_train/valid/test.json) instead of generated questions",
    )
    parser.add_argument("--output-dir", default="runs/bench_reasoning")
    args = parser.parse_args(argv)
    if args.pretrain_samples and (args.task != "prosqa" or args.coconut_dir):
        parser.error("--pretrain-samples splits generated ProsQA questions: --task prosqa without --coconut-dir")
    return args


def run_tool(command: list[str], log: Path) -> None:
    """Run one stage, ``[tool of lime_megatron.cli, its arguments...]``, with its output to ``log``;
    stop with the log's tail if it fails."""
    with open(log, "a") as out:
        code = subprocess.run(tool_command(*command), stdout=out, stderr=subprocess.STDOUT).returncode
    if code:
        tail = "".join(log.read_text().splitlines(True)[-15:])
        sys.exit(f"{' '.join(command[:2])} failed (exit {code}); see {log}:\n{tail}")


def make_data(args: argparse.Namespace, out: Path) -> tuple[Path, list[str]]:
    """Write the task's data once; (test file, the trainer's data flags)."""
    if args.task == "aet":
        test, data_flags = main_job.test_file(out), main_job.trainer_data_flags(out)
        if not Path(data_flags[2] + ".idx").exists():
            for _, tool, tool_args in main_job.data_steps(
                out, args.train_samples or 150000, args.test_samples, PAPER_TIERS
            ):
                run_tool([tool, *tool_args], out / "data.log")
        return test, data_flags
    data_flags = prosqa_data_flags(out)
    if not Path(data_flags[2] + ".idx").exists():
        make_prosqa_data(args, out)
    return out / "prosqa_test.json", data_flags


def make_prosqa_data(args: argparse.Namespace, out: Path) -> None:
    """ProsQA's data stages: the questions (generated, or converted from Coconut's files with
    ``--coconut-dir``); with ``--pretrain-samples P`` the first P training questions become the
    pretraining split (``pretrain.jsonl``) and the rest the fine-tuning one; a 512-piece tokenizer
    with byte fallback trained on both (it keeps the newlines between steps); prompt/response data of
    the fine-tuning split and, with P, the pretraining split's whole texts packed (``--append-eod``)."""
    log, train = out / "data.log", out / "prosqa_train.jsonl"
    if args.coconut_dir:
        questions = ["--from-coconut", args.coconut_dir]
    else:
        total = (args.train_samples or 6000) + args.pretrain_samples
        questions = ["--train-samples", str(total), "--test-samples", str(args.test_samples)]
    run_tool(["make_prosqa_data", "--output-dir", str(out), *questions], log)
    tokenizer = ["train_tokenizer", "--input", str(train), "--kind", "sentencepiece", "--vocab-size", "512"]
    run_tool(tokenizer + ["--character-coverage", "1.0", "--output-dir", str(out / "tokenizer"), "--no-progress"], log)
    finetune = train
    if args.pretrain_samples:
        finetune = split_pretraining(train, args.pretrain_samples, out)
        run_tool(preprocess(out / "pretrain.jsonl", out / "pretrain", out, "--json-keys", "text", "--append-eod"), log)
    run_tool(preprocess(finetune, out / "train", out, "--prompt-key", "prompt", "--json-keys", "response"), log)


def preprocess(source: Path, prefix: Path, out: Path, *keys: str) -> list[str]:
    """The ``preprocess_data`` stage of ``source`` into ``prefix`` with the task's tokenizer."""
    return ["preprocess_data", "--input", str(source), "--output-prefix", str(prefix), *keys, "--no-progress"] + [
        *tokenizer_flags(out)
    ]


def split_pretraining(train: Path, count: int, out: Path) -> Path:
    """Write the first ``count`` lines of ``train`` to ``pretrain.jsonl`` and the rest to
    ``finetune.jsonl`` (two disjoint sets of questions, none of them a test question); the latter's path."""
    lines = train.read_text().splitlines(True)
    (out / "pretrain.jsonl").write_text("".join(lines[:count]))
    (out / "finetune.jsonl").write_text("".join(lines[count:]))
    return out / "finetune.jsonl"


def prosqa_data_flags(out: Path) -> list[str]:
    """The trainer's data flags for the ProsQA fine-tuning data of :func:`make_prosqa_data`."""
    return ["--sft", *dataset_flags(out, "train_response_document")]


def pretraining_flags(out: Path) -> list[str]:
    """The trainer's data flags for the packed pretraining split of :func:`make_prosqa_data`."""
    return dataset_flags(out, "pretrain_text_document")


def dataset_flags(out: Path, dataset: str) -> list[str]:
    """``--data-path`` of ``out``'s ``dataset``, its cache and the task's tokenizer."""
    return ["--data-path", str(out / dataset), "--data-cache-path", str(out / "cache"), *tokenizer_flags(out)]


def sequence_length(prefix: str) -> tuple[int, int]:
    """(the longest example with its leading end-of-document token, rounded up to 8; examples)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(prefix)
    longest = int(dataset.sequence_lengths.reshape(-1, 2).sum(axis=1).max()) + 1
    return -(-longest // 8) * 8, len(dataset.document_indices) - 1


def packed_sequences(prefix: str, seq: int) -> int:
    """How many ``seq``-token sequences the packed dataset at ``prefix`` fills."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(prefix)  # held: its lengths are a view of its memory map
    return int(dataset.sequence_lengths.sum()) // seq


def train(args, name: str, seed: int, data_flags: list[str], seq: int, iters: int, run: Path, log: Path) -> dict:
    """Train ``name`` for ``iters`` iterations of the bench's schedule into ``run``; the last metrics
    record."""
    run_tool(
        ["pretrain", *SHAPES[args.task].split(), *SCHEDULE.split(), *MODELS[name], *data_flags]
        + ["--seq-length", str(seq), "--micro-batch-size", str(args.batch_size)]
        + ["--global-batch-size", str(args.batch_size), "--train-iters", str(iters)]
        + ["--lr-warmup-iters", str(max(1, iters // 20)), "--seed", str(seed), "--save", str(run)]
        + ["--metrics-file", str(run) + ".jsonl"],
        log,
    )
    return json.loads((Path(str(run) + ".jsonl")).read_text().splitlines()[-1])


def train_and_score(args, out: Path, name: str, seed: int, data_flags: list[str], test: Path, seq: int) -> dict:
    """Train one model (pretrained first with ``--pretrain-samples``, else from scratch), score it;
    its accuracies and the training time (a run whose result is already in ``--output-dir`` is read
    back, not repeated)."""
    run = out / f"{name.lower()}-{seed}"
    result_file = out / f"result-{name.lower()}-{seed}.json"
    if result_file.exists():
        return json.loads(result_file.read_text())
    log = out / f"{name.lower()}-{seed}.log"
    start = time.perf_counter()
    result = {}
    if args.pretrain_iters:
        pretrained = out / f"{name.lower()}-{seed}-pretrained"
        last = train(args, name, seed, pretraining_flags(out), seq, args.pretrain_iters, pretrained, log)
        result["pretrain_loss"] = last["lm_loss"]
        data_flags = [*data_flags, "--pretrained-checkpoint", str(pretrained)]
    last = train(args, name, seed, data_flags, seq, args.train_iters, run, log)
    seconds = time.perf_counter() - start
    scores = out / f"scores-{name.lower()}-{seed}.json"
    task = ["--task", "prosqa", "--max-new-tokens", "96"] if args.task == "prosqa" else ["--max-new-tokens", "64"]
    run_tool(
        ["score_generation", str(run), "--test-file", str(test), "--output", str(scores), "--no-progress", *task], log
    )
    result |= {
        "tiers": {str(t["group"]): t["accuracy"] for t in json.loads(scores.read_text())["tiers"]},
        "seconds": seconds,
        "loss": last["lm_loss"],
        "epoch": last.get("epoch"),
    }
    result_file.write_text(json.dumps(result))
    return result


T_975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228)
"""Student's t quantile 0.975 for 1..10 degrees of freedom (1.96 beyond: the normal's)."""


def t_975(degrees: float) -> float:
    """The 0.975 quantile of Student's t with ``degrees`` of freedom (rounded down: wider)."""
    whole = max(1, math.floor(degrees))
    return T_975[whole - 1] if whole <= len(T_975) else 1.96


def mean_interval(values: list[float]) -> tuple[float, float, float]:
    """(mean, low, high): the mean of ``values`` (one per seed) with its 95% t-interval; the
    interval is the mean itself for one value."""
    mean = statistics.mean(values)
    if len(values) < 2:
        return mean, mean, mean
    half = t_975(len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))
    return mean, mean - half, mean + half


def gap_interval(lime: list[float], llama: list[float]) -> tuple[float, float, float]:
    """(gap, low, high): LIMe's mean minus LLaMA's with its 95% Welch interval (seeds independent
    per model); the gap itself for one seed each."""
    gap = statistics.mean(lime) - statistics.mean(llama)
    if min(len(lime), len(llama)) < 2:
        return gap, gap, gap
    shares = [statistics.variance(values) / len(values) for values in (lime, llama)]
    error = math.sqrt(sum(shares))
    if error == 0:
        return gap, gap, gap
    degrees = error**4 / sum(share**2 / (len(values) - 1) for share, values in zip(shares, (lime, llama)))
    return gap, gap - t_975(degrees) * error, gap + t_975(degrees) * error


def interval_cell(triple: tuple[float, float, float], sign: str = "") -> str:
    """``mean [low, high]`` in percent (points), ``sign`` ``"+"`` for a gap."""
    mean, low, high = (100 * value for value in triple)
    return f"{mean:{sign}6.1f} [{low:{sign}.1f}, {high:{sign}.1f}]" if low != high else f"{mean:{sign}6.1f}"


def candidate_answers(scores: Path, test: Path) -> tuple[float, float, float]:
    """ProsQA's chance line, read from one run's generations: (the share of answers naming exactly
    one of the question's two candidate concepts, the target or the negative; the accuracy among
    those; the share of generated steps that are facts of the question).  Naming one at random is
    right half the time; a step that is no fact of the question was not read from it."""
    from lime_megatron.data import prosqa

    records = prosqa.read(str(test), graph=True)
    named = correct = steps = facts = 0
    for record, generation in zip(records, json.loads(scores.read_text())["generations"], strict=True):
        words = set(generation["answer"].replace(".", " ").split())
        target, negative = (record["idx_to_symbol"][record[key]] for key in ("target", "neg_target"))
        if (target in words) != (negative in words):
            named += 1
            correct += generation["answer_correct"]
        given = {sentence.strip().rstrip(".") for sentence in record["question"].split(".")}
        generated = prosqa.generated_steps(generation["generated"])
        steps, facts = steps + len(generated), facts + sum(step.rstrip(".") in given for step in generated)
    return named / len(records), correct / max(1, named), facts / max(1, steps)


def report_candidates(out: Path, test: Path, models: list[str], seeds: list[int]) -> None:
    """Per ProsQA run: how often its answer names one of the two candidates, and how often that one
    is right (the chance line: 50%)."""
    print("\nProsQA per seed: answers naming one of the two candidates (right among them; chance 50%), steps")
    print("that are facts of the question:")
    for name in models:
        shares = [candidate_answers(out / f"scores-{name.lower()}-{seed}.json", test) for seed in seeds]
        cells = ", ".join(f"{100 * n:.1f}% ({100 * right:.1f}% right), {100 * f:.1f}%" for n, right, f in shares)
        print(f"{name:>6}: {cells}")


def report(results: dict, models: list[str], seeds: list[int]) -> None:
    """Per group (tier, or answer/steps): each model's accuracy per seed, the mean over seeds with
    its 95% t-interval, and the LIMe - LLaMA gap with its 95% Welch interval when both models ran."""
    groups = list(next(iter(results.values()))["tiers"])
    print(
        f"\n{'group':>8} {'model':>6} "
        + " ".join(f"{'seed ' + str(s):>8}" for s in seeds)
        + f" {'mean [95% interval] (%)':>26}"
    )
    for group in groups:
        values = {}
        for name in models:
            values[name] = [results[(name, seed)]["tiers"][group] for seed in seeds]
            cells = " ".join(f"{100 * v:7.1f}%" for v in values[name])
            print(f"{group:>8} {name:>6} {cells} {interval_cell(mean_interval(values[name])):>26}")
        if set(values) == set(MODELS):
            gap = interval_cell(gap_interval(values["LIMe"], values["LLaMA"]), "+")
            print(f"{group:>8} {'gap':>6} {'':>{9 * len(seeds)}} {gap:>26} points")
    for name in models:
        runs = [results[(name, seed)] for seed in seeds]
        print(
            f"{name:>6}: final train loss "
            + ", ".join(f"{r['loss']:.3f}" for r in runs)
            + f"; epochs {runs[0]['epoch']:.2f}; training "
            + ", ".join(f"{r['seconds']:.0f} s" for r in runs)
        )


def main(argv=None) -> None:
    args = parse_args(argv)
    out = Path(args.output_dir) / (args.task + (f"-pretrain{args.pretrain_samples}" if args.pretrain_samples else ""))
    out.mkdir(parents=True, exist_ok=True)
    test, data_flags = make_data(args, out)
    seq, examples = sequence_length(data_flags[2])
    if args.epochs is not None:
        args.train_iters = math.ceil(args.epochs * examples / args.batch_size)
    args.pretrain_iters = 0
    if args.pretrain_samples:
        sequences = packed_sequences(pretraining_flags(out)[1], seq)
        args.pretrain_iters = math.ceil(args.pretrain_epochs * sequences / args.batch_size)
        print(
            f"pretraining: {args.pretrain_samples:,} questions packed in {sequences:,} sequences of {seq}, "
            f"{args.pretrain_iters} iterations of {args.batch_size} ({args.pretrain_epochs:g} epochs) per run"
        )
    print(
        f"{args.task}: {examples:,} training examples, sequence {seq}, {args.train_iters} iterations of "
        f"{args.batch_size} ({args.train_iters * args.batch_size / examples:.2f} epochs) per run"
    )
    runs = [(name, seed) for seed in args.seeds for name in args.models]
    results = {}
    for name, seed in tqdm(runs, desc="runs", unit="run"):
        results[(name, seed)] = train_and_score(args, out, name, seed, data_flags, test, seq)
    report(results, args.models, args.seeds)
    if args.task == "prosqa":
        report_candidates(out, test, args.models, args.seeds)


if __name__ == "__main__":
    main()
