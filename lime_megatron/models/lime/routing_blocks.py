"""Blocked routing: the routing products of B consecutive layers read each source row once.

Layer m's routed keys/values are ``W_m @ buffer[sources(m)]`` (Eq. 2): a skinny product that
reads every source row to do 2 * kv_heads FLOPs per element, so it runs at memory bandwidth.
For a block of B consecutive consumer layers ``[m0, m0 + B)`` the sources before the block are
mixed for all B layers at the block's first layer in one product

    partial_block = W_block[:, earlier] @ buffer[earlier]      [B * kv_heads, 2 * s * b * d]

(``W_block`` stacks the B routers' columns of the earlier sources, zero where a windowed router
does not read a source, ``RouterStack``; ``stacked_routing.StackedRouting`` runs it), and each
layer adds its in-block sources when it runs (``static_routing.StaticRouting``).  The three
backward products block the same way: the router-weight gradient of the earlier columns is
``G_block @ buffer[earlier]^T`` once per block (``MixEarlierSources.backward``), the gradient of a
block of B source rows from the consumers after it is ``W_later^T @ G_later`` once per source
block (``consumer_gradients.ConsumerGradients``), and the rebuild of dropped routed K/V reuses the
forward's stacked product.  Reads of the N-wide rows fall from about L^2/2 to
L^2/(2B) + L*B/2 row blocks per product for the same FLOPs; what stays per layer (the in-block
sources) must, because a layer's own rows exist only once the layer has run.

On the Triton path a block whose layers all route there runs as one (``fused_blocks``): the same
three products, each one launch, over tensors the block's layers share.

``lime_megatron.planning.routing_block`` picks B from a cost model; whoever builds a chunk passes
it (``models.gpt_model.build_model``'s ``routing_block``; the trainer does), else the chunk runs
``default_routing_block``.  Either way ``recompute_safe_block`` keeps blocks inside recomputed
chunks.  The functions here take tensors (``EarlierSources``); the memory's parts hand them over.
``lime_megatron.testing.routing_reads`` counts the bytes the products actually read (tests check
it against ``planning.routing_bytes.routing_bytes_per_step``), their FLOPs and their time
(``bench/bench_lime_overhead.py`` reports the rate they run at).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lime_megatron.kernels.operands import Columns
from lime_megatron.models.lime.router import LimeRouter
from lime_megatron.models.lime.routing_products import (
    key_value_halves,
    placed_columns,
    routing_product,
    routing_product_attention_layout,
    weight_grad_product,
)


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
    model on a GPU.  Built once per pass (the torch path) or kept by the model chunk and
    ``refresh``-ed once per pass (``StandingRouterStack``, the Triton path): the weights hold still
    between a forward and its backward (the optimizer steps after both).  Its places are views made
    once; a refresh copies every run of every router's sources into them in one operator.
    """

    def __init__(self, routers: dict[int, LimeRouter], layers: range, like: torch.Tensor):
        first = routers[layers.start]
        self.first, self.rows, self.local = layers.start, first.weight.shape[0], first.local_heads
        self.matrix = like.new_zeros(len(layers) * self.rows, layers.stop * self.local)
        self._places, self._weights = [], []
        with torch.no_grad():  # views of the weights outside autograd, whoever builds it
            for layer in layers:
                router, top = routers[layer], (layer - self.first) * self.rows
                for start, stop in router.source_runs:
                    self._places.append(self.matrix[top : top + self.rows, start * self.local : stop * self.local])
                    self._weights.append(router.weight_columns(start, stop))
        self.refresh()

    def refresh(self) -> None:
        """Copy the routers' weights into their places (one ``_foreach_copy_``)."""
        with torch.no_grad():
            torch._foreach_copy_(self._places, self._weights)

    def operand(self, consumers: range, sources: range, transposed: bool = False) -> Columns:
        """The columns of source layers ``sources`` of the routers of layers ``consumers`` where
        they lie, as a kernel operand (``.t()`` of them when ``transposed``): no copy, no view."""
        top = (consumers.start - self.first) * self.rows
        rows = slice(top, top + len(consumers) * self.rows)
        return Columns.of(self.matrix, rows, slice(sources.start * self.local, sources.stop * self.local), transposed)

    def columns(self, consumers: Sequence[int], start: int, stop: int) -> torch.Tensor:
        """``[len(consumers) * kv_heads, (stop - start) * local heads]``: the columns of source
        layers ``start..stop-1`` of the routers of layers ``consumers`` (ascending), contiguous:
        one copy of these few elements, as a strided operand slows the CPU's batched products
        (by 10-60% at the bench's shapes, measured)."""
        columns = slice(start * self.local, stop * self.local)
        top = (consumers[0] - self.first) * self.rows
        if consumers[-1] - consumers[0] + 1 == len(consumers):
            return self.matrix[top : top + len(consumers) * self.rows, columns].contiguous()
        return torch.cat(
            [self.matrix[(m - self.first) * self.rows : (m - self.first + 1) * self.rows, columns] for m in consumers]
        )


class StandingRouterStack:
    """A model chunk's ``RouterStack`` kept across passes (the Triton path, whose host work per
    layer it saves): ``refreshed`` per pass with one operator, built anew when the rows' dtype or
    device or a weight's storage changed (a cast, a move, megatron's DDP taking the weights into
    its buffer).  It holds ``len(layers) * kv_heads`` x ``layers.stop * local heads`` elements for
    the chunk's lifetime, where the torch path builds one per micro-batch."""

    def __init__(self, routers: dict[int, LimeRouter], layers: range):
        self.routers, self.layers = routers, layers
        self._stack: RouterStack | None = None
        self._built_for: tuple | None = None

    def refreshed(self, like: torch.Tensor) -> RouterStack:
        """The stack in ``like``'s dtype and device holding the routers' current weights."""
        built_for = (like.dtype, like.device, *(router.weight.data_ptr() for router in self.routers.values()))
        if self._stack is None or built_for != self._built_for:
            self._stack, self._built_for = RouterStack(self.routers, self.layers, like), built_for
        else:
            self._stack.refresh()
        return self._stack


@dataclass
class EarlierSources:
    """The operands of a block's product over the sources before the block.

    ``readers``: the block's routers that read such sources (ascending layers); ``runs``: the row
    blocks ``(start, stop)`` of those sources (their union, split where the memory's own rows and
    external blocks meet); per run its ``rows`` ``[(stop - start) * kv_heads, 2*s*b*d]`` and the
    readers' stacked ``columns`` ``[len(readers) * kv_heads, (stop - start) * local heads]``
    (``RouterStack.columns``, in the rows' dtype); ``kv_shape``: ``(s, b, kv_heads, d)``;
    ``triton``: the products run as Triton kernels (``kernels.routing_kernels``).
    """

    readers: list[LimeRouter]
    runs: list[tuple[int, int]]
    rows: list[torch.Tensor]
    columns: list[torch.Tensor]
    kv_shape: tuple[int, int, int, int]
    triton: bool = False


def mix_earlier(sources: EarlierSources, kind: str = "forward") -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each reader's sums over the sources before its block, keys and values (this rank's columns),
    from one product per row block for all readers together (of kind ``kind``): without tensor
    parallelism in attention's layout ``[s, b, kv_heads, d]`` each (views of the block's
    ``[2*s*b, B*kv_heads, d]``, ``routing_product_attention_layout``), else the two halves
    ``[kv_heads, s*b*d]`` of rows ``[kv_heads, 2*s*b*d]``."""
    readers = sources.readers
    attention_layout = readers[0].sharding.size == 1
    s, b, kv_heads, d = sources.kv_shape
    partial = None
    for narrow, wide in zip(sources.columns, sources.rows):
        partial = (
            routing_product_attention_layout(kind, narrow, wide, d, partial, sources.triton)
            if attention_layout
            else routing_product(kind, narrow, wide, partial, sources.triton)
        )
    if attention_layout:
        halves = (
            [part.view(s, b, kv_heads, d) for part in half.chunk(len(readers), dim=1)] for half in partial.chunk(2)
        )
        return list(zip(*halves))
    return [key_value_halves(rows) for rows in partial.chunk(len(readers))]


class MixEarlierSources(torch.autograd.Function):
    """``mix_earlier`` with the router-weight gradient of those columns.

    forward(sources (``EarlierSources``), key_values (``key_value_rows.KeyValueRows``), kept
            (``kept_gradients.KeptGradients``), key, *the readers' weights)
        -> per reader its keys' and its values' partial sums (``mix_earlier``), flat
    backward: dL/dW_m[:, earlier] = g_m @ buffer[earlier]^T for the whole block in one product per
    row block (the rows of ``sources.runs`` read again from ``key_values``: the node keeps no
    rows of its own, so received rows go when the memory forgets them); float32; returned as
    router m's whole gradient, placed beside the in-block
    columns' that ``memory.RouteKeysValues`` left in ``kept`` (one gradient per router and step:
    no second placement and no add in autograd).  The gradient of router m's partial sums is
    g_m itself (the partial is added to m's routed keys/values inside
    ``memory.RouteKeysValues``), whose backward kept g_m as rows before this runs: the product
    reads those kept rows (``KeptGradients.grad_rows``, the readers' span: a pruned non-reader
    between two readers adds rows whose products are not used), not a restacked copy of
    ``grad_partials``.  Fixed routers (``average``) have no weight gradient: nothing runs.

    Order (an autograd edge, whatever the engine prefers among ready nodes).  The product reads the
    raw rows before the block, which the backward of their layer overwrites with its gradient rows
    (``ConsumerGradients.kv_grad``).  ``key``, the raw keys ``[s, b, local kv heads, d]`` of
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
    def forward(ctx, sources: EarlierSources, key_values, kept, key, *weights):
        ctx.readers, ctx.runs, ctx.key_values, ctx.kept = sources.readers, sources.runs, key_values, kept
        return tuple(half for pair in mix_earlier(sources) for half in pair)

    @staticmethod
    def backward(ctx, *grad_partials):
        if not any(ctx.needs_input_grad[4:]):
            return (None,) * len(ctx.needs_input_grad)
        readers, kept = ctx.readers, ctx.kept
        # each reader's in-block pieces (none: the layer's output fed no loss), then its earlier ones
        pieces = [kept.take_in_block(router.layer) for router in readers]
        rows, first = readers[0].weight.shape[0], readers[0].layer
        grads = kept.grad_rows(range(first, readers[-1].layer + 1), rows)
        for start, stop in ctx.runs:
            block_grad = weight_grad_product(grads, ctx.key_values.rows(start, stop), ctx.key_values.triton)
            for placed, router in zip(pieces, readers):
                top, local = (router.layer - first) * rows, router.local_heads
                placed += [
                    (router.columns(a, b), block_grad[top : top + rows, (a - start) * local : (b - start) * local])
                    for a, b in runs_within(router, start, stop)
                ]
        return (
            None,
            None,
            None,
            None,
            *(placed_columns(placed, router.weight) for placed, router in zip(pieces, readers)),
        )
