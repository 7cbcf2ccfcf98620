"""``bench/bench_startup.py``: its cases run the checkout's commands and check what they answer."""

from __future__ import annotations

from tests.bench import load_bench

_, startup = load_bench("tables", "bench_startup")


def test_cases_time_the_commands_and_check_their_answers(tmp_path):
    rows = startup.measure(["pretrain-help", "pretrain-config"], [startup.ROOT], 1, str(tmp_path))
    assert [(row["case"], row["status"], row["check"]) for row in rows] == [
        ("pretrain-help", "0", "ok"),
        ("pretrain-config", "2", "ok"),
    ]
    assert "cannot read config file" in rows[1]["error"] and all(row["s0"] > 0 for row in rows)


def test_error_line_is_the_last_line_naming_an_error():
    assert startup.error_line("warning: x\nerror: one\nerror: two\n\n") == "error: two"
    assert startup.error_line("just this\n") == "just this"
