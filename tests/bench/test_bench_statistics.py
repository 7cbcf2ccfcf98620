"""The statistics the overhead benches report their verdicts with (``bench/``): the distribution-free
interval of a median and the met / missed / open verdict of ``bench_floor_target.py``."""

from __future__ import annotations

import math
import random

import pytest

from tests.bench import load_bench

_, _, lime_overhead, floor_target = load_bench("tables", "cpu_triton", "bench_lime_overhead", "bench_floor_target")
median_interval, verdict = lime_overhead.median_interval, floor_target.verdict

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning")]


def coverage(n: int, j: int) -> float:
    """P(x_(j) <= median <= x_(n+1-j)) for n draws of a continuous distribution: the chance that
    at least j and at most n - j of them fall below the median, a Binomial(n, 1/2) count."""
    return sum(math.comb(n, k) for k in range(j, n - j + 1)) / 2**n


@pytest.mark.parametrize("n", [9, 11, 21, 41])
def test_median_interval_is_the_narrowest_order_statistics_holding_95_percent(n):
    values = random.Random(n).sample(range(1000), n)
    low, high = median_interval(values)
    ordered = sorted(values)
    j = ordered.index(low) + 1
    assert ordered.index(high) + 1 == n + 1 - j  # symmetric order statistics
    assert coverage(n, j) >= 0.95 > coverage(n, j + 1)


def test_median_interval_of_few_values_is_their_range():
    assert median_interval([3.0, 1.0, 2.0]) == (1.0, 3.0)


@pytest.mark.parametrize("low,high,expected", [(0.96, 1.05, "met"), (1.051, 1.2, "missed"), (1.0, 1.06, "open")])
def test_verdict_reads_the_whole_interval_against_the_target(low, high, expected):
    assert verdict(low, high, 1.05) == expected


reasoning = load_bench("bench_reasoning")[0]


def test_t_quantiles_are_students():
    """Student's t 0.975 quantiles (tables: 12.706 at 1, 4.303 at 2, 2.228 at 10 degrees), the
    normal's 1.96 beyond the table, fractional degrees rounded down (a wider interval)."""
    assert reasoning.t_975(1) == 12.706 and reasoning.t_975(2) == 4.303 and reasoning.t_975(10) == 2.228
    assert reasoning.t_975(2.9) == 4.303 and reasoning.t_975(40) == 1.96


@pytest.mark.parametrize("seeds", [3, 5])
def test_seed_intervals_cover_the_mean_95_percent_of_the_time(seeds):
    """Normal draws of ``seeds`` values: the t-interval holds the true mean in about 95% of 4,000
    trials, the Welch gap interval the true gap likewise."""
    rng = random.Random(seeds)
    trials, held, gap_held = 4000, 0, 0
    for _ in range(trials):
        lime = [rng.gauss(0.6, 0.05) for _ in range(seeds)]
        llama = [rng.gauss(0.4, 0.08) for _ in range(seeds)]
        _, low, high = reasoning.mean_interval(lime)
        held += low <= 0.6 <= high
        _, low, high = reasoning.gap_interval(lime, llama)
        gap_held += low <= 0.2 <= high
    assert abs(held / trials - 0.95) <= 0.015
    assert 0.94 <= gap_held / trials <= 0.975  # Welch's degrees rounded down: at least nominal


def test_pretraining_split_is_disjoint_and_complete(tmp_path):
    """``--pretrain-samples P``: the first P training questions pretrain, the others fine-tune;
    together they are the training file, line for line."""
    train = tmp_path / "prosqa_train.jsonl"
    lines = [f'{{"text": "question {i}"}}\n' for i in range(10)]
    train.write_text("".join(lines))
    finetune = reasoning.split_pretraining(train, 4, tmp_path)
    assert (tmp_path / "pretrain.jsonl").read_text() == "".join(lines[:4])
    assert finetune.read_text() == "".join(lines[4:])


@pytest.mark.parametrize("task,extra", [("aet", []), ("prosqa", ["--coconut-dir", "coconut/data"])])
def test_pretraining_is_refused_where_it_cannot_split_generated_questions(task, extra, capsys):
    with pytest.raises(SystemExit):
        reasoning.parse_args(["--task", task, "--epochs", "1", "--pretrain-samples", "10", *extra])
    assert "--pretrain-samples splits generated ProsQA questions" in capsys.readouterr().err


def test_candidate_answers_count_answers_naming_one_candidate(tmp_path):
    """An answer naming the target or the negative alone counts (right or not); one naming both, or
    neither, does not; a generated step counts as read when it is a fact of the question."""
    import json

    from lime_megatron.data import prosqa

    records = prosqa.generate(4, seed=3)
    (tmp_path / "test.json").write_text(json.dumps(records))
    names = [(r["idx_to_symbol"][r["target"]], r["idx_to_symbol"][r["neg_target"]]) for r in records]
    answers = [f"Tom is a {names[0][0]}.", f"Tom is a {names[1][1]}.", f"{names[2][0]} {names[2][1]}", "Tom is."]
    fact = records[0]["question"].split(". ")[1] + "."  # a fact of the first question
    steps = [f"{fact}\nEvery wumpus is a yumpus.\n### ", "### ", "### ", "### "]
    generations = [
        {"answer": answer, "answer_correct": index == 0, "generated": steps[index] + answer}
        for index, answer in enumerate(answers)
    ]
    (tmp_path / "scores.json").write_text(json.dumps({"generations": generations}))
    assert reasoning.candidate_answers(tmp_path / "scores.json", tmp_path / "test.json") == (0.5, 0.5, 0.5)
