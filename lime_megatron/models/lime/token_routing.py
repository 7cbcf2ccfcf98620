"""The dynamic router's mixing of the buffer rows by per-token weights (``dynamic_router``, v1 §3).

Its weights p_l ``[s, b, local kv heads, l + 1]`` depend on the token, so Eq. 2 is not a matrix
product but one multiply-add per source row, head h of the routed keys/values reading head h of
each source only:

    routed[x, s, b, h, d] = sum_j p_l[s, b, h, j] * rows_j[h, x, s, b, d]        (x: keys 0, values 1)

Backward (``dynamic_router.RouteKeysValuesByToken``): ``token_weight_grad`` gives dL/dp_l from g_l
and the source rows, read before g_l overwrites layer l's own rows, and ``keep_token_weights``
keeps p_l for l's sources, whose row gradient is sum_m p_m[..., l] * g_m over the kept g_m
(``mixed_grad``, called by ``consumer_gradients``).  Route pruning (``pruning``) leaves a source
none of a router's kept routes reads out of its ``read_sources``: its rows are not read (its
weight is 0).  Each read of N-wide rows is shown to the product observer (``routing_products``).
"""

from __future__ import annotations

import torch

from lime_megatron.models.lime.kept_gradients import KeptGradients
from lime_megatron.models.lime.key_value_rows import KeyValueRows
from lime_megatron.models.lime.routing_products import observed_read


def per_row(weights: torch.Tensor) -> torch.Tensor:
    """One source's token weights ``[s, b, h]`` broadcast over rows ``[h, 2, s, b, d]``."""
    return weights.permute(2, 0, 1)[:, None, :, :, None]


class TokenRouting:
    """Eq. 2 and its gradients for dynamic routers, over the rows of ``key_values``; g_m from
    ``kept``.  Keeps each dynamic consumer's p_m from its backward until its sources' backward."""

    def __init__(self, key_values: KeyValueRows, kept: KeptGradients):
        self.key_values, self.kept = key_values, kept
        self._weights: dict[int, torch.Tensor] = {}

    def mix_by_token(self, router, probs: torch.Tensor, kind: str = "forward") -> tuple[torch.Tensor, torch.Tensor]:
        """routed[x, s, b, h, d] = sum_j probs[s, b, h, j] * rows_j[h, x, s, b, d], written as keys
        (x = 0) and values (x = 1) in attention's layout ``[s, b, local kv heads, d]`` (two new
        tensors); one multiply-add per source layer read (a pruned source's weights are 0), its
        rows read as ``kind``."""
        s, b, h, d = self.key_values.kv_shape
        keys, values = probs.new_zeros(s, b, h, d), probs.new_zeros(s, b, h, d)
        for source in router.read_sources:
            rows = self.key_values.heads_first(observed_read(kind, self.key_values.rows(source, source + 1)))
            weights = per_row(probs[..., source])[:, 0]
            for index, routed in enumerate((keys, values)):
                routed.permute(2, 0, 1, 3).addcmul_(weights, rows[:, index])
        return keys, values

    def token_weight_grad(self, router, grad_rows: torch.Tensor) -> torch.Tensor:
        """dL/dp_l[s, b, h, j] = sum_{x, d} g_l[h, x, s, b, d] * rows_j[h, x, s, b, d]:
        ``[s, b, local kv heads, l + 1]``.  Run before g_l overwrites layer l's own rows."""
        grad = self.key_values.heads_first(grad_rows)
        s, b, h, _ = self.key_values.kv_shape
        grads = grad_rows.new_zeros(h, s, b, len(router.sources))
        for source in router.read_sources:  # a pruned route's weight is a constant 0
            rows = observed_read("weight_grad", self.key_values.rows(source, source + 1))
            grads[..., source] = (grad * self.key_values.heads_first(rows)).sum(dim=(1, 4))
        return grads.permute(1, 2, 0, 3)

    def keep_token_weights(self, layer: int, probs: torch.Tensor) -> None:
        """Backward of dynamic layer ``layer``: keep its p ``[s, b, h, l+1]`` until its sources
        took their share ``p[..., source] * g_layer`` (freed with the memory)."""
        self._weights[layer] = probs.detach()

    def mixed_grad(self, sources: range, routers: list) -> torch.Tensor:
        """sum_m p_m[..., l] * g_m over the consumers m of ``routers`` for each l in ``sources``
        (column l of p_m is source layer l): ``[len(sources) * local heads, 2*s*b*d]``, each g_m
        read once per source its router reads."""
        h, first = self.key_values.kv_heads, self.key_values.layers.start
        grads = self.kept.buffer(h)
        mixed = grads.new_zeros(len(sources) * h, grads.shape[1])
        heads_first = self.key_values.heads_first
        for router in routers:
            grad = grads[(router.layer - first) * h : (router.layer - first + 1) * h]
            weights = self._weights[router.layer]
            for index, source in enumerate(sources):
                if source in router.read_sources:  # g_m read once per source it reads
                    target = heads_first(mixed[index * h : (index + 1) * h])
                    kept = heads_first(observed_read("row_grad", grad))
                    target.addcmul_(per_row(weights[..., source]), kept)
        return mixed
