"""lime_megatron.parallel.fusions: every example config resolved as on a CUDA machine with
TransformerEngine (the environment is a ``Platform`` argument), CPU runs keep fusions off, the run's
config and ``--dry-run`` carry the choices, and a pipeline run with ``deallocate_pipeline_outputs``
(what every pipeline run gets) reproduces the single-stage model exactly (2 processes, gloo)."""

from __future__ import annotations

import dataclasses
import sys
from functools import partial
from pathlib import Path

import pytest
import torch

from lime_megatron.parallel import fusions
from lime_megatron.parallel.fusions import Platform
from lime_megatron.testing.distributed import Layout, run_distributed
from lime_megatron.training import arguments
from lime_megatron.training.run_config import RunConfig
from tests.example_configs import CONFIGS, parsed

H100_TE = Platform(cuda=True, te=True)
H100_TE_APEX = Platform(cuda=True, te=True, fused_wgrad=True, softmax_kernels=True)
FUSIONS = ("apply_rope_fusion", "bias_activation_fusion", "bias_dropout_fusion")


@pytest.fixture(scope="module")
def examples() -> dict:
    return {path.stem: RunConfig.from_namespace(parsed(path)) for path in CONFIGS}


def test_every_example_on_a_te_gpu_fuses_rope_swiglu_and_bias_dropout(examples):
    assert len(examples) == 22
    for name, run in examples.items():
        impl, pp = run.model.transformer_impl, run.parallel.pipeline_model_parallel_size
        assert impl == "transformer_engine", name  # Hyper-Connections too (their TE spec unfuses the norms)
        for platform, wgrad in ((H100_TE, False), (H100_TE_APEX, True)):
            choices = fusions.resolve(platform, impl, pp)
            fields = choices.config_fields()
            assert all(fields[field] for field in FUSIONS), (name, choices)
            assert not fields["masked_softmax_fusion"], name  # TE attention: megatron's softmax unused
            assert fields["gradient_accumulation_fusion"] is wgrad, (name, platform)
            assert fields["deallocate_pipeline_outputs"] is (pp > 1), name
            assert all(getattr(choices, field).reason for field in fields), name


def test_pipeline_examples_deallocate_stage_tensors(examples):
    pipelined = {name for name, run in examples.items() if run.parallel.pipeline_model_parallel_size > 1}
    assert pipelined == {f"{model}_deep{depth}" for model in ("lime", "llama") for depth in (32, 64, 128)}


def test_cpu_runs_keep_fusions_off_and_pipelines_deallocate():
    for pp in (1, 4):
        fields = fusions.resolve(Platform(cuda=False, te=True), "local", pp).config_fields()
        assert fields.pop("deallocate_pipeline_outputs") is (pp > 1)
        assert not any(fields.values()), fields


def test_each_fusion_needs_its_library():
    no_te = fusions.resolve(Platform(cuda=True), "local", 1)
    assert not no_te.apply_rope_fusion.on and "TransformerEngine" in no_te.apply_rope_fusion.reason
    assert no_te.bias_activation_fusion.on and no_te.bias_dropout_fusion.on
    assert not no_te.masked_softmax_fusion.on and not no_te.gradient_accumulation_fusion.on
    local_kernels = fusions.resolve(H100_TE_APEX, "local", 1)
    assert local_kernels.masked_softmax_fusion.on  # megatron's own attention with its kernels
    assert not local_kernels.gradient_accumulation_fusion.on  # only with TE's linear layers
    with pytest.raises(ValueError, match="unknown transformer_impl 'inductor'"):
        fusions.resolve(H100_TE, "inductor", 1)


def test_dry_run_plans_for_the_gpu_and_the_config_carries_the_choices(examples):
    run = examples["lime_deep64"]
    expected = fusions.resolve(H100_TE, "transformer_engine", 4).config_fields()
    config = arguments.transformer_config(run)
    assert {name: getattr(config, name) for name in expected} == expected
    report = fusions.report(run)
    assert "assumed GPU machine" in report and "apply_rope_fusion             on" in report


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU machine's own run")
def test_a_cpu_run_resolves_against_this_machine(examples):
    run = examples["lime_deep32"]
    run = dataclasses.replace(
        run,
        dry_run=False,
        model=dataclasses.replace(run.model, transformer_impl="local"),
        precision=dataclasses.replace(run.precision, bf16=False),
    )
    config = arguments.transformer_config(run)
    assert config.deallocate_pipeline_outputs
    assert not any(getattr(config, name) for name in FUSIONS + ("gradient_accumulation_fusion",))


def deallocated_pipeline_runs() -> dict:
    """PP=2 and PP=2 with virtual stages, stage tensors deallocated after sending, against the
    single-stage run; counts the stage tensors megatron freed."""
    from megatron.core.pipeline_parallel import schedules

    from tests.parallel.test_lime_pipeline import compare, train

    freed = []
    deallocate = schedules.deallocate_output_tensor

    def counting(out, deallocate_pipeline_outputs=False):
        # megatron-core 0.19 also passes lists/dicts of stage tensors and recurses through this name
        if isinstance(out, torch.Tensor) and deallocate_pipeline_outputs:
            freed.append(out.numel())
        deallocate(out, deallocate_pipeline_outputs)

    schedules.deallocate_output_tensor = counting
    model = dict(num_query_groups=2)
    reference = train(Layout(), model)
    stages = dict(deallocate_pipeline_outputs=True)
    report = {
        layout.name: compare(layout, model, reference, stages=stages) for layout in (Layout(pp=2), Layout(pp=2, vpp=2))
    }
    return dict(report=report, freed=len(freed))


def test_deallocated_stage_tensors_keep_the_pipeline_exact():
    from tests.parallel.test_lime_pipeline import check_report

    results = run_distributed(partial(deallocated_pipeline_runs), 2, timeout=600, nccl_rules=True)
    check_report(results[0]["report"])
    assert results[0]["freed"] > 0  # the first stage sent and freed stage tensors


def test_detect_says_why_transformer_engine_cannot_be_used(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", None)  # an import that fails
    platform = Platform.detect()
    assert not platform.te and "cannot import transformer_engine.pytorch: ModuleNotFoundError" in platform.te_problem
    assert platform.te_problem in dataclasses.replace(platform, cuda=True).describe()
    (tmp_path / "broken_te_standin.py").write_text("raise RuntimeError('cudnn shared object not found')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert fusions._import_problem("broken_te_standin") == (
        "cannot import broken_te_standin: RuntimeError: cudnn shared object not found"
    )
    assert fusions._import_problem("math") == ""


def test_gpu_extra_is_megatron_cores_transformer_engine_requirement():
    """pyproject.toml's ``gpu`` extra is the ``te`` extra megatron-core 0.19 declares (its metadata)."""
    from importlib.metadata import requires, version

    import tomllib

    if not version("megatron-core").startswith("0.19."):
        pytest.skip("megatron-core 0.19 is installed by the Python 3.12 CI leg")
    declared = [req.split(";")[0].strip() for req in requires("megatron-core") if 'extra == "te"' in req]
    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]
    assert declared == project["optional-dependencies"]["gpu"]
