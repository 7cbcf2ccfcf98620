"""LIMe under pipeline parallelism equals the PP=1 run (CPU, gloo, under the NCCL-rules mode).

One 4-process launch checks, against the single-stage model from the same initial weights (loss and
every gradient, routers included, over two SGD steps; ``deallocate_pipeline_outputs`` on, as the
trainer runs pipelines; megatron's GPU defaults: batched p2p unless a case overlaps): TP=2 x PP=2 x
VPP=2 with SP, PP=4 x VPP=2, PP=2 with and without virtual stages, an uneven split with virtual
stages, full recompute, megatron's ``overlap_p2p_comm`` with full recompute at PP=2 x VPP=2 (over
gloo exact thanks to ``compat`` patch 6, without which it is off by ~3e-4; LIMe's other overlapped
layouts are ``test_gpu_defaults.py``'s), MHA and GQA, the ``last`` router whose hops carry fewer
rows, rebuilt routed K/V, blocks, the dynamic router, pruning and the Triton path; the K/V elements
handed to the transport per hop against ``pipeline.hop_elements``, every operation on megatron's
pipeline group, no kept row left after a training or an evaluation call; a checkpoint saved at one
virtual layout loaded at others; two mutations of the side channel (a hop's returned gradient
dropped, stale rows sent) that the comparison must catch. Without processes: every K/V row reaches a
rank at most once per micro-batch, and exactly the rows its chunks read that it does not produce.
The side channel's state after each call, counted attribute by attribute with the collector off.
Posting orders that NCCL refuses, caught by the mode. Slow: the rest of the matrix (``SLOW_CASES``:
PP=4 alone, 4 virtual stages, the ``first`` router, selective recompute, uneven without virtual
stages, more blocked and Triton layouts) and the 128-layer tiny model over PP=4 x VPP=4 (4
processes), over PP=8 and PP=8 x VPP=2 (8 processes), the virtual layouts with overlap on and off.
``test_gpu_defaults.py`` names each of megatron's p2p settings on plain gloo and under the mode.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Callable
from contextlib import contextmanager
from functools import partial

import pytest
import torch

from lime_megatron.testing.distributed import (
    DistributedTestError,
    Layout,
    data_parallel_share,
    gather_full,
    initialize_layout,
    layout_config_kwargs,
    make_batches,
    run_distributed,
)
from tests.lime_fixtures import prune_by_hand
from tests.parallel import layout_cases
from tests.parallel.layout_cases import model_key
from tests.parallel.test_lime_tensor_parallel import build_chunks, router_rule, sgd

VOCAB, SEQ, MICRO_BATCHES, STEPS, LR = 64, 16, 4, 2, 0.5
TOLERANCE = 1e-5


def make_config(layout: Layout, **model):
    from lime_megatron.models.config import lime_config

    settings = dict(
        num_layers=8,
        hidden_size=32,
        ffn_hidden_size=64,
        num_attention_heads=4,
        num_query_groups=4,
        deallocate_pipeline_outputs=layout.pp > 1,
        lime_routing_block=1,
    )
    return lime_config(use_cpu_initialization=True, **{**layout_config_kwargs(layout), **settings, **model})


def keep_every_third(layer: int, source: int) -> bool:
    """A hand-set pruning: layer ``layer`` reads only itself and the layers 0, 3, 6, ..., so the
    rows carried across a boundary are not consecutive (at 4: layers 0 and 3)."""
    return source == layer or source % 3 == 0


def train(
    layout: Layout,
    model: dict,
    weights=None,
    steps: int = STEPS,
    seq: int = SEQ,
    stages: dict | None = None,
    micro_batches: int = MICRO_BATCHES,
    keep: Callable | None = None,
):
    """``steps`` SGD steps; returns (losses, [full grads per step], initial full weights).
    ``stages``: config options of the pipeline split (left out of the single-stage reference);
    ``keep``: routes pruned by hand before the first step (``prune_by_hand``) instead of by top-p."""
    from lime_megatron.models.lime.pruning import collect_dynamic_prior
    from lime_megatron.training.trainer import prune_routes, train_step

    initialize_layout(layout)
    config = make_config(layout, **{**model, **(stages or {})})
    rules = partial(router_rule, config)
    chunks = build_chunks(config, weights, rules)
    if keep is not None:
        prune_by_hand(chunks, keep)
    optimizer, scheduler = sgd(chunks, LR, steps)
    initial = gather_full(chunks, extra_shard_rules=rules)
    batches = data_parallel_share(make_batches(micro_batches, 2, seq, VOCAB))
    losses, grads = [], []
    for step in range(steps):
        prune = config.lime_prune_top_p is not None and step == 0 and keep is None  # pruned after step 1
        collect_dynamic_prior(chunks, prune)
        losses.append(train_step(chunks, optimizer, scheduler, batches)[0])
        grads.append(gather_full(chunks, select=lambda p: p.main_grad, extra_shard_rules=rules))
        if prune:
            counts = prune_routes(chunks, config.lime_prune_top_p, 1)
            assert 0 < counts.masked < counts.routes, counts
    return losses, grads, initial


def compare(layout: Layout, model: dict, reference, **train_kwargs) -> dict:
    """Worst loss and relative gradient differences of ``layout`` against ``reference``."""
    ref_losses, ref_grads, weights = reference
    losses, grads, _ = train(layout, model, weights, **train_kwargs)
    return dict(
        loss=max(abs(a - b) for a, b in zip(losses, ref_losses)),
        grad=max(((g[n] - r[n]).norm() / r[n].norm()).item() for g, r in zip(grads, ref_grads) for n in r),
        routers=sum("router" in name for name in ref_grads[0]),
        names=set(grads[0]) == set(ref_grads[0]),
    )


UNEVEN = dict(num_layers_in_first_pipeline_stage=1, num_layers_in_last_pipeline_stage=1)
UNEVEN_VIRTUAL = dict(num_layers_in_first_pipeline_stage=2, num_layers_in_last_pipeline_stage=2)  # of 12 layers
FULL_RECOMPUTE = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
FULL_RECOMPUTE_2 = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2)
OVERLAP = dict(overlap_p2p_comm=True, batch_p2p_comm=False)  # megatron's default with virtual stages
BATCHED = dict(batch_p2p_comm=True)  # megatron's default without overlap: one batch_isend_irecv per exchange
TRITON = dict(lime_routing_kernel="triton")  # the routing products as Triton kernels
CASES = [  # (name, model settings, layouts[, pipeline options left out of the single-stage reference])
    ("mha", {}, [Layout(tp=2, pp=2, vpp=2, sp=True), Layout(pp=4, vpp=2)]),
    ("gqa", dict(num_query_groups=2), [Layout(pp=4, vpp=2)]),
    ("mha-12-uneven", dict(num_layers=12), [Layout(pp=4, vpp=2)], UNEVEN_VIRTUAL),
    ("mha-rebuilt", dict(lime_recompute_routed_kv=True), [Layout(tp=2, pp=2, vpp=2, sp=True)]),
    ("gqa-full-recompute-overlap", dict(num_query_groups=2, **FULL_RECOMPUTE), [Layout(pp=2, vpp=2)], OVERLAP),
    ("last-3", dict(lime_router="last", lime_router_window=3), [Layout(pp=4, vpp=2)]),
    # blocked routing (B > 1, external blocks read once per block) against the B = 1 single stage
    (
        "mha-16-blocked-rebuilt",
        dict(num_layers=16, lime_recompute_routed_kv=True),
        [Layout(pp=2, vpp=2)],
        dict(lime_routing_block=3),
    ),
    (
        "gqa-full-recompute-blocked",
        dict(num_query_groups=2, **FULL_RECOMPUTE_2),
        [Layout(pp=2)],
        dict(lime_routing_block=2),
    ),
    # the dynamic router: its rows cross stages like the static ones', its p_m weight the row gradients
    ("dynamic", dict(lime_router="dynamic"), [Layout(tp=2, pp=2, vpp=2, sp=True)]),
    # route pruning after the first step (dynamic: top-p away from the start's shares 0.9 + k 0.1 / l)
    ("pruned-blocked", dict(lime_prune_top_p=0.7), [Layout(pp=2, vpp=2)], dict(lime_routing_block=2)),
    ("dynamic-pruned", dict(lime_router="dynamic", lime_prune_top_p=0.915), [Layout(pp=4)]),
    # the Triton kernels (Triton's CPU interpreter) against the torch single stage: TP-sharded
    # heads, external rows, VPP chunks, blocks, pruned routers
    ("mha-triton", {}, [Layout(tp=2, pp=2, vpp=2, sp=True)], TRITON),
    ("pruned-blocked-triton", dict(lime_prune_top_p=0.7), [Layout(pp=2, vpp=2)], dict(lime_routing_block=2, **TRITON)),
]
SLOW_CASES = [  # the rest of the matrix, in the slow 4-process launch (overlap_p2p_comm: test_gpu_defaults)
    ("mha", {}, [Layout(pp=4)]),
    ("mha-16", dict(num_layers=16), [Layout(pp=4, vpp=4)]),
    ("mha-rebuilt", dict(lime_recompute_routed_kv=True), [Layout(pp=4)]),
    (
        "mha-16-blocked-rebuilt",
        dict(num_layers=16, lime_recompute_routed_kv=True),
        [Layout(tp=2, pp=2, sp=True)],
        dict(lime_routing_block=3),
    ),
    ("last-3-blocked", dict(lime_router="last", lime_router_window=3), [Layout(pp=2)], dict(lime_routing_block=2)),
    ("dynamic", dict(lime_router="dynamic"), [Layout(pp=4, vpp=2)]),
    (
        "dynamic-gqa-full-recompute",
        dict(lime_router="dynamic", num_query_groups=2, **FULL_RECOMPUTE),
        [Layout(pp=2, vpp=2)],
    ),
    # the Triton path (its interpreter is the slow part): fused blocks on tensor-parallel rank
    # chunks with received rows, one layer per chunk, blocks of 3 across chunks of 4 layers
    ("mha-blocked-triton", {}, [Layout(tp=2, pp=2, sp=True)], dict(lime_routing_block=2, **TRITON)),
    ("mha-triton", {}, [Layout(pp=4, vpp=2)], TRITON),
    ("mha-16-blocked-triton", dict(num_layers=16), [Layout(pp=2, vpp=2)], dict(lime_routing_block=3, **TRITON)),
    ("gqa", dict(num_query_groups=2), [Layout(tp=2, pp=2, vpp=2, sp=True)]),
    ("mha-uneven", {}, [Layout(pp=4)], UNEVEN),
    ("gqa-full-recompute", dict(num_query_groups=2, **FULL_RECOMPUTE), [Layout(pp=2, vpp=2), Layout(pp=4)]),
    ("mha-selective-recompute", dict(recompute_granularity="selective"), [Layout(tp=2, pp=2, vpp=2, sp=True)]),
    ("first-2", dict(lime_router="first", lime_router_window=2), [Layout(pp=4), Layout(pp=4, vpp=2)]),
]
DEEP = dict(num_layers=128, hidden_size=16, ffn_hidden_size=32, num_attention_heads=2, num_query_groups=2)


def _rewrite_queued(kind: str, rewrite) -> Callable:
    """A replacement of ``KeptRows.attached_ops`` that first rewrites the tensors queued for
    megatron's ``kind`` operation: ``rewrite(key, tensors) -> tensors``."""
    from lime_megatron.parallel.pipeline import KeptRows

    attached = KeptRows.attached_ops

    def rewritten(self, operation, hidden):
        if operation == kind:
            key, tensors = self.outgoing[kind].popleft()
            self.outgoing[kind].appendleft((key, rewrite(key, tensors)))
        return attached(self, operation, hidden)

    return rewritten


def drop_returned_gradients() -> tuple[str, object]:
    """Mutation of ``pipeline.KeptRows``: every hop returns zeros instead of the gradient of the
    rows it carried.  Returns (method name, replacement)."""
    return "attached_ops", _rewrite_queued("send_prev", lambda key, grads: [torch.zeros_like(g) for g in grads])


def send_stale_rows() -> tuple[str, object]:
    """Mutation of ``pipeline.KeptRows``: every hop sends the rows it sent for the first
    micro-batch, whatever the micro-batch."""
    first = {}

    def stale(key, rows):
        return [first.setdefault((key[1], index), row.clone()) for index, row in enumerate(rows)]

    return "attached_ops", _rewrite_queued("send_next", stale)


@contextmanager
def kept_rows_mutated(mutation):
    """``mutation()``'s (method name, replacement) applied to ``pipeline.KeptRows`` inside the
    ``with`` block (a test-only monkeypatch in this process, undone afterwards)."""
    from lime_megatron.parallel.pipeline import KeptRows

    name, replacement = mutation()
    original = getattr(KeptRows, name)
    setattr(KeptRows, name, replacement)
    try:
        yield
    finally:
        setattr(KeptRows, name, original)


def mutated(layout: Layout, model: dict, reference, mutation) -> dict:
    """``compare`` with ``mutation`` applied to ``pipeline.KeptRows``."""
    with kept_rows_mutated(mutation):
        return compare(layout, model, reference)


def side_channel_accounting(
    layout: Layout | None = None, model: dict | None = None, keep: Callable | None = None
) -> dict:
    """One training and one evaluation schedule call: the K/V elements attached per hop (this
    rank's sends, keyed by receiving chunk) and those handed to torch (``PointToPoint.post`` for
    ``isend``, ``PointToPoint.batched`` for ``batch_isend_irecv``), what ``pipeline.hop_elements``
    says, and what it says without pruning; the rows still kept after each call; both losses;
    whether every point-to-point operation used megatron's pipeline group.  ``keep``: routes
    pruned by hand first (``prune_by_hand``)."""
    from megatron.core import parallel_state

    from lime_megatron.parallel import pipeline
    from lime_megatron.training.trainer import forward_backward, run_schedule

    layout = layout or Layout(pp=4, vpp=2)
    initialize_layout(layout)
    config = make_config(layout, **(model or {}))
    rank, chunk_count = parallel_state.get_pipeline_model_parallel_rank(), layout.pp * (layout.vpp or 1)
    batches = data_parallel_share(make_batches(MICRO_BATCHES, 2, SEQ, VOCAB))
    hops = range(rank + 1, chunk_count, layout.pp)
    unpruned = {chunk: len(batches) * pipeline.hop_elements(config, chunk, SEQ, 2)[1] for chunk in hops}
    chunks = build_chunks(config)
    if keep is not None:
        prune_by_hand(chunks, keep)
    sent, attached = defaultdict(int), pipeline.KeptRows.attached_ops
    post, batched = pipeline.PointToPoint.post, pipeline.PointToPoint.batched
    handed = defaultdict(int)  # elements of the attached forward rows handed to torch, whatever the hop
    forward_rows, groups = set(), set()  # ids of the attached forward rows about to be posted; groups posted on

    def counted(self, kind, hidden):  # per hop: the rows attached to the hidden state's send into it
        hop = self.outgoing[kind][0][0][1] + 1 if kind == "send_next" else None  # queued (micro-batch, chunk)
        ops, keep = attached(self, kind, hidden)
        if hop is not None:
            sent[hop] += sum(op.tensor.numel() for op in ops)
            forward_rows.update(id(op.tensor) for op in ops)
        return ops, keep

    def handing(handed_to_torch):
        def hand(op):
            groups.add(op.group)
            if id(op.tensor) in forward_rows:
                forward_rows.discard(id(op.tensor))
                handed["all"] += op.tensor.numel()
            return handed_to_torch(op)

        return hand

    pipeline.KeptRows.attached_ops = counted
    pipeline.PointToPoint.post, pipeline.PointToPoint.batched = handing(post), handing(batched)
    try:
        loss = forward_backward(chunks, batches)
    finally:
        pipeline.KeptRows.attached_ops = attached
        pipeline.PointToPoint.post, pipeline.PointToPoint.batched = post, batched
    kept_after_training = len(pipeline._KEPT.blocks)
    with torch.no_grad():
        evaluated = run_schedule(chunks, batches, forward_only=True)
    expected = {chunk: len(batches) * pipeline.hop_elements(config, chunk, SEQ, 2)[1] for chunk in hops}
    return dict(
        sent={chunk: sent[chunk] for chunk in expected},
        expected=expected,
        unpruned=unpruned,
        handed=handed["all"],
        loss=(loss, evaluated),
        kept=(kept_after_training, len(pipeline._KEPT.blocks)),
        only_pipeline_group=groups == {parallel_state.get_pipeline_model_parallel_group()},
    )


def run_cases(cases: list) -> tuple[dict, dict]:
    """(report per case and layout, single-stage reference per ``model_key``)."""
    return layout_cases.run_cases(cases, lambda model: train(Layout(), model), compare)


HAND_PRUNED = {  # prunable runs whose routes keep_every_third masks by hand: 16 layers, 4 per chunk at PP=2 x VPP=2
    "static": dict(num_layers=16, lime_prune_top_p=0.5),
    "dynamic": dict(num_layers=16, lime_prune_top_p=0.5, lime_router="dynamic", num_query_groups=2),
}


def hand_pruned_cases() -> dict:
    """The hand-pruned models (whose hops carry non-consecutive layers) against the single stage."""
    report = {}
    for name, model in HAND_PRUNED.items():
        reference = train(Layout(), model, keep=keep_every_third)
        for layout in (Layout(pp=2, vpp=2), Layout(tp=2, pp=2, sp=True)):
            report[f"hand-pruned {name} {layout.name}"] = compare(layout, model, reference, keep=keep_every_third)
    return report


def pipeline_checks(directory: str) -> dict:
    """On every rank of 4: every case of ``CASES`` and the hand-pruned ones, the mutations, the
    side channel's bytes and freeing (with and without pruning), resharding across virtual layouts."""
    report, references = run_cases(CASES)
    report.update(hand_pruned_cases())
    mutations = {
        mutation.__name__: mutated(Layout(pp=4, vpp=2), {}, references[model_key({})], mutation)
        for mutation in (drop_returned_gradients, send_stale_rows)
    }
    pruned = side_channel_accounting(Layout(pp=2, vpp=2), HAND_PRUNED["static"], keep_every_third)
    return dict(
        cases=report,
        mutations=mutations,
        accounting=side_channel_accounting(),
        pruned_accounting=pruned,
        checkpoint=reshard_checkpoint(directory),
    )


def slow_pipeline_checks() -> dict:
    """On every rank of 4: ``SLOW_CASES`` and the 128-layer model over PP=4 x VPP=4."""
    report, _ = run_cases(SLOW_CASES)
    deep = train(Layout(), DEEP, steps=1, seq=8)
    report["deep-128 tp1-pp4-vpp4"] = compare(Layout(pp=4, vpp=4), DEEP, deep, steps=1, seq=8)
    report["deep-128 tp1-pp4-vpp4 overlap"] = compare(Layout(pp=4, vpp=4), DEEP, deep, steps=1, seq=8, stages=OVERLAP)
    return report


def loss_after_loading(layout: Layout, checkpoint: str) -> float:
    """Loss of a freshly initialised model at ``layout`` after loading ``checkpoint`` (if any)."""
    from megatron.core import dist_checkpointing

    from lime_megatron.training.trainer import forward_backward

    initialize_layout(layout)
    config = make_config(layout, num_query_groups=2, init_seed=100 + layout.pp)  # other weights than saved
    chunks = build_chunks(config)
    if checkpoint:
        state = {}
        for index, chunk in enumerate(chunks):
            state[f"model{index}"] = chunk.module.sharded_state_dict()
        loaded = dist_checkpointing.load(state, checkpoint)
        for index, chunk in enumerate(chunks):
            chunk.module.load_state_dict(loaded[f"model{index}"])
    return forward_backward(chunks, data_parallel_share(make_batches(MICRO_BATCHES, 2, SEQ, VOCAB)))


def reshard_checkpoint(directory: str):
    """Save at TP=2 x PP=2 x VPP=2, load at PP=1 and PP=4 x VPP=2: (saved, loaded, fresh)."""
    from megatron.core import dist_checkpointing

    from lime_megatron.training.trainer import forward_backward

    layout = Layout(tp=2, pp=2, vpp=2)
    initialize_layout(layout)
    config = make_config(layout, num_query_groups=2)
    chunks = build_chunks(config)
    saved = forward_backward(chunks, data_parallel_share(make_batches(MICRO_BATCHES, 2, SEQ, VOCAB)))
    dist_checkpointing.save(
        {f"model{index}": chunk.module.sharded_state_dict() for index, chunk in enumerate(chunks)}, directory
    )
    torch.distributed.barrier()
    loaded = [loss_after_loading(target, directory) for target in (Layout(), Layout(pp=4, vpp=2))]
    return saved, loaded, loss_after_loading(Layout(), "")


def check_report(report: dict) -> None:
    for case, result in report.items():
        print(
            f"{case}: |loss diff| {result['loss']:.1e}, relative grad error {result['grad']:.1e}, "
            f"{result['routers']} router weights compared"
        )
        assert result["names"], case
        assert result["routers"] > 0, case
        assert result["loss"] <= TOLERANCE, case
        assert result["grad"] <= TOLERANCE, case


def test_pipeline_layouts_equal_single_stage(tmp_path):
    results = run_distributed(pipeline_checks, 4, str(tmp_path), timeout=900, nccl_rules=True)
    result = results[0]
    check_report(result["cases"])
    assert result["cases"]["mha tp1-pp4-vpp2"]["routers"] == 7
    assert {"mha-triton tp2-pp2-vpp2-sp", "pruned-blocked-triton tp1-pp2-vpp2"} <= set(result["cases"])
    for name, mutation in result["mutations"].items():
        print(f"mutation {name}: |loss diff| {mutation['loss']:.1e}, relative grad error {mutation['grad']:.1e}")
        assert mutation["grad"] > 100 * TOLERANCE, name
    assert result["mutations"]["send_stale_rows"]["loss"] > 100 * TOLERANCE
    for rank, accounting in enumerate(result["accounting"] for result in results):
        print(
            f"rank {rank}: K/V elements sent per hop {accounting['sent']}, kept rows after a training and an "
            f"evaluation call {accounting['kept']}"
        )
        assert accounting["sent"] == accounting["expected"] and all(accounting["sent"].values()), rank
        assert accounting["handed"] == sum(accounting["expected"].values()), rank  # every attached row posted
        assert accounting["only_pipeline_group"], rank  # no communicator beside megatron's
        assert accounting["kept"] == (0, 0), rank
        assert abs(accounting["loss"][0] - accounting["loss"][1]) <= TOLERANCE, rank
        assert accounting["sent"] == accounting["unpruned"], rank
    for rank, accounting in enumerate(result["pruned_accounting"] for result in results):
        print(
            f"rank {rank}, pruned by hand: K/V elements sent per hop {accounting['sent']}, "
            f"without pruning {accounting['unpruned']}"
        )
        assert accounting["sent"] == accounting["expected"] and accounting["handed"] == sum(accounting["sent"].values())
        assert all(0 < sent < accounting["unpruned"][chunk] for chunk, sent in accounting["sent"].items()), rank
        assert accounting["kept"] == (0, 0), rank
    saved, loaded, fresh = result["checkpoint"]
    print(f"checkpoint saved at tp2-pp2-vpp2 with loss {saved:.6f}; loaded at pp1, pp4-vpp2: {loaded}")
    assert all(abs(loss - saved) <= 1e-5 for loss in loaded)
    assert abs(fresh - saved) > 1e-3  # a model that loaded nothing differs


def deep_eight_stages() -> dict:
    settings = dict(steps=1, seq=8, micro_batches=8)
    reference = train(Layout(), DEEP, **settings)
    report = {
        layout.name: compare(layout, DEEP, reference, **settings) for layout in (Layout(pp=8), Layout(pp=8, vpp=2))
    }
    report["tp1-pp8-vpp2 overlap"] = compare(Layout(pp=8, vpp=2), DEEP, reference, stages=OVERLAP, **settings)
    return report


@pytest.mark.slow
def test_rest_of_the_matrix_and_the_deep_model_over_four_ranks():
    report = run_distributed(slow_pipeline_checks, 4, timeout=1800, nccl_rules=True)[0]
    check_report(report)
    assert report["deep-128 tp1-pp4-vpp4"]["routers"] == 127
    assert {"mha-triton tp1-pp4-vpp2", "mha-16-blocked-triton tp1-pp2-vpp2"} <= set(report)


@pytest.mark.slow
def test_deep_model_over_eight_stages():
    check_report(run_distributed(deep_eight_stages, 8, timeout=1800, nccl_rules=True)[0])


def random_reads(layers: int, seed: int) -> tuple[tuple[int, ...], ...]:
    """Reads after a random pruning: layer l reads itself and each earlier layer with chance 1/4."""
    generator = torch.Generator().manual_seed(seed)
    return tuple(
        tuple(source for source in range(layer) if torch.rand(1, generator=generator) < 0.25) + (layer,)
        for layer in range(layers)
    )


@pytest.mark.parametrize("router", ["full", "last-3", "first-2", "pruned"])
@pytest.mark.parametrize("pp, vpp, layers", [(2, None, 8), (4, 2, 16), (4, 4, 32), (8, 2, 32), (4, 4, 128)])
def test_every_row_reaches_a_rank_once(router, pp, vpp, layers):
    """Over all hops into a rank's chunks, one micro-batch brings each layer's rows at most once,
    every layer its chunks read (``router.layer_reads``: the variant's sources, or after pruning
    ``config.lime_route_reads``) that it does not produce, and no row that no layer at or after
    the hop's chunk reads.  Unpruned, exactly the layers it reads; pruned, also rows it passes on
    to a later rank (the hops form a ring)."""
    from lime_megatron.models.lime.router import layer_reads
    from lime_megatron.parallel.pipeline import chunk_layers, hop_blocks

    options = {
        "full": {},
        "last-3": dict(lime_router="last", lime_router_window=3),
        "first-2": dict(lime_router="first", lime_router_window=2),
        "pruned": dict(lime_route_reads=random_reads(layers, seed=layers + pp)),
    }[router]
    config = make_config(Layout(pp=pp, vpp=vpp), num_layers=layers, **options)
    chunks = chunk_layers(config)
    for rank in range(pp):
        mine = range(rank, len(chunks), pp)
        received = [layer for chunk in mine for block in hop_blocks(config, chunk) for layer in block.layers]
        produced = {layer for chunk in mine for layer in chunks[chunk]}
        read = {source for chunk in mine for layer in chunks[chunk] for source in layer_reads(config, layer)}
        assert len(received) == len(set(received)), (rank, received)
        assert set(received) >= read - produced, rank
        if router != "pruned":
            assert set(received) == read - produced, rank
        for chunk in mine:
            later = range(chunks[chunk].start, layers)
            read_later = {source for layer in later for source in layer_reads(config, layer)}
            assert all(
                set(block.layers) <= read_later and block.source % pp != rank for block in hop_blocks(config, chunk)
            ), (rank, chunk)


def test_layouts_that_cannot_split_fail_clearly():
    from lime_megatron.models.config import LimeConfigError

    with pytest.raises(LimeConfigError, match="divisible by pipeline_model_parallel_size"):
        make_config(Layout(pp=4), num_layers=6)
    with pytest.raises(LimeConfigError, match="divisible by vp_size"):
        make_config(Layout(pp=2, vpp=3), num_layers=8)


STATIC_STATE = {"config", "p", "chunks", "rank", "group", "next_peer", "prev_peer", "forwards"}
"""``KeptRows`` attributes that describe the schedule call, not a micro-batch: everything else is
state that must be empty once the call ended."""


def state_size(value) -> tuple[int, int]:
    """(entries, tensor bytes) held by ``value``: containers counted entry by entry, through
    nested dicts, lists, tuples and deques, tensors and kept blocks by their bytes."""
    from lime_megatron.parallel.pipeline import _KeptBlock

    if isinstance(value, torch.Tensor):
        return 1, value.numel() * value.element_size()
    if isinstance(value, _KeptBlock):
        tensors = [*value.runs, *([value.grad] if value.grad is not None else [])]
        return 1, sum(state_size(tensor)[1] for tensor in tensors)
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple, deque)):
        sizes = [state_size(item) for item in value]
        return sum(count for count, _ in sizes), sum(size for _, size in sizes)
    return 1, 0


def live_side_channel_objects() -> dict:
    """What the side channel holds on this rank, counted among the objects Python tracks (valid
    with the collector off): live layer-integrated memories, their key/value rows and kept row
    gradients (held apart from a memory by a block's autograd node), kept blocks, and per attribute
    of this call's ``KeptRows`` outside ``STATIC_STATE`` its (entries, tensor bytes); a
    ``KeptRows`` attribute nobody classified fails the count (new state must be counted)."""
    import gc

    from lime_megatron.models.lime.kept_gradients import KeptGradients
    from lime_megatron.models.lime.key_value_rows import KeyValueRows
    from lime_megatron.models.lime.memory import LayerIntegratedMemory
    from lime_megatron.parallel import pipeline

    objects = gc.get_objects()
    counts = {
        "memories": sum(isinstance(o, LayerIntegratedMemory) for o in objects),
        "key/value rows": sum(isinstance(o, KeyValueRows) for o in objects),
        "kept gradients": sum(isinstance(o, KeptGradients) for o in objects),
        "kept blocks": sum(isinstance(o, pipeline._KeptBlock) for o in objects),
    }
    state = vars(pipeline._KEPT) if pipeline._KEPT is not None else {}
    for name, value in state.items():
        if name not in STATIC_STATE:
            counts[name] = state_size(value)
    return counts


def empty_state(counts: dict) -> bool:
    """Nothing of a micro-batch held: no memory, no kept block, every state attribute empty."""
    return all(value in (0, (0, 0)) for value in counts.values())


def keep_received_rows() -> tuple[str, object]:
    """Mutation of ``pipeline.KeptRows``: what a hop received stays in ``arrived`` after the
    chunk took it (the model still gets the right rows).  Returns (method name, replacement)."""

    def take(self, kind, chunk, micro_batch):
        tensors, works = self.arrived[kind, chunk, micro_batch]
        for work in works:
            work.wait()
        return tensors

    return "_take", take


RESIDUE_RUNS = ((Layout(pp=2, vpp=2), {}), (Layout(pp=4), {}), (Layout(pp=2, vpp=2), dict(lime_router="dynamic")))


def residue_per_call(layout: Layout, model: dict, steps: int) -> list[dict]:
    """With Python's cyclic collector off, ``live_side_channel_objects`` after each of ``steps``
    training steps and each evaluation call."""
    import gc

    from lime_megatron.training.trainer import run_schedule, train_step

    initialize_layout(layout)
    chunks = build_chunks(make_config(layout, **model))
    optimizer, scheduler = sgd(chunks, LR, steps)
    batches = data_parallel_share(make_batches(MICRO_BATCHES, 2, SEQ, VOCAB))
    gc.collect()
    gc.disable()
    try:
        counts = []
        for _ in range(steps):
            train_step(chunks, optimizer, scheduler, batches)
            counts.append(live_side_channel_objects())
            with torch.no_grad():
                run_schedule(chunks, batches, forward_only=True)
            counts.append(live_side_channel_objects())
    finally:
        gc.enable()
    return counts


def side_channel_residue(steps: int = 3) -> dict:
    """What the side channel leaves alive after each call, at PP=2 x VPP=2 and PP=4 (static
    router) and PP=2 x VPP=2 (dynamic router: its memory also keeps the weights p_m in backward);
    and after one step with received rows kept (``keep_received_rows``), which must show."""
    residue = {
        " ".join([layout.name, *model.values()]): residue_per_call(layout, model, steps)
        for layout, model in RESIDUE_RUNS
    }
    with kept_rows_mutated(keep_received_rows):
        return dict(residue=residue, mutated=residue_per_call(Layout(pp=4), {}, 1))


def test_side_channel_keeps_nothing_alive_without_the_garbage_collector():
    """Nothing of a step's or an evaluation's micro-batches survives the call with the cyclic
    collector off (a hook closing over its own tensor, a kept send handle or received tensors
    left in ``arrived`` would grow these), and a side channel that keeps its received rows is
    caught by the same count."""
    results = run_distributed(side_channel_residue, 4, nccl_rules=True)
    for rank, result in enumerate(results):
        for layout, counts in result["residue"].items():
            print(f"rank {rank} {layout}: per call {counts}")
        print(f"rank {rank} with received rows kept: {result['mutated']}")
    for rank, result in enumerate(results):
        for layout, counts in result["residue"].items():
            assert all(map(empty_state, counts)), (rank, layout, counts)
    assert all(not empty_state(result["mutated"][0]) for result in results[1:])  # rank 0 receives no rows
    assert all(result["mutated"][0]["arrived"][1] > 0 for result in results[1:])


# --------------------------------------------------------------------------- NCCL's rules


def rows_after_all_hidden_sends_first(hops: list) -> list:
    """Mutation of ``PipelineCommunicator.posting_order``: the rows after every hidden-state
    operation of the call, sends before receives: two neighbours' row sends face each other."""
    rows = [op for _, _, row_ops, _ in hops for op in row_ops]
    return [hidden_op for _, hidden_op, _, _ in hops] + sorted(rows, key=lambda op: not op.send)


def rows_before_the_hidden_send(hops: list) -> list:
    """Mutation of ``PipelineCommunicator.posting_order``: a sender posts the rows before the
    hidden state, its receiver takes the hidden state first."""
    return [
        op
        for kind, hidden_op, row_ops, _ in hops
        for op in ((*row_ops, hidden_op) if kind.startswith("send") else (hidden_op, *row_ops))
    ]


def facing_row_sends(pipeline) -> None:
    pipeline.PipelineCommunicator.posting_order = staticmethod(rows_after_all_hidden_sends_first)


def rows_posted_first_by_senders(pipeline) -> None:
    pipeline.PipelineCommunicator.posting_order = staticmethod(rows_before_the_hidden_send)


UNBATCHED = dict(batch_p2p_comm=False)  # one operation at a time: each its own queue entry
POSTING_MUTATIONS = {  # the layout, the mutation, its pipeline options
    "facing-row-sends": (Layout(pp=2, vpp=2), facing_row_sends, UNBATCHED),
    "rows-before-hidden-unbatched": (Layout(pp=2, vpp=2), rows_posted_first_by_senders, UNBATCHED),
    "rows-before-hidden-batched": (Layout(pp=2, vpp=2), rows_posted_first_by_senders, BATCHED),
}


def one_step_with(layout: Layout, mutation: Callable, stages: dict) -> float:
    """One training step of the 8-layer LIMe model on ``layout`` with pipeline options
    ``stages``, ``mutation`` applied to the pipeline module in this process (a fresh rank of the
    harness)."""
    from lime_megatron.parallel import pipeline

    mutation(pipeline)
    return train(layout, {}, steps=1, stages=stages)[0][0]


@pytest.mark.parametrize("case", sorted(POSTING_MUTATIONS))
def test_nccl_rules_catch_each_wrong_posting_order(case):
    """Posting orders that break NCCL, put into the real pipeline communicator, fail under the
    NCCL-rules mode with a report: facing row sends deadlock (plain gloo buffers them and runs);
    rows posted before the hidden state by senders are received in its place (in-order matching:
    a size mismatch, on plain gloo too)."""
    layout, mutation, stages = POSTING_MUTATIONS[case]
    with pytest.raises(DistributedTestError) as caught:
        run_distributed(one_step_with, layout.pp, layout, mutation, stages, nccl_rules=True, timeout=120)
    print(caught.value)
    if case == "facing-row-sends":
        assert "NCCL rules: deadlock" in str(caught.value)
        run_distributed(one_step_with, layout.pp, layout, mutation, stages, timeout=120)  # gloo runs it
    else:
        assert "NCCL rules: size mismatch" in str(caught.value)
