"""Profiling a window of training iterations (``--profile``), as Megatron-LM does.

The window is Megatron-LM's: profiling starts once ``--profile-step-start`` iterations have
completed and stops after iteration ``--profile-step-end`` (10 and 12 profile the 11th and 12th
iterations), on the ranks of ``--profile-ranks`` (default rank 0).

- ``--use-pytorch-profiler``: ``torch.profiler`` records CPU activity (and CUDA kernels on a
  GPU) with shapes and writes a Chrome/TensorBoard trace ``rank<R>.iterations<A>-<B>.pt.trace.json``
  under ``--profile-dir`` (default ``--tensorboard-dir``), readable by chrome://tracing, Perfetto
  and TensorBoard's profiler plugin.
- otherwise (GPU only): ``cudaProfilerStart``/``Stop`` around the window and
  ``torch.autograd.profiler.emit_nvtx``, for ``nsys profile --capture-range=cudaProfilerApi``.

On a GPU every profiled iteration is also an NVTX range ``iteration N`` (``torch.cuda.nvtx``).
"""

from __future__ import annotations

import contextlib
import os

import torch

from lime_megatron.training.run_config import LoggingOptions


class IterationProfiler:
    """Starts and stops the profiler at iteration boundaries; ``with profiler.iteration(n):``
    wraps training iteration ``n`` (1-based). Use as a context manager: leaving it stops a
    profile the run did not finish."""

    def __init__(self, options: LoggingOptions, rank: int):
        self.options = options
        self.enabled = options.profile and rank in options.profile_ranks
        self.rank = rank
        self._torch_profiler: torch.profiler.profile | None = None
        self._nvtx: contextlib.AbstractContextManager | None = None
        self._first: int | None = None
        self._last: int | None = None
        self.trace_path: str | None = None
        """The trace written by ``--use-pytorch-profiler`` (once it stopped)."""

    def __enter__(self) -> IterationProfiler:
        return self

    def __exit__(self, *exc) -> None:
        self._stop()

    def _profiled(self, number: int) -> bool:
        return self.enabled and self.options.profile_step_start < number <= self.options.profile_step_end

    @contextlib.contextmanager
    def iteration(self, number: int):
        """Profile iteration ``number`` if it lies in the window."""
        if not self._profiled(number):
            yield
            return
        if self._first is None:
            self._start(number)
        self._last = number
        with self.range(f"iteration {number}"):
            yield
        if number == self.options.profile_step_end:
            self._stop()

    def range(self, name: str):
        """An NVTX range ``name`` while profiling on a GPU (nothing otherwise)."""
        if self._first is None or not torch.cuda.is_available():
            return contextlib.nullcontext()
        return torch.cuda.nvtx.range(name)

    def _start(self, number: int) -> None:
        self._first = number
        if self.options.use_pytorch_profiler:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._torch_profiler = torch.profiler.profile(activities=activities, record_shapes=True)
            self._torch_profiler.start()
        else:
            torch.cuda.cudart().cudaProfilerStart()
            self._nvtx = torch.autograd.profiler.emit_nvtx(record_shapes=True)
            self._nvtx.__enter__()

    def _stop(self) -> None:
        if self._first is None:
            return
        if self._torch_profiler is not None:
            self._torch_profiler.stop()
            os.makedirs(self.options.trace_dir, exist_ok=True)
            name = f"rank{self.rank}.iterations{self._first}-{self._last}.pt.trace.json"
            self.trace_path = os.path.join(self.options.trace_dir, name)
            self._torch_profiler.export_chrome_trace(self.trace_path)
            self._torch_profiler = None
        if self._nvtx is not None:
            self._nvtx.__exit__(None, None, None)
            torch.cuda.cudart().cudaProfilerStop()
            self._nvtx = None
        self._first = None
