"""Where a GPU step's device waits (``testing.device_idle``): its idle gaps charged to the operator
whose launch ended each, and the host calls that wait for the device, on Chrome-trace events laid
out by hand as a GPU's profile writes them (CPU operators, runtime calls and device work with the
external id of the operator around their launch), and on a real CPU profile's trace, which has no
device work."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from lime_megatron.testing.device_idle import (
    NO_OPERATOR,
    blocking_calls,
    device_work,
    idle_gaps,
    operator_names,
    trace_events,
)

OPERATORS = {1: "aten::mm", 2: "RouteKeysValuesBackward", 3: "aten::item"}
"""The profile's CPU operators by external id."""


def event(name, start, end, category="cpu_op", external=None):
    """A Chrome-trace event as kineto writes it (``ts``/``dur`` in microseconds)."""
    args = {} if external is None else {"External id": external}
    return dict(ph="X", cat=category, name=name, ts=start, dur=end - start, args=args)


def kernel(name, start, end, operator, category="kernel"):
    return event(name, start, end, category, external=operator)


def profile_events():
    """A step: mm's kernel 0-100 us; an idle 30 us, then the Triton kernel of RouteKeysValuesBackward
    (130-200) overlapping a copy on another stream (150-260); item's copy back after 40 us idle
    (300-310), its cudaStreamSynchronize waiting 10 us; a fill launched outside any operator 10 us
    after; and what the trace puts on the device that is no work: an annotation range over all,
    the synchronisation's range; and a metadata event."""
    operators = [event(name, 0, 1, external=id) for id, name in OPERATORS.items()]
    return operators + [
        kernel("gemm", 0, 100, 1),
        kernel("mix_kernel", 130, 200, 2),
        kernel("Memcpy DtoD", 150, 260, 2, "gpu_memcpy"),
        kernel("Memcpy DtoH", 300, 310, 3, "gpu_memcpy"),
        kernel("fill", 320, 330, 99, "gpu_memset"),
        event("cuLaunchKernel", 129, 130, "cuda_driver", external=2),
        event("cudaStreamSynchronize", 300, 310, "cuda_runtime", external=3),
        event("cudaMalloc", 310, 315, "cuda_runtime"),
        event("ProfilerStep", 0, 330, "gpu_user_annotation"),
        event("Stream Sync", 260, 310, "cuda_sync", external=3),
        dict(ph="M", name="process_name", ts=0, pid=1, tid=0, args=dict(name="python")),
    ]


def test_gaps_are_charged_to_the_operator_whose_work_ended_them():
    work = device_work(profile_events())
    assert [item.start_us for item in work] == [0, 130, 150, 300, 320]
    gaps = idle_gaps(work)
    assert gaps.keys() == {"RouteKeysValuesBackward", "aten::item", NO_OPERATOR}
    assert gaps["RouteKeysValuesBackward"] == pytest.approx((0.030, 1))
    assert gaps["aten::item"] == pytest.approx((0.040, 1))  # after the copy on the other stream ends
    assert gaps[NO_OPERATOR] == pytest.approx((0.010, 1))


def test_overlapping_work_leaves_no_gap_and_the_ends_are_not_idle():
    """Work that starts before earlier work ends (another stream, or queued back to back) leaves
    no gap, whichever of the two ends later; before the first and after the last nothing counts."""
    work = device_work([kernel("a", 10, 100, 1), kernel("b", 20, 50, 1), kernel("c", 60, 120, 2)])
    assert idle_gaps(work) == {}
    assert idle_gaps([]) == {}


def test_blocking_calls_name_the_operator_around_them():
    calls = blocking_calls(profile_events())
    assert calls == {
        "cudaStreamSynchronize in aten::item": pytest.approx((0.010, 1)),
        f"cudaMalloc in {NO_OPERATOR}": pytest.approx((0.005, 1)),
    }


def test_a_cpu_profile_has_no_device_work():
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        torch.randn(8, 8).matmul(torch.randn(8, 8)).sum()
    events = trace_events(profiler)
    assert "aten::mm" in operator_names(events).values()
    assert device_work(events) == [] and idle_gaps(device_work(events)) == {} and blocking_calls(events) == {}
