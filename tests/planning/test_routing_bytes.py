"""The bytes the routing products read, counted on the products themselves, against the plan of
``planning.routing_bytes`` at B = 1 and blocked; blocking reads fewer at the same FLOPs."""

from __future__ import annotations

from dataclasses import replace

import pytest
from torch.utils.flop_counter import FlopCounterMode

from lime_megatron.planning.routing_block import H100_SXM, forward_products, routing_block_size
from lime_megatron.planning.routing_bytes import routing_bytes_per_step
from lime_megatron.testing.routing_reads import RoutingReads, routing_reads
from tests.lime_fixtures import BATCH, SEQ, batch, loss_of, megatron_logits, tiny_model

pytestmark = [
    pytest.mark.usefixtures("megatron"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]

VARIANTS = {
    "full": dict(lime_router="full"),
    "average": dict(lime_router="average"),
    "last-2": dict(lime_router="last", lime_router_window=2),
    "first-2": dict(lime_router="first", lime_router_window=2),
}


def counted_step(model) -> tuple[RoutingReads, int]:
    """The ``routing_reads`` counter and the FLOPs of one forward+backward on ``lime_fixtures.batch()``."""
    tokens, positions, mask = batch()
    with routing_reads() as reads, FlopCounterMode(display=False) as flops:
        loss_of(megatron_logits(model, tokens, positions, mask), tokens).backward()
    return reads, flops.get_total_flops()


@pytest.mark.parametrize("rebuild", [False, True], ids=["kept", "rebuilt"])  # MHA rebuilt: a product more
@pytest.mark.parametrize("variant", list(VARIANTS.values()), ids=list(VARIANTS))
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("num_layers,block", [(7, 1), (7, 3), (9, 4)])
def test_counted_reads_match_the_plan(variant, num_layers, block, kv_heads, rebuild):
    model = tiny_model(
        num_layers=num_layers,
        num_query_groups=kv_heads,
        lime_routing_block=block,
        lime_recompute_routed_kv=rebuild,
        **variant,
    )
    counted, _ = counted_step(model)
    planned = {kind: read for kind, read in routing_bytes_per_step(model.config, SEQ, BATCH, block).items() if read}
    assert counted.by_kind == planned


def test_blocking_reads_less_for_the_same_flops():
    """16 layers, full router: the roofline's B (H100 figures without host time) reads about
    L/(2B) + B/2 of L/2 rows per product."""
    block = routing_block_size(range(16), 2, 2 * 2048 * 64, 2, replace(H100_SXM, seconds_per_operator=0.0))
    assert block > 1
    per_layer = counted_step(tiny_model(num_layers=16, num_query_groups=2, lime_routing_block=1))
    blocked = counted_step(tiny_model(num_layers=16, num_query_groups=2, lime_routing_block=block))
    assert blocked[0].total < 0.6 * per_layer[0].total
    # zero-padded stacked routers would add FLOPs; the full router pads nothing
    assert blocked[1] == per_layer[1]


@pytest.mark.parametrize("rebuild", [False, True], ids=["kept", "rebuilt"])
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("block", [1, 3])
def test_counted_product_flops_are_the_routers(block, kv_heads, rebuild):
    """The FLOPs counted on the routing products (which the overhead bench divides by their counted
    time) are, per kind, Eq. 2's: the forward's, the weight gradient's, the row gradient's and the
    rebuild's (where the routed K/V are dropped: MHA here) each equal the router FLOPs of the plan
    (``router_flops_per_token``), blocked or not; every counted kind was timed."""
    from lime_megatron.models.lime.recompute import drops_routed_kv
    from lime_megatron.planning.flops import router_flops_per_token

    model = tiny_model(
        num_layers=7, num_query_groups=kv_heads, lime_routing_block=block, lime_recompute_routed_kv=rebuild
    )
    counted, _ = counted_step(model)
    step_flops = router_flops_per_token(model.config) * SEQ * BATCH
    dropped = rebuild and kv_heads == 4
    assert drops_routed_kv(model.config, "local") == dropped
    kinds = ["forward", "weight_grad", "row_grad"] + (["rebuild"] if dropped else [])
    assert counted.flops_by_kind == {kind: step_flops for kind in kinds}
    assert set(counted.seconds_by_kind) == set(kinds)
    assert all(seconds > 0 for seconds in counted.seconds_by_kind.values())


@pytest.mark.parametrize("rebuild", [False, True], ids=["kept", "rebuilt"])
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_dynamic_router_reads_match_the_plan(kv_heads, rebuild):
    """The dynamic router's per-token multiply-adds read what the plan says at B = 1 (each source
    row once per consumer, in forward, in the weight gradient and in a rebuild; each kept g_m once
    per source it reads)."""
    model = tiny_model(num_layers=7, num_query_groups=kv_heads, lime_router="dynamic", lime_recompute_routed_kv=rebuild)
    counted, _ = counted_step(model)
    planned = {kind: read for kind, read in routing_bytes_per_step(model.config, SEQ, BATCH, 1).items() if read}
    assert counted.by_kind == planned


@pytest.mark.parametrize("num_layers,block", [(7, 1), (7, 3), (9, 4), (16, 4)])
def test_the_roofline_models_the_forward_products_the_memory_runs(num_layers, block):
    """The block-size roofline prices the forward products the memory runs (B = 1: one per layer
    over all its sources; blocked: the earlier rows once per block and the in-block ones per layer):
    its rows read are the forward reads counted on the products."""
    model = tiny_model(num_layers=num_layers, num_query_groups=2, lime_routing_block=block)
    counted, _ = counted_step(model)
    row_bytes = 2 * SEQ * BATCH * model.config.kv_channels * 8  # float64 rows
    rows = sum(rows for rows, _ in forward_products(range(num_layers), 2, block))
    assert rows * row_bytes == counted.by_kind["forward"]


@pytest.mark.parametrize("fixed", [None, 3], ids=["chosen", "--lime-routing-block"])
def test_dry_run_reports_the_block_and_the_bytes_read(fixed):
    from lime_megatron.models.config import lime_config
    from lime_megatron.planning.estimate import estimate, report_lines
    from lime_megatron.planning.routing_block import chunk_routing_block

    config = lime_config(
        num_layers=32,
        hidden_size=64,
        ffn_hidden_size=128,
        num_attention_heads=4,
        num_query_groups=4,
        use_cpu_initialization=True,
        lime_routing_block=fixed,
    )
    result = estimate(config, vocab_size=128, seq_length=64, micro_batch_size=2, num_microbatches=1)
    block = chunk_routing_block(config, range(32), 64, 2)
    per_layer, blocked = (sum(routing_bytes_per_step(config, 64, 2, b).values()) / 2**30 for b in (1, block))
    line = next(line for line in report_lines(result) if line.startswith("LIMe routing"))
    assert f"block size B per chunk layers 0-31: {block} " in line
    assert fixed is None or block == fixed
    assert f"per layer (B=1) {per_layer:.2f} GiB, blocked {blocked:.2f} GiB" in line
