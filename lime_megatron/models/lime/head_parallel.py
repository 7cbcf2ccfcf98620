"""Tensor-parallel key/value heads: which heads a rank holds, and the two collectives of
routing under tensor parallelism (paper Eq. 2 split by input head).

Each rank multiplies its own buffered heads by its columns of R^(l), which gives partial sums
for all kv_heads output heads; ``scatter_heads`` (one reduce-scatter) leaves each rank the sums
of its own heads.  In backward ``gather_heads`` (one all-gather) is its adjoint.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class HeadSharding:
    """The key/value heads one tensor-parallel rank holds, following megatron's GQA split.

    With ``kv_heads >= size`` rank r holds heads r*k..(r+1)*k-1 (k = kv_heads / size); with
    ``kv_heads < size`` megatron gives every rank one head, shared by ``replicas`` consecutive
    ranks, of which the first (``primary``) contributes the head's routing terms.
    """

    kv_heads: int
    rank: int = 0
    size: int = 1
    group: Any = field(default=None, compare=False)
    """The tensor-parallel process group (None without tensor parallelism)."""

    @property
    def replicas(self) -> int:
        """Ranks that hold the same heads."""
        return max(1, self.size // self.kv_heads)

    def heads_of(self, rank: int) -> list[int]:
        """Heads held by ``rank``."""
        if self.kv_heads >= self.size:
            per_rank = self.kv_heads // self.size
            return list(range(rank * per_rank, (rank + 1) * per_rank))
        return [rank // self.replicas]

    @property
    def local_heads(self) -> list[int]:
        """Heads held by this rank."""
        return self.heads_of(self.rank)

    @property
    def primary(self) -> bool:
        """Whether this rank contributes its heads' routing terms (one rank per replica group)."""
        return self.rank % self.replicas == 0

    def heads_by_rank(self) -> list[int]:
        """Heads of every rank in rank order: the row order of a reduce-scatter over ranks."""
        return [head for rank in range(self.size) for head in self.heads_of(rank)]


def scatter_heads(partial: torch.Tensor, sharding: HeadSharding) -> torch.Tensor:
    """Sum ``partial`` [kv_heads, n] over tensor-parallel ranks; each keeps its own heads' rows."""
    if sharding.size == 1:
        return partial
    rows = partial[rank_order(sharding, partial.device)] if sharding.replicas > 1 else partial
    out = partial.new_empty(len(sharding.local_heads), partial.shape[1])
    torch.distributed.reduce_scatter_tensor(out, rows.contiguous(), group=sharding.group)
    return out


def gather_heads(local: torch.Tensor, sharding: HeadSharding) -> torch.Tensor:
    """Adjoint of ``scatter_heads``: every rank's rows [local heads, n] -> [kv_heads, n]."""
    if sharding.size == 1:
        return local
    gathered = local.new_empty(sharding.size * local.shape[0], local.shape[1])
    torch.distributed.all_gather_into_tensor(gathered, local.contiguous(), group=sharding.group)
    if sharding.replicas == 1:
        return gathered
    index = rank_order(sharding, local.device)
    return local.new_zeros(sharding.kv_heads, local.shape[1]).index_add_(0, index, gathered)


def rank_order(sharding: HeadSharding, device: torch.device) -> torch.Tensor:
    """``sharding.heads_by_rank()`` as an index tensor on ``device``, made once per sharding and
    device: a tensor made from host data per pass would cost a copy to the device, on a GPU one
    that waits for the device to drain (a copy from pageable memory)."""
    return _rank_order(sharding.kv_heads, sharding.size, device)


@functools.cache
def _rank_order(kv_heads: int, size: int, device: torch.device) -> torch.Tensor:
    return torch.tensor(HeadSharding(kv_heads, size=size).heads_by_rank(), device=device)
