"""``bench/bench_lime_overhead.py`` at a tiny shape on the CPU: the collector paused in timed steps,
the quantities ``--skip`` drops absent from the rows and "-" in the tables, the seconds of each
phase run (``phase_s``), and ``--kernel-profile``'s table of LIMe's extra self time by name."""

from __future__ import annotations

import contextlib
import gc
import io
import json
from types import SimpleNamespace

import pytest
import torch

from lime_megatron.kernels import operands
from tests.bench import load_bench

tables, _, overhead = load_bench("tables", "cpu_triton", "bench_lime_overhead")

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning")]

TINY = (
    "--depths 4 --kv-heads 2 --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 128 --seq-length 16 "
    "--micro-batch-size 1 --repeats 2"
).split()
"""A setting that runs every phase in a few seconds."""

TOP = 4
"""The kernel profile's length in ``profiled_run``."""


def run_main(*extra: str) -> tuple[list[dict], str]:
    """``main`` at ``TINY`` with ``extra`` options: its rows and what it printed."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        rows = overhead.main([*TINY, *extra])
    return rows, printed.getvalue()


def table_after(output: str, heading: str) -> list[str]:
    """The lines of the table printed after the line starting with ``heading``, up to a blank line."""
    lines = output.splitlines()
    start = next(index for index, line in enumerate(lines) if line.startswith(heading)) + 1
    end = next((index for index in range(start, len(lines)) if not lines[index]), len(lines))
    return lines[start:end]


@pytest.fixture(scope="module")
def profiled_run(tmp_path_factory):
    """Rows, output and JSON document of a run measuring everything, with a kernel profile, its idle
    profile and a launch profile (empty: on a CPU the bench takes the torch path, which launches
    no kernel)."""
    path = tmp_path_factory.mktemp("overhead") / "overhead.json"
    rows, output = run_main("--kernel-profile", str(TOP), "--idle-profile", "--launch-profile", "--json", str(path))
    return rows, output, json.loads(path.read_text())


class Recorder(torch.nn.Module):
    """A model of ``train_step``'s signature that records whether the collector is on in its
    forward (``enabled``), and raises there with ``fail``."""

    def __init__(self, fail: bool = False):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(1))
        self.fail = fail
        self.enabled: list[bool] = []

    def forward(self, tokens, positions, mask, labels):
        self.enabled.append(gc.isenabled())
        if self.fail:
            raise RuntimeError("the step failed")
        return self.weight * tokens.float()


BATCH = (torch.ones(1, 4, dtype=torch.long), torch.arange(4)[None], None)


def test_the_collector_is_off_in_a_timed_step_and_on_after(monkeypatch):
    assert gc.isenabled()
    events = []
    collect = gc.collect
    monkeypatch.setattr(gc, "collect", lambda *args: events.append("collect") or collect(*args))
    model = Recorder()
    overhead.train_step(model, BATCH)
    assert model.enabled == [False] and gc.isenabled()
    assert events == ["collect"] and model.weight.grad is not None


def test_a_failing_step_turns_the_collector_back_on():
    model = Recorder(fail=True)
    with pytest.raises(RuntimeError, match="the step failed"):
        overhead.train_step(model, BATCH)
    assert model.enabled == [False] and gc.isenabled()


def test_the_heap_is_frozen_only_inside_the_block():
    with overhead.frozen_heap():
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0


def test_a_missing_key_prints_as_a_dash():
    row = dict(a=1.0, b=2.0)
    assert tables.field("c", ".3f")(row) == tables.field("c", ".1f", 2**20)(row) == tables.MISSING
    assert tables.ratio("a", "c")(row) == tables.ratio("c", "b")(row) == tables.MISSING
    assert tables.ratio("a", "b")(row) == "0.500"


def test_skipped_quantities_are_absent_and_print_as_dashes():
    [row], output = run_main("--skip", *overhead.SKIP_CHOICES)
    skipped = {"rebuilt_x", "rebuilt_saved", "base_saved", "lime_saved", "extra_copies", "blocked_operators"}
    skipped |= {"triton_operators", "rest_ms", "products_ms", "kernel_profile"}
    assert not skipped & row.keys()
    assert {"base_s", "per_layer_x", "lime_x", "lime_spread", "floor", "reads_blocked"} <= row.keys()
    assert list(row["phase_s"]) == ["build", "timed"]
    [cells] = [line.split() for line in table_after(output, "where blocked LIMe's time")[2:]]
    assert cells[:3] == ["4", "2", str(row["block"])] and set(cells[3:]) == {"-"}
    assert "saved-bytes" not in output.splitlines()[-1]


def test_phase_s_holds_every_phase_run(profiled_run):
    [row], output, _ = profiled_run
    assert list(row["phase_s"]) == list(overhead.PHASE_NAMES)
    assert row["launch_profile"] == row["launch_profile_tiles"] == [] and "routing kernels' launches" not in output
    assert all(seconds > 0 for seconds in row["phase_s"].values())
    [cells] = [line.split() for line in table_after(output, "wall seconds of each phase")[2:]]
    assert len(cells) == len(overhead.PHASE_COLUMNS) and "-" not in cells


def test_the_launch_profile_compares_tiles_on_the_triton_path(monkeypatch):
    """Per kind of launch, under the default tiles, wider ones and more warps: the same launches,
    and the same step (up to the order of sums: a tile's dot, the router-weight gradient's
    atomics); each other tiles' timed step after an untimed one under them (their compilation)."""
    skipped = ("--skip", "rebuilt", "counts", "copies", "split", "saved")
    steps, outcome = [], overhead.step_outcome

    def counted(model, batch):
        steps.append(operands.mix_tiles())  # the tiles the step runs under
        return outcome(model, batch)

    monkeypatch.setattr(overhead, "step_outcome", counted)
    flags = ("--launch-profile", "512", "--launch-profile-warps", "8")
    [row], output = run_main("--lime-routing-kernel", "triton", *flags, *skipped)
    default, [wider, warps] = row["launch_profile"], row["launch_profile_tiles"]
    assert wider["tiles"] == "tiles of up to 512 elements, 4 warps" and wider["difference"] <= 1e-6
    assert warps["tiles"] == "tiles of up to 128 (512 beside a weight gradient) elements, 8 warps"
    assert warps["difference"] <= 1e-6
    launches = {kind["kind"]: kind["launches"] for kind in default}
    assert launches and {kind["kind"]: kind["launches"] for kind in wider["kinds"]} == launches
    assert {kind["kind"]: kind["launches"] for kind in warps["kinds"]} == launches
    assert len(table_after(output, "the same with tiles of up to 512 elements")) == 2 + len(launches)
    assert [(tiles.elements, tiles.warps) for tiles in steps] == [(128, 4), (512, 4), (512, 4), (128, 8), (128, 8)]


def test_the_launch_profiles_warps_need_the_launch_profile(capsys):
    with pytest.raises(SystemExit):
        overhead.parse_args([*TINY, "--launch-profile-warps", "8"])
    assert "give --launch-profile too" in capsys.readouterr().err


def test_kernel_profile_prints_the_requested_names_and_totals(profiled_run):
    [row], output, document = profiled_run
    entries = row["kernel_profile"]
    assert len(entries) == TOP and document["rows"][0]["kernel_profile"] == entries
    differences = [entry["diff_ms"] for entry in entries]
    assert differences == sorted(differences, reverse=True)
    assert all(entry["diff_ms"] == pytest.approx(entry["lime_ms"] - entry["base_ms"]) for entry in entries)
    lines = table_after(output, f"L4 kv 2 B {row['block']}: self time")
    assert len(lines) == 2 + TOP + 1 and lines[-1].endswith("all names")
    assert row["kernel_profile_total"]["lime_count"] > row["kernel_profile_total"]["base_count"]
    # and what the baseline spends most on, in both models
    base = row["kernel_profile_base"]
    assert len(base) == TOP and [entry["base_ms"] for entry in base] == sorted(
        (e["base_ms"] for e in base), reverse=True
    )
    assert base[0]["base_ms"] >= max(entry["base_ms"] for entry in entries) and base[0]["lime_count"] > 0
    assert table_after(output, f"the {TOP} names the baseline spends")[2].split()[-1] == base[0]["name"]
    # and where the wall time goes beside the device's: the host's ms and the device's idle ms
    host = row["host_and_idle"]
    for model in ("lime", "base"):
        assert 0 < host[f"{model}_host_ms"] <= host[f"{model}_wall_ms"]
        busy = row["kernel_profile_total"][f"{model}_ms"]
        assert host[f"{model}_idle_ms"] == pytest.approx(host[f"{model}_wall_ms"] - busy)
    [cells] = [line.split() for line in table_after(output, "unprofiled steps (medians)")[2:]]
    assert float(cells[0]) == pytest.approx(host["lime_host_ms"], abs=0.05)
    assert float(cells[-1]) == pytest.approx(host["host_diff_ms"], abs=0.005)
    # and where the device waited in the profiled steps: on a CPU no device work, so no gap, no call
    assert row["idle_profile"] == [] and row["blocking_calls"] == []
    assert row["idle_profile_total"] == dict(
        name="all gaps", lime_ms=0.0, base_ms=0.0, diff_ms=0.0, lime_count=0, base_count=0
    )
    assert table_after(output, "the device idle in the profiled steps")[-1].split()[-1] == "gaps"
    assert len(table_after(output, "the host's calls that wait")) == 2


@pytest.mark.usefixtures("megatron")
def test_lime_only_operators_have_no_baseline_time():
    """Listing every name: LIMe's routing autograd function, forward and backward, appears once
    per layer with the baseline at 0 ms and 0 calls, and the entries add up to the totals."""
    args = overhead.parse_args([*TINY, "--kernel-profile", "100000", "--skip", "rebuilt"])
    setting = overhead.build_setting(args, 4, 2)
    for model in setting.models.values():
        overhead.train_step(model, setting.batch)
    fields = overhead.kernel_profile_fields(setting)
    by_name = {entry["name"]: entry for entry in fields["kernel_profile"]}
    for name in ("RouteKeysValues", "RouteKeysValuesBackward"):
        assert by_name[name]["base_ms"] == 0 and by_name[name]["base_count"] == 0
        assert by_name[name]["lime_ms"] > 0 and by_name[name]["lime_count"] == 4
    total = fields["kernel_profile_total"]
    assert sum(entry["lime_ms"] for entry in by_name.values()) == pytest.approx(total["lime_ms"])
    assert sum(entry["base_count"] for entry in by_name.values()) == total["base_count"]


def test_the_idle_profile_needs_the_kernel_profile_and_is_absent_without_its_flag(capsys):
    with pytest.raises(SystemExit):
        overhead.parse_args([*TINY, "--idle-profile"])
    assert "give --kernel-profile N too" in capsys.readouterr().err
    [row], output = run_main("--skip", *overhead.SKIP_CHOICES, "--kernel-profile", "2")
    assert "kernel_profile" in row and "idle_profile" not in row and "the device idle in the profiled" not in output


def test_a_bench_stopped_mid_case_keeps_what_it_measured(monkeypatch, tmp_path):
    """The JSON holds a case's row after its timed rounds and after each phase, not only at its end:
    a GPU session stops a bench at its budget (the second H200 session's 128-layer case, stopped
    in its profiles, left nothing of its timed rounds)."""

    def stopped(setting):
        raise KeyboardInterrupt  # as a stop at the budget arrives: mid-phase

    monkeypatch.setitem(overhead.SKIPPABLE_PHASES, "saved", stopped)
    path = tmp_path / "overhead.json"
    with pytest.raises(KeyboardInterrupt):
        run_main("--skip", "rebuilt", "split", "--json", str(path))
    [row] = json.loads(path.read_text())["rows"]
    assert {"base_s", "lime_x", "floor", "per_layer_operators"} <= row.keys()  # timed, then the counts
    assert list(row["phase_s"]) == ["build", "timed", "counts"] and "lime_saved" not in row


def test_a_trace_it_cannot_read_keeps_the_kernel_profile(monkeypatch):
    """A trace without what the idle profile reads (another torch's format) costs the idle
    profile, said in ``idle_profile_error``, not the kernel profile nor the run."""
    monkeypatch.setattr(overhead, "trace_events", lambda profiler: [dict(cat="kernel", name="gemm")])
    [row], output = run_main("--skip", *overhead.SKIP_CHOICES, "--kernel-profile", "2", "--idle-profile")
    assert row["idle_profile_error"] == "the profile's trace could not be read: KeyError: 'ts'"
    assert "kernel_profile" in row and "idle_profile" not in row and "idle profile: KeyError" in output


def test_a_profiler_that_cannot_run_keeps_the_timings(monkeypatch):
    """A GPU image whose profiler fails (no CUPTI) costs the profile, said in ``kernel_profile_error``,
    not the setting's timings."""

    def no_profiler(model, batch, idle):
        raise RuntimeError("CUPTI initialization failed")

    monkeypatch.setattr(overhead, "profiled_step", no_profiler)
    [row], output = run_main("--skip", *overhead.SKIP_CHOICES, "--kernel-profile", "3")
    assert row["kernel_profile_error"] == "RuntimeError: CUPTI initialization failed"
    assert "kernel_profile" not in row and {"base_s", "lime_x", "lime_spread"} <= row.keys()
    assert "CUPTI initialization failed" in output


def test_host_time_pairs_the_models_steps_against_a_drifting_host(monkeypatch):
    """``host_and_idle`` alternates LIMe's and the baseline's unprofiled steps and takes the median
    of the pairs' differences: a host slowing by 0.1 ms a step (the lent H200's pace moved by 10-20%
    between rounds) leaves LIMe's 1 ms of extra host time at 1 ms less one step's drift, where
    the difference of two medians of steps run apart would carry the drift of all of them."""
    calls = []

    def step(model, batch):
        host = 0.010 + 0.0001 * len(calls) + (0.001 if model == "lime model" else 0.0)
        calls.append(model)
        return host, host + 0.002

    monkeypatch.setattr(overhead, "host_and_wall_step", step)
    setting = SimpleNamespace(models=dict(blocked="lime model", base="base model"), batch=None)
    fields = overhead.host_and_idle(setting, dict(lime_ms=1.0, base_ms=1.0))
    assert calls == ["lime model", "base model"] * overhead.HOST_STEPS
    assert fields["host_diff_ms"] == pytest.approx(0.9)
    middle = overhead.HOST_STEPS // 2
    assert fields["lime_host_ms"] == pytest.approx(11 + 0.2 * middle)
    assert fields["base_idle_ms"] == pytest.approx(fields["base_wall_ms"] - 1.0)
