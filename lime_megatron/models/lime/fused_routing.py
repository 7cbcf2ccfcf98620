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
chunks' share, ``kept_gradients``.)  The backward's launch runs two kinds of programs: the row
gradient's tiles, and the weight gradient's, which read B[l] and then write g_l over it (each row of
B[l] is read by one program alone when g_l's rows fit one tile, as they do up to 64 heads; beyond,
two launches).  Besides the launches the host allocates the outputs: 3 operators per layer in
forward and 4 in backward at B = 1, 8 with autograd's accumulation of the router's gradient
(``tests/models/test_fused_routing.py`` holds the count).

Sources in another pipeline chunk's rows take one launch more per row block, in forward and for
the weight gradient; later pipeline chunks' share of the row gradient is added in the row
gradient's launch.  Where a layer's case is not this one (``FusedRouting.serves`` decides), the memory's
general path runs, its products Triton launches too (``routing_products``): tensor parallelism
(rows layout, collectives), the identity routing of layer 0, a pruned router none of whose kept
routes reads its own layer.
"""

from __future__ import annotations

import torch

from lime_megatron.kernels import operands as kernels
from lime_megatron.kernels.operands import Columns, Halves
from lime_megatron.models.lime.consumer_gradients import ConsumerGradients
from lime_megatron.models.lime.kept_gradients import KeptGradients
from lime_megatron.models.lime.key_value_rows import KeyValueRows
from lime_megatron.models.lime.router import LimeRouter, routing_consumers
from lime_megatron.models.lime.routing_products import weight_grad_dtype
from lime_megatron.models.lime.stacked_routing import StackedRouting
from lime_megatron.models.lime.static_routing import StaticRouting


class FusedRouting:
    """A layer's routing on the Triton path (module docstring), over the memory's parts: the rows
    ``key_values``, the kept g_m ``kept``, the blocks of ``routing``, the router stack of
    ``stacked`` and the block and pipeline shares of ``gradients``."""

    def __init__(
        self,
        key_values: KeyValueRows,
        kept: KeptGradients,
        routing: StaticRouting,
        stacked: StackedRouting,
        gradients: ConsumerGradients,
    ):
        self.key_values, self.kept, self.routing, self.stacked, self.gradients = (
            key_values,
            kept,
            routing,
            stacked,
            gradients,
        )

    def serves(self, router: LimeRouter) -> bool:
        """Whether ``router``'s layer routes as the module docstring says: the Triton path, no tensor
        parallelism, a learned or fixed product (not the identity) reading the layer's own rows."""
        return (
            self.key_values.triton
            and router.sharding.size == 1
            and not router.identity
            and router.read_sources[-1] == router.layer
        )

    def store_and_mix(
        self,
        router: LimeRouter,
        key: torch.Tensor,
        value: torch.Tensor,
        earlier: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Eqs. 1-2 of ``router``'s layer (module docstring): its keys/values ``[s, b, h, d]``
        written into the buffer, the routed keys and values returned (``[s, b, h, d]`` each, two
        tensors), the block's ``earlier`` sums added when given.  One launch per row block of
        sources (one unless the layer reads another pipeline chunk's rows or skips sources)."""
        rows = self.key_values
        rows.allocate(key)
        keys, values = key.new_empty(rows.kv_shape), key.new_empty(rows.kv_shape)
        out = Halves.of_heads(keys, values)
        added = None if earlier is None else Halves.of_heads(*earlier)
        since = self.routing.block_of(router.layer).start if earlier is not None else 0
        *others, (start, _) = self.routing.source_spans(router, since)
        for other_start, other_stop in others:
            term = (_router_columns(router, other_start, other_stop), rows.halves(other_start, other_stop))
            kernels.mix(out, term, accumulate=added)
            added = out
        layer = router.layer
        first = (_router_columns(router, start, layer), rows.halves(start, layer)) if start < layer else None
        own = (_router_columns(router, layer, layer + 1), Halves.of_heads(key, value))
        kernels.mix(out, first, own, accumulate=added, store=rows.halves(layer, layer + 1))
        return keys, values

    def backward(
        self, router: LimeRouter, grads: Halves, since: int | None
    ) -> tuple[tuple[slice, torch.Tensor] | None, torch.Tensor, torch.Tensor]:
        """A layer's backward, ``grads`` being g_l: ``(weight gradient piece or None, grad keys,
        grad values)``.  The piece (``since``: its first source layer; None: no weight gradient)
        is ``(columns, [kv_heads, len(columns)])`` in ``weight_grad_dtype``, dL/dW_l = g_l @
        B[sources]^T at the columns of the sources from layer ``since`` on, zero where no kept
        route reads; the keys'/values' gradients ``[s, b, h, d]`` each are ``kv_grad``'s.  One
        launch for both where g_l's rows fit one tile (``kernels.fits_one_tile``): the weight
        gradient's programs keep g_l into l's dead rows after reading them; else one launch each.
        Sources in another pipeline chunk's rows take one weight-gradient launch more each."""
        if since is None:
            return None, *self.kv_grad(router, grads)
        rows, spans = self.key_values, self.routing.source_spans(router, since)
        columns = slice(router.columns(*spans[0]).start, router.weight.shape[1])
        terms = [(router.columns(start, stop).start - columns.start, rows.halves(start, stop)) for start, stop in spans]
        width, dtype = columns.stop - columns.start, weight_grad_dtype(router.weight)
        if not kernels.fits_one_tile(grads):
            weight = kernels.weight_grad_sums(grads, terms, width, dtype, rows.deterministic)
            return (columns, weight), *self.kv_grad(router, grads)
        weight, splits = kernels.weight_grad_output(grads, terms, width, dtype, rows.deterministic)
        *others, (column_start, own_rows) = terms
        for other_start, other_rows in others:
            kernels.weight_grad(weight, grads, other_rows, other_start, rows.deterministic, splits)
        keys, values, (out, first, mine, added, _, more) = self._kv_grad_operands(router, grads)
        own_row = (router.layer - spans[-1][0]) * router.local_heads
        kernels.mix_and_weight_grad(
            out, first, mine, weight, own_rows, column_start, own_row, rows.deterministic, splits, added, more
        )
        self.kept.mark_kept(router.layer)
        return (columns, weight.sum(0) if rows.deterministic else weight), keys, values

    def kv_grad(self, router: LimeRouter, grads: Halves) -> tuple[torch.Tensor, torch.Tensor]:
        """The gradient of layer l's keys and values (``[s, b, h, d]`` each): sum over its
        consumers m of W_m[:, l]^T g_m, g_l being ``grads`` (kept into l's dead rows on the way)
        and the others' kept; with blocked routing the share of consumers after l's block
        (computed for the block at its first use) added, and only the in-block consumers
        multiplied here; under pipeline parallelism later chunks' share
        (``KeptGradients.downstream_halves``) added.  One launch."""
        keys, values, (out, first, mine, added, kept_rows, more) = self._kv_grad_operands(router, grads)
        kernels.mix(out, first, mine, accumulate=added, store=kept_rows, more=more)
        self.kept.mark_kept(router.layer)
        return keys, values

    def _kv_grad_operands(self, router: LimeRouter, grads: Halves) -> tuple[torch.Tensor, torch.Tensor, tuple]:
        """``kv_grad``'s outputs (new) and its mix's operands ``(out, first, mine, added, kept
        rows, more)``."""
        layer, gradients, kept = router.layer, self.gradients, self.kept
        own = self.key_values.layers
        stop = min(routing_consumers(layer, gradients.num_layers, gradients.variant, gradients.window)[1], own.stop)
        kept.require(layer, range(layer + 1, stop))
        later = None
        if self.routing.block > 1:
            block = self.routing.block_of(layer)
            later, stop = gradients.later_consumer_grad(layer, block), min(stop, block.stop)
        kv_heads, kv_shape = router.weight.shape[0], self.key_values.kv_shape
        keys, values = grads.keys.new_empty(kv_shape), grads.keys.new_empty(kv_shape)
        consumers, first = range(layer + 1, stop), None
        if consumers:
            stack = self.stacked.stack(grads.keys).matrix
            top = (consumers.start - own.start) * kv_heads
            sources = slice(layer * router.local_heads, (layer + 1) * router.local_heads)
            columns = Columns.of(stack, slice(top, top + len(consumers) * kv_heads), sources, transposed=True)
            first = (columns, kept.grad_halves(consumers, kv_heads))
        mine = (_router_columns(router, layer, layer + 1, transposed=True), grads)
        added = None if later is None else Halves.of_heads(later)
        kept_rows = kept.grad_halves(range(layer, layer + 1), kv_heads)
        out = Halves.of_heads(keys, values)
        return keys, values, (out, first, mine, added, kept_rows, kept.downstream_halves(layer))


def _router_columns(router: LimeRouter, start: int, stop: int, transposed: bool = False) -> Columns:
    """``router.weight[:, columns of sources start..stop-1]`` (``.t()`` when ``transposed``)."""
    return Columns.of(router.weight, slice(0, router.weight.shape[0]), router.columns(start, stop), transposed)
