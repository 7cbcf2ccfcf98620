"""The routing products of several static routers at once: a block's earlier sums and the row
gradients, their narrow operand taken from one ``routing_blocks.RouterStack`` per pass.

Blocked forward (``routing_blocks``).  For a block of B consumer layers ``[m0, m0 + B)`` the
sources before the block are mixed for every reader of them in one product per row block, run
at the block's first reader and kept until each reader takes its sums (``earlier_partial``):

    partial_block = W_block[:, earlier] @ buffer[earlier]      [B * kv_heads, 2 * s * b * d]

(``routing_blocks.MixEarlierSources``, which also returns those columns' weight gradient).  The
rebuild of dropped routed K/V runs the same product again in backward (``rebuilt_earlier_partial``).

Row gradients.  The share of source layers ``l`` in the gradient from consumers m is one product
over their kept g_m (``row_grad``, called by ``consumer_gradients``):

    sum_m W_m[:, block l]^T g_m  =  W_consumers[:, block sources]^T @ G_consumers
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lime_megatron.kernels import operands as kernels
from lime_megatron.kernels.operands import Halves
from lime_megatron.models.lime.kept_gradients import KeptGradients
from lime_megatron.models.lime.key_value_rows import KeyValueRows
from lime_megatron.models.lime.router import LimeRouter, contiguous_runs
from lime_megatron.models.lime.routing_blocks import (
    EarlierSources,
    MixEarlierSources,
    RouterStack,
    StandingRouterStack,
    mix_earlier,
)
from lime_megatron.models.lime.routing_products import (
    observed_product,
    routing_product,
    routing_product_attention_layout,
)
from lime_megatron.models.lime.static_routing import StaticRouting


class StackedRouting:
    """Products of several of the chunk's ``routers`` (by layer) over the rows of ``key_values``,
    blocked as ``routing`` says; a block's weight gradient reads ``kept``'s g_m.  Holds the pass's
    ``RouterStack`` (built by its first product, or ``standing``, the chunk's, refreshed) and a
    block's partial sums until its readers take them."""

    def __init__(
        self,
        key_values: KeyValueRows,
        kept: KeptGradients,
        routing: StaticRouting,
        routers: dict[int, LimeRouter],
        standing: StandingRouterStack | None = None,
    ):
        self.key_values, self.kept, self.routing, self.routers = key_values, kept, routing, routers
        self._standing = standing
        self._stack: RouterStack | None = None
        self._partials: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # forward: a block's earlier sums
        self._rebuild_partials: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # the same, rebuilt in backward

    def stacked_columns(self, consumers: Sequence[int], start: int, stop: int, wide: torch.Tensor) -> torch.Tensor:
        """The columns of source layers ``start..stop-1`` of the routers of own layers ``consumers``,
        stacked (``RouterStack.columns``, in the dtype of ``wide``, the rows they multiply)."""
        return self.stack(wide).columns(consumers, start, stop)

    def stack(self, like: torch.Tensor) -> RouterStack:
        """This pass's ``RouterStack`` in the dtype of ``like`` (the rows it multiplies), built (or
        the chunk's standing one refreshed) by the pass's first product of several routers."""
        if self._stack is None:
            standing = self._standing
            self._stack = (
                standing.refreshed(like) if standing else RouterStack(self.routers, self.key_values.layers, like)
            )
        return self._stack

    def _earlier_readers(self, block: range) -> list[LimeRouter]:
        """The routers of ``block`` that read sources before it."""
        return [self.routers[m] for m in block if self.routing.blocked(self.routers[m])]

    def _earlier_sources(self, block: range, readers: list[LimeRouter]) -> EarlierSources:
        """The operands of ``block``'s product over the sources before it that ``readers`` read."""
        sources = sorted({source for router in readers for source in router.read_sources if source < block.start})
        runs = [piece for run in contiguous_runs(sources) for piece in self.key_values.row_blocks(*run)]
        rows = [self.key_values.rows(start, stop) for start, stop in runs]
        consumers = [reader.layer for reader in readers]
        columns = [self.stacked_columns(consumers, start, stop, wide) for (start, stop), wide in zip(runs, rows)]
        return EarlierSources(readers, runs, rows, columns, self.key_values.kv_shape, self.key_values.triton)

    def earlier_partial(self, router: LimeRouter, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Forward: ``router``'s sums over the sources before its block, keys and values (this rank's
        columns, in the layout of ``routing_blocks.mix_earlier``), from one product for the whole
        block run at its first layer (``routing_blocks.MixEarlierSources``, which carries the
        router-weight gradient of those columns); None when ``router`` is not blocked.  ``key``:
        the layer's raw keys ``[s, b, local kv heads, d]``; at the block's first reader an input of
        ``MixEarlierSources`` that orders its backward before every earlier layer's."""
        if not self.routing.blocked(router):
            return None
        if router.layer not in self._partials:  # the block's first reader (or first after a recompute boundary)
            block = self.routing.block_of(router.layer)
            readers = [reader for reader in self._earlier_readers(block) if reader.layer >= router.layer]
            sums = MixEarlierSources.apply(
                self._earlier_sources(block, readers),
                self.key_values,
                self.kept,
                key,
                *(reader.weight for reader in readers),
            )
            self._partials = dict(zip((reader.layer for reader in readers), zip(sums[0::2], sums[1::2])))
        return self._partials.pop(router.layer)

    def rebuilt_earlier_partial(self, router: LimeRouter) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Backward rebuild of the dropped routed K/V: ``earlier_partial`` again, its block's
        product run once when the block's first rebuild needs it (rows before the block are
        intact until the block's backward ends)."""
        if not self.routing.blocked(router):
            return None
        if router.layer not in self._rebuild_partials:  # backward reaches the block's last reader first
            block = self.routing.block_of(router.layer)
            readers = [reader for reader in self._earlier_readers(block) if reader.layer <= router.layer]
            with torch.no_grad():
                sums = mix_earlier(self._earlier_sources(block, readers), "rebuild")
            self._rebuild_partials = dict(zip((reader.layer for reader in readers), sums))
        return self._rebuild_partials.pop(router.layer)

    def row_grad(
        self,
        sources: range,
        consumers: range,
        grads: torch.Tensor | Halves,
        attention_layout: bool,
        accumulate: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """sum_{m in consumers} W_m[:, block l]^T g_m for each l in ``sources``, stacked, one
        product reading the kept g_m ``grads`` ``[len(consumers) * kv_heads, 2*s*b*d]`` once (on
        the Triton path where they lie, as kernel operands: ``_row_grad_launch``):
        ``[2*s*b, len(sources) * kv_heads, d]`` with ``attention_layout``, else rows
        ``[len(sources) * local heads, 2*s*b*d]``, plus ``accumulate`` (the same shape) in the
        product's kernel when given; a new tensor."""
        if isinstance(grads, Halves):
            return self._row_grad_launch(sources, consumers, grads, attention_layout, accumulate)
        narrow = self.stacked_columns(consumers, sources.start, sources.stop, grads).t()
        if attention_layout:
            inner = self.key_values.kv_shape[3]
            return routing_product_attention_layout("row_grad", narrow, grads, inner, accumulate)
        return routing_product("row_grad", narrow, grads, accumulate)

    def _row_grad_launch(
        self, sources: range, consumers: range, grads: Halves, attention_layout: bool, accumulate: torch.Tensor | None
    ) -> torch.Tensor:
        """``row_grad`` as one ``mix_kernel`` launch, the router columns read from the stack
        (``RouterStack.operand``) and the kept g_m where ``grads`` addresses them (rows, or the
        rank chunks ``KeptGradients.gather`` keeps under tensor parallelism)."""
        columns = self.stack(grads.keys).operand(consumers, sources, transposed=True)
        s, b, _, width = self.key_values.kv_shape
        if attention_layout:
            out = grads.keys.new_empty(2 * s * b, columns.rows, width)
        else:
            out = grads.keys.new_empty(columns.rows, 2 * s * b * width)

        def in_out_layout(tensor: torch.Tensor) -> Halves:
            return Halves.of_heads(tensor) if attention_layout else Halves.of_rows(tensor, 0, columns.rows, width)

        halves, added = in_out_layout(out), None if accumulate is None else in_out_layout(accumulate)
        flops = 2 * columns.rows * grads.bytes // grads.keys.element_size()
        observed_product("row_grad", grads, flops, lambda: kernels.mix(halves, (columns, grads), accumulate=added))
        return out
