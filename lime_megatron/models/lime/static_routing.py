"""Eq. 2 for routers whose weights are parameters (``router.LimeRouter``), over the memory's rows.

Layer l mixes the rows of its source layers with one matrix product per contiguous run of
sources (``mix``):

    routed_l = W_l @ buffer[rows of sources(l)]            [kv_heads, 2 * s * b * d]

Layer 0 has no router (W_0 = I over its own rows, ``LimeRouter.identity``): no product is run
for it, in forward, backward, the rebuild of its routed keys/values or decoding, and under
tensor parallelism no collective either (each rank's routed heads are its own heads).  Route
pruning (``pruning``) leaves a source none of a router's kept routes reads out of its
``read_sources`` (and ``source_runs``): no product reads its rows.

Routed K/V.  The products write the routed keys and the routed values as two tensors
(``routing_products.routing_product_keys_values``), ``[s, b, kv_heads, d]`` each: attention
keeps the rotated keys and the values for backward, and the routed keys, which only RoPE reads,
are freed, so LIMe keeps its buffer where the baseline keeps its QKV output.  With
``lime_recompute_routed_kv`` ``recompute.recompute_in_backward`` also drops the values and
rotated keys from autograd's saved tensors and rebuilds them from the buffer when backward first
needs them (one extra router product per layer, kind ``rebuild``).

Blocks (``routing_blocks``).  With block size B > 1 a block's sums over the sources before it are
one product for all its readers at its first reader (``stacked_routing.StackedRouting``), and each
layer's product here covers its in-block sources only (``earlier``).

Gradients.  ``weight_grad_pieces`` gives dL/dW_l = g_l @ buffer[sources]^T (accumulated and
returned in float32 for bf16/fp16 rows, ``routing_products.float32_product``; a bf16 run keeps
its routers in float32 and the products cast them to the rows' dtype).  The sources' row
gradient W_m[:, block l]^T g_m is a product of several routers (``StackedRouting.row_grad``).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from lime_megatron.models.lime.head_parallel import scatter_heads
from lime_megatron.models.lime.key_value_rows import KeyValueRows
from lime_megatron.models.lime.router import LimeRouter
from lime_megatron.models.lime.routing_products import (
    key_value_halves,
    routing_product,
    routing_product_keys_values,
    weight_grad_product,
)


class StaticRouting:
    """The per-layer routing products of a chunk's static routers over the rows of ``key_values``,
    with blocks of ``block`` layers from the chunk's first (B; 1: every product per layer)."""

    def __init__(self, key_values: KeyValueRows, block: int):
        self.key_values, self.block = key_values, block
        self._blocks: dict[int, range] = {}  # block_of, by layer: asked several times per layer and pass
        self._blocked: dict[int, bool] = {}  # blocked, by layer

    def source_spans(self, router: LimeRouter, since: int = 0) -> list[tuple[int, int]]:
        """(first source layer, stop) per contiguous block of ``router``'s sources from layer
        ``since`` on (a run of read sources, split where the own rows and external blocks meet)."""
        return [
            span
            for run_start, run_stop in router.source_runs
            if run_stop > since
            for span in self.key_values.row_blocks(max(run_start, since), run_stop)
        ]

    def _source_blocks(self, router: LimeRouter, since: int = 0) -> Iterator[tuple[int, int, torch.Tensor]]:
        """``source_spans`` with their rows."""
        for start, stop in self.source_spans(router, since):
            yield start, stop, self.key_values.rows(start, stop)

    def block_of(self, layer: int) -> range:
        """The routing block of own layer ``layer``: B consecutive layers from the chunk's first."""
        block = self._blocks.get(layer)
        if block is None:
            layers = self.key_values.layers
            start = layers.start + (layer - layers.start) // self.block * self.block
            block = self._blocks[layer] = range(start, min(start + self.block, layers.stop))
        return block

    def blocked(self, router: LimeRouter) -> bool:
        """Whether ``router``'s earlier sources are mixed once for its block (B > 1, a learned or
        fixed product, this rank the heads' primary, some source before the block)."""
        blocked = self._blocked.get(router.layer)
        if blocked is None:
            blocked = self._blocked[router.layer] = (
                self.block > 1
                and not router.identity
                and router.sharding.primary
                and router.read_sources[0] < self.block_of(router.layer).start
            )
        return blocked

    def mix(
        self, router: LimeRouter, earlier: tuple[torch.Tensor, torch.Tensor] | None = None, kind: str = "forward"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Eq. 2: ``W_l @ rows(sources)``, one product per contiguous block of sources (``W_l``: the
        router's weight itself; for part of its sources a contiguous copy on the torch path, the
        columns where they lie on the Triton path; a product of one router needs no
        ``RouterStack``, so KV-cache decoding builds none); with ``earlier`` (the block's sums over
        the sources before the block) only the in-block ones.  ``kind`` names the products
        (``rebuild`` in backward).

        Under tensor parallelism each rank multiplies its own heads' rows, giving partial sums
        for all kv_heads output heads, and a reduce-scatter leaves each rank its heads' sums.
        Without tensor parallelism the products write attention's layout directly
        (``_mix_in_attention_layout``).  The identity routing (layer 0) is no product: its own
        rows, rearranged.
        Returns the routed keys and values, ``[s, b, local kv heads, d]`` each, two new tensors
        (attention may keep the values and not the keys, which only RoPE reads).
        """
        rows = self.key_values
        if router.identity:
            return rows.from_rows(rows.rows(router.layer, router.layer + 1))
        if router.sharding.size == 1:
            return self._mix_in_attention_layout(router, earlier, kind)
        partial = None
        if router.sharding.primary:
            since = 0 if earlier is None else self.block_of(router.layer).start
            for start, stop, wide in self._source_blocks(router, since):
                narrow = router.weight_columns(start, stop)
                if not rows.triton:  # a Triton launch reads the columns where they lie
                    narrow = narrow.contiguous()
                partial = routing_product(kind, narrow, wide, partial, rows.triton)
        if partial is None:  # a replica of another rank's heads (the primary adds those terms), or
            # a blocked layer whose kept routes all read sources before its block
            partial = rows.buffer.new_zeros(router.weight.shape[0], rows.buffer.shape[1])
        for half, part in zip(key_value_halves(partial), earlier or ()):
            half.add_(part)
        return rows.from_rows(scatter_heads(partial, router.sharding))

    def _mix_in_attention_layout(
        self, router: LimeRouter, earlier: tuple[torch.Tensor, torch.Tensor] | None, kind: str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``mix`` without tensor parallelism: the products write the keys and the values
        ``[s, b, kv_heads, d]`` directly (``routing_product_keys_values``), so no rows-to-attention
        copy follows; each product adds the sum so far in its own kernel, starting from
        ``earlier`` (keys and values ``[s, b, kv_heads, d]``, ``routing_blocks.mix_earlier``)."""
        since = 0 if earlier is None else self.block_of(router.layer).start
        kv_shape = self.key_values.kv_shape
        routed = earlier
        for start, stop, wide in self._source_blocks(router, since):
            narrow = router.weight_columns(start, stop).contiguous()
            routed = routing_product_keys_values(kind, narrow, wide, kv_shape[3], routed, self.key_values.triton)
        if routed is earlier:  # every kept route reads a source before the block: those sums alone
            routed = tuple(part.clone(memory_format=torch.contiguous_format) for part in earlier)
        return tuple(part.view(kv_shape) for part in routed)

    def weight_grad_pieces(
        self, router: LimeRouter, grad_rows: torch.Tensor, since: int = 0
    ) -> list[tuple[slice, torch.Tensor]]:
        """dL/dW_l = g_l @ rows(sources)^T for this rank's columns of the sources from layer
        ``since`` on, as ``(columns, [kv_heads, len(columns)])`` per contiguous block of sources
        (``routing_products.placed_columns`` places them), accumulated in float32
        (``weight_grad_product``); ``grad_rows`` holds all kv_heads rows of g_l.  Replica ranks
        compute the same value (their weight columns are one shared parameter)."""
        return [
            (router.columns(start, stop), weight_grad_product(grad_rows, wide, self.key_values.triton))
            for start, stop, wide in self._source_blocks(router, since)
        ]
