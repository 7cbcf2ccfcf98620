"""megatron-core on CPU: parallel layouts reproduce the single-process run.

A one-process launch trains the plain megatron LLaMA baseline (``lime=False``: megatron's own
``GPTModel`` layers, built by the trainer's ``build_model_chunks``) for one step (the
reference); one
4-rank launch then trains it in several parallel layouts, each loaded with the reference's
initial weights and fed the same global batch. Every layout must reproduce the reference's loss,
every full gradient, the optimizer's clipped-gradient norm and the Adam update.
"""

import math

import pytest
import torch

from lime_megatron.testing.distributed import (
    REPLICATED,
    DistributedTestError,
    Layout,
    ShardRule,
    data_parallel_share,
    gather_full,
    initialize_layout,
    layout_config_kwargs,
    load_full,
    make_batches,
    merge_shards,
    run_distributed,
)

WORLD_SIZE = 4
# 8 microbatches: the interleaved schedule (pp2, vpp2, 4 microbatches per data-parallel rank)
# reaches its steady phase, where megatron's own batched posting order would swap activations and
# gradients (``pipeline.PipelineCommunicator``, which the trainer hands the schedule, does not).
VOCAB_SIZE, SEQ_LENGTH, MICRO_BATCH_SIZE, NUM_MICROBATCHES = 128, 16, 2, 8
# Adam step (the distributed optimizer supports only Adam). With a large epsilon the first Adam
# update, -lr * g / (|g| + eps) for the clipped gradient g, is nearly linear in g; the learning
# rate is large so that the update stands well above float32 rounding of the weights (norm
# weights are ~1, their gradients ~1e-4). The clip is below the gradient norm.
LR, ADAM_EPS, CLIP_GRAD = 100.0, 1.0, 0.5
LOSS_TOLERANCE = 1e-5  # absolute
GRAD_TOLERANCE = 1e-5  # max |difference| relative to max |reference|, per tensor
UPDATE_TOLERANCE = 1e-4  # same for (weight after - weight before); a difference of weights

# (layout, use the distributed optimizer); the first group runs by default, the second is slow.
CASES = {
    "default": (
        (Layout(tp=2, pp=2, sp=True), False),
        (Layout(pp=2, vpp=2), False),
        (Layout(), True),
    ),
    "slow": (
        (Layout(tp=2), False),
        (Layout(pp=2), False),
        (Layout(tp=2, sp=True), False),
        (Layout(tp=2, pp=2, vpp=2, sp=True), False),
        (Layout(tp=2, sp=True), True),
    ),
}


def _case_id(case) -> str:
    """Test id and result key of a case, e.g. ``tp2-pp1-sp-distopt``."""
    layout, distributed_optimizer = case
    return layout.name + ("-distopt" if distributed_optimizer else "")


# --------------------------------------------------------------------------- on every rank


def _adam(chunks, distributed_optimizer: bool):
    """The trainer's optimizer as megatron's Adam without weight decay, clipping gradients at
    ``CLIP_GRAD``, with a constant learning rate."""
    from megatron.core.optimizer import OptimizerConfig

    from lime_megatron.training.optimizer import LRSchedule, build_optimizer, build_scheduler

    config = OptimizerConfig(
        optimizer="adam",
        lr=LR,
        adam_eps=ADAM_EPS,
        weight_decay=0.0,
        clip_grad=CLIP_GRAD,
        use_distributed_optimizer=distributed_optimizer,
        params_dtype=torch.float32,
    )
    optimizer = build_optimizer(chunks, config)
    return optimizer, build_scheduler(optimizer, LRSchedule(max_lr=LR, decay_iters=1, decay_style="constant"))


def _train_step(chunks, batches, distributed_optimizer: bool) -> dict:
    """One step: loss, full gradients (None with the distributed optimizer, whose gradients are
    only reduced on each rank's shard), clipped-gradient norm and full weights after the step.

    The distributed optimizer's state is then loaded into a fresh one, as when resuming.
    """
    from lime_megatron.training.trainer import forward_backward, optimizer_step

    loss = forward_backward(chunks, batches)
    grads = None if distributed_optimizer else gather_full(chunks, lambda param: param.main_grad)
    optimizer, scheduler = _adam(chunks, distributed_optimizer)
    grad_norm, _ = optimizer_step(optimizer, scheduler)
    if distributed_optimizer:
        _adam(chunks, True)[0].load_state_dict(optimizer.state_dict())
    return dict(loss=loss, grads=grads, grad_norm=grad_norm, weights=gather_full(chunks))


def _gpt_model(layout: Layout, weights=None, distributed_optimizer: bool = False):
    """Initialise ``layout`` and build this rank's DDP-wrapped chunks of a tiny LLaMA baseline
    (4 layers, hidden 64, 4 heads in 2 query groups), loaded with ``weights`` if given."""
    from lime_megatron.models.config import lime_config
    from lime_megatron.training.trainer import build_model_chunks

    initialize_layout(layout)
    config = lime_config(
        lime=False,
        num_layers=4,
        hidden_size=64,
        ffn_hidden_size=128,
        num_attention_heads=4,
        num_query_groups=2,
        **layout_config_kwargs(layout),
    )
    chunks = build_model_chunks(config, VOCAB_SIZE, SEQ_LENGTH, use_distributed_optimizer=distributed_optimizer)
    if weights is not None:
        load_full(chunks, weights)
    return chunks


def _batches() -> list:
    """The global batch: ``NUM_MICROBATCHES`` fixed random microbatches."""
    return make_batches(NUM_MICROBATCHES, MICRO_BATCH_SIZE, SEQ_LENGTH, VOCAB_SIZE)


def _single_process_step() -> dict:
    """On a world of one: ``{"initial": freshly initialised full weights, "step": one step}``."""
    chunks = _gpt_model(Layout())
    initial = gather_full(chunks)
    return {"initial": initial, "step": _train_step(chunks, _batches(), False)}


def _train_layouts(initial: dict, cases) -> dict:
    """One step per case from the ``initial`` weights; rank 0 returns ``{case id: step}``."""
    results = {}
    for layout, distributed_optimizer in cases:
        chunks = _gpt_model(layout, initial, distributed_optimizer)
        step = _train_step(chunks, data_parallel_share(_batches()), distributed_optimizer)
        results[_case_id((layout, distributed_optimizer))] = step
    return results if torch.distributed.get_rank() == 0 else None


def _sharded_state_dict(chunks) -> dict:
    """megatron's sharded state dict of all chunks, one ``model<i>`` entry per chunk."""
    return {f"model{i}": chunk.module.sharded_state_dict() for i, chunk in enumerate(chunks)}


def _checkpoint_round_trip(directory: str) -> dict:
    """Train TP=2/PP=2 for a step, save it with megatron's dist_checkpointing, load it into other
    layouts; rank 0 returns ``{layout name: max |loaded - saved| over all full weights}``."""
    from megatron.core import dist_checkpointing

    chunks = _gpt_model(Layout(tp=2, pp=2))
    _train_step(chunks, data_parallel_share(_batches()), False)
    saved = gather_full(chunks)
    dist_checkpointing.save(_sharded_state_dict(chunks), directory)
    errors = {}
    for layout in (Layout(), Layout(pp=2, vpp=2)):
        chunks = _gpt_model(layout)
        loaded = dist_checkpointing.load(_sharded_state_dict(chunks), directory)
        for i, chunk in enumerate(chunks):
            chunk.module.load_state_dict(loaded[f"model{i}"])
        weights = gather_full(chunks)
        errors[layout.name] = max((weights[n] - saved[n]).abs().max().item() for n in saved)
    return errors if torch.distributed.get_rank() == 0 else None


# --------------------------------------------------------------------------- in pytest


@pytest.fixture(scope="module")
def single_process():
    """The single-process reference: initial weights and one training step."""
    return run_distributed(_single_process_step, 1)[0]


@pytest.fixture(scope="module")
def launched(single_process):
    """``launched(group)``: steps of the cases ``CASES[group]`` from one 4-rank launch (run
    once per group), all starting from the reference's initial weights."""
    cache = {}

    def results(group: str) -> dict:
        if group not in cache:
            cache[group] = run_distributed(
                _train_layouts, WORLD_SIZE, single_process["initial"], CASES[group], nccl_rules=True
            )[0]
        return cache[group]

    return results


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected|."""
    assert actual.shape == expected.shape, f"shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    return ((actual - expected).abs().max() / expected.abs().max()).item()


def _assert_all_close(actual: dict, expected: dict, tolerance: float, what: str) -> None:
    """Every tensor of ``actual`` matches ``expected`` within ``tolerance`` (relative to max)."""
    assert sorted(actual) == sorted(expected), f"{what}: parameter names differ"
    errors = {name: _relative_error(actual[name], expected[name]) for name in expected}
    worst = max(errors, key=errors.get)
    assert errors[worst] <= tolerance, f"{what} of {worst}: relative error {errors[worst]:.2e}"


def _global_norm(tensors: dict) -> float:
    """L2 norm of all tensors together, in float64."""
    return math.sqrt(sum(float(t.double().pow(2).sum()) for t in tensors.values()))


def _updates(step: dict, initial: dict) -> dict:
    """What the optimizer step changed: weights after the step minus the initial weights."""
    return {name: step["weights"][name] - initial[name] for name in initial}


def _expected_updates(reference: dict) -> dict:
    """First Adam update of the reference gradients after clipping them to ``CLIP_GRAD``."""
    clip = min(1.0, CLIP_GRAD / (_global_norm(reference["grads"]) + 1e-6))
    clipped = {name: clip * grad.double() for name, grad in reference["grads"].items()}
    return {name: (-LR * g / (g.abs() + ADAM_EPS)).float() for name, g in clipped.items()}


def test_reference_step_clips_and_updates(single_process):
    reference = single_process["step"]
    norm = _global_norm(reference["grads"])
    assert norm > CLIP_GRAD, "the step must exercise gradient clipping"
    assert reference["grad_norm"] == pytest.approx(norm, rel=1e-6)
    _assert_all_close(
        _updates(reference, single_process["initial"]),
        _expected_updates(reference),
        UPDATE_TOLERANCE,
        "reference update",
    )


@pytest.mark.parametrize(
    "group, case",
    [pytest.param("default", case, id=_case_id(case)) for case in CASES["default"]]
    + [pytest.param("slow", case, id=_case_id(case), marks=pytest.mark.slow) for case in CASES["slow"]],
)
def test_layout_matches_single_process(single_process, launched, group, case):
    reference, step = single_process["step"], launched(group)[_case_id(case)]
    loss_error = abs(step["loss"] - reference["loss"])
    assert loss_error <= LOSS_TOLERANCE, f"loss {step['loss']} vs {reference['loss']}"
    if step["grads"] is not None:
        _assert_all_close(step["grads"], reference["grads"], GRAD_TOLERANCE, "gradient")
    assert step["grad_norm"] == pytest.approx(reference["grad_norm"], rel=GRAD_TOLERANCE)
    _assert_all_close(
        _updates(step, single_process["initial"]), _expected_updates(reference), UPDATE_TOLERANCE, "update"
    )


def test_dist_checkpoint_reshards_exactly(tmp_path):
    errors = run_distributed(_checkpoint_round_trip, WORLD_SIZE, str(tmp_path))[0]
    assert errors == {"tp1-pp1": 0.0, "tp1-pp2-vpp2": 0.0}


# --------------------------------------------------------------------------- harness


def _fail_on_rank_one():
    """Rank 1 raises while rank 0 waits for it in a barrier."""
    if torch.distributed.get_rank() == 1:
        raise ValueError("deliberate failure on rank 1")
    torch.distributed.barrier()


def test_run_distributed_reports_the_failing_rank():
    with pytest.raises(DistributedTestError, match="(?s)rank 1.*deliberate failure on rank 1"):
        run_distributed(_fail_on_rank_one, 2, timeout=120)


def test_layout_rejects_bad_sizes():
    with pytest.raises(ValueError, match="not divisible by tp\\*pp = 4"):
        Layout(tp=2, pp=2).data_parallel_size(6)
    with pytest.raises(ValueError, match="sequence parallelism needs tp >= 2"):
        Layout(sp=True)
    with pytest.raises(ValueError, match="vpp needs pp >= 2"):
        Layout(vpp=2)


def test_shard_rule_round_trip_and_gated_layout():
    full = torch.arange(24.0).reshape(8, 3)
    gated = ShardRule(dim=0, blocks=2)  # rows 0-3 gate, rows 4-7 up
    shards = [gated.shard(full, rank, 2) for rank in range(2)]
    assert shards[0][:, 0].tolist() == [0.0, 3.0, 12.0, 15.0]  # gate rows 0-1, up rows 4-5
    assert torch.equal(gated.unshard(shards), full)
    columns = ShardRule(dim=1)
    assert torch.equal(columns.unshard([columns.shard(full, r, 3) for r in range(3)]), full)


def test_merge_shards_rejects_disagreeing_replicas():
    weight = torch.ones(4)
    with pytest.raises(ValueError, match="copies on different ranks differ"):
        merge_shards([("norm.weight", 0, REPLICATED, weight), ("norm.weight", 1, REPLICATED, weight * 1.01)], tp_size=2)
    with pytest.raises(ValueError, match="have tensor-parallel shards \\[0\\] of 2"):
        merge_shards([("linear.weight", 0, ShardRule(dim=0), weight)], tp_size=2)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.int64, torch.bool])
def test_gathered_tensors_travel_bit_for_bit(dtype):
    """``gather_full`` hands ``all_gather_object`` each tensor as its bytes: every dtype, a
    transposed (non-contiguous) view, a scalar and an empty tensor come back bit for bit."""
    import pickle

    from lime_megatron.testing.distributed import _as_bytes, _from_bytes

    values = torch.randn(3, 5, dtype=torch.float64) * 1e3
    for tensor in (values.to(dtype), values.to(dtype).t(), values[0, 0].to(dtype), values[:0].to(dtype)):
        back = _from_bytes(*pickle.loads(pickle.dumps(_as_bytes(tensor))))
        assert back.dtype == dtype and back.shape == tensor.shape
        assert torch.equal(back.view(-1).view(torch.uint8), tensor.reshape(-1).contiguous().view(torch.uint8))


def test_enable_cpu_support_is_idempotent():
    from lime_megatron.parallel import compat

    if torch.cuda.is_available():
        assert compat.enable_cpu_support() is False
        return
    real_type, real_cuda = torch.Tensor.type, torch.Tensor.cuda
    assert compat.enable_cpu_support() is True
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads

    standin, clip = utils.torch, clip_grads.clip_grad_by_total_norm_fp32
    assert compat.enable_cpu_support() is True
    assert utils.torch is standin and clip_grads.clip_grad_by_total_norm_fp32 is clip
    assert utils.torch.cuda.current_device() == "cpu"
    assert utils.torch.zeros(2, device="cuda").device.type == "cpu"
    assert torch.Tensor.type is real_type and torch.Tensor.cuda is real_cuda
    assert compat.default_device() == "cpu" and compat.distributed_backend() == "gloo"
