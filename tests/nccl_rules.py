"""NCCL's point-to-point rules emulated over gloo, for the distributed test harness.

gloo buffers a send until its receive is posted and matches messages by tag, so code whose order
of point-to-point operations would deadlock (or mismatch) on NCCL passes over gloo.  This module
makes the ranks of :func:`distributed.run_distributed` (``nccl_rules=True``) follow NCCL's rules,
as strict as the worst case on a GPU (one hardware queue, ``CUDA_DEVICE_MAX_CONNECTIONS=1``):

1. **Matching per (communicator, peer) in posting order, tags ignored.**  The ``k``-th send of
   rank ``a`` to ``b`` on a communicator meets the ``k``-th receive of ``b`` from ``a`` on it,
   whatever their tags.  The data really moves by gloo, with the message's position on that
   channel as its gloo tag, so a mismatch in order delivers the wrong tensor (or fails on size)
   exactly as NCCL would.
2. **One queue per rank.**  Each rank's operations, on all its communicators, complete in the
   order it posted them: an operation progresses only at the head of its rank's queue, and a
   send and its receive complete together when both are at their heads (rendezvous: no
   buffering).  A blocked operation holds back everything posted after it.  Operations posted
   together by one ``batch_isend_irecv`` form one queue entry (one grouped kernel): each of them
   completes when its peer's operation is at the peer's head, and the entry leaves the queue
   when all of them did.
3. **Lazy communicators.**  A process group created by ``new_group`` is not ready until its
   first use, and that first use (a point-to-point operation or a ``barrier``) is a collective of
   all its members that blocks the calling thread, like ``ncclCommInitRank``.  The default group
   counts as ready (the harness initialises it with a collective).

How.  In every rank ``torch.distributed.isend``/``irecv``/``batch_isend_irecv``/``P2POp``/
``new_group``/``barrier`` are wrapped (:func:`install`).  A posted operation is handed to gloo at
once (so no transfer waits for Python) and announced to a coordinator thread in the launching
process, which keeps every rank's queue and applies rules 1-3; ``Work.wait()`` returns only once
the coordinator says the operation's queue entry completed, then waits for gloo.  Ranks tell the
coordinator when they block (in ``wait`` or a communicator's setup) and when they finish.  When
every rank still running is blocked and nothing can progress, that is a deadlock: the
coordinator sends every rank the list of each rank's pending operations (queue head first, the
operation each rank waits for marked), and the blocked ranks raise :class:`NcclRulesDeadlock`
with it, so the test fails within a second, never hangs.  A rank blocked in a gloo collective
is invisible to the coordinator; if ranks stay blocked ``STALL_S`` seconds without progress the
same report is sent as a stall.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch

STALL_S = 20.0
WORLD_GROUP_ID = 0


class NcclRulesDeadlock(RuntimeError):
    """The ranks' point-to-point operations cannot progress under NCCL's rules."""


# --------------------------------------------------------------------------- coordinator


@dataclass
class _Entry:
    """One queue entry of a rank: one operation, or the operations of one batch."""

    number: int
    ops: list  # (kind, group, src, dst, position, bytes)
    done: set = field(default_factory=set)


class Coordinator:
    """Applies the rules to the operations announced by ``world_size`` ranks (a thread in the
    launching process): ``inbox`` receives the ranks' messages, ``outboxes[rank]`` answers."""

    def __init__(self, world_size: int, inbox, outboxes):
        self.inbox, self.outboxes = inbox, outboxes
        self.queues = [deque() for _ in range(world_size)]
        self.state = ["running"] * world_size  # running | ("wait", entry) | ("init", group) | exited
        self.finished = [0] * world_size  # number of the last entry each rank completed (in order)
        self.inits: dict[int, set] = {}
        self.names: dict[int, str] = {WORLD_GROUP_ID: "WORLD"}
        self.last_progress = time.monotonic()
        self.reported = False
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                message = self.inbox.get(timeout=0.2)
            except queue.Empty:
                self._check_stall()
                continue
            self._handle(*message)
            self._progress()
            self._check_deadlock()

    def _handle(self, kind: str, rank: int, *payload) -> None:
        if kind == "post":
            number, ops = payload
            self.queues[rank].append(_Entry(number, ops))
        elif kind == "wait":
            if payload[0] > self.finished[rank]:
                self.state[rank] = ("wait", payload[0])
        elif kind == "init":
            group, members, name = payload
            self.names[group] = name
            self.state[rank] = ("init", group)
            waiting = self.inits.setdefault(group, set())
            waiting.add(rank)
            if waiting >= set(members):
                for member in members:
                    self.state[member] = "running"
                    self.outboxes[member].put(("init_done", group))
                self.last_progress = time.monotonic()
        elif kind == "running":
            self.state[rank] = "running"
        elif kind == "exit":
            self.state[rank] = "exited"

    def _head(self, rank: int) -> _Entry | None:
        return self.queues[rank][0] if self.queues[rank] else None

    def _progress(self) -> None:
        """Complete every operation whose partner is at its rank's head, pop finished entries."""
        changed = True
        while changed:
            changed = False
            for rank in range(len(self.queues)):
                head = self._head(rank)
                if head is None:
                    continue
                for index, (kind, group, src, dst, position, _) in enumerate(head.ops):
                    if index in head.done:
                        continue
                    peer = dst if kind == "send" else src
                    partner = self._head(peer)
                    other = "recv" if kind == "send" else "send"
                    match = None if partner is None else next(
                        (i for i, op in enumerate(partner.ops)
                         if op[:5] == (other, group, src, dst, position) and i not in partner.done), None)
                    if match is not None:
                        head.done.add(index)
                        partner.done.add(match)
                        changed = True
                for queue_rank in range(len(self.queues)):
                    while self._head(queue_rank) is not None and \
                            len(self._head(queue_rank).done) == len(self._head(queue_rank).ops):
                        finished = self.queues[queue_rank].popleft()
                        self.finished[queue_rank] = finished.number
                        self.outboxes[queue_rank].put(("done", finished.number))
                        if self.state[queue_rank] == ("wait", finished.number):
                            self.state[queue_rank] = "running"
                        self.last_progress = time.monotonic()
                        changed = True

    def _check_deadlock(self) -> None:
        blocked = [state for state in self.state if state != "exited"]
        if blocked and all(state != "running" for state in blocked):
            self._report("deadlock")

    def _check_stall(self) -> None:
        waiting = any(isinstance(state, tuple) for state in self.state)
        if waiting and time.monotonic() - self.last_progress > STALL_S:
            self._report(f"stall ({STALL_S:.0f} s without progress; a rank may sit in a gloo collective)")

    def _report(self, what: str) -> None:
        if self.reported:
            return
        self.reported = True
        text = describe(what, self.queues, self.state, self.names)
        for outbox in self.outboxes:
            outbox.put(("deadlock", text))


def describe(what: str, queues, state, names) -> str:
    """Each rank's state and pending operations, queue head first."""
    lines = [f"NCCL rules: {what}; pending point-to-point operations per rank (head first):"]
    for rank, entries in enumerate(queues):
        lines.append(f"  rank {rank}: {_state_text(state[rank], names)}")
        for entry in entries:
            ops = ", ".join(
                f"{kind} {'to' if kind == 'send' else 'from'} {dst if kind == 'send' else src} "
                f"on {names.get(group, f'group {group}')} #{position} ({size} B)"
                + (" [done]" if index in entry.done else "")
                for index, (kind, group, src, dst, position, size) in enumerate(entry.ops))
            lines.append(f"    entry {entry.number}: {ops}")
    return "\n".join(lines)


def _state_text(state, names) -> str:
    if isinstance(state, tuple) and state[0] == "init":
        return f"blocked creating communicator {names.get(state[1], state[1])}"
    if isinstance(state, tuple):
        return f"blocked waiting for entry {state[1]}"
    return state


# --------------------------------------------------------------------------- ranks


class _RankRules:
    """The wrappers' state in one rank."""

    def __init__(self, rank: int, outbox, inbox, originals: dict):
        self.rank, self.outbox, self.inbox, self.real = rank, outbox, inbox, originals
        self.group_ids: dict = {}
        self.group_count = 0
        self.ready = {WORLD_GROUP_ID}
        self.positions: dict[tuple, int] = {}
        self.entries = 0
        self.done: set = set()
        self.deadlock: str | None = None

    # bookkeeping ---------------------------------------------------------
    def group_id(self, group) -> int:
        if group is None or group is torch.distributed.group.WORLD:
            return WORLD_GROUP_ID
        return self.group_ids[id(group)]

    def new_group(self, *args, **kwargs):
        group = self.real["new_group"](*args, **kwargs)
        self.group_count += 1
        if group is not None and group is not torch.distributed.GroupMember.NON_GROUP_MEMBER:
            self.group_ids[id(group)] = self.group_count
        return group

    def _pump(self, block: bool) -> None:
        try:
            message = self.inbox.get(timeout=1.0) if block else self.inbox.get_nowait()
        except queue.Empty:
            return
        kind, value = message
        if kind == "done":
            self.done.add(value)
        elif kind == "init_done":
            self.ready.add(value)
        else:
            self.deadlock = value
        while True:  # drain what else arrived
            try:
                kind, value = self.inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "done":
                self.done.add(value)
            elif kind == "init_done":
                self.ready.add(value)
            else:
                self.deadlock = value

    def _block_until(self, ready, announce: tuple) -> None:
        self._pump(block=False)
        if ready():
            return
        self.outbox.put(announce)
        while not ready():
            if self.deadlock is not None:
                raise NcclRulesDeadlock(self.deadlock)
            self._pump(block=True)
        self.outbox.put(("running", self.rank))

    def ensure_ready(self, group) -> None:
        """A group's first use on this rank: the collective setup of its communicator."""
        gid = self.group_id(group)
        if gid in self.ready:
            return
        members = torch.distributed.get_process_group_ranks(group)
        self._block_until(lambda: gid in self.ready, ("init", self.rank, gid, members, f"group {gid} {members}"))

    # operations ----------------------------------------------------------
    def post(self, ops: list) -> list:
        """Post ``ops`` (``Op``) as one queue entry; their ``Work`` handles."""
        for op in ops:
            self.ensure_ready(op.group)
        self.entries += 1
        number, described, works = self.entries, [], []
        for op in ops:
            gid = self.group_id(op.group)
            src, dst = (self.rank, op.peer) if op.kind == "send" else (op.peer, self.rank)
            position = self.positions.get((gid, src, dst), 0)
            self.positions[gid, src, dst] = position + 1
            real = self.real["isend" if op.kind == "send" else "irecv"]
            works.append(_Work(self, number, real(op.tensor, op.peer, op.group, position)))
            described.append((op.kind, gid, src, dst, position, op.tensor.numel() * op.tensor.element_size()))
        self.outbox.put(("post", self.rank, number, described))
        return works

    def wait_entry(self, number: int) -> None:
        self._block_until(lambda: number in self.done, ("wait", self.rank, number))

    def barrier(self, *args, group=None, **kwargs):
        self.ensure_ready(group)
        return self.real["barrier"](*args, group=group, **kwargs)


class _Work:
    """Handle of one emulated operation: done when its queue entry completed and gloo finished."""

    def __init__(self, rules: _RankRules, entry: int, real):
        self.rules, self.entry, self.real = rules, entry, real

    def wait(self, *args, **kwargs) -> bool:
        self.rules.wait_entry(self.entry)
        return self.real.wait(*args, **kwargs)

    def is_completed(self) -> bool:
        self.rules._pump(block=False)
        return self.entry in self.rules.done and self.real.is_completed()


@dataclass
class Op:
    """Stand-in for ``torch.distributed.P2POp`` under the emulation."""

    op: object
    tensor: torch.Tensor
    peer: int | None = None
    group: object = None
    tag: int = 0
    group_peer: int | None = None

    @property
    def kind(self) -> str:
        return "send" if self.op in (_ACTIVE.isend, _ACTIVE.real["isend"]) else "recv"


class _Active:
    """The installed wrappers (module functions handed to ``P2POp`` compare against these)."""

    real: dict = {}
    isend = irecv = None


_ACTIVE = _Active()


def install(rank: int, outbox, inbox) -> _RankRules:
    """Wrap this rank's ``torch.distributed`` point-to-point API under NCCL's rules."""
    dist = torch.distributed
    names = ("isend", "irecv", "batch_isend_irecv", "P2POp", "new_group", "barrier")
    originals = {name: getattr(dist, name) for name in names}
    rules = _RankRules(rank, outbox, inbox, originals)

    def isend(tensor, dst=None, group=None, tag=0, **_):
        return rules.post([Op(isend, tensor, dst, group, tag)])[0]

    def irecv(tensor, src=None, group=None, tag=0, **_):
        return rules.post([Op(irecv, tensor, src, group, tag)])[0]

    def batch_isend_irecv(ops):
        return rules.post(list(ops))

    _ACTIVE.real, _ACTIVE.isend, _ACTIVE.irecv = originals, isend, irecv
    dist.isend, dist.irecv, dist.batch_isend_irecv, dist.P2POp = isend, irecv, batch_isend_irecv, Op
    dist.new_group, dist.barrier = rules.new_group, rules.barrier
    return rules


def announce_exit(rules: _RankRules) -> None:
    rules.outbox.put(("exit", rules.rank))
