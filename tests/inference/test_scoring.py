"""lime_megatron.inference.scoring and tools/score_generation.py's table: the Wilson interval
against hand-computed values, answer extraction, and per-tier exact-match accuracy of a generator
made to be right, one made to be wrong and one right on one tier only."""

import re

import pytest

from lime_megatron.cli import make_arithmetic_data as arith
from lime_megatron.cli import score_generation
from lime_megatron.inference import scoring
from lime_megatron.inference.generation import Generation

EOD = 0


class CharTokenizer:
    """One token per character (its code point); 0 is the end of document."""

    eod = EOD

    def tokenize(self, text: str) -> list[int]:
        return [ord(character) for character in text]

    def detokenize(self, tokens: list[int]) -> str:
        return "".join(chr(token) for token in tokens)


class SolvingGenerator:
    """Stands in for ``Generator``: reads each prompt's tokens back, checks they are the
    end-of-document token then ``"<expression> ="``, and continues with the true solution
    (``offset`` 0) or with its answer shifted by ``offset`` on the tiers in ``wrong_tiers``."""

    def __init__(self, offset: int = 0, wrong_tiers: tuple[int, ...] = ()):
        self.tokenizer, self.eod = CharTokenizer(), EOD
        self.offset, self.wrong_tiers = offset, wrong_tiers
        self.batches = []

    def generate(self, prompts: list[list[int]], options) -> Generation:
        assert options.temperature == 0 and options.stop_at_eod
        self.batches.append(len(prompts))
        texts = []
        for prompt in prompts:
            assert prompt[0] == EOD
            text = self.tokenizer.detokenize(prompt[1:])
            assert text.endswith(" =")
            expression = text[:-2]
            steps = arith.solution(arith.parse(expression))[1:]
            if len(re.findall(r"\d+", expression)) - 1 in self.wrong_tiers:  # tiers in operators
                steps[-1] = str(int(steps[-1]) + self.offset)
            texts.append(" " + " = ".join(steps))
        return Generation([[1]] * len(prompts), ["eod"] * len(prompts), 0.0, texts)


@pytest.fixture(scope="module")
def records() -> list[dict]:
    spec = arith.ArithmeticSpec(min_operators=4, max_operators=6)
    return arith.test_split(90, seed=3, spec=spec)


def test_wilson_interval_matches_hand_computation():
    # 8 of 10: p = 0.8, z^2 = 3.8415: centre (0.8 + 0.19207) / 1.38415 = 0.71681,
    # half 1.95996 / 1.38415 * sqrt(0.016 + 0.0096037) = 0.22656.
    low, high = scoring.wilson_interval(8, 10)
    assert low == pytest.approx(0.49016, abs=1e-4) and high == pytest.approx(0.94332, abs=1e-4)
    # 0 of n: [0, z^2 / (n + z^2)].
    assert scoring.wilson_interval(0, 10) == pytest.approx((0.0, 3.841459 / 13.841459), abs=1e-6)
    assert scoring.wilson_interval(10, 10)[1] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="0 <= correct <= total"):
        scoring.wilson_interval(3, 2)


def test_final_answer_is_after_the_last_equals_sign():
    assert scoring.final_answer(" 12 / 4 = 3") == "3"
    assert scoring.final_answer("3 ") == "3"
    assert scoring.final_answer("12 / 4 = 3 = ") == ""


def test_a_generator_made_to_be_right_scores_100_percent(records):
    generator = SolvingGenerator()
    tiers, rows = scoring.score_arithmetic(scoring.greedy_completer(generator, 100, batch_size=32), records)
    assert generator.batches == [32, 32, 26]
    assert [tier.group for tier in tiers] == [4, 5, 6]
    assert sum(tier.total for tier in tiers) == 90
    assert all(tier.correct == tier.total for tier in tiers) and all(row["correct"] for row in rows)
    assert rows[0]["answer"] == str(records[0]["answer"])


def test_a_generator_made_to_be_wrong_scores_0_and_one_wrong_tier_only_there(records):
    wrong = SolvingGenerator(offset=1, wrong_tiers=(4, 5, 6))
    tiers, _ = scoring.score_arithmetic(scoring.greedy_completer(wrong, 100), records)
    assert all(tier.correct == 0 for tier in tiers)
    partly = SolvingGenerator(offset=7, wrong_tiers=(5,))
    tiers, _ = scoring.score_arithmetic(scoring.greedy_completer(partly, 100), records)
    counts = {tier.group: (tier.correct, tier.total) for tier in tiers}
    assert counts[5][0] == 0 and counts[4][0] == counts[4][1] and counts[6][0] == counts[6][1]
    table = score_generation.table(tiers, scoring.TASKS["arithmetic"][2](records))
    assert table.split()[0] == "operators" and "100.0%" in table and "  0.0%" in table and "[" in table


def test_scoring_needs_records_and_a_tokenizer():
    with pytest.raises(ValueError, match="no test records"):
        scoring.score_arithmetic(lambda prompts: [], [])
    generator = SolvingGenerator()
    generator.tokenizer = None
    with pytest.raises(ValueError, match="tokenizer"):
        scoring.greedy_completer(generator, 10)


def test_wilson_interval_contains_the_proportion_at_the_boundaries():
    """At 0 or all correct, rounding must not put a bound past the proportion (the main job's
    accuracy plot draws accuracy - low and high - accuracy as error bars)."""
    for total in range(1, 500):
        for correct in (0, total):
            low, high = scoring.wilson_interval(correct, total)
            assert low <= correct / total <= high, (correct, total, low, high)
