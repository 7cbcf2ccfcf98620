"""The layer-integrated memory: the key/value buffer B of one forward pass (paper §4, Eqs. 1-2).

Layout.  One preallocated tensor ``buffer`` of shape ``[num_layers * kv_heads, 2 * s * b * d]``
holds the raw keys and values of every layer: row ``l * kv_heads + h`` is head h of layer l, its
columns are ``(k|v, s, b, d)``.  Layer l writes its own rows once (Eq. 1) and mixes rows of its
source layers with one matrix product per contiguous run of sources (Eq. 2):

    routed_l = W_l @ buffer[rows of sources(l)]            [kv_heads, 2 * s * b * d]

so nothing is re-concatenated per layer (the official code's per-layer ``torch.cat`` costs
O(L^2) time and saved memory).  Layer 0 has no router (W_0 = I over its own rows,
``LimeRouter.identity``): no product is run for it, in forward, backward, the rebuild of its
routed keys/values or decoding, and under tensor parallelism no collective either (each rank's
routed heads are its own heads).

Backward.  ``RouteKeysValues`` gives the router weight gradient ``g_l @ buffer[sources]^T``
(accumulated and returned in float32 for bf16/fp16 rows, ``routing_blocks.float32_product``; a bf16 run keeps
its routers in float32 and the products cast them to the rows' dtype) and
the gradient of layer l's own keys/values, which collects the contributions of every *consumer*
m >= l of layer l:  grad(kv_l) = sum_m W_m[:, block l]^T g_m.  Autograd runs layer l's backward
only after every later layer's (later layers depend on layer l through the residual stream), so
when layer m's backward finishes its raw rows are dead: they are overwritten with g_m, and
grad(kv_l) is one matrix product over the rows l..stop of consumers.  No second buffer is
allocated for gradients.

Order.  Every read of layer l's raw rows comes before their overwrite, and every read of a kept
g_m after its write, by an autograd edge, never by the engine's choice among ready nodes
(``tests/models/test_backward_ordering.py`` checks the edges and runs the engine with that choice
inverted):

- a consumer m > l (its weight gradient, a dynamic router's ``token_weight_grad``; its g_m and p_m
  kept for ``_consumer_grad``): layer m's keys are computed from layer l's output (the residual
  stream), so the gradient m's ``RouteKeysValues`` returns for them flows down to l's;
- layer l itself reads its rows (weight gradient, ``token_weight_grad``) in its own backward,
  before ``kv_grad`` writes g_l;
- a block's ``routing_blocks.MixEarlierSources``: its input ``key`` (raw keys of the block's first
  reader, gradient None) makes that reader's QKV projection, and so every earlier layer's
  backward, wait for it; it runs after the readers' ``RouteKeysValues``, which take its outputs;
- the rebuild of layer m's dropped routed K/V (``lime_recompute_routed_kv``) runs when a node of
  m's core attention unpacks a saved tensor: those nodes take the routed K/V, so they lie above
  m's ``RouteKeysValues`` and every earlier layer's;
- full activation recompute reruns a chunk's forward, edges included, inside its backward; rows of
  an earlier chunk are written by that chunk's backward, which needs the gradient of this chunk's
  input, returned when its backward ends;
- pipeline stages: external rows received from another rank are never written; those kept from
  this rank's earlier chunk are written by that chunk's backward, which needs the gradient of
  its output, the later chunks' input (as above); the own rows' downstream gradient is handed
  over in a hook on the chunk's output, before any layer's backward
  (``lime_megatron.parallel.pipeline``).

Dynamic routers (``dynamic_router``).  Their weights are per token, so ``mix_by_token`` is one
multiply-add per source row (same head only) instead of a product, ``token_weight_grad`` gives
dL/dp_l, and a source's row gradient is sum_m p_m[..., l] * g_m over the kept g_m
(``_token_mixed_grad``), with each consumer's p_m kept from its backward (``keep_token_weights``).
Route pruning (``pruning``) leaves a source none of a router's kept routes reads out of its
``read_sources``: no product reads its rows.

Routed K/V.  The products write the routed keys and the routed values as two tensors
(``routing_product_keys_values``), ``[s, b, kv_heads, d]`` each: attention keeps the rotated keys
and the values for backward, and the routed keys, which only RoPE reads, are freed, so LIMe keeps
its buffer where the baseline keeps its QKV output.  With ``lime_recompute_routed_kv``
``recompute.recompute_in_backward`` also drops the values and rotated keys from autograd's saved
tensors and rebuilds them from the buffer when backward first needs them (one extra router
product per layer).

Decoding.  With a KV cache (``lime_megatron.inference.decoding``) each forward pass is one decoding step
over the step's new tokens only: its memory holds their raw keys/values of all layers
(``[num_layers * kv_heads, 2 * s_new * b * d]``, one token per sequence after the prompt) and is
freed with the step; the routed keys/values go to the per-layer cache.  ``route_new_tokens`` is
that path: Eqs. 1-2 without autograd.

The memory of a pass is found by layers through a small handle tensor that megatron threads
through every layer (and through its activation-recompute checkpoints) as the decoder's
``context``; see ``lime_megatron.models.gpt_model``.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Iterator

import torch

from lime_megatron.models.lime.head_parallel import gather_heads, scatter_heads
from lime_megatron.models.lime.router import LimeRouter, routing_consumers
from lime_megatron.models.lime.routing_blocks import (
    MixEarlierSources,
    RouterStack,
    count_read,
    key_value_halves,
    mix_earlier,
    placed_columns,
    routing_product,
    routing_product_attention_layout,
    routing_product_keys_values,
    weight_grad_product,
)

_MEMORIES: weakref.WeakValueDictionary[int, LayerIntegratedMemory] = weakref.WeakValueDictionary()
_NEXT_ID = itertools.count()


class LayerIntegratedMemory:
    """Buffer B of one forward pass of one model chunk, and the routers that read it.

    Args:
        num_layers: layers of the whole model (fixes which layers read each layer).
        variant, window: router variant (App. D).
        layers: this chunk's own layers (global 0-based indices; all layers without pipelining).
        block: routing block size B (``routing_blocks``; 1: every product per layer).
        routers: the chunk's routers by layer (a block's first layer mixes the earlier sources of
            all its layers; every product reads their weights from one ``RouterStack`` per pass).

    Own rows: allocated by the first ``store`` (its keys fix shape, dtype and device) as
    ``[len(layers) * kv_heads, 2 * s * b * d]``.  Under pipeline parallelism the rows of earlier
    chunks' layers that this chunk's layers read are *external* blocks (``receive``: rows received
    from other ranks or kept from this rank's earlier chunks); in backward this chunk's share of
    their gradient is handed back (``external_shares``), and the gradient of its own rows from
    later chunks arrives before its layers' backward (``receive_downstream_grad``); see
    ``lime_megatron.parallel.pipeline``.
    """

    def __init__(self, num_layers: int, variant: str, window: int | None, layers: range | None = None,
                 block: int = 1, *, routers: dict[int, LimeRouter]):
        self.num_layers = num_layers
        self.variant, self.window = variant, window
        self.layers = range(num_layers) if layers is None else layers
        self.buffer: torch.Tensor | None = None
        self._writer: torch.Tensor | None = None
        self.kv_shape: tuple[int, int, int, int] | None = None
        self.external: list[tuple[range, torch.Tensor]] = []
        self.read_later: tuple[int, ...] = ()  # own layers read by later chunks (set by the pipeline)
        self._downstream_grad: torch.Tensor | None = None
        self._routers: dict[int, LimeRouter] = {}
        self._grad_rows: torch.Tensor | None = None
        self._grad_rows_written = [False] * len(self.layers)
        self.block, self._chunk_routers = block, routers
        self._router_stack: RouterStack | None = None  # built by the first product of the pass
        self._partials: dict[int, torch.Tensor] = {}  # forward: earlier-source sums of the block
        self._rebuild_partials: dict[int, torch.Tensor] = {}  # the same, rebuilt in backward
        self._later_grads: dict[int, torch.Tensor] = {}  # backward: row gradients from later blocks
        # backward: a blocked router's in-block weight-gradient pieces, placed by MixEarlierSources
        self.in_block_weight_grads: dict[int, list[tuple[slice, torch.Tensor]]] = {}
        self._token_weights: dict[int, torch.Tensor] = {}  # backward: p_m of dynamic consumers m
        self.id = next(_NEXT_ID)
        _MEMORIES[self.id] = self

    def _allocate(self, key: torch.Tensor) -> None:
        """Allocate the own rows for keys shaped like ``key`` ``[s, b, kv_heads, d]``."""
        s, b, h, d = key.shape
        if self.kv_shape not in (None, (s, b, h, d)):
            raise RuntimeError(f"keys {(s, b, h, d)} do not match the received ones {self.kv_shape}")
        self.kv_shape = (s, b, h, d)
        self.buffer = torch.empty(len(self.layers) * h, 2 * s * b * d, dtype=key.dtype, device=key.device)
        # Writes go through an alias with its own version counter: each row block is written
        # once before it is read, so views of it saved for backward stay valid.
        self._writer = torch.empty(0, dtype=key.dtype, device=key.device).set_(
            self.buffer.untyped_storage(), 0, self.buffer.shape, self.buffer.stride()
        )

    @property
    def kv_heads(self) -> int:
        """Key/value heads per layer held here."""
        return self.kv_shape[2]

    @property
    def row_length(self) -> int:
        """Elements of one buffer row (one head's keys and values): ``2 * s * b * d``."""
        s, b, _, d = self.kv_shape
        return 2 * s * b * d

    # ----------------------------------------------------------------------------- handle
    def handle(self) -> torch.Tensor:
        """A one-element tensor naming this memory, passed through megatron as ``context``.

        The handle keeps the memory alive (megatron's recompute checkpoints save it); detached
        copies made by the checkpoints still resolve through ``from_handle``.
        """
        handle = torch.tensor([self.id], dtype=torch.int64)
        handle.lime_memory = self
        return handle

    @staticmethod
    def from_handle(handle: torch.Tensor | None) -> LayerIntegratedMemory:
        """The memory named by ``handle`` (the ``context`` a LIMe layer receives)."""
        if handle is None:
            raise RuntimeError(
                "a LIMe layer ran without its layer-integrated memory: build the model with "
                "lime_megatron.models.gpt_model.LimeGPTModel, whose forward passes it to the decoder"
            )
        memory = getattr(handle, "lime_memory", None) or _MEMORIES.get(int(handle))  # a copy: by its id
        if memory is None:
            raise RuntimeError(f"the LIMe memory {int(handle)} of this pass was already freed")
        return memory

    # ----------------------------------------------------------------------------- layout
    def rows(self, start: int, stop: int) -> torch.Tensor:
        """Rows of layers ``start..stop-1``, all in one external block or all own:
        ``[(stop - start) * kv_heads, 2 * s * b * d]``."""
        h, first = self.kv_heads, self.layers.start
        if start >= first:
            return self.buffer[(start - first) * h : (stop - first) * h]
        for layers, rows in self.external:
            if layers.start <= start and stop <= layers.stop:
                return rows[(start - layers.start) * h : (stop - layers.start) * h]
        raise IndexError(f"rows of layers {start}..{stop - 1} are not held by the chunk of layers "
                         f"{self.layers.start}..{self.layers.stop - 1} (external: "
                         f"{[layers for layers, _ in self.external]})")

    def row_blocks(self, start: int, stop: int) -> list[tuple[int, int]]:
        """``(start, stop)`` split where external blocks and the own rows begin and end."""
        cuts = {self.layers.start} | {edge for layers, _ in self.external for edge in (layers.start, layers.stop)}
        edges = [start, *sorted(cut for cut in cuts if start < cut < stop), stop]
        return list(zip(edges[:-1], edges[1:]))

    @staticmethod
    def to_rows(keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Keys and values ``[s, b, h, d]`` -> rows ``[h, 2 * s * b * d]`` (one copy)."""
        return torch.stack((keys.permute(2, 0, 1, 3), values.permute(2, 0, 1, 3)), dim=1).view(keys.shape[2], -1)

    def from_rows(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[h, 2 * s * b * d]`` -> keys and values, each a contiguous ``[s, b, h, d]`` of its own."""
        heads_first = self._heads_first(rows)
        return tuple(heads_first[:, half].permute(1, 2, 0, 3).contiguous() for half in (0, 1))

    def store(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """Eq. 1: write layer ``layer``'s keys/values ``[s, b, h, d]`` into its rows; returns them."""
        if self.buffer is None:
            self._allocate(key)
        if tuple(key.shape) != self.kv_shape:
            raise RuntimeError(f"layer {layer} keys {tuple(key.shape)} do not match the memory's {self.kv_shape}")
        s, b, h, d = self.kv_shape
        local = layer - self.layers.start
        slot = self._writer[local * h : (local + 1) * h].view(h, 2, s, b, d)
        torch.stack((key.permute(2, 0, 1, 3), value.permute(2, 0, 1, 3)), dim=1, out=slot)
        return self.rows(layer, layer + 1)

    # ----------------------------------------------------------------------------- stages
    def receive(self, blocks: list[tuple[range, torch.Tensor]], kv_shape: tuple[int, int, int, int]) -> None:
        """External row blocks ``(layers, rows [len(layers) * kv_heads, 2 * s * b * d])`` of
        earlier chunks' layers that this chunk's layers read, keys shaped ``kv_shape``."""
        for layers, _ in blocks:
            if layers.stop > self.layers.start:
                raise ValueError(f"external layers {layers} must come before this chunk's {self.layers}")
        self.external, self.kv_shape = blocks, kv_shape

    def receive_downstream_grad(self, grad_rows: torch.Tensor) -> None:
        """Gradient of the own rows of ``read_later`` from later chunks, stacked in that order:
        the share sum_{m later} W_m[:, block l]^T g_m of each own layer l read after this chunk."""
        self._downstream_grad = grad_rows

    # ----------------------------------------------------------------------------- routing
    def _source_blocks(self, router: LimeRouter, since: int = 0) -> Iterator[tuple[int, int, torch.Tensor]]:
        """(first source layer, stop, buffered rows) per contiguous block of ``router``'s sources
        from layer ``since`` on."""
        for run_start, run_stop in router.source_runs:
            if run_stop > since:
                for start, stop in self.row_blocks(max(run_start, since), run_stop):
                    yield start, stop, self.rows(start, stop)

    def stacked_columns(self, consumers: list[int] | range, start: int, stop: int,
                        wide: torch.Tensor) -> torch.Tensor:
        """The columns of source layers ``start..stop-1`` of the routers of own layers ``consumers``,
        stacked (``RouterStack.columns``, in the dtype of ``wide``, the rows they multiply)."""
        if self._router_stack is None:
            self._router_stack = RouterStack(self._chunk_routers, self.layers, wide)
        return self._router_stack.columns(consumers, start, stop)

    # ----------------------------------------------------------------------------- blocks
    def block_of(self, layer: int) -> range:
        """The routing block of own layer ``layer``: B consecutive layers from the chunk's first."""
        first = self.layers.start
        start = first + (layer - first) // self.block * self.block
        return range(start, min(start + self.block, self.layers.stop))

    def blocked(self, router: LimeRouter) -> bool:
        """Whether ``router``'s earlier sources are mixed once for its block (B > 1, a learned or
        fixed product, this rank the heads' primary, some source before the block)."""
        return (self.block > 1 and not router.identity and router.sharding.primary
                and router.read_sources[0] < self.block_of(router.layer).start)

    def _earlier_readers(self, block: range) -> list[LimeRouter]:
        """The routers of ``block`` that read sources before it."""
        return [self._chunk_routers[m] for m in block if self.blocked(self._chunk_routers[m])]

    def earlier_partial(self, router: LimeRouter, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Forward: ``router``'s sums over the sources before its block, keys and values (this rank's
        columns, in the layout of ``routing_blocks.mix_earlier``), from one product for the whole
        block run at its first layer (``routing_blocks.MixEarlierSources``, which carries the
        router-weight gradient of those columns); None when ``router`` is not blocked.  ``key``:
        the layer's raw keys ``[s, b, local kv heads, d]``; at the block's first reader an input of
        ``MixEarlierSources`` that orders its backward before every earlier layer's."""
        if not self.blocked(router):
            return None
        if router.layer not in self._partials:  # the block's first reader (or first after a recompute boundary)
            block = self.block_of(router.layer)
            readers = [reader for reader in self._earlier_readers(block) if reader.layer >= router.layer]
            sums = MixEarlierSources.apply(self, block, readers, key, *(reader.weight for reader in readers))
            self._partials = dict(zip((reader.layer for reader in readers), zip(sums[0::2], sums[1::2])))
        return self._partials.pop(router.layer)

    def rebuilt_earlier_partial(self, router: LimeRouter) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Backward rebuild of the dropped routed K/V: ``earlier_partial`` again, its block's
        product run once when the block's first rebuild needs it (rows before the block are
        intact until the block's backward ends)."""
        if not self.blocked(router):
            return None
        if router.layer not in self._rebuild_partials:  # backward reaches the block's last reader first
            block = self.block_of(router.layer)
            readers = [reader for reader in self._earlier_readers(block) if reader.layer <= router.layer]
            with torch.no_grad():
                self._rebuild_partials = dict(zip((reader.layer for reader in readers),
                                                  mix_earlier(self, block, readers, "rebuild")))
        return self._rebuild_partials.pop(router.layer)

    def mix(self, router: LimeRouter, earlier: tuple[torch.Tensor, torch.Tensor] | None = None,
            kind: str = "forward") -> tuple[torch.Tensor, torch.Tensor]:
        """Eq. 2: ``W_l @ rows(sources)``, one product per contiguous block of sources (``W_l``: the
        router's weight itself, contiguous, a copy only for part of its sources; a product of one
        router needs no ``RouterStack``, so KV-cache decoding builds none); with
        ``earlier`` (the block's sums over the sources before the block) only the in-block ones.
        ``kind`` names the products for ``routing_blocks.routing_reads`` (``rebuild`` in backward).

        Under tensor parallelism each rank multiplies its own heads' rows, giving partial sums
        for all kv_heads output heads, and a reduce-scatter leaves each rank its heads' sums.
        Without tensor parallelism the products write attention's layout directly
        (``_mix_in_attention_layout``).  The identity routing (layer 0) is no product: its own
        rows, rearranged.
        Returns the routed keys and values, ``[s, b, local kv heads, d]`` each, two new tensors
        (attention may keep the values and not the keys, which only RoPE reads).
        """
        if router.identity:
            return self.from_rows(self.rows(router.layer, router.layer + 1))
        if router.sharding.size == 1:
            return self._mix_in_attention_layout(router, earlier, kind)
        partial = None
        if router.sharding.primary:
            since = 0 if earlier is None else self.block_of(router.layer).start
            for start, stop, rows in self._source_blocks(router, since):
                narrow = router.weight_columns(start, stop).contiguous()
                partial = routing_product(kind, narrow, rows, partial)
        if partial is None:  # a replica of another rank's heads (the primary adds those terms), or
            # a blocked layer whose kept routes all read sources before its block
            partial = self.buffer.new_zeros(router.weight.shape[0], self.buffer.shape[1])
        for half, part in zip(key_value_halves(partial), earlier or ()):
            half.add_(part)
        return self.from_rows(scatter_heads(partial, router.sharding))

    def _mix_in_attention_layout(self, router: LimeRouter, earlier: tuple[torch.Tensor, torch.Tensor] | None,
                                 kind: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``mix`` without tensor parallelism: the products write the keys and the values
        ``[s, b, kv_heads, d]`` directly (``routing_product_keys_values``), so no rows-to-attention
        copy follows (issue 26, item 3); each product adds the sum so far in its own kernel,
        starting from ``earlier`` (keys and values ``[s, b, kv_heads, d]``,
        ``routing_blocks.mix_earlier``)."""
        since = 0 if earlier is None else self.block_of(router.layer).start
        routed = earlier
        for start, stop, rows in self._source_blocks(router, since):
            narrow = router.weight_columns(start, stop).contiguous()
            routed = routing_product_keys_values(kind, narrow, rows, self.kv_shape[3], routed)
        if routed is earlier:  # every kept route reads a source before the block: those sums alone
            routed = tuple(part.clone(memory_format=torch.contiguous_format) for part in earlier)
        return tuple(part.view(self.kv_shape) for part in routed)

    def register(self, router: LimeRouter) -> None:
        """Record that ``router``'s layer read the memory in this pass (its weight is needed by
        the backward of every source layer)."""
        self._routers[router.layer] = router

    def weight_grad_pieces(self, router: LimeRouter, grad_rows: torch.Tensor,
                           since: int = 0) -> list[tuple[slice, torch.Tensor]]:
        """dL/dW_l = g_l @ rows(sources)^T for this rank's columns of the sources from layer
        ``since`` on, as ``(columns, [kv_heads, len(columns)])`` per contiguous block of sources
        (``routing_blocks.placed_columns`` places them), accumulated in float32
        (``weight_grad_product``); ``grad_rows`` holds all kv_heads rows of g_l.  Replica ranks
        compute the same value (their weight columns are one shared parameter)."""
        return [(router.columns(start, stop), weight_grad_product(grad_rows, rows))
                for start, stop, rows in self._source_blocks(router, since)]

    def _grad_buffer(self, kv_heads: int) -> torch.Tensor:
        """Where g_l (all kv_heads rows) of the own layers is kept until every source of layer l
        took its share: the dead own raw rows without tensor parallelism, else a buffer."""
        if kv_heads == self.kv_heads:
            return self._writer
        if self._grad_rows is None:
            self._grad_rows = self.buffer.new_empty(len(self.layers) * kv_heads, self.buffer.shape[1])
        return self._grad_rows

    def kept_grad_rows(self, layers: range, kv_heads: int) -> torch.Tensor:
        """The kept g_m (``kv_grad``) of own layers ``layers``, stacked as rows: a view
        ``[len(layers) * kv_heads, 2*s*b*d]`` of the gradient buffer (``_grad_buffer``)."""
        first = self.layers.start
        return self._grad_buffer(kv_heads)[(layers.start - first) * kv_heads : (layers.stop - first) * kv_heads]

    def _grads_in_attention_layout(self) -> bool:
        """Whether row gradients are summed in attention's layout ``[2*s*b, kv_heads, d]``, the
        layout the key/value gradients are handed on in (``routing_product_attention_layout``: no
        rearranging copy): without tensor parallelism, for static routers; else as rows."""
        router = next(iter(self._routers.values()))
        return router.sharding.size == 1 and self.variant != "dynamic"

    def _in_grad_layout(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows ``[kv_heads, 2*s*b*d]`` in the layout row gradients are summed in (a view)."""
        if self._grads_in_attention_layout():
            return rows.view(rows.shape[0], -1, self.kv_shape[3]).transpose(0, 1)
        return rows

    def _head_first_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """The inverse of ``_in_grad_layout``: a row gradient as ``[kv_heads, 2*s*b, d]`` (a view;
        ``torch.cat`` of these along dim 0 stacks rows with one copy) or as rows."""
        return grad.transpose(0, 1) if self._grads_in_attention_layout() else grad

    def _consumer_grad(self, layer: int, own_grad: torch.Tensor | None = None) -> torch.Tensor:
        """Gradient of the rows of ``layer`` (own or received): sum over its consumers m of
        W_m[:, block layer]^T g_m, the consumers in this chunk from the kept g_m, those of later
        stages from the downstream gradient.  ``own_grad``: g_layer of a layer with the identity
        routing (this rank's heads), its own term W^T g = g.  ``[2*s*b, kv_heads, d]`` or rows
        ``[local kv heads, 2*s*b*d]`` (``_grads_in_attention_layout``)."""
        _, stop = routing_consumers(layer, self.num_layers, self.variant, self.window)
        local = range(max(layer, self.layers.start), min(stop, self.layers.stop))
        missing = [m for m in local if not self._grad_rows_written[m - self.layers.start]]
        if missing:
            raise RuntimeError(f"LIMe backward reached layer {layer} before that of its consumer layers {missing}")
        mixing = local if own_grad is None else local[1:]
        grad = None
        if self.block > 1 and layer >= self.layers.start:
            grad = self._later_consumer_grad(layer, self.block_of(layer))
            mixing = range(mixing.start, min(mixing.stop, self.block_of(layer).stop))
        if mixing and self._routers[mixing.start].sharding.primary:
            grad = self._mixed_grad(range(layer, layer + 1), mixing, grad)
        downstream = self._downstream_rows(layer) if layer in self.read_later else None
        for term in (own_grad, downstream):
            if term is not None:
                term = self._in_grad_layout(term)
                grad = term.clone() if grad is None else grad.add_(term)
        if grad is None:  # a replica rank: the primary passes this head's gradient
            some_rows = self.buffer if self.buffer is not None else self.external[0][1]
            grad = some_rows.new_zeros(self.kv_heads, some_rows.shape[1])
        return grad

    def _mixed_grad(self, sources: range, consumers: range, accumulate: torch.Tensor | None = None) -> torch.Tensor:
        """sum_{m in consumers} W_m[:, block l]^T g_m for each l in ``sources``, stacked, one
        product reading each kept g_m once: ``[2*s*b, len(sources) * kv_heads, d]`` or rows
        ``[len(sources) * local heads, 2*s*b*d]`` (``_grads_in_attention_layout``), plus
        ``accumulate`` (the same shape: the sums of the consumers after the block) in the
        product's kernel when given; a new tensor."""
        routers = [self._routers[m] for m in consumers]
        if routers[0].dynamic:  # never blocked (``chunk_routing_block``): nothing to accumulate
            return self._token_mixed_grad(sources, consumers)
        grads = self.kept_grad_rows(consumers, routers[0].weight.shape[0])
        narrow = self.stacked_columns(consumers, sources.start, sources.stop, grads).t()
        if self._grads_in_attention_layout():
            return routing_product_attention_layout("row_grad", narrow, grads, self.kv_shape[3], accumulate)
        return routing_product("row_grad", narrow, grads, accumulate)

    # ----------------------------------------------------------------------------- by token
    def _heads_first(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows of one layer ``[kv_heads, 2*s*b*d]`` viewed as ``[kv_heads, 2, s, b, d]``."""
        s, b, h, d = self.kv_shape
        return rows.view(h, 2, s, b, d)

    @staticmethod
    def _per_row(weights: torch.Tensor) -> torch.Tensor:
        """One source's token weights ``[s, b, h]`` broadcast over rows ``[h, 2, s, b, d]``."""
        return weights.permute(2, 0, 1)[:, None, :, :, None]

    def mix_by_token(self, router, probs: torch.Tensor, kind: str = "forward") -> tuple[torch.Tensor, torch.Tensor]:
        """Dynamic LIMe's Eq. 2 (``dynamic_router``): routed[x, s, b, h, d] =
        sum_j probs[s, b, h, j] * rows_j[h, x, s, b, d], written as keys (x = 0) and values
        (x = 1) in attention's layout ``[s, b, local kv heads, d]`` (two new tensors); one
        multiply-add per source layer read (a pruned source's weights are 0), its rows counted as
        ``kind`` (``routing_reads``)."""
        s, b, h, d = self.kv_shape
        keys, values = probs.new_zeros(s, b, h, d), probs.new_zeros(s, b, h, d)
        for source in router.read_sources:
            rows = self._heads_first(count_read(kind, self.rows(source, source + 1)))
            weights = self._per_row(probs[..., source])[:, 0]
            for index, routed in enumerate((keys, values)):
                routed.permute(2, 0, 1, 3).addcmul_(weights, rows[:, index])
        return keys, values

    def token_weight_grad(self, router, grad_rows: torch.Tensor) -> torch.Tensor:
        """dL/dp_l[s, b, h, j] = sum_{x, d} g_l[h, x, s, b, d] * rows_j[h, x, s, b, d]:
        ``[s, b, local kv heads, l + 1]``.  Run before g_l overwrites layer l's own rows."""
        grad = self._heads_first(grad_rows)
        s, b, h, _ = self.kv_shape
        grads = grad_rows.new_zeros(h, s, b, len(router.sources))
        for source in router.read_sources:  # a pruned route's weight is a constant 0
            rows = count_read("weight_grad", self.rows(source, source + 1))
            grads[..., source] = (grad * self._heads_first(rows)).sum(dim=(1, 4))
        return grads.permute(1, 2, 0, 3)

    def keep_token_weights(self, layer: int, probs: torch.Tensor) -> None:
        """Backward of dynamic layer ``layer``: keep its p ``[s, b, h, l+1]`` until its sources
        took their share ``p[..., source] * g_layer`` (freed with the memory)."""
        self._token_weights[layer] = probs.detach()

    def _token_mixed_grad(self, sources: range, consumers: range) -> torch.Tensor:
        """``_mixed_grad`` for dynamic consumers: sum_m p_m[..., l] * g_m for each l in
        ``sources`` (column l of p_m is source layer l), ``[len(sources) * local heads, 2*s*b*d]``."""
        h, first = self.kv_heads, self.layers.start
        grads = self._grad_buffer(h)
        mixed = grads.new_zeros(len(sources) * h, grads.shape[1])
        for consumer in consumers:
            grad = grads[(consumer - first) * h : (consumer - first + 1) * h]
            weights, read = self._token_weights[consumer], self._routers[consumer].read_sources
            for index, source in enumerate(sources):
                if source in read:  # g_consumer read once per source it reads
                    target = self._heads_first(mixed[index * h : (index + 1) * h])
                    kept = self._heads_first(count_read("row_grad", grad))
                    target.addcmul_(self._per_row(weights[..., source]), kept)
        return mixed

    def _later_consumer_grad(self, layer: int, sources: range) -> torch.Tensor | None:
        """The share of layer ``layer``'s row gradient from this chunk's consumers after the
        source block ``sources`` (an own block, or an external one: then every consumer in this
        chunk), computed for the whole block at its first use."""
        if layer not in self._later_grads:
            stop = max(routing_consumers(source, self.num_layers, self.variant, self.window)[1] for source in sources)
            consumers = range(max(sources.stop, self.layers.start), min(stop, self.layers.stop))
            if not consumers or not self._routers[consumers.start].sharding.primary:
                return None
            stacked = self._mixed_grad(sources, consumers)
            heads_dim = 1 if self._grads_in_attention_layout() else 0
            self._later_grads.update(zip(sources, stacked.chunk(len(sources), dim=heads_dim)))
        return self._later_grads.pop(layer)

    def _external_grad(self, layer: int, layers: range) -> torch.Tensor:
        """This chunk's share of the gradient of external layer ``layer`` (of the block
        ``layers``): with blocked routing from one product for the whole external block."""
        grad = self._later_consumer_grad(layer, layers) if self.block > 1 else None
        return grad if grad is not None else self._consumer_grad(layer)

    def _downstream_rows(self, layer: int) -> torch.Tensor:
        """Rows of the downstream gradient for sent layer ``layer``."""
        if self._downstream_grad is None:
            raise RuntimeError(f"the gradient of layer {layer}'s keys/values from later pipeline stages is missing")
        offset = self.read_later.index(layer) * self.kv_heads
        return self._downstream_grad[offset : offset + self.kv_heads]

    def kv_grad(self, router: LimeRouter, grad_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Gradient of layer l's own keys and values, ``[s, b, local kv heads, d]`` each.

        Keeps ``grad_rows`` (g_l, all kv_heads rows) as the layer's gradient rows, then sums
        W_m[:, block l]^T g_m over the consumers m of layer l (one product for this chunk's).
        For the identity routing ``grad_rows`` holds this rank's heads only: no other layer
        reads g_l, so it is not kept, and its term W_l^T g_l is g_l itself.
        """
        layer = router.layer
        local = layer - self.layers.start
        if not router.identity:
            kv_heads = grad_rows.shape[0]
            self._grad_buffer(kv_heads)[local * kv_heads : (local + 1) * kv_heads].copy_(grad_rows)
        self._grad_rows_written[local] = True
        own_grad = grad_rows if router.identity else None
        grad = self._consumer_grad(layer, own_grad)
        if self._grads_in_attention_layout():
            return grad.view(2, *self.kv_shape).unbind(0)
        grad_kv = grad.view(self.kv_heads, 2, *self.kv_shape[:2], -1)
        return tuple(half.permute(1, 2, 0, 3) for half in grad_kv.unbind(1))

    def external_shares(self) -> list[tuple[range, torch.Tensor]]:
        """This chunk's share of the gradient of its external rows, once every own layer's
        backward ran: ``(layers, sum_{m in chunk} W_m[:, block l]^T g_m stacked over l)`` per
        external block, ``[len(layers) * kv_heads, 2*s*b*d]``."""
        shares = []
        for layers, _ in self.external:
            grads = [self._head_first_grad(self._external_grad(layer, layers)) for layer in layers]
            shares.append((layers, torch.cat(grads).flatten(1)))
        self.external = []
        return shares


class RouteKeysValues(torch.autograd.Function):
    """Store a layer's keys/values in the memory and return the routed ones (Eqs. 1-2).

    forward(weight [h, n_src*h], key [s,b,h,d], value [s,b,h,d], earlier keys, earlier values,
            memory, router) -> routed keys [s, b, h, d], routed values [s, b, h, d]

    ``earlier``: the block's sums over the sources before the block, keys and values (blocked
    routing; ``[s, b, h, d]`` each without tensor parallelism, else halves ``[h, s*b*d]`` of rows;
    None otherwise); the product then covers the in-block sources, and backward leaves their
    columns' weight gradient to ``routing_blocks.MixEarlierSources``, which returns the router's
    whole gradient.  ``weight`` is the input whose gradient backward returns (unblocked); the
    products read the router's weight (``LayerIntegratedMemory.mix``).
    """

    @staticmethod
    def forward(ctx, weight, key, value, earlier_keys, earlier_values, memory: LayerIntegratedMemory,
                router: LimeRouter):
        own_rows = memory.store(router.layer, key, value)
        memory.register(router)
        # Saved so that saved-tensor accounting (and offloading hooks) see the buffer.
        ctx.save_for_backward(own_rows)
        ctx.memory, ctx.router, ctx.blocked = memory, router, earlier_keys is not None
        return memory.mix(router, (earlier_keys, earlier_values) if ctx.blocked else None)

    @staticmethod
    def backward(ctx, grad_keys, grad_values):
        ctx.saved_tensors  # noqa: B018 - releases the saved view through the hooks
        memory, router = ctx.memory, ctx.router
        grad_rows = memory.to_rows(grad_keys, grad_values)
        if not router.identity:  # the identity routes each rank's own heads: nothing to gather
            grad_rows = gather_heads(grad_rows, router.sharding)
        grad_weight = None
        if ctx.needs_input_grad[0]:
            since = memory.block_of(router.layer).start if ctx.blocked else 0
            pieces = memory.weight_grad_pieces(router, grad_rows, since)
            if ctx.blocked:  # placed beside the earlier columns' by ``routing_blocks.MixEarlierSources``
                memory.in_block_weight_grads[router.layer] = pieces
            else:
                grad_weight = placed_columns(pieces, router.weight)
        grad_key, grad_value = memory.kv_grad(router, grad_rows)
        grad_earlier = (None, None)  # else in the layout of ``earlier`` (``routing_blocks.mix_earlier``)
        if ctx.blocked and router.sharding.size == 1:
            grad_earlier = (grad_keys, grad_values)
        elif ctx.blocked:
            grad_earlier = key_value_halves(grad_rows)
        return grad_weight, grad_key, grad_value, *grad_earlier, None, None


def route_keys_values(
    memory: LayerIntegratedMemory, router: LimeRouter, key: torch.Tensor, value: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Routed keys and values of ``router``'s layer, ``[s, b, kv_heads, d]`` each."""
    earlier = memory.earlier_partial(router, key) or (None, None)
    return RouteKeysValues.apply(router.weight, key, value, *earlier, memory, router)


# --------------------------------------------------------------------------------- decoding
def route_new_tokens(
    memory: LayerIntegratedMemory, router: LimeRouter, key: torch.Tensor, value: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """KV-cache decoding step (no autograd): store the new tokens' keys/values ``[s_new, b, h, d]``
    of ``router``'s layer in the step's memory (Eq. 1) and return their routed keys and values
    ``([s_new, b, h, d], [s_new, b, h, d])`` (Eq. 2), which the caller copies into the layer's
    cache: for the identity routing (layer 0) ``key`` and ``value`` themselves."""
    if torch.is_grad_enabled():
        raise RuntimeError("LIMe KV-cache decoding runs without autograd: call the model under torch.no_grad()")
    memory.store(router.layer, key, value)
    if router.identity:
        return key, value
    return memory.mix(router)
