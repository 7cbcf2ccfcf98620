"""Timing each routing-kernel launch of a step and the bytes it must move: the bandwidth each kind
of launch reaches, against the device's (docs/routing.md, "Fused routing kernels (Triton)").

``bench/bench_lime_overhead.py --launch-profile`` reports it per setting: a kernel profile gives
one total per kernel name, this splits it by what a launch does (a mix with or without the
store, the sums or the weight gradient, the weight gradient alone) and sets its time against the
least memory it must read and write, so that a slow kind shows as a low rate.

On a GPU each launch is timed between two CUDA events on its stream (the device's time, no host
synchronisation inside the step); on a CPU (Triton's interpreter) by the host's clock, which
says nothing about a GPU.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass

import torch

from lime_megatron.kernels.operands import Launch, launches_observed


def launch_kind(launch: Launch) -> str:
    """What a launch does: ``weight grad`` alone, or ``mix`` with ``+store`` (a layer's own rows
    into the buffer), ``+sums`` (earlier partial sums added), ``+dW`` (the weight gradient's
    programs beside the mix's: a layer's or a block's backward)."""
    if launch.name != "mix_kernel":
        return "weight grad"
    named = launch.named_arguments()
    parts = ["mix"]
    parts += ["+store"] if named["HAS_STORE"] else []
    parts += ["+sums"] if named["HAS_ACC"] or named["HAS_MORE"] else []
    parts += ["+dW"] if named["WEIGHT_GRAD"] else []
    return " ".join(parts)


def moved_bytes(launch: Launch) -> int:
    """The least a launch reads and writes: each operand row once (``routing_kernels``: a row is
    2 x P positions x D elements), the router columns and the weight gradient's float32 sums."""
    named = launch.named_arguments()
    if launch.name != "mix_kernel":
        return _weight_grad_bytes(named["weight"], named["W_WIDTH"])
    out_rows, positions, _ = named["shape"]
    sources, own = named["a1"][-1], named["a2"][-1]
    rows = sources + own + out_rows * (1 + named["HAS_ACC"] + named["HAS_MORE"]) + own * named["HAS_STORE"]
    moved = rows * _row_bytes(named["out"][0], positions, named["WIDTH"])
    moved += out_rows * (sources + own) * named["a1"][0].element_size()
    if named["WEIGHT_GRAD"]:
        moved += _weight_grad_bytes(named["weight"], named["W_WIDTH"], kept=named["KEEP"])
    return moved


def _weight_grad_bytes(weight: tuple, width: int, kept: bool = False) -> int:
    """Bytes of ``G @ X^T`` (``routing_kernels.weight_grad_kernel``'s ``weight``): G's M rows and
    X's C rows read once, the float32 [M, C] sums written, with ``kept`` G's rows written again."""
    _, grads, m, _, c, (positions, _, _) = weight
    rows = m + c + (m if kept else 0)
    return rows * _row_bytes(grads[0], positions, width) + 4 * m * c


def _row_bytes(tensor: torch.Tensor, positions: int, width: int) -> int:
    return 2 * positions * width * tensor.element_size()


@dataclass
class LaunchKind:
    """The launches of one kind in a step: how many, their time and their bytes (``moved_bytes``)."""

    kind: str
    launches: int = 0
    seconds: float = 0.0
    moved: int = 0

    def as_row(self) -> dict:
        """The kind as a table row: launches, ms, GB moved, GB/s."""
        rate = self.moved / self.seconds / 1e9 if self.seconds else float("nan")
        return dict(kind=self.kind, launches=self.launches, ms=1e3 * self.seconds, gb=self.moved / 1e9, gb_per_s=rate)


class KernelLaunches:
    """Times every routing-kernel launch while active: ``with KernelLaunches() as launches: step``,
    then ``launches.kinds()``.  Only launches are observed: the rest of the step runs as it would."""

    def __init__(self):
        self._timed: list[tuple[str, int, object, object]] = []

    def __enter__(self) -> KernelLaunches:
        self._observing = launches_observed(self._time)
        self._observing.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._observing.__exit__(*exc)

    def _time(self, launch: Launch, run) -> None:
        if launch.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
        else:
            start = time.perf_counter()
            run()
            end = time.perf_counter()
        self._timed.append((launch_kind(launch), moved_bytes(launch), start, end))

    def kinds(self) -> list[dict]:
        """Per kind (most time first): ``LaunchKind.as_row``; waits for the device's events."""
        by_kind: dict[str, LaunchKind] = defaultdict(lambda: LaunchKind(""))
        for kind, moved, start, end in self._timed:
            entry = by_kind[kind]
            entry.kind, entry.launches, entry.moved = kind, entry.launches + 1, entry.moved + moved
            entry.seconds += _elapsed_s(start, end)
        return [entry.as_row() for entry in sorted(by_kind.values(), key=lambda e: e.seconds, reverse=True)]


def _elapsed_s(start, end) -> float:
    if isinstance(start, float):
        return end - start
    end.synchronize()
    return start.elapsed_time(end) / 1e3
