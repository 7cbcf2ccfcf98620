"""lime_megatron.planning.schedule_model: megatron's schedule order, the closed-form bubbles with free
transfer, two timelines worked by hand, and the work derived from a model config."""

from __future__ import annotations

import pytest
import torch
from megatron.core.pipeline_parallel.schedules import get_schedule_table

from lime_megatron.models.config import lime_config, pipeline_layer_split
from lime_megatron.parallel.pipeline import exact_stage_width
from lime_megatron.planning import flops
from lime_megatron.planning.activations import Geometry
from lime_megatron.planning.schedule_model import (
    Link,
    Operation,
    PipelineWork,
    hop_bytes,
    pipeline_work,
    rank_operations,
    simulate,
    step_time,
)

BYTE_PER_NS = Link("one byte per ns", bandwidth_gbps=8.0, latency_us=0.0)


def uniform(pp: int, vpp: int, m: int, forward: float = 1.0, backward: float = 2.0, hop: int = 0) -> PipelineWork:
    """Every chunk the same: a rank's forward + backward of one microbatch takes 3 s in all."""
    stages = pp * vpp
    return PipelineWork(pp, vpp, m, pp, (forward / vpp,) * stages, (backward / vpp,) * stages, (hop,) * (stages - 1))


@pytest.mark.parametrize("pp,m", [(2, 2), (2, 5), (4, 4), (4, 8), (8, 16)])
def test_one_f_one_b_bubble_is_p_minus_1_over_m(pp, m):
    work = uniform(pp, 1, m)
    assert simulate(work, None, overlap=True) == pytest.approx((m + pp - 1) * 3.0, rel=1e-12)
    assert step_time(work, BYTE_PER_NS).bubble == pytest.approx((pp - 1) / m, rel=1e-12)


@pytest.mark.parametrize("pp,vpp,m", [(2, 2, 2), (2, 2, 4), (4, 2, 8), (4, 4, 8), (4, 2, 12), (8, 2, 16), (4, 4, 16)])
def test_interleaved_bubble_is_p_minus_1_over_v_m(pp, vpp, m):
    work = uniform(pp, vpp, m)
    assert step_time(work, BYTE_PER_NS).bubble == pytest.approx((pp - 1) / (vpp * m), rel=1e-12)


def test_rank_operations_follow_megatron():
    """1F1B: p - r - 1 warm-up forwards; interleaved: megatron's table, backwards on the chunks
    in reverse, warm-up 2(p - r - 1) + (v - 1) * group."""
    f, b = (lambda c, i: Operation(True, c, i)), (lambda c, i: Operation(False, c, i))
    assert rank_operations(3, 1, 0, 4, 3) == [f(0, 0), f(0, 1), f(0, 2), b(0, 0), f(0, 3), b(0, 1), b(0, 2), b(0, 3)]
    assert rank_operations(3, 1, 2, 2, 3) == [f(0, 0), b(0, 0), f(0, 1), b(0, 1)]
    table = get_schedule_table(4, 2, 2)
    rank1 = rank_operations(2, 2, 1, 4, 2)
    assert [(op.microbatch, op.chunk) for op in rank1 if op.forward] == table
    assert [(op.microbatch, 1 - op.chunk) for op in rank1 if not op.forward] == table
    assert [op.forward for op in rank1[:4]] == [True, True, True, False]  # warm-up (2 - 1) * 2
    with pytest.raises(ValueError, match="microbatch_group_size_per_vp_stage=2 <= num_microbatches=1"):
        rank_operations(2, 2, 0, 1, 2)


def test_one_f_one_b_by_hand():
    """p = 2, m = 2; forward 1 s, backward 2 s per stage; each hop 0.5 s (5e8 bytes at 1 byte/ns).

    Overlapped (the sender computes on):
        rank 0: F0 0-1 (sent 1-1.5), F1 1-2 (sent 2-2.5), B0 waits for rank 1's gradient: 5-7,
                B1 8-10
        rank 1: F0 1.5-2.5, B0 2.5-4.5 (sent 4.5-5), F1 4.5-5.5, B1 5.5-7.5 (sent 7.5-8)
        -> 10 s; free transfer: 9 s = (m + p - 1) * 3; exposed 1 s.
    Blocking (the sender waits for its send):
        rank 0: F0 0-1, send until 1.5, F1 1.5-2.5, send until 3, B0 5-7, B1 8.5-10.5
        rank 1: F0 1.5-2.5, B0 2.5-4.5, send until 5, F1 5-6, B1 6-8, send until 8.5
        -> 10.5 s.
    """
    work = uniform(2, 1, 2, hop=500_000_000)
    times = step_time(work, BYTE_PER_NS)
    assert (times.iteration_s, times.blocking_s, times.free_s, times.compute_s) == pytest.approx((10, 10.5, 9, 6))
    assert times.exposed_s == pytest.approx(1.0)
    assert times.exposed_blocking_s == pytest.approx(1.5)


def test_interleaved_by_hand():
    """p = 2, v = 2, m = 2 (one group of 2); every chunk: forward 1 s, backward 2 s. Stages
    q0 = rank 0 chunk 0, q1 = rank 1 chunk 0, q2 = rank 0 chunk 1, q3 = rank 1 chunk 1.
    Rank 0 warms up min(4, 2 + 2) = 4 forwards, rank 1 min(4, 2) = 2.

    Free transfer:
        rank 0: F q0 m0 0-1, F q0 m1 1-2, F q2 m0 2-3, F q2 m1 3-4, B q2 m0 6-8, B q2 m1 9-11,
                B q0 m0 11-13, B q0 m1 13-15
        rank 1: F q1 m0 1-2, F q1 m1 2-3, F q3 m0 3-4, B q3 m0 4-6, F q3 m1 6-7, B q3 m1 7-9,
                B q1 m0 9-11, B q1 m1 11-13
        -> 15 s against 12 s of compute per rank: bubble 1/4 = (p - 1)/(v m).
    With every hop 1 s, overlapped (links: rank 0 -> 1 carries q0 -> q1 and q2 -> q3, rank 1 -> 0
    carries q1 -> q2; backwards the reverse), "(to t)" is the arrival:
        rank 0: F q0 m0 0-1 (to 2), F q0 m1 1-2 (link busy until 2: to 3), F q2 m0 4-5 (to 6),
                F q2 m1 5-6 (to 7), B q2 m0 10-12 (to 13), B q2 m1 13-15 (to 16), B q0 m0 16-18,
                B q0 m1 19-21
        rank 1: F q1 m0 2-3 (to 4), F q1 m1 3-4 (to 5), F q3 m0 6-7, B q3 m0 7-9 (to 10),
                F q3 m1 9-10, B q3 m1 10-12 (to 13), B q1 m0 13-15 (to 16), B q1 m1 16-18 (to 19)
        -> 21 s: 6 s exposed, the six hops on microbatch 1's path.
    """
    times = step_time(uniform(2, 2, 2, forward=2.0, backward=4.0), BYTE_PER_NS)
    assert (times.free_s, times.compute_s, times.bubble) == pytest.approx((15, 12, 0.25))
    hops = step_time(uniform(2, 2, 2, forward=2.0, backward=4.0, hop=1_000_000_000), BYTE_PER_NS)
    assert (hops.free_s, hops.iteration_s, hops.exposed_s) == pytest.approx((15, 21, 6))


def test_work_of_a_lime_layout_uses_its_flops_and_exact_hop_widths():
    config = lime_config(
        num_layers=8,
        hidden_size=64,
        ffn_hidden_size=96,
        num_attention_heads=4,
        pipeline_model_parallel_size=2,
        virtual_pipeline_model_parallel_size=2,
        pipeline_dtype=torch.float32,
        use_cpu_initialization=True,
    )
    work = pipeline_work(
        config, vocab_size=128, seq_length=32, micro_batch_size=2, num_microbatches=4, compute_tflops=1e-6
    )
    tokens, per_second = 32 * 2, 1e6
    assert sum(work.forward_s) == pytest.approx(tokens * flops.forward_flops_per_token(config, 32, 128) / per_second)
    assert work.backward_s == pytest.approx(tuple(2 * f for f in work.forward_s))
    split = pipeline_layer_split(config)
    boundaries = [split[0, 0].stop, split[1, 0].stop, split[0, 1].stop]  # 2, 4, 6
    assert boundaries == [2, 4, 6]
    assert work.hop_bytes == tuple(32 * 2 * exact_stage_width(config, b) * 4 for b in boundaries)
    geometry = Geometry.of(config, 32, 2, 128)
    # Full router, every row once per rank: the hop before layer 6 (into rank 1's second chunk)
    # carries the hidden state and layers 4-5's K/V rows; rank 1 holds layers 0-3 already.
    assert hop_bytes(config, 6, geometry) == 32 * 2 * 64 * 4 + 2 * geometry.kv_rows


def test_bad_input_fails_with_one_clear_message():
    with pytest.raises(ValueError, match="link bandwidth must be positive"):
        Link("no link", 0.0, 1.0)
    config = lime_config(num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4)
    with pytest.raises(ValueError, match="compute_tflops must be positive, got -1"):
        pipeline_work(config, vocab_size=128, seq_length=32, micro_batch_size=2, num_microbatches=4, compute_tflops=-1)


def test_a_run_overlaps_its_transfers_only_in_the_interleaved_schedule():
    from types import SimpleNamespace

    from lime_megatron.planning.schedule_model import StepTime, overlaps_transfers

    def config(vpp, overlap):
        return SimpleNamespace(virtual_pipeline_model_parallel_size=vpp, overlap_p2p_comm=overlap)

    assert overlaps_transfers(config(2, True))
    assert not overlaps_transfers(config(2, False)) and not overlaps_transfers(config(None, True))
    times = StepTime(iteration_s=3.0, blocking_s=5.0, free_s=2.0, compute_s=1.0)
    assert times.as_run(True) == (3.0, 1.0) and times.as_run(False) == (5.0, 3.0)
