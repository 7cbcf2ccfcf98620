"""One GPU check: ``python -m lime_megatron.gpu_check`` (docs/gpu.md).

On one CUDA GPU, in a few minutes, in one process:

1. **bf16 against fp32.**  LIMe, the LLaMA baseline, Hyper-Connections and mHC (``BF16_FAMILIES``,
   ``CheckScale``) are built with the TransformerEngine spec in bf16, with the fused kernels
   ``lime_megatron.parallel.fusions`` picks for the machine; the same weights are copied
   (``copy_weights``: TE fuses the input norms into ``linear_qkv``/``linear_fc1``) into the local
   spec in fp32 with no fusions.  The loss and every gradient (routers included; the
   hyper-connection parameters pooled into one vector, ``pooled_hyper_connections``) are compared:
   relative error ``||a - b|| / ||b||`` within ``TOLERANCES``.
2. **The routing kernels.**  LIMe on the Triton path (``--lime-routing-kernel``; ``KERNEL_CASES``:
   bf16 with atomic weight-gradient sums, float32 with per-split ones) against the torch path in
   float32, local spec, same weights: the loss and every gradient, in bf16 within the bf16
   check's ``loss_bf16``/``grad_bf16``, in float32 within ``kernels_fp32``.  (The H200 measured
   Triton-bf16 against torch-bf16 at 0.0323 on a router gradient, where megatron's own bf16 is
   0.0385 from float32: two bf16 runs may differ by the sum of their distances to float32.)  CI
   runs the kernels only in Triton's CPU interpreter; here they run compiled.
3. **FP8.**  ``CheckScale.fp8_steps`` AdamW steps of LIMe and the baseline (``FP8_MODELS``) with
   TE's FP8 (``hybrid`` format; delayed and current/tensorwise scaling), each from its bf16 run's
   initial weights on the same batches: every loss finite and changed by FP8; the first step's
   distance to bf16 (per-token losses, the weights still equal) and the largest over the steps,
   LIMe's within ``TOLERANCES.fp8_over_baseline`` times the baseline's plus ``fp8_slack`` (the
   H200's 20-step distances, LIMe 0.14/0.137 and the baseline 0.096/0.092, showed the absolute
   FP8 error of this small model is not LIMe's to answer for).  Skipped (not failed) on GPUs
   without FP8 (compute capability < 8.9).
4. **Attention backend.**  The backend TransformerEngine selected for each family's attention
   (its debug log, ``NVTE_DEBUG=1 NVTE_DEBUG_LEVEL=2``, which ``python -m`` sets before the
   module's imports import TE: TE reads them once, at import, and the H200's first run, which set
   them later, logged no selection; ``reselect_te_attention_backend`` before each family): FAILED
   if it is not the one the routed-K/V prediction and the ``--dry-run`` memory estimate assume
   (``--attention-backend``: cuDNN ``FusedAttention`` for ``auto``/``fused``, ``FlashAttention``
   for ``flash``), quoting TE's "Disabling ..." reasons.
5. **Training legs** (``lime_megatron.training.short_runs``: the trainer itself on mock data, a few
   iterations): ``--bf16`` through megatron's ``Float16Module`` with the distributed optimizer
   against the float32 run (``TOLERANCES.loss_bf16``); under ``torchrun`` with 2 or more GPUs also
   TP2 + SP and PP2 (LIMe's rows over NCCL) against the data-parallel run over the same GPUs, in
   float32 (``TOLERANCES.layout_loss``); on one GPU the layout rows say they were skipped.
6. **Speed and memory.**  Forward+backward of LIMe and the baseline at the paper's 1B shapes
   (GQA-8 and MHA, 16 layers) and at the deep-narrow shape (128 layers, hidden 512), timed
   interleaved (LIMe, baseline, LIMe, ...) in bf16 with the TE spec: median step time, LIMe's
   overhead, tokens/s, TFLOP/s and MFU (``flops`` module, routers included, training = 3x
   forward), and peak memory (``torch.cuda.max_memory_allocated`` during the step).  The
   targets (overhead <= 1% GQA-8 / 3% MHA, memory within 2%, MFU >= 40%) are reported,
   not enforced: timings are not tolerances.

``--spec local`` runs the same checks with megatron's local spec as the candidate (a GPU without
TransformerEngine: megatron's own fused kernels in bf16 against fp32, the speed of the local
spec, the training legs); FP8 and the attention backend need TransformerEngine and are skipped.

Prints one table and exits 1 if a tolerance is missed, 0 otherwise; on a machine without CUDA it
prints one line and exits 2.  Every row has a name that is the same on every machine and run
(``Row.name``: ``check | model | key``), and a check a machine cannot make leaves its rows
``skipped`` with the reason, so the table always has the same rows; ``--json PATH`` writes them
after each check (the GPU session, ``tools/gpu/session.py``, reads them).  ``--rehearse`` runs on
a CPU what a CPU can, at ``REHEARSAL_SCALE`` with the local spec: the session's CPU rehearsal.
The GPU-free pieces (tolerances, the table, the weight copy between specs, the comparison, the
checks themselves at the rehearsal's scale) are tested on CPU (``tests/test_gpu_check.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import logging
import math
import os
import re
import statistics
import sys
import textwrap
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

if __name__ == "__main__":  # TransformerEngine's backend-selection log: read once, when TE is imported
    os.environ.setdefault("NVTE_DEBUG", "1")  # (``_NVTE_DEBUG``, ``AttentionLogging._log_level``), so
    os.environ.setdefault("NVTE_DEBUG_LEVEL", "2")  # set before the imports below; a user's own win
if "--rehearse" in sys.argv[1:]:  # the routing kernels on a CPU: Triton's interpreter, which only
    os.environ.setdefault("TRITON_INTERPRET", "1")  # counts if set before triton (megatron) is imported

import torch

from lime_megatron.models.config import PAPER_1B, lime_config
from lime_megatron.models.lime.recompute import drops_routed_kv, routed_kv_log, te_flash_attention
from lime_megatron.parallel import fusions
from lime_megatron.parallel.fusions import Platform
from lime_megatron.planning import flops
from lime_megatron.training import short_runs
from lime_megatron.training.short_runs import ShortRun

VOCAB = 50304  # GPT-2's 50257 padded to a multiple of 128, as the trainer pads it


@dataclass(frozen=True)
class Tolerances:
    """Relative errors a bf16/FP8 run may show against its reference (FP8: LIMe's against the
    baseline's, a factor and a slack)."""

    loss_bf16: float = 1e-2
    """|loss_bf16 - loss_fp32| / loss_fp32 (TE spec in bf16 vs local spec in fp32, same weights)."""
    grad_bf16: float = 5e-2
    """||g_bf16 - g_fp32|| / ||g_fp32|| for every parameter (bf16 keeps 8 mantissa bits)."""
    fp8_over_baseline: float = 2.0
    """LIMe's FP8 loss distance to bf16 over the LLaMA baseline's, same recipe, first step and worst
    step alike.  What this codebase answers for is the FP8 error LIMe adds to what the same TE
    recipe gives the baseline, not the absolute FP8 error of a 4-layer model (the H200's baseline
    drifted 0.096/0.092 from bf16 over 20 steps).  LIMe runs the same FP8 GEMMs and adds routers,
    bf16-precision parameters applied outside TE's FP8 GEMMs to K/V the FP8 GEMMs made, so its
    error may be somewhat larger (the H200: 0.14/0.137, 1.46x/1.48x); a router or scale that FP8
    breaks for LIMe alone shows as a multiple of the baseline's, beyond 2."""
    fp8_slack: float = 1e-3
    """Added to ``fp8_over_baseline`` times the baseline's distance: two distances both a tenth of
    bf16's own loss tolerance (``loss_bf16``) or less are not told apart by their ratio."""
    layout_loss: float = 1e-5
    """|loss_layout - loss_DP| / loss_DP at every iteration of the float32 TP2 and PP2 legs: the same
    function summed in another order (measured 3e-8 on CPU over gloo, ``tests/test_gpu_check.py``)."""
    kernels_fp32: float = 1e-5
    """Loss and every gradient, the Triton path in float32 against the torch path in float32 (the
    kernels sum in another order; ``tests/models/test_fused_routing.py`` holds the interpreter to
    the same).  The Triton path in bf16 is held to ``loss_bf16``/``grad_bf16`` against the same
    float32 reference (``check_routing_kernels``)."""


TOLERANCES = Tolerances()
FP8_STEPS = 20
FP8_MIN_DISTANCE = 1e-6
"""Below this the FP8 run's losses equal bf16's (to float32 printing): FP8 did not run."""
FP8_RECIPES = ("delayed", "tensorwise")  # megatron's names: delayed and current (tensorwise) scaling
CHECK_SHAPE = dict(num_layers=4, hidden_size=512, ffn_hidden_size=2048, num_attention_heads=8, num_query_groups=2)
CHECK_BATCH = (2, 256)  # (micro batch, sequence) of the correctness checks
BF16_FAMILIES: dict[str, dict[str, Any]] = {  # label -> check_config's lime and overrides
    "LIMe": dict(lime=True, lime_recompute_routed_kv=True),  # the routed-K/V drop under TransformerEngine
    "baseline": dict(lime=False),
    "HC": dict(lime=False, hyper_connections=4),
    "mHC": dict(lime=False, hyper_connections=4, hyper_connections_manifold=True),
}
"""The model families of the bf16 check: HC's TransformerEngine spec unfuses the norms, mHC's keeps
them fused (``lime_megatron.models.hyper_connections.spec``); on CPU only stand-ins check that."""
KERNEL_CASES: dict[str, dict[str, Any]] = {  # label -> check_config's overrides, the Triton path's dtype
    "bf16, blocks of 2": dict(bf16=True, lime_routing_block=2, num_layers=6),
    "fp32, blocks of 2, deterministic": dict(bf16=False, lime_routing_block=2, num_layers=6, deterministic_mode=True),
}
"""The routing-kernel check's cases: 6 layers in blocks of 2 run every kind of launch (layer 1's
own forward and its backward with the weight gradient, a fused block's product over earlier
sources, the third block's backward launch that computes the second's row gradients); atomic
weight-gradient sums in bf16 (a GPU's default), per-split sums in float32; the reference of both
is the torch path in float32."""
KERNEL_REFERENCE = "(reference: torch path, float32)"
"""What the routing-kernel rows' quantities say they were measured against."""
PEAK_BF16_TFLOPS = {"H100": 989.4, "H200": 989.4, "GH200": 989.4, "A100": 312.0, "B200": 2250.0}
"""Dense bf16 peak (TFLOP/s) by device name: SXM parts; pass --peak-tflops for others (H100 PCIe)."""


@dataclass(frozen=True)
class TimedShape:
    """A timed model shape: config fields, micro batch and sequence length, and the
    target for LIMe's step-time overhead over the baseline."""

    name: str
    model: dict
    micro_batch: int
    seq: int
    overhead_target: float


TIMED_SHAPES = (
    TimedShape("1B GQA-8", dict(PAPER_1B, num_query_groups=8), 4, 2048, 0.01),
    TimedShape("1B MHA", dict(PAPER_1B, num_query_groups=32), 4, 2048, 0.03),
    TimedShape(
        "deep-128", dict(num_layers=128, hidden_size=512, ffn_hidden_size=2048, num_attention_heads=8), 4, 2048, 0.03
    ),
)
LOCAL_SPEC_MICRO_BATCH = 1
"""The micro batch of the timed shapes with ``--spec local``: megatron's unfused attention keeps each
layer's s x s probabilities (fp32 softmax output and bf16 probabilities, 6 bytes per head and
position pair), about 30 GiB per sequence at the deep-128 shape, 120 GiB at micro batch 4."""
MEMORY_TARGET, MFU_TARGET = 0.02, 0.40
TRAINING_RUN = ShortRun()
"""The training legs' model and run (4 layers, hidden 256, 4 iterations of 8 x 256 tokens)."""


@dataclass(frozen=True)
class CheckScale:
    """The size the correctness checks run at: the model (config fields), the batch (micro batch,
    sequence), the vocabulary, the FP8 run's steps and the training legs' run."""

    shape: dict = dataclasses.field(default_factory=lambda: dict(CHECK_SHAPE))
    batch: tuple[int, int] = CHECK_BATCH
    vocab: int = VOCAB
    fp8_steps: int = FP8_STEPS
    training: ShortRun = TRAINING_RUN


REHEARSAL_SCALE = CheckScale(
    shape=dict(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2),
    batch=(2, 16),
    vocab=128,
    fp8_steps=2,
    training=ShortRun(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=128, iterations=3),
)
"""The checks shrunk to seconds on a CPU: ``--rehearse`` and the CPU tests."""


# --------------------------------------------------------------------------- weights between specs

TE_FUSED_NORMS = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}
"""TransformerEngine spec parameter -> local spec parameter (TE fuses the norms into the linears)."""


def local_name(name: str) -> str:
    """The local spec's name of a parameter named ``name`` in either spec."""
    for te_suffix, local_suffix in TE_FUSED_NORMS.items():
        if name.endswith("." + te_suffix):
            return name[: -len(te_suffix)] + local_suffix
    return name


def local_named(tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """``{local spec name: tensor}`` of ``(name, tensor)`` pairs of either spec (TE's
    ``_extra_state`` FP8 metadata is not a parameter and is left out)."""
    return {local_name(name): tensor for name, tensor in tensors if not name.endswith("_extra_state")}


def copy_weights(source: torch.nn.Module, target: torch.nn.Module) -> None:
    """Copy every parameter of ``source`` into ``target`` (local or TE spec, any dtype/device).
    Raises ValueError naming the parameters that do not match one to one, or differ in shape."""
    sources, targets = local_named(source.named_parameters()), local_named(target.named_parameters())
    if sources.keys() != targets.keys():
        raise ValueError(
            f"parameters differ between the specs: only in the source "
            f"{sorted(sources.keys() - targets.keys())}, only in the target "
            f"{sorted(targets.keys() - sources.keys())}"
        )
    shapes = [name for name in sources if sources[name].shape != targets[name].shape]
    if shapes:
        differ = [(name, tuple(sources[name].shape), tuple(targets[name].shape)) for name in shapes]
        raise ValueError(f"parameter shapes differ (name, source, target): {differ}")
    with torch.no_grad():
        for name, tensor in sources.items():
            targets[name].copy_(tensor)


# --------------------------------------------------------------------------- comparison and table


@dataclass(frozen=True)
class Row:
    """One line of the table: a checked quantity, its value and limit (None: reported only)."""

    check: str
    model: str
    quantity: str
    value: float
    limit: float | None = None
    lower_bound: bool = False
    """``value`` must be >= ``limit`` (MFU) instead of <= ``limit``."""
    enforced: bool = True
    """A missed limit fails the check (tolerances) or is only reported (speed targets)."""
    key: str = ""
    """The row's stable name within its check and model (default ``quantity``, which may carry
    measured details such as a parameter's name): ``name`` is what a report looks rows up by."""
    skipped: str = ""
    """Why the row was not measured on this machine (then ``value`` is nan and nothing is checked)."""

    @property
    def name(self) -> str:
        """``check | model | key``: the same on every machine and every run of the check."""
        return f"{self.check} | {self.model} | {self.key or self.quantity}"

    @property
    def passed(self) -> bool:
        if self.limit is None or self.skipped:
            return True
        if not math.isfinite(self.value):
            return False
        return self.value >= self.limit if self.lower_bound else self.value <= self.limit

    @property
    def status(self) -> str:
        if self.skipped:
            return "skipped"
        if self.limit is None:
            return ""
        if self.passed:
            return "ok" if self.enforced else "target met"
        return "FAILED" if self.enforced else "target missed"

    @property
    def limit_text(self) -> str:
        """``<= limit`` (``>= limit`` for a lower bound), empty for a row without one."""
        return "" if self.limit is None else (">= " if self.lower_bound else "<= ") + _number(self.limit)

    def as_dict(self) -> dict:
        """The row for a JSON report (``--json``): its name, quantity, value, limit and status."""
        value = self.value if math.isfinite(self.value) else None
        return dict(name=self.name, quantity=self.quantity, value=value, limit=self.limit_text, status=self.status)


def skipped_row(check: str, model: str, key: str, reason: str) -> Row:
    """A row this machine cannot measure, kept in the table (and the report) with ``reason``."""
    return Row(check, model, f"{key} (skipped: {reason})", math.nan, None, key=key, skipped=reason)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| in float64 (absolute when expected is zero)."""
    actual, expected = actual.double(), expected.double()
    scale = expected.norm().item()
    diff = (actual - expected).norm().item()
    return diff / scale if scale > 0 else diff


def compare_gradients(
    check: str, model: str, actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], tolerance: float
) -> list[Row]:
    """One row per parameter: relative error of ``actual`` against ``expected`` (same names).
    Raises ValueError naming the parameters missing on either side."""
    if actual.keys() != expected.keys():
        raise ValueError(
            f"gradients differ in names: missing {sorted(expected.keys() - actual.keys())}, "
            f"unexpected {sorted(actual.keys() - expected.keys())}"
        )
    return [
        Row(check, model, f"grad {name}", relative_error(actual[name], expected[name]), tolerance) for name in expected
    ]


POOLED_HYPER_CONNECTIONS = "hyper-connection parameters (one vector)"


def pooled_hyper_connections(grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``grads`` with every hyper-connection parameter's gradient (``.hc_`` in the name) joined into
    one vector ``POOLED_HYPER_CONNECTIONS`` (name order): their gates and scales are sums over all
    positions that cancel (mHC's first residual gate is zero up to rounding), so their bf16 errors
    relative to themselves measure rounding, not the spec; pooled, they are compared as a whole."""
    pooled = [grad.flatten() for name, grad in sorted(grads.items()) if ".hc_" in name]
    kept = {name: grad for name, grad in grads.items() if ".hc_" not in name}
    return {**kept, POOLED_HYPER_CONNECTIONS: torch.cat(pooled)} if pooled else kept


def summarize_gradients(rows: list[Row]) -> list[Row]:
    """The worst router gradient and the worst other parameter's (keys ``worst router grad`` and
    ``worst grad``), then every failing gradient row."""
    summary = []
    for routers in (True, False):
        group = [row for row in rows if ("router" in row.quantity) == routers]
        if group:
            worst = max(group, key=lambda row: row.value if math.isfinite(row.value) else math.inf)
            kind = "router grad" if routers else "grad"
            summary.append(
                dataclasses.replace(
                    worst,
                    quantity=f"worst of {len(group)} {kind}s: {worst.quantity[5:]}",
                    key=f"worst {kind}",
                )
            )
    return summary + [row for row in rows if not row.passed]


def format_table(rows: list[Row]) -> str:
    """The rows as one fixed-width table."""
    header = ("check", "model", "quantity", "value", "limit", "status")
    cells = [header] + [
        (
            row.check,
            row.model,
            row.quantity,
            _number(row.value),
            row.limit_text,
            row.status,
        )
        for row in rows
    ]
    widths = [max(len(line[i]) for line in cells) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip() for line in cells]
    return "\n".join([lines[0], "-" * len(lines[0])] + lines[1:])


def _number(value: float) -> str:
    if not math.isfinite(value):
        return str(value)
    if value == 0 or 1e-3 <= abs(value) < 1e6:
        return f"{value:,.4g}" if abs(value) < 1e3 else f"{value:,.0f}"
    return f"{value:.2e}"


def exit_code(rows: list[Row]) -> int:
    """0 if every enforced limit holds, else 1."""
    return 0 if all(row.passed for row in rows if row.enforced) else 1


# --------------------------------------------------------------------------- GPU runs


@dataclass(frozen=True)
class Machine:
    """Where the checks run: the device and the spec of the candidate models.  ``main`` uses
    ``Machine()`` (CUDA, TransformerEngine spec, the machine's fused kernels), or with
    ``--spec local`` ``Machine(te=False)`` (CUDA, megatron's own layers and fused kernels); the CPU
    tests run the same checks with ``Machine("cpu", te=False)`` (local spec, no fusions)."""

    device: str = "cuda"
    te: bool = True
    scale: CheckScale = CheckScale()

    @property
    def transformer_impl(self) -> str:
        return "transformer_engine" if self.te else "local"

    def platform(self) -> Platform:
        """The fused kernels the candidates use: this machine's on CUDA, none on CPU."""
        return Platform.detect() if self.device == "cuda" else Platform(cuda=False)


GPU = Machine()
REHEARSAL = Machine("cpu", te=False, scale=REHEARSAL_SCALE)
"""``--rehearse``: every check a CPU can run, at ``REHEARSAL_SCALE``, with the local spec."""


def check_config(lime: bool, *, te: bool, bf16: bool, fusions_on: bool, machine: Machine = GPU, **overrides):
    """A LIMe (or baseline) config of ``overrides`` (else ``machine.scale.shape``) for the checks:
    bf16 or fp32, with ``machine``'s fused kernels (``fusions``) or none.  Gradient-accumulation
    fusion stays off: the checks run without DDP's ``main_grad``."""
    dtype = torch.bfloat16 if bf16 else torch.float32
    shape = {**machine.scale.shape, **overrides}
    config = lime_config(
        lime=lime,
        bf16=bf16,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        transformer_impl="transformer_engine" if te else "local",
        use_cpu_initialization=machine.device == "cpu",
        **shape,
    )
    platform = machine.platform() if fusions_on else Platform(cuda=False)
    return fusions.without_ddp(fusions.resolve(platform, config.transformer_impl, 1)).apply(config)


def build(config, seq: int, machine: Machine = GPU):
    """The model of ``config`` (spec ``config.transformer_impl``) on ``machine``'s device."""
    from lime_megatron.models.gpt_model import build_model

    return build_model(config, machine.scale.vocab, seq, transformer_impl=config.transformer_impl).to(machine.device)


def make_batch(
    micro_batch: int, seq: int, seed: int, device: str = "cuda", vocab: int = VOCAB
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, labels) ``[b, s]`` of a learnable sequence: random start, then +1 mod ``vocab``."""
    generator = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab, (micro_batch, 1), generator=generator)
    tokens = (start + torch.arange(seq + 1)) % vocab
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def token_losses(model, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token loss (fp32) of ``model`` at every position of ``tokens``, ``[b, s]``."""
    positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
    return model(tokens, positions, None, labels=labels).float()


def loss_of(model, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss (fp32) of ``model`` on ``tokens``."""
    return token_losses(model, tokens, labels).mean()


def loss_and_gradients(model, batch) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = loss_of(model, *batch)
    loss.backward()
    grads = local_named((name, param.grad.float()) for name, param in model.named_parameters())
    return loss.item(), grads


def check_bf16(label: str, tolerances: Tolerances, machine: Machine = GPU) -> list[Row]:
    """``machine``'s spec in bf16 (its fused kernels) against the local spec in fp32 (none), same
    weights, for the family ``label`` of ``BF16_FAMILIES``; for LIMe also whether the routed K/V
    were dropped where the dry run predicts."""
    family = BF16_FAMILIES[label]
    lime = family["lime"]
    micro_batch, seq = machine.scale.batch
    torch.manual_seed(1)
    config = check_config(**family, te=machine.te, bf16=True, fusions_on=True, machine=machine)
    candidate = build(config, seq, machine)
    reference = build(check_config(**family, te=False, bf16=False, fusions_on=False, machine=machine), seq, machine)
    copy_weights(candidate, reference)
    batch = make_batch(micro_batch, seq, seed=0, device=machine.device, vocab=machine.scale.vocab)
    routed_kv_log.take()
    if machine.te:
        reselect_te_attention_backend()
    with captured_log_messages() as messages:
        loss, grads = loss_and_gradients(candidate, batch)
    drops = routed_kv_log.take()
    ref_loss, ref_grads = loss_and_gradients(reference, batch)
    rows = [Row("bf16 vs fp32", label, "loss", abs(loss - ref_loss) / abs(ref_loss), tolerances.loss_bf16)]
    if machine.te:
        rows += attention_backend_rows(label, config, messages)
    else:
        rows.append(skipped_row("attention backend", label, BACKEND_KEY, "the local spec has no attention backends"))
    rows += routed_kv_rows(label, config, drops) if lime else []
    grads, ref_grads = pooled_hyper_connections(grads), pooled_hyper_connections(ref_grads)
    return rows + summarize_gradients(compare_gradients("bf16 vs fp32", label, grads, ref_grads, tolerances.grad_bf16))


def check_routing_kernels(label: str, tolerances: Tolerances, machine: Machine = GPU) -> list[Row]:
    """The Triton path (``--lime-routing-kernel``) in the dtype of the case ``label`` of
    ``KERNEL_CASES`` against the torch path in float32, same weights (the Triton model's, cast) and
    batch, local spec without fusions: the loss and every gradient, in bf16 within the tolerances
    megatron's own bf16 is held to (``loss_bf16``/``grad_bf16``, the bf16 check's), in float32
    within ``kernels_fp32``.  Two bf16 computations may differ by the sum of their distances to
    float32: the H200 measured Triton-bf16 against torch-bf16 at 0.0323 on a router gradient that
    megatron's bf16 misses float32 by 0.0385, so bf16 is held to float32, not to another bf16.
    What Triton's CPU interpreter cannot vouch for, the compiled kernels (tensor-core dots, no TF32
    in float32, atomic sums, a program reading the rows it then overwrites), a GPU checks here."""
    case = dict(KERNEL_CASES[label])
    bf16 = case.pop("bf16")
    micro_batch, seq = machine.scale.batch
    config = functools.partial(check_config, True, te=False, fusions_on=False, machine=machine, **case)
    torch.manual_seed(1)
    candidate = build(config(bf16=bf16, lime_routing_kernel="triton"), seq, machine)
    reference = build(config(bf16=False, lime_routing_kernel="torch"), seq, machine)
    reference.load_state_dict(candidate.state_dict())
    batch = make_batch(micro_batch, seq, seed=0, device=machine.device, vocab=machine.scale.vocab)
    (loss, grads), (ref_loss, ref_grads) = (loss_and_gradients(model, batch) for model in (candidate, reference))
    loss_tolerance, grad_tolerance = (
        (tolerances.loss_bf16, tolerances.grad_bf16) if bf16 else (tolerances.kernels_fp32, tolerances.kernels_fp32)
    )
    loss_row = Row("triton vs torch", label, "loss", abs(loss - ref_loss) / abs(ref_loss), loss_tolerance)
    rows = [loss_row] + summarize_gradients(
        compare_gradients("triton vs torch", label, grads, ref_grads, grad_tolerance)
    )
    return [
        dataclasses.replace(row, quantity=f"{row.quantity} {KERNEL_REFERENCE}", key=row.key or row.quantity)
        for row in rows
    ]


def routed_kv_rows(label: str, config, drops: dict) -> list[Row]:
    """One row: the layers whose routed K/V were dropped (``routed_kv_log.take()``'s ``drops``)
    or kept against ``recompute.drops_routed_kv``, the prediction ``--dry-run``'s memory estimate
    uses; FAILED when a layer differs or no layer was logged (the check's LIMe models rebuild the
    routed K/V, ``lime_recompute_routed_kv``); where copies were kept against the prediction, the
    first such layer's ``explanation`` (the layouts given and saved instead) follows."""
    predicted = drops_routed_kv(config, config.transformer_impl)
    wrong = [layer for layer, counts in drops.items() if bool(counts.dropped and not counts.kept) != predicted]
    quantity = (
        f"layers whose routed K/V were {'kept' if predicted else 'dropped'} against the dry run's "
        f"'{'dropped' if predicted else 'kept'}' ({len(drops)} logged)"
    )
    explained = next(((layer, drops[layer].explanation) for layer in wrong if drops[layer].explanation), None)
    if explained:
        quantity += f"; layer {explained[0]}: {explained[1]}"
    return [Row("routed K/V", label, quantity, len(wrong) if drops else math.inf, 0, key="layers against the dry run")]


SELECTED_BACKEND = re.compile(r"Selected backend = (\w+)")
DISABLED_BACKEND = re.compile(r"Disabling \w+")
"""TransformerEngine's debug messages on why it ruled a backend out (``get_attention_backend``)."""
BACKEND_KEY = "selected backend"
BACKEND_REASONS_SHOWN, BACKEND_REASON_CHARS = 4, 160
"""How many of TransformerEngine's distinct "Disabling ..." messages a failed backend row quotes,
each cut to how many characters."""


def expected_te_backend(config) -> str:
    """The TransformerEngine attention backend the routed-K/V prediction and the memory estimate
    assume for ``config`` (``recompute.drops_routed_kv``)."""
    return "FlashAttention" if te_flash_attention(config) else "FusedAttention"


def attention_backend_rows(label: str, config, messages: list[str]) -> list[Row]:
    """One row: the backend TransformerEngine's debug log ``messages`` say it selected, against
    :func:`expected_te_backend`; FAILED when another (or none) was selected, quoting TE's reasons
    (:func:`backend_reasons`)."""
    selected = sorted({match.group(1) for message in messages for match in SELECTED_BACKEND.finditer(message)})
    expected = expected_te_backend(config)
    quantity = f"backends selected {selected or 'none logged'}, the dry run assumes {expected}"
    if selected != [expected]:
        quantity += f"; TE: {backend_reasons(messages, expected)}"
    return [Row("attention backend", label, quantity, 0 if selected == [expected] else math.inf, 0, key=BACKEND_KEY)]


def backend_reasons(messages: list[str], expected: str) -> str:
    """TransformerEngine's distinct "Disabling ..." messages among ``messages``, those about the
    ``expected`` backend first, at most ``BACKEND_REASONS_SHOWN`` of ``BACKEND_REASON_CHARS`` each."""
    reasons = list(dict.fromkeys(message for message in messages if DISABLED_BACKEND.match(message)))
    reasons.sort(key=lambda reason: not reason.startswith(f"Disabling {expected}"))
    if not reasons:
        return "no 'Disabling ...' message logged"
    shown = [textwrap.shorten(reason, BACKEND_REASON_CHARS, placeholder=" ...") for reason in reasons]
    more = len(reasons) - BACKEND_REASONS_SHOWN
    return "; ".join(shown[:BACKEND_REASONS_SHOWN]) + (f" (and {more} more)" if more > 0 else "")


def reselect_te_attention_backend() -> None:
    """Make TransformerEngine select (and log) its attention backend again at its next attention:
    it keeps its last selection while the attention's parameters (shapes, dtypes, mask) stay the
    same, so a second model family of the same shape would log none (TE's own tests reset
    ``_attention_backends`` the same way)."""
    from transformer_engine.pytorch.attention.dot_product_attention import _attention_backends

    _attention_backends["backend_selection_requires_update"] = True


@contextlib.contextmanager
def captured_log_messages() -> Iterator[list[str]]:
    """The messages every logger emits within the block, each once: a handler on the root logger
    takes those of every logger that propagates (TransformerEngine's ``DotProductAttention``,
    made at its first backend selection, does), the same handler on each logger that does not
    propagate takes the rest."""
    messages: list[str] = []
    handler = logging.Handler(logging.DEBUG)
    # a one-off handler: its emit replaced on the instance
    handler.emit = lambda record: messages.append(record.getMessage())  # type: ignore[method-assign]
    loggers = [logging.getLogger()] + [
        logger
        for logger in logging.Logger.manager.loggerDict.values()
        if isinstance(logger, logging.Logger) and not logger.propagate
    ]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        yield messages
    finally:
        for logger in loggers:
            logger.removeHandler(handler)


def train_losses(model, batches, lr: float = 1e-3) -> torch.Tensor:
    """AdamW steps of ``model``, one per batch: the loss of every token at each step (on the CPU),
    ``[steps, b, s]``."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    for batch in batches:
        optimizer.zero_grad(set_to_none=True)
        step = token_losses(model, *batch)
        step.mean().backward()
        optimizer.step()
        losses.append(step.detach().cpu())
    return torch.stack(losses)


def step_losses(losses: torch.Tensor) -> torch.Tensor:
    """The mean loss of each step of ``train_losses``'s ``losses``."""
    return losses.mean(dim=(1, 2))


FP8_MODELS = {"LIMe": True, "baseline": False}
"""The FP8 check's models (label -> lime): LIMe's FP8 error is held to the baseline's."""


def check_fp8(tolerances: Tolerances, machine: Machine = GPU, capability: tuple[int, int] | None = None) -> list[Row]:
    """``machine.scale.fp8_steps`` AdamW steps of each of ``FP8_MODELS`` with each FP8 recipe and in
    bf16, from the same weights (per model) on the same batches: ``fp8_rows`` per recipe
    (``capability``: the GPU's compute capability, asked from CUDA when None)."""
    if (capability or torch.cuda.get_device_capability()) < (8, 9):
        return skipped_fp8_rows("FP8 needs compute capability >= 8.9")
    micro_batch, seq = machine.scale.batch
    batches = [
        make_batch(micro_batch, seq, seed=step, device=machine.device, vocab=machine.scale.vocab)
        for step in range(machine.scale.fp8_steps)
    ]
    weights, references = {}, {}
    for label, lime in FP8_MODELS.items():
        torch.manual_seed(2)
        bf16 = build(check_config(lime, te=machine.te, bf16=True, fusions_on=True, machine=machine), seq, machine)
        weights[label] = {name: param.detach().clone() for name, param in bf16.named_parameters()}
        references[label] = train_losses(bf16, batches)
        del bf16
    rows = []
    for recipe in FP8_RECIPES:
        losses = {
            label: fp8_losses(lime, recipe, weights[label], batches, machine) for label, lime in FP8_MODELS.items()
        }
        rows += fp8_rows(f"fp8 {recipe}", losses, references, tolerances)
    return rows


def fp8_losses(lime: bool, recipe: str, weights: dict[str, torch.Tensor], batches, machine: Machine) -> torch.Tensor:
    """``train_losses`` of LIMe (or the baseline) with the FP8 ``recipe`` (``hybrid`` format), from
    ``weights``."""
    config = check_config(
        lime, te=machine.te, bf16=True, fusions_on=True, machine=machine, fp8="hybrid", fp8_recipe=recipe
    )
    model = build(config, batches[0][0].shape[1], machine)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(weights[name])
    return train_losses(model, batches)


FP8_KEYS = ("first-step loss distance to bf16", "max loss distance to bf16", "FP8 changed the losses")
"""The stable keys of the three rows ``fp8_rows`` makes for each recipe and model."""


def skipped_fp8_rows(reason: str) -> list[Row]:
    """The FP8 rows (each recipe, model and key), skipped for ``reason``."""
    return [
        skipped_row(f"fp8 {recipe}", label, key, reason)
        for recipe in FP8_RECIPES
        for label in FP8_MODELS
        for key in FP8_KEYS
    ]


def fp8_distances(losses: torch.Tensor, reference: torch.Tensor) -> tuple[float, float]:
    """The relative distances of FP8 ``losses`` to bf16 ``reference`` losses (``train_losses``'s):
    the first step's, its per-token losses as one vector (the weights still equal: FP8's numerics
    alone, measured on every token rather than on their mean, where errors cancel), and the largest
    of the steps' mean losses' (the trajectories diverge); both inf when an FP8 loss is not finite."""
    if not torch.isfinite(losses).all():
        return math.inf, math.inf
    steps, reference_steps = step_losses(losses).double(), step_losses(reference).double()
    worst = ((steps - reference_steps).abs() / reference_steps.abs()).max().item()
    return relative_error(losses[0], reference[0]), worst


def fp8_rows(
    check: str, losses: dict[str, torch.Tensor], references: dict[str, torch.Tensor], tolerances: Tolerances
) -> list[Row]:
    """The rows of one FP8 recipe (``check``) for each of ``FP8_MODELS`` (``fp8_model_rows``), from
    their FP8 ``losses`` and bf16 ``references``: LIMe's held to the baseline's distances."""
    baseline = fp8_distances(losses["baseline"], references["baseline"])
    return [
        row
        for label in FP8_MODELS
        for row in fp8_model_rows(
            check, label, losses[label], references[label], None if label == "baseline" else baseline, tolerances
        )
    ]


def fp8_model_rows(
    check: str,
    label: str,
    losses: torch.Tensor,
    reference: torch.Tensor,
    baseline: tuple[float, float] | None,
    tolerances: Tolerances,
) -> list[Row]:
    """The rows (``FP8_KEYS``) of model ``label`` for one recipe: its first-step and largest distance
    to bf16 (``fp8_distances``), each within ``tolerances.fp8_over_baseline`` times the baseline's
    (``baseline``; None: this is the baseline, reported) plus ``fp8_slack``, and that FP8 changed
    the losses, every one finite (the larger of the two distances at least ``FP8_MIN_DISTANCE``:
    0 means FP8 never ran)."""
    distances = fp8_distances(losses, reference)
    limits = [fp8_limit(distance, tolerances) for distance in baseline] if baseline else [(None, " (reported)")] * 2
    steps, reference_steps = step_losses(losses).tolist(), step_losses(reference).tolist()
    quantities = (
        "first step, rel. distance of the per-token losses to bf16",
        f"max rel. loss distance to bf16 over {len(steps)} steps (loss {steps[0]:.4g} -> {steps[-1]:.4g}, "
        f"bf16 {reference_steps[0]:.4g} -> {reference_steps[-1]:.4g})",
    )
    rows = [
        Row(check, label, quantity + note, distance, limit, key=key)
        for quantity, distance, (limit, note), key in zip(quantities, distances, limits, FP8_KEYS)
    ]
    quantity = "FP8 changed the losses, every one finite (the larger distance to bf16)"
    return rows + [Row(check, label, quantity, max(distances), FP8_MIN_DISTANCE, lower_bound=True, key=FP8_KEYS[2])]


def fp8_limit(baseline: float, tolerances: Tolerances) -> tuple[float, str]:
    """LIMe's limit for an FP8 distance the baseline measured as ``baseline``, and the row's words
    for it: ``fp8_over_baseline`` times it plus ``fp8_slack``."""
    factor, slack = tolerances.fp8_over_baseline, tolerances.fp8_slack
    return factor * baseline + slack, f"; limit {factor:g} x the baseline's {baseline:.3g} + {slack:g}"


def training_rows(
    lime: bool, tolerances: Tolerances, world_size: int, machine: Machine = GPU, run: ShortRun | None = None
) -> list[Row]:
    """The training legs (``short_runs``) of ``run`` (default ``machine.scale.training``): bf16 +
    distributed optimizer against float32 (the machine's spec), and with a world of 2 or more
    processes TP2 + SP and PP2 against data parallelism (float32, local spec); on a world of one
    the layout rows are skipped."""
    label = "LIMe" if lime else "baseline"
    run = run or machine.scale.training
    distance = short_runs.mixed_precision_difference(run, lime, machine.transformer_impl)
    rows = [
        Row(
            "bf16 training",
            label,
            f"Float16Module + dist. optimizer vs fp32, max rel. loss diff over {run.iterations} its",
            distance,
            tolerances.loss_bf16,
            key="Float16Module + dist. optimizer vs fp32",
        )
    ]
    if world_size < 2 or world_size % 2:
        reason = f"the layouts need torchrun on 2k GPUs (world {world_size})"
        return rows + [skipped_row("layouts", label, f"{leg} vs DP", reason) for leg in short_runs.LAYOUT_LEGS]
    for leg, difference in short_runs.layout_differences(run, lime).items():
        rows.append(
            Row(
                "layouts",
                label,
                f"{leg} vs DP{world_size} fp32, max rel. loss diff over {run.iterations} its",
                difference,
                tolerances.layout_loss,
                key=f"{leg} vs DP",
            )
        )
    return rows


def _timed_step(model, batch) -> tuple[float, int]:
    """(seconds, peak bytes allocated) of one forward+backward."""
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    loss_of(model, *batch).backward()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated()
    model.zero_grad(set_to_none=True)
    return seconds, peak


def time_shape(
    shape: TimedShape, peak_tflops: float | None, machine: Machine = GPU, warmup: int = 3, repeats: int = 10
) -> list[Row]:
    """LIMe and the baseline at ``shape`` with ``machine``'s spec, timed interleaved; rows of speed
    and memory."""
    models = {}
    for lime in (True, False):
        config = check_config(lime, te=machine.te, bf16=True, fusions_on=True, machine=machine, **shape.model)
        models["LIMe" if lime else "baseline"] = (build(config, shape.seq, machine), config)
    batch = make_batch(shape.micro_batch, shape.seq, seed=0)
    times: dict[str, list[float]] = {name: [] for name in models}
    peaks: dict[str, int] = {}
    for repeat in range(warmup + repeats):
        for name, (model, _) in models.items():
            seconds, peak = _timed_step(model, batch)
            if repeat >= warmup:
                times[name].append(seconds)
                peaks[name] = max(peaks.get(name, 0), peak)
    tokens = shape.micro_batch * shape.seq
    rows = []
    for name, (_, config) in models.items():
        seconds = statistics.median(times[name])
        tflops = flops.training_flops_per_iteration(config, shape.seq, VOCAB, shape.micro_batch) / seconds / 1e12
        label = f"{shape.name} {name}"
        rows += [
            Row("speed", label, "fwd+bwd ms (median)", seconds * 1e3),
            Row("speed", label, "tokens/s", tokens / seconds),
            Row("speed", label, "TFLOP/s (routers included)", tflops),
            Row("memory", label, "peak GiB (both models' weights resident)", peaks[name] / 2**30),
        ]
        if peak_tflops:
            mfu = tflops / peak_tflops
            rows.append(
                Row(
                    "speed",
                    label,
                    "MFU",
                    mfu,
                    MFU_TARGET if name == "LIMe" and "1B" in shape.name else None,
                    lower_bound=True,
                    enforced=False,
                )
            )
    overhead = statistics.median(times["LIMe"]) / statistics.median(times["baseline"]) - 1
    memory = peaks["LIMe"] / peaks["baseline"] - 1
    rows += [
        Row("speed", shape.name, "LIMe step-time overhead", overhead, shape.overhead_target, enforced=False),
        Row("memory", shape.name, "LIMe peak memory over baseline", memory, MEMORY_TARGET, enforced=False),
    ]
    del models
    torch.cuda.empty_cache()
    return rows


def device_peak_tflops(name: str) -> float | None:
    """Dense bf16 peak of the device called ``name`` (``PEAK_BF16_TFLOPS``), None if unknown."""
    matches = [key for key in PEAK_BF16_TFLOPS if key in name]
    return PEAK_BF16_TFLOPS[max(matches, key=len)] if matches else None


def guarded(check: str, run: Callable[[], list[Row]]) -> list[Row]:
    """``run()``'s rows, or one failed row naming the error (out of memory included)."""
    try:
        return run()
    except Exception as error:  # noqa: BLE001 - a check that cannot run is a failed check
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        message = f"{type(error).__name__}: {(str(error).splitlines() or [''])[0][:90]}"
        return [Row(check, "-", message, math.nan, math.inf, key="error")]


SPECS = ("transformer_engine", "local")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peak-tflops", type=float, help="dense bf16 peak of the GPU (default: from its name)")
    parser.add_argument("--skip-timing", action="store_true", help="correctness checks only")
    parser.add_argument(
        "--spec",
        choices=SPECS,
        default="transformer_engine",
        help="the candidates' layer spec: 'local' checks a GPU without TransformerEngine (megatron's "
        "own layers and fused kernels; the FP8 and attention-backend checks are skipped)",
    )
    parser.add_argument(
        "--rehearse",
        action="store_true",
        help="run every check a CPU can run, shrunk to seconds (local spec, no timing; the rows that "
        "need CUDA or TransformerEngine say why they were skipped): the GPU session's rehearsal",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the rows to PATH as JSON, after each check")
    return parser.parse_args(argv)


def timed_shapes(machine: Machine) -> list[TimedShape]:
    """``TIMED_SHAPES``, at ``LOCAL_SPEC_MICRO_BATCH`` on the local spec (named so in the table)."""
    if machine.te:
        return list(TIMED_SHAPES)
    return [
        dataclasses.replace(shape, name=f"{shape.name} mb{LOCAL_SPEC_MICRO_BATCH}", micro_batch=LOCAL_SPEC_MICRO_BATCH)
        for shape in TIMED_SHAPES
    ]


def check_groups(machine: Machine, skip_timing: bool, peak: float | None, world_size: int) -> Iterator[list[Row]]:
    """The rows of every check on ``machine``, one list per check as it ends: bf16, the routing
    kernels, FP8
    (TransformerEngine spec only; skipped rows with the local spec), speed and memory
    (``timed_shapes``, unless ``skip_timing``), the training legs."""
    for label in BF16_FAMILIES:
        yield guarded("bf16 vs fp32", functools.partial(check_bf16, label, TOLERANCES, machine))
    for label in KERNEL_CASES:
        yield guarded("triton vs torch", functools.partial(check_routing_kernels, label, TOLERANCES, machine))
    if machine.te:
        yield guarded("fp8", functools.partial(check_fp8, TOLERANCES, machine))
    else:
        yield skipped_fp8_rows("FP8 needs the TransformerEngine spec")
    if not skip_timing:
        for shape in timed_shapes(machine):
            yield guarded(f"speed {shape.name}", functools.partial(time_shape, shape, peak, machine))
    for lime in (True, False):  # last: the trainer re-initialises the parallel state
        yield guarded("training", functools.partial(training_rows, lime, TOLERANCES, world_size, machine))


def all_checks(machine: Machine, skip_timing: bool, peak: float | None, world_size: int) -> list[Row]:
    """Every row of :func:`check_groups`, in order."""
    return [row for group in check_groups(machine, skip_timing, peak, world_size) for row in group]


def write_json(path: str, header: dict, rows: list[Row]) -> None:
    """``header`` and ``rows`` (``Row.as_dict``) as one JSON object at ``path``, replaced whole."""
    with open(path + ".part", "w") as file:
        json.dump(dict(header, rows=[row.as_dict() for row in rows]), file, indent=1)
    os.replace(path + ".part", path)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available() and not args.rehearse:
        print("gpu_check: no CUDA GPU on this machine; nothing checked (--rehearse runs the CPU's part)", flush=True)
        return 2
    from lime_megatron.parallel.process_groups import initialize_parallel, launch_world_size

    initialize_parallel()
    name = "CPU rehearsal" if args.rehearse else torch.cuda.get_device_name()
    peak = args.peak_tflops or device_peak_tflops(name)
    platform = Platform(cuda=False) if args.rehearse else Platform.detect()
    machine = REHEARSAL if args.rehearse else Machine(te=args.spec == "transformer_engine")
    header = dict(device=name, spec=machine.transformer_impl, platform=platform.describe())
    print(
        f"gpu_check on {name} (bf16 peak {peak or 'unknown'} TFLOP/s), {machine.transformer_impl} spec; "
        f"{platform.describe()}",
        flush=True,
    )
    rows: list[Row] = []
    if machine.te and not platform.te:
        problem = f"TransformerEngine: {platform.te_problem} (--spec local checks without it)"
        rows.append(Row("setup", "-", problem, math.nan, math.inf, key="TransformerEngine"))
    else:
        for group in check_groups(machine, args.skip_timing or args.rehearse, peak, launch_world_size()):
            rows += group
            if args.json and torch.distributed.get_rank() == 0:
                write_json(args.json, header, rows)
    if args.json and torch.distributed.get_rank() == 0:
        write_json(args.json, header, rows)
    if torch.distributed.get_rank() != 0:
        return exit_code(rows)
    print(format_table(rows), flush=True)
    code = exit_code(rows)
    print("gpu_check: all tolerances met" if code == 0 else "gpu_check: a tolerance was missed (FAILED rows)")
    return code


if __name__ == "__main__":
    sys.exit(main())
