"""The NCCL-rules mode of the distributed harness (``tests/nccl_rules.py``) on small programs:
what NCCL deadlocks on is reported as a deadlock (with the pending operations), what it runs
passes, and messages are matched per communicator and peer in posting order, tags ignored."""

import pytest
import torch
from distributed import DistributedTestError, run_distributed


def _exchange(pattern: str) -> list:
    """Two ranks swap a tensor following ``pattern``; returns what each received."""
    dist = torch.distributed
    rank = dist.get_rank()
    peer = 1 - rank
    mine, theirs = torch.full((4,), float(rank)), torch.empty(4)
    if pattern == "facing sends":  # both post their send first: rendezvous sends face each other
        works = [dist.isend(mine, peer), dist.irecv(theirs, peer)]
    elif pattern == "even-odd":  # megatron's unbatched order
        works = [dist.isend(mine, peer), dist.irecv(theirs, peer)] if rank == 0 else \
            [dist.irecv(theirs, peer), dist.isend(mine, peer)]
    elif pattern == "batched":  # one batch progresses as a unit
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, mine, peer), dist.P2POp(dist.irecv, theirs, peer)])
    elif pattern in ("lazy group", "eager group"):  # rank 0's first use of a new group; rank 1 waits elsewhere
        group = dist.new_group([0, 1])
        if pattern == "eager group":
            dist.barrier(group=group)
        if rank == 0:
            works = dist.batch_isend_irecv([dist.P2POp(dist.isend, mine, peer, group),
                                            dist.P2POp(dist.isend, mine, peer)])
        else:
            dist.irecv(theirs, peer).wait()
            works = [dist.irecv(torch.empty(4), peer, group)]
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


@pytest.mark.parametrize("pattern", ["even-odd", "batched", "eager group", "same order"])
def test_orders_nccl_runs_pass(pattern):
    received = run_distributed(_exchange, 2, pattern, nccl_rules=True, timeout=60)
    assert received[1][0] in (0.0, 10.0), received  # rank 1 got rank 0's tensor through the emulated channel


@pytest.mark.parametrize("pattern", ["facing sends", "lazy group", "crossed communicators"])
def test_deadlocks_are_reported_with_the_pending_operations(pattern):
    with pytest.raises(DistributedTestError, match="NCCL rules: deadlock") as caught:
        run_distributed(_exchange, 2, pattern, nccl_rules=True, timeout=60)
    print(caught.value)
    assert "rank 0:" in str(caught.value) and "rank 1:" in str(caught.value)
    assert "blocked" in str(caught.value)


def test_the_same_orders_pass_over_plain_gloo():
    """Without the mode gloo buffers and matches by tag: the deadlocks above go unnoticed."""
    for pattern in ("facing sends", "crossed communicators"):
        run_distributed(_exchange, 2, pattern, timeout=60)


def test_messages_match_in_posting_order_with_tags_ignored():
    assert run_distributed(_tags_ignored, 2, nccl_rules=True, timeout=60)[1] == [1.0, 2.0]
    assert run_distributed(_tags_ignored, 2, timeout=60)[1] == [2.0, 1.0]  # gloo matches by tag
