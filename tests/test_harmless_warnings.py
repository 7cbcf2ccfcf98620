"""``lime_megatron.harmless_warnings``: its filters drop the third-party warnings they name and
nothing else, the test run's ``filterwarnings`` holds the same ones, and the commands print none
of them unless the user asks for warnings."""

import json
import logging
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from lime_megatron import harmless_warnings

ROOT = Path(__file__).resolve().parents[1]

# Each warning as megatron-core 0.16.1 or 0.19.2 and torch 2.13 raise it: (category, text, module).
RAISED = [
    (
        FutureWarning,
        "`torch.distributed.reduce_scatter_tensor` is deprecated. Please use "
        "`torch.distributed.reduce_scatter_single` instead.",
        "torch.distributed.c10d_logger",
    ),
    (
        FutureWarning,
        "`torch.distributed.all_gather_into_tensor` is deprecated. Please use "
        "`torch.distributed.all_gather_single` instead.",
        "torch.distributed.c10d_logger",
    ),
    (
        UserWarning,
        "The .grad attribute of a Tensor that is not a leaf Tensor is being accessed. Its .grad "
        "attribute won't be populated during autograd.backward().",
        "megatron.core.optimizer.optimizer",
    ),
    (
        UserWarning,
        "MimoModelConfig is experimental and still under active development. The API may change "
        "without notice in future releases.",
        "megatron.core.models.mimo.config.base_configs",
    ),
    (
        UserWarning,
        "torch.distributed is disabled, unavailable or uninitialized, assuming the intent is to load "
        "in a single process.",
        "torch.distributed.checkpoint.utils",
    ),
    (
        UserWarning,
        "The argument order of load has been changed. Please check the document to avoid future breakages.",
        "torch.distributed.checkpoint.logger",
    ),
    (
        UserWarning,
        "Transformer Engine and Apex are not installed. Falling back to Torch optimizers.",
        "megatron.core.optimizer",
    ),
    (UserWarning, "Apex is not installed. Falling back to Torch Norm", "megatron.core.models.backends"),
    (
        UserWarning,
        "full scope is deprecated. Use empty cuda_graph_scope to capture the whole layer.",
        "megatron.core.transformer.transformer_config",
    ),
    (
        FutureWarning,
        "`load_state_dict` is deprecated and will be removed in future versions. Please use `load` instead.",
        "megatron.core.dist_checkpointing.strategies.torch",
    ),
    (
        FutureWarning,
        "Please use DTensor instead and we are deprecating ShardedTensor.",
        "torch.distributed.checkpoint.planner_helpers",
    ),
]
CPU_RAISED = [
    (
        UserWarning,
        "When using async grad allreduce it is recommended to set the environment variable "
        "CUDA_DEVICE_MAX_CONNECTIONS to 1 for maximum speedup",
        "megatron.core.tensor_parallel.layers",
    ),
]


def _shown(raised) -> list[str]:
    """The texts of ``raised`` that the current filters let through."""
    with warnings.catch_warnings(record=True) as shown:
        for category, text, module in raised:
            warnings.warn_explicit(text, category, "megatron.py", 1, module=module)
    return [str(warning.message) for warning in shown]


@pytest.fixture
def filters(monkeypatch):
    """A clean slate: warnings always shown, no user warning options, no log filters left behind."""
    monkeypatch.setattr(sys, "warnoptions", [])
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        yield
    for harmless in harmless_warnings.HARMLESS_LOGS:
        logging.getLogger(harmless.logger).removeFilter(harmless)


def test_the_filters_drop_the_harmless_warnings_and_no_others(filters):
    for harmless in harmless_warnings.HARMLESS + harmless_warnings.CPU_NOTICES:
        assert any(re.match(harmless.message, text) for _, text, _ in RAISED + CPU_RAISED), harmless
    others = [
        (UserWarning, "`sequence_parallel` is set to `True`, but tensor model parallel size is 1.", "megatron.core"),
        (UserWarning, "Apex is not installed. Falling back to Torch Norm", "lime_megatron.models.norm"),
        (DeprecationWarning, "Apex is not installed. Falling back to Torch Norm", "megatron.core.models.backends"),
    ]
    harmless_warnings.ignore()
    assert _shown(RAISED + CPU_RAISED + others) == [text for _, text, _ in CPU_RAISED + others]
    harmless_warnings.ignore_cpu_notices()
    assert _shown(CPU_RAISED) == []

    for harmless in harmless_warnings.HARMLESS_LOGS:
        logger = logging.getLogger(harmless.logger)
        dropped = logger.makeRecord(logger.name, logging.WARNING, "", 1, harmless.message + " ...", (), None)
        kept = logger.makeRecord(logger.name, logging.WARNING, "", 1, "... " + harmless.message, (), None)
        assert not logger.filter(dropped) and logger.filter(kept), harmless


def test_warning_options_of_the_user_win(filters, monkeypatch):
    monkeypatch.setattr(sys, "warnoptions", ["default"])
    harmless_warnings.ignore()
    harmless_warnings.ignore_cpu_notices()
    assert len(_shown(RAISED + CPU_RAISED)) == len(RAISED + CPU_RAISED)
    for harmless in harmless_warnings.HARMLESS_LOGS:
        assert harmless not in logging.getLogger(harmless.logger).filters


def test_the_test_run_filters_the_same_warnings():
    """pyproject.toml's pytest ``filterwarnings`` has every filter of the module, each with a
    comment above it."""
    import tomllib

    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    configured = tomllib.loads(text)["tool"]["pytest"]["ini_options"]["filterwarnings"]
    lines = text.splitlines()
    for harmless in harmless_warnings.HARMLESS + harmless_warnings.CPU_NOTICES:
        line = f"ignore:{harmless.message}:{harmless.category.__name__}:{harmless.module}"
        assert line in configured, f"pyproject.toml's filterwarnings lacks {line!r}"
        [number] = [i for i, each in enumerate(lines) if each.strip() == json.dumps(line) + ","]
        assert lines[number - 1].strip().startswith("#"), f"no comment says why {line!r} is harmless"


def test_commands_print_no_harmless_warning_unless_asked():
    """A command's process imports megatron-core quietly; ``python -W default`` shows the warnings."""
    imports = "import lime_megatron.cli, megatron.core.optimizer, megatron.core.models.gpt.gpt_layer_specs"
    env = {name: value for name, value in os.environ.items() if name != "PYTHONWARNINGS"}
    quiet = subprocess.run([sys.executable, "-c", imports], cwd=ROOT, env=env, capture_output=True, text=True)
    assert quiet.returncode == 0 and quiet.stderr == "", quiet.stderr
    asked = subprocess.run(
        [sys.executable, "-W", "default", "-c", imports], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert "Transformer Engine and Apex are not installed" in asked.stderr, asked.stderr
