"""The GPU-free pieces of ``python -m lime_megatron.gpu_check``: the exit without CUDA, the weight
copy between the TransformerEngine and local specs (local -> local and against a hand-made
TE-style module), the gradient comparison, the table and exit code, that the bf16 tolerances
hold for bf16 rounding of a small LIMe model on CPU, and the bf16 and FP8 checks themselves run
on CPU with the local spec (``Machine("cpu", te=False)``): model building, the weight copy, the
routed-K/V row against the dry run's prediction, and an FP8 run that changes nothing FAILS; the
attention-backend row from TransformerEngine-style debug messages; the training legs through the
trainer (bf16 + distributed optimizer single process; TP2 + SP and PP2 on 2 gloo ranks), each
shown to FAIL on a leg that trains something else."""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
import types

import pytest
import torch
from torch import nn

from lime_megatron import gpu_check
from lime_megatron.gpu_check import Row
from lime_megatron.parallel.process_groups import initialize_parallel as init_single_process
from lime_megatron.testing import distributed as dist
from lime_megatron.training import short_runs
from tests.lime_fixtures import SEQ, VOCAB, batch, loss_of, tiny_model
from tests.scripts import ROOT


@pytest.fixture(scope="module", autouse=True)
def megatron():
    init_single_process()


CPU = gpu_check.REHEARSAL  # the GPU checks' code paths, shrunk, with the local spec on CPU


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_without_cuda_one_line_and_exit_2(capsys):
    assert gpu_check.main([]) == 2
    assert capsys.readouterr().out.strip().count("\n") == 0


@pytest.mark.parametrize("te", [True, False])
def test_all_checks_run_on_the_spec_asked_for(monkeypatch, te):
    """``--spec local`` (``Machine(te=False)``) runs every check on the local spec and skips FP8's
    rows; the TransformerEngine spec runs FP8 once, both models; the timing follows skip_timing."""
    calls = []

    def recorder(check):
        return lambda *args: calls.append((check, args[-1] if check != "training" else args[3])) or []

    for check, function in (
        ("bf16", "check_bf16"),
        ("kernels", "check_routing_kernels"),
        ("fp8", "check_fp8"),
        ("speed", "time_shape"),
        ("training", "training_rows"),
    ):
        monkeypatch.setattr(gpu_check, function, recorder(check))
    machine = gpu_check.Machine(te=te)
    for skip_timing in (False, True):
        calls.clear()
        rows = gpu_check.all_checks(machine, skip_timing, 989.4, 1)
        kinds = [check for check, _ in calls]
        assert kinds.count("bf16") == len(gpu_check.BF16_FAMILIES) and kinds.count("training") == 2
        assert kinds.count("kernels") == len(gpu_check.KERNEL_CASES)
        assert kinds.count("fp8") == (1 if te else 0)
        assert kinds.count("speed") == (0 if skip_timing else len(gpu_check.TIMED_SHAPES))
        assert all(passed is machine for _, passed in calls)
        skipped = [row for row in rows if row.check.startswith("fp8")]
        fp8_rows = len(gpu_check.FP8_RECIPES) * len(gpu_check.FP8_MODELS) * len(gpu_check.FP8_KEYS)
        assert len(skipped) == (0 if te else fp8_rows)
        assert all(row.status == "skipped" and row.passed for row in skipped)
    batches = {shape.micro_batch for shape in gpu_check.timed_shapes(machine)}
    assert batches == ({4} if te else {gpu_check.LOCAL_SPEC_MICRO_BATCH})


def test_spec_option():
    assert gpu_check.parse_args([]).spec == "transformer_engine"
    assert gpu_check.parse_args(["--spec", "local"]).spec == "local"
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--spec", "apex"])


def module_with(tensors: dict[str, torch.Tensor]) -> nn.Module:
    """A module whose ``named_parameters`` are ``tensors`` (dotted names become submodules)."""
    root = nn.Module()
    for name, tensor in tensors.items():
        *path, leaf = name.split(".")
        module = root
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, nn.Module())
            module = getattr(module, part)
        module.register_parameter(leaf, nn.Parameter(tensor.clone()))
    return root


def te_style(local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A TE-spec state of local-spec tensors: the input norms fused into the linear layers."""
    to_te = {value: key for key, value in gpu_check.TE_FUSED_NORMS.items()}
    named = {}
    for name, tensor in local.items():
        suffix = next((s for s in to_te if name.endswith("." + s)), None)
        named[name[: -len(suffix)] + to_te[suffix] if suffix else name] = tensor
    return named


def test_te_names_map_to_local_names():
    names = {
        "decoder.layers.3.self_attention.linear_qkv.layer_norm_weight": "decoder.layers.3.input_layernorm.weight",
        "decoder.layers.3.mlp.linear_fc1.layer_norm_weight": "decoder.layers.3.pre_mlp_layernorm.weight",
        "decoder.layers.3.self_attention.linear_qkv.weight": "decoder.layers.3.self_attention.linear_qkv.weight",
        "decoder.layers.3.self_attention.router.weight": "decoder.layers.3.self_attention.router.weight",
    }
    assert {te: gpu_check.local_name(te) for te in names} == names
    assert list(gpu_check.local_named([("a.linear_qkv._extra_state", torch.zeros(1))])) == []


def test_weights_copy_between_local_and_te_style_specs():
    source, target = tiny_model(seed=1), tiny_model(seed=2)
    gpu_check.copy_weights(source, target)
    for (name, a), (_, b) in zip(source.named_parameters(), target.named_parameters()):
        assert torch.equal(a, b), name
    local = dict(source.named_parameters())
    te = module_with({name: torch.randn_like(t) for name, t in te_style(local).items()})
    gpu_check.copy_weights(te, target)
    te_params = dict(te.named_parameters())
    fused = "decoder.layers.2.self_attention.linear_qkv.layer_norm_weight"
    assert torch.equal(dict(target.named_parameters())["decoder.layers.2.input_layernorm.weight"], te_params[fused])
    gpu_check.copy_weights(source, te)
    assert torch.equal(te_params[fused], local["decoder.layers.2.input_layernorm.weight"])
    with pytest.raises(ValueError, match="only in the target.*input_layernorm"):
        gpu_check.copy_weights(module_with({"decoder.final_layernorm.weight": torch.ones(32)}), target)
    with pytest.raises(ValueError, match="shapes differ"):
        gpu_check.copy_weights(tiny_model(hidden_size=16, num_attention_heads=2), target)


def test_gradient_comparison_finds_the_wrong_parameter():
    expected = {"a.weight": torch.randn(8, 8), "a.router.weight": torch.randn(4, 8)}
    actual = {"a.weight": expected["a.weight"] * 1.2, "a.router.weight": expected["a.router.weight"] + 1e-4}
    rows = gpu_check.compare_gradients("bf16 vs fp32", "LIMe", actual, expected, 5e-2)
    assert [row.passed for row in rows] == [False, True]
    assert rows[0].value == pytest.approx(0.2)
    summary = gpu_check.summarize_gradients(rows)
    assert rows[0] in summary and any("worst of 1 router grads" in row.quantity for row in summary)
    with pytest.raises(ValueError, match=r"missing \['a.router.weight'\]"):
        gpu_check.compare_gradients("c", "m", {"a.weight": actual["a.weight"]}, expected, 1.0)


def test_table_and_exit_code():
    rows = [
        Row("bf16 vs fp32", "LIMe", "loss", 2e-3, 1e-2),
        Row("speed", "1B GQA-8", "LIMe step-time overhead", 0.05, 0.01, enforced=False),
        Row("speed", "1B GQA-8 LIMe", "MFU", 0.45, 0.40, lower_bound=True, enforced=False),
        Row("speed", "1B GQA-8 LIMe", "tokens/s", 123456.0),
    ]
    table = gpu_check.format_table(rows)
    lines = table.splitlines()
    assert len(lines) == 2 + len(rows) and "target missed" in lines[3] and "target met" in lines[4]
    assert ">= 0.4" in lines[4] and "123,456" in lines[5]
    assert gpu_check.exit_code(rows) == 0  # speed targets are reported, not enforced
    failing = rows + [Row("fp8 delayed", "LIMe", "loss distance", math.nan, 3e-2)]
    assert gpu_check.exit_code(failing) == 1 and "FAILED" in gpu_check.format_table(failing)


def test_device_peaks():
    assert gpu_check.device_peak_tflops("NVIDIA H100 80GB HBM3") == 989.4
    assert gpu_check.device_peak_tflops("NVIDIA GH200 480GB") == 989.4
    assert gpu_check.device_peak_tflops("Tesla T4") is None


def test_bf16_tolerances_hold_for_bf16_rounding_on_cpu():
    """The same LIMe weights in float32 and bfloat16 (local spec, CPU): loss and every gradient
    within the stated bf16 tolerances, so a GPU failure points at a kernel, not at rounding."""
    fp32 = tiny_model(dtype=torch.float32, seed=3)
    bf16 = tiny_model(dtype=torch.bfloat16, seed=4)
    gpu_check.copy_weights(fp32, bf16)
    with torch.no_grad():  # weights representable in both
        for param in fp32.parameters():
            param.copy_(param.bfloat16().float())
    results = []
    for model in (fp32, bf16):
        tokens, positions, mask = batch()
        loss = loss_of(model(tokens, positions, mask).float(), tokens)
        loss.backward()
        results.append((loss.item(), {n: p.grad.float() for n, p in model.named_parameters()}))
    (ref_loss, ref_grads), (loss, grads) = results
    assert abs(loss - ref_loss) / ref_loss <= gpu_check.TOLERANCES.loss_bf16
    rows = gpu_check.compare_gradients("bf16", "LIMe", grads, ref_grads, gpu_check.TOLERANCES.grad_bf16)
    assert sum("router" in row.quantity for row in rows) == 4
    assert all(row.passed for row in rows), [row for row in rows if not row.passed]
    assert max(row.value for row in rows) > 1e-4  # bf16 did round: the comparison is not vacuous


def test_check_configs_and_the_training_loop_on_cpu():
    """The pieces the GPU runs share with CPU: configs (no fusions for the fp32 reference, no
    gradient-accumulation fusion without DDP), loss and local-named gradients, AdamW steps."""
    reference = gpu_check.check_config(True, te=False, bf16=False, fusions_on=False)
    assert not any(
        getattr(reference, name)
        for name in (
            "apply_rope_fusion",
            "bias_activation_fusion",
            "bias_dropout_fusion",
            "gradient_accumulation_fusion",
        )
    )
    assert reference.params_dtype == torch.float32 and reference.num_query_groups == 2
    model = tiny_model(dtype=torch.float32, seed=5)
    batch_ = gpu_check.make_batch(2, SEQ, seed=0, device="cpu", vocab=VOCAB)
    loss, grads = gpu_check.loss_and_gradients(model, batch_)
    assert math.isfinite(loss) and sum("router" in name for name in grads) == 4
    assert set(grads) == set(gpu_check.local_named(model.named_parameters()))
    losses = gpu_check.train_losses(model, [batch_] * 8, lr=1e-2)
    assert losses.shape == (8, *batch_[0].shape)
    steps = gpu_check.step_losses(losses)
    assert steps[-1] < steps[0] - 0.5  # the sequence task is learnable


@pytest.mark.parametrize("family", gpu_check.BF16_FAMILIES)
def test_bf16_check_runs_on_cpu_for_each_family(family):
    rows = gpu_check.check_bf16(family, gpu_check.TOLERANCES, CPU)
    assert gpu_check.exit_code(rows) == 0, gpu_check.format_table(rows)
    assert [row.quantity for row in rows][0] == "loss" and {row.model for row in rows} == {family}
    assert any(row.check == "routed K/V" for row in rows) == (family == "LIMe")
    backend = [row for row in rows if row.check == "attention backend"]
    assert [row.status for row in backend] == ["skipped"]  # the local spec has no backends
    assert max(row.value for row in rows if row.quantity.startswith("worst")) > 1e-4  # bf16 rounded


@pytest.mark.parametrize("case", gpu_check.KERNEL_CASES)
def test_routing_kernel_check_runs_on_cpu(case):
    """The Triton path (Triton's interpreter here) against the torch path in float32: every row
    met, each saying what it was measured against, bf16 at the bf16 check's tolerances."""
    rows = gpu_check.check_routing_kernels(case, gpu_check.TOLERANCES, CPU)
    assert gpu_check.exit_code(rows) == 0, gpu_check.format_table(rows)
    assert [row.key for row in rows] == ["loss", "worst router grad", "worst grad"]
    assert all(row.quantity.endswith(gpu_check.KERNEL_REFERENCE) for row in rows)
    tolerances = gpu_check.TOLERANCES
    bf16 = (tolerances.loss_bf16, tolerances.grad_bf16, tolerances.grad_bf16)
    assert [row.limit for row in rows] == list(bf16 if case.startswith("bf16") else [tolerances.kernels_fp32] * 3)
    if case.startswith("bf16"):  # against float32: bf16's rounding shows
        assert max(row.value for row in rows) > 1e-4


def test_routing_kernel_check_catches_a_wrong_kernel(monkeypatch):
    """A block's backward launch that drops its weight-gradient programs fails the router rows."""
    from lime_megatron.kernels import operands

    monkeypatch.setattr(operands, "mix_beside_weight_grad", lambda out, later, *weighed: operands.mix(out, later))
    rows = gpu_check.check_routing_kernels("bf16, blocks of 2", gpu_check.TOLERANCES, CPU)
    failed = [row.key for row in rows if not row.passed]
    assert "worst router grad" in failed and all("router" in key for key in failed), gpu_check.format_table(rows)


def test_hyper_connection_gradients_are_compared_pooled():
    """HC/mHC gates are sums that cancel: compared as one vector with the other hyper-connection
    gradients, and a wrong large one (a dynamic weight's) still fails that vector."""
    generator = torch.Generator().manual_seed(0)
    expected = {
        "decoder.layers.0.hc_attn.alpha_res": torch.tensor([1e-9]),
        "decoder.layers.0.hc_attn.mapping_proj.weight": torch.randn(4, 8, generator=generator),
        "decoder.layers.0.mlp.linear_fc2.weight": torch.randn(8, 8, generator=generator),
    }
    actual = {**expected, "decoder.layers.0.hc_attn.alpha_res": torch.tensor([-1e-9])}  # 200% off, rounding-sized
    pooled = gpu_check.pooled_hyper_connections(actual)
    assert sorted(pooled) == ["decoder.layers.0.mlp.linear_fc2.weight", gpu_check.POOLED_HYPER_CONNECTIONS]
    assert pooled[gpu_check.POOLED_HYPER_CONNECTIONS].numel() == 33
    rows = gpu_check.compare_gradients("bf16", "mHC", pooled, gpu_check.pooled_hyper_connections(expected), 0.05)
    assert all(row.passed for row in rows)
    wrong = {
        **actual,
        "decoder.layers.0.hc_attn.mapping_proj.weight": 1.2 * expected["decoder.layers.0.hc_attn.mapping_proj.weight"],
    }
    rows = gpu_check.compare_gradients(
        "bf16", "mHC", gpu_check.pooled_hyper_connections(wrong), gpu_check.pooled_hyper_connections(expected), 0.05
    )
    assert [row.quantity for row in rows if not row.passed] == [f"grad {gpu_check.POOLED_HYPER_CONNECTIONS}"]


def test_bf16_check_catches_a_wrong_routed_kv_prediction(monkeypatch):
    # a dry run predicting the opposite (GQA on the local spec keeps copies) is caught
    monkeypatch.setattr(gpu_check, "drops_routed_kv", lambda config, impl: True)
    routed = [row for row in gpu_check.check_bf16("LIMe", gpu_check.TOLERANCES, CPU) if row.check == "routed K/V"]
    assert routed[0].status == "FAILED" and routed[0].value == 2  # both layers differ
    # the row says why: the [s, b, kv heads, d] keys given, the copies repeated to the query heads saved
    config = gpu_check.check_config(True, te=False, bf16=True, fusions_on=True, machine=CPU)
    given = [config.kv_heads, config.kv_channels]
    repeated = [config.num_attention_heads, config.kv_channels]
    assert "layer 0: given keys [" in routed[0].quantity and f"{given}"[1:-1] in routed[0].quantity
    assert (
        "saved instead [" in routed[0].quantity and f"{repeated}"[1:-1] in routed[0].quantity.split("saved instead")[1]
    )
    assert (
        gpu_check.routed_kv_rows("LIMe", gpu_check.check_config(True, te=False, bf16=False, fusions_on=False), {})[
            0
        ].status
        == "FAILED"
    )  # nothing logged: LIMe's attention never ran


def test_fp8_that_changes_nothing_fails():
    """The local spec ignores ``fp8``: the FP8 runs repeat the bf16 losses exactly, and the check
    must say FAILED instead of passing on a distance of 0; the rows are the same as when skipped."""
    rows = gpu_check.check_fp8(gpu_check.TOLERANCES, CPU, capability=(9, 0))
    unchanged = [row for row in rows if row.key == "FP8 changed the losses"]
    assert len(unchanged) == len(gpu_check.FP8_RECIPES) * len(gpu_check.FP8_MODELS)
    assert all(row.status == "FAILED" and row.value == 0 for row in unchanged), gpu_check.format_table(rows)
    older = gpu_check.check_fp8(gpu_check.TOLERANCES, CPU, capability=(8, 0))
    assert {row.status for row in older} == {"skipped"}
    assert [row.name for row in older] == [row.name for row in rows]


def off_by(bf16: torch.Tensor, distance: float) -> torch.Tensor:
    """Synthetic FP8 losses at relative ``distance`` from ``bf16``'s, on every token and step."""
    return bf16 * (1 + distance)


BF16_LOSSES = 2 + torch.rand(3, 2, 4, generator=torch.Generator().manual_seed(0))  # [steps, b, s]


def fp8_statuses(lime: torch.Tensor, baseline: torch.Tensor) -> dict[str, str]:
    """``key of each LIMe row -> status`` of ``fp8_rows`` on synthetic losses (bf16: ``BF16_LOSSES``)."""
    losses, references = {"LIMe": lime, "baseline": baseline}, dict.fromkeys(gpu_check.FP8_MODELS, BF16_LOSSES)
    rows = gpu_check.fp8_rows("fp8 delayed", losses, references, gpu_check.TOLERANCES)
    assert all(row.passed for row in rows if row.model == "baseline" and row.key != "FP8 changed the losses")
    return {row.key: row.status for row in rows if row.model == "LIMe"}


def test_fp8_lime_is_held_to_the_baselines_distance():
    """LIMe's FP8 distances to bf16 (first step and over the steps) pass within
    ``fp8_over_baseline`` times the baseline's and fail at 3 times; non-finite losses fail, and so
    does FP8 that changed nothing."""
    baseline = off_by(BF16_LOSSES, 0.05)
    first, worst, changed = gpu_check.FP8_KEYS
    assert gpu_check.TOLERANCES.fp8_over_baseline < 3
    assert fp8_statuses(off_by(BF16_LOSSES, 0.08), baseline) == {first: "ok", worst: "ok", changed: "ok"}
    assert fp8_statuses(off_by(BF16_LOSSES, 0.15), baseline) == {first: "FAILED", worst: "FAILED", changed: "ok"}
    nan = off_by(BF16_LOSSES, 0.05)
    nan[2, 1, 3] = math.nan
    assert set(fp8_statuses(nan, baseline).values()) == {"FAILED"}
    assert fp8_statuses(BF16_LOSSES.clone(), BF16_LOSSES.clone())[changed] == "FAILED"


def test_fp8_distances_first_step_per_token_then_worst_step():
    """The first step's distance is measured on every token (errors that cancel in the mean loss
    count), the worst step's on the mean losses; a non-finite FP8 loss makes both inf."""
    signs = torch.tensor([1.0, -1.0]).repeat(2, 2)  # [b, s] = [2, 4], the mean's errors cancel
    losses = BF16_LOSSES.clone()
    losses[0] += 0.01 * signs
    losses[2] *= 1.03
    first, worst = gpu_check.fp8_distances(losses, BF16_LOSSES)
    assert first == pytest.approx(0.01 * 8**0.5 / BF16_LOSSES[0].norm().item(), rel=1e-5)
    assert worst == pytest.approx(0.03, rel=1e-5)  # float32 losses
    losses[1, 0, 0] = math.inf
    assert gpu_check.fp8_distances(losses, BF16_LOSSES) == (math.inf, math.inf)


def test_attention_backend_row_names_the_selection_and_fails_on_another():
    auto = gpu_check.check_config(True, te=False, bf16=False, fusions_on=False)
    flash = gpu_check.check_config(True, te=False, bf16=False, fusions_on=False, attention_backend="flash")
    fused_log = [
        "Available backends = {FlashAttention=True, FusedAttention=True (sub-backend 1)}",
        "Selected backend = FusedAttention (sub-backend 1)",
    ]
    flash_log = ["Selected backend = FlashAttention"]
    assert [row.status for row in gpu_check.attention_backend_rows("LIMe", auto, fused_log)] == ["ok"]
    assert [row.status for row in gpu_check.attention_backend_rows("LIMe", flash, flash_log)] == ["ok"]
    assert [row.status for row in gpu_check.attention_backend_rows("LIMe", auto, flash_log)] == ["FAILED"]
    assert [row.status for row in gpu_check.attention_backend_rows("LIMe", auto, fused_log + flash_log)] == ["FAILED"]
    assert [row.status for row in gpu_check.attention_backend_rows("LIMe", auto, [])] == ["FAILED"]
    assert all("TE:" not in row.quantity for row in gpu_check.attention_backend_rows("LIMe", auto, fused_log))


def test_a_failed_backend_row_quotes_transformer_engines_reasons():
    """Another backend (or none) selected: the row quotes TE's distinct "Disabling ..." messages,
    those about the expected backend first, each shortened, the rest counted."""
    auto = gpu_check.check_config(True, te=False, bf16=False, fusions_on=False)
    supported = "Supported: qkv_dtype = {torch.float16, torch.bfloat16}. " * 5
    fused_reason = f"Disabling FusedAttention for unsupported qkv_dtype = torch.float32. {supported}"
    log = [
        "Disabling FlashAttention 3 for compute capability != sm90",
        fused_reason,
        fused_reason,
        "Available backends = {FlashAttention=True (2.8.3), FusedAttention=False, UnfusedDotProductAttention=True}",
        "Selected backend = FlashAttention (2.8.3).",
    ]
    quantity = gpu_check.attention_backend_rows("LIMe", auto, log)[0].quantity
    assert quantity.index("Disabling FusedAttention") < quantity.index("Disabling FlashAttention 3")
    assert quantity.count("Disabling FusedAttention") == 1 and "Available" not in quantity
    assert supported not in quantity and len(quantity) < 2 * gpu_check.BACKEND_REASON_CHARS + 150
    many = [f"Disabling UnfusedDotProductAttention for reason {n}" for n in range(gpu_check.BACKEND_REASONS_SHOWN + 2)]
    quantity = gpu_check.attention_backend_rows("LIMe", auto, many)[0].quantity
    assert "reason 3" in quantity and "reason 4" not in quantity and quantity.endswith("(and 2 more)")
    assert gpu_check.attention_backend_rows("LIMe", auto, [])[0].quantity.endswith("no 'Disabling ...' message logged")


def test_log_capture_reaches_a_logger_that_does_not_propagate():
    logger = logging.getLogger("te-style-attention-logger")
    logger.propagate, logger.level = False, logging.DEBUG
    child = logging.getLogger("te-style-attention-logger.child")  # propagates to the one that does not
    with gpu_check.captured_log_messages() as messages:
        logger.debug("Selected backend = %s", "FusedAttention")
        child.debug("from the child")
    logger.debug("after the block")
    assert messages == ["Selected backend = FusedAttention", "from the child"]  # each once


def test_log_capture_reaches_a_logger_made_in_the_block():
    """TransformerEngine makes its ``DotProductAttention`` logger at its first backend selection,
    inside the block, sets its level, adds its own stream handler only where ``hasHandlers()``
    finds none, and lets it propagate: the capture takes its messages, once each."""
    name = "DotProductAttention, made in the block"
    assert name not in logging.Logger.manager.loggerDict
    with gpu_check.captured_log_messages() as messages:
        logger = logging.getLogger(name)
        logger.setLevel(logging.DEBUG)
        if not logger.hasHandlers():
            logger.addHandler(logging.StreamHandler())
        logger.debug("Disabling FlashAttention 3 for compute capability != sm90")
        logger.debug("Selected backend = %s.", "FusedAttention (sub-backend 1)")
    assert messages == [
        "Disabling FlashAttention 3 for compute capability != sm90",
        "Selected backend = FusedAttention (sub-backend 1).",
    ]


def test_transformer_engine_is_asked_to_select_its_backend_again(monkeypatch):
    """TE keeps its last backend selection while the attention's parameters stay the same: the
    bf16 check asks for a new one before each family's step, so that each family logs its own."""
    module = types.ModuleType("transformer_engine.pytorch.attention.dot_product_attention")
    module._attention_backends = {"backend_selection_requires_update": False}  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    gpu_check.reselect_te_attention_backend()
    assert module._attention_backends == {"backend_selection_requires_update": True}  # type: ignore[attr-defined]


DEBUG_ENVIRONMENT_AT_FIRST_HEAVY_IMPORT = """
import builtins, json, os, runpy, sys

seen = {}
plain_import = builtins.__import__

def recording_import(name, *args, **kwargs):
    if not seen and name.split(".")[0] in ("torch", "megatron", "transformer_engine"):
        seen.update((variable, os.environ.get(variable)) for variable in ("NVTE_DEBUG", "NVTE_DEBUG_LEVEL"))
    return plain_import(name, *args, **kwargs)

builtins.__import__ = recording_import
sys.argv = ["gpu_check", "--help"]  # argparse exits once the module's imports are done
try:
    runpy.run_module("lime_megatron.gpu_check", run_name="__main__", alter_sys=True)  # as python -m
except SystemExit:
    pass
print(json.dumps(seen))
"""


def test_te_debug_log_is_switched_on_before_anything_imports_transformer_engine():
    """TransformerEngine reads ``NVTE_DEBUG``/``NVTE_DEBUG_LEVEL`` once, when imported (through
    torch and megatron, by the module's own imports): ``python -m lime_megatron.gpu_check`` must
    have set them when torch is first imported, a user's own setting left as it is."""
    environment = {name: value for name, value in os.environ.items() if not name.startswith("NVTE_DEBUG")}
    completed = subprocess.run(
        [sys.executable, "-c", DEBUG_ENVIRONMENT_AT_FIRST_HEAVY_IMPORT],
        env={**environment, "NVTE_DEBUG_LEVEL": "1"},
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert completed.returncode == 0, completed.stderr[-2000:]
    assert json.loads(completed.stdout.splitlines()[-1]) == {"NVTE_DEBUG": "1", "NVTE_DEBUG_LEVEL": "1"}


SMALL_RUN = short_runs.ShortRun(
    num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=128, iterations=3
)
OTHER_LR = {"other-lr": ["--lr", "2e-3"]}  # a leg that trains something else: the check must fail it


def layout_rows(lime: bool, extra_legs: dict) -> list[Row]:
    """``training_rows`` on a rank of the 2-process world (``extra_legs`` added to the layouts)."""
    short_runs.LAYOUT_LEGS.update(extra_legs)
    return [
        row for row in gpu_check.training_rows(lime, gpu_check.TOLERANCES, 2, CPU, SMALL_RUN) if row.check == "layouts"
    ]


@pytest.mark.parametrize(
    "lime",
    [True, pytest.param(False, marks=pytest.mark.slow)],
    ids=["lime", "llama"],  # llama: ~20 s, slow suite
)
def test_layout_legs_match_data_parallel_on_two_ranks(lime):
    rows = dist.run_distributed(layout_rows, 2, lime, OTHER_LR, nccl_rules=True)[0]
    assert [row.quantity.split()[0] for row in rows] == ["TP2", "PP2", "other-lr"]
    assert [row.status for row in rows] == ["ok", "ok", "FAILED"], gpu_check.format_table(rows)
    assert all(row.value < 1e-6 for row in rows[:2])


def test_bf16_training_leg_on_cpu_and_layouts_skipped_on_one_process(monkeypatch):
    try:
        rows = gpu_check.training_rows(True, gpu_check.TOLERANCES, 1, CPU, SMALL_RUN)
        statuses = [(row.check, row.status) for row in rows]
        assert statuses == [("bf16 training", "ok")] + [("layouts", "skipped")] * len(short_runs.LAYOUT_LEGS)
        assert 0 < rows[0].value  # bf16 did round
        monkeypatch.setattr(short_runs, "MIXED_PRECISION_LEG", short_runs.MIXED_PRECISION_LEG + ["--lr", "1e-2"])
        assert gpu_check.training_rows(True, gpu_check.TOLERANCES, 1, CPU, SMALL_RUN)[0].status == "FAILED"
    finally:
        init_single_process()  # the trainer tore the parallel state down
