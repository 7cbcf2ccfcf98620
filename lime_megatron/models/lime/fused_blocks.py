"""A routing block on the Triton path: the tensors of its B layers allocated once per block.

Blocked routing (``routing_blocks``) runs three products once per block of B consumer layers
``[m0, m0 + B)``; on the Triton path they take two launches over tensors the block's layers
share, so the block costs the host a few operators and each layer none beyond its own two
launches (m0 one, its forward being the block's):

    forward    P = W_block[:, earlier] @ B[earlier]     P_keys, P_values [R, s, b, kv, d]
                   + W_block[:, m0] @ (K_m0 | V_m0)      (and B[m0] = (K_m0 | V_m0), Eq. 1)
               (R readers of earlier sources, m0 the first; reader q's routed keys/values are
               P[q], a view handed out by one ``unbind`` per block, which its own launch
               completes in place with its in-block sources after m0:
               ``fused_routing.FusedRouting.store_and_mix``; m0's is complete)
    backward   G[j] = sum_{m after the block} W_m[:, j]^T g_m     G [2B, s, b, kv, d]
               (keys then values; layer j's gradients G[j], G[B + j] are views its own launch
               completes in place with the in-block consumers' terms and its own)
               dW_q[:, earlier] = g_q @ B[earlier]^T for every reader q, into the readers'
               gradients laid one after another in one float32 buffer (each reader's own
               launch writes its in-block columns there; ``kernels.Placement``)

The backward's two products of different blocks share one launch
(``kernels.mix_beside_weight_grad``): when block k's readers have all run backward, so have the
consumers after block k - 1, and block k's earlier weight columns and block k - 1's G run
together; G of a block whose next block does not route here (or has fixed routers) takes a
launch of its own at the block's first backward.

``MixEarlierRows`` puts the block in autograd: its forward runs P's product and returns P's keys
tensor, which every reader takes as an input, so its backward runs after every reader's and
before the backward of any layer before the block (``key``, as in
``routing_blocks.MixEarlierSources``), and returns each reader's whole weight gradient.

A block routes here when each of its layers routes on the fused path alone (a product reading
its own layer; under tensor parallelism on the rank chunks, where its chunk's memory gathers
g_m: ``fused_routing.gathers_heads``) and its readers are consecutive layers from its first
whose sources are whole runs (no pruned source) whose columns step evenly from reader to reader
(the ``full`` and ``last`` routers; ``BlockReaders``); other blocks run the memory's general
blocked path (``routing_blocks``), whose products are Triton launches too.  Under tensor
parallelism P is one tensor ``[R, ranks * 2, s, b, local kv, d]`` (each reader's slot the rank
chunks its reduce-scatter takes), G holds the rank's own heads, and the readers' weight
gradients have all kv heads' rows and this rank's columns.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from lime_megatron.kernels import operands as kernels
from lime_megatron.kernels.launch_plans import LaunchPlans, Unplanned
from lime_megatron.kernels.operands import Columns, Halves, Placement
from lime_megatron.models.lime.consumer_gradients import ConsumerGradients
from lime_megatron.models.lime.key_value_rows import KeyValueRows
from lime_megatron.models.lime.router import LimeRouter, route_changes
from lime_megatron.models.lime.routing_blocks import RouterStack
from lime_megatron.models.lime.routing_products import weight_grad_dtype
from lime_megatron.models.lime.static_routing import StaticRouting


@dataclass(frozen=True)
class BlockReaders:
    """A block's readers of earlier sources, consecutive layers from its first, reader q with
    ``heads`` rows and ``width + q * widen`` weight columns whose source j sits at column ``(j -
    first_source - q * step) * local`` (``local``: the heads this rank holds of each source):
    their gradients lie one after another (``Placement``'s groups)."""

    routers: list[LimeRouter]
    width: int
    widen: int
    first_source: int
    step: int
    heads: int
    local: int

    @staticmethod
    def of(readers: list[LimeRouter]) -> BlockReaders | None:
        """The readers' layout, or None where they do not step evenly (then the block is not fused)."""
        first, heads = readers[0], readers[0].weight.shape[0]
        widen = readers[1].weight.shape[1] - first.weight.shape[1] if len(readers) > 1 else 0
        step = readers[1].sources[0] - first.sources[0] if len(readers) > 1 else 0
        for q, router in enumerate(readers):
            whole = router.read_sources == router.sources == list(range(router.sources[0], router.layer + 1))
            steps = (router.layer, router.weight.shape[1], router.sources[0]) == (
                first.layer + q,
                first.weight.shape[1] + q * widen,
                first.sources[0] + q * step,
            )
            if not (whole and steps):
                return None
        return BlockReaders(readers, first.weight.shape[1], widen, first.sources[0], step, heads, first.local_heads)

    def origin(self, q: int) -> int:
        """The element where reader q's gradient ``[heads, width + q * widen]`` starts."""
        return self.heads * (q * self.width + self.widen * (q * (q - 1) // 2))

    def every_reader(self, source: int) -> Placement:
        """A product over every reader's g (``[R * heads, ...]``) whose column 0 reads ``source``."""
        return Placement(
            (source - self.first_source) * self.local,
            self.width,
            group=self.heads,
            widen=self.widen,
            shift=-self.step * self.local,
        )

    def one_reader(self, q: int, source: int) -> Placement:
        """A product over reader q's g whose column 0 reads ``source``."""
        column = (source - self.first_source - q * self.step) * self.local
        return Placement(column, self.width + q * self.widen, origin=self.origin(q))

    def weight_grads(self, summed: torch.Tensor) -> list[torch.Tensor]:
        """Each reader's gradient, a view of ``summed`` (the buffer, splits summed)."""
        widths = [self.width + q * self.widen for q in range(len(self.routers))]
        return [summed.as_strided((self.heads, width), (width, 1), self.origin(q)) for q, width in enumerate(widths)]

    def elements(self) -> int:
        """Elements of all the readers' gradients."""
        return self.origin(len(self.routers))


def routes_alone(router: LimeRouter, triton: bool) -> bool:
    """Whether ``router``'s layer can route on the fused path (``fused_routing``): the Triton path
    (``triton``), no tensor parallelism, a learned or fixed product (not the identity) reading the
    layer's own rows."""
    return triton and router.sharding.size == 1 and not router.identity and router.read_sources[-1] == router.layer


def routes_on_ranks(router: LimeRouter, triton: bool) -> bool:
    """Whether ``router``'s layer can route on the fused path under tensor parallelism
    (``fused_routing``, its rank chunks): the Triton path (``triton``), every kv head held by one
    rank (no replicas: megatron shares a head between ranks only with fewer kv heads than ranks),
    a learned or fixed product reading its own layer (route pruning may drop it)."""
    sharding = router.sharding
    own = not router.identity and router.read_sources[-1] == router.layer
    return triton and sharding.size > 1 and sharding.replicas == 1 and own


def fusable_readers(routers: list[LimeRouter], routing: StaticRouting, triton: bool) -> BlockReaders | None:
    """The readers of the block of ``routers`` (its layers) where the block can route here
    (module docstring; under tensor parallelism on the rank chunks, ``routes_on_ranks``), else
    None."""
    readers = [router for router in routers if routing.blocked(router)]
    fused = readers and readers[0].layer == routers[0].layer
    fused = fused and all(routes_alone(router, triton) or routes_on_ranks(router, triton) for router in routers)
    return BlockReaders.of(readers) if fused else None


class FusedBlocks:
    """The fused blocks of a chunk (module docstring) over the memory's parts, those of
    ``gradients`` (which also says which layers read a layer); holds a block's shared tensors from
    the first of its layers that needs them until the last has taken its own.  Each block's
    launches are recorded in ``plans`` (``kernels.launch_plans``)."""

    def __init__(self, gradients: ConsumerGradients, plans: LaunchPlans | Unplanned):
        self.key_values, self.kept, self.routing = gradients.key_values, gradients.kept, gradients.routing
        self.stacked, self._consumers, self.plans = gradients.stacked, gradients.consumers, plans
        self._readers: dict[int, BlockReaders | None] = {}
        self._sums: dict[int, tuple[torch.Tensor, ...]] = {}  # forward: a reader's keys, values
        self._grads: dict[int, tuple[torch.Tensor, torch.Tensor, bool]] = {}  # backward: G[j], whether summed
        self._weights: dict[int, tuple[torch.Tensor, int]] = {}  # backward: the readers' gradients, splits

    def readers(self, block: range) -> BlockReaders | None:
        """The readers of ``block`` when it routes here (module docstring), else None."""
        if block.start not in self._readers:
            routers = [self.stacked.routers[m] for m in block]
            readers = fusable_readers(routers, self.routing, self.key_values.triton)
            if routers[0].sharding.size > 1 and self.kept.gathered is None:  # g_m kept as rows
                readers = None
            self._readers[block.start] = readers
        return self._readers[block.start]

    def fused(self, router: LimeRouter) -> bool:
        """Whether ``router``'s layer lies in a block that routes here."""
        return self.readers(self.routing.block_of(router.layer)) is not None

    def earlier_sums(self, router: LimeRouter, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """Forward, at each reader: P's keys (``MixEarlierRows``' output, the reader's input for
        the order of backward; under tensor parallelism P), the block's product run at its first
        reader (``key``, ``value``: its raw keys and values ``[s, b, local kv, d]``, which that
        product stores and mixes)."""
        block = self.routing.block_of(router.layer)
        readers = self.readers(block)
        if router is readers.routers[0]:
            MixEarlierRows.apply(self, block, key, value, *(reader.weight for reader in readers.routers))
        return self._sums[router.layer][2]

    def take_sums(self, layer: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Reader ``layer``'s slots of P (its routed keys and values, to complete in place; under
        tensor parallelism its rank chunks and None)."""
        keys, values, _ = self._sums.pop(layer)
        return keys, values

    def mix_earlier(self, block: range, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """P (module docstring) of ``block``'s readers, with the first reader's own source m0 (its
        raw keys and values ``key``, ``value`` ``[s, b, local kv, d]``, stored into the buffer on
        the way, which they allocate when m0 is the chunk's first layer): one launch per row block
        of earlier sources, m0 added in the last.  The first reader's slots are then its routed
        keys/values (under tensor parallelism its sums for every rank's heads, to reduce-scatter:
        P is ``[R, ranks * 2, s, b, local kv, d]``, each reader's slot its rank chunks); each
        reader's slots kept for it; returns P's keys (P under tensor parallelism)."""
        readers = self.readers(block).routers
        rows = self.key_values
        rows.allocate(key)
        keys, values = self._new_sums(readers)
        stack = self.stacked.stack(key)
        tensors = (keys, values, key, value, stack.matrix, *rows.tensors())
        facts = (route_changes(), rows.cuts)
        self.plans.launch(
            ("earlier sums", block.start), facts, tensors, self._mix_earlier, block, keys, values, stack, key, value
        )
        value_slots = values.unbind(0) if values is not None else (None,) * len(readers)
        for reader, key_slot, value_slot in zip(readers, keys.unbind(0), value_slots):
            self._sums[reader.layer] = (key_slot, value_slot, keys)
        return keys

    def _mix_earlier(
        self,
        block: range,
        keys: torch.Tensor,
        values: torch.Tensor | None,
        stack: RouterStack,
        key: torch.Tensor,
        value: torch.Tensor,
    ) -> None:
        """``mix_earlier``'s launches into P (``keys``, ``values``; ``_new_sums``') from the
        readers' columns in ``stack`` (this pass's ``RouterStack``)."""
        readers, rows = self.readers(block).routers, self.key_values
        if values is None:
            out = Halves.of_rank_chunks(keys, 0, len(readers) * readers[0].weight.shape[0])
        else:
            out = Halves.of_groups(keys, values)
        layers = range(readers[0].layer, readers[-1].layer + 1)
        own = (stack.operand(layers, range(block.start, block.start + 1)), Halves.of_heads(key, value))
        *others, last = _earlier_spans(rows, readers, block.start)
        added = None
        for start, stop in others:
            kernels.mix(out, (stack.operand(layers, range(start, stop)), rows.halves(start, stop)), accumulate=added)
            added = out
        first = (stack.operand(layers, range(*last)), rows.halves(*last))
        kernels.mix(out, first, own, accumulate=added, store=rows.halves(block.start, block.start + 1))

    def _new_sums(self, readers: list[LimeRouter]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """P of ``readers``, uninitialised: keys and values ``[R, s, b, kv, d]`` each, or under
        tensor parallelism one ``[R, ranks * 2, s, b, local kv, d]`` and None."""
        s, b, heads, d = self.key_values.kv_shape
        like, ranks = self.key_values.buffer, readers[0].sharding.size
        if ranks > 1:
            return like.new_empty(len(readers), ranks * 2, s, b, heads, d), None
        return like.new_empty(len(readers), s, b, heads, d), like.new_empty(len(readers), s, b, heads, d)

    def take_grads(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """Backward: layer ``layer``'s gradient slots G[j], G[B + j] and whether they hold the
        later consumers' share already (to add to in place), G allocated and that share computed
        by the block's first layer to need them."""
        block = self.routing.block_of(layer)
        if layer not in self._grads:
            self._later_grads(block)
        return self._grads.pop(layer)

    def _later_grads(self, block: range) -> None:
        """G of ``block`` with the share of the chunk's consumers after it (one launch), or
        unsummed where none reads it."""
        consumers = self._later_consumers(block)
        if not consumers:
            self._hand_out(block, self._new_grads(block), summed=False)
            return
        grads, stack = self._later_grads_made(block, consumers)
        facts = (route_changes(), consumers)
        tensors = (grads, stack.matrix, *self.kept.tensors())
        site, launches = ("later sums", block.start), self._later_sums
        self.plans.launch(site, facts, tensors, launches, block, consumers, grads, stack)

    def _later_sums(self, block: range, consumers: range, grads: torch.Tensor, stack: RouterStack) -> None:
        """``_later_grads``' launch: G (``grads``) of ``block``, the later ``consumers``' share."""
        kernels.mix(*self._later_product(block, consumers, grads, stack))

    def _later_consumers(self, block: range) -> range:
        """The chunk's layers after ``block`` that read any of its layers."""
        stop = min(max(self._consumers(source)[1] for source in block), self.key_values.layers.stop)
        return range(block.stop, stop)

    def _later_grads_made(self, block: range, consumers: range) -> tuple[torch.Tensor, RouterStack]:
        """(G of ``block``, allocated and handed out; this pass's router stack) for the product of
        the later ``consumers``' share, whose g_m must be kept."""
        self.kept.require(block.start, consumers)
        grads = self._new_grads(block)
        self._hand_out(block, grads, summed=True)
        return grads, self.stacked.stack(grads)

    def _later_product(
        self, block: range, consumers: range, grads: torch.Tensor, stack: RouterStack
    ) -> tuple[Halves, tuple[Columns, Halves]]:
        """The product ``(out, (W^T, g))`` (a ``mix``'s) of the later ``consumers``' share into G
        (``grads``) of ``block``."""
        columns = stack.operand(consumers, block, transposed=True)
        kv_heads = self.stacked.routers[consumers.start].weight.shape[0]
        return Halves.of_groups(grads), (columns, self.kept.grad_halves(consumers, kv_heads))

    def _new_grads(self, block: range) -> torch.Tensor:
        """G ``[2B, s, b, kv, d]`` of ``block`` (module docstring), uninitialised."""
        return self.key_values.buffer.new_empty(2 * len(block), *self.key_values.kv_shape)

    def _hand_out(self, block: range, grads: torch.Tensor, summed: bool) -> None:
        """Keep layer j's slots G[j], G[B + j] for it (``take_grads``), ``summed``: whether they
        will hold the later consumers' share."""
        slots = grads.unbind(0)
        for j, layer in enumerate(block):
            self._grads[layer] = (slots[j], slots[len(block) + j], summed)

    def weight_target(self, router: LimeRouter, grads: Halves) -> tuple[torch.Tensor, Callable[[int], Placement], int]:
        """Backward of reader ``router``: (the block's float32 buffer of its readers' gradients,
        where a product of g_l whose column 0 reads a source goes, the position splits), the
        buffer allocated by the block's first reader to need it."""
        block = self.routing.block_of(router.layer)
        readers = self.readers(block)
        if block.start not in self._weights:  # splits fit for the block's product over earlier rows
            rows, columns = len(readers.routers) * readers.heads, (block.start - readers.first_source) * readers.local
            tiles = kernels.ceil_div(rows, kernels.block(rows)) * kernels.ceil_div(columns, kernels.block(columns))
            splits = kernels.weight_grad_splits(grads, tiles)
            shape = (splits, readers.elements()) if self.key_values.deterministic else (readers.elements(),)
            self._weights[block.start] = grads.keys.new_zeros(shape, dtype=weight_grad_dtype(router.weight)), splits
        buffer, splits = self._weights[block.start]
        q = readers.routers.index(router)
        return buffer, lambda source: readers.one_reader(q, source), splits

    def earlier_weight_grads(self, block: range) -> list[torch.Tensor]:
        """``MixEarlierRows``' backward: every reader's columns of the sources before the block,
        g_q @ B[earlier]^T, one launch per row block into the readers' buffer, the last launch
        also running the block before's later-consumer product (``_later_product``) where that
        block is fused and its later consumers have all run (they are this block's layers and
        those after); each reader's whole gradient (views of it)."""
        readers = self.readers(block)
        layers = range(readers.routers[0].layer, readers.routers[-1].layer + 1)
        self.kept.require(block.start, layers)  # so a trainable reader's launch made the buffer
        buffer, splits = self._weights.pop(block.start)
        before = self._fused_before(block)
        consumers = self._later_consumers(before) if before else range(0)
        later = self._later_grads_made(before, consumers) if consumers else (None, None)
        facts = (route_changes(), self.key_values.cuts, self.key_values.deterministic, splits, before, consumers)
        stack_matrix = None if later[1] is None else later[1].matrix
        tensors = (buffer, later[0], stack_matrix, *self.kept.tensors())
        site, launches = ("earlier weight grads", block.start), self._earlier_weight_grads
        self.plans.launch(site, facts, tensors, launches, block, buffer, splits, before, consumers, *later)
        deterministic = self.key_values.deterministic
        return readers.weight_grads(buffer.sum(0) if deterministic else buffer)

    def _earlier_weight_grads(
        self,
        block: range,
        buffer: torch.Tensor,
        splits: int,
        before: range | None,
        consumers: range,
        later_grads: torch.Tensor | None,
        stack: RouterStack | None,
    ) -> None:
        """``earlier_weight_grads``' launches into the readers' ``buffer``, the last beside the
        product of the later ``consumers``' share into G (``later_grads``) of the block ``before``
        where there are any (``_later_grads_made``')."""
        readers, deterministic = self.readers(block), self.key_values.deterministic
        layers = range(readers.routers[0].layer, readers.routers[-1].layer + 1)
        grads = self.kept.grad_halves(layers, readers.heads)
        *others, last = _earlier_spans(self.key_values, readers.routers, block.start)
        for start, stop in others:
            rows = self.key_values.halves(start, stop)
            kernels.weight_grad(buffer, grads, rows, readers.every_reader(start), deterministic, splits)
        rows, placed = self.key_values.halves(*last), readers.every_reader(last[0])
        if consumers:
            out, later = self._later_product(before, consumers, later_grads, stack)
            kernels.mix_beside_weight_grad(out, later, buffer, grads, rows, placed, deterministic, splits)
        else:
            kernels.weight_grad(buffer, grads, rows, placed, deterministic, splits)

    def _fused_before(self, block: range) -> range | None:
        """The chunk's block before ``block`` where it routes here and its G is not made yet."""
        if block.start == self.key_values.layers.start:
            return None
        before = self.routing.block_of(block.start - 1)
        return before if self.readers(before) is not None and before[-1] not in self._grads else None


def _earlier_spans(key_values: KeyValueRows, readers: list[LimeRouter], before: int) -> tuple[tuple[int, int], ...]:
    """The row blocks (``KeyValueRows.row_blocks``) of the sources before layer ``before`` that
    any of ``readers`` reads: from the first reader's first source (its window reaches furthest
    back)."""
    return key_values.row_blocks(readers[0].sources[0], before)


class MixEarlierRows(torch.autograd.Function):
    """A fused block in autograd (module docstring).

    forward(blocks (``FusedBlocks``), block (its layers), key, value (raw keys and values of its
            first reader), *the readers' weights) -> P's keys ``[R, s, b, kv, d]`` (each reader's
            input)
    backward: each reader's whole weight gradient (``FusedBlocks.earlier_weight_grads``), the
    readers' own launches having written their in-block columns; nothing for a fixed router.
    """

    @staticmethod
    def forward(ctx, blocks: FusedBlocks, block: range, key: torch.Tensor, value: torch.Tensor, *weights):
        ctx.set_materialize_grads(False)
        ctx.blocks, ctx.block = blocks, block
        return blocks.mix_earlier(block, key, value)

    @staticmethod
    def backward(ctx, _):
        if not any(ctx.needs_input_grad[4:]):
            return (None,) * len(ctx.needs_input_grad)
        return None, None, None, None, *ctx.blocks.earlier_weight_grads(ctx.block)
