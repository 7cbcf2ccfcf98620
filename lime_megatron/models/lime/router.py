"""The LIMe router R^(l) (paper §4 Eq. 2, App. D, App. E) and its routing plan.

Layer l (0-based) mixes the buffered key/value heads of its *source* layers into its own
``kv_heads`` heads.  The router is stored as a matrix ``W`` of shape
``[kv_heads, len(sources) * kv_heads]`` whose column ``j * kv_heads + h'`` holds the weight
R_{s_j, h', h} from head h' of source layer s_j into head h (row h).  One router serves keys and
values; weights are signed and not normalised (no softmax).

Sources per variant (layer l, window j, 0-based layers):

- ``full``    : 0..l (learned)
- ``dynamic`` : 0..l (per-token weights, ``dynamic_router``; layer 0 has this static identity)
- ``average`` : 0..l, fixed weights 1/(l+1) on the same head (no parameters)
- ``last``    : max(0, l-j+1)..l (learned)
- ``first``   : 0..min(l, j)-1 and l (learned)

Layer 0 has no router: its routing matrix is the fixed identity (``LimeRouter.identity``), which
is never multiplied: the memory hands layer 0 its own keys/values.  The current layer is always
the last source, so the identity initialisation of the paper sets the last ``kv_heads`` columns.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from torch import nn

from lime_megatron.models.config import LimeTransformerConfig
from lime_megatron.models.lime.head_parallel import HeadSharding

ROUTER_PARAM_ATTR = "is_lime_router"
"""Attribute set to True on every router weight; optimizer overrides select it (see
``router_param_key``)."""


def routing_sources(layer: int, variant: str, window: int | None) -> list[int]:
    """Source layers (0-based, ascending, ending with ``layer``) that layer ``layer`` mixes."""
    if variant in ("full", "average", "dynamic"):
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


def routing_consumers(layer: int, num_layers: int, variant: str, window: int | None) -> tuple[int, int]:
    """Half-open range ``(layer, stop)`` of the layers (of ``num_layers``) that read ``layer``.

    The inverse of ``routing_sources``; it is a contiguous range for every variant.
    """
    if variant == "last":
        return layer, min(num_layers, layer + window)
    if variant == "first" and layer >= window:
        return layer, layer + 1
    return layer, num_layers


def layer_reads(config, layer: int) -> list[int]:
    """Source layers that layer ``layer`` of the model ``config`` describes reads: the variant's
    (``routing_sources``), or after route pruning those some kept route reads
    (``config.lime_route_reads``)."""
    reads = getattr(config, "lime_route_reads", None)
    if reads is not None:
        return list(reads[layer])
    return routing_sources(layer, config.lime_router, config.lime_router_window)


def router_source_count(config: LimeTransformerConfig, layers: Iterable[int] | None = None) -> int:
    """Routing sources summed over the routed layers among ``layers`` (default: the whole model).

    Layer 0 has no router (its routing matrix is the fixed identity) and the baseline none at
    all; every other layer l mixes ``len(routing_sources(l, ...))`` source layers.  Router
    parameters and router FLOPs are both proportional to this count.
    """
    if not config.lime:
        return 0
    layers = range(config.num_layers) if layers is None else layers
    return sum(
        len(routing_sources(layer, config.lime_router, config.lime_router_window)) for layer in layers if layer > 0
    )


def router_parameter_count(config: LimeTransformerConfig) -> int:
    """Number of learned router weights of the whole model (0 for ``average`` and the baseline).

    kv_heads^2 per source of every routed layer: for ``full`` kv_heads^2 * (L(L+1)/2 - 1); for
    ``dynamic`` hidden * kv_heads per source (W_l maps the input to one logit per head and source).
    """
    if config.lime_router == "average":
        return 0
    return router_weights_per_source(config) * router_source_count(config)


def router_weights_per_source(config: LimeTransformerConfig) -> int:
    """Learned router weights per (routed layer, source layer): kv_heads^2 (static) or
    hidden * kv_heads (dynamic)."""
    if config.lime_router == "dynamic":
        return config.hidden_size * config.kv_heads
    return config.kv_heads**2


def add_route_mask(router: nn.Module, config, shape: tuple[int, ...]) -> None:
    """Give ``router`` (static or dynamic) its ``route_mask`` of ``shape`` for route pruning
    (``pruning``; every route kept, all sources read), kept in the checkpoint when the run prunes
    (``config.lime_prune_top_p``), and refresh its read sources whenever a state dict is loaded
    into it (``refresh_read_sources``)."""
    router.prunable = config.lime_prune_top_p is not None
    router.register_buffer("route_mask", torch.ones(shape, dtype=torch.bool), persistent=router.prunable)
    router.register_load_state_dict_post_hook(lambda module, _keys: refresh_read_sources(module))
    router.read_sources, router.source_runs, router.pruned = router.sources, contiguous_runs(router.sources), False


def kept_by_source(mask: torch.Tensor, n_sources: int) -> torch.Tensor:
    """``[rows, n_sources]``: whether row ``r`` keeps some route from source ``j`` of a route mask
    whose columns group by source (static ``[kv, sources * local heads]``: row = consumer head,
    any of its source heads; dynamic ``[local heads, sources]``: the mask itself)."""
    return mask.view(mask.shape[0], n_sources, -1).any(dim=2)


_route_changes = 0


def route_changes() -> int:
    """How many times a router's read sources were set (``refresh_read_sources``): the routing
    launches recorded before a change are recorded anew after it (``kernels.launch_plans``)."""
    return _route_changes


def refresh_read_sources(router: nn.Module) -> None:
    """``router.read_sources`` (and their contiguous ``source_runs``) and ``router.pruned`` from
    its mask: the sources some kept route reads.  The mask's columns group by source (static
    ``[kv, sources * local heads]``, dynamic ``[local heads, sources]``)."""
    global _route_changes
    _route_changes += 1
    mask = router.route_mask
    read = kept_by_source(mask, len(router.sources)).any(dim=0).tolist()
    router.pruned = not bool(mask.all())
    router.read_sources = [source for source, kept in zip(router.sources, read) if kept]
    router.source_runs = contiguous_runs(router.read_sources)


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
    """R^(l) of one layer: ``weight`` [kv_heads, len(sources) * local kv heads].

    Column ``j * k + i`` holds the weights from local head i of source layer j (k local heads;
    k = kv_heads without tensor parallelism).  Rows are all kv_heads output heads: under tensor
    parallelism each rank holds the columns of its own input heads (see ``memory``).
    A learned ``nn.Parameter`` (tagged ``is_lime_router``) for layers >= 1 of the learned
    variants; a fixed, non-persistent buffer for layer 0 (identity) and for ``average``.
    """

    dynamic = False
    """Static weights (``dynamic_router.DynamicLimeRouter`` has per-token ones)."""

    def __init__(self, config: LimeTransformerConfig, layer: int, sharding: HeadSharding | None = None):
        super().__init__()
        self.layer = layer
        self.sharding = sharding or HeadSharding(config.kv_heads)
        self.sources = routing_sources(layer, config.lime_router, config.lime_router_window)
        self.read_sources = self.sources  # those a kept route reads (``pruning``)
        self.source_runs = contiguous_runs(self.sources)
        self.prunable = self.pruned = False
        self.local_heads = len(self.sharding.local_heads)
        """Number of input heads per source held here."""
        self._column_of = {source: j * self.local_heads for j, source in enumerate(self.sources)}
        self.learned = not (layer == 0 or config.lime_router == "average")
        """Whether this router has trainable weights (a fixed buffer for layer 0 and ``average``)."""
        self.identity = not self.learned and len(self.sources) == 1
        """Whether the routing is the fixed identity over the layer's own keys/values (layer 0 of
        every variant): Eq. 2 returns them unchanged, so no product is run
        (``StaticRouting.mix``)."""
        if not self.learned:
            fixed = fixed_routing_weight(len(self.sources), config.kv_heads, config.lime_router, config.params_dtype)
            self.register_buffer("weight", self._local_columns(fixed), persistent=False)
            return
        weight = torch.empty(config.kv_heads, len(self.sources) * config.kv_heads, dtype=config.params_dtype)
        if config.perform_initialization:
            init_router_weight(weight, config.kv_heads)
        self.weight = nn.Parameter(self._local_columns(weight))
        setattr(self.weight, ROUTER_PARAM_ATTR, True)
        # Split by input head: megatron's gradient norm counts a tensor-parallel parameter on
        # every rank, others on rank 0 only; a replica of another rank's heads is not counted.
        set_tensor_model_parallel_attributes(self.weight, is_parallel=self.sharding.primary, dim=1, stride=1)
        add_route_mask(self, config, self.weight.shape)
        if self.prunable:  # a masked weight receives no gradient (``pruning``)
            self.weight.register_hook(lambda grad: grad * self.route_mask)

    def full_weight(self) -> torch.Tensor:
        """R^(l) of all heads ``[kv_heads, n_sources * kv_heads]`` (gathered over tensor-parallel ranks)."""
        weight = self.weight.detach()
        if self.sharding.size == 1:
            return weight
        parts = [torch.empty_like(weight) for _ in range(self.sharding.size)]
        torch.distributed.all_gather(parts, weight.contiguous(), group=self.sharding.group)
        kv_heads = self.sharding.kv_heads
        full = weight.new_empty(weight.shape[0], len(self.sources), kv_heads)
        for rank, part in enumerate(parts):
            full[:, :, self.sharding.heads_of(rank)] = part.view(weight.shape[0], len(self.sources), -1)
        return full.view(weight.shape[0], -1)

    def set_route_mask(self, full_mask: torch.Tensor) -> None:
        """Mask the routes where ``full_mask`` (``[kv_heads, n_sources * kv_heads]``, all heads) is
        False: this rank's columns of it become ``route_mask`` and the masked weights zero."""
        with torch.no_grad():
            self.route_mask.copy_(self._local_columns(full_mask))
            self.weight.mul_(self.route_mask)
        refresh_read_sources(self)

    def _local_columns(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's columns of a full router matrix ``[kv_heads, n_sources * kv_heads]``."""
        if self.sharding.size == 1:
            return full
        kv_heads = self.sharding.kv_heads
        columns = [j * kv_heads + h for j in range(len(self.sources)) for h in self.sharding.local_heads]
        return full[:, columns].contiguous()

    def weight_columns(self, start: int, stop: int) -> torch.Tensor:
        """The columns of ``weight`` that read the consecutive source layers ``start..stop-1``:
        ``[kv_heads, (stop - start) * local heads]``, ``weight`` itself where they span it, else a
        view.  For the routing products, which run where grad mode is off (inside autograd
        Functions, in backward, in decoding): no ``detach`` is dispatched, as each operator is host
        time in a host-bound step (docs/routing.md, "Host work per layer"); with grad mode on this
        raises rather than hand out columns autograd would track."""
        if torch.is_grad_enabled():
            raise RuntimeError(
                f"router {self.layer}: weight_columns is for the routing products, which run "
                "with grad mode off; use the weight parameter itself under autograd"
            )
        columns = self.columns(start, stop)
        return self.weight if columns == slice(0, self.weight.shape[1]) else self.weight[:, columns]

    def columns(self, start: int, stop: int) -> slice:
        """Columns of ``weight`` that read the consecutive source layers ``start..stop-1``."""
        return slice(self._column_of[start], self._column_of[stop - 1] + self.local_heads)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        """megatron distributed-checkpoint entry of ``weight``, resharding across TP/PP sizes.

        Saved per layer (routers differ in shape, so unlike megatron's other layer parameters they
        are not stacked along a layer axis: ``sharded_offsets`` is not used) as the global
        ``[kv_heads, n_sources, kv_heads]`` tensor split along its last axis (input heads), so a
        checkpoint written at one TP size loads at any other; a pruning run's route mask likewise.
        Fixed routers (layer 0, ``average``) have nothing to save.
        """
        if not self.learned:
            return {}
        sharding, n_sources = self.sharding, len(self.sources)
        shard = (2, sharding.rank // sharding.replicas, sharding.size // sharding.replicas)

        def build(key, data, replica_id, flattened_range):
            if flattened_range is not None:
                raise NotImplementedError("LIMe router weights do not support flattened checkpoint ranges")
            view = data.view(data.shape[0], n_sources, -1)
            return ShardedTensor.from_rank_offsets(key, view, shard, replica_id=replica_id)

        def merge(loaded: torch.Tensor) -> torch.Tensor:
            return loaded.reshape(loaded.shape[0], -1)

        dp_rank = parallel_state.get_data_parallel_rank(with_context_parallel=True)
        replica_id = (0, sharding.rank % sharding.replicas, dp_rank)
        entries = {"weight": self.weight, "route_mask": self.route_mask} if self.prunable else {"weight": self.weight}
        return {
            f"{prefix}{name}": ShardedTensorFactory(
                f"{prefix}{name}_of_layer_{self.layer}", tensor, build, merge, replica_id
            )
            for name, tensor in entries.items()
        }

    def extra_repr(self) -> str:
        return f"layer={self.layer}, sources={self.source_runs}, learned={self.learned}"
