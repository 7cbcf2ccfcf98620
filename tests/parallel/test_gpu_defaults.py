"""Pipelines under megatron's GPU defaults equal the single-process run, on plain gloo and under
the NCCL-rules mode (communicators created lazily, and eagerly as with a ``device_id``: in the slow
suite), for LIMe and the LLaMA baseline.

megatron's defaults on a GPU cluster: without virtual stages no overlap, so batched p2p
(``batch_p2p_comm``: one ``batch_isend_irecv`` per exchange) with ``batch_p2p_sync``; with virtual
stages ``overlap_p2p_comm`` (unbatched, asynchronous), and batched p2p again with
``--no-overlap-p2p-communication``.  The trainer sets the same (``training.arguments``) and the
CPU runs them as they are.  Each combination below is one named test per model and transport
(``COMBINATIONS``); a launch per world size and transport runs them all (launches are the
expensive part on two cores) and the tests read its report.  ``batch_p2p_sync`` synchronises the
CUDA device after each batch and is a no-op here; its combinations check that neither value
changes the exchange.

One more check: megatron's own communicator posts a batch in one fixed order on every rank
(``send_prev, recv_prev, send_next, recv_next``).  At two stages with virtual stages the next and
previous rank are one peer, in-order matching (NCCL's; gloo's per tag) delivers the gradient
where the activation is expected, and the loss is silently wrong; the trainer therefore hands
every pipelined schedule ``pipeline.PipelineCommunicator``, baseline included.  The baseline
through megatron's communicator is run to show the difference is real.
"""

from __future__ import annotations

import pytest

from lime_megatron.testing.distributed import Layout, run_distributed
from tests.parallel.test_lime_pipeline import compare, train

TOLERANCE = 1e-5
BATCHED_SYNC = dict(batch_p2p_comm=True, batch_p2p_sync=True)  # megatron's default without virtual stages
BATCHED_NO_SYNC = dict(batch_p2p_comm=True, batch_p2p_sync=False)
UNBATCHED = dict(batch_p2p_comm=False)
OVERLAP = dict(overlap_p2p_comm=True, batch_p2p_comm=False)  # megatron's default with virtual stages
NO_OVERLAP = dict(overlap_p2p_comm=False, batch_p2p_comm=True)  # --no-overlap-p2p-communication
COMBINATIONS = {  # name -> (world size, layout, pipeline options)
    "pp2-batched-sync": (2, Layout(pp=2), BATCHED_SYNC),
    "pp2-batched-nosync": (2, Layout(pp=2), BATCHED_NO_SYNC),
    "pp2-unbatched": (2, Layout(pp=2), UNBATCHED),
    "pp2-vpp2-overlap": (2, Layout(pp=2, vpp=2), OVERLAP),
    "pp2-vpp2-no-overlap-batched": (2, Layout(pp=2, vpp=2), NO_OVERLAP),
    "pp2-vpp2-unbatched": (2, Layout(pp=2, vpp=2), UNBATCHED),
    "dp2-pp2-batched-sync": (4, Layout(pp=2), BATCHED_SYNC),
    "pp4-batched-sync": (4, Layout(pp=4), BATCHED_SYNC),
    "pp4-vpp2-overlap": (4, Layout(pp=4, vpp=2), OVERLAP),
    "pp4-vpp2-no-overlap-batched": (4, Layout(pp=4, vpp=2), NO_OVERLAP),
    "tp2-pp2-vpp2-sp-overlap": (4, Layout(tp=2, pp=2, vpp=2, sp=True), OVERLAP),
    "tp2-pp2-vpp2-sp-no-overlap-batched": (4, Layout(tp=2, pp=2, vpp=2, sp=True), NO_OVERLAP),
}
MODELS = {"lime": {}, "llama": dict(lime=False)}
TRANSPORTS = {"gloo": False, "nccl-lazy": "lazy", "nccl-eager": "eager"}  # eager: as with a device_id
TRANSPORT_PARAMS = [  # the eager communicators' launches (~50 s) in the slow suite
    "gloo",
    "nccl-lazy",
    pytest.param("nccl-eager", marks=pytest.mark.slow),
]


def with_megatrons_communicator(layout: Layout, model: dict, stages: dict, reference) -> dict:
    """``compare`` with the trainer handing megatron's schedule no communicator of ours."""
    from lime_megatron.training import trainer

    arguments = trainer.schedule_arguments
    trainer.schedule_arguments = lambda *args, **kwargs: {}
    try:
        return compare(layout, model, reference, stages=stages)
    finally:
        trainer.schedule_arguments = arguments


def combinations_on(world_size: int) -> dict:
    """On every rank: each model over each combination of ``world_size`` ranks, against its
    single-process run; on two ranks also the baseline through megatron's own communicator."""
    report = {}
    for model_name, model in MODELS.items():
        reference = train(Layout(), model)
        for name, (world, layout, stages) in COMBINATIONS.items():
            if world == world_size:
                report[model_name, name] = compare(layout, model, reference, stages=stages)
        if model_name == "llama" and world_size == 2:
            report["megatron-communicator"] = with_megatrons_communicator(
                Layout(pp=2, vpp=2), model, NO_OVERLAP, reference
            )
    return report


_REPORTS: dict = {}


def report_for(world_size: int, transport: str) -> dict:
    """Rank 0's report of one launch of ``combinations_on`` (run once per test session)."""
    if (world_size, transport) not in _REPORTS:
        _REPORTS[world_size, transport] = run_distributed(
            combinations_on, world_size, world_size, nccl_rules=TRANSPORTS[transport], timeout=900
        )[0]
    return _REPORTS[world_size, transport]


@pytest.mark.parametrize("transport", TRANSPORT_PARAMS)
@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("combination", list(COMBINATIONS))
def test_gpu_default_equals_single_process(combination, model, transport):
    world_size = COMBINATIONS[combination][0]
    result = report_for(world_size, transport)[model, combination]
    print(
        f"{combination} {model} over {transport}: |loss diff| {result['loss']:.1e}, "
        f"relative grad error {result['grad']:.1e}"
    )
    assert result["names"]
    assert result["loss"] <= TOLERANCE and result["grad"] <= TOLERANCE


@pytest.mark.parametrize("transport", TRANSPORT_PARAMS)
def test_megatrons_batched_order_swaps_at_two_stages_with_virtual_stages(transport):
    """The reason the baseline goes through ``PipelineCommunicator`` too: megatron's own batched
    order delivers gradients as activations at PP=2 x VPP=2, silently."""
    result = report_for(2, transport)["megatron-communicator"]
    print(
        f"baseline through megatron's communicator over {transport}: |loss diff| {result['loss']:.1e}, "
        f"relative grad error {result['grad']:.1e}"
    )
    assert result["grad"] > 1000 * TOLERANCE
