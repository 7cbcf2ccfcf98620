"""The routing kernels compile for an H100/H200 (sm_90, Triton's own ptxas; no GPU needed), and
the PTX multiplies as ``routing_kernels`` says: bf16/fp16 rows on tensor cores with float32
accumulation, float32 rows in float32 FMAs, never TF32 (``input_precision="ieee"``).  The CPU
interpreter cannot vouch for either: it runs ``tl.dot`` as numpy (and bf16 upcast)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def compiled_report(cache: Path, *arguments: str):
    """``python -m tests.kernels.hopper_ptx *arguments``'s JSON: Triton compiling (not its
    interpreter) into a fresh ``cache``."""
    environment = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    environment["TRITON_CACHE_DIR"] = str(cache)
    done = subprocess.run(
        [sys.executable, "-m", "tests.kernels.hopper_ptx", *arguments],
        cwd=ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def hopper_report(tmp_path_factory) -> dict:
    return compiled_report(tmp_path_factory.mktemp("triton-cache"))


def test_every_variant_compiles(hopper_report):
    assert len(hopper_report) == 18, sorted(hopper_report)


def test_sixteen_bit_rows_run_on_tensor_cores_with_float32_sums(hopper_report):
    for name, found in hopper_report.items():
        if "fp32" in name.split()[1]:
            continue
        dtype = name.split()[1].replace("fp16", "f16")
        assert found["mma"] == [f"mma.sync.aligned.m16n8k16.row.col.f32.{dtype}.{dtype}.f32"], (name, found)


def test_float32_rows_never_use_tf32(hopper_report):
    for name, found in hopper_report.items():
        if name.split()[1] == "fp32":
            assert not found["tf32"] and found["mma"] == [] and found["fma"], (name, found)


@pytest.fixture(scope="module")
def bf16_model_launches(megatron, tmp_path_factory) -> list[dict]:
    """Every distinct launch of a bf16 GQA LIMe model's forward and backward on the Triton path
    (head dimension 64; blocked and per-layer routing), recorded with the specialization Triton's
    runtime gives it (from shapes, strides and the pointers' alignment, never a value: the launches
    are not run), then compiled for sm_90 (``hopper_ptx --launches``)."""
    from lime_megatron.kernels.operands import launches_observed
    from tests.kernels.hopper_ptx import specialization
    from tests.lime_fixtures import batch, loss_of, megatron_logits, tiny_model

    recorded = {}

    def record(launch, run):
        found = specialization(launch.kernel, launch.args, launch.constants)
        recorded[json.dumps(found, sort_keys=True)] = found

    shape = dict(num_layers=6, hidden_size=256, num_attention_heads=4, num_query_groups=2, lime_routing_kernel="triton")
    with launches_observed(record):
        for block in (3, 1):
            model = tiny_model(torch.bfloat16, ffn_hidden_size=64, lime_routing_block=block, **shape)
            tokens, positions, mask = batch()
            loss_of(megatron_logits(model, tokens, positions, mask).float(), tokens).backward()
    path = tmp_path_factory.mktemp("launches") / "launches.json"
    path.write_text(json.dumps(list(recorded.values())))
    return compiled_report(tmp_path_factory.mktemp("triton-cache"), "--launches", str(path))


@pytest.mark.slow  # a bf16 model's step compiled for sm_90: ~30 s
def test_a_models_launches_move_rows_16_bytes_at_a_time(bf16_model_launches):
    """The kernels read their rows in 16-byte asynchronous copies (what lets Triton pipeline the
    loads) and the mixes write theirs in 16-byte stores, as a GPU compiles the model's own launches:
    each head's elements adjacent (the head dimension a constant of the kernels), every stride and
    offset a multiple of 16 elements.  The same kernels compiled without the runtime's
    specialization (``report``'s fixed signatures) read 2 bytes at a time."""
    kinds = {(launch["kernel"], launch["constants"].get("WEIGHT_GRAD")) for launch in bf16_model_launches}
    assert kinds == {("mix_kernel", False), ("mix_kernel", True), ("weight_grad_kernel", None)}, kinds
    for launch in bf16_model_launches:
        access = launch["access"]
        assert access.get("cp.async 16 bytes") and not access.get("cp.async 2 bytes"), (launch["constants"], access)
        if launch["kernel"] == "mix_kernel":
            assert access.get("st.global.v4.b32") and not access.get("st.global.b16"), (launch["constants"], access)
