"""Scoring a model by generation: the arithmetic-expression task (LIMe paper §5.3.2, App. B) and
ProsQA (§5.3.1; ``lime_megatron.data.prosqa``).

Every test expression is given as the prompt ``"<eod><expression> ="`` (the end-of-document token
first, as every training document follows one); the model continues greedily with the KV cache
(:class:`lime_megatron.inference.generation.Generator`) until it emits the end-of-document token
or ``max_new_tokens``. The final answer is the text after the continuation's last ``=`` (the
whole continuation when it has none), and a sample is right when that equals the expected integer
exactly (exact match, as the paper scores AET). Accuracy is reported per operand count (the
paper's tiers) with a 95% Wilson score interval, which stays inside [0, 1] and is not degenerate
at 0 or 100% accuracy:

    centre = (p + z^2 / 2n) / (1 + z^2 / n),  half = z / (1 + z^2 / n) * sqrt(p (1 - p) / n + z^2 / 4n^2)

with p = correct / n and z = 1.96.

ProsQA: the prompt is the question and a newline (after the end-of-document token); the answer
is right when the text after the generation's last ``#`` equals the record's answer (Coconut's
exact match), the steps when the generated lines before ``###`` equal the record's steps.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

from megatron.core.utils import unwrap_model
from tqdm import tqdm

from lime_megatron.data import prosqa
from lime_megatron.data.arithmetic_task import prompt_of, tier_of
from lime_megatron.inference.generation import Generator, SamplingOptions

Z_95 = 1.959963984540054
"""The standard normal quantile of 0.975: two-sided 95% intervals."""


def wilson_interval(correct: int, total: int, z: float = Z_95) -> tuple[float, float]:
    """The Wilson score interval ``(low, high)`` of a binomial proportion ``correct / total``."""
    if total < 1 or not 0 <= correct <= total:
        raise ValueError(f"need 0 <= correct <= total and total >= 1 (got {correct} of {total})")
    p, n = correct / total, total
    scale = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / scale
    half = z / scale * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    # The interval contains p; rounding can put a bound a hair past it at p = 0 or 1.
    return max(0.0, min(p, centre - half)), min(1.0, max(p, centre + half))


def final_answer(continuation: str) -> str:
    """The text after the last ``=`` of a generated solution (all of it when there is none)."""
    return continuation.rsplit("=", 1)[-1].strip()


@dataclass(frozen=True)
class Accuracy:
    """Exact-match accuracy of one group (an AET operand count, ProsQA's "answer" or "steps")
    with its 95% Wilson interval."""

    group: int | str
    correct: int
    total: int

    @property
    def accuracy(self) -> float:
        return self.correct / self.total

    @property
    def interval(self) -> tuple[float, float]:
        return wilson_interval(self.correct, self.total)

    def as_dict(self) -> dict:
        low, high = self.interval
        return {**asdict(self), "accuracy": self.accuracy, "ci95_low": low, "ci95_high": high}


Completer = Callable[[Sequence[str]], list[str]]
"""Prompts (text) -> the generated continuation of each."""


def greedy_completer(
    generator: Generator, max_new_tokens: int, batch_size: int = 64, progress: bool = False
) -> Completer:
    """A :data:`Completer` decoding greedily with ``generator`` (its KV cache unless built with
    ``use_cache=False``): each prompt is tokenized after the end-of-document token, batches of
    ``batch_size`` prompts, stop at end of document."""
    if generator.tokenizer is None or generator.eod is None:
        raise ValueError("scoring needs a generator with a tokenizer and an end-of-document token")
    options = SamplingOptions(max_new_tokens=max_new_tokens, temperature=0.0, stop_at_eod=True)

    def complete(prompts: Sequence[str]) -> list[str]:
        texts = []
        batches = range(0, len(prompts), batch_size)
        for start in tqdm(batches, desc="generating", unit="batch", disable=not progress):
            batch = [
                [generator.eod, *generator.tokenizer.tokenize(prompt)] for prompt in prompts[start : start + batch_size]
            ]
            texts += generator.generate(batch, options).texts
        return texts

    return complete


def score_arithmetic(complete: Completer, records: Sequence[dict]) -> tuple[list[Accuracy], list[dict]]:
    """Per-tier accuracies (sorted by tier, ``arithmetic_task.tier_of``) of ``complete`` on
    ``records`` (``expression``, ``answer``, the tier's counts and unit), and one row per record
    (prompt, generated continuation, extracted and expected answer, tier, correct)."""
    if not records:
        raise ValueError("no test records to score")
    continuations = complete([prompt_of(record) for record in records])
    rows: list[dict] = []
    tiers: dict[int, tuple[int, int]] = {}  # tier -> (correct, records)
    for record, continuation in zip(records, continuations, strict=True):
        answer = final_answer(continuation)
        correct = answer == str(record["answer"])
        rows.append(
            {
                "prompt": prompt_of(record),
                "generated": continuation,
                "answer": answer,
                "expected": record["answer"],
                "tier": tier_of(record),
                "correct": correct,
            }
        )
        hits, total = tiers.get(tier_of(record), (0, 0))
        tiers[tier_of(record)] = (hits + correct, total + 1)
    return [Accuracy(tier, *tiers[tier]) for tier in sorted(tiers)], rows


def read_arithmetic(path: str) -> list[dict]:
    """The test records of an arithmetic JSONL file, all with one tier unit; one message naming
    the first unusable line."""
    records: list[dict] = []
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            record = json.loads(line)
            missing = {"expression", "answer", "num_operators", "num_operands", "tier_unit"} - set(record)
            if missing:
                raise ValueError(
                    f"{path} line {number} lacks {sorted(missing)} (write it with "
                    "tools/make_arithmetic_data.py --test-output)"
                )
            if records and record["tier_unit"] != records[0]["tier_unit"]:
                raise ValueError(
                    f"{path} line {number}: tiers in {record['tier_unit']}, line 1's in {records[0]['tier_unit']}"
                )
            tier_of(record)
            records.append(record)
    return records


def score_prosqa(complete: Completer, records: Sequence[dict]) -> tuple[list[Accuracy], list[dict]]:
    """Answer and step accuracy of ``complete`` on ProsQA ``records``, and one row per record."""
    if not records:
        raise ValueError("no test records to score")
    continuations = complete([prosqa.prompt_of(record) for record in records])
    rows = []
    for record, continuation in zip(records, continuations, strict=True):
        rows.append(
            {
                "generated": continuation,
                "answer": prosqa.final_answer(continuation),
                "expected": record["answer"],
                "answer_correct": prosqa.final_answer(continuation) == record["answer"],
                "steps_correct": prosqa.generated_steps(continuation) == record["steps"],
            }
        )
    return [
        Accuracy(group, sum(row[f"{group}_correct"] for row in rows), len(rows)) for group in ("answer", "steps")
    ], rows


TASKS = {
    "arithmetic": (read_arithmetic, score_arithmetic, lambda records: records[0]["tier_unit"]),
    "prosqa": (prosqa.read, score_prosqa, lambda records: "scored"),
}
"""Task name: (reader of its test file, scorer, what a group is given the records read)."""


def generation_evaluator(trainer) -> dict[str, float]:
    """The trainer's :data:`~lime_megatron.training.trainer.Evaluator` for
    ``--eval-generation-file``: accuracy by greedy generation of the training model (its first
    chunk, unwrapped; one pipeline stage) on that test file, per group
    (``generation_accuracy/<group>``); nothing without the flag. New tokens are capped at the
    sequence length."""
    logging = trainer.run.logging
    if not logging.eval_generation_file:
        return {}
    read = TASKS[logging.eval_generation_task][0]
    model = unwrap_model(trainer.model[0])
    tiers, _ = score_model(
        model,
        trainer.tokenizer,
        logging.eval_generation_task,
        read(logging.eval_generation_file),
        trainer.run.model.seq_length,
    )
    model.train()
    return {f"generation_accuracy/{tier.group}": tier.accuracy for tier in tiers}


def score_model(
    model,
    tokenizer,
    task: str,
    records: Sequence[dict],
    max_new_tokens: int,
    batch_size: int = 64,
    progress: bool = False,
) -> tuple[list[Accuracy], list[dict]]:
    """Score ``model`` (a ``LimeGPTModel`` of this process, or of every rank of a tensor-parallel
    group) on ``task``'s test ``records`` by greedy KV-cache generation; the model is left in eval
    mode."""
    complete = greedy_completer(Generator(model, tokenizer), max_new_tokens, batch_size, progress)
    return TASKS[task][1](complete, records)
