"""tools/make_arithmetic_data.py: every solution checked by an independent evaluator (Python's
own parser with exact Fraction arithmetic), the paper's example, determinism, the CLI, bad input."""

import ast
import itertools
import json
import re
from collections import Counter
from fractions import Fraction

import pytest

from lime_megatron.cli import make_arithmetic_data as arith
from lime_megatron.data.arithmetic_task import tier_of

PAPER_INPUT = "(7 + 5) ÷ (6 + 4 × 3 - 2 × 7)"
PAPER_SOLUTION = (
    "(7 + 5) ÷ (6 + 4 × 3 - 2 × 7) = 12 ÷ (6 + 4 × 3 - 2 × 7) = "
    "12 ÷ (6 + 12 - 2 × 7) = 12 ÷ (18 - 2 × 7) = 12 ÷ (18 - 14) = 12 ÷ 4 = 3"
)
SPEC = arith.ArithmeticSpec(min_operators=1, max_operators=5, min_operand=1, max_operand=12, max_value=150)
PAPER_TIERS = arith.ArithmeticSpec(min_operators=4, max_operators=6)
"""The paper's tiers 4, 5, 6 as operator counts, the default value range."""
PYTHON_OPERATORS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}


def python_tree(step: str) -> ast.expr:
    """Python's parse of one step (paper symbols mapped to ASCII)."""
    return ast.parse(step.replace("×", "*").replace("÷", "/"), mode="eval").body


def evaluate(node: ast.expr, seen: list) -> Fraction:
    """Exact value of a Python expression tree; every intermediate value appended to `seen`."""
    if isinstance(node, ast.Constant):
        return Fraction(node.value)
    a, b = evaluate(node.left, seen), evaluate(node.right, seen)
    operator = PYTHON_OPERATORS[type(node.op)]
    value = {"+": lambda: a + b, "-": lambda: a - b, "*": lambda: a * b, "/": lambda: a / b}[operator]()
    seen.append(value)
    return value


def reduce_first(node: ast.expr) -> ast.expr:
    """Python's tree with its first operator in post-order replaced by its exact value."""
    if isinstance(node.left, ast.BinOp):
        return ast.BinOp(reduce_first(node.left), node.op, node.right)
    if isinstance(node.right, ast.BinOp):
        return ast.BinOp(node.left, node.op, reduce_first(node.right))
    value = evaluate(node, [])
    assert value.denominator == 1
    return ast.Constant(int(value))


def check_record(record: dict, spec: arith.ArithmeticSpec) -> None:
    steps = record["text"].split(" = ")
    assert steps[0] == record["expression"] and steps[-1] == str(record["answer"])
    operands = [int(n) for n in re.findall(r"\d+", record["expression"])]
    assert len(operands) == record["num_operands"] == record["num_operators"] + 1 == len(steps)  # a reduction a step
    assert spec.min_operators <= record["num_operators"] <= spec.max_operators
    assert record["tier_unit"] == spec.tier_unit and tier_of(record) == spec.tier(record["num_operators"])
    assert all(spec.min_operand <= n <= spec.max_operand for n in operands)
    trees = [python_tree(step) for step in steps]
    for tree in trees:
        seen = []
        assert evaluate(tree, seen) == record["answer"]
        assert all(v.denominator == 1 and 0 <= v <= spec.max_value for v in seen), seen
    for tree, following in zip(trees, trees[1:]):
        assert ast.dump(reduce_first(tree)) == ast.dump(following)


def test_paper_example_reproduced_exactly():
    """App. B's expression and solution, and the example is a record of the paper's hardest tier,
    6 operators (7 operands), that the generator of the paper's tiers can draw: its operator tree
    has fillings within the value bounds that evaluate to its answer."""
    assert arith.solve(PAPER_INPUT, "paper") == PAPER_SOLUTION
    ascii_solution = PAPER_SOLUTION.replace("×", "*").replace("÷", "/")
    assert arith.solve(PAPER_INPUT.replace("×", "*"), "ascii") == ascii_solution
    record = {
        "text": ascii_solution,
        "expression": ascii_solution.split(" = ")[0],
        "answer": 3,
        "num_operators": 6,
        "num_operands": 7,
        "tier_unit": "operators",
    }
    check_record(record, PAPER_TIERS)
    assert tier_of(record) == PAPER_TIERS.max_operators == 6

    def skeleton(node):
        return None if isinstance(node, int) else (node[0], skeleton(node[1]), skeleton(node[2]))

    assert arith.ExpressionSampler(PAPER_TIERS).counts(skeleton(arith.parse(record["expression"])))[3] > 0


def test_the_numbers_fig_8b_probes_occur():
    """Fig. 8b probes 100-103: the default range holds them (the old bound of 100 did not), and
    3,000 expressions of the paper's tiers (seed 1) contain each of them."""
    numbers = Counter(
        int(n) for record in arith.generate(3000, seed=1, spec=PAPER_TIERS) for n in re.findall(r"\d+", record["text"])
    )
    assert all(numbers[n] > 0 for n in range(100, 104)), [numbers[n] for n in range(100, 104)]
    assert PAPER_TIERS.max_value >= 103


@pytest.mark.parametrize("symbols", ["ascii", "paper"])
def test_every_solution_checks_out_independently(symbols):
    spec = arith.ArithmeticSpec(**{**SPEC.__dict__, "symbols": symbols})
    records = list(arith.generate(1500, seed=7, spec=spec))
    for record in records:
        check_record(record, spec)
    assert set(Counter(r["num_operators"] for r in records)) == set(range(1, 6))
    # The tree is recovered from the text: parse(render(tree)) is the identity.
    for record in records[:200]:
        assert arith.render(arith.parse(record["expression"]), symbols) == record["expression"]


def test_operators_uniform_and_parentheses_present():
    records = list(arith.generate(2000, seed=3, spec=SPEC))
    counts = Counter(c for r in records for c in r["expression"] if c in "+-*/")
    total = sum(counts.values())
    assert all(0.2 < counts[op] / total < 0.3 for op in "+-*/"), counts
    assert sum("(" in r["expression"] for r in records) > len(records) / 4


def test_deterministic_for_a_seed():
    first = list(arith.generate(300, seed=11, spec=SPEC))
    assert first == list(arith.generate(300, seed=11, spec=SPEC))
    assert first != list(arith.generate(300, seed=12, spec=SPEC))


def test_cli_writes_the_records_of_generate(tmp_path, capsys):
    out = tmp_path / "sub" / "arith.jsonl"
    argv = [
        "--output",
        str(out),
        "--num-samples",
        "400",
        "--seed",
        "5",
        "--min-operators",
        "1",
        "--max-operators",
        "5",
        "--max-operand",
        "12",
        "--max-value",
        "150",
        "--no-progress",
    ]
    assert arith.main(argv) == 0
    lines = out.read_text(encoding="utf-8").splitlines()
    assert [json.loads(line) for line in lines] == list(arith.generate(400, 5, SPEC))
    assert sorted(p.name for p in out.parent.iterdir()) == ["arith.jsonl"]
    summary = capsys.readouterr().out
    assert "wrote 400 samples" in summary and "operators per expression: 1:" in summary
    assert arith.main([*argv[:6], "--min-operands", "3", "--max-operands", "4", "--no-progress"]) == 0
    records = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert {(r["tier_unit"], r["num_operands"]) for r in records} == {("operands", 3), ("operands", 4)}
    assert "operands per expression: 3:" in capsys.readouterr().out
    assert arith.main(argv + ["--symbols", "paper"]) == 0
    assert "×" in out.read_text(encoding="utf-8") or "÷" in out.read_text(encoding="utf-8")


def test_interrupted_run_keeps_the_previous_file(tmp_path, monkeypatch, capsys):
    out = tmp_path / "arith.jsonl"
    out.write_text("previous\n")

    def interrupted(num_samples, seed, spec, exclude=frozenset(), generate=arith.generate):
        yield from itertools.islice(generate(num_samples, seed, spec, exclude), 3)
        raise KeyboardInterrupt

    monkeypatch.setattr(arith, "generate", interrupted)
    assert arith.main(["--output", str(out), "--num-samples", "10", "--no-progress"]) == 130
    assert out.read_text() == "previous\n"
    assert [p.name for p in tmp_path.iterdir()] == ["arith.jsonl"]
    assert "nothing was written" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--min-operators", "0"], "min-operators must be at least 1"),
        (["--min-operators", "4", "--max-operators", "3"], "max-operators (3) is below min-operators (4)"),
        (["--min-operands", "1", "--max-operands", "3"], "min-operands must be at least 2"),
        (["--min-operands", "4", "--max-operands", "3"], "max-operands (3) is below min-operands (4)"),
        (["--min-operands", "4"], "--min-operands and --max-operands go together"),
        (["--max-operators", "4", "--max-operands", "5", "--min-operands", "3"], "not both"),
        (["--min-operand", "-1"], "min-operand must be >= 0"),
        (["--min-operand", "5", "--max-operand", "4"], "max-operand (4) is below min-operand (5)"),
        (["--max-operand", "20", "--max-value", "10"], "max-value (10) is below max-operand (20)"),
        (["--num-samples", "0"], "--num-samples must be at least 1"),
        (["--symbols", "latex"], "invalid choice: 'latex'"),
    ],
)
def test_bad_arguments_fail_with_one_clear_message(tmp_path, capsys, flags, message):
    argv = ["--output", str(tmp_path / "a.jsonl"), "--num-samples", "5", *flags]
    with pytest.raises(SystemExit) as exit_info:
        arith.main(argv)  # a repeated flag: the last one counts
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "a.jsonl").exists()


@pytest.mark.parametrize(
    "expression, message",
    [
        ("7 / 2", "7 / 2 is not an exact integer division"),
        ("3 / (2 - 2)", "3 / 0 is not an exact integer division"),
        ("1 +", "ends where a number was expected"),
        ("(1 + 2", "unbalanced parentheses"),
        ("1 % 2", "unexpected '% 2'"),
    ],
)
def test_solve_rejects_bad_expressions(expression, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        arith.solve(expression)
