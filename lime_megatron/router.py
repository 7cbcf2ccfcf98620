"""The LIMe router R^(l) (paper §4 Eq. 2, App. D, App. E) and its routing plan.

Layer l (0-based) mixes the buffered key/value heads of its *source* layers into its own
``kv_heads`` heads.  The router is stored as a matrix ``W`` of shape
``[kv_heads, len(sources) * kv_heads]`` whose column ``j * kv_heads + h'`` holds the weight
R_{s_j, h', h} from head h' of source layer s_j into head h (row h).  One router serves keys and
values; weights are signed and not normalised (no softmax).

Sources per variant (layer l, window j, 0-based layers):

- ``full``    : 0..l (learned)
- ``average`` : 0..l, fixed weights 1/(l+1) on the same head (no parameters)
- ``last``    : max(0, l-j+1)..l (learned)
- ``first``   : 0..min(l, j)-1 and l (learned)

Layer 0 has no router: its routing matrix is the fixed identity.  The current layer is always
the last source, so the identity initialisation of the paper sets the last ``kv_heads`` columns.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from lime_megatron.config import LimeTransformerConfig

ROUTER_PARAM_ATTR = "is_lime_router"
"""Attribute set to True on every router weight; optimizer overrides select it (see
``router_param_key``)."""


def routing_sources(layer: int, variant: str, window: int | None) -> list[int]:
    """Source layers (0-based, ascending, ending with ``layer``) that layer ``layer`` mixes."""
    if variant in ("full", "average"):
        return list(range(layer + 1))
    if variant == "last":
        return list(range(max(0, layer - window + 1), layer + 1))
    if variant == "first":
        return sorted(set(range(min(layer, window))) | {layer})
    raise ValueError(f"unknown LIMe router variant {variant!r}")


def contiguous_runs(layers: list[int]) -> list[tuple[int, int]]:
    """Split ascending layer indices into half-open runs ``(start, stop)`` of consecutive layers."""
    runs: list[tuple[int, int]] = []
    for layer in layers:
        if runs and runs[-1][1] == layer:
            runs[-1] = (runs[-1][0], layer + 1)
        else:
            runs.append((layer, layer + 1))
    return runs


def routing_consumers(
    layer: int, num_layers: int, variant: str, window: int | None
) -> tuple[int, int]:
    """Half-open range ``(layer, stop)`` of the layers (of ``num_layers``) that read ``layer``.

    The inverse of ``routing_sources``; it is a contiguous range for every variant.
    """
    if variant == "last":
        return layer, min(num_layers, layer + window)
    if variant == "first" and layer >= window:
        return layer, layer + 1
    return layer, num_layers


def router_parameter_count(config: LimeTransformerConfig) -> int:
    """Number of learned router weights of the whole model (0 for ``average`` and the baseline).

    For ``full`` this is kv_heads^2 * (L(L+1)/2 - 1).
    """
    if not config.lime or config.lime_router == "average":
        return 0
    per_layer = (
        len(routing_sources(layer, config.lime_router, config.lime_router_window))
        for layer in range(1, config.num_layers)
    )
    return config.kv_heads**2 * sum(per_layer)


def init_router_weight(weight: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Paper App. A/E initialisation, in place: identity on the own-layer slice (the last
    ``kv_heads`` columns), Kaiming-uniform with bound sqrt(3 / fan_in) elsewhere, where
    fan_in = number of columns = (number of sources) * kv_heads."""
    bound = math.sqrt(3.0 / weight.shape[1])
    with torch.no_grad():
        weight.uniform_(-bound, bound)
        weight[:, -kv_heads:].copy_(torch.eye(kv_heads, dtype=weight.dtype))
    return weight


def fixed_routing_weight(sources: int, kv_heads: int, variant: str, dtype: torch.dtype) -> torch.Tensor:
    """The non-learned routing matrix: identity for a single source (layer 0), the per-head
    uniform average for ``average``."""
    eye = torch.eye(kv_heads, dtype=dtype)
    if sources == 1:
        return eye
    assert variant == "average", f"variant {variant!r} has learned routing weights"
    return torch.cat([eye / sources] * sources, dim=1)


class LimeRouter(nn.Module):
    """R^(l) of one layer: ``weight`` [kv_heads, len(sources) * kv_heads].

    A learned ``nn.Parameter`` (tagged ``is_lime_router``) for layers >= 1 of the learned
    variants; a fixed, non-persistent buffer for layer 0 (identity) and for ``average``.
    """

    def __init__(self, config: LimeTransformerConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.sources = routing_sources(layer, config.lime_router, config.lime_router_window)
        self.source_runs = contiguous_runs(self.sources)
        kv_heads = config.kv_heads
        self._column_of = {source: j * kv_heads for j, source in enumerate(self.sources)}
        if layer == 0 or config.lime_router == "average":
            fixed = fixed_routing_weight(len(self.sources), kv_heads, config.lime_router, config.params_dtype)
            self.register_buffer("weight", fixed, persistent=False)
            return
        weight = torch.empty(kv_heads, len(self.sources) * kv_heads, dtype=config.params_dtype)
        if config.perform_initialization:
            init_router_weight(weight, kv_heads)
        self.weight = nn.Parameter(weight)
        setattr(self.weight, ROUTER_PARAM_ATTR, True)

    @property
    def learned(self) -> bool:
        """Whether this router has trainable weights."""
        return isinstance(self.weight, nn.Parameter)

    def block(self, source: int) -> torch.Tensor:
        """Columns of ``weight`` that read source layer ``source``: [kv_heads, kv_heads]."""
        start = self._column_of[source]
        return self.weight[:, start : start + self.weight.shape[0]]

    def column_runs(self) -> list[tuple[slice, tuple[int, int]]]:
        """``(columns of weight, (first layer, stop layer))`` per contiguous run of sources."""
        return [
            (slice(self._column_of[start], self._column_of[stop - 1] + self.weight.shape[0]),
             (start, stop))
            for start, stop in self.source_runs
        ]

    def extra_repr(self) -> str:
        return f"layer={self.layer}, sources={self.source_runs}, learned={self.learned}"
