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

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def hopper_report(tmp_path_factory) -> dict:
    environment = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    environment["TRITON_CACHE_DIR"] = str(tmp_path_factory.mktemp("triton-cache"))  # compile afresh
    done = subprocess.run(
        [sys.executable, "-m", "tests.kernels.hopper_ptx"],
        cwd=ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


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
