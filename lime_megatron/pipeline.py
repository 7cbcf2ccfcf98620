"""Pipeline parallelism: the layer-integrated memory crosses stage boundaries.

megatron-core's schedules pass one tensor between pipeline stages.  A LIMe chunk whose layers
read keys/values of earlier stages receives them, and sends on those that later stages read, in
that one tensor (the *stage tensor*, ``[s', b, k]``; ``s'`` is the sequence length, divided by
the tensor-parallel size under sequence parallelism).  Its flat memory holds

    hidden state [s', b, hidden] (flattened) | K/V rows of the carried layers [n * kv_local, 2*s*b*d]

so both parts are views of the received tensor (no copy on the receiving stage).  The carried
layers at a boundary before layer ``c`` are the earlier layers read by some layer >= c
(``carried_layers``): all c of them for the ``full`` and ``average`` routers, at most j - 1 for
``last``-j and j for ``first``-j.  In backward the gradient of the stage tensor carries, for each
carried layer l, the later stages' share of its gradient, sum_{m >= c} W_m[:, block l]^T g_m.

Stage tensor shapes are known on both sides of a boundary (they follow from the config), so no
shape is exchanged at run time: ``StageTensorCommunicator`` (pass ``schedule_arguments(config)``
to megatron's forward-backward function) is megatron's communicator receiving ``[s', b, width]``
instead of ``[s', b, hidden]``, all transfers otherwise megatron's own.  Without virtual stages
each rank receives at one boundary and sends at one, so every stage tensor has its exact width.
With virtual stages megatron's communicator cannot tell which chunk a receive is for, so every
stage tensor is padded to the widest boundary of the model (``stage_tensor_width``; the
padding is sent but never read).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core import parallel_state
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron.core.process_groups_config import ProcessGroupCollection

from lime_megatron.config import pipeline_layer_split
from lime_megatron.memory import LayerIntegratedMemory
from lime_megatron.router import routing_consumers


def carried_layers(config, boundary: int) -> range:
    """Layers before ``boundary`` read by some layer at or after it (of the model ``config``
    describes): the K/V rows a stage
    tensor carries across the boundary before layer ``boundary``.  A contiguous range for every
    router variant: ``[0, b)`` for ``full``/``average``, ``[b - j + 1, b)`` for ``last``-j,
    ``[0, min(j, b))`` for ``first``-j (empty at 0 and at ``num_layers``)."""
    carried = [
        layer for layer in range(boundary)
        if routing_consumers(layer, config.num_layers, config.lime_router, config.lime_router_window)[1] > boundary
    ]
    if not carried:
        return range(boundary, boundary)
    if carried != list(range(carried[0], carried[-1] + 1)):
        raise AssertionError(f"carried layers {carried} at boundary {boundary} are not contiguous")
    return range(carried[0], carried[-1] + 1)


@dataclass(frozen=True)
class ChunkLayers:
    """The global layers of one model chunk, the K/V rows crossing its two boundaries and the
    widths of the stage tensors there."""

    own: range
    """Layers built in this chunk."""
    received: range
    """Earlier layers whose rows arrive with the incoming stage tensor."""
    sent: range
    """Layers whose rows leave with the outgoing stage tensor (empty on the last stage)."""
    received_width: int
    """Last dimension of the incoming stage tensor (``stage_tensor_width``)."""
    sent_width: int
    """Last dimension of the outgoing stage tensor."""

    @classmethod
    def of(cls, own: range, config) -> "ChunkLayers":
        """The boundaries of the chunk of layers ``own`` in a model described by ``config``."""
        return cls(
            own=own,
            received=carried_layers(config, own.start),
            sent=carried_layers(config, own.stop),
            received_width=stage_tensor_width(config, own.start),
            sent_width=stage_tensor_width(config, own.stop),
        )


def _heads_and_sequence_factor(config) -> tuple[int, int]:
    """(kv heads per tensor-parallel rank, full sequence length / stage-tensor sequence length)."""
    tp = config.tensor_model_parallel_size
    return max(1, config.kv_heads // tp), tp if config.sequence_parallel else 1


def stage_kv_shape(hidden_shape: torch.Size, config) -> tuple[int, int, int, int]:
    """Shape ``[s, b, local kv heads, head dim]`` of one layer's keys on this tensor-parallel
    rank, for a stage tensor whose hidden part is ``hidden_shape`` ``[s', b, hidden]``."""
    local_heads, factor = _heads_and_sequence_factor(config)
    return hidden_shape[0] * factor, hidden_shape[1], local_heads, config.kv_channels


def exact_stage_width(config, boundary: int) -> int:
    """Last dimension of the stage tensor before layer ``boundary``: hidden size plus the
    carried layers' K/V rows spread over the ``[s', b]`` positions."""
    if not getattr(config, "lime", False):
        return config.hidden_size
    carried = carried_layers(config, boundary)
    local_heads, factor = _heads_and_sequence_factor(config)
    return config.hidden_size + len(carried) * local_heads * 2 * config.kv_channels * factor


def stage_tensor_width(config, boundary: int) -> int:
    """Last dimension of the stage tensor sent across the boundary before layer ``boundary``:
    exact without virtual stages, else the widest boundary of the model."""
    if not config.virtual_pipeline_model_parallel_size:
        return exact_stage_width(config, boundary)
    return max(exact_stage_width(config, layers.start) for layers in pipeline_layer_split(config).values())


class SendStage(torch.autograd.Function):
    """Pack the chunk's output hidden state and the rows of ``layers`` into one stage tensor.

    forward(hidden [s', b, hidden], memory, layers, width) -> stage tensor [s', b, width]
    backward: the hidden part flows back into the chunk; the rows part is the later stages'
    gradient of the sent rows, handed to the memory.
    """

    @staticmethod
    def forward(ctx, hidden, memory: LayerIntegratedMemory, layers: range, width: int):
        rows = memory.sent_rows(layers) if len(layers) else []
        s, b, _ = hidden.shape
        stage = hidden.new_empty(s, b, width)
        flat = stage.view(-1)
        if hidden.numel() + sum(part.numel() for part in rows) > flat.numel():
            raise AssertionError(f"layers {layers} do not fit a stage tensor [{s}, {b}, {width}]")
        flat[: hidden.numel()].view_as(hidden).copy_(hidden)
        offset = hidden.numel()
        for part in rows:
            flat[offset : offset + part.numel()].view_as(part).copy_(part)
            offset += part.numel()
        flat[offset:].zero_()  # padding to the widest boundary (virtual stages), never read
        ctx.memory, ctx.layers, ctx.hidden_shape = memory, layers, hidden.shape
        return stage

    @staticmethod
    def backward(ctx, grad_stage):
        flat = grad_stage.contiguous().view(-1)
        size = ctx.hidden_shape.numel()
        if len(ctx.layers):
            count = len(ctx.layers) * ctx.memory.kv_heads
            rows = flat[size : size + count * ctx.memory.row_length].view(count, -1)
            ctx.memory.receive_downstream_grad(rows, ctx.layers)
        return flat[:size].view(ctx.hidden_shape), None, None, None


class ReceiveStage(torch.autograd.Function):
    """Unpack an incoming stage tensor: the hidden state (returned) and the rows of the
    ``chunk``'s received layers (given to ``memory``), both views of it.

    forward(stage [s', b, width], memory, chunk, config) -> hidden [s', b, hidden]
    backward: the stage tensor's gradient, hidden part from the chunk, rows part from the
    memory (this chunk's and later stages' shares, once every own layer's backward ran).
    """

    @staticmethod
    def forward(ctx, stage, memory: LayerIntegratedMemory, chunk: ChunkLayers, config):
        s, b, width = stage.shape
        hidden_shape = torch.Size((s, b, config.hidden_size))
        expected, layers = chunk.received_width, chunk.received
        if width != expected:
            raise RuntimeError(
                f"the stage tensor {tuple(stage.shape)} received before layer {chunk.own.start} should be "
                f"[{s}, {b}, {expected}] (hidden {config.hidden_size} and the keys/values of layers "
                f"{layers.start}..{layers.stop - 1}): run megatron's schedule with "
                "**lime_megatron.pipeline.schedule_arguments(config) and the same config on every stage"
            )
        kv_shape = stage_kv_shape(hidden_shape, config)
        row_length = 2 * kv_shape[0] * kv_shape[1] * kv_shape[3]
        flat = stage.detach().view(-1)
        rows = flat[hidden_shape.numel() : hidden_shape.numel() + len(layers) * kv_shape[2] * row_length]
        memory.receive(rows.view(-1, row_length), layers, kv_shape)
        ctx.memory, ctx.stage_shape, ctx.row_length = memory, stage.shape, row_length
        return flat[: hidden_shape.numel()].view(hidden_shape)

    @staticmethod
    def backward(ctx, grad_hidden):
        grad = grad_hidden.new_zeros(ctx.stage_shape)
        flat = grad.view(-1)
        flat[: grad_hidden.numel()].view_as(grad_hidden).copy_(grad_hidden)
        received = len(ctx.memory.received_layers) * ctx.memory.kv_heads * ctx.row_length
        if received:
            rows = flat[grad_hidden.numel() : grad_hidden.numel() + received].view(-1, ctx.row_length)
            ctx.memory.write_received_grad(rows)
        return grad, None, None, None


def _rank_boundaries(config, rank: int) -> tuple[int, int]:
    """First and stop layer of pipeline rank ``rank``'s one chunk (without virtual stages;
    with them every boundary has the same width and (0, 0) is returned)."""
    if config.virtual_pipeline_model_parallel_size:
        return 0, 0
    layers = pipeline_layer_split(config)[rank, None]
    return layers.start, layers.stop


class StageTensorCommunicator(P2PCommunicator):
    """megatron's pipeline communicator for stage tensors ``[s', b, width]``: megatron's
    schedules ask to receive ``[s', b, hidden]``; this rank's receives from the previous stage
    and from the next one get the widths of its input and output boundaries instead."""

    def __init__(self, pp_group, config):
        super().__init__(pp_group, config)
        first, last = _rank_boundaries(config, pp_group.rank())
        self.widths = {"prev": stage_tensor_width(config, first), "next": stage_tensor_width(config, last)}

    def _communicate(self, *, recv_prev: bool, recv_next: bool, tensor_shape, **kwargs):
        if tensor_shape is not None and (recv_prev or recv_next):
            widths = {self.widths[side] for side, wanted in (("prev", recv_prev), ("next", recv_next)) if wanted}
            if len(widths) != 1:
                raise AssertionError(f"one receive shape for stage tensors of widths {widths}")
            tensor_shape = (*tuple(tensor_shape)[:2], widths.pop())
        return super()._communicate(recv_prev=recv_prev, recv_next=recv_next, tensor_shape=tensor_shape, **kwargs)


def schedule_groups() -> ProcessGroupCollection:
    """megatron's process groups as its schedules take them with a ``p2p_communicator``."""
    groups = ProcessGroupCollection()
    groups.tp = parallel_state.get_tensor_model_parallel_group()
    groups.cp = parallel_state.get_context_parallel_group()
    groups.pp = parallel_state.get_pipeline_model_parallel_group()
    groups.embd = parallel_state.get_embedding_group(check_initialized=False)
    groups.pos_embd = parallel_state.get_position_embedding_group(check_initialized=False)
    groups.dp = parallel_state.get_data_parallel_group()
    groups.dp_cp = parallel_state.get_data_parallel_group(with_context_parallel=True)
    groups.tp_dp_cp = parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True)
    return groups


def schedule_arguments(config) -> dict:
    """Keyword arguments for megatron's ``get_forward_backward_func()(...)`` that LIMe needs
    under pipeline parallelism (``p2p_communicator`` and the matching ``pg_collection``);
    empty without pipelining or for the baseline."""
    if parallel_state.get_pipeline_model_parallel_world_size() == 1 or not getattr(config, "lime", False):
        return {}
    groups = schedule_groups()
    return dict(p2p_communicator=StageTensorCommunicator(groups.pp, config), pg_collection=groups)
