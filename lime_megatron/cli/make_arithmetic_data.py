"""Generate the Arithmetic Expression Task (LIMe paper App. B; Feng et al. 2023) as JSONL.

    python tools/make_arithmetic_data.py --output data/arith.jsonl --num-samples 100000 --seed 0
    python tools/make_arithmetic_data.py --output data/aet_train.jsonl --num-samples 150000 \
        --min-operators 4 --max-operators 6 --test-output data/aet_test.jsonl --test-samples 1500

Each line is one expression over integer operands with + - * / and parentheses, followed by its
step-by-step solution and the exact integer result::

    {"text": "(7 + 5) / (6 + 4 * 3 - 2 * 7) = 12 / (6 + 4 * 3 - 2 * 7) = 12 / (6 + 12 - 2 * 7)
     = 12 / (18 - 2 * 7) = 12 / (18 - 14) = 12 / 4 = 3",
     "expression": "(7 + 5) / (6 + 4 * 3 - 2 * 7)", "answer": 3, "num_operators": 6, "num_operands": 7,
     "tier_unit": "operators", "prompt": "(7 + 5) / (6 + 4 * 3 - 2 * 7) =",
     "response": " 12 / (6 + 4 * 3 - 2 * 7) = ... = 3"}

(``text`` is one line; it is wrapped here.) ``prompt + response == text``: the split that
fine-tuning (``preprocess_data.py --prompt-key prompt --json-keys response``, ``pretrain_lime.py
--sft``) and scoring by generation use (``lime_megatron.data.arithmetic_task``).
``--symbols paper`` writes the paper's ``×``/``÷``.

Tiers: counted in operators by default (``--min-operators``/``--max-operators``), as Feng et al.'s
``length`` counts them and as the LIMe paper's App. B example implies: its expression, 7 operands
and 6 operators, belongs to the hardest of its tiers "4, 5 and 6", which are operator counts (with
operand counts it would be outside every tier). ``--min-operands``/``--max-operands`` count the
tiers in operands instead (n operands = n - 1 operators). Every record has both counts and
``tier_unit``, the unit its tier is counted in (``lime_megatron.data.arithmetic_task.tier_of``;
scoring groups by it).

Value range (our choice; Feng et al. work modulo a prime, the LIMe paper's example uses plain
integers): operands are integers in [--min-operand, --max-operand] (default 1..9); every
intermediate value and the answer is an integer in [0, --max-value] (default 1000: the paper's
Fig. 8b probes the numbers 100-103, so its values exceed 100). So no value is negative, every
division is exact and nothing is divided by zero.

Distribution: an expression of k operators (k uniform in the tier range) gets a random skeleton
first, its shape (the split of the operands between the two sides of every
operator is uniform) and its operators (uniform over + - * /); skeletons that no operand values
can satisfy are redrawn. The operands are then drawn uniformly among all fillings of the
skeleton that satisfy the bounds (exact counting, top-down). So the four operators are equally
frequent; small answers are more frequent than large ones, and divisions by small numbers more
than by large ones, because more fillings give them.

Solution steps: one operator is reduced per step, the first in evaluation order (the first
operator of the parse tree's post-order, i.e. the leftmost innermost one), and parentheses
disappear when their content becomes a number; the paper's App. B example is reproduced
exactly. Expressions are written with the fewest parentheses under the usual precedence and
left-to-right order, except that a right operand of the same precedence keeps its parentheses
(``a + (b - c)``), so reading any step back gives the same tree.

The output is written to a temporary name beside it and renamed when complete.
"""

import argparse
import json
import os
import random
import re
import sys
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import lru_cache
from typing import Union

import numpy as np
from tqdm import tqdm

from lime_megatron.data.arithmetic_task import prompt_of, response_of, tier_of
from lime_megatron.training.arguments import CommandParser

# A parse tree: an int (a number) or (operator, left, right) with operator in "+-*/".
Node = Union[int, tuple[str, "Node", "Node"]]  # noqa: UP007 - a recursive alias needs the string form

OPERATORS = ("+", "-", "*", "/")
PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2}
TIER_UNITS = ("operators", "operands")
SYMBOLS = {"ascii": {"+": "+", "-": "-", "*": "*", "/": "/"}, "paper": {"+": "+", "-": "-", "*": "×", "/": "÷"}}
# Skeletons drawn for one expression before the bounds are declared too tight.
MAX_SKELETON_DRAWS = 1000
TOKEN = re.compile(r"\s*(?:(\d+)|([-+*/×÷()]))")


@dataclass(frozen=True)
class ArithmeticSpec:
    """What to generate: tiers as operator counts, the unit records count their tier in, value
    bounds (see the module docstring), symbols."""

    min_operators: int = 1
    max_operators: int = 4
    min_operand: int = 1
    max_operand: int = 9
    max_value: int = 1000
    symbols: str = "ascii"
    tier_unit: str = "operators"

    def __post_init__(self):
        problem = self.problem()
        if problem:
            raise ValueError(problem)

    def tier(self, operators: int) -> int:
        """An expression of ``operators`` operators counted in ``tier_unit``."""
        return operators + (self.tier_unit == "operands")

    def problem(self) -> str:
        """The first thing wrong with this spec, or '' (tier bounds named in ``tier_unit``)."""
        if self.tier_unit not in TIER_UNITS:
            return f"tier_unit must be one of {list(TIER_UNITS)} (got {self.tier_unit!r})"
        low, high = self.tier(self.min_operators), self.tier(self.max_operators)
        if self.min_operators < 1:
            return f"min_{self.tier_unit} must be at least {self.tier(1)} (got {low}): a solution needs an operator"
        if self.max_operators < self.min_operators:
            return f"max_{self.tier_unit} ({high}) is below min_{self.tier_unit} ({low})"
        if self.min_operand < 0:
            return f"min_operand must be >= 0 (got {self.min_operand}): values are never negative"
        if self.max_operand < self.min_operand:
            return f"max_operand ({self.max_operand}) is below min_operand ({self.min_operand})"
        if self.max_value < self.max_operand:
            return f"max_value ({self.max_value}) is below max_operand ({self.max_operand})"
        if self.symbols not in SYMBOLS:
            return f"symbols must be one of {sorted(SYMBOLS)} (got {self.symbols!r})"
        return ""


def apply(operator: str, a: int, b: int) -> int:
    """a `operator` b in exact integer arithmetic; a division must be exact."""
    if operator == "+":
        return a + b
    if operator == "-":
        return a - b
    if operator == "*":
        return a * b
    if b == 0 or a % b:
        raise ValueError(f"{a} / {b} is not an exact integer division")
    return a // b


def render(node: Node, symbols: str = "ascii") -> str:
    """The text of a tree (fewest parentheses that keep the tree, see the module docstring)."""
    if isinstance(node, int):
        return str(node)
    operator, left, right = node
    return (
        f"{_operand(left, operator, False, symbols)} {SYMBOLS[symbols][operator]} "
        f"{_operand(right, operator, True, symbols)}"
    )


def _operand(child: Node, parent: str, is_right: bool, symbols: str) -> str:
    """`child` rendered as an operand of `parent`, parenthesized where needed."""
    text = render(child, symbols)
    if isinstance(child, int):
        return text
    outer, inner = PRECEDENCE[parent], PRECEDENCE[child[0]]
    return f"({text})" if inner < outer or (is_right and inner == outer) else text


def reduce_once(node: tuple[str, Node, Node]) -> Node:
    """`node` with its first operator in evaluation order replaced by its value."""
    operator, left, right = node
    if not isinstance(left, int):
        return operator, reduce_once(left), right
    if not isinstance(right, int):
        return operator, left, reduce_once(right)
    return apply(operator, left, right)


def solution(node: Node, symbols: str = "ascii") -> list[str]:
    """The expression followed by every step of its solution; the last is the result."""
    steps = [render(node, symbols)]
    while not isinstance(node, int):
        node = reduce_once(node)
        steps.append(render(node, symbols))
    return steps


def parse(text: str) -> Node:
    """The tree of an expression in either symbol set (usual precedence, left to right)."""
    tokens, position = [], 0
    text = text.rstrip()
    while position < len(text):
        match = TOKEN.match(text, position)
        if not match:
            raise ValueError(f"cannot parse {text!r}: unexpected {text[position:].strip()[:10]!r}")
        tokens.append(int(match[1]) if match[1] else {"×": "*", "÷": "/"}.get(match[2], match[2]))
        position = match.end()
    node, rest = _parse_sum(tokens)
    if rest:
        raise ValueError(f"cannot parse {text!r}: unexpected {rest[0]!r}")
    return node


def _parse_sum(tokens: list) -> tuple[Node, list]:
    return _parse_chain(tokens, "+-", _parse_product)


def _parse_product(tokens: list) -> tuple[Node, list]:
    return _parse_chain(tokens, "*/", _parse_atom)


def _parse_chain(tokens: list, operators: str, operand) -> tuple[Node, list]:
    """A left-associative chain of `operand`s joined by `operators`; returns (tree, rest)."""
    node, tokens = operand(tokens)
    while tokens and isinstance(tokens[0], str) and tokens[0] in operators:
        right, rest = operand(tokens[1:])
        node, tokens = (tokens[0], node, right), rest
    return node, tokens


def _parse_atom(tokens: list) -> tuple[Node, list]:
    if not tokens:
        raise ValueError("cannot parse: the expression ends where a number was expected")
    if isinstance(tokens[0], int):
        return tokens[0], tokens[1:]
    if tokens[0] == "(":
        node, rest = _parse_sum(tokens[1:])
        if not rest or rest[0] != ")":
            raise ValueError("cannot parse: unbalanced parentheses")
        return node, rest[1:]
    raise ValueError(f"cannot parse: {tokens[0]!r} where a number was expected")


def solve(expression: str, symbols: str = "ascii") -> str:
    """The full solution line ``expression = step = ... = result`` of a given expression."""
    return " = ".join(solution(parse(expression), symbols))


class ExpressionSampler:
    """Draws trees that satisfy an `ArithmeticSpec`'s bounds (see the module docstring).

    A skeleton is a tree without numbers: None for an operand, else (operator, left, right).
    ``counts(skeleton)[v]`` is the number of ways to fill its operands so that it evaluates to
    v with every intermediate value an integer in [0, max_value] (float64, exact below 2**53;
    only ratios matter).
    """

    def __init__(self, spec: ArithmeticSpec):
        self.spec = spec
        top = spec.max_value
        self.leaf = np.zeros(top + 1)
        self.leaf[spec.min_operand : spec.max_operand + 1] = 1.0
        # Every (x, y) in [0, max_value]^2 with x * y <= max_value: products x*y, quotients x.
        pairs = [(x, y) for x in range(top + 1) for y in range(top // x + 1 if x else top + 1)]
        self.x, self.y = np.array(pairs, dtype=np.int64).T
        self.counts = lru_cache(maxsize=1 << 16)(self._counts)
        self.children = lru_cache(maxsize=1 << 16)(self._children)

    def _counts(self, skeleton) -> np.ndarray:
        """[max_value + 1]: fillings of `skeleton` per value."""
        if skeleton is None:
            return self.leaf
        operator, left, right = skeleton
        a, b, top = self.counts(left), self.counts(right), self.spec.max_value
        if operator == "+":
            return np.convolve(a, b)[: top + 1]
        if operator == "-":  # index x + (top - y) holds x - y + top
            return np.convolve(a, b[::-1])[top:]
        if operator == "*":
            return np.bincount(self.x * self.y, a[self.x] * b[self.y], top + 1)
        divisor = self.y > 0  # x * y / y = x
        x, y = self.x[divisor], self.y[divisor]
        return np.bincount(x, a[x * y] * b[y], top + 1)

    def _children(self, skeleton, v: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(left values, right values, cumulative fillings) of the children giving v."""
        operator, left, right = skeleton
        if operator == "+":
            a = np.arange(v + 1)
            b = v - a
        elif operator == "-":
            b = np.arange(self.spec.max_value - v + 1)
            a = v + b
        elif operator == "*":
            product = self.x * self.y == v
            a, b = self.x[product], self.y[product]
        else:
            quotient = (self.x == v) & (self.y > 0)
            a, b = self.x[quotient] * self.y[quotient], self.y[quotient]
        return a, b, np.cumsum(self.counts(left)[a] * self.counts(right)[b])

    def sample(self, rng: random.Random, num_operands: int) -> Node:
        """A random tree of `num_operands` operands: skeletons are drawn until one can be
        filled within the bounds, then filled uniformly among its valid fillings."""
        for _ in range(MAX_SKELETON_DRAWS):
            skeleton = self._skeleton(rng, num_operands)
            counts = np.cumsum(self.counts(skeleton))
            if counts[-1] > 0:
                return self._fill(rng, skeleton, _pick(rng, counts))
        raise ValueError(
            f"{MAX_SKELETON_DRAWS} random operator trees of {num_operands} operands "
            f"in a row cannot keep every value in [0, {self.spec.max_value}]: "
            "raise max_value or lower max_operand"
        )

    def _skeleton(self, rng: random.Random, k: int):
        """A skeleton of k operands: split point and operator uniform at every node."""
        if k == 1:
            return None
        kl = rng.randint(1, k - 1)
        return rng.choice(OPERATORS), self._skeleton(rng, kl), self._skeleton(rng, k - kl)

    def _fill(self, rng: random.Random, skeleton, v: int) -> Node:
        """`skeleton` filled so that it evaluates to v."""
        if skeleton is None:
            return v
        a, b, cumulative = self.children(skeleton, v)
        i = _pick(rng, cumulative)
        return (skeleton[0], self._fill(rng, skeleton[1], int(a[i])), self._fill(rng, skeleton[2], int(b[i])))


def _pick(rng: random.Random, cumulative: np.ndarray) -> int:
    """An index drawn with probability proportional to its weight (given cumulated)."""
    return int(np.searchsorted(cumulative, rng.random() * cumulative[-1], side="right"))


def generate(
    num_samples: int, seed: int, spec: ArithmeticSpec = ArithmeticSpec(), exclude: frozenset[str] = frozenset()
) -> Iterator[dict]:
    """Yield `num_samples` records (text, expression, answer, num_operators, num_operands,
    tier_unit, prompt, response); same seed, same records. The operator count of each is uniform
    in [min_operators, max_operators]. A drawn expression in `exclude` (a held-out test set) is
    skipped and another one drawn."""
    if num_samples < 1:
        raise ValueError(f"num_samples must be at least 1 (got {num_samples})")
    rng, sampler = random.Random(seed), ExpressionSampler(spec)
    produced = 0
    while produced < num_samples:
        num_operators = rng.randint(spec.min_operators, spec.max_operators)
        steps = solution(sampler.sample(rng, num_operators + 1), spec.symbols)
        if steps[0] in exclude:
            continue
        produced += 1
        record = {
            "text": " = ".join(steps),
            "expression": steps[0],
            "answer": int(steps[-1]),
            "num_operators": num_operators,
            "num_operands": num_operators + 1,
            "tier_unit": spec.tier_unit,
        }
        yield {**record, "prompt": prompt_of(record), "response": response_of(record)}


def test_split(num_samples: int, seed: int, spec: ArithmeticSpec) -> list[dict]:
    """`num_samples` distinct held-out expressions, drawn with their own stream (seed ``-1 - seed``,
    never a training seed >= 0); train with ``exclude`` = their expressions."""
    records, seen = [], set()
    for record in generate(10 * num_samples, -1 - seed, spec):
        if record["expression"] not in seen:
            seen.add(record["expression"])
            records.append(record)
        if len(records) == num_samples:
            return records
    raise ValueError(f"could not draw {num_samples} distinct test expressions: widen the value bounds")


@dataclass
class Summary:
    """Totals of a written file."""

    samples: int
    bytes: int
    seconds: float
    tiers: Counter  # tier -> samples
    tier_unit: str
    answers: tuple[int, int]  # smallest, largest
    distinct: int  # distinct expressions

    def lines(self, path: str) -> list[str]:
        counts = ", ".join(f"{k}: {n:,}" for k, n in sorted(self.tiers.items()))
        return [
            f"wrote {self.samples:,} samples ({self.bytes / 1e6:.2f} MB) to {path} in {self.seconds:.1f} s",
            f"{self.tier_unit} per expression: {counts}",
            f"answers in [{self.answers[0]}, {self.answers[1]}]; {self.distinct:,} distinct expressions",
        ]


def write_jsonl(path: str, records: Iterable[dict], num_samples: int, progress: bool = True) -> Summary:
    """Write the `num_samples` `records` to `path` (complete, or not at all)."""
    start = time.perf_counter()
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    temporary = os.path.join(directory, f".{os.path.basename(path)}.tmp-{os.getpid()}")
    tiers: Counter[int] = Counter()
    units: set[str] = set()
    answers: list[int] = []
    expressions: set[str] = set()
    try:
        with open(temporary, "w", encoding="utf-8") as out:
            for record in tqdm(records, total=num_samples, desc="expressions", unit="expr", disable=not progress):
                out.write(json.dumps(record, ensure_ascii=False) + "\n")
                tiers[tier_of(record)] += 1
                units.add(record["tier_unit"])
                answers.append(record["answer"])
                expressions.add(record["expression"])
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)
    return Summary(
        num_samples,
        os.path.getsize(path),
        time.perf_counter() - start,
        tiers,
        "/".join(sorted(units)),
        (min(answers), max(answers)),
        len(expressions),
    )


def tier_fields(args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict:
    """The spec's tier fields from the flags: operator counts, or operand counts (n operands
    = n - 1 operators) with ``tier_unit`` "operands"; both kinds given is an error."""
    operands, operators = (args.min_operands, args.max_operands), (args.min_operators, args.max_operators)
    if operands == (None, None):
        defaults = (ArithmeticSpec().min_operators, ArithmeticSpec().max_operators)
        low, high = (given if given is not None else default for given, default in zip(operators, defaults))
        return dict(min_operators=low, max_operators=high, tier_unit="operators")
    if operators != (None, None):
        parser.error("give the tiers in operators (--min/max-operators) or in operands (--min/max-operands), not both")
    if None in operands:
        parser.error("--min-operands and --max-operands go together")
    return dict(min_operators=operands[0] - 1, max_operators=operands[1] - 1, tier_unit="operands")


def parse_args(argv=None) -> argparse.Namespace:
    """Command-line flags; a bad value ends the run with one message."""
    defaults = ArithmeticSpec()
    parser = CommandParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output", required=True, help="the .jsonl file to write")
    parser.add_argument("--num-samples", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    tiers = parser.add_argument_group("tiers (in operators, the default, or in operands; not both)")
    tiers.add_argument("--min-operators", type=int, help=f"default {defaults.min_operators}")
    tiers.add_argument("--max-operators", type=int, help=f"default {defaults.max_operators}")
    tiers.add_argument("--min-operands", type=int, help="tiers counted in operands: n operands, n - 1 operators")
    tiers.add_argument("--max-operands", type=int)
    parser.add_argument("--min-operand", type=int, default=defaults.min_operand, help="smallest operand")
    parser.add_argument("--max-operand", type=int, default=defaults.max_operand, help="largest operand")
    parser.add_argument(
        "--max-value",
        type=int,
        default=defaults.max_value,
        help="bound of every intermediate value and answer (all are >= 0)",
    )
    parser.add_argument(
        "--symbols", choices=sorted(SYMBOLS), default=defaults.symbols, help="ascii: * and /; paper: × and ÷"
    )
    parser.add_argument(
        "--test-output", help="also write held-out test expressions here; no training expression equals one of them"
    )
    parser.add_argument("--test-samples", type=int, default=0, help="distinct test expressions (with --test-output)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    try:
        args.spec = ArithmeticSpec(
            **tier_fields(args, parser),
            min_operand=args.min_operand,
            max_operand=args.max_operand,
            max_value=args.max_value,
            symbols=args.symbols,
        )
    except ValueError as err:
        parser.error(str(err).replace("_", "-"))
    if args.num_samples < 1:
        parser.error(f"--num-samples must be at least 1 (got {args.num_samples})")
    if bool(args.test_output) != (args.test_samples > 0):
        parser.error("--test-output and --test-samples (>= 1) go together")
    return args


def main(argv=None) -> int:
    """Entry point; returns the process exit status."""
    args = parse_args(argv)
    progress = not args.no_progress
    try:
        held_out: frozenset[str] = frozenset()
        if args.test_output:
            test = test_split(args.test_samples, args.seed, args.spec)
            held_out = frozenset(record["expression"] for record in test)
            print("\n".join(write_jsonl(args.test_output, test, len(test), progress).lines(args.test_output)))
        records = generate(args.num_samples, args.seed, args.spec, exclude=held_out)
        summary = write_jsonl(args.output, records, args.num_samples, progress)
    except (OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: nothing was written", file=sys.stderr)
        return 130
    print("\n".join(summary.lines(args.output)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
