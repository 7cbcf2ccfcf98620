"""The GPU session's steps: what each runs, within which time, and the rows it reports.

Each step runs one or more commands of the project (the GPU check, the benches, the trainer),
each writing JSON into the step's folder; the step then reads its rows from there.  A step
declares its rows up front (``Step.rows``), the same on the GPU and in the CPU rehearsal: the
report shows every one of them whatever happens to the step.  The two modes differ in the
commands' shapes only (``Mode``): on the GPU the paper's shapes with the TransformerEngine spec in
bf16, in the rehearsal tiny shapes with the local spec on the CPU, where the rows that need CUDA or
TransformerEngine say why they were skipped.

| step | GPU s | what |
|---|---|---|
| environment | 30 | install the carry (``session.install``); versions, the device, TE, cuDNN, FP8 |
| attention | 40 | ``tools/gpu/attention_probe.py``: the backend TE selects, and the library environment |
| | | under which it selects FusedAttention, exported to the later steps |
| gpu-check | 105 | ``python -m lime_megatron.gpu_check --skip-timing``: bf16 vs fp32 (LIMe, LLaMA, HC, |
| | | mHC) on the TE spec, the routing kernels, FP8 (delayed, current scaling), the attention |
| | | backend, bf16 training |
| overhead-1b | 120 | ``bench/bench_lime_overhead.py`` at 1B GQA-8 and MHA, micro batch 4 x 2048, |
| | | per-layer and blocked routing, the TE spec, the kernel profile (``session_bench_flags``) |
| deep-128 | 95 | the same bench at 128 layers, hidden 512, micro batch 1 |
| host-time | 70 | ``bench/bench_host_time.py`` at 32 layers whose kernels cost next to nothing: the |
| | | host's us per layer LIMe adds, inside its routing functions and inside its launches |
| pretrain | 80 | ``pretrain_lime.py`` with the 1B GQA-8 example configs (LIMe, LLaMA), bf16, TE, mock |
| | | data, 12 iterations: tokens/s, MFU |
| decoding | 60 | not by default (``--steps decoding``): ``bench/bench_decoding.py`` at 1B GQA-8: |
| | | KV-cache tokens/s, LIMe vs LLaMA, and where a token's host time goes (``--profile``) |

The budgets come from the H200 sessions (at a6951d8, 88c5415 and 8765886; docs/gpu.md gives each
step's times there), less what the session's bench runs now skip: at 8765886 overhead-1b and
decoding ran out of their 110 and 50 s with their tables printed (the processes' exit cut off), and
deep-128 took 76 of its 125 s (79 at ce64950; its host steps then became 5 pairs, from 3 per
model).  At 76e4f5c the GPU check ran one comparison past its 95 s, and overhead-1b took 104 s.
Micro batches 2 and 4 at 128 layers take longer than a session can give them: run the bench on
its own for those.

Standard library only, like the session.
"""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from attention_probe import fused
from session_report import ReportRow, limit_status

ROOT = Path(__file__).resolve().parents[2]
"""The checkout the session runs in: the commands are the project's own."""


def checkout_commit() -> str:
    """``git describe --always --dirty`` of the checkout (``unknown (no git)`` without one)."""
    completed = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True, text=True)
    return completed.stdout.strip() or "unknown (no git)"


@dataclass(frozen=True)
class Mode:
    """Where and at what size the session runs."""

    name: str
    rehearsal: bool
    device: str
    dtype: str
    transformer_impl: str
    budget_s: float
    """The whole session's time, install included."""
    overhead_shape: list[str]
    """``bench_lime_overhead.py`` flags of the 1B shape (depth, widths, micro batch, rounds)."""
    overhead_kv_heads: dict[int, str]
    """The kv-head counts of the 1B shape and the row label of each."""
    deep_shape: list[str]
    deep_micro_batches: dict[int, str]
    host_shape: list[str]
    """``bench_host_time.py`` flags: a shape whose kernels cost next to nothing, 32 layers."""
    pretrain_shape: list[str]
    """Trainer flags on top of the 1B example configs (the rehearsal shrinks the model).  Both give
    ``--vocab-size``: mock data then takes the NullTokenizer, as the GPU image has no GPT-2
    vocabulary files (no network, none carried); 50257 is GPT-2's, padded to the examples' 50304."""
    pretrain_iterations: int
    pretrain_warmup: int
    """Iterations left out of the tokens/s median (the first ones compile, allocate, warm up)."""
    decoding_shape: list[str]

    def bench_flags(self) -> list[str]:
        """The device, dtype and spec flags every bench of this mode takes."""
        return ["--device", self.device, "--dtype", self.dtype, "--transformer-impl", self.transformer_impl]


GPU = Mode(
    name="gpu",
    rehearsal=False,
    device="cuda",
    dtype="bfloat16",
    transformer_impl="transformer_engine",
    budget_s=540,
    overhead_shape="--depths 16 --hidden-size 2048 --num-attention-heads 32 --ffn-hidden-size 8192 "
    "--seq-length 2048 --micro-batch-size 4 --repeats 5 --warmup 1".split(),
    overhead_kv_heads={8: "1B GQA-8", 32: "1B MHA"},
    deep_shape="--depths 128 --hidden-size 512 --num-attention-heads 8 --ffn-hidden-size 2048 "
    "--seq-length 2048 --kv-heads 8 --repeats 5 --warmup 1".split(),
    deep_micro_batches={1: "deep-128 mb1"},
    host_shape="--depths 32 --hidden-size 128 --num-attention-heads 4 --kv-heads 4 --ffn-hidden-size 256 "
    "--seq-length 16 --repeats 11 --warmup 2".split(),
    pretrain_shape="--micro-batch-size 4 --global-batch-size 16 --vocab-size 50257".split(),
    pretrain_iterations=12,
    pretrain_warmup=4,
    decoding_shape="--num-layers 16 --hidden-size 2048 --num-attention-heads 32 --kv-heads 8 "
    "--ffn-hidden-size 8192 --vocab-size 50304 --prompt-length 128 --new-tokens 32 --repeats 1".split(),
)
REHEARSAL = Mode(
    name="rehearsal",
    rehearsal=True,
    device="cpu",
    dtype="float32",
    transformer_impl="local",
    budget_s=1200,
    overhead_shape="--depths 4 --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 128 "
    "--seq-length 32 --micro-batch-size 2 --repeats 2 --warmup 1".split(),
    overhead_kv_heads={2: "1B GQA-8", 4: "1B MHA"},
    deep_shape="--depths 8 --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 128 "
    "--seq-length 32 --kv-heads 4 --repeats 2 --warmup 1".split(),
    deep_micro_batches={1: "deep-128 mb1"},
    host_shape="--depths 4 --hidden-size 32 --num-attention-heads 4 --kv-heads 4 --ffn-hidden-size 64 "
    "--seq-length 4 --repeats 3 --warmup 1".split(),
    pretrain_shape="--micro-batch-size 2 --global-batch-size 4 --num-layers 2 --hidden-size 64 "
    "--ffn-hidden-size 128 --num-attention-heads 4 --num-query-groups 2 --seq-length 32 --vocab-size 128 "
    "--transformer-impl local".split(),
    pretrain_iterations=6,
    pretrain_warmup=2,
    decoding_shape="--num-layers 2 --hidden-size 64 --num-attention-heads 4 --kv-heads 2 "
    "--ffn-hidden-size 128 --vocab-size 128 --prompt-length 8 --new-tokens 8 --repeats 1".split(),
)
"""The same steps on a CPU in about two minutes: every row, at tiny shapes (the labels keep the
GPU's names; the commands in the report show the shapes that ran)."""


@dataclass(frozen=True)
class Command:
    """One command of a step: its arguments (run in the checkout) and the JSON it writes."""

    argv: list[str]
    output: Path


@dataclass(frozen=True)
class Step:
    """A step: its commands in a mode, the rows it declares, and how its rows are read back."""

    name: str
    title: str
    budget_s: float
    """Seconds on the GPU (the rehearsal gives every step ``REHEARSAL_STEP_S``)."""
    rows: tuple[str, ...]
    commands: Callable[[Mode, Path], list[Command]] = field(repr=False)
    read: Callable[[Mode, Path], list[ReportRow]] = field(repr=False)
    """The rows found in the step's folder (those of commands that did not run are absent)."""
    by_default: bool = True
    """Whether a session without ``--steps`` runs it (the default steps' budgets fill the call)."""

    def budget(self, mode: Mode) -> float:
        return REHEARSAL_STEP_S if mode.rehearsal else self.budget_s


REHEARSAL_STEP_S = 300.0


def python(*arguments: str) -> list[str]:
    """The session's Python running ``arguments``."""
    return [sys.executable, *arguments]


def load_json(path: Path) -> dict:
    """The JSON object at ``path``; {} when the command never wrote it."""
    return json.loads(path.read_text()) if path.is_file() else {}


# --------------------------------------------------------------------------- environment

ENVIRONMENT_ROWS = (
    "python",
    "torch",
    "device",
    "megatron-core",
    "TransformerEngine",
    "cuDNN",
    "FP8",
    "installed from the carry",
)


def environment_commands(mode: Mode, folder: Path) -> list[Command]:
    output = folder / "environment.json"
    return [Command(python("tools/gpu/environment_probe.py", "--json", str(output)), output)]


def read_environment(mode: Mode, folder: Path) -> list[ReportRow]:
    """The probe's findings (``environment_probe.py``) and the install's (``install.json``)."""
    found = load_json(folder / "environment.json")
    installed = load_json(folder / "install.json")
    te_reason = "CPU machines never install TransformerEngine (it breaks import megatron.core)"
    rows = []
    for name in ENVIRONMENT_ROWS[:-1]:
        problem = found.get(f"{name} problem")
        if name in found:
            rows.append(ReportRow(name, found[name]))
        elif problem and mode.rehearsal and name in ("TransformerEngine", "cuDNN", "FP8"):
            rows.append(ReportRow(name, status="skipped", note=f"asked of TransformerEngine: {te_reason}"))
        elif problem:
            rows.append(ReportRow(name, status="FAILED", note=problem))
    if installed:
        rows.append(ReportRow("installed from the carry", installed["summary"], note=installed["note"]))
    else:
        rows.append(ReportRow("installed from the carry", "nothing", note="no --carry: the environment as it is"))
    return rows


# --------------------------------------------------------------------------- the attention backend

ATTENTION_ROWS = ("attention | as the session runs it", "attention | environment for the later steps")
EXPORTS = "exports.json"
"""A step's environment variables for the steps after it (``session.exported_environment``)."""


def attention_commands(mode: Mode, folder: Path) -> list[Command]:
    output = folder / "attention.json"
    argv = python("tools/gpu/attention_probe.py", "--json", str(output), "--exports", str(folder / EXPORTS))
    return [Command(argv, output)]


def read_attention(mode: Mode, folder: Path) -> list[ReportRow]:
    """A row per candidate environment the probe tried (the first enforced: TE must select its
    fused attention as the session runs), and the environment the later steps get."""
    found = load_json(folder / "attention.json")
    if "skipped" in found:
        return [ReportRow(name, status="skipped", note=found["skipped"]) for name in ATTENTION_ROWS]
    rows = [attention_row(record, enforced=index == 0) for index, record in enumerate(found.get("candidates", []))]
    if found.get("candidates"):
        exports = found.get("exports", {})
        found_fused = any(fused(record) for record in found["candidates"])
        value = ", ".join(f"{name}={value}" for name, value in exports.items()) or "as it is"
        rows.append(ReportRow(ATTENTION_ROWS[1], value[:300], status="ok" if found_fused else "FAILED"))
    return rows


def attention_row(record: dict, enforced: bool) -> ReportRow:
    """One candidate's row: the backend TE selected; the note its reasons, cuDNN's first error
    line and the cuDNN files mapped."""
    selected, ran_fused = record.get("selected") or [], fused(record)
    cudnn_files = [path for path in record.get("mapped", []) if "cudnn" in path.rsplit("/", 1)[-1]]
    notes = [record.get("error", ""), "" if ran_fused else record.get("reasons", "")]
    notes += [*record.get("cudnn_errors", [])[:2], f"cuDNN files: {', '.join(cudnn_files) or 'none'}"]
    status = ("ok" if ran_fused else "FAILED") if enforced else ""
    value = ", ".join(selected) or "none"
    return ReportRow(f"attention | {record['name']}", value, status=status, note="; ".join(filter(None, notes)))


# --------------------------------------------------------------------------- the GPU check

GPU_CHECK_FAMILIES = ("LIMe", "baseline", "HC", "mHC")
GPU_CHECK_KERNEL_CASES = ("bf16, blocks of 2", "fp32, blocks of 2, deterministic")
"""``gpu_check.KERNEL_CASES``: the Triton path against the torch path, compiled on the GPU."""
GPU_CHECK_ROWS = (
    *(
        name
        for family in GPU_CHECK_FAMILIES
        for name in (
            f"bf16 vs fp32 | {family} | loss",
            f"attention backend | {family} | selected backend",
            *((f"routed K/V | {family} | layers against the dry run",) if family == "LIMe" else ()),
            *((f"bf16 vs fp32 | {family} | worst router grad",) if family == "LIMe" else ()),
            f"bf16 vs fp32 | {family} | worst grad",
        )
    ),
    *(
        f"triton vs torch | {case} | {key}"
        for case in GPU_CHECK_KERNEL_CASES
        for key in ("loss", "worst router grad", "worst grad")
    ),
    *(
        f"fp8 {recipe} | {model} | {key}"
        for recipe in ("delayed", "tensorwise")
        for model in ("LIMe", "baseline")
        for key in ("first-step loss distance to bf16", "max loss distance to bf16", "FP8 changed the losses")
    ),
    *(
        name
        for model in ("LIMe", "baseline")
        for name in (
            f"bf16 training | {model} | Float16Module + dist. optimizer vs fp32",
            f"layouts | {model} | TP2 vs DP",
            f"layouts | {model} | PP2 vs DP",
        )
    ),
)


def gpu_check_commands(mode: Mode, folder: Path) -> list[Command]:
    output = folder / "gpu_check.json"
    flags = ["--rehearse"] if mode.rehearsal else ["--skip-timing"]
    return [Command(python("-m", "lime_megatron.gpu_check", *flags, "--json", str(output)), output)]


def read_gpu_check(mode: Mode, folder: Path) -> list[ReportRow]:
    """``gpu_check --json``'s rows as they are (its failing gradients and errors included)."""
    rows = load_json(folder / "gpu_check.json").get("rows", [])
    return [ReportRow(r["name"], r["value"], r["limit"], r["status"], r["quantity"]) for r in rows]


# --------------------------------------------------------------------------- overhead benches


@dataclass(frozen=True)
class BenchField:
    """A row of a bench case: its name after the case's label, the value from the case's record,
    and an optional target, for every case or by label (reported, not enforced)."""

    name: str
    value: Callable[[dict], float]
    target: float | dict[str, float] | None = None

    def row(self, label: str, record: dict) -> ReportRow:
        """The field's row of a case; ``missing``, with the bench's reason where it gave one (a
        ``..._error`` field), when the record lacks what the field reads."""
        try:
            value = self.value(record)
        except KeyError as key:
            reasons = [f"{name}: {text}" for name, text in record.items() if name.endswith("_error")]
            note = "; ".join(reasons) or f"the bench wrote no {key}"
            return ReportRow(f"{label} | {self.name}", status="missing", note=note)
        target = self.target.get(label) if isinstance(self.target, dict) else self.target
        row = ReportRow(f"{label} | {self.name}", value)
        if target is not None:
            row.limit, row.status = limit_status(value, target)
        return row


OVERHEAD_FIELDS = (
    BenchField("routing block B", lambda r: r["block"]),
    BenchField("baseline fwd+bwd ms", lambda r: 1e3 * r["base_s"]),
    BenchField("LIMe B=1 / baseline", lambda r: r["per_layer_x"]),
    BenchField("LIMe blocked / baseline", lambda r: r["lime_x"], target={"1B GQA-8": 1.015, "1B MHA": 1.03}),
    BenchField("FLOP floor", lambda r: r["floor"]),
    BenchField("blocked / floor", lambda r: r["lime_x"] / r["floor"], target=1.05),
    BenchField("IQR of blocked / floor", lambda r: r["lime_spread"] / r["floor"]),
    BenchField("saved bytes blocked / baseline", lambda r: r["lime_saved"] / r["base_saved"], target=1.02),
    BenchField("baseline saved GiB", lambda r: r["base_saved"] / 2**30),
    BenchField("profiled time LIMe - baseline ms", lambda r: r["kernel_profile_total"]["diff_ms"]),
    BenchField("host ms LIMe - baseline", lambda r: r["host_and_idle"]["host_diff_ms"]),
    BenchField(
        "device idle ms LIMe - baseline",
        lambda r: r["host_and_idle"]["lime_idle_ms"] - r["host_and_idle"]["base_idle_ms"],
    ),
)
"""The rows of one case of ``bench_lime_overhead.py`` in both bench steps (BENCHMARKS.md explains
the columns); the targets: LIMe within 1.5% (GQA-8) and 3% (MHA) of the baseline at 1B (the
paper's Table 9 on an H100: +1.2-1.6% and +10.5%), blocked routing within 1.05x of its FLOP floor,
saved bytes within 2%.  Then one profiled step's device time (on a CPU: operator time) over the
baseline's (``--kernel-profile``; its largest differences follow as rows, ``case_rows``), and from
unprofiled steps LIMe's extra host time and extra device idle time: the second H200 session found
LIMe's wall time at 1B GQA-8 11 ms over the baseline's against 3.7 ms of extra device time.  At 1B
(``IDLE_FIELDS``) the profiled steps' idle gaps over the baseline's follow (``testing.device_idle``),
and their operators and the host's blocking calls as rows (``case_rows``): where that time goes."""

IDLE_FIELDS = (
    *OVERHEAD_FIELDS,
    BenchField("profiled idle gaps ms LIMe - baseline", lambda r: r["idle_profile_total"]["diff_ms"]),
)
"""The 1B cases' rows (``--idle-profile``): ``OVERHEAD_FIELDS`` and the profiled steps' idle gaps."""


def session_bench_flags(device_bound: bool) -> list[str]:
    """What the session's bench runs leave out (``--skip``): the rebuilt-K/V model, the copy bytes (a
    CPU count), the synchronised rounds of the time split, whose "rest" a GPU inflates, and the
    operator counts (the first two H200 sessions read 9.6 per layer at B = 1 and 8.7 blocked at 1B
    on the TE spec; the kernels' tiles do not change them, and counting took 22 s of the 1B step);
    the kernel profile says instead where LIMe's extra device time goes (its 8 largest
    differences), the launch profile at what rate each kind of routing-kernel launch moves its
    bytes, under the default tiles.  A ``device_bound`` shape (1B, whose launches move 0.1-0.9 GB
    each: the second session's reached 0.65-1.75 TB/s of 4.8) adds the launch profile under tiles
    of up to 128 elements in every launch (the default before 8765886's profile, which compared
    512 elements and 8 warps: ``MixTiles.weight_grad_elements``), and the idle profile (where the
    device waited: 7.4 ms of LIMe's step at 1B GQA-8 in the second session); the 128-layer step is
    the host's pace, not its kernels', and its profile too long to read for the idle profile."""
    skipped = ["--skip", "rebuilt", "copies", "split", "counts"]
    extras = ["128", "--idle-profile"] if device_bound else []
    return skipped + ["--kernel-profile", "8", "--launch-profile", *extras]


def bench_rows(labels: list[str], fields: tuple[BenchField, ...]) -> tuple[str, ...]:
    return tuple(f"{label} | {field.name}" for label in labels for field in fields)


def case_rows(label: str, record: dict, fields: tuple[BenchField, ...]) -> list[ReportRow]:
    """A case's ``fields``, then the profiled names with the largest LIMe-minus-baseline time (ms),
    the routing kernels' rate per kind of launch (GB/s of the least bytes each must move) and the
    seconds the bench spent in each of its phases (``phase_s``)."""
    rows = [bench_field.row(label, record) for bench_field in fields]
    rows += profile_rows(f"{label} | +ms", record.get("kernel_profile", []))
    rows += profile_rows(f"{label} | +idle ms before", record.get("idle_profile", []))
    rows += profile_rows(f"{label} | blocking ms", record.get("blocking_calls", []))
    rows += launch_rows(f"{label} | GB/s", record.get("launch_profile", []))
    for tiled in record.get("launch_profile_tiles", []):
        name = f"{label} | {tiled['tiles']}"
        rows.append(ReportRow(f"{name}: largest difference", tiled["difference"], note="loss and gradients"))
        rows += launch_rows(f"{name}, GB/s", tiled["kinds"])
    phases = record.get("phase_s", {})
    note = ", ".join(f"{name} {seconds:.1f}" for name, seconds in phases.items())
    return rows + [ReportRow(f"{label} | bench seconds", sum(phases.values()), note=note)]


def kernel_note(entry: dict) -> str:
    """Each model's ms and count of a ``bench_lime_overhead.profile_entry``."""
    return (
        f"LIMe {entry['lime_ms']:.3f} ms x{entry['lime_count']}, "
        f"baseline {entry['base_ms']:.3f} ms x{entry['base_count']}"
    )


def profile_rows(
    prefix: str, entries: list[dict], by: str = "diff_ms", note: Callable[[dict], str] = kernel_note
) -> list[ReportRow]:
    """One row per name of a profile: its ``by`` ms (the LIMe-minus-baseline ms unless told) and,
    as ``note`` writes it, each model's figures (by default a kernel profile's,
    ``bench_lime_overhead.profile_entry``: ms and count)."""
    return [ReportRow(f"{prefix} | {entry['name'][:80]}", entry[by], note=note(entry)) for entry in entries]


def launch_rows(prefix: str, kinds: list[dict]) -> list[ReportRow]:
    """One row per kind of routing-kernel launch: its GB/s, and its launches, ms and GB."""
    return [
        ReportRow(
            f"{prefix} | {kind['kind']}",
            kind["gb_per_s"],
            note=f"{kind['launches']} launches, {kind['ms']:.3f} ms, {kind['gb']:.3f} GB moved",
        )
        for kind in kinds
    ]


def overhead_commands(mode: Mode, folder: Path) -> list[Command]:
    output = folder / "overhead.json"
    kv_heads = [str(kv) for kv in mode.overhead_kv_heads]
    argv = python("bench/bench_lime_overhead.py", *mode.bench_flags(), *mode.overhead_shape, "--kv-heads", *kv_heads)
    return [Command(argv + [*session_bench_flags(True), "--json", str(output)], output)]


def read_overhead(mode: Mode, folder: Path) -> list[ReportRow]:
    rows = []
    for record in load_json(folder / "overhead.json").get("rows", []):
        rows += case_rows(mode.overhead_kv_heads[record["kv_heads"]], record, IDLE_FIELDS)
    return rows


def deep_commands(mode: Mode, folder: Path) -> list[Command]:
    commands = []
    for micro_batch in mode.deep_micro_batches:
        output = folder / f"deep_mb{micro_batch}.json"
        argv = python(
            "bench/bench_lime_overhead.py", *mode.bench_flags(), *mode.deep_shape, *session_bench_flags(False)
        )
        commands.append(Command(argv + ["--micro-batch-size", str(micro_batch), "--json", str(output)], output))
    return commands


def read_deep(mode: Mode, folder: Path) -> list[ReportRow]:
    rows = []
    for micro_batch, label in mode.deep_micro_batches.items():
        for record in load_json(folder / f"deep_mb{micro_batch}.json").get("rows", []):
            rows += case_rows(label, record, OVERHEAD_FIELDS)
    return rows


# --------------------------------------------------------------------------- host time

HOST_MODELS = ("torch B=1", "torch B=4", "triton B=1", "triton B=4")
"""``bench_host_time.py``'s LIMe models (its default paths and blocks)."""
HOST_FIELDS = {
    "extra us/layer": "us",
    "routing forward us/layer": "forward us",
    "routing backward us/layer": "backward us",
    "launches us/layer": "launches us",
}
"""Each model's rows: the row's name and the bench's key (after the model's name)."""
HOST_ROWS = (
    "host 32 layers | baseline us/layer",
    *(f"{model} | {name}" for model in HOST_MODELS for name in HOST_FIELDS),
)


def host_commands(mode: Mode, folder: Path) -> list[Command]:
    output = folder / "host_time.json"
    argv = python("bench/bench_host_time.py", *mode.bench_flags(), *mode.host_shape, "--json", str(output))
    return [Command(argv, output)]


def read_host(mode: Mode, folder: Path) -> list[ReportRow]:
    """The baseline's host us per layer and each LIMe model's extra, its time inside its routing
    functions and (on a GPU) inside its kernels' launches, per layer."""
    rows = []
    for record in load_json(folder / "host_time.json").get("rows", []):
        rows.append(ReportRow("host 32 layers | baseline us/layer", record["base_us"]))
        for model in HOST_MODELS:
            rows += [ReportRow(f"{model} | {name}", record[f"{model} {key}"]) for name, key in HOST_FIELDS.items()]
    return rows


# --------------------------------------------------------------------------- pretrain

PRETRAIN_CONFIGS = {"LIMe": "examples/lime_1b_gqa8.yaml", "baseline": "examples/llama_1b_gqa8.yaml"}
MFU_TARGET = 0.40
PRETRAIN_ROWS = (
    *(
        f"{model} | {name}"
        for model in PRETRAIN_CONFIGS
        for name in ("tokens/s", "TFLOP/s per GPU", "MFU", "first loss", "last loss")
    ),
    "LIMe / baseline | tokens/s",
)


def pretrain_commands(mode: Mode, folder: Path) -> list[Command]:
    commands = []
    for model, config in PRETRAIN_CONFIGS.items():
        output = folder / f"{model}.jsonl"
        argv = python("pretrain_lime.py", "--config", config, "--mock-data", *PRETRAIN_RUN_FLAGS)
        argv += ["--train-iters", str(mode.pretrain_iterations), *mode.pretrain_shape, "--metrics-file", str(output)]
        commands.append(Command(argv, output))
    return commands


PRETRAIN_RUN_FLAGS = [
    *("--save", "", "--load", "", "--save-interval", "", "--ckpt-keep-last", ""),  # the example's, off
    *("--tensorboard-dir", "", "--wandb-project", ""),
    *"--lr-warmup-iters 1 --eval-iters 0 --log-interval 1 --log-throughput".split(),
]


def iteration_records(path: Path) -> list[dict]:
    """The trainer's ``--metrics-file`` records, one per iteration."""
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def read_pretrain(mode: Mode, folder: Path) -> list[ReportRow]:
    rows, rates = [], {}
    for model in PRETRAIN_CONFIGS:
        records = iteration_records(folder / f"{model}.jsonl")
        timed = records[mode.pretrain_warmup :]
        if len(records) < mode.pretrain_iterations or not timed:
            continue
        rates[model] = statistics.median(r["tokens_per_sec"] for r in timed)
        rows.append(
            ReportRow(
                f"{model} | tokens/s",
                rates[model],
                note=f"median of iterations {len(records) - len(timed) + 1}-{len(records)}",
            )
        )
        rows += throughput_rows(mode, model, timed)
        first, last = records[0]["lm_loss"], records[-1]["lm_loss"]
        rows.append(ReportRow(f"{model} | first loss", first))
        limit, status = limit_status(last, first, enforced=True)
        rows.append(ReportRow(f"{model} | last loss", last, f"< first ({limit})", status))
    if len(rates) == 2:
        rows.append(ReportRow("LIMe / baseline | tokens/s", rates["LIMe"] / rates["baseline"]))
    return rows


def throughput_rows(mode: Mode, model: str, timed: list[dict]) -> list[ReportRow]:
    """TFLOP/s per GPU and MFU (medians), which the trainer reports on CUDA only."""
    if mode.rehearsal:
        return [
            ReportRow(f"{model} | {name}", status="skipped", note="the trainer measures FLOP rates on CUDA only")
            for name in ("TFLOP/s per GPU", "MFU")
        ]
    tflops = statistics.median(r.get("tflops_per_gpu") or math.nan for r in timed)
    mfu = statistics.median(r.get("mfu") or math.nan for r in timed)
    row = ReportRow(f"{model} | MFU", mfu, note="of the dense bf16 peak")
    if model == "LIMe":
        row.limit, row.status = limit_status(mfu, MFU_TARGET, lower_bound=True)
    return [ReportRow(f"{model} | TFLOP/s per GPU", tflops), row]


# --------------------------------------------------------------------------- decoding

DECODING_ROWS = (
    *(
        f"{model} | {name}"
        for model in ("LIMe", "baseline")
        for name in (
            "KV-cache tokens/s",
            "recompute tokens/s",
            "cached tokens = recomputed",
            "ms per KV-cache token",
            "device busy ms per KV-cache token",
        )
    ),
    "LIMe / baseline | KV-cache tokens/s",
)
DECODING_PROFILE = "12"
"""Functions of each ``--profile`` list the decoding step reports (``bench_decoding.py``)."""


def decoding_commands(mode: Mode, folder: Path) -> list[Command]:
    output = folder / "decoding.json"
    argv = python("bench/bench_decoding.py", *mode.bench_flags(), *mode.decoding_shape, "--profile", DECODING_PROFILE)
    return [Command(argv + ["--json", str(output)], output)]


def read_decoding(mode: Mode, folder: Path) -> list[ReportRow]:
    document = load_json(folder / "decoding.json")
    records = {r["model"]: r for r in document.get("rows", [])}
    profiled = document.get("profile", {})
    rows = []
    for model, record in records.items():
        rows += decoding_rate_rows(mode, model, record, profiled.get("device_ms_per_token", {}).get(model))
    if len(records) == 2:
        ratio = records["LIMe"]["cached_tokens_per_s"] / records["baseline"]["cached_tokens_per_s"]
        rows.append(ReportRow("LIMe / baseline | KV-cache tokens/s", ratio))
    rows += profile_rows("+host ms per token", profiled.get("functions", []), note=function_note)
    base = profiled.get("functions_base", [])
    return rows + profile_rows("baseline host ms per token", base, "base_ms", function_note)


def decoding_rate_rows(mode: Mode, model: str, record: dict, device_ms: float | None) -> list[ReportRow]:
    """A model's tokens/s with and without the cache, whether both made the same tokens, and a
    KV-cache token's wall and device-busy ms (the latter measured on CUDA only)."""
    same = "yes" if record["same_tokens"] else "no"
    tie = "" if same == "yes" else "greedy ties may differ in bf16"
    rows = [
        ReportRow(f"{model} | KV-cache tokens/s", record["cached_tokens_per_s"]),
        ReportRow(f"{model} | recompute tokens/s", record["recompute_tokens_per_s"]),
        ReportRow(f"{model} | cached tokens = recomputed", same, note=tie),
        ReportRow(f"{model} | ms per KV-cache token", 1e3 / record["cached_tokens_per_s"], note="prefill included"),
    ]
    busy = f"{model} | device busy ms per KV-cache token"
    if device_ms is not None:
        return rows + [ReportRow(busy, device_ms, note="all kernels' time in one profiled generation")]
    if mode.rehearsal:
        return rows + [ReportRow(busy, status="skipped", note="the kernels' time is profiled on CUDA only")]
    return rows


def function_note(entry: dict) -> str:
    """Each model's cumulative and own ms and calls per token of a
    ``host_profile.function_differences`` entry."""
    return (
        f"LIMe {entry['lime_ms']:.3f} ms ({entry['lime_own_ms']:.3f} own) x{entry['lime_calls']:.1f}, "
        f"baseline {entry['base_ms']:.3f} ms ({entry['base_own_ms']:.3f} own) x{entry['base_calls']:.1f}"
    )


STEPS = (
    Step("environment", "Install and environment", 30, ENVIRONMENT_ROWS, environment_commands, read_environment),
    Step(
        "attention",
        "TransformerEngine's attention backend and the libraries it needs",
        40,
        ATTENTION_ROWS,
        attention_commands,
        read_attention,
    ),
    Step(
        "gpu-check",
        "bf16, the routing kernels, FP8 and the attention backend on TransformerEngine",
        105,
        GPU_CHECK_ROWS,
        gpu_check_commands,
        read_gpu_check,
    ),
    Step(
        "overhead-1b",
        "LIMe overhead at the paper's 1B shape, micro batch 4",
        120,
        bench_rows(list(GPU.overhead_kv_heads.values()), IDLE_FIELDS),
        overhead_commands,
        read_overhead,
    ),
    Step(
        "deep-128",
        "128 narrow layers, micro batch 1",
        95,
        bench_rows(list(GPU.deep_micro_batches.values()), OVERHEAD_FIELDS),
        deep_commands,
        read_deep,
    ),
    Step(
        "host-time",
        "LIMe's host time per layer, 32 layers whose kernels cost next to nothing",
        70,
        HOST_ROWS,
        host_commands,
        read_host,
    ),
    Step(
        "pretrain", "pretrain_lime.py, 1B GQA-8, bf16, mock data", 80, PRETRAIN_ROWS, pretrain_commands, read_pretrain
    ),
    Step(
        "decoding",
        "Decoding, 1B GQA-8, KV cache",
        60,
        DECODING_ROWS,
        decoding_commands,
        read_decoding,
        by_default=False,
    ),
)
