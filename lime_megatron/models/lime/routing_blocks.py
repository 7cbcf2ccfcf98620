"""Blocked routing: the routing products of B consecutive layers read each source row once.

Layer m's routed keys/values are ``W_m @ buffer[sources(m)]`` (Eq. 2): a skinny product that
reads every source row to do 2 * kv_heads FLOPs per element, so it runs at memory bandwidth.
For a block of B consecutive consumer layers ``[m0, m0 + B)`` the sources before the block are
mixed for all B layers at the block's first layer in one product

    partial_block = W_block[:, earlier] @ buffer[earlier]      [B * kv_heads, 2 * s * b * d]

(``W_block`` stacks the B routers' columns of the earlier sources, zero where a windowed router
does not read a source), and each layer adds its in-block sources when it runs.  The three
backward products block the same way: the router-weight gradient of the earlier columns is
``G_block @ buffer[earlier]^T`` once per block (``MixEarlierSources.backward``), the gradient of a
block of B source rows from the consumers after it is ``W_later^T @ G_later`` once per source
block (``LayerIntegratedMemory._consumer_grad``), and the rebuild of dropped routed K/V reuses the
forward's stacked product.  Reads of the N-wide rows fall from about L^2/2 to
L^2/(2B) + L*B/2 row blocks per product for the same FLOPs; what stays per layer (the in-block
sources) must, because a layer's own rows exist only once the layer has run.

``lime_megatron.planning.routing_block`` picks B from a cost model; whoever builds a chunk passes
it (``models.gpt_model.build_model``'s ``routing_block``; the trainer does), else the chunk runs
``default_routing_block``.  Either way ``recompute_safe_block`` keeps blocks inside recomputed
chunks.  ``routing_reads`` counts the bytes the products actually read (tests check it against
``planning.routing_bytes.routing_bytes_per_step``), their FLOPs and their time
(``bench/bench_lime_overhead.py`` reports the rate they run at).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from contextlib import contextmanager

import torch

from lime_megatron.models.lime.router import LimeRouter, contiguous_runs


def recompute_safe_block(config, block: int) -> int:
    """``block`` or the largest block size below it that no recompute boundary splits: under full
    activation recompute a block's product over earlier sources runs once per forward of its first
    layer, so a block must lie inside one recomputed chunk.  ``uniform``: chunks of
    ``recompute_num_layers`` layers from the chunk's first, so B divides it (gcd); ``block``: each of
    the first ``recompute_num_layers`` layers is a chunk of its own, so B = 1."""
    if config.recompute_granularity != "full" or not config.recompute_num_layers:
        return block
    return 1 if config.recompute_method == "block" else math.gcd(block, config.recompute_num_layers)


def default_routing_block(config) -> int:
    """The block size of a chunk built without one: ``config.lime_routing_block`` (1 when unset,
    for the dynamic router, whose per-token products are not blocked, and for the baseline),
    kept inside recomputed chunks (``recompute_safe_block``)."""
    if not config.lime or config.lime_router == "dynamic":
        return 1
    return recompute_safe_block(config, config.lime_routing_block or 1)


# ----------------------------------------------------------------------------- byte counting
class RoutingReads:
    """What the routing products did while counting was on: bytes of the N-wide operands they read
    (buffer rows, gradient rows, partial sums) by product kind (``by_kind``; the dynamic router's
    per-token products included), and for the matrix products their FLOPs (``flops_by_kind``) and
    wall seconds (``seconds_by_kind``; on a GPU the device is synchronised around each product
    while counting, so these are its kernel times plus one launch)."""

    def __init__(self):
        self.by_kind: dict[str, int] = {}
        self.flops_by_kind: dict[str, int] = {}
        self.seconds_by_kind: dict[str, float] = {}

    @property
    def total(self) -> int:
        return sum(self.by_kind.values())

    def add(self, kind: str, wide: torch.Tensor) -> None:
        self.by_kind[kind] = self.by_kind.get(kind, 0) + wide.numel() * wide.element_size()

    def add_product(self, kind: str, flops: int, seconds: float) -> None:
        self.flops_by_kind[kind] = self.flops_by_kind.get(kind, 0) + flops
        self.seconds_by_kind[kind] = self.seconds_by_kind.get(kind, 0.0) + seconds


_COUNTER: list[RoutingReads] = []


@contextmanager
def routing_reads():
    """Count the bytes, FLOPs and seconds of the routing products inside the ``with`` block."""
    counter = RoutingReads()
    _COUNTER.append(counter)
    try:
        yield counter
    finally:
        _COUNTER.remove(counter)


def count_read(kind: str, wide: torch.Tensor) -> torch.Tensor:
    """Count the read of ``wide`` as ``kind`` in the open ``routing_reads`` counters; returns it
    (the dynamic router's per-token products count their operands this way)."""
    for counter in _COUNTER:
        counter.add(kind, wide)
    return wide


def synchronize_device_of(tensor: torch.Tensor) -> None:
    """Wait for the kernels queued on ``tensor``'s GPU (nothing on CPU), so wall time covers them."""
    if tensor.is_cuda:
        torch.cuda.synchronize(tensor.device)


def counted_product(kind: str, wide: torch.Tensor, flops: int, product: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``product()``, a matrix product reading the N-wide ``wide`` for ``flops`` FLOPs, counted as
    ``kind`` in the open ``routing_reads`` counters: its read, its FLOPs and its wall time."""
    count_read(kind, wide)
    if not _COUNTER:
        return product()
    synchronize_device_of(wide)
    start = time.perf_counter()
    result = product()
    synchronize_device_of(wide)
    for counter in _COUNTER:
        counter.add_product(kind, flops, time.perf_counter() - start)
    return result


def routing_product(kind: str, narrow: torch.Tensor, wide: torch.Tensor,
                    accumulate: torch.Tensor | None = None) -> torch.Tensor:
    """``narrow @ wide`` ([r, k] @ [k, N]) in ``wide``'s dtype (router weights may be kept in float32
    beside bf16 activations), plus ``accumulate`` ([r, N]) in the same kernel when given (a new
    tensor either way), counted as ``kind`` (``counted_product``)."""
    flops = 2 * narrow.shape[0] * narrow.shape[1] * wide.shape[1]
    narrow = narrow.to(wide.dtype)
    if accumulate is None:
        return counted_product(kind, wide, flops, lambda: narrow @ wide)
    return counted_product(kind, wide, flops, lambda: torch.addmm(accumulate, narrow, wide))


def routing_product_attention_layout(kind: str, narrow: torch.Tensor, wide: torch.Tensor, inner: int,
                                     accumulate: torch.Tensor | None = None) -> torch.Tensor:
    """``narrow @ wide`` written straight into attention's layout: ``[r, k] @ [k, M * inner]`` ->
    ``[M, r, inner]`` contiguous (with ``M * inner = 2*s*b*d``, ``inner = d``: ``[2, s, b, r, d]``),
    one strided-batched product instead of the ``[r, N]`` product and its rearranging copy, plus
    ``accumulate`` (viewable as ``[M, r, inner]``) in the same kernel when given; counted as
    ``kind`` (``counted_product``)."""
    batched = wide.view(wide.shape[0], -1, inner).transpose(0, 1)
    return batched_product(kind, batched_narrow(narrow, batched), batched, accumulate)


def batched_narrow(narrow: torch.Tensor, batched: torch.Tensor) -> torch.Tensor:
    """The narrow operand ``[r, k]`` in the dtype of ``batched`` ``[M, k, inner]``, broadcast over
    its M positions (a view)."""
    return narrow.to(batched.dtype).expand(batched.shape[0], -1, -1)


def batched_product(kind: str, narrow: torch.Tensor, batched: torch.Tensor,
                    accumulate: torch.Tensor | None = None) -> torch.Tensor:
    """``narrow @ batched`` (``[M, r, k] @ [M, k, inner]``, ``narrow`` one matrix broadcast over M)
    -> ``[M, r, inner]``, plus ``accumulate`` in the same kernel when given; counted as ``kind``,
    reading ``batched`` (``counted_product``)."""
    flops = 2 * narrow.shape[1] * batched.numel()
    if accumulate is None:
        return counted_product(kind, batched, flops, lambda: torch.bmm(narrow, batched))
    accumulate = accumulate.view(batched.shape[0], narrow.shape[1], batched.shape[2])
    return counted_product(kind, batched, flops, lambda: torch.baddbmm(accumulate, narrow, batched))


def key_value_halves(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``[h, (k|v, s, b, d)]`` (buffer rows, their partial sums or gradients) as their keys'
    and values' halves ``[h, s*b*d]``: two views."""
    return tuple(rows.view(rows.shape[0], 2, -1).unbind(1))


def routing_product_keys_values(kind: str, narrow: torch.Tensor, wide: torch.Tensor, inner: int,
                                accumulate: tuple[torch.Tensor, torch.Tensor] | None = None
                                ) -> tuple[torch.Tensor, torch.Tensor]:
    """``routing_product_attention_layout`` of the keys' and the values' halves of the rows
    ``wide`` apart, each plus its half of ``accumulate`` when given: keys and values
    ``[s*b, r, inner]``, two tensors, so that attention can keep the values without the keys
    (only RoPE reads those).  The two halves' batched views come from one view of ``wide``
    and share one broadcast ``narrow`` (each operator is host time, docs/routing.md)."""
    halves = wide.view(wide.shape[0], 2, -1, inner).permute(1, 2, 0, 3).unbind(0)
    narrow = batched_narrow(narrow, halves[0])
    return tuple(batched_product(kind, narrow, half, added)
                 for half, added in zip(halves, accumulate or (None, None)))


def weight_grad_dtype(weight: torch.Tensor) -> torch.dtype:
    """The dtype router-weight gradients are accumulated and returned in: float32 at least
    (float64 for float64 weights)."""
    return torch.float64 if weight.dtype == torch.float64 else torch.float32


def placed_columns(pieces: list[tuple[slice, torch.Tensor]], weight: torch.Tensor) -> torch.Tensor:
    """A router-weight gradient shaped like ``weight``, in ``weight_grad_dtype``: each piece
    ``(columns, [rows, len(columns)])`` at its columns, zero elsewhere.  Pieces that adjoin (the
    usual case: a run of consecutive sources, split at its block's start under blocked routing)
    are joined by one ``cat`` (none for a single piece) and padded by one ``pad`` (none where
    they span the weight's columns, e.g. the full router's)."""
    dtype = weight_grad_dtype(weight)
    pieces = sorted(pieces, key=lambda piece: piece[0].start)
    if pieces and all(left.stop == right.start for (left, _), (right, _) in zip(pieces, pieces[1:])):
        grad = torch.cat([piece for _, piece in pieces], dim=1) if len(pieces) > 1 else pieces[0][1]
        margins = (pieces[0][0].start, weight.shape[1] - pieces[-1][0].stop)
        return grad.to(dtype) if margins == (0, 0) else torch.nn.functional.pad(grad.to(dtype), margins)
    grad = torch.zeros_like(weight, dtype=dtype)
    for columns, piece in pieces:
        grad[:, columns] = piece
    return grad


def weight_grad_product(grad_rows: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """:func:`float32_product` counted as the weight gradient's (``counted_product``)."""
    flops = 2 * grad_rows.shape[0] * rows.shape[0] * rows.shape[1]
    return counted_product("weight_grad", rows, flops, lambda: float32_product(grad_rows, rows))


FLOAT32_CHUNK_BYTES = 64 * 2**20
"""Bytes of the float32 copies of one chunk of the reduced dimension in ``float32_product``."""


CUBLAS_FLOAT32_OUTPUT = torch.torch_version.TorchVersion(torch.__version__) >= "2.8"
"""``torch.mm(..., out_dtype=torch.float32)`` exists (torch 2.8): on CUDA, bf16/fp16 operands,
float32 accumulation and result in one cuBLAS product."""


def float32_product(grad_rows: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``grad_rows @ rows^T`` (``[m, N] x [n, N] -> [m, n]``), accumulated in float32 for
    bf16/fp16 operands: the router weight gradient reduces over N = 2*s*b*d elements (about 2M at
    the paper's 1B shape), where bf16 partial sums (split-K) lose about 1e-2 relative.  On CUDA
    (torch >= 2.8) one cuBLAS product with a float32 result (``CUBLAS_FLOAT32_OUTPUT``: on an H200,
    [128, 2^20] x [512, 2^20]^T in 0.35 ms against 6.4 ms upcast by chunks, 3.7e-5 relative);
    elsewhere the operands are upcast a chunk of N at a time (``FLOAT32_CHUNK_BYTES``), never
    whole.  Float32 and float64 operands multiply as they are."""
    if grad_rows.dtype in (torch.float32, torch.float64) and rows.dtype == grad_rows.dtype:
        return grad_rows @ rows.t()
    if grad_rows.is_cuda and CUBLAS_FLOAT32_OUTPUT and rows.dtype == grad_rows.dtype:
        return torch.mm(grad_rows, rows.t(), out_dtype=torch.float32)
    step = max(1, FLOAT32_CHUNK_BYTES // (4 * (grad_rows.shape[0] + rows.shape[0])))
    product = grad_rows.new_zeros(grad_rows.shape[0], rows.shape[0], dtype=torch.float32)
    for start in range(0, rows.shape[1], step):
        product.addmm_(grad_rows[:, start : start + step].float(), rows[:, start : start + step].float().t())
    return product


# ----------------------------------------------------------------------------- stacked routers
def runs_within(router: LimeRouter, start: int, stop: int) -> list[tuple[int, int]]:
    """The router's runs of consecutive read sources (``source_runs``) cut to ``start..stop-1``."""
    return [(max(a, start), min(b, stop)) for a, b in router.source_runs if a < stop and b > start]


class RouterStack:
    """Every router of a model chunk as one matrix, in the dtype of the rows it multiplies:
    ``[len(layers) * kv_heads, layers.stop * local heads]``, router m's rows at
    ``(m - layers.start) * kv_heads``, its columns of source layer j at ``j * local heads``, zero
    where m does not read j (a windowed router, a pruned source, a later layer).

    Every product of several routers (a block's earlier sums and their rebuild, the row
    gradients) takes its narrow operand from here (``columns``: one copy), where stacking the
    routers per product cost one copy per router per product, O(L) small copies and their
    Python per layer in backward at B = 1, the host's work that sets the pace of a deep narrow
    model on a GPU (issue 26).  Built once per pass, one copy per run of a router's sources:
    the weights hold still between a forward and its backward (the optimizer steps after both).
    """

    def __init__(self, routers: dict[int, LimeRouter], layers: range, like: torch.Tensor):
        first = routers[layers.start]
        self.first, self.rows, self.local = layers.start, first.weight.shape[0], first.local_heads
        self.matrix = like.new_zeros(len(layers) * self.rows, layers.stop * self.local)
        with torch.no_grad():  # a copy of the weights outside autograd, whoever builds it
            for layer in layers:
                router, top = routers[layer], (layer - self.first) * self.rows
                for start, stop in router.source_runs:
                    self.matrix[top : top + self.rows, start * self.local : stop * self.local] = \
                        router.weight_columns(start, stop)

    def columns(self, consumers: list[int], start: int, stop: int) -> torch.Tensor:
        """``[len(consumers) * kv_heads, (stop - start) * local heads]``: the columns of source
        layers ``start..stop-1`` of the routers of layers ``consumers`` (ascending), contiguous:
        one copy of these few elements, as a strided operand slows the CPU's batched products
        (by 10-60% at the bench's shapes, measured)."""
        columns = slice(start * self.local, stop * self.local)
        top = (consumers[0] - self.first) * self.rows
        if consumers[-1] - consumers[0] + 1 == len(consumers):
            return self.matrix[top : top + len(consumers) * self.rows, columns].contiguous()
        return torch.cat([self.matrix[(m - self.first) * self.rows : (m - self.first + 1) * self.rows, columns]
                          for m in consumers])


def earlier_runs(memory, block: range, routers: list[LimeRouter]) -> list[tuple[int, int]]:
    """Row blocks ``(start, stop)`` of the sources before ``block`` that ``routers`` read (their
    union, split where the memory's external blocks begin and end)."""
    sources = sorted({source for router in routers for source in router.read_sources if source < block.start})
    return [piece for run in contiguous_runs(sources) for piece in memory.row_blocks(*run)]


def mix_earlier(memory, block: range, routers: list[LimeRouter],
                kind: str = "forward") -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each router's sums over the sources before ``block``, keys and values (this rank's columns),
    from one product per row block for all ``routers`` together (counted as ``kind``): without
    tensor parallelism in attention's layout ``[s, b, kv_heads, d]`` each (views of the block's
    ``[2*s*b, B*kv_heads, d]``, ``routing_product_attention_layout``), else the two halves
    ``[kv_heads, s*b*d]`` of rows ``[kv_heads, 2*s*b*d]``."""
    attention_layout = routers[0].sharding.size == 1
    partial = None
    consumers = [router.layer for router in routers]
    for start, stop in earlier_runs(memory, block, routers):
        wide = memory.rows(start, stop)
        narrow = memory.stacked_columns(consumers, start, stop, wide)
        partial = (routing_product_attention_layout(kind, narrow, wide, memory.kv_shape[3], partial)
                   if attention_layout else routing_product(kind, narrow, wide, partial))
    if attention_layout:
        s, b, kv_heads, d = memory.kv_shape
        halves = ([part.view(s, b, kv_heads, d) for part in half.chunk(len(routers), dim=1)]
                  for half in partial.chunk(2))
        return list(zip(*halves))
    return [key_value_halves(rows) for rows in partial.chunk(len(routers))]


class MixEarlierSources(torch.autograd.Function):
    """``mix_earlier`` with the router-weight gradient of those columns.

    forward(memory, block, routers (those of the block that read earlier rows), key, *their weights)
        -> per router its keys' and its values' partial sums (``mix_earlier``), flat
    backward: dL/dW_m[:, earlier] = g_m @ buffer[earlier]^T for the whole block in one product per
    row block; float32; returned as router m's whole gradient, placed beside the in-block
    columns' that ``memory.RouteKeysValues`` left in ``memory.in_block_weight_grads`` (one
    gradient per router and step: no second placement and no add in autograd).  The gradient
    of router m's partial sums is g_m itself (the partial is added to m's routed keys/values
    inside ``memory.RouteKeysValues``), whose backward kept g_m as rows before this runs: the
    product reads those kept rows
    (``LayerIntegratedMemory.kept_grad_rows``, the readers' span: a pruned non-reader between
    two readers adds rows whose products are not used), not a restacked copy of
    ``grad_partials``.  Fixed routers (``average``) have no weight gradient: nothing runs.

    Order (an autograd edge, whatever the engine prefers among ready nodes).  The product reads the
    raw rows before the block, which the backward of their layer overwrites with its gradient rows
    (``LayerIntegratedMemory.kv_grad``).  ``key``, the raw keys ``[s, b, local kv heads, d]`` of
    the block's first reader m0, is an input for that edge alone: nothing saved, its gradient None,
    which the engine still counts.  So the node giving the gradient of ``key`` (m0's QKV
    projection) runs after this backward, and every node below it after that: the backward of
    every earlier layer j that has one (its output reaches m0's input through the residual
    stream), ``RouteKeysValues`` of j included.
    Under full activation recompute this node and its edge are rebuilt in the rerun of the chunk
    holding m0, and an earlier chunk's backward needs that chunk's input gradient, returned when
    its backward ends.  The readers' ``RouteKeysValues`` take this node's outputs, so they ran
    (and kept their g_m) before it.
    """

    @staticmethod
    def forward(ctx, memory, block: range, routers: list[LimeRouter], key, *weights):
        ctx.memory, ctx.block, ctx.routers = memory, block, routers
        return tuple(half for pair in mix_earlier(memory, block, routers) for half in pair)

    @staticmethod
    def backward(ctx, *grad_partials):
        if not any(ctx.needs_input_grad[4:]):
            return (None,) * len(ctx.needs_input_grad)
        memory, block, routers = ctx.memory, ctx.block, ctx.routers
        # each router's in-block pieces (none: the layer's output fed no loss), then its earlier ones
        pieces = [memory.in_block_weight_grads.pop(router.layer, []) for router in routers]
        rows, first = routers[0].weight.shape[0], routers[0].layer
        kept = memory.kept_grad_rows(range(first, routers[-1].layer + 1), rows)
        for start, stop in earlier_runs(memory, block, routers):
            block_grad = weight_grad_product(kept, memory.rows(start, stop))
            for placed, router in zip(pieces, routers):
                top, local = (router.layer - first) * rows, router.local_heads
                placed += [(router.columns(a, b),
                            block_grad[top : top + rows, (a - start) * local : (b - start) * local])
                           for a, b in runs_within(router, start, stop)]
        return None, None, None, None, *(placed_columns(placed, router.weight)
                                         for placed, router in zip(pieces, routers))
