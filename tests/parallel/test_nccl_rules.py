"""The NCCL-rules mode of the distributed harness (``lime_megatron.testing.nccl_rules``) on small programs:
what NCCL deadlocks on is reported as a deadlock (with the pending operations) while plain gloo
runs it, what NCCL runs passes, messages are matched per communicator and peer in posting order,
tags ignored, and a slow rank is never mistaken for a deadlock (slow: it sleeps 25 s)."""

import time

import pytest
import torch

from lime_megatron.testing.distributed import DistributedTestError, run_distributed

MODES = ("lazy", "eager")


def _exchange(pattern: str) -> list:
    """Two ranks swap a tensor following ``pattern``; returns what each received."""
    dist = torch.distributed
    rank = dist.get_rank()
    peer = 1 - rank
    mine, theirs = torch.full((4,), float(rank)), torch.empty(4)
    if pattern == "facing sends":  # both post their send first: rendezvous sends face each other
        works = [dist.isend(mine, peer), dist.irecv(theirs, peer)]
    elif pattern == "facing blocking sends":
        dist.send(mine, peer)
        dist.recv(theirs, peer)
        works = []
    elif pattern == "even-odd":  # megatron's unbatched order
        works = (
            [dist.isend(mine, peer), dist.irecv(theirs, peer)]
            if rank == 0
            else [dist.irecv(theirs, peer), dist.isend(mine, peer)]
        )
    elif pattern == "blocking even-odd":
        if rank == 0:
            dist.send(mine, peer)
        dist.recv(theirs, peer)
        if rank == 1:
            dist.send(mine, peer)
        works = []
    elif pattern == "batched":  # one batch progresses as a unit
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, mine, peer), dist.P2POp(dist.irecv, theirs, peer)])
    elif pattern in ("crossed communicators", "same order"):  # rank 0: group then WORLD
        group = dist.new_group([0, 1])
        dist.barrier(group=group)
        if rank == 0:
            works = [dist.isend(mine, peer, group), dist.isend(mine + 10, peer)]
        elif pattern == "crossed communicators":
            works = [dist.irecv(theirs, peer), dist.irecv(torch.empty(4), peer, group)]
        else:
            works = [dist.irecv(torch.empty(4), peer, group), dist.irecv(theirs, peer)]
    else:
        raise ValueError(pattern)
    for work in works:
        work.wait()
    return theirs.tolist()


def _unbatched_meets_batched() -> list:
    """Rank 0's first use of a fresh group is an unbatched send; rank 1 receives it in a batch.
    Lazily the send needs a 2-rank communicator that rank 1 never joins while rank 1 waits in the
    group communicator's setup for rank 0; eagerly both use the group's communicator."""
    dist = torch.distributed
    group = dist.new_group([0, 1])
    received = torch.zeros(2)
    if dist.get_rank() == 0:
        dist.isend(torch.ones(2), 1, group).wait()
    else:
        dist.batch_isend_irecv([dist.P2POp(dist.irecv, received, 0, group)])[0].wait()
    return received.tolist()


def _p2p_then_collective(coalesced: bool) -> float:
    """Rank 0 waits for rank 1's message, then all-reduces; rank 1 queues the all-reduce first
    (asynchronously, so gloo gets the message through; in a ``_coalescing_manager`` block, as
    megatron's DDP does, when ``coalesced``), then sends: with one queue per rank the send sits
    behind an all-reduce that waits for rank 0."""
    dist = torch.distributed
    value = torch.ones(1)
    if dist.get_rank() == 0:
        dist.irecv(torch.empty(1), 1).wait()
        dist.all_reduce(value)
        return value.item()
    if coalesced:
        with dist._coalescing_manager(async_ops=True) as reduced:
            dist.all_reduce(value)
    else:
        reduced = dist.all_reduce(value, async_op=True)
    dist.isend(torch.ones(1), 0).wait()
    reduced.wait()
    return value.item()


def _collectives_in_order() -> list:
    """Point-to-point messages and collectives (blocking, asynchronous, object, coalesced) in an
    order NCCL runs; returns what rank 1 received and the reduced values."""
    dist = torch.distributed
    rank = dist.get_rank()
    received, value = torch.zeros(1), torch.full((2,), float(rank + 1))
    if rank == 0:
        dist.isend(torch.full((1,), 7.0), 1).wait()
    else:
        dist.irecv(received, 0).wait()
    reduced = dist.all_reduce(value, async_op=True)
    gathered = [None, None]
    dist.all_gather_object(gathered, rank)
    reduced.wait()
    blocking, overlapped = torch.ones(1), torch.ones(1)
    with dist._coalescing_manager():
        dist.all_reduce(blocking)
    with dist._coalescing_manager(async_ops=True) as coalesced:
        dist.all_reduce(overlapped)
    coalesced.wait()
    dist.barrier()
    return [received.item(), *value.tolist(), *gathered, blocking.item(), overlapped.item()]


def _mismatched_collectives() -> None:
    """Rank 0 all-reduces where rank 1 broadcasts: the group's first collectives differ."""
    dist = torch.distributed
    if dist.get_rank() == 0:
        work = dist.all_reduce(torch.ones(1), async_op=True)
    else:
        work = dist.broadcast(torch.ones(1), 0, async_op=True)
    work.wait()


def _mixed_groups_in_one_batch() -> None:
    """Each rank batches a send on a new group with a receive on WORLD."""
    dist = torch.distributed
    group = dist.new_group([0, 1])
    peer = 1 - dist.get_rank()
    dist.batch_isend_irecv(
        [dist.P2POp(dist.isend, torch.ones(1), peer, group), dist.P2POp(dist.irecv, torch.empty(1), peer)]
    )


def _sizes_differ() -> None:
    """Rank 0 sends four elements, rank 1 receives eight."""
    dist = torch.distributed
    if dist.get_rank() == 0:
        dist.send(torch.ones(4), 1)
    else:
        dist.recv(torch.empty(8), 0)


def _tags_ignored() -> list:
    """Rank 0 sends 1 (tag 5) then 2 (tag 7); rank 1 receives tag 7 first: it gets 1."""
    dist = torch.distributed
    if dist.get_rank() == 0:  # both posted before either is waited for (gloo would block on the first)
        works = [dist.isend(torch.full((1,), value), 1, tag=tag) for value, tag in ((1.0, 5), (2.0, 7))]
        for work in works:
            work.wait()
        return []
    first, second = torch.empty(1), torch.empty(1)
    dist.irecv(first, 0, tag=7).wait()
    dist.irecv(second, 0, tag=5).wait()
    return [first.item(), second.item()]


def _slow_rank(sleep_s: float) -> float:
    """Rank 1 sleeps ``sleep_s`` before it sends and all-reduces; rank 0 waits for both."""
    dist = torch.distributed
    value = torch.ones(1)
    if dist.get_rank() == 1:
        time.sleep(sleep_s)
        dist.isend(torch.full((1,), 3.0), 0).wait()
    else:
        dist.irecv(value, 1).wait()
    dist.all_reduce(value)
    return value.item()


def _new_group_behind_a_wait() -> None:
    """Rank 0 creates a group before it sends; rank 1 waits for the message before creating it."""
    dist = torch.distributed
    if dist.get_rank() == 0:
        dist.new_group([0, 1])
        dist.isend(torch.ones(1), 1).wait()
    else:
        dist.irecv(torch.empty(1), 0).wait()
        dist.new_group([0, 1])


def _pair_deadlock_beside_a_busy_rank() -> None:
    """Ranks 0 and 1 face their blocking sends while rank 2 computes for a minute."""
    dist = torch.distributed
    if dist.get_rank() == 2:
        time.sleep(60)
        return
    dist.send(torch.ones(1), 1 - dist.get_rank())


def _assert_deadlock(fn, world_size: int, *args, mode="lazy") -> str:
    with pytest.raises(DistributedTestError, match="NCCL rules: deadlock") as caught:
        run_distributed(fn, world_size, *args, nccl_rules=mode, timeout=60)
    report = str(caught.value)
    print(report)
    assert "rank 0:" in report and "rank 1:" in report and "blocked" in report and "waits for ranks" in report
    return report


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("pattern", ["even-odd", "blocking even-odd", "batched", "same order"])
def test_orders_nccl_runs_pass(pattern, mode):
    received = run_distributed(_exchange, 2, pattern, nccl_rules=mode, timeout=60)
    assert received[1][0] in (0.0, 10.0), received  # rank 1 got rank 0's tensor through the emulated channel


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("pattern", ["facing sends", "facing blocking sends", "crossed communicators"])
def test_deadlocks_are_reported_with_the_pending_operations(pattern, mode):
    _assert_deadlock(_exchange, 2, pattern, mode=mode)


def test_the_same_orders_pass_over_plain_gloo():
    """Without the mode gloo buffers and matches by tag: the deadlocks above go unnoticed."""
    for pattern in ("facing sends", "crossed communicators"):
        run_distributed(_exchange, 2, pattern, timeout=60)


def test_facing_blocking_sends_only_time_out_over_plain_gloo():
    """Rule 3: gloo's blocking send waits for its receive too, but nothing says why the ranks hang;
    the mode reports the deadlock (above) instead of this timeout."""
    with pytest.raises(TimeoutError):
        run_distributed(_exchange, 2, "facing blocking sends", timeout=10)


def test_one_group_per_batch_as_torch_checks():
    """Rule 1: torch refuses a batch over two groups before the backend sees it, so plain gloo
    raises the same error; the mode must not let such a batch through."""
    for mode in (False, "lazy", "eager"):
        with pytest.raises(DistributedTestError, match="All ops need to use the same group"):
            run_distributed(_mixed_groups_in_one_batch, 2, nccl_rules=mode, timeout=60)


@pytest.mark.parametrize("coalesced", [False, True], ids=["all_reduce", "coalesced"])
def test_collectives_queue_behind_point_to_point(coalesced):
    """Rule 2: an all-reduce queued before a send holds the send back until every member has it
    at its head (plain gloo runs the all-reduce in the background and passes).  Eager
    communicators isolate the rule; lazily the ranks already block creating the two
    communicators (rank 0 WORLD's pair, rank 1 WORLD's own)."""
    report = _assert_deadlock(_p2p_then_collective, 2, coalesced, mode="eager")
    assert "all_reduce on WORLD [0, 1] #0" in report and "recv from 1 on WORLD [0, 1] #0" in report
    assert "creating communicator" in _assert_deadlock(_p2p_then_collective, 2, coalesced, mode="lazy")
    assert run_distributed(_p2p_then_collective, 2, coalesced, timeout=60) == [2.0, 2.0]


@pytest.mark.parametrize("mode", MODES)
def test_collectives_in_order_pass(mode):
    assert run_distributed(_collectives_in_order, 2, nccl_rules=mode, timeout=60)[1] == [7.0, 3.0, 3.0, 0, 1, 2.0, 2.0]


def test_mismatched_collectives_are_reported():
    with pytest.raises(DistributedTestError, match=r"collective mismatch on WORLD \[0, 1\] #0"):
        run_distributed(_mismatched_collectives, 2, nccl_rules=True, timeout=60)


def test_lazy_pair_communicator_deadlocks_where_eager_passes():
    """Rule 4: lazily, an unbatched send and a batched receive use different communicators, and
    each rank blocks in a setup the other never joins; eagerly (and on plain gloo) they meet."""
    report = _assert_deadlock(_unbatched_meets_batched, 2, mode="lazy")
    assert "blocked creating communicator" in report and "pair 0-1" in report
    assert run_distributed(_unbatched_meets_batched, 2, nccl_rules="eager", timeout=60)[1] == [1.0, 1.0]
    assert run_distributed(_unbatched_meets_batched, 2, timeout=60)[1] == [1.0, 1.0]


def test_a_cycle_is_reported_while_another_rank_still_runs():
    """Rule 5: ranks 0 and 1 deadlock while rank 2 sleeps a minute; the cycle is reported at once,
    with rank 2 still running (not once every rank is blocked, nor by a timer)."""
    report = _assert_deadlock(_pair_deadlock_beside_a_busy_rank, 3)
    assert "rank 2: running" in report


def test_a_rank_inside_new_group_is_seen():
    """Rule 5: ``new_group`` blocks its members until all called it (gloo connects them there, and
    so does NCCL with a ``device_id``), so the wait for a message that comes after it is a cycle;
    plain gloo hangs on this pattern without a word."""
    assert "blocked creating new_group [0, 1] (call 1)" in _assert_deadlock(_new_group_behind_a_wait, 2, mode="eager")


@pytest.mark.slow
def test_a_slow_rank_is_not_a_deadlock():
    """Rule 5: no timer; a rank that takes 25 s (longer than the 20 s stall limit the mode once
    had) before posting passes.  In the slow suite: 25 s of sleep."""
    assert run_distributed(_slow_rank, 2, 25.0, nccl_rules=True, timeout=120) == [4.0, 4.0]


@pytest.mark.parametrize("mode", MODES)
def test_a_send_meeting_a_receive_of_another_size_is_reported(mode):
    """Rule 4: the matched pair names both operations (NCCL fails or truncates there)."""
    with pytest.raises(
        DistributedTestError,
        match=r"size mismatch: rank 0's send to 1 .*\(16 B\).* recv from 0 .*"
        r"\(32 B\)",
    ):
        run_distributed(_sizes_differ, 2, nccl_rules=mode, timeout=60)


def test_messages_match_in_posting_order_with_tags_ignored():
    assert run_distributed(_tags_ignored, 2, nccl_rules=True, timeout=60)[1] == [1.0, 2.0]
    assert run_distributed(_tags_ignored, 2, timeout=60)[1] == [2.0, 1.0]  # gloo matches by tag


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="nccl_rules must be"):
        run_distributed(_tags_ignored, 2, nccl_rules="sometimes")
