"""``bench/bench_host_time.py`` at a tiny shape on the CPU: a row per depth with the baseline's time
per layer, each LIMe model's extra, its time inside the routing functions and its Python calls, the
Triton path's launches dropped while it times (and only on a CPU), its Markdown tables."""

from __future__ import annotations

import contextlib
import gc
import io
import json
import time

import pytest

from lime_megatron.kernels import operands
from tests.bench import load_bench

_, _, _, host_time = load_bench("tables", "cpu_triton", "bench_lime_overhead", "bench_host_time")

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning")]

TINY = "--depths 2 3 --hidden-size 16 --num-attention-heads 2 --kv-heads 2 --blocks 1 2 --repeats 2".split()


def test_rows_and_table_of_each_path_and_block(monkeypatch):
    installed, launched, frozen, before = [], [], [], gc.get_freeze_count()

    def recorded(observer):
        installed.append(observer)
        frozen.append(gc.get_freeze_count() > before)  # the heap out of the collector's sight: fast collections
        return operands.launches_observed(lambda launch, run: (launched.append(launch.name), observer(launch, run)))

    monkeypatch.setattr(host_time, "launches_observed", recorded)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        rows = host_time.main(TINY)
    names = ["torch B=1", "torch B=2", "triton B=1", "triton B=2"]
    assert [row["layers"] for row in rows] == [2, 3]
    assert all(row["base_us"] > 0 and all(f"{name} us" in row for name in names) for row in rows)
    # every LIMe model spends time inside its routing functions, forward and backward
    assert all(row[f"{name} {phase} us"] > 0 for row in rows for name in names for phase in ("forward", "backward"))
    # per depth the timed rounds ran under an observer that never runs a launch, removed after
    assert len(installed) == 2 and operands._OBSERVER is None
    assert frozen == [True, True]
    assert "mix_kernel" in launched  # the Triton models' launches went to it
    # every LIMe model runs Python of its own beyond the baseline's, counted per layer
    assert all(row[f"{name} calls"] > 0 for row in rows for name in names)
    ran = []
    installed[0](None, lambda: ran.append(True))
    assert ran == []
    table = [line for line in printed.getvalue().splitlines() if line.startswith("|")]
    titles = ["layers", "kv", "base us/layer", *(f"{name}: extra us/layer" for name in names)]
    assert table[0] == "| " + " | ".join(titles) + " |"
    assert table[4] == table[8] == "| " + " | ".join(["layers", "kv", *names]) + " |"
    assert len(table) == 12


def test_launches_run_on_a_gpu():
    """Only a CPU drops the launches: with ``--device cuda`` the observer is left as it is."""
    with host_time.launches_dropped("cuda"):
        assert operands._OBSERVER is None
    with host_time.launches_dropped("cpu"):
        assert operands._OBSERVER is not None
    assert operands._OBSERVER is None


def test_launch_timer_times_each_launch_on_a_gpu_only():
    """On a GPU each launch's host seconds add up in ``seconds["launches"]``; a CPU installs nothing."""
    seconds, ran = {"launches": 0.0}, []
    with host_time.launch_timer(seconds, "cuda"):
        operands._OBSERVER(None, lambda: ran.append(time.sleep(0.01)))
        operands._OBSERVER(None, lambda: ran.append(None))
    assert len(ran) == 2 and 0.01 <= seconds["launches"] < 1 and operands._OBSERVER is None
    with host_time.launch_timer(seconds, "cpu"):
        assert operands._OBSERVER is None


def test_json_holds_the_rows(tmp_path):
    path = tmp_path / "host.json"
    with contextlib.redirect_stdout(io.StringIO()):
        rows = host_time.main([*TINY[:2], *TINY[3:], "--blocks", "1", "--paths", "triton", "--json", str(path)])
    written = json.loads(path.read_text())
    assert written["rows"] == rows and written["args"]["paths"] == ["triton"]
    assert rows[0]["triton B=1 launches us"] == 0  # dropped on a CPU


def test_routing_timers_time_each_phase_and_restore_the_functions():
    """The timers add each call's seconds to its phase and put the functions back after."""

    def phases() -> dict:
        return {
            (function, phase): function.__dict__[phase]
            for function in host_time.ROUTING_FUNCTIONS
            for phase in host_time.PHASES
        }

    function, before, seconds, calls = host_time.ROUTING_FUNCTIONS[0], phases(), {}, []
    function.forward = staticmethod(lambda *args: calls.append(args) or time.sleep(0.01))
    stub = phases()
    try:
        with host_time.routing_timers(seconds):
            assert phases() != stub
            function.forward(1, 2)
        assert calls == [(1, 2)] and seconds["forward"] >= 0.01 and "backward" not in seconds
        assert phases() == stub
    finally:
        function.forward = before[function, "forward"]
    assert phases() == before
