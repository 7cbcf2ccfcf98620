"""Bytes the LIMe routing products read per training step, per layer (B = 1) or blocked.

Every routing product is skinny: ``[r, k] @ [k, N]`` with N = 2*s*b*d (one buffer row holds a
head's keys and values), so its time is the bytes of its N-wide operand.  Per model chunk of L
layers with g kv heads and blocks of B layers (``lime_megatron.models.lime.routing_blocks``), a
routed layer m reads (rows of N elements; a block's first layer adds one product for the block):

- forward mix:    its sources inside its block; per block, the union of the block's sources
                  before it (B = 1: all its sources);
- rebuild of the dropped routed K/V (where they are dropped): the forward's reads again;
- router-weight gradient (learned routers): the forward's reads again (g_m @ rows^T);
- row gradient:   per source layer l, the kept g_m of its consumers m inside l's block; per
                  source block, those of the consumers after the block (B = 1: all consumers
                  m of l, less l itself for layer 0, whose term is its own gradient).

For the ``full`` router that is about L^2 g / 2 rows per product at B = 1 and
L^2 g / (2B) + L B g / 2 blocked.  This enumerates the same plan from the routing sources and
consumers (``router.routing_sources`` / ``routing_consumers``); ``tests/planning`` checks it
against the bytes the products actually read.
"""

from __future__ import annotations

import torch

from lime_megatron.models.config import LimeTransformerConfig
from lime_megatron.models.lime.recompute import drops_routed_kv
from lime_megatron.models.lime.router import routing_consumers, routing_sources


def chunk_blocks(layers: range, block: int) -> list[range]:
    """The routing blocks of a chunk of ``layers``: ``block`` consecutive layers from its first
    (``StaticRouting.block_of``), the last one shorter where ``block`` does not divide."""
    return [range(start, min(start + block, layers.stop)) for start in range(layers.start, layers.stop, block)]


def _forward_rows(config: LimeTransformerConfig, layers: range, block: int) -> int:
    """Source rows (in layers, not heads) the forward mixes of ``layers`` read."""
    rows = 0
    for consumers in chunk_blocks(layers, block):
        earlier = set()
        for m in consumers:
            if m == 0:
                continue  # the identity routing: no product
            sources = routing_sources(m, config.lime_router, config.lime_router_window)
            blocked = block > 1 and sources[0] < consumers.start
            rows += sum(1 for source in sources if source >= consumers.start) if blocked else len(sources)
            earlier |= {source for source in sources if source < consumers.start} if blocked else set()
        rows += len(earlier)
    return rows


def _row_grad_rows(config: LimeTransformerConfig, layers: range, block: int) -> int:
    """Kept gradient rows (in layers) the row-gradient products of ``layers`` read."""
    rows = 0
    for sources in chunk_blocks(layers, block):
        later_stop = sources.stop
        for layer in sources:
            stop = min(
                routing_consumers(layer, config.num_layers, config.lime_router, config.lime_router_window)[1],
                layers.stop,
            )
            first = layer + 1 if layer == 0 else layer
            rows += len(range(first, min(stop, sources.stop))) if block > 1 else len(range(first, stop))
            later_stop = max(later_stop, stop)
        rows += len(range(sources.stop, later_stop)) if block > 1 else 0
    return rows


def routing_bytes_per_step(
    config: LimeTransformerConfig,
    seq_len: int,
    micro_batch: int,
    block: int,
    layers: range | None = None,
    transformer_impl: str = "local",
) -> dict[str, int]:
    """Bytes of N-wide operands the routing products of ``layers`` (default: all, one chunk)
    read in one forward and backward of one micro-batch, by product: ``forward``, ``rebuild``
    (where the attention drops the routed K/V, ``recompute.drops_routed_kv``), ``weight_grad``,
    ``row_grad`` (no tensor parallelism)."""
    layers = range(config.num_layers) if layers is None else layers
    row = 2 * seq_len * micro_batch * config.kv_channels * config.kv_heads
    row *= torch.empty(0, dtype=config.params_dtype).element_size()
    forward = _forward_rows(config, layers, block) * row
    learned = config.lime_router != "average"
    return {
        "forward": forward,
        "rebuild": forward if drops_routed_kv(config, transformer_impl) else 0,
        "weight_grad": forward if learned else 0,
        "row_grad": _row_grad_rows(config, layers, block) * row,
    }
