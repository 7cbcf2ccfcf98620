"""A layer's routing on the Triton path: Eqs. 1-2 in one launch, each gradient in one launch.

Where the torch path stores a layer's keys/values (Eq. 1), multiplies its sources (Eq. 2) and,
in backward, rearranges the incoming gradient into rows, keeps it, and runs the router-weight and
row-gradient products, each with the views and copies around it, the Triton path reads and
writes every operand where it lies (``kernels.operands.Halves``):

    forward    routed (K|V) = [partial +] W_l[:, run] @ B[run] + W_l[:, l] @ (K_l|V_l)
               and B[l] = (K_l|V_l) on the way                        one mix_kernel launch
    backward   grad (K_l|V_l) = [later +] [downstream +] W_M[:, l]^T G_M + W_l[:, l]^T g_l
               and dW_l = g_l @ B[sources]^T (float32), the dead rows
               B[l] = g_l once it has read them                       one mix_kernel launch

(``run``: the layer's sources before it in the same row block, from its routing block's start;
``partial``: the block's sums over earlier sources, ``routing_blocks``; ``M``: the layer's other
consumers in this chunk, their g_m kept in their dead rows, ``kept_gradients``; ``later``: the
block's share from consumers after it, ``consumer_gradients``; ``downstream``: later pipeline
chunks' share, ``kept_gradients``.)  In a block that routes on this path too (``fused_blocks``)
``partial`` and ``later`` are the block's tensors, completed in place and handed on as the
layer's routed keys/values and their gradients (the block's first layer runs no forward launch of
its own: the block's product adds and stores its keys/values), and a blocked layer's dW_l columns
go into its block's buffer of its readers' gradients, which the block returns (its earlier
columns written there in one launch for the block).  The backward's launch runs two kinds of
programs: the row gradient's tiles, and the weight gradient's, which read B[l] and then write g_l
over it (each row of B[l] is read by one program alone when g_l's rows fit one tile, as they do up
to 64 heads; beyond, two launches).  Besides the launches the host allocates the outputs: 3 operators per layer in
forward and 4 in backward at B = 1, 8 with autograd's accumulation of the router's gradient; in a
fused block 4 per layer (the two launches, the view of the router's gradient and its
accumulation) and 8 per block, its first layer's forward launch being the block's
(``tests/models/test_fused_routing.py`` holds the counts).

Sources in another pipeline chunk's rows take one launch more per row block, in forward and for
the weight gradient; later pipeline chunks' share of the row gradient is added in the row
gradient's launch.

Tensor parallelism (Eq. 2 split by input head, ``head_parallel``).  Each rank holds its heads'
rows and its columns of every router, so the same two launches run over them with one collective
each (``gathers_heads`` says where: no head shared by ranks, every router reading its own layer,
every block with earlier sources fused, ``fused_blocks``, whose P holds each reader's rank
chunks; a chunk routes all its layers one way):

    forward    this rank's columns' sums for every rank's heads, written as the rank chunks
               [ranks * 2, s, b, local heads, d] a reduce-scatter takes   one mix_kernel launch
               reduce-scatter: this rank's routed keys and values in attention's layout
    backward   all-gather of g_l (this rank's keys' and values' gradients, one ``stack``) into the
               layer's rank chunks, where it stays kept (``KeptGradients.gather``), then the row
               gradient of this rank's heads and dW_l of its columns, reading every consumer's
               kept g_m there                                            one mix_kernel launch

4 operators per layer beyond the TP = 1 path's: the two collectives, and the ``stack`` and the
``unbind`` around them (``tests/parallel/test_lime_tensor_parallel.py`` holds the count).
KV-cache decoding keeps no gradient: its steps route this way (and without tensor parallelism as
above, in one launch) whatever the block size (``routes_new_tokens``).

Where a layer's case is not one of these (``FusedRouting.serves`` decides), the memory's general
path runs, its products Triton launches too (``routing_products``; the row gradients read the kept
g_m where they lie, ``StackedRouting.row_grad``): the identity routing of layer 0, a pruned router
none of whose kept routes reads its own layer, a blocked layer whose block does not route here,
and under tensor parallelism heads shared by ranks (rows layout, collectives) and chunks with a
block that does not route as one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from lime_megatron.kernels import operands as kernels
from lime_megatron.kernels.launch_plans import LaunchPlans, Unplanned
from lime_megatron.kernels.operands import Columns, Halves, Placement
from lime_megatron.models.lime.consumer_gradients import ConsumerGradients
from lime_megatron.models.lime.fused_blocks import FusedBlocks, fusable_readers, routes_alone, routes_on_ranks
from lime_megatron.models.lime.kept_gradients import KeptGradients
from lime_megatron.models.lime.key_value_rows import KeyValueRows
from lime_megatron.models.lime.router import LimeRouter, route_changes
from lime_megatron.models.lime.routing_products import weight_grad_dtype
from lime_megatron.models.lime.stacked_routing import StackedRouting
from lime_megatron.models.lime.static_routing import StaticRouting


class FusedRouting:
    """A layer's routing on the Triton path (module docstring), over the memory's parts: the rows
    ``key_values``, the kept g_m ``kept``, the blocks of ``routing``, the router stack of
    ``stacked`` and the block and pipeline shares of ``gradients``; each layer's launches
    recorded in the model chunk's ``plans`` and launched again in later passes
    (``kernels.launch_plans``; None: built every pass)."""

    def __init__(
        self,
        key_values: KeyValueRows,
        kept: KeptGradients,
        routing: StaticRouting,
        stacked: StackedRouting,
        gradients: ConsumerGradients,
        plans: LaunchPlans | None = None,
    ):
        self.key_values, self.kept, self.routing, self.stacked, self.gradients = (
            key_values,
            kept,
            routing,
            stacked,
            gradients,
        )
        self.plans = plans or Unplanned()
        self.blocks = FusedBlocks(gradients, self.plans)
        self._serves: dict[int, bool] = {}  # serves, by layer: asked in forward and backward

    def routes_new_tokens(self, router: LimeRouter) -> bool:
        """Whether a KV-cache decoding step of ``router``'s layer routes here (``store_and_mix``
        over all its sources, blocked or not; no gradient kept)."""
        return routes_alone(router, self.key_values.triton) or routes_on_ranks(router, self.key_values.triton)

    def serves(self, router: LimeRouter) -> bool:
        """Whether ``router``'s layer routes as the module docstring says: alone
        (``fused_blocks.routes_alone``) and, where its block mixes its earlier sources, in a block
        that routes on the fused path too (``fused_blocks``); under tensor parallelism every layer
        but the identity's where the memory gathers g_l (``gathers_heads``)."""
        serves = self._serves.get(router.layer)
        if serves is None:
            if self.kept.gathered is not None:
                serves = not router.identity
            else:
                alone = routes_alone(router, self.key_values.triton)
                serves = alone and (not self.routing.blocked(router) or self.blocks.fused(router))
            self._serves[router.layer] = serves
        return serves

    def store_and_mix(
        self, router: LimeRouter, key: torch.Tensor, value: torch.Tensor, in_block: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Eqs. 1-2 of ``router``'s layer (module docstring): its keys/values ``[s, b, h, d]``
        written into the buffer, the routed keys and values returned (``[s, b, h, d]`` each, two
        tensors; a blocked layer's are its block's sums over earlier sources, completed in
        place: ``fused_blocks``; with ``in_block`` False the layer's product covers all its
        sources whatever its block: KV-cache decoding, ``memory.route_new_tokens``; under tensor
        parallelism this rank's heads', its sums for every rank's heads reduce-scattered,
        ``_scattered``).  One launch per row block of sources (one unless the layer reads another
        pipeline chunk's rows or skips sources)."""
        rows = self.key_values
        rows.allocate(key)
        blocked, since, ranks = in_block and self.routing.blocked(router), 0, router.sharding.size
        if blocked:
            keys, values = self.blocks.take_sums(router.layer)
            since = self.routing.block_of(router.layer).start + 1  # the block's launch added its first
        elif ranks > 1:
            keys, values = key.new_empty(ranks * 2, *rows.kv_shape), None
        else:
            keys, values = key.new_empty(rows.kv_shape), key.new_empty(rows.kv_shape)
        if since <= router.layer:  # else its block's launch stored and mixed this layer
            facts = (in_block, blocked, since, route_changes(), rows.cuts)
            tensors = (router.weight, key, value, keys, values, *rows.tensors())
            site, launches = ("store and mix", router.layer), self._store_and_mix
            self.plans.launch(site, facts, tensors, launches, router, keys, values, blocked, since, key, value)
        return (keys, values) if ranks == 1 else self._scattered(router, keys)

    def _store_and_mix(
        self,
        router: LimeRouter,
        keys: torch.Tensor,
        values: torch.Tensor | None,
        blocked: bool,
        since: int,
        key: torch.Tensor,
        value: torch.Tensor,
    ) -> None:
        """``store_and_mix``'s launches into its outputs ``keys``, ``values`` (under tensor
        parallelism rank chunks and None; ``blocked``: the block's sums, added to)."""
        if values is None:
            out = Halves.of_rank_chunks(keys, 0, router.weight.shape[0])
        else:
            out = Halves.of_heads(keys, values)
        self._mix_sources(router, out, out if blocked else None, since, key, value)

    def _mix_sources(
        self, router: LimeRouter, out: Halves, added: Halves | None, since: int, key: torch.Tensor, value: torch.Tensor
    ) -> None:
        """``out = added + W_l[:, sources from since] @ B[sources] + W_l[:, l] @ (K_l|V_l)``, the
        layer's keys/values ``key``, ``value`` stored into its rows on the way: one launch, and one
        more per further row block of sources."""
        rows = self.key_values
        *others, (start, _) = self.routing.source_spans(router, since)
        for other_start, other_stop in others:
            term = (_router_columns(router, other_start, other_stop), rows.halves(other_start, other_stop))
            kernels.mix(out, term, accumulate=added)
            added = out
        layer = router.layer
        first = (_router_columns(router, start, layer), rows.halves(start, layer)) if start < layer else None
        own = (_router_columns(router, layer, layer + 1), Halves.of_heads(key, value))
        kernels.mix(out, first, own, accumulate=added, store=rows.halves(layer, layer + 1))

    def _scattered(self, router: LimeRouter, chunks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Under tensor parallelism (Eq. 2 split by input head, ``head_parallel``): this rank's
        columns' sums for every rank's heads, the rank chunks ``[ranks * 2, s, b, local heads,
        d]`` a reduce-scatter takes, reduce-scattered: this rank's own heads' routed keys and
        values in attention's layout, ``[s, b, local heads, d]`` each."""
        routed = chunks.new_empty(2, *self.key_values.kv_shape)
        torch.distributed.reduce_scatter_tensor(routed, chunks, group=router.sharding.group)
        return routed.unbind(0)

    def backward(
        self, router: LimeRouter, grad_keys: torch.Tensor, grad_values: torch.Tensor, since: int | None
    ) -> tuple[tuple[slice, torch.Tensor] | None, torch.Tensor, torch.Tensor]:
        """A layer's backward, g_l being its routed keys' and values' gradients ``grad_keys``,
        ``grad_values`` (gathered from every rank first under tensor parallelism, ``kept.gather``):
        ``(weight gradient piece or None, grad keys, grad values)``.  The piece (``since``: its
        first source layer; None: no weight gradient) is ``(columns, [kv_heads, len(columns)])``
        in ``weight_grad_dtype``, dL/dW_l = g_l @ B[sources]^T at the columns of the sources from
        layer ``since`` on, zero where no kept route reads; a fused block's reader returns none,
        its columns written into its block's buffer (``_weight_target``); the keys'/values'
        gradients ``[s, b, h, d]`` each are ``kv_grad``'s.  One launch for both where g_l's rows
        fit one tile (``kernels.fits_one_tile``): the weight gradient's programs keep g_l into
        l's dead rows after reading them; else one launch each (gathered: one launch, g_l being
        kept already).  Sources in another pipeline chunk's rows take one weight-gradient launch
        more each."""
        gathered = self.kept.gathered is not None
        if gathered:
            grads = self.kept.gather(router.layer, grad_keys, grad_values)
        else:
            grads = Halves.of_heads(grad_keys, grad_values)
        if since is None:
            return None, *self.kv_grad(router, grads)
        rows, spans = self.key_values, self.routing.source_spans(router, since)
        weight, placed, splits, piece = self._weight_target(router, grads, spans)
        if not (gathered or kernels.fits_one_tile(grads)):
            for start, stop in spans:
                kernels.weight_grad(weight, grads, rows.halves(start, stop), placed(start), rows.deterministic, splits)
            return piece(), *self.kv_grad(router, grads)
        outputs = self._kv_grad_outputs(router, grads)
        facts = (since, splits, route_changes(), rows.cuts, self.kept.read_later, gathered, rows.deterministic)
        tensors = (weight, *self._kv_grad_tensors(router, grads, outputs))
        site = ("backward", router.layer)
        self.plans.launch(site, facts, tensors, self._backward, router, grads, outputs, weight, placed, spans, splits)
        self.kept.mark_kept(router.layer)
        return piece(), outputs[0], outputs[1]

    def _backward(
        self,
        router: LimeRouter,
        grads: Halves,
        outputs: tuple,
        weight: torch.Tensor,
        placed: Callable[[int], int | Placement],
        spans: list[tuple[int, int]],
        splits: int,
    ) -> None:
        """``backward``'s launches where g_l fits one tile: the weight gradient of each span of
        sources but the last, then that of the last with the row gradient into ``outputs``
        (``_kv_grad_outputs``'), g_l kept into the layer's dead rows (unless gathered, kept already)."""
        rows = self.key_values
        *others, (own_start, own_stop) = spans
        for start, stop in others:
            kernels.weight_grad(weight, grads, rows.halves(start, stop), placed(start), rows.deterministic, splits)
        out, first, mine, added, _, more = self._kv_grad_operands(router, grads, outputs)
        own_row = None if self.kept.gathered is not None else (router.layer - own_start) * router.local_heads
        own_rows, at = rows.halves(own_start, own_stop), placed(own_start)
        kernels.mix_and_weight_grad(
            out, first, mine, weight, own_rows, at, own_row, rows.deterministic, splits, added, more
        )

    def _weight_target(self, router: LimeRouter, grads: Halves, spans: list[tuple[int, int]]) -> tuple:
        """Where ``backward``'s weight-gradient products over ``spans`` go: ``(target, source ->
        where a product reading from that source layer goes, position splits, () -> the piece
        backward returns)``.  A fused block's reader writes into its block's buffer of its
        readers' gradients and returns no piece (``MixEarlierRows`` returns its gradient); any
        other layer into zeros of its own (summed over the splits where deterministic)."""
        if self.routing.blocked(router):
            target, in_block, splits = self.blocks.weight_target(router, grads)
            return target, in_block, splits, lambda: None
        router_weight = router.weight
        columns = slice(router.columns(*spans[0]).start, router_weight.shape[1])
        widest = max(stop - start for start, stop in spans) * router.local_heads
        width, dtype = columns.stop - columns.start, weight_grad_dtype(router_weight)
        weight, splits = kernels.weight_grad_output(grads, widest, width, dtype, self.key_values.deterministic)

        def placed(source: int) -> int:
            return router.columns(source, source + 1).start - columns.start

        def piece() -> tuple[slice, torch.Tensor]:
            return columns, weight.sum(0) if self.key_values.deterministic else weight

        return weight, placed, splits, piece

    def kv_grad(self, router: LimeRouter, grads: Halves) -> tuple[torch.Tensor, torch.Tensor]:
        """The gradient of layer l's keys and values (``[s, b, h, d]`` each): sum over its
        consumers m of W_m[:, l]^T g_m, g_l being ``grads`` (kept into l's dead rows on the way)
        and the others' kept; with blocked routing the share of consumers after l's block
        (computed for the block at its first use) added, and only the in-block consumers
        multiplied here; under pipeline parallelism later chunks' share
        (``KeptGradients.downstream_halves``) added.  One launch."""
        outputs = self._kv_grad_outputs(router, grads)
        out, first, mine, added, kept_rows, more = self._kv_grad_operands(router, grads, outputs)
        kernels.mix(out, first, mine, accumulate=added, store=kept_rows, more=more)
        self.kept.mark_kept(router.layer)
        return outputs[0], outputs[1]

    def _kv_grad_outputs(self, router: LimeRouter, grads: Halves) -> tuple:
        """``(keys, values, later, stack)``: ``kv_grad``'s outputs (new, or the layer's slots of its
        fused block's gradients), the share added to them (``Halves`` or None) and this pass's
        router stack where the layer has in-block consumers (else None), after the bookkeeping the
        mix relies on (its consumers' g_m kept, the stack refreshed, the buffer g_l is kept in
        allocated): what ``_kv_grad_operands`` reads besides facts."""
        layer, kept = router.layer, self.kept
        kept.require(layer, self._consumers(router))
        stack = self.stacked.stack(grads.keys) if self._in_block_consumers(router) else None
        if kept.gathered is None:
            kept.buffer(router.weight.shape[0])
        if self.blocks.fused(router):
            keys, values, summed = self.blocks.take_grads(layer)
            return keys, values, Halves.of_heads(keys, values) if summed else None, stack
        kv_shape = self.key_values.kv_shape
        keys, values, later = grads.keys.new_empty(kv_shape), grads.keys.new_empty(kv_shape), None
        if self.routing.block > 1:
            later = self.gradients.later_consumer_halves(layer, self.routing.block_of(layer))
        return keys, values, later, stack

    def _consumers(self, router: LimeRouter) -> range:
        """The own layers after ``router``'s that read it."""
        layer = router.layer
        return range(layer + 1, min(self.gradients.consumers(layer)[1], self.key_values.layers.stop))

    def _in_block_consumers(self, router: LimeRouter) -> range:
        """``_consumers`` within ``router``'s routing block when blocked (the later ones' share is
        the block's)."""
        consumers = self._consumers(router)
        if self.routing.block == 1:
            return consumers
        return range(consumers.start, min(consumers.stop, self.routing.block_of(router.layer).stop))

    def _kv_grad_tensors(self, router: LimeRouter, grads: Halves, outputs: tuple) -> tuple:
        """Every tensor ``_kv_grad_operands`` reads (a launch plan's, ``kernels.launch_plans``)."""
        keys, values, later, stack = outputs
        later_tensors = (None, None) if later is None else (later.keys, later.values)
        stack_matrix = None if stack is None else stack.matrix
        return (
            router.weight,
            grads.keys,
            grads.values,
            keys,
            values,
            *later_tensors,
            stack_matrix,
            *self.kept.tensors(),
        )

    def _kv_grad_operands(self, router: LimeRouter, grads: Halves, outputs: tuple) -> tuple:
        """``kv_grad``'s mix's operands ``(out, first, mine, added, kept rows, more)`` over
        ``_kv_grad_outputs``' ``outputs``."""
        layer, kept, kv_heads = router.layer, self.kept, router.weight.shape[0]
        keys, values, later, stack = outputs
        consumers, first = self._in_block_consumers(router), None
        if consumers:
            columns = stack.operand(consumers, range(layer, layer + 1), transposed=True)
            first = (columns, kept.grad_halves(consumers, kv_heads))
        mine = (_router_columns(router, layer, layer + 1, transposed=True), grads)
        kept_rows = None if kept.gathered is not None else kept.grad_halves(range(layer, layer + 1), kv_heads)
        out = Halves.of_heads(keys, values)
        return out, first, mine, later, kept_rows, kept.downstream_halves(layer)


def gathers_heads(routers: dict[int, LimeRouter], triton: bool, routing: StaticRouting) -> Any:
    """The tensor-parallel process group whose ranks' g_l a chunk's memory gathers on the Triton
    path (``KeptGradients.gather``), or None where its layers route otherwise: where every layer
    but the identity's ``routes_on_ranks`` and, blocked, every block whose layers mix earlier
    sources routes as one (``fused_blocks.fusable_readers``).  A chunk routes all its layers one
    way: the g_m its layers keep are read by the others'."""
    learned = [router for router in routers.values() if not router.identity]
    if not learned or not all(routes_on_ranks(router, triton) for router in learned):
        return None
    for start in range(min(routers), max(routers) + 1, routing.block):
        block = [routers[layer] for layer in routing.block_of(start)]
        if any(routing.blocked(router) for router in block) and fusable_readers(block, routing, triton) is None:
            return None
    return learned[0].sharding.group


def _router_columns(router: LimeRouter, start: int, stop: int, transposed: bool = False) -> Columns:
    """``router.weight[:, columns of sources start..stop-1]`` (``.t()`` when ``transposed``)."""
    weight = router.weight
    return Columns.of(weight, slice(0, weight.shape[0]), router.columns(start, stop), transposed)
