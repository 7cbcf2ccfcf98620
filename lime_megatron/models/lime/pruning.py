"""Route pruning (the paper's first version, v1 §5.4 and Table 5): top-p masks of the routes.

At the iterations ``--lime-prune-iters`` the trainer sets, per consumer layer and key/value head,
a mask over the head's routes (``set_route_masks``):

- static routers: the weights of row h of R^(l), scored by |weight| normalised over the row;
- dynamic routers: the (head, source) pairs, scored by the dynamic prior, the mean of p_l(t)[h, :]
  over the tokens of that iteration's global batch (``collect_dynamic_prior``; all data-parallel
  ranks' tokens).

``top_p_mask`` keeps the largest scores of a row until the kept share reaches ``top_p`` and masks
the rest (at least one route per head stays).  A masked static weight is zero in every forward
(the trainer zeroes masked weights after each optimizer step, ``enforce_route_masks``, since
Adam's moments would move them) and receives no gradient (a gradient hook on the weight); a masked
dynamic route gets logit -inf, so weight 0, and W_l's row for it no gradient.  A source none of a
router's heads reads leaves its ``read_sources``: the routing products skip its rows.  Masks are
part of the checkpoint.  ``share_route_reads`` (when masks are set or loaded) gives every rank the
source layers each layer still reads, so the pipeline carries no row that no later layer reads.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

import torch
from megatron.core import parallel_state
from torch import nn

from lime_megatron.models.lime.router import kept_by_source, routing_sources


def top_p_mask(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """Boolean mask ``[rows, n]`` keeping, per row, the largest ``scores`` (non-negative) until
    their share of the row's sum reaches ``top_p``: entry k (descending) is kept when the share of
    the entries before it is below ``top_p``.  Ties are broken by position (stable sort)."""
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top-p must be in (0, 1], got {top_p}")
    share = scores / scores.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(scores.dtype).tiny)
    ordered, order = share.sort(dim=-1, descending=True, stable=True)
    kept = (ordered.cumsum(dim=-1) - ordered) < top_p
    return torch.zeros_like(kept).scatter(-1, order, kept)


def routers_of(chunks: Iterable[nn.Module]) -> list[nn.Module]:
    """The learned routers (static and dynamic) of the model chunks, in layer order."""
    routers = [
        module
        for chunk in chunks
        for module in chunk.modules()
        if getattr(module, "learned", False) and hasattr(module, "route_mask")
    ]
    return sorted(routers, key=lambda router: router.layer)


def collect_dynamic_prior(chunks: Iterable[nn.Module], collecting: bool = True) -> None:
    """Start (``collecting``) or stop accumulating the dynamic routers' prior over the forward
    passes of training (``set_route_masks`` takes it)."""
    for router in routers_of(chunks):
        if router.dynamic:
            router.collect_prior(collecting)


def set_route_masks(chunks: Iterable[nn.Module], top_p: float) -> None:
    """Set every learned router's mask by top-p (module docstring); the dynamic routers' priors
    are summed over the data-parallel ranks first."""
    for router in routers_of(chunks):
        if router.dynamic:
            prior = router.take_prior()
            group = parallel_state.get_data_parallel_group(with_context_parallel=True)
            if torch.distributed.is_initialized() and torch.distributed.get_world_size(group) > 1:
                torch.distributed.all_reduce(prior, group=group)
            router.set_route_mask(top_p_mask(prior, top_p))
        else:
            router.set_route_mask(top_p_mask(router.full_weight().abs(), top_p))


def enforce_route_masks(chunks: Iterable[nn.Module]) -> None:
    """Zero the masked static router weights again (after an optimizer step)."""
    with torch.no_grad():
        for router in routers_of(chunks):
            if not router.dynamic and router.pruned:
                router.weight.mul_(router.route_mask)


class RouteCounts(NamedTuple):
    """The routes pruning chooses among and the masked ones, in two units.

    Ours: a static router weight R^(l)[h, (j, h')], or a dynamic (head h, source j) pair, own
    layer j = l included: ``kv_heads^2 * (L(L+1)/2 - 1)`` static, ``kv_heads * (L(L+1)/2 - 1)``
    dynamic for the ``full`` and ``dynamic`` variants.  v1 Table 5's: one (head h, earlier source
    j < l) pair, the own layer not counted: ``kv_heads * L(L-1)/2`` (v1's 7,936 / 32,256 / 130,048
    at 16 heads and 32 / 64 / 128 layers); a v1 route is masked when every route of ours in it
    is (static: all R^(l)[h, (j, h')] over h')."""

    routes: int
    masked: int
    v1_routes: int
    v1_masked: int


def v1_route_count(config) -> int:
    """v1 Table 5's total of ``config``: kv_heads times the earlier sources of every routed layer
    (``RouteCounts``), from the variant's sources alone."""
    layers = range(1, config.num_layers)
    earlier = sum(len(routing_sources(layer, config.lime_router, config.lime_router_window)) - 1 for layer in layers)
    return config.kv_heads * earlier


def _v1_counts(router: nn.Module) -> tuple[int, int]:
    """(v1 routes, masked v1 routes) of one router on this rank (``RouteCounts``).  A static
    router's rows hold every consumer head over this rank's source heads, so whether a (head,
    source) pair keeps a route is reduced over the tensor-parallel ranks (a collective) and
    counted on rank 0; a dynamic router's rows are its own heads, counted on their primary rank."""
    kept = kept_by_source(router.route_mask, len(router.sources))[:, :-1]  # the own layer is the last source
    counted = router.sharding.primary
    if not router.dynamic and router.sharding.size > 1:
        reduced = kept.to(torch.int32)
        torch.distributed.all_reduce(reduced, torch.distributed.ReduceOp.MAX, group=router.sharding.group)
        kept, counted = reduced.bool(), router.sharding.rank == 0
    return (kept.numel(), int((~kept).sum())) if counted else (0, 0)


def pruned_counts(chunks: Iterable[nn.Module]) -> RouteCounts:
    """``RouteCounts`` of this rank's routers (sum them over the model-parallel ranks); a
    tensor-parallel replica of another rank's heads is not counted.  Every tensor-parallel rank
    calls it (the static routers' v1 counts reduce over those ranks)."""
    total = masked = v1_total = v1_masked = 0
    for router in routers_of(chunks):
        if router.sharding.primary:
            total += router.route_mask.numel()
            masked += int((~router.route_mask).sum())
        routes, pruned = _v1_counts(router)
        v1_total, v1_masked = v1_total + routes, v1_masked + pruned
    return RouteCounts(total, masked, v1_total, v1_masked)


def share_route_reads(chunks: list[nn.Module]) -> None:
    """Set ``config.lime_route_reads`` of the model chunks' config: per layer, the source layers
    some kept route of any head reads (``read_sources``), the same on every rank.  The union over
    the tensor-parallel ranks' heads, then each layer's row from the pipeline stage that holds it
    (the other stages hold the variant's full row there, the superset)."""
    config = chunks[0].config
    device = next(chunks[0].parameters()).device  # the collectives' device (the model's)
    reads = torch.zeros(config.num_layers, config.num_layers, dtype=torch.int32, device=device)
    for layer in range(config.num_layers):
        reads[layer, routing_sources(layer, config.lime_router, config.lime_router_window)] = 1
    for router in routers_of(chunks):
        reads[router.layer] = 0
        reads[router.layer, router.read_sources] = 1
    if torch.distributed.is_initialized() and parallel_state.model_parallel_is_initialized():
        torch.distributed.all_reduce(
            reads, torch.distributed.ReduceOp.MAX, group=parallel_state.get_tensor_model_parallel_group()
        )
        torch.distributed.all_reduce(
            reads, torch.distributed.ReduceOp.MIN, group=parallel_state.get_pipeline_model_parallel_group()
        )
    config.lime_route_reads = tuple(tuple(row.nonzero().flatten().tolist()) for row in reads.cpu())
