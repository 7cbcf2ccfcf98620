"""The gradient of each layer's raw keys/values: the sum over the layers that read them.

Layer l's keys/values are read by every *consumer* m >= l whose router has l among its sources,
so their gradient collects one term per consumer (Eq. 2 transposed):

    grad(kv_l) = sum_m W_m[:, block l]^T g_m          (dynamic routers: sum_m p_m[..., l] * g_m)

with g_m the gradient of layer m's routed keys/values as rows, kept from m's backward
(``kept_gradients``).  Autograd runs layer l's backward after every consumer's, so in l's
backward (``kv_grad``) the terms of this chunk's consumers are one product over the kept rows of
consumers l..stop (``stacked_routing.StackedRouting.row_grad``, or
``token_routing.TokenRouting.mixed_grad``).  Under blocked routing the consumers after l's block
give their terms for the whole source block in one product at its first use.  Under pipeline
parallelism the terms of later chunks' consumers arrive as the downstream gradient
(``KeptGradients.downstream_rows``), and this chunk hands back its terms for the external rows it
read (``external_shares``).

Layouts.  Without tensor parallelism, for static routers, the sums are formed in attention's
layout ``[2*s*b, kv_heads, d]``, the layout the key/value gradients are handed on in (the
products write it, ``routing_products.routing_product_attention_layout``: no rearranging copy);
otherwise as rows ``[kv_heads, 2*s*b*d]``.
"""

from __future__ import annotations

import torch

from lime_megatron.kernels.operands import Halves
from lime_megatron.models.lime.kept_gradients import KeptGradients
from lime_megatron.models.lime.key_value_rows import KeyValueRows
from lime_megatron.models.lime.router import LimeRouter, routing_consumers
from lime_megatron.models.lime.stacked_routing import StackedRouting
from lime_megatron.models.lime.static_routing import StaticRouting
from lime_megatron.models.lime.token_routing import TokenRouting


class ConsumerGradients:
    """grad(kv_l) for the own and external layers of a chunk of a ``num_layers``-layer model whose
    routers are of ``variant`` (``window``), blocked as ``routing`` says: own-layer terms from
    ``kept``'s g_m, products by ``stacked`` (static routers) or ``by_token`` (dynamic ones).
    Holds the routers that read the
    memory in this pass (``register``) and a block's later-consumer sums until their sources'
    backward takes them."""

    def __init__(
        self,
        num_layers: int,
        variant: str,
        window: int | None,
        key_values: KeyValueRows,
        kept: KeptGradients,
        routing: StaticRouting,
        stacked: StackedRouting,
        by_token: TokenRouting,
    ):
        self.num_layers, self.variant, self.window = num_layers, variant, window
        self.key_values, self.kept = key_values, kept
        self.routing, self.stacked, self.by_token = routing, stacked, by_token
        self._routers: dict[int, LimeRouter] = {}
        self._later_grads: dict[int, torch.Tensor] = {}  # row gradients from consumers after a block

    def consumers(self, layer: int) -> tuple[int, int]:
        """``(first, stop)`` of the layers that read layer ``layer`` (``routing_consumers``)."""
        return routing_consumers(layer, self.num_layers, self.variant, self.window)

    def register(self, router: LimeRouter) -> None:
        """Record that ``router``'s layer read the memory in this pass (its weight is needed by
        the backward of every source layer)."""
        self._routers[router.layer] = router

    def kv_grad(self, router: LimeRouter, grad_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Gradient of layer l's own keys and values, ``[s, b, local kv heads, d]`` each.

        Keeps ``grad_rows`` (g_l, all kv_heads rows) as the layer's gradient rows, then sums
        W_m[:, block l]^T g_m over the consumers m of layer l (one product for this chunk's).
        For the identity routing ``grad_rows`` holds this rank's heads only: no other layer
        reads g_l, so it is not kept, and its term W_l^T g_l is g_l itself.
        """
        self.kept.keep(router, grad_rows)
        grad = self._consumer_grad(router.layer, grad_rows if router.identity else None)
        kv_shape = self.key_values.kv_shape
        if self._in_attention_layout():
            return grad.view(2, *kv_shape).unbind(0)
        grad_kv = grad.view(self.key_values.kv_heads, 2, *kv_shape[:2], -1)
        return tuple(half.permute(1, 2, 0, 3) for half in grad_kv.unbind(1))

    def external_shares(self) -> list[tuple[range, torch.Tensor]]:
        """This chunk's share of the gradient of its external rows, once every own layer's
        backward ran: ``(layers, sum_{m in chunk} W_m[:, block l]^T g_m stacked over l)`` per
        external block, ``[len(layers) * kv_heads, 2*s*b*d]``; the external rows are forgotten."""
        shares = []
        for layers, _ in self.key_values.external:
            grads = [self._head_first(self._external_grad(layer, layers)) for layer in layers]
            shares.append((layers, torch.cat(grads).flatten(1)))
        self.key_values.forget_external()
        return shares

    def _consumer_grad(self, layer: int, own_grad: torch.Tensor | None = None) -> torch.Tensor:
        """Gradient of the rows of ``layer`` (own or received): sum over its consumers m of
        W_m[:, block layer]^T g_m, the consumers in this chunk from the kept g_m, those of later
        stages from the downstream gradient.  ``own_grad``: g_layer of a layer with the identity
        routing (this rank's heads), its own term W^T g = g.  ``[2*s*b, kv_heads, d]`` or rows
        ``[local kv heads, 2*s*b*d]`` (``_in_attention_layout``)."""
        _, stop = self.consumers(layer)
        own = self.key_values.layers
        local = range(max(layer, own.start), min(stop, own.stop))
        self.kept.require(layer, local)
        mixing = local if own_grad is None else local[1:]
        grad = None
        if self.routing.block > 1 and layer >= own.start:
            block = self.routing.block_of(layer)
            grad = self.later_consumer_grad(layer, block)
            mixing = range(mixing.start, min(mixing.stop, block.stop))
        if mixing and self._routers[mixing.start].sharding.primary:
            grad = self._mixed_grad(range(layer, layer + 1), mixing, grad)
        for term in (own_grad, self.kept.downstream_rows(layer)):
            if term is not None:
                term = self._in_grad_layout(term)
                grad = term.clone() if grad is None else grad.add_(term)
        if grad is None:  # a replica rank: the primary passes this head's gradient
            grad = self.key_values.new_zero_rows(self.key_values.kv_heads)
        return grad

    def _mixed_grad(self, sources: range, consumers: range, accumulate: torch.Tensor | None = None) -> torch.Tensor:
        """sum_{m in consumers} W_m[:, block l]^T g_m for each l in ``sources``, stacked, one
        product reading each kept g_m once (``StackedRouting.row_grad``), plus ``accumulate`` in
        the product's kernel when given; for dynamic consumers ``TokenRouting.mixed_grad``."""
        routers = [self._routers[m] for m in consumers]
        if routers[0].dynamic:  # never blocked (``chunk_routing_block``): nothing to accumulate
            return self.by_token.mixed_grad(sources, routers)
        kv_heads, kept = routers[0].weight.shape[0], self.kept
        grads = kept.grad_halves(consumers, kv_heads) if self.key_values.triton else kept.grad_rows(consumers, kv_heads)
        return self.stacked.row_grad(sources, consumers, grads, self._in_attention_layout(), accumulate)

    def later_consumer_grad(self, layer: int, sources: range) -> torch.Tensor | None:
        """The share of layer ``layer``'s row gradient from this chunk's consumers after the
        source block ``sources`` (an own block, or an external one: then every consumer in this
        chunk), computed for the whole block at its first use."""
        if layer not in self._later_grads:
            stop = max(self.consumers(source)[1] for source in sources)
            own = self.key_values.layers
            consumers = range(max(sources.stop, own.start), min(stop, own.stop))
            if not consumers or not self._routers[consumers.start].sharding.primary:
                return None
            stacked = self._mixed_grad(sources, consumers)
            heads_dim = 1 if self._in_attention_layout() else 0
            self._later_grads.update(zip(sources, stacked.chunk(len(sources), dim=heads_dim)))
        return self._later_grads.pop(layer)

    def later_consumer_halves(self, layer: int, sources: range) -> Halves | None:
        """``later_consumer_grad`` as the kernels address it, in the layout it was summed in."""
        grad = self.later_consumer_grad(layer, sources)
        if grad is None:
            return None
        if self._in_attention_layout():
            return Halves.of_heads(grad)
        return Halves.of_rows(grad, 0, grad.shape[0], self.key_values.kv_shape[3])

    def _external_grad(self, layer: int, layers: range) -> torch.Tensor:
        """This chunk's share of the gradient of external layer ``layer`` (of the block
        ``layers``): with blocked routing from one product for the whole external block."""
        grad = self.later_consumer_grad(layer, layers) if self.routing.block > 1 else None
        return grad if grad is not None else self._consumer_grad(layer)

    def _in_attention_layout(self) -> bool:
        """Whether row gradients are summed in attention's layout ``[2*s*b, kv_heads, d]``: without
        tensor parallelism, for static routers; else as rows."""
        router = next(iter(self._routers.values()))
        return router.sharding.size == 1 and self.variant != "dynamic"

    def _in_grad_layout(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows ``[kv_heads, 2*s*b*d]`` in the layout row gradients are summed in (a view)."""
        if self._in_attention_layout():
            return rows.view(rows.shape[0], -1, self.key_values.kv_shape[3]).transpose(0, 1)
        return rows

    def _head_first(self, grad: torch.Tensor) -> torch.Tensor:
        """The inverse of ``_in_grad_layout``: a row gradient as ``[kv_heads, 2*s*b, d]`` (a view;
        ``torch.cat`` of these along dim 0 stacks rows with one copy) or as rows."""
        return grad.transpose(0, 1) if self._in_attention_layout() else grad
