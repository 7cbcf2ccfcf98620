"""Training metrics: console lines, TensorBoard, Weights & Biases and a JSON-lines file.

One :class:`IterationMetrics` per iteration goes to :meth:`MetricsLogger.log`, on the rank that
reports (the last one: it holds the last pipeline stage, where the loss is computed; losses are
already averaged over data-parallel ranks). Destinations:

- console: one line every ``--log-interval`` iterations (iteration, loss, learning rates,
  gradient norm; with ``--log-throughput`` also tokens/s and, on GPU, TFLOP/s per GPU and MFU),
  and every validation result;
- ``--metrics-file PATH``: one JSON object per iteration, appended (a resumed run continues the
  file): ``iteration``, ``lm_loss``, ``lr``, ``grad_norm``, ``tokens_per_sec``, plus
  ``router_lr``, ``tflops_per_gpu``, ``mfu``, ``validation_loss``/``validation_ppl`` when known,
  ``epoch`` (training examples consumed over the split's, with ``--sft``), ``evaluations`` (a dict
  of the trainer's evaluators' metrics at evaluations; flattened for TensorBoard and wandb);
- TensorBoard (``--tensorboard-dir``) and wandb (``--wandb-project``; ``--wandb-mode`` or
  ``$WANDB_MODE``: online, offline or disabled): every iteration's scalars.

Model FLOPs come from ``lime_megatron.planning.flops`` (router included); a training iteration counts 3x
the forward FLOPs (forward + backward, recomputation not counted). MFU is
relative to the dense bf16 peak of the GPU (``--gpu-peak-tflops``, or the table below).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass
from typing import Literal, cast

import torch

from lime_megatron.extras import requires_extra
from lime_megatron.training.run_config import LoggingOptions

PEAK_BF16_TFLOPS = {"H200": 989.4, "H100": 989.4, "A100": 312.0, "B200": 2250.0, "L40S": 362.1}
"""Dense bf16 tensor-core peak (TFLOP/s) by GPU name fragment, for MFU."""


@dataclass
class IterationMetrics:
    """What one iteration reports (None: not measured at this iteration)."""

    iteration: int
    lm_loss: float
    lr: float
    grad_norm: float
    tokens_per_sec: float
    router_lr: float | None = None
    tflops_per_gpu: float | None = None
    mfu: float | None = None
    loss_scale: float | None = None
    skipped: bool = False
    validation_loss: float | None = None
    validation_ppl: float | None = None
    epoch: float | None = None
    evaluations: dict[str, float] | None = None
    """Metrics of the trainer's evaluators (e.g. ``generation_accuracy/3``), at evaluations."""

    def as_dict(self) -> dict:
        """Non-None fields (``skipped`` only when True)."""
        return {key: value for key, value in asdict(self).items() if value is not None and (key != "skipped" or value)}


def gpu_peak_tflops(configured: float | None = None) -> float | None:
    """Dense bf16 peak of this GPU (``configured``: ``--gpu-peak-tflops``, else by device name);
    None on CPU or for an unknown GPU."""
    if not torch.cuda.is_available():
        return None
    if configured:
        return configured
    name = torch.cuda.get_device_name()
    return next((peak for key, peak in PEAK_BF16_TFLOPS.items() if key in name), None)


def perplexity(loss: float) -> float:
    """exp(loss), inf on overflow."""
    return math.exp(loss) if loss < 700 else math.inf


class MetricsLogger:
    """Sends :class:`IterationMetrics` to the console and the configured sinks (on the
    reporting rank only; other ranks' loggers do nothing)."""

    def __init__(
        self, options: LoggingOptions, train_iters: int, reporting: bool, name: str, run_options: dict | None = None
    ):
        """``options``: the sinks; ``run_options``: every option of the run, for wandb's config."""
        self.options = options
        self.train_iters = train_iters
        self.reporting = reporting
        self._file = self._tensorboard = self._wandb = None
        if not reporting:
            return
        if options.metrics_file:
            os.makedirs(os.path.dirname(os.path.abspath(options.metrics_file)), exist_ok=True)
            self._file = open(options.metrics_file, "a", encoding="utf-8")
        if options.tensorboard_dir:
            with requires_extra("logging"):
                from torch.utils.tensorboard import SummaryWriter

            self._tensorboard = SummaryWriter(log_dir=options.tensorboard_dir)
        if options.wandb_project:
            self._wandb = _start_wandb(options, name, run_options or {})

    def log(self, metrics: IterationMetrics) -> None:
        """Record one iteration."""
        if not self.reporting:
            return
        record = metrics.as_dict()
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        scalars = {key: value for key, value in record.items() if key not in ("iteration", "evaluations")}
        scalars.update(record.get("evaluations", {}))
        if self._tensorboard is not None:
            for key, value in scalars.items():
                self._tensorboard.add_scalar(key, float(value), metrics.iteration)
        if self._wandb is not None:
            self._wandb.log(scalars, step=metrics.iteration)
        if metrics.iteration % self.options.log_interval == 0:
            print(console_line(metrics, self.train_iters, self.options.log_throughput), flush=True)
        if metrics.evaluations:
            print(
                f" evaluations at iteration {metrics.iteration}: "
                + " | ".join(f"{name} {value:.4f}" for name, value in metrics.evaluations.items()),
                flush=True,
            )
        if metrics.validation_loss is not None:
            print(
                f" validation at iteration {metrics.iteration}: loss {metrics.validation_loss:.4f}"
                f" | ppl {metrics.validation_ppl:.3f}",
                flush=True,
            )

    def close(self) -> None:
        """Flush and close every sink."""
        if self._file is not None:
            self._file.close()
        if self._tensorboard is not None:
            self._tensorboard.close()
        if self._wandb is not None:
            self._wandb.finish()


def console_line(metrics: IterationMetrics, train_iters: int, throughput: bool = False) -> str:
    """The Megatron-style console line of one iteration; tokens/s, TFLOP/s per GPU and MFU only
    with ``throughput`` (``--log-throughput``, as in Megatron-LM)."""
    parts = [
        f" iteration {metrics.iteration:>7d}/{train_iters:>7d}",
        f"lm loss {metrics.lm_loss:.6E}",
        f"lr {metrics.lr:.3E}",
    ]
    if metrics.router_lr is not None:
        parts.append(f"router lr {metrics.router_lr:.3E}")
    parts.append(f"grad norm {metrics.grad_norm:.3f}")
    if throughput:
        parts.append(f"tokens/s {metrics.tokens_per_sec:,.0f}")
        if metrics.tflops_per_gpu is not None:
            parts.append(f"TFLOP/s/GPU {metrics.tflops_per_gpu:.1f}")
        if metrics.mfu is not None:
            parts.append(f"MFU {100 * metrics.mfu:.1f}%")
    if metrics.epoch is not None:
        parts.append(f"epoch {metrics.epoch:.2f}")
    if metrics.loss_scale is not None:
        parts.append(f"loss scale {metrics.loss_scale:.1f}")
    if metrics.skipped:
        parts.append("skipped (inf/nan gradients)")
    return " | ".join(parts)


def _start_wandb(options: LoggingOptions, name: str, run_options: dict):
    """A wandb run in ``--wandb-mode`` (default ``$WANDB_MODE``, else online)."""
    with requires_extra("logging"):
        import wandb

    # --wandb-mode's choices, or $WANDB_MODE unchecked (wandb.init refuses an unknown mode itself)
    mode = cast(Literal["online", "offline", "disabled"], options.wandb_mode or os.environ.get("WANDB_MODE", "online"))
    if options.wandb_save_dir:
        os.makedirs(options.wandb_save_dir, exist_ok=True)
    return wandb.init(
        project=options.wandb_project,
        name=options.wandb_exp_name or name,
        dir=options.wandb_save_dir,
        mode=mode,
        config=run_options,
        resume="allow",
    )
