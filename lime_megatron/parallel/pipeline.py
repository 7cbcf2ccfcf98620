"""Pipeline parallelism: the layer-integrated memory crosses stage boundaries, every row once.

Chunks.  megatron splits the layers into ``p * v`` chunks (``p`` pipeline ranks, ``v`` virtual
stages, ``v = 1`` without interleaving); global chunk ``k = vp_stage * p + rank`` holds the
``k``-th run of layers, so the chunks of rank ``r`` are ``r, r + p, r + 2p, ...``.  A LIMe layer
reads the keys/values (K/V rows, ``memory``) of earlier layers; the rows a chunk reads or must pass
on are those of ``carried_layers`` at its first layer.

After route pruning (``models.lime.pruning``) the layers read are those of
``config.lime_route_reads``, the same on every rank: a row that no later layer reads crosses no
stage, and a chunk's carried layers need not be consecutive (blocks are stacked runs).

Every row crosses to a rank at most once per micro-batch.  Each rank keeps, per micro-batch in
flight, the rows it produced or already received (``KeptRows``, shared by its chunks).  The hop
into chunk ``k`` (from the rank of chunk ``k - 1``) therefore carries only the rows the receiving
rank lacks: those of chunks ``max(0, k - p + 1) .. k - 1`` (run on the other ranks since it last
saw this micro-batch) still read at or after chunk ``k`` (``hop_blocks``; one exact-width block
per source chunk, no padding).  The sender has them: its own chunk ``k - 1``'s rows and the
blocks it received at the hop into ``k - 1``.  For a row of chunk ``h`` this is the chain of hops
``h + 1 .. h + p - 1``, one per other rank.

Backward.  The gradient of a row of layer ``l`` is the sum over its consumers ``m`` of
``W_m[:, block l]^T g_m`` (``models.lime.consumer_gradients``).  On each rank a kept block has one gradient accumulator:
each chunk that read it adds its share when its backward ends (chunks of a rank run backward in
reverse order, so the later consumers come first), and the gradient returned by the outgoing hop
that carried it on (the further ranks' shares) is added when the sending chunk's backward starts.
When the backward of the chunk that received a block ends, the accumulator is complete and goes
back as the hop's returned gradient, exactly the rows the hop carried; block and accumulator are
then freed.  A chunk's own rows get their later consumers' shares (same rank and other ranks)
before its layers' backward runs (``KeptGradients.receive_downstream``).

Design: rows beside megatron's hidden state.  megatron's stage tensor is the plain hidden state
``[s', b, hidden]`` (its buffers, ``overlap_p2p_comm``, ``batch_p2p_comm``, ``batch_p2p_sync`` and
``deallocate_pipeline_outputs`` work as they are); the rows travel in the same calls, on the same
communicator.  ``schedule_arguments`` hands megatron's schedule a ``PipelineCommunicator``:
megatron's own communicator whose ``_communicate`` posts each hidden-state operation (in
``_HIDDEN_ORDER``: even ranks send first, odd ranks receive first, batched or not) followed at
once by the same hop's row operations, on megatron's pipeline group, in the same
``batch_isend_irecv`` under ``batch_p2p_comm`` (torch refuses a batch of several groups).  Each
row operation thus sits right behind its hidden-state operation on both ends, which is what NCCL
needs: it matches point-to-point messages per (communicator, peer) in posting order, ignoring
tags, and with one hardware queue (``CUDA_DEVICE_MAX_CONNECTIONS=1``) completes a GPU's operations
in posting order; a pair that completes in megatron's order completes with its rows after it.
gloo matches per (peer, tag) in posting order, so the rows, sent with tag 0 like the hidden state,
meet their receives the same way.  No communicator exists beside megatron's: none is set up
lazily by one rank while its peer waits elsewhere.  The baseline's pipeline gets the same
communicator without rows, for ``_HIDDEN_ORDER`` (megatron's batched order swaps activations and
gradients at two stages with virtual stages).  Both ends know each hop's sizes from the config and
the hidden state's shape: the sender queues the tensors of each hop when a chunk's forward (or
backward) ends, in megatron's order of sends; the receiver sizes the receives megatron posts next
from the schedule's order of forwards and backwards (``forward_order``, ``backward_order``:
megatron's schedule table with virtual stages).  ``tests/parallel/test_lime_pipeline.py`` runs
every layout under the test harness's NCCL-rules mode and puts posting orders NCCL refuses (facing
row sends, rows posted before the hidden state) into this communicator to show the mode catches
them; ``tests/parallel/test_gpu_defaults.py`` runs each of megatron's p2p settings.

Overlap.  A hop's rows are sent when the sending chunk's forward ends and received where megatron
receives the hidden state: with ``overlap_p2p_comm`` (interleaved schedule) megatron posts the
next forward's receive before the current compute, so the rows' transfer overlaps compute as the
hidden state's does; the 1F1B schedule without virtual stages waits for every transfer
(``planning.schedule_model.overlaps_transfers``).  Sends are asynchronous, their handles kept until
the sent rows may change (own rows become gradients in backward) or the schedule call ends.

Memory.  Received blocks are freed when the receiving chunk's backward ends, own rows kept for the
rank's later chunks when the owning chunk's backward starts; without backward (evaluation under
``torch.no_grad``) a micro-batch's rows are dropped after the rank's last chunk ran it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from megatron.core import parallel_state
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.utils import unwrap_model

from lime_megatron.models.config import pipeline_layer_split
from lime_megatron.models.lime.memory import LayerIntegratedMemory
from lime_megatron.models.lime.router import contiguous_runs, layer_reads
from lime_megatron.parallel.compat import default_device


def carried_layers(config, boundary: int) -> tuple[int, ...]:
    """Layers before ``boundary`` read by some layer at or after it (of the model ``config``
    describes; ``router.layer_reads``), ascending.  Without pruning a contiguous run for every
    router variant: ``[0, b)`` for ``full``/``average``/``dynamic``, ``[b - j + 1, b)`` for
    ``last``-j, ``[0, min(j, b))`` for ``first``-j; after route pruning any subset."""
    read = {source for layer in range(boundary, config.num_layers) for source in layer_reads(config, layer)}
    return tuple(layer for layer in range(boundary) if layer in read)


def layer_runs(layers: tuple[int, ...]) -> list[range]:
    """Ascending ``layers`` as runs of consecutive layers."""
    return [range(start, stop) for start, stop in contiguous_runs(list(layers))]


def chunk_layers(config) -> list[range]:
    """The layers of every global chunk, in layer order (chunk ``vp_stage * p + rank``)."""
    split = pipeline_layer_split(config)
    p = config.pipeline_model_parallel_size
    return [split[rank, vp] for vp in sorted({vp for _, vp in split}, key=lambda vp: vp or 0) for rank in range(p)]


@dataclass(frozen=True)
class HopBlock:
    """Rows of one source chunk carried by a hop."""

    source: int
    """Global chunk that produced the rows."""
    layers: tuple[int, ...]
    """Their layers (some of the source chunk's, ascending; rows stacked in this order)."""


def hop_blocks(config, chunk: int) -> list[HopBlock]:
    """The K/V rows of the hop into global chunk ``chunk``: per source chunk
    ``max(0, chunk - p + 1) .. chunk - 1`` (those run on other ranks since the receiving rank
    last saw the micro-batch), its layers still read at or after ``chunk``.  Empty for chunk 0
    and for the baseline."""
    if not getattr(config, "lime", False) or chunk == 0:
        return []
    chunks = chunk_layers(config)
    read_later = carried_layers(config, chunks[chunk].start)
    blocks = []
    for source in range(max(0, chunk - config.pipeline_model_parallel_size + 1), chunk):
        layers = tuple(layer for layer in read_later if layer in chunks[source])
        if layers:
            blocks.append(HopBlock(source, layers))
    return blocks


def chunk_starting_at(config, boundary: int) -> int:
    """The global chunk whose first layer is ``boundary`` (the first such non-empty chunk)."""
    chunks = chunk_layers(config)
    for index, layers in enumerate(chunks):
        if layers.start == boundary and len(layers):
            return index
    raise ValueError(f"no chunk of the pipeline split starts at layer {boundary}")


def _heads_and_sequence_factor(config) -> tuple[int, int]:
    """(kv heads per tensor-parallel rank, full sequence length / stage-tensor sequence length)."""
    tp = config.tensor_model_parallel_size
    return max(1, config.kv_heads // tp), tp if config.sequence_parallel else 1


def stage_kv_shape(hidden_shape: torch.Size, config) -> tuple[int, int, int, int]:
    """Shape ``[s, b, local kv heads, head dim]`` of one layer's keys on this tensor-parallel
    rank, for a stage tensor (hidden state) ``hidden_shape`` ``[s', b, hidden]``."""
    local_heads, factor = _heads_and_sequence_factor(config)
    return hidden_shape[0] * factor, hidden_shape[1], local_heads, config.kv_channels


def hop_elements(config, chunk: int, seq_length: int, micro_batch_size: int) -> tuple[int, int]:
    """Elements the hop into global chunk ``chunk`` carries per micro-batch and tensor-parallel
    rank, one direction (the backward returns as many): (hidden state, K/V rows)."""
    local_heads, factor = _heads_and_sequence_factor(config)
    hidden = seq_length // factor * micro_batch_size * config.hidden_size
    layers = sum(len(block.layers) for block in hop_blocks(config, chunk))
    return hidden, layers * local_heads * 2 * seq_length * micro_batch_size * config.kv_channels


def exact_stage_width(config, boundary: int) -> int:
    """The hop into the chunk starting at layer ``boundary`` as the last dimension of one
    ``[s', b, width]`` tensor: hidden size plus its K/V rows spread over the ``[s', b]``
    positions (for tools that think in stage tensors; the hop itself is several tensors)."""
    if not getattr(config, "lime", False):
        return config.hidden_size
    local_heads, factor = _heads_and_sequence_factor(config)
    layers = sum(len(block.layers) for block in hop_blocks(config, chunk_starting_at(config, boundary)))
    return config.hidden_size + layers * local_heads * 2 * config.kv_channels * factor


def hop_bytes(config, chunk: int, seq_length: int, micro_batch_size: int, element_size: int) -> int:
    """Bytes of the hop into global chunk ``chunk`` per micro-batch and tensor-parallel rank, one
    direction (hidden state plus the K/V rows of ``hop_blocks``)."""
    return element_size * sum(hop_elements(config, chunk, seq_length, micro_batch_size))


# --------------------------------------------------------------------------- side channel


class _KeptBlock:
    """Rows a rank holds for one micro-batch and source chunk, and their gradient so far.

    ``layers`` ascending, not necessarily consecutive (route pruning); ``runs`` the rows of each
    run of consecutive layers (``layer_runs``), ``[len(run) * kv_heads, 2*s*b*d]``: views of a
    received block or of the producing chunk's memory."""

    def __init__(self, layers: tuple[int, ...], runs: list[torch.Tensor], kv_heads: int):
        self.layers, self.runs, self.kv_heads = layers, runs, kv_heads
        self.layer_runs = layer_runs(layers)  # the layers of each of ``runs``
        self.position = {layer: index for index, layer in enumerate(layers)}
        self.grad: torch.Tensor | None = None

    @classmethod
    def received(cls, layers: tuple[int, ...], rows: torch.Tensor, kv_heads: int) -> _KeptBlock:
        """A block of ``layers`` received as one stacked tensor ``rows``."""
        sizes = [len(run) * kv_heads for run in layer_runs(layers)]
        return cls(layers, list(rows.split(sizes)), kv_heads)

    def view(self, run: range) -> torch.Tensor:
        """Rows of the consecutive layers ``run`` (all kept here): a view."""
        for layers, rows in zip(self.layer_runs, self.runs):
            if layers.start <= run.start and run.stop <= layers.stop:
                return rows[(run.start - layers.start) * self.kv_heads : (run.stop - layers.start) * self.kv_heads]
        raise IndexError(f"rows of layers {run} are not in one kept run of {self.layers}")

    def stacked(self, layers: tuple[int, ...]) -> torch.Tensor:
        """Rows of ``layers`` (some of the kept ones, ascending), stacked (a copy unless one run)."""
        views = [self.view(run) for run in layer_runs(layers)]
        return views[0] if len(views) == 1 else torch.cat(views)

    def add_grad(self, layers: tuple[int, ...], grad: torch.Tensor) -> None:
        """Add ``grad`` (stacked like ``stacked(layers)``) to the gradient of the rows of ``layers``."""
        offset, accumulated = 0, self.gradient()
        for run in layer_runs(layers):
            start, rows = self.position[run.start] * self.kv_heads, len(run) * self.kv_heads
            accumulated[start : start + rows].add_(grad[offset : offset + rows])
            offset += rows

    def gradient(self) -> torch.Tensor:
        """The gradient of all kept rows summed so far, stacked like ``layers`` (zeros at first)."""
        if self.grad is None:
            self.grad = self.runs[0].new_zeros(len(self.layers) * self.kv_heads, self.runs[0].shape[1])
        return self.grad


@dataclass(frozen=True)
class PointToPoint:
    """One point-to-point operation: send ``tensor`` to, or receive it from, global rank ``peer``
    on ``group``.  Posted through ``torch.distributed``'s functions as they are at posting time."""

    send: bool
    tensor: torch.Tensor
    peer: int
    group: object

    def _function(self):
        return torch.distributed.isend if self.send else torch.distributed.irecv

    def post(self):
        return self._function()(self.tensor, self.peer, self.group)

    def batched(self):
        """The operation as a ``torch.distributed.P2POp`` for ``batch_isend_irecv``."""
        return torch.distributed.P2POp(self._function(), self.tensor, self.peer, self.group)


def forward_order(config, num_microbatches: int, rank: int) -> list[tuple[int, int]]:
    """``(global chunk, micro-batch)`` of this pipeline rank's forwards in the order megatron's
    schedule runs them (its schedule table with virtual stages, micro-batch order without)."""
    p = config.pipeline_model_parallel_size
    vpp = config.virtual_pipeline_model_parallel_size
    if not vpp:
        return [(rank, micro_batch) for micro_batch in range(num_microbatches)]
    from megatron.core.pipeline_parallel.schedules import get_schedule_table

    group = config.microbatch_group_size_per_vp_stage or p
    return [(vp * p + rank, micro_batch) for micro_batch, vp in get_schedule_table(num_microbatches, vpp, group)]


def backward_order(config, num_microbatches: int, rank: int) -> list[tuple[int, int]]:
    """``(global chunk, micro-batch)`` of this pipeline rank's backwards in megatron's order: the
    schedule table with the virtual stages reversed."""
    vpp = config.virtual_pipeline_model_parallel_size
    if not vpp:
        return forward_order(config, num_microbatches, rank)
    p = config.pipeline_model_parallel_size
    last = (vpp - 1) * p + rank
    forwards = forward_order(config, num_microbatches, rank)
    return [(last - (chunk - rank), micro_batch) for chunk, micro_batch in forwards]


class KeptRows:
    """This rank's K/V rows per micro-batch in flight, shared by its chunks, and the side
    channel that moves them (see the module docstring).

    The rows travel in the same posting order as megatron's hidden state: the model queues what
    each hop sends (``outgoing``), ``PipelineCommunicator`` posts it right after the hidden-state
    operation it belongs to and posts the receives of the hop megatron receives next
    (``expected``, from the schedule's order), and the model takes what arrived (``arrived``)."""

    def __init__(self, config, num_microbatches: int, forward_only: bool):
        self.config = config
        self.p = config.pipeline_model_parallel_size
        self.chunks = chunk_layers(config)
        self.rank = parallel_state.get_pipeline_model_parallel_rank()
        self.group = parallel_state.get_pipeline_model_parallel_group()
        self.next_peer = torch.distributed.get_global_rank(self.group, (self.rank + 1) % self.p)
        self.prev_peer = torch.distributed.get_global_rank(self.group, (self.rank - 1) % self.p)
        self.blocks: dict[tuple[int, int], _KeptBlock] = {}
        self.forwards = [0] * len(self.chunks)
        last = len(self.chunks) - 1
        backwards = [] if forward_only else backward_order(config, num_microbatches, self.rank)
        self.expected = {  # hops megatron receives next, in its order: (global chunk of the hop, micro-batch)
            "recv_prev": deque(key for key in forward_order(config, num_microbatches, self.rank) if key[0] > 0),
            "recv_next": deque((chunk + 1, mb) for chunk, mb in backwards if chunk < last),
        }
        # tensors of each hop, in megatron's order: ((micro-batch, chunk), tensors)
        self.outgoing: dict[str, deque[tuple[tuple[int, int], list[torch.Tensor]]]] = {
            "send_next": deque(),
            "send_prev": deque(),
        }
        self.arrived: dict[tuple[str, int, int], tuple[list, list]] = {}  # (kind, chunk, mb) -> (tensors, works)
        self.sends: dict[tuple[int, int], list] = {}
        self.grad_sends: list = []
        self.backward_state: dict[tuple[str, int, int], tuple] = {}

    def _row_shapes(self, chunk: int, hidden_shape: torch.Size) -> list[tuple[int, int]]:
        """Shapes ``[layers * local kv heads, 2*s*b*d]`` of the blocks of the hop into ``chunk``."""
        kv_shape = stage_kv_shape(hidden_shape, self.config)
        heads, row = kv_shape[2], 2 * kv_shape[0] * kv_shape[1] * kv_shape[3]
        return [(len(block.layers) * heads, row) for block in hop_blocks(self.config, chunk)]

    def attached_ops(self, kind: str, hidden: torch.Tensor) -> tuple[list, Callable]:
        """The side channel's operations that follow megatron's hidden-state operation ``kind``
        (``send_next``, ``recv_prev``, ``send_prev``, ``recv_next``) on ``hidden``
        (``PointToPoint``), and a callback taking their works once posted."""
        forward = kind in ("send_next", "recv_prev")
        if kind in self.outgoing:
            key, tensors = self.outgoing[kind].popleft()
            peer = self.next_peer if forward else self.prev_peer
            ops = [PointToPoint(True, tensor.contiguous(), peer, self.group) for tensor in tensors]
            return ops, self.sends.setdefault(key, []).extend if forward else self.grad_sends.extend
        chunk, micro_batch = self.expected[kind].popleft()
        peer = self.prev_peer if forward else self.next_peer
        tensors = [hidden.new_empty(shape, requires_grad=False) for shape in self._row_shapes(chunk, hidden.shape)]
        ops = [PointToPoint(False, tensor, peer, self.group) for tensor in tensors]
        return ops, lambda works: self.arrived.__setitem__((kind, chunk, micro_batch), (tensors, works))

    def _take(self, kind: str, chunk: int, micro_batch: int) -> list[torch.Tensor]:
        """The tensors of hop ``chunk`` and ``micro_batch`` received with megatron's ``kind``."""
        tensors, works = self.arrived.pop((kind, chunk, micro_batch))
        for work in works:
            work.wait()
        return tensors

    def finish_sends(self) -> None:
        """Wait for every send posted so far (at the end of a schedule call)."""
        for work in [work for works in self.sends.values() for work in works] + self.grad_sends:
            work.wait()
        self.sends, self.grad_sends = {}, []

    def _on_backward(self, tensor: torch.Tensor, step, chunk: int, micro_batch: int, *state) -> None:
        """Run ``step(chunk, micro_batch, *state)`` when ``tensor``'s gradient is computed (if
        autograd will compute one).  ``state`` (the pass's memory) is held here until then, not by
        the hook: the hook lives as long as ``tensor``, and megatron keeps a chunk's last stage
        input (``TransformerBlock.input_tensor``), so a hook holding the memory would keep the
        last micro-batch's buffer alive until the next schedule call."""
        if not (tensor.requires_grad and torch.is_grad_enabled()):
            return
        key = (step.__name__, chunk, micro_batch)
        self.backward_state[key] = state
        tensor.register_hook(lambda grad: step(chunk, micro_batch, *self.backward_state.pop(key)))

    # ------------------------------------------------------------------ forward
    def start_forward(self, chunk: int) -> int:
        """The micro-batch of chunk ``chunk``'s next forward."""
        micro_batch = self.forwards[chunk]
        self.forwards[chunk] += 1
        return micro_batch

    def receive(self, chunk: int, micro_batch: int, memory: LayerIntegratedMemory, hidden: torch.Tensor) -> None:
        """Forward of the hop into ``chunk``: take its blocks (received with the hidden state)
        and give ``memory`` every kept block its layers read.  In backward (a hook on ``hidden``,
        once every layer of the chunk ran) the chunk's shares are added and the hop's gradient
        is queued for the hidden state's gradient."""
        kv_shape = stage_kv_shape(hidden.shape, self.config)
        received = hop_blocks(self.config, chunk)
        for block, rows in zip(received, self._take("recv_prev", chunk, micro_batch)):
            self.blocks[micro_batch, block.source] = _KeptBlock.received(block.layers, rows, kv_shape[2])
        read = set(carried_layers(self.config, self.chunks[chunk].start))
        external = []
        for (batch, _), kept in sorted(self.blocks.items(), key=lambda item: item[0]):
            if batch == micro_batch:
                runs = layer_runs(tuple(layer for layer in kept.layers if layer in read))
                external += [(run, kept.view(run)) for run in runs]
        memory.key_values.receive(external, kv_shape)
        self._on_backward(hidden, self._end_backward, chunk, micro_batch, memory, received)

    def send(self, chunk: int, micro_batch: int, memory: LayerIntegratedMemory, output: torch.Tensor) -> None:
        """Forward end of a chunk before the last: queue the blocks of the next hop (its own rows
        and the kept blocks it passes on) for the hidden state's send, keep its rows for this
        rank's later chunks; in backward (a hook on ``output``, before the chunk's layers) take
        the hop's returned gradient."""
        own = tuple(
            layer for layer in carried_layers(self.config, self.chunks[chunk].stop) if layer in self.chunks[chunk]
        )
        memory.kept.read_later = own
        if own:
            runs = [memory.key_values.rows(run.start, run.stop) for run in layer_runs(own)]
            self.blocks[micro_batch, chunk] = _KeptBlock(own, runs, memory.key_values.kv_heads)
        tensors = [
            self.blocks[micro_batch, block.source].stacked(block.layers) for block in hop_blocks(self.config, chunk + 1)
        ]
        self.outgoing["send_next"].append(((micro_batch, chunk), tensors))
        self._on_backward(output, self._start_backward, chunk, micro_batch, memory, own)

    def end_forward(self, chunk: int, micro_batch: int) -> None:
        """Without backward (``torch.no_grad``), forget the micro-batch's rows once this rank's
        last chunk ran it."""
        if not torch.is_grad_enabled() and chunk + self.p >= len(self.chunks):
            for key in [key for key in self.blocks if key[0] == micro_batch]:
                del self.blocks[key]

    # ------------------------------------------------------------------ backward
    def _start_backward(
        self, chunk: int, micro_batch: int, memory: LayerIntegratedMemory, own: tuple[int, ...]
    ) -> None:
        """Before chunk ``chunk``'s layers run backward: the returned gradient of the hop into
        ``chunk + 1`` goes to the kept blocks it carried; the own rows' gradient from later
        chunks goes to ``memory``."""
        for work in self.sends.pop((micro_batch, chunk), []):  # matched: the next rank ran its backward
            work.wait()  # the own rows sent are about to be overwritten by gradients
        for block, grad in zip(hop_blocks(self.config, chunk + 1), self._take("recv_next", chunk + 1, micro_batch)):
            self.blocks[micro_batch, block.source].add_grad(block.layers, grad)
        kept = self.blocks.pop((micro_batch, chunk), None)
        if kept is not None:
            memory.kept.receive_downstream(kept.gradient())

    def _end_backward(
        self, chunk: int, micro_batch: int, memory: LayerIntegratedMemory, received: list[HopBlock]
    ) -> None:
        """After chunk ``chunk``'s layers ran backward: add its shares of the kept rows'
        gradients, queue the gradient of the rows the hop into it carried for the hidden state's
        gradient, free them."""
        for layers, share in memory.gradients.external_shares():
            source = next(index for index, own in enumerate(self.chunks) if layers.start in own)
            self.blocks[micro_batch, source].add_grad(tuple(layers), share)
        grads = [self.blocks.pop((micro_batch, block.source)).gradient() for block in received]
        self.outgoing["send_prev"].append(((micro_batch, chunk), grads))
        self.grad_sends = [work for work in self.grad_sends if not work.is_completed()]


_HIDDEN_ORDER = {
    0: ("send_next", "recv_prev", "send_prev", "recv_next"),
    1: ("recv_prev", "send_next", "recv_next", "send_prev"),
}
"""Posting order of the hidden-state operations on even and odd pipeline ranks, batched or not
(megatron's unbatched order): two neighbours never both start with a send to each other, and
each one's sends to the other meet the other's receives in the same order.  megatron's batched
order (``send_prev, recv_prev, send_next, recv_next`` on every rank) breaks the second rule at
two stages with virtual stages: there the next and previous rank are one peer, which receives the
activation first while the sender posted the gradient first, and in-order matching (NCCL's, and
gloo's per tag) swaps the two silently."""


class PipelineCommunicator(P2PCommunicator):
    """megatron's pipeline communicator posting in ``_HIDDEN_ORDER`` in both of megatron's modes
    (one ``batch_isend_irecv`` per exchange with ``batch_p2p_comm``, else one operation at a
    time), with LIMe's K/V rows attached when ``kept`` is given: each hidden-state operation is
    followed at once, on the same process group (megatron's pipeline group: one batch holds one
    group), by the rows of the same hop (``KeptRows.attached_ops``).  Refuses megatron's variable
    sequence lengths and ring exchange, which neither uses."""

    def __init__(self, pp_group, config, kept: KeptRows | None):
        if config.variable_seq_lengths or getattr(config, "use_ring_exchange_p2p", False):
            raise NotImplementedError(
                "lime-megatron's pipeline communicator needs fixed stage shapes and "
                "megatron's send/receive path (no variable_seq_lengths, no ring exchange)"
            )
        super().__init__(pp_group, config)
        self.kept = kept

    def _buffer(self, shape) -> torch.Tensor:
        return torch.empty(shape, requires_grad=True, device=default_device(), dtype=self.config.pipeline_dtype)

    def _hidden_op(self, kind: str, tensor: torch.Tensor) -> PointToPoint:
        send, peer = kind.startswith("send"), self.next_rank if kind.endswith("next") else self.prev_rank
        # a send hands over an alias: megatron may swap the sent output's storage (deallocate_output_tensor)
        return PointToPoint(send, tensor.detach() if send else tensor, peer, self.pp_group)

    def _communicate(
        self, *, tensor_send_next, tensor_send_prev, recv_prev, recv_next, tensor_shape, wait_on_reqs=True
    ):
        hidden = {
            "send_next": tensor_send_next,
            "recv_prev": self._buffer(tensor_shape) if recv_prev else None,
            "send_prev": tensor_send_prev,
            "recv_next": self._buffer(tensor_shape) if recv_next else None,
        }
        hops = []  # (kind, hidden-state operation, the rows' operations, callback taking their works)
        for kind in _HIDDEN_ORDER[self.pp_group.rank() % 2]:
            if hidden[kind] is not None:
                hops.append((kind, self._hidden_op(kind, hidden[kind]), *self._attached_ops(kind, hidden[kind])))
        ordered = self.posting_order(hops)
        works = dict(zip(map(id, ordered), self._post(ordered)))
        reqs = {kind: works[id(hidden_op)] for kind, hidden_op, _, _ in hops}
        for _, _, row_ops, keep in hops:
            keep([works[id(op)] for op in row_ops])
        if wait_on_reqs:
            for work in reqs.values():
                work.wait()
            reqs = None
        return hidden["recv_prev"], hidden["recv_next"], reqs

    def _attached_ops(self, kind: str, hidden: torch.Tensor) -> tuple[list, Callable]:
        """The rows' operations following the hidden-state operation ``kind`` (none without LIMe)."""
        return self.kept.attached_ops(kind, hidden) if self.kept is not None else ([], lambda works: None)

    @staticmethod
    def posting_order(hops: list) -> list[PointToPoint]:
        """The operations of ``hops`` (``(kind, hidden-state operation, row operations, _)`` in
        megatron's order) as posted: each hidden-state operation followed at once by its rows."""
        return [op for _, hidden_op, row_ops, _ in hops for op in (hidden_op, *row_ops)]

    def _post(self, ops: list[PointToPoint]) -> list:
        """Post ``ops`` in order: one batch with ``batch_p2p_comm``, else one by one."""
        if not ops:
            return []
        if not self.config.batch_p2p_comm:
            return [op.post() for op in ops]
        works = list(torch.distributed.batch_isend_irecv([op.batched() for op in ops]))
        if self.config.batch_p2p_sync and torch.cuda.is_available():
            torch.cuda.synchronize()  # as megatron's batched path does (a workaround for a NCCL race)
        return works


_KEPT: KeptRows | None = None


def reset_side_channel() -> None:
    """Forget the side channel's kept rows (``parallel.destroy_parallel``)."""
    global _KEPT
    _KEPT = None


def finish_schedule() -> None:
    """After a call of megatron's forward-backward function: wait for the side channel's last
    sends and drop their handles, so no micro-batch's rows outlive the call (an evaluation call,
    which runs no backward, would otherwise keep every micro-batch's sent rows until the next)."""
    if _KEPT is not None:
        _KEPT.finish_sends()


def schedule_arguments(config, num_microbatches: int, forward_only: bool = False, model: Sequence = ()) -> dict:
    """Prepare one call of megatron's ``get_forward_backward_func()`` over ``num_microbatches``
    with the model chunks ``model`` (call it once per schedule call, on every rank: micro-batches
    are numbered from 0 again; :func:`finish_schedule` after the call) and return the keyword
    arguments the call needs: under pipeline parallelism a ``PipelineCommunicator`` (for LIMe with
    its K/V rows attached) and the process groups it goes with; none otherwise.  Each chunk is
    handed this call's ``KeptRows`` (its ``side_channel``; None without LIMe's pipeline)."""
    global _KEPT
    pipelined = (
        parallel_state.model_parallel_is_initialized() and parallel_state.get_pipeline_model_parallel_world_size() > 1
    )
    lime = getattr(config, "lime", False)
    _KEPT = KeptRows(config, num_microbatches, forward_only) if lime and pipelined else None
    for chunk in model:
        unwrap_model(chunk).side_channel = _KEPT
    if not pipelined:
        return {}
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    groups = ProcessGroupCollection.use_mpu_process_groups(
        required_pgs=["tp", "cp", "pp", "embd", "pos_embd", "dp_cp", "tp_dp_cp", "dp"]
    )
    return dict(p2p_communicator=PipelineCommunicator(pp_group, config, _KEPT), pg_collection=groups)
