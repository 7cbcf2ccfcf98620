"""NCCL's communication rules emulated over gloo, for the distributed test harness.

gloo completes a posted send in the background whenever its receive comes, matches messages by
tag and runs each call on its own, so code whose order of operations would deadlock (or
mismatch) on NCCL passes over gloo.  This module makes the ranks of
:func:`distributed.run_distributed` (``nccl_rules=...``) follow NCCL's rules, as strict as the
worst case on a GPU (one hardware queue, ``CUDA_DEVICE_MAX_CONNECTIONS=1``), with communicators
as ``ProcessGroupNCCL`` uses them:

1. **One process group per batch.**  ``batch_isend_irecv`` runs torch's own check of its list
   (``ValueError: All ops need to use the same group.``) before anything else, as the real
   function does (plain gloo refuses the same list: torch checks before the backend).
2. **One queue per rank, point-to-point and collectives alike.**  Every operation is an entry of
   its rank's queue, in posting order, and progresses only at the head.  A send and its receive
   complete together when both are at their heads (rendezvous: no buffering); the operations of
   one ``batch_isend_irecv`` form one entry (one grouped kernel) that leaves the queue when each
   of them met its peer's operation at the peer's head.  A collective (``all_reduce``,
   ``all_gather*``, ``reduce_scatter*``, ``broadcast``, ``barrier``, the ``*_object``
   collectives, a ``_coalescing_manager`` block, ...) completes when every member of its group has
   it at its head; the members must call a group's collectives in the same order, and two
   different collectives meeting at the same position are reported (``NCCL rules: collective
   mismatch``).  Only then does
   a blocking collective run on gloo; an asynchronous one is handed to gloo at once and its
   handle's ``wait`` blocks on the entry, like a point-to-point handle's.
3. **Blocking ``send``/``recv``** are a post followed by a wait: two ranks that both start with a
   blocking send deadlock.  A receive from any source is refused, as NCCL refuses it.
4. **Communicators as ProcessGroupNCCL creates them**, matching messages per (communicator, peer)
   in posting order, tags ignored (the ``k``-th send of ``a`` to ``b`` on a communicator meets
   the ``k``-th receive of ``b`` from ``a`` on it, whatever their tags; the data really moves by
   gloo, tagged with its channel and position, so a mismatch in order delivers the wrong tensor,
   as on NCCL; a send that meets a receive of another size is reported at once, ``NCCL rules:
   size mismatch``, where NCCL fails or truncates).  Two modes, as ``init_process_group`` is called:

   - ``"lazy"`` (the default, ``nccl_rules=True``; no ``device_id`` bound, as
     ``lime_megatron.parallel.process_groups`` and most launchers initialise): a group's
     communicator is created at its first collective or batched point-to-point operation, an
     ``ncclCommInitRank`` of all its members that blocks each caller until all arrived; an
     unbatched ``isend``/``irecv`` between ``a`` and ``b`` uses a 2-rank communicator of its own
     per (group, pair), created the same way by ``a`` and ``b`` at their first unbatched operation
     with each other on that group.  Unbatched and batched messages of one group therefore travel
     on different communicators and never match each other.
   - ``"eager"`` (``device_id`` bound): every group's communicator exists from its creation on, and
     unbatched point-to-point operations reuse it (``pointToPoint``: "In eagerInit mode, reuse the
     parent comm.  Do not lazily create p2p communicators"), so no operation blocks on a setup.

   The default group is no exception: lazily its communicator too comes with its first use.  In
   both modes ``new_group`` blocks each member until all members called it: gloo connects them
   there (so the emulation cannot do otherwise; lazily NCCL would return at once, but the wait
   would hang over gloo all the same), and NCCL in eager mode creates the communicator there.
5. **Deadlock is a cycle of waits, found as soon as it closes.**  A rank blocked on an entry waits
   for the peers of the unfinished operations at its queue head (or the members that lack the
   head collective at theirs); a rank blocked in a communicator setup or ``new_group`` waits for
   the members that have not arrived; a rank that finished with nothing queued will never post
   again.  A blocked rank is stuck when it waits for a stuck rank or its waits close a cycle; the
   first stuck rank makes the coordinator send every rank the report (each rank's pending
   operations, queue head first, and what each blocked rank waits for), and the blocked ranks
   raise :class:`NcclRulesDeadlock` with it.  Every blocking point is visible to the coordinator,
   so no timer is involved and a slow or loaded machine cannot cause a report.

How.  In every rank the ``torch.distributed`` functions above (and ``P2POp``'s check, through
torch's own ``isend``/``irecv`` names) are replaced by wrappers (:func:`install`), in
``torch.distributed`` and wherever megatron, ``lime_megatron`` or ``torch.distributed`` bound them
by name at import (e.g. megatron's ``dist_all_gather_func``).  A wrapper announces each post,
wait and setup to a coordinator thread in the launching process (:class:`Coordinator`), which
keeps every rank's queue and applies the rules; ``Work.wait()`` returns once the coordinator says
the entry completed, then waits for gloo.  A collective called inside another wrapped call (the
``all_gather`` of ``all_gather_object``) is part of that call, not a second entry.

Not modelled: several queues per rank (``CUDA_DEVICE_MAX_CONNECTIONS > 1``, which only relaxes the
rules); the host not blocking in NCCL's ``wait`` or in a blocking collective (the emulation blocks
there, as the CPU tests read the data right after); ``new_group(use_local_synchronization=True)``
or groups created with a ``device_id`` of their own; the dtypes of matched operations; ranks that
are not blocked when a report goes out raise only at their next post or wait; collectives reached
only through the process group object's methods or ``torch.distributed._functional_collectives``
(a rank blocked in those is invisible and shows as the launch's timeout, not as a report).
"""

from __future__ import annotations

import contextlib
import inspect
import queue
import sys
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed import distributed_c10d as c10d

MODES = ("lazy", "eager")
P2P_NAMES = ("isend", "irecv", "send", "recv", "batch_isend_irecv")
COLLECTIVE_NAMES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "reduce_scatter",
    "_all_gather_base",
    "_reduce_scatter_base",
    "broadcast",
    "barrier",
    "reduce",
    "gather",
    "scatter",
    "all_to_all_single",
    "all_gather_object",
    "broadcast_object_list",
    "gather_object",
)
WRAPPED_NAMES = (*P2P_NAMES, *COLLECTIVE_NAMES, "new_group", "_coalescing_manager")
# Modules whose names bound to the wrapped functions at import are rebound to the wrappers.
REBOUND_PREFIXES = ("torch.distributed", "megatron", "lime_megatron")


class NcclRulesDeadlock(RuntimeError):
    """The ranks' operations cannot progress under NCCL's rules (or two collectives mismatch)."""


# --------------------------------------------------------------------------- operations


@dataclass(frozen=True)
class P2p:
    """One send or receive: ``position``-th message from ``src`` to ``dst`` on communicator ``comm``
    (``size`` in bytes, for the report)."""

    kind: str
    comm: str
    src: int
    dst: int
    position: int
    size: int

    @property
    def channel(self) -> tuple:
        """What a matching operation shares with this one: communicator, ends and position."""
        return self.comm, self.src, self.dst, self.position

    def peer(self, rank: int) -> int:
        return self.dst if rank == self.src else self.src

    def text(self) -> str:
        direction = f"to {self.dst}" if self.kind == "send" else f"from {self.src}"
        return f"{self.kind} {direction} on {self.comm} #{self.position} ({self.size} B)"


@dataclass(frozen=True)
class Collective:
    """The ``seq``-th collective ``name`` on communicator ``comm`` of global ranks ``members``."""

    comm: str
    name: str
    members: tuple
    seq: int

    def text(self) -> str:
        return f"{self.name} on {self.comm} #{self.seq}"


@dataclass
class _Entry:
    """One queue entry of a rank: an operation, the operations of one batch, or a collective;
    ``done`` holds the indices of the operations that completed."""

    number: int
    ops: list
    done: set = field(default_factory=set)

    @property
    def complete(self) -> bool:
        return len(self.done) == len(self.ops)


# --------------------------------------------------------------------------- coordinator


class Coordinator:
    """Applies the rules to the operations announced by ``world_size`` ranks (a thread in the
    launching process): ``inbox`` receives the ranks' messages, ``outboxes[rank]`` answers."""

    def __init__(self, world_size: int, inbox, outboxes):
        self.inbox, self.outboxes = inbox, outboxes
        self.queues: list[deque[_Entry]] = [deque() for _ in range(world_size)]
        self.state: list = ["running"] * world_size  # running | ("wait", n) | ("init", key) | exited
        self.finished = [0] * world_size  # number of the last entry each rank completed (in order)
        self.arrived: dict[str, set] = {}  # setup key -> ranks that reached it
        self.members: dict[str, tuple] = {}  # setup key -> ranks it needs
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
            self._arrive(rank, *payload)
        elif kind == "exit":
            self.state[rank] = "exited"

    def _arrive(self, rank: int, key: str, members: tuple) -> None:
        """``rank`` reached setup ``key``; release its members once all arrived."""
        self.members[key] = members
        arrived = self.arrived.setdefault(key, set())
        arrived.add(rank)
        self.state[rank] = ("init", key)
        if arrived >= set(members):
            for member in members:
                self.state[member] = "running"
                self.outboxes[member].put(("init_done", key))

    def _head(self, rank: int) -> _Entry | None:
        return self.queues[rank][0] if self.queues[rank] else None

    def _progress(self) -> None:
        """Complete every operation that meets its partners at their heads, pop finished entries."""
        changed = True
        while changed and not self.reported:
            changed = False
            for rank in range(len(self.queues)):
                head = self._head(rank)
                if head is not None:
                    changed |= self._match_head(rank, head)
            changed |= self._pop_finished()

    def _match_head(self, rank: int, head: _Entry) -> bool:
        if isinstance(head.ops[0], Collective):
            return self._match_collective(head.ops[0])
        matched = False
        for index, op in enumerate(head.ops):
            if index in head.done:
                continue
            partner = self._head(op.peer(rank))
            match = (
                None
                if partner is None
                else next(
                    (
                        i
                        for i, other in enumerate(partner.ops)
                        if i not in partner.done
                        and isinstance(other, P2p)
                        and other.channel == op.channel
                        and other.kind != op.kind
                    ),
                    None,
                )
            )
            if match is not None and partner.ops[match].size != op.size:
                self._report(
                    f"size mismatch: rank {rank}'s {op.text()} meets rank {op.peer(rank)}'s {partner.ops[match].text()}"
                )
                return False
            if match is not None:
                head.done.add(index)
                partner.done.add(match)
                matched = True
        return matched

    def _match_collective(self, collective: Collective) -> bool:
        """Complete ``collective`` if every member has it at its head; report a mismatch."""
        heads = [self._head(member) for member in collective.members]
        found = [head.ops[0] if head is not None else None for head in heads]
        same_slot = [
            op for op in found if isinstance(op, Collective) and (op.comm, op.seq) == (collective.comm, collective.seq)
        ]
        if any(op.name != collective.name for op in same_slot):
            names = {member: op.name for member, op in zip(collective.members, found) if op in same_slot}
            self._report(f"collective mismatch on {collective.comm} #{collective.seq}: {names}")
            return False
        if len(same_slot) < len(collective.members):
            return False
        for head in heads:
            head.done.add(0)
        return True

    def _pop_finished(self) -> bool:
        popped = False
        for rank, entries in enumerate(self.queues):
            while entries and entries[0].complete:
                finished = entries.popleft()
                self.finished[rank] = finished.number
                self.outboxes[rank].put(("done", finished.number))
                state = self.state[rank]
                if isinstance(state, tuple) and state[0] == "wait" and state[1] <= finished.number:
                    self.state[rank] = "running"
                popped = True
        return popped

    # wait-for graph -----------------------------------------------------
    def waits_for(self, rank: int) -> set | None:
        """The ranks a blocked or finished ``rank`` waits for; None when it finished with nothing
        queued (it will never post again); an empty set for a running rank."""
        state = self.state[rank]
        if isinstance(state, tuple) and state[0] == "init":
            return set(self.members[state[1]]) - self.arrived[state[1]]
        if state == "running":
            return set()
        head = self._head(rank)
        if head is None:
            return None if state == "exited" else set()
        if isinstance(head.ops[0], Collective):
            collective = head.ops[0]
            return {
                member
                for member in collective.members
                if self._head(member) is None or self._head(member).ops[0] != collective
            }
        return {op.peer(rank) for index, op in enumerate(head.ops) if index not in head.done}

    def stuck(self) -> set:
        """Ranks that can never progress: the blocked or finished ranks that wait for a finished
        rank with nothing queued or for a rank in a cycle of waits (any one of those suffices)."""
        edges = {rank: self.waits_for(rank) for rank, state in enumerate(self.state) if state != "running"}
        final = {rank for rank, targets in edges.items() if targets is None}
        edges = {rank: (targets or set()) & set(edges) for rank, targets in edges.items()}
        while True:  # drop ranks that wait only for ranks that may still act
            free = {rank for rank, targets in edges.items() if not targets and rank not in final}
            if not free:
                break
            edges = {rank: targets - free for rank, targets in edges.items() if rank not in free}
        return set(edges)

    def _check_deadlock(self) -> None:
        if any(self.state[rank] != "exited" for rank in self.stuck()):
            self._report("deadlock")

    def _report(self, what: str) -> None:
        if self.reported:
            return
        self.reported = True
        text = self.describe(what)
        for outbox in self.outboxes:
            outbox.put(("deadlock", text))

    def describe(self, what: str) -> str:
        """Each rank's state, what it waits for and its pending operations, queue head first."""
        lines = [f"NCCL rules: {what}; pending operations per rank (head first):"]
        for rank, entries in enumerate(self.queues):
            waits = self.waits_for(rank)
            waiting = f"; waits for ranks {sorted(waits)}" if waits else ""
            lines.append(f"  rank {rank}: {_state_text(self.state[rank])}{waiting}")
            for entry in entries:
                ops = ", ".join(
                    op.text() + (" [done]" if index in entry.done else "") for index, op in enumerate(entry.ops)
                )
                lines.append(f"    entry {entry.number}: {ops}")
        return "\n".join(lines)


def _state_text(state) -> str:
    if isinstance(state, tuple) and state[0] == "init":
        return f"blocked creating {state[1]}"
    if isinstance(state, tuple):
        return f"blocked waiting for entry {state[1]}"
    return state


# --------------------------------------------------------------------------- ranks


class _RankRules:
    """The wrappers' state in one rank: ``real`` holds torch's functions, ``mode`` is ``"lazy"`` or
    ``"eager"``, ``ready`` the setups this rank completed (communicators, ``new_group`` calls)."""

    def __init__(self, rank: int, mode: str, outbox, inbox, originals: dict):
        self.rank, self.mode, self.outbox, self.inbox, self.real = rank, mode, outbox, inbox, originals
        self.ready: set = set()
        self.positions: dict[tuple, int] = {}  # (comm, src, dst) -> messages posted
        self.sequences: dict[str, int] = {}  # comm -> collectives posted
        self.group_calls: dict[tuple, int] = {}  # members -> new_group calls with them
        self.entries = 0
        self.done: set = set()
        self.deadlock: str | None = None
        self.inside = False  # in a wrapped call: nested wrapped calls go straight to torch
        # the installed wrappers (P2POp.op compares against them)
        self.isend: Callable[..., Any] | None = None
        self.irecv: Callable[..., Any] | None = None

    # messages ------------------------------------------------------------
    def _take(self, message) -> None:
        kind, value = message
        if kind == "done":
            self.done.add(value)
        elif kind == "init_done":
            self.ready.add(value)
        else:
            self.deadlock = value

    def _pump(self, block: bool) -> None:
        """Take the coordinator's answers: wait up to a second for one when ``block``, then drain."""
        if block:
            try:
                self._take(self.inbox.get(timeout=1.0))
            except queue.Empty:
                return
        while True:
            try:
                self._take(self.inbox.get_nowait())
            except queue.Empty:
                return

    def _block_until(self, ready, announce: tuple) -> None:
        self._pump(block=False)
        if ready():
            return
        self.outbox.put(announce)
        while not ready():
            if self.deadlock is not None:
                raise NcclRulesDeadlock(self.deadlock)
            self._pump(block=True)

    def _call(self, real, *args, **kwargs):
        """Run torch's ``real`` with the wrappers passing nested calls straight through."""
        outer, self.inside = self.inside, True
        try:
            return real(*args, **kwargs)
        finally:
            self.inside = outer

    # communicators ------------------------------------------------------
    def setup(self, key: str, members) -> None:
        """Block until every one of ``members`` reached setup ``key`` (once per key)."""
        if key in self.ready or list(members) == [self.rank]:
            return
        self._block_until(lambda: key in self.ready, ("init", self.rank, key, tuple(members)))

    def group_comm(self, group) -> tuple[str, list]:
        """The name of ``group``'s own communicator and its members (global ranks); in lazy mode it
        is created (with all members) at this first use."""
        members = torch.distributed.get_process_group_ranks(group)
        comm = f"{_group_label(group)} {members}"
        if self.mode == "lazy":
            self.setup(f"communicator {comm}", members)
        return comm, members

    def p2p_comm(self, group, peer: int, batched: bool) -> tuple[str, int]:
        """The communicator of a point-to-point operation with global rank ``peer`` and its slot
        among the channels between two ranks of ``group`` (for distinct gloo tags)."""
        if batched or self.mode == "eager":
            return self.group_comm(group)[0], 0
        pair = tuple(sorted((self.rank, peer)))
        comm = f"{_group_label(group)} pair {pair[0]}-{pair[1]}"
        self.setup(f"communicator {comm}", pair)
        return comm, 1

    # operations ----------------------------------------------------------
    def post(self, ops: list) -> int:
        """Announce ``ops`` as one queue entry; its number."""
        if self.deadlock is not None:
            raise NcclRulesDeadlock(self.deadlock)
        self.entries += 1
        self.outbox.put(("post", self.rank, self.entries, ops))
        return self.entries

    def post_p2p(self, ops: list, batched: bool) -> list:
        """Post ``P2POp``s (one batch, or a single unbatched one); their handles."""
        comm, slot = self.p2p_comm(ops[0].group, ops[0].peer, batched)
        described, works = [], []
        for op in ops:
            kind = "send" if op.op is self.isend else "recv"
            src, dst = (self.rank, op.peer) if kind == "send" else (op.peer, self.rank)
            position = self.positions.get((comm, src, dst), 0)
            self.positions[comm, src, dst] = position + 1
            real = self.real["isend" if kind == "send" else "irecv"]
            size = op.tensor.numel() * op.tensor.element_size()
            works.append(self._call(real, op.tensor, op.peer, op.group, gloo_tag(position, slot, size)))
            described.append(P2p(kind, comm, src, dst, position, size))
        number = self.post(described)
        return [_Work(self, number, work) for work in works]

    def collective(self, name: str, group, async_op: bool, call):
        """Queue collective ``name`` on ``group`` and run ``call`` (torch's) on gloo: at once for an
        asynchronous one (its handle waits on the entry), after the entry completed otherwise."""
        group = c10d._get_default_group() if group is None else group
        if c10d._rank_not_in_group(group) or group in c10d._world.pg_coalesce_state:
            return call()  # torch warns and skips, or records the op for _coalescing_manager
        number = self.post_collective(name, group)
        if async_op:
            work = self._call(call)
            return work if work is None else _Work(self, number, work)
        self.wait_entry(number)
        return self._call(call)

    def post_collective(self, name: str, group) -> int:
        comm, members = self.group_comm(group)
        seq = self.sequences.get(comm, 0)
        self.sequences[comm] = seq + 1
        return self.post([Collective(comm, name, tuple(members), seq)])

    def wait_entry(self, number: int) -> None:
        self._block_until(lambda: number in self.done, ("wait", self.rank, number))

    def new_group(self, call, ranks) -> object:
        """``new_group``: blocks its members until all called it, then torch's."""
        members = tuple(sorted(range(torch.distributed.get_world_size()) if ranks is None else ranks))
        if self.rank in members:
            count = self.group_calls.get(members, 0) + 1
            self.group_calls[members] = count
            self.setup(f"new_group {list(members)} (call {count})", members)
        return self._call(call)


def gloo_tag(position: int, slot: int, size: int) -> int:
    """The gloo tag of the ``position``-th message of a channel (``slot``: unbatched or batched) of
    ``size`` bytes: a send and a receive of different sizes get different tags (but for one size
    pair in 4096), so gloo, which aborts the process on a size mismatch, never matches them and
    the coordinator's report (``NCCL rules: size mismatch``) is what the ranks see.  Below 2^31,
    as gloo's tags must be, for channels of up to 2^18 messages."""
    return (2 * position + slot) << 12 | (size * 2654435761 >> 7) & 0xFFF


def _group_label(group) -> str:
    return "WORLD" if group is c10d._get_default_group() else f"group {group.group_name}"


class _Work:
    """Handle of an emulated operation: done when its queue entry completed and gloo finished."""

    def __init__(self, rules: _RankRules, entry: int, real):
        self.rules, self.entry, self.real = rules, entry, real

    def wait(self, *args, **kwargs) -> bool:
        self.rules.wait_entry(self.entry)
        return self.real.wait(*args, **kwargs)

    def is_completed(self) -> bool:
        self.rules._pump(block=False)
        return self.entry in self.rules.done and self.real.is_completed()


# --------------------------------------------------------------------------- wrappers


def _p2p_wrappers(rules: _RankRules) -> dict:
    """``isend``/``irecv``/``send``/``recv``/``batch_isend_irecv`` under the rules."""
    P2POp = torch.distributed.P2POp

    def isend(tensor, dst=None, group=None, tag=0, group_dst=None):
        return rules.post_p2p([P2POp(isend, tensor, dst, group, tag, group_dst)], batched=False)[0]

    def irecv(tensor, src=None, group=None, tag=0, group_src=None):
        if src is None and group_src is None:
            raise RuntimeError("NCCL rules: NCCL does not support receiving from any source")
        return rules.post_p2p([P2POp(irecv, tensor, src, group, tag, group_src)], batched=False)[0]

    def send(tensor, dst=None, group=None, tag=0, group_dst=None):
        isend(tensor, dst, group, tag, group_dst).wait()

    def recv(tensor, src=None, group=None, tag=0, group_src=None):
        irecv(tensor, src, group, tag, group_src).wait()
        return src if src is not None else c10d.get_global_rank(c10d._group_or_default_group(group), group_src)

    def batch_isend_irecv(p2p_op_list):
        c10d._check_p2p_op_list(p2p_op_list)  # torch's own check: a list of P2POp, one group
        return rules.post_p2p(list(p2p_op_list), batched=True)

    rules.isend, rules.irecv = isend, irecv
    return dict(isend=isend, irecv=irecv, send=send, recv=recv, batch_isend_irecv=batch_isend_irecv)


def _collective_wrapper(rules: _RankRules, name: str):
    """``name`` under the rules: a queue entry of the calling rank (see :meth:`_RankRules.collective`)."""
    real = rules.real[name]
    signature = inspect.signature(real)

    def wrapper(*args, **kwargs):
        if rules.inside:
            return real(*args, **kwargs)
        arguments = signature.bind(*args, **kwargs).arguments
        return rules.collective(
            name, arguments.get("group"), arguments.get("async_op", False), lambda: real(*args, **kwargs)
        )

    wrapper.__name__ = wrapper.__qualname__ = name
    return wrapper


def _other_wrappers(rules: _RankRules) -> dict:
    """``new_group`` and ``_coalescing_manager`` under the rules."""
    real_new_group, real_coalescing = rules.real["new_group"], rules.real["_coalescing_manager"]
    signature = inspect.signature(real_new_group)

    def new_group(*args, **kwargs):
        ranks = signature.bind(*args, **kwargs).arguments.get("ranks")
        return rules.new_group(lambda: real_new_group(*args, **kwargs), ranks)

    @contextlib.contextmanager
    def _coalescing_manager(group=None, device=None, async_ops=False):
        """The block's collectives are one collective entry, posted as the block ends."""
        coalesced = c10d._get_default_group() if group is None else group
        number = None
        with real_coalescing(group, device, async_ops) as manager:
            yield manager
            recorded = c10d._world.pg_coalesce_state.get(coalesced)
            if recorded and not c10d._rank_not_in_group(coalesced):
                number = rules.post_collective(f"coalesced {recorded[0].op.__name__}", coalesced)
                if not async_ops:
                    rules.wait_entry(number)
        if number is not None and async_ops and manager.works:
            manager.works[-1] = _Work(rules, number, manager.works[-1])

    return dict(new_group=new_group, _coalescing_manager=_coalescing_manager)


def _rebind(replacements: dict) -> None:
    """Replace, in every loaded module under ``REBOUND_PREFIXES``, each name bound to one of the
    replaced functions (``id(original) -> (original, wrapper)``) by its wrapper."""
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith(REBOUND_PREFIXES):
            continue
        namespace = vars(module)
        for key, value in list(namespace.items()):
            pair = replacements.get(id(value))
            if pair is not None and pair[0] is value:
                namespace[key] = pair[1]


def install(rank: int, mode: str, outbox, inbox) -> _RankRules:
    """Put this rank's ``torch.distributed`` communication under NCCL's rules (``mode``: ``"lazy"``
    or ``"eager"`` communicators, see the module docstring)."""
    if mode not in MODES:
        raise ValueError(f"NCCL rules mode must be one of {MODES}, got {mode!r}")
    originals = {name: getattr(c10d, name) for name in WRAPPED_NAMES}
    rules = _RankRules(rank, mode, outbox, inbox, originals)
    wrappers = {**_p2p_wrappers(rules), **_other_wrappers(rules)}
    wrappers.update({name: _collective_wrapper(rules, name) for name in COLLECTIVE_NAMES})
    _rebind({id(originals[name]): (originals[name], wrappers[name]) for name in WRAPPED_NAMES})
    return rules


def announce_exit(rules: _RankRules) -> None:
    """Tell the coordinator this rank posts nothing more (its queued operations may still complete)."""
    rules.outbox.put(("exit", rules.rank))
