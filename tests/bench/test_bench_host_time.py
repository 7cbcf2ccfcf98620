"""``bench/bench_host_time.py`` at a tiny shape on the CPU: a row per depth with the baseline's time
per layer and each LIMe model's extra, the Triton path's launches dropped while it times (and only
on a CPU), its Markdown table."""

from __future__ import annotations

import contextlib
import io

import pytest

from lime_megatron.kernels import operands
from tests.bench import load_bench

_, _, _, host_time = load_bench("tables", "cpu_triton", "bench_lime_overhead", "bench_host_time")

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning")]

TINY = "--depths 2 3 --hidden-size 16 --num-attention-heads 2 --kv-heads 2 --blocks 1 2 --repeats 2".split()


def test_rows_and_table_of_each_path_and_block(monkeypatch):
    installed, launched = [], []

    def recorded(observer):
        installed.append(observer)
        counted = observer and (lambda launch, run: (launched.append(launch.name), observer(launch, run)))
        operands.set_launch_observer(counted)

    monkeypatch.setattr(host_time, "set_launch_observer", recorded)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        rows = host_time.main(TINY)
    names = ["torch B=1", "torch B=2", "triton B=1", "triton B=2"]
    assert [row["layers"] for row in rows] == [2, 3]
    assert all(row["base_us"] > 0 and all(f"{name} us" in row for name in names) for row in rows)
    # per depth the timed rounds ran under an observer that never runs a launch, removed after
    assert len(installed) == 4 and installed[1::2] == [None, None] and operands._OBSERVER is None
    assert "mix_kernel" in launched  # the Triton models' launches went to it
    ran = []
    installed[0](None, lambda: ran.append(True))
    assert ran == []
    table = [line for line in printed.getvalue().splitlines() if line.startswith("|")]
    titles = ["layers", "kv", "base us/layer", *(f"{name}: extra us/layer" for name in names)]
    assert table[0] == "| " + " | ".join(titles) + " |"
    assert len(table) == 4


def test_launches_run_on_a_gpu():
    """Only a CPU drops the launches: with ``--device cuda`` the observer is left as it is."""
    with host_time.launches_dropped("cuda"):
        assert operands._OBSERVER is None
    with host_time.launches_dropped("cpu"):
        assert operands._OBSERVER is not None
    assert operands._OBSERVER is None
