"""LIMe under tensor and sequence parallelism equals the TP=1 run (CPU, gloo, 4 processes)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import partial

import pytest
import torch

from lime_megatron.testing.distributed import (
    Layout,
    ShardRule,
    data_parallel_share,
    gather_full,
    initialize_layout,
    layout_config_kwargs,
    load_full,
    make_batches,
    run_distributed,
)
from tests.lime_fixtures import prune_by_hand

VOCAB, SEQ, MICRO_BATCHES, STEPS, LR = 64, 16, 4, 3, 0.5


@dataclasses.dataclass(frozen=True)
class RouterShardRule(ShardRule):
    """A router weight [kv_heads, n_sources * kv_heads] split by input head within each source
    block; with fewer kv heads than ranks, consecutive ranks share a head (megatron's GQA split)
    and the first of them stands for it."""

    kv_heads: int = 1

    def _ranks(self, size: int) -> list[int]:
        replicas = max(1, size // self.kv_heads)
        return list(range(0, size, replicas))

    def shard(self, full, rank, size):
        replicas = max(1, size // self.kv_heads)
        return super().shard(full, rank // replicas, size // replicas)

    def unshard(self, shards):
        return super().unshard([shards[r] for r in self._ranks(len(shards))])


def router_rule(config, name, param):
    if not name.endswith("router.weight"):
        return None
    local_heads = max(1, config.kv_heads // config.tensor_model_parallel_size)
    return RouterShardRule(dim=1, blocks=param.shape[1] // local_heads, kv_heads=config.kv_heads)


def small_config(layout: Layout, kv_heads: int = 4, num_layers: int = 4, **settings):
    """The tests' LIMe config (hidden 32, 4 heads, ``kv_heads``, ``num_layers``) for ``layout``,
    float32, initialised on the CPU, with ``settings``."""
    from lime_megatron.models.config import lime_config

    return lime_config(
        num_layers=num_layers,
        hidden_size=32,
        ffn_hidden_size=64,
        num_attention_heads=4,
        num_query_groups=kv_heads,
        use_cpu_initialization=True,
        **settings,
        **layout_config_kwargs(layout),
    )


def build_chunks(config, weights=None, extra_shard_rules=None) -> list:
    """This rank's DDP-wrapped chunks as the trainer builds them, loaded with the full
    single-process ``weights`` if given."""
    from lime_megatron.training.trainer import build_model_chunks

    chunks = build_model_chunks(config, VOCAB, SEQ)
    if weights is not None:
        load_full(chunks, weights, extra_shard_rules)
    return chunks


def sgd(chunks, lr: float, steps: int):
    """The trainer's optimizer and scheduler as plain SGD: ``param -= lr * main_grad`` for every
    parameter, routers included (no momentum, weight decay or clipping; constant lr)."""
    from megatron.core.optimizer import OptimizerConfig

    from lime_megatron.training.optimizer import LRSchedule, RouterGroup, build_optimizer, build_scheduler

    config = OptimizerConfig(
        optimizer="sgd", lr=lr, weight_decay=0.0, sgd_momentum=0.0, clip_grad=0.0, params_dtype=torch.float32
    )
    optimizer = build_optimizer(chunks, config, RouterGroup(lr=lr))
    return optimizer, build_scheduler(optimizer, LRSchedule(max_lr=lr, decay_iters=steps, decay_style="constant"))


def train(
    layout: Layout,
    kv_heads: int,
    weights=None,
    block: int = 1,
    router: str = "full",
    prune: float | None = None,
    keep: Callable[[int, int], bool] | None = None,
    kernel: str = "auto",
    deterministic: bool = False,
):
    """3 SGD steps of the ``router`` variant with routing blocks of ``block`` layers (the routing
    products as ``kernel`` says: ``--lime-routing-kernel``; megatron's ``deterministic_mode`` with
    ``deterministic``), the routed K/V
    rebuilt in backward by the router products (their reduce-scatter included; with
    ``prune``: routes pruned at that top-p after the second step, as the trainer does; with
    ``keep``: routes pruned by hand before the first step, ``lime_fixtures.prune_by_hand``); returns
    (losses, [full grads per step], initial full weights, [router gradient norm per step as
    megatron's clipping sees it], the trainer's ``RouteCounts`` with ``prune``, else None)."""
    from lime_megatron.models.lime.pruning import collect_dynamic_prior
    from lime_megatron.training.trainer import prune_routes, train_step

    initialize_layout(layout)
    # With ``keep`` a top-p of 1.0 (prunes nothing) only makes the routers prunable: their route
    # masks persist and mask the gradients, as they do for ``prune_by_hand``'s masks.
    config = small_config(
        layout,
        kv_heads,
        lime_routing_block=block,
        lime_router=router,
        lime_prune_top_p=1.0 if keep else prune,
        lime_recompute_routed_kv=True,
        lime_routing_kernel=kernel,
        deterministic_mode=deterministic,
    )
    rules = partial(router_rule, config)
    chunks = build_chunks(config, weights, rules)
    optimizer, scheduler = sgd(chunks, LR, STEPS)
    initial = gather_full(chunks, extra_shard_rules=rules)
    batches = data_parallel_share(make_batches(MICRO_BATCHES, 2, SEQ, VOCAB))
    if keep is not None:
        prune_by_hand(chunks, keep)
    losses, grads, norms, counts = [], [], [], None
    for step in range(STEPS):
        if prune is not None:
            collect_dynamic_prior(chunks, step == 1)
        losses.append(train_step(chunks, optimizer, scheduler, batches)[0])
        if prune is not None and step == 1:
            counts = prune_routes(chunks, prune, 2)
            assert 0 < counts.masked < counts.routes, counts
        grads.append(gather_full(chunks, select=lambda p: p.main_grad, extra_shard_rules=rules))
        norms.append(router_grad_norm(chunks))
    return losses, grads, initial, norms, counts


def router_grad_norm(chunks) -> float:
    """The router weights' gradient norm as megatron's gradient clipping computes it."""
    from megatron.core import parallel_state
    from megatron.core.optimizer.clip_grads import get_grad_norm_fp32
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    grads = [
        param.main_grad
        for chunk in chunks
        for name, param in chunk.named_parameters()
        if "router" in name and param_is_not_tensor_parallel_duplicate(param)
    ]
    return float(get_grad_norm_fp32(grads, grad_stats_parallel_group=parallel_state.get_model_parallel_group()))


LAYOUTS = [  # (layout, kv_heads, routing block; the TP=1 reference runs B = 1)
    (Layout(tp=2), 4, 1),
    (Layout(tp=2, sp=True), 4, 1),
    (Layout(tp=4), 4, 1),
    (Layout(tp=4, sp=True), 2, 1),  # fewer kv heads than ranks: heads shared by rank pairs
    (Layout(tp=2), 2, 1),
    (Layout(tp=2, sp=True), 4, 2),  # blocked routing: blocks 0-1, 2-3
    (Layout(tp=4, sp=True), 2, 3),  # blocked, heads shared by rank pairs: blocks 0-2, 3
]


DYNAMIC_LAYOUTS = [(Layout(tp=2, sp=True), 4, 1), (Layout(tp=4), 4, 1), (Layout(tp=2), 2, 1)]
"""The dynamic router (each rank's logits are its own heads'; no replicated heads)."""


def compare_layouts(
    layouts=tuple(LAYOUTS),
    router: str = "full",
    prune: float | None = None,
    keep: Callable[[int, int], bool] | None = None,
    kernel: str = "auto",
    deterministic: bool = False,
):
    """On every rank: each layout (its routing products as ``kernel`` says, deterministic or not)
    against TP=1 (the torch path) from the same initial weights."""
    report = []
    for kv_heads in sorted({kv for _, kv, _ in layouts}):
        ref_losses, ref_grads, weights, ref_norms, ref_counts = train(
            Layout(), kv_heads, router=router, prune=prune, keep=keep
        )
        for layout, kv, block in layouts:
            if kv != kv_heads:
                continue
            settings = (block, router, prune, keep, kernel, deterministic)
            losses, grads, _, norms, counts = train(layout, kv_heads, weights, *settings)
            assert counts == ref_counts, (layout.name, counts, ref_counts)  # both units, summed over ranks
            worst = max(
                ((g[name] - ref[name]).norm() / ref[name].norm()).item()
                for g, ref in zip(grads, ref_grads)
                for name in ref
            )
            norm_error = max(abs(a - b) / b for a, b in zip(norms, ref_norms))
            name = layout.name + (f"-B{block}" if block > 1 else "")
            report.append(
                (
                    name,
                    kv_heads,
                    max(abs(a - b) for a, b in zip(losses, ref_losses)),
                    max(worst, norm_error),
                    sorted(name for name in ref_grads[0] if "router" in name),
                )
            )
    return report


def loss_after_loading(layout: Layout, checkpoint: str, router: str = "full") -> float:
    """Loss of a fresh model at ``layout`` (other random weights) after loading ``checkpoint``."""
    from megatron.core import dist_checkpointing

    from lime_megatron.models.config import lime_config
    from lime_megatron.training.trainer import forward_backward

    initialize_layout(layout)
    # With ``keep`` a top-p of 1.0 (prunes nothing) only makes the routers prunable: their route
    # masks persist and mask the gradients, as they do for ``prune_by_hand``'s masks.
    config = lime_config(
        num_layers=4,
        hidden_size=32,
        ffn_hidden_size=64,
        num_attention_heads=4,
        num_query_groups=4,
        use_cpu_initialization=True,
        init_seed=100 + layout.tp,
        lime_router=router,
        **layout_config_kwargs(layout),
    )  # other initial weights
    chunks = build_chunks(config)
    model = chunks[0].module
    if checkpoint:
        model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), checkpoint))
    return forward_backward(chunks, data_parallel_share(make_batches(MICRO_BATCHES, 2, SEQ, VOCAB)))


def reshard_checkpoint(directory: str, router: str = "full"):
    """Save at TP=2, load at TP=1 and TP=4: (saved loss, [loaded losses], fresh-model loss).
    The saved model's routers are drawn at random (a dynamic one starts at zero)."""
    from megatron.core import dist_checkpointing

    from lime_megatron.models.config import lime_config
    from lime_megatron.training.trainer import forward_backward

    initialize_layout(Layout(tp=2))

    config = lime_config(
        num_layers=4,
        hidden_size=32,
        ffn_hidden_size=64,
        num_attention_heads=4,
        num_query_groups=4,
        use_cpu_initialization=True,
        lime_router=router,
        **layout_config_kwargs(Layout(tp=2)),
    )
    chunks = build_chunks(config)
    with torch.no_grad():
        for name, param in chunks[0].module.named_parameters():
            if "router" in name:
                param.uniform_(-0.5, 0.5)
    saved_loss = forward_backward(chunks, data_parallel_share(make_batches(MICRO_BATCHES, 2, SEQ, VOCAB)))
    dist_checkpointing.save(chunks[0].module.sharded_state_dict(), directory)
    torch.distributed.barrier()
    loaded = [loss_after_loading(Layout(tp=tp), directory, router) for tp in (1, 4)]
    return saved_loss, loaded, loss_after_loading(Layout(tp=1), "", router)


def tensor_parallel_checks(directory: str, router: str = "full"):
    layouts = DYNAMIC_LAYOUTS if router == "dynamic" else LAYOUTS
    return compare_layouts(layouts, router), reshard_checkpoint(directory, router)


def test_tensor_and_sequence_parallel_equal_single_rank(tmp_path):
    report = check_layouts(run_distributed(tensor_parallel_checks, 4, str(tmp_path))[0])
    assert report == {"tp2-pp1", "tp2-pp1-sp", "tp4-pp1", "tp4-pp1-sp", "tp2-pp1-sp-B2", "tp4-pp1-sp-B3"}


def test_dynamic_router_under_tensor_and_sequence_parallelism(tmp_path):
    """Dynamic LIMe: TP2+SP, TP4 (MHA) and TP2 (GQA) against TP=1 over 3 SGD steps (the routers
    start at zero and are trained by the first step), and a TP=2 checkpoint loaded at TP=1 and 4."""
    report = check_layouts(run_distributed(tensor_parallel_checks, 4, str(tmp_path), "dynamic")[0])
    assert report == {"tp2-pp1-sp", "tp4-pp1", "tp2-pp1"}


def check_layouts(result) -> set[str]:
    """Assert the report of ``tensor_parallel_checks``; returns the layouts it compared."""
    report, (saved_loss, loaded, fresh) = result
    print(f"checkpoint saved at TP=2 with loss {saved_loss:.6f}; loaded at TP=1, TP=4: {loaded}")
    assert all(abs(loss - saved_loss) <= 1e-5 for loss in loaded)
    assert abs(fresh - saved_loss) > 1e-3  # a model that loaded nothing differs
    for name, kv_heads, loss_diff, grad_err, routers in report:
        print(
            f"{name} kv={kv_heads}: max |loss diff| {loss_diff:.2e}, "
            f"max relative error of gradients and router gradient norm {grad_err:.2e}"
        )
        assert len(routers) == 3
        assert loss_diff <= 1e-5, name
        assert grad_err <= 1e-5, name
    return {name for name, *_ in report}


PRUNED_LAYOUTS = [(Layout(tp=2), 4, 1), (Layout(tp=4, sp=True), 2, 3)]
"""Route pruning: the static masks from the gathered router (heads shared by rank pairs at TP4, kv 2;
blocked routing), the dynamic ones from each rank's own heads' prior."""


def only_sources_before_its_block(layer: int, source: int) -> bool:
    """Routes kept by hand: layer 3 reads layers 0-1 only, all before its block (2-3 at B = 2, 3 at
    B = 3), so it runs no product of its own: its routed K/V are the block's earlier sums alone."""
    return layer != 3 or source < 2


def pruning_checks():
    # dynamic: top-p 0.92, as the prior of the second step is still near the start's (the own layer
    # 0.9, the others 0.1 / l; 0.7 would keep the own layer only, where W_l gets no gradient), away
    # from the shares' partial sums (0.9, 0.933, 0.95)
    blocked = [(Layout(tp=2), 4, 2), (Layout(tp=4, sp=True), 2, 3)]
    return {
        "full": compare_layouts(PRUNED_LAYOUTS, "full", 0.7),
        "dynamic": compare_layouts(PRUNED_LAYOUTS[:1], "dynamic", 0.92),
        "earlier sources only": compare_layouts(blocked, "full", keep=only_sources_before_its_block),
    }


def test_route_pruning_under_tensor_parallelism():
    """Routes pruned after the second of three SGD steps: the same masks (losses and every gradient
    of the last step) at TP2 and TP4+SP as at TP=1, static and dynamic; and routes pruned by hand so
    that a blocked layer reads only sources before its block (TP2 B = 2, TP4+SP B = 3 with heads
    shared by rank pairs), against TP=1 at B = 1."""
    for router, report in run_distributed(pruning_checks, 4)[0].items():
        for name, kv_heads, loss_diff, grad_err, _ in report:
            print(
                f"{router} {name} kv={kv_heads}: max |loss diff| {loss_diff:.2e}, max relative gradient error "
                f"{grad_err:.2e}"
            )
            assert loss_diff <= 1e-5 and grad_err <= 1e-5, (router, name)
        assert len(report) == (1 if router == "dynamic" else 2)


TRITON_LAYOUTS = [  # the Triton path (Triton's interpreter) against the TP=1 torch run
    (Layout(tp=2, sp=True), 4, 1),
    (Layout(tp=2, sp=True), 4, 2),  # blocks 0-1 (no earlier sources) and 2-3 (a fused block)
    (Layout(tp=4, sp=True), 2, 3),  # blocked, heads shared by rank pairs: the general path
]
SLOW_TRITON_LAYOUTS = [
    (Layout(tp=2), 2, 1),  # one head per rank
    (Layout(tp=4, sp=True), 2, 1),  # heads shared by rank pairs, per layer
    (Layout(tp=2), 4, 1),
    (Layout(tp=4), 4, 1),
    (Layout(tp=4), 4, 2),
]
"""The rest, in the slow suite (Triton's interpreter is the slow part): one head per rank, the
general path per layer, and rank chunks without SP (SP changes only the hidden states' split, the
routing reads whole sequences either way)."""


def skip_layer_one(layer: int, source: int) -> bool:
    """Routes kept by hand: layer 3 skips layer 1, so it reads two runs of sources (0, 2-3) and
    still its own layer (its chunk stays on the gathered path)."""
    return layer != 3 or source != 1


def decoding_step_operators(lime: bool) -> tuple[torch.Tensor, torch.Tensor, dict[str, int]]:
    """A TP = 2 (kv 4) model, LIMe on the Triton path at B = 2 with random routers or the
    baseline: its full forward's logits and KV-cache decoding's (a prefill of 5 tokens, then one
    per step), and the operators of a decoding step of one token."""
    from lime_megatron.inference.decoding import decode_step, full_logits, kv_cache_context
    from lime_megatron.testing.dispatched_operators import DispatchedOperators
    from tests.decoding_fixtures import incremental_logits

    layout = Layout(tp=2)
    initialize_layout(layout)
    config = small_config(layout, lime=lime, lime_routing_kernel="triton" if lime else "auto", lime_routing_block=2)
    model = build_chunks(config)[0].module.eval()
    tokens = make_batches(1, 2, SEQ, VOCAB)[0]["tokens"]
    with torch.no_grad():
        for router in model.routers():
            if router.learned:
                router.weight.uniform_(-0.5, 0.5)
        full, incremental = full_logits(model, tokens), incremental_logits(model, tokens, 5)
        context = kv_cache_context(model, tokens.shape[0], tokens.shape[1])
        decode_step(model, context, tokens[:, :-1])
        with DispatchedOperators() as operators:
            decode_step(model, context, tokens[:, -1:])
    return full, incremental, operators.by_name


def triton_decoding() -> tuple[float, dict[str, int]]:
    """TP = 2, B = 2 on the Triton path: the relative error of KV-cache decoding's logits against
    the full forward's, and the operators a decoding step dispatches beyond the baseline's."""
    full, incremental, lime = decoding_step_operators(True)
    base = decoding_step_operators(False)[2]
    error = ((incremental[:, 4:] - full[:, 4:]).norm() / full[:, 4:].norm()).item()
    return error, {name: lime.get(name, 0) - base.get(name, 0) for name in lime.keys() | base.keys()}


def triton_checks():
    return {
        "layouts": compare_layouts(TRITON_LAYOUTS, kernel="triton"),
        "skipping a source": compare_layouts(TRITON_LAYOUTS[:1], keep=skip_layer_one, kernel="triton"),
        "deterministic": compare_layouts([(Layout(tp=2), 4, 2)], kernel="triton", deterministic=True),
        "decoding": triton_decoding(),
    }


def test_triton_path_under_tensor_parallelism():
    """The Triton path's routing under TP2 + SP (per layer and blocked), where each layer's g_l is
    all-gathered into rank chunks and its forward mix reduce-scattered (``fused_routing``), and
    fused blocks on those chunks; TP4 with heads shared by rank pairs, blocked (the general path,
    its products Triton launches); a router skipping a source and megatron's deterministic mode
    (the weight gradients summed per split, blocked): 3 SGD steps, losses and every gradient
    against the TP=1 torch run; and TP2's KV-cache decoding on this path against its full forward.
    One head per rank, the general path per layer and rank chunks without SP:
    ``SLOW_TRITON_LAYOUTS``."""
    reports = run_distributed(triton_checks, 4)[0]
    decoding, operators = reports.pop("decoding")
    print(f"decoding against the full forward at TP2, B = 2: relative error {decoding:.2e}; a step's {operators}")
    assert decoding <= 1e-5
    # per layer after the first: its two outputs, one launch, one reduce-scatter and one unbind;
    # layer 0 (the identity) stores its rows by one stack; no product beyond the baseline's
    picked = {name: operators[name] for name in ("triton:mix_kernel", "_reduce_scatter_base_", "unbind", "new_empty")}
    assert picked == {"triton:mix_kernel": 3, "_reduce_scatter_base_": 3, "unbind": 3, "new_empty": 6}
    assert operators["stack"] == 1 and all(operators[name] == 0 for name in ("mm", "bmm", "baddbmm"))
    for case, report in reports.items():
        check_triton_report(case, report)
        assert len(report) == {"layouts": len(TRITON_LAYOUTS)}.get(case, 1)
    assert set(reports) == {"layouts", "skipping a source", "deterministic"}


def check_triton_report(case: str, report: list) -> None:
    """Every layout of a Triton ``compare_layouts`` report equals the TP=1 torch run, three routers
    compared."""
    for name, kv_heads, loss_diff, grad_err, routers in report:
        print(f"{case} {name} kv={kv_heads}: max |loss diff| {loss_diff:.2e}, max relative error {grad_err:.2e}")
        assert len(routers) == 3
        assert loss_diff <= 1e-5 and grad_err <= 1e-5, (case, name)


def more_triton_layouts():
    return compare_layouts(SLOW_TRITON_LAYOUTS, kernel="triton")


@pytest.mark.slow
def test_more_triton_layouts_under_tensor_parallelism():
    """``SLOW_TRITON_LAYOUTS`` as ``test_triton_path_under_tensor_parallelism`` checks its layouts."""
    report = run_distributed(more_triton_layouts, 4)[0]
    check_triton_report("slow layouts", report)
    assert len(report) == len(SLOW_TRITON_LAYOUTS)


def trainer_step_operators(config, micro_batches: int = 1) -> dict[str, float]:
    """Operators per micro-batch of one training step's forward+backward (the trainer's chunks and
    schedule; after an uncounted one, gradients zeroed between) on this rank for ``config``;
    Triton launches counted, not run (``DispatchedOperators``: the same count)."""
    from lime_megatron.testing.dispatched_operators import DispatchedOperators
    from lime_megatron.training.trainer import forward_backward

    chunks, batches = build_chunks(config), make_batches(micro_batches, 2, SEQ, VOCAB)
    with DispatchedOperators(run_launches=False):
        forward_backward(chunks, batches)
    for chunk in chunks:
        chunk.zero_grad_buffer()
    with DispatchedOperators(run_launches=False) as operators:
        forward_backward(chunks, batches)
    return {name: count / micro_batches for name, count in operators.by_name.items()}


def step_operators(layers: int, lime: bool, block: int = 1, tp: int = 2, kv_heads: int = 4) -> dict[str, float]:
    """``trainer_step_operators`` of a TP = ``tp`` chunk of ``kv_heads``, LIMe on the Triton path
    (blocks of ``block`` layers) or the baseline."""
    layout = Layout(tp=tp)
    initialize_layout(layout)
    kernel = "triton" if lime else "auto"
    settings = dict(lime=lime, lime_routing_kernel=kernel, lime_routing_block=block)
    return trainer_step_operators(small_config(layout, kv_heads, num_layers=layers, **settings))


def collective_operators() -> dict[str, int]:
    """The operators this backend dispatches for one reduce-scatter and one all-gather of a tensor
    (gloo's reduce-scatter adds a ``split`` and a ``copy_``; NCCL's does not)."""
    from lime_megatron.testing.dispatched_operators import DispatchedOperators

    size = torch.distributed.get_world_size()
    whole, part = torch.ones(2 * size, 3), torch.ones(2, 3)
    with DispatchedOperators() as operators:
        torch.distributed.reduce_scatter_tensor(part, whole)
        torch.distributed.all_gather_into_tensor(whole, part)
    return operators.by_name


def host_work_under_tensor_parallelism() -> tuple[dict[str, float], dict[str, int]]:
    """LIMe's operators per layer beyond the baseline's (by difference of 12 and 8 layers), and
    ``collective_operators``."""
    extra = {}
    for layers in (8, 12):
        lime, base = step_operators(layers, True), step_operators(layers, False)
        extra[layers] = {name: lime.get(name, 0) - base.get(name, 0) for name in lime.keys() | base.keys()}
    change = {name: (extra[12].get(name, 0) - extra[8].get(name, 0)) / 4 for name in extra[12].keys() | extra[8]}
    return {name: count for name, count in change.items() if count}, collective_operators()


TENSOR_PARALLEL_PER_LAYER = {
    "new_empty": 4,  # forward: the mix's rank chunks, the routed keys/values; backward: their gradients
    "new_zeros": 1,  # the router-weight gradient
    "triton:mix_kernel": 2,  # forward: Eqs. 1-2; backward: the row and weight gradients
    "stack": 1,  # the all-gather's input: this rank's keys' and values' gradients
    "unbind": 1,  # the reduce-scatter's output: the routed keys and values
    "detach": 2,  # megatron's DDP accumulating the router's gradient (as for every parameter)
    "add_": 1,
}
"""Operators per layer beyond the baseline's on the Triton path at TP = 2 (B = 1), besides the
reduce-scatter and the all-gather."""


def test_triton_host_work_per_layer_under_tensor_parallelism():
    """The host work LIMe adds per layer on the Triton path under tensor parallelism, a launch
    counted as one, exactly: the TP = 1 path's (``tests/models/test_fused_routing.py``) plus one
    reduce-scatter in forward and one all-gather in backward (Eq. 2 split by input head) and the
    two rearrangements around them; no torch product, no view per source (48 per layer before the
    gathered path, 12 now besides the collectives, 2 of them DDP's)."""
    per_layer, collectives = run_distributed(host_work_under_tensor_parallelism, 2)[0]
    expected = dict(TENSOR_PARALLEL_PER_LAYER)
    for name, count in collectives.items():
        expected[name] = expected.get(name, 0) + count
    assert per_layer == expected


def operators_by_block(blocks: tuple[int, ...], kv_heads: int) -> dict[int, float]:
    """Operators LIMe (the Triton path) dispatches beyond the baseline in one forward+backward at
    TP = the world's size, 16 layers of ``kv_heads``, per block size."""
    tp = torch.distributed.get_world_size()
    base = sum(step_operators(16, False, tp=tp, kv_heads=kv_heads).values())
    return {block: sum(step_operators(16, True, block, tp, kv_heads).values()) - base for block in blocks}


def host_data_tensors(kv_heads: int) -> dict[bool, float]:
    """Tensors made from host data (``lift_fresh``) in one forward+backward at TP = the world's
    size, 16 layers of ``kv_heads``, of the baseline (False) and of LIMe on the Triton path (True)."""
    tp = torch.distributed.get_world_size()
    return {lime: step_operators(16, lime, tp=tp, kv_heads=kv_heads).get("lift_fresh", 0) for lime in (False, True)}


def test_heads_shared_by_ranks_make_no_tensor_from_host_data_per_layer():
    """On a GPU a tensor made from host data is a copy to the device after which the host waits for
    it to drain: with kv heads shared by ranks (TP = 4, kv 2: the general path's ``scatter_heads``
    and ``gather_heads``) LIMe makes one per pass beyond the baseline, its memory's handle, which
    stays on the host (``head_parallel.rank_order`` keeps the heads' index on the device)."""
    counted = run_distributed(host_data_tensors, 4, 2)[0]
    assert counted[True] - counted[False] == 1, counted


@pytest.mark.slow  # ~25 s; the model's pipeline and one-rank cases stay in tests/planning
def test_host_operators_model_blocking_under_tensor_parallelism():
    """What blocking adds on the Triton path under tensor parallelism is what ``host_operators``
    adds with the path's counts, exactly: ``TENSOR_PARALLEL_TRITON_OPERATORS`` (TP = 2, kv 4:
    fused blocks on the rank chunks) and ``SHARED_HEADS_TRITON_OPERATORS`` (TP = 4, kv 2: the
    general path); and the block-size chooser counts those for such runs."""
    from lime_megatron.models.config import lime_config
    from lime_megatron.planning import routing_block as R

    paths = [(2, 4, R.TENSOR_PARALLEL_TRITON_OPERATORS), (4, 2, R.SHARED_HEADS_TRITON_OPERATORS)]
    for ranks, kv_heads, counts in paths:
        counted = run_distributed(operators_by_block, ranks, (1, 2, 8), kv_heads)[0]
        modelled = {block: R.host_operators(range(16), block, counts=counts) for block in counted}
        added = {block: (counted[block] - counted[1], modelled[block] - modelled[1]) for block in counted}
        assert all(count == pytest.approx(model, abs=0.01) for count, model in added.values()), (ranks, added)
        config = lime_config(
            num_layers=16,
            hidden_size=64,
            num_attention_heads=4,
            num_query_groups=kv_heads,
            tensor_model_parallel_size=ranks,
        )
        assert R.path_machine(config, R.H100_SXM).operators == counts
