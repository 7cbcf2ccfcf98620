"""Which of megatron's fused kernels a run uses, decided in one place from the machine.

``resolve`` maps a ``Platform`` (CUDA or not, and which kernel libraries are importable) and the
run's transformer implementation and pipeline size to ``FusionChoices``: one ``Choice`` (on/off
and why) per megatron option.  ``arguments.transformer_config`` applies them to the run's
config and ``--dry-run`` prints them (its memory estimate reads the same config fields).

The options and what each needs (megatron-core 0.16.1 and 0.19.x):

- ``apply_rope_fusion``: TransformerEngine's fused RoPE kernel (``fused_apply_rotary_pos_emb``,
  sbhd).  LIMe rotates the routed keys after routing through the same megatron function
  (``LimeSelfAttention._rotate``), so the fused kernel applies there too; it saves only the
  frequencies for backward, so the routed-K/V drop of ``lime_megatron.models.lime.recompute`` is unchanged.
- ``bias_activation_fusion``: megatron's jit-fused SwiGLU (``bias_swiglu_impl``); pure torch,
  compiled on CUDA (the LLaMA architecture: SiLU with a gated linear unit).
- ``masked_softmax_fusion``: megatron's fused scale-mask-softmax of its local
  ``DotProductAttention``; needs the ``scaled_*_softmax_cuda`` extensions (apex or Megatron-LM's
  fused kernels).  TransformerEngine's attention fuses the softmax itself and ignores the flag.
- ``bias_dropout_fusion``: megatron's jit-fused bias-dropout-add; pure torch, on CUDA.
- ``gradient_accumulation_fusion``: weight gradients accumulated into ``main_grad`` inside the
  GEMM.  TransformerEngine's linear layers have the kernel (``fuse_wgrad_accumulation``), but
  GPTModel's output layer is megatron's ``ColumnParallelLinear``, which refuses the option
  without apex's ``fused_weight_gradient_mlp_cuda``: on only with both.
- ``deallocate_pipeline_outputs``: frees each sent stage tensor's data once it is sent (the
  schedule keeps only its autograd node); on for every pipeline run, CPU included.  LIMe's stage
  tensor is megatron's hidden state (its K/V rows travel on ``pipeline``'s side channel, and the
  backward hook on it reads only the incoming gradient), so it survives megatron's
  ``deallocate_output_tensor``.

CPU runs keep every fusion off: the kernels are CUDA-only, and CPU runs are the exactness
references.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
from dataclasses import dataclass, field

import torch

TRANSFORMER_ENGINE = "transformer_engine"


@dataclass(frozen=True)
class Platform:
    """What a run's machine offers: CUDA, TransformerEngine, apex's fused weight-gradient GEMM
    and megatron's fused softmax kernels (importable modules).  ``assumed``: not detected but
    the GPU machine a ``--dry-run`` on a CPU machine plans for."""

    cuda: bool
    te: bool = False
    fused_wgrad: bool = False
    softmax_kernels: bool = False
    assumed: bool = False
    te_problem: str = field(default="", compare=False)
    """Why TransformerEngine cannot be used here (its import error), empty when it can."""

    @classmethod
    def detect(cls) -> Platform:
        """This machine.  TransformerEngine is imported (``transformer_engine.pytorch``: a wheel
        without its CUDA libraries fails there, and megatron then fails on ``import megatron.core``);
        apex's and megatron's kernels are looked up, not imported."""
        te_problem = _import_problem("transformer_engine.pytorch")
        return cls(
            cuda=torch.cuda.is_available(),
            te=not te_problem,
            te_problem=te_problem,
            fused_wgrad=_importable("fused_weight_gradient_mlp_cuda"),
            softmax_kernels=_importable("scaled_upper_triang_masked_softmax_cuda")
            and _importable("scaled_masked_softmax_cuda"),
        )

    @classmethod
    def target_gpu(cls, transformer_impl: str) -> Platform:
        """The GPU machine a run with ``transformer_impl`` needs: CUDA, TransformerEngine for
        the ``transformer_engine`` implementation, no apex (its kernels are optional)."""
        return cls(cuda=True, te=transformer_impl == TRANSFORMER_ENGINE, assumed=True)

    def describe(self) -> str:
        """One line, e.g. ``CUDA, TransformerEngine, no apex wgrad GEMM, no fused softmax (assumed)``."""
        if not self.cuda:
            return "CPU"
        transformer_engine = (
            "TransformerEngine" if self.te or not self.te_problem else (f"TransformerEngine ({self.te_problem})")
        )
        parts = [
            "CUDA",
            _has(self.te, transformer_engine),
            _has(self.fused_wgrad, "apex wgrad GEMM"),
            _has(self.softmax_kernels, "fused softmax kernels"),
        ]
        return ", ".join(parts) + (" (assumed GPU machine of this --dry-run)" if self.assumed else "")


def _import_problem(module: str) -> str:
    """Empty if ``module`` imports, else one line: why it does not (any import-time error)."""
    try:
        importlib.import_module(module)
    except Exception as error:  # noqa: BLE001 - TE raises RuntimeError/OSError without CUDA libraries
        return f"cannot import {module}: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    return ""


def _importable(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _has(present: bool, name: str) -> str:
    return name if present else f"no {name}"


@dataclass(frozen=True)
class Choice:
    """One megatron option: on or off, and why."""

    on: bool
    reason: str


@dataclass(frozen=True)
class FusionChoices:
    """The megatron options ``resolve`` decides, each a ``Choice`` named as the config field."""

    apply_rope_fusion: Choice
    bias_activation_fusion: Choice
    masked_softmax_fusion: Choice
    bias_dropout_fusion: Choice
    gradient_accumulation_fusion: Choice
    deallocate_pipeline_outputs: Choice

    def config_fields(self) -> dict[str, bool]:
        """``{config field: on}`` for every option."""
        return {field.name: getattr(self, field.name).on for field in dataclasses.fields(self)}

    def apply(self, config):
        """Set the options on ``config`` (a built ``TransformerConfig``) and return it.

        Set after construction: megatron's ``__post_init__`` imports TransformerEngine to check
        ``apply_rope_fusion``, which a ``--dry-run`` planning for a GPU cannot do on a CPU
        machine; ``resolve`` checked the same conditions against its ``Platform``.
        """
        for name, on in self.config_fields().items():
            setattr(config, name, on)
        return config

    def describe(self) -> str:
        """One line per option: ``name  on|off  reason``."""
        width = max(len(field.name) for field in dataclasses.fields(self))
        return "\n".join(
            f"  {name:<{width}}  {'on ' if choice.on else 'off'}  {choice.reason}"
            for name, choice in ((f.name, getattr(self, f.name)) for f in dataclasses.fields(self))
        )


def resolve(platform: Platform, transformer_impl: str, pipeline_model_parallel_size: int) -> FusionChoices:
    """The fusion choices of a run of the LLaMA architecture (SwiGLU, RoPE, RMSNorm, no biases)
    with ``transformer_impl`` (``local`` or ``transformer_engine``) on ``platform``."""
    if transformer_impl not in ("local", TRANSFORMER_ENGINE):
        raise ValueError(f"unknown transformer_impl {transformer_impl!r}")
    te_layers = transformer_impl == TRANSFORMER_ENGINE
    pipeline = pipeline_model_parallel_size > 1
    deallocate = Choice(
        pipeline, "pipeline run: sent stage tensors freed after sending" if pipeline else "no pipeline parallelism"
    )
    if not platform.cuda:
        off = Choice(False, "CPU run: fused kernels are CUDA-only")
        return FusionChoices(off, off, off, off, off, deallocate)
    return FusionChoices(
        apply_rope_fusion=Choice(True, "TransformerEngine's fused RoPE (queries and routed keys)")
        if platform.te
        else Choice(False, "needs TransformerEngine (fused_apply_rotary_pos_emb)"),
        bias_activation_fusion=Choice(True, "megatron's jit-fused SwiGLU"),
        masked_softmax_fusion=_softmax_choice(platform, te_layers),
        bias_dropout_fusion=Choice(True, "megatron's jit-fused bias-dropout-add"),
        gradient_accumulation_fusion=_wgrad_choice(platform, te_layers),
        deallocate_pipeline_outputs=deallocate,
    )


def without_ddp(choices: FusionChoices) -> FusionChoices:
    """``choices`` for a model run without megatron's DDP (the GPU check, the benches): no
    gradient-accumulation fusion, whose kernels add into DDP's ``main_grad`` buffers."""
    return dataclasses.replace(choices, gradient_accumulation_fusion=Choice(False, "no DDP main_grad"))


def _softmax_choice(platform: Platform, te_layers: bool) -> Choice:
    if te_layers:
        return Choice(False, "TransformerEngine's attention fuses its softmax (flag unused)")
    if platform.softmax_kernels:
        return Choice(True, "megatron's fused scale-mask-softmax kernels (fp16/bf16 inputs)")
    return Choice(False, "needs the scaled_*_softmax_cuda extensions (apex / Megatron-LM fused kernels)")


def _wgrad_choice(platform: Platform, te_layers: bool) -> Choice:
    if not te_layers:
        return Choice(False, "only with TransformerEngine's linear layers")
    if not platform.te:
        return Choice(False, "needs TransformerEngine")
    if not platform.fused_wgrad:
        return Choice(False, "GPTModel's output layer needs apex's fused_weight_gradient_mlp_cuda")
    return Choice(True, "TransformerEngine's fused wgrad accumulation (apex GEMM for the output layer)")


def replace_config(config, **changes):
    """``dataclasses.replace`` for a config whose fusions ``FusionChoices.apply`` set: the copy is
    built with RoPE fusion off (megatron's ``__post_init__`` would import TransformerEngine to
    check it), then gets the original's value back unless ``changes`` sets it."""
    rope_fusion = changes.pop("apply_rope_fusion", config.apply_rope_fusion)
    copy = dataclasses.replace(config, apply_rope_fusion=False, **changes)
    copy.apply_rope_fusion = rope_fusion
    return copy


def run_platform(dry_run: bool, transformer_impl: str) -> Platform:
    """The platform a run resolves against: this machine, or for a ``--dry-run`` on a machine
    without CUDA the GPU machine the run needs (``Platform.target_gpu``)."""
    detected = Platform.detect()
    return Platform.target_gpu(transformer_impl) if dry_run and not detected.cuda else detected


def run_choices(run) -> FusionChoices:
    """The fusion choices of the run described by ``run`` (a ``run_config.RunConfig``)."""
    platform = run_platform(run.dry_run, run.model.transformer_impl)
    return resolve(platform, run.model.transformer_impl, run.parallel.pipeline_model_parallel_size)


def report(run) -> str:
    """The ``--dry-run`` section: platform and the choices, one per line."""
    platform = run_platform(run.dry_run, run.model.transformer_impl)
    return f"fused kernels on {platform.describe()}:\n{run_choices(run).describe()}"
