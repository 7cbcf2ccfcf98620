"""Where a GPU step's device waits for its host: the idle gaps between its kernels, each charged to
the operator whose launch ended it, and the host calls that block until the device drains.

A step whose device time is below its wall time has gaps in which no kernel, copy or fill runs on
any stream.  In a step the device would otherwise run back to back, a gap closes when the host
queues the next work: the operator that queued it (the innermost one around the launch, e.g. an
ATen operator, ``RouteKeysValues`` or its backward node for a Triton launch) is what the device
waited for.  Gaps whose cause is a host call that waits for the device (a synchronisation, a copy
to pageable memory, ``cudaMalloc``/``cudaFree``) close after that call returns; those calls are
listed on their own (``blocking_calls``) with the operator around each.

Both read the events of one ``torch.profiler`` run with CPU and CUDA activity as its Chrome trace
gives them (``trace_events``: the format kineto has written for years, where the attributes of
``profiler.events()`` change between torch versions), by their category: CPU operators
(``cpu_op``), the device's work (``kernel``, ``gpu_memcpy``, ``gpu_memset``; not its
synchronisation or annotation ranges, which the trace also puts on the device) and the runtime's
and driver's calls (``cuda_runtime``, ``cuda_driver``), each of the last two with the ``External
id`` of the operator around its launch.  On a CPU there is no device work and no CUDA call: both
are empty.  ``bench/bench_lime_overhead.py --kernel-profile N --idle-profile`` reports both,
LIMe's beside the baseline's; the GPU session's 1B step runs it.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

NO_OPERATOR = "(no operator)"
"""The name charged where a launch or call ran outside any profiled operator."""

BLOCKING_CALLS = frozenset(
    {
        "cudaDeviceSynchronize",
        "cudaStreamSynchronize",
        "cudaEventSynchronize",
        "cuCtxSynchronize",
        "cuStreamSynchronize",
        "cuEventSynchronize",
        "cudaMemcpy",
        "cudaMalloc",
        "cudaFree",
        "cudaMallocHost",
        "cudaHostAlloc",
        "cudaFreeHost",
        "cuModuleLoadData",
    }
)
"""Runtime and driver calls after which the host resumes only when the device has drained (or the
call itself takes the host's time: an allocation, loading a compiled kernel)."""

Totals = dict[str, tuple[float, int]]
"""Milliseconds and occurrences by name, as ``bench_lime_overhead.ProfiledTimes``."""


@dataclass(frozen=True)
class DeviceWork:
    """One kernel, copy or fill on the device, microseconds from the profile's start, and the
    operator whose launch queued it."""

    start_us: float
    end_us: float
    operator: str


DEVICE_WORK = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
"""The trace categories of work the device runs."""

HOST_CALLS = frozenset({"cuda_runtime", "cuda_driver"})
"""The trace categories of the host's calls into CUDA."""

TraceEvent = dict[str, Any]
"""One event of a Chrome trace: ``name``, ``cat``, ``ts`` and ``dur`` (microseconds), ``args``."""


def trace_events(profiler) -> list[TraceEvent]:
    """The events of a finished ``torch.profiler.profile``'s Chrome trace."""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "trace.json")
        profiler.export_chrome_trace(path)
        with open(path) as file:
            return json.load(file)["traceEvents"]


def operator_names(events: Iterable[TraceEvent]) -> dict[int, str]:
    """The CPU operators' names by their external id."""
    return {
        event["args"]["External id"]: event["name"]
        for event in events
        if event.get("cat") == "cpu_op" and "External id" in event.get("args", {})
    }


def device_work(events: list[TraceEvent]) -> list[DeviceWork]:
    """The device's kernels, copies and fills of ``events``, in start order."""
    operators = operator_names(events)
    work = [
        DeviceWork(event["ts"], event["ts"] + event["dur"], _operator_of(event, operators))
        for event in events
        if event.get("cat") in DEVICE_WORK
    ]
    return sorted(work, key=lambda item: item.start_us)


def idle_gaps(work: list[DeviceWork]) -> Totals:
    """Per operator, the milliseconds the device sat idle (no work on any stream) before work it
    queued, and the number of such gaps: between the first work's start and the last's end, so the
    step's start and end are not counted."""
    gaps: Totals = {}
    busy_until = work[0].end_us if work else 0.0
    for item in work[1:]:
        if item.start_us > busy_until:
            ms, count = gaps.get(item.operator, (0.0, 0))
            gaps[item.operator] = (ms + (item.start_us - busy_until) / 1e3, count + 1)
        busy_until = max(busy_until, item.end_us)
    return gaps


def blocking_calls(events: list[TraceEvent]) -> Totals:
    """Per ``call in operator`` (``BLOCKING_CALLS``), the host's milliseconds in it and its calls."""
    operators = operator_names(events)
    calls: Totals = {}
    for event in events:
        if event.get("cat") not in HOST_CALLS or event["name"] not in BLOCKING_CALLS:
            continue
        name = f"{event['name']} in {_operator_of(event, operators)}"
        ms, count = calls.get(name, (0.0, 0))
        calls[name] = (ms + event["dur"] / 1e3, count + 1)
    return calls


def _operator_of(event: TraceEvent, operators: dict[int, str]) -> str:
    """The name of the operator around ``event``'s launch or call."""
    return operators.get(event.get("args", {}).get("External id"), NO_OPERATOR)
