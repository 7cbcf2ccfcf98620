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

import torch
from megatron.core import parallel_state
from torch import nn

from lime_megatron.models.lime.router import routing_sources


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


def pruned_counts(chunks: Iterable[nn.Module]) -> tuple[int, int]:
    """(routes, masked routes) of this rank's routers: static weights, or dynamic (head, source)
    pairs; a tensor-parallel replica of another rank's heads is not counted."""
    total = masked = 0
    for router in routers_of(chunks):
        if router.sharding.primary:
            total += router.route_mask.numel()
            masked += int((~router.route_mask).sum())
    return total, masked


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
