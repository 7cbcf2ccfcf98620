"""``pretrain_lime.py --hyper-connections``: a run through the trainer's flags whose loss goes down,
and a resume from its distributed checkpoint equal, bit for bit, to the uninterrupted run (the
official optimizer groups, Adam with weight decay, so the optimizer state must come back); a
checkpoint of another stream count or variant is refused with one message; the same for mHC
(``--hyper-connections-manifold``), whose Sinkhorn iteration count must agree too."""

from __future__ import annotations

import pytest

from lime_megatron.training import trainer
from lime_megatron.training.checkpointing import CheckpointError

HC_RUN = (
    "--num-layers 4 --hidden-size 64 --num-attention-heads 4 --num-query-groups 2 --seq-length 32 "
    "--micro-batch-size 2 --global-batch-size 4 --lr 1e-2 --mock-data --vocab-size 128 --log-interval 100 "
    "--eval-iters 0 --train-iters 6 --weight-decay 0.1 --weight-decay-grouping official "
    "--hyper-connections 2"
).split()


VARIANTS = {  # flags -> (other flags, the mismatch named) a checkpoint of it refuses
    "hc": (
        [],
        (
            (["--hyper-connections", "4"], "hyper_connections 2 vs 4"),
            (["--hyper-connections-static"], "hyper_connections_static False vs True"),
            (["--hyper-connections-manifold"], "hyper_connections_manifold False vs True"),
        ),
    ),
    "mhc": (
        ["--hyper-connections-manifold"],
        ((["--hyper-connections-sinkhorn-iterations", "5"], "hyper_connections_sinkhorn_iterations 20 vs 5"),),
    ),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_hyper_connections_train_and_resume_exactly(tmp_path, variant):
    flags, refusals = VARIANTS[variant]
    run = [*HC_RUN, *flags]
    reference = trainer.train(run)
    assert reference.losses[6] < reference.losses[1]
    save = str(tmp_path / "ckpt")
    first = trainer.train([*run, "--save", save, "--load", save, "--save-interval", "3", "--exit-interval", "3"])
    second = trainer.train([*run, "--save", save, "--load", save, "--save-interval", "3"])
    assert sorted(first.losses) == [1, 2, 3] and second.resumed_from.endswith("iter_0000003")
    assert {**first.losses, **second.losses} == reference.losses
    fresh = trainer.train([*run, "--seed", "7", "--train-iters", "4", "--exit-interval", "4"])
    assert fresh.losses[4] != reference.losses[4]  # the comparison can fail: other weights, other losses
    for other, named in refusals:
        with pytest.raises(CheckpointError, match=f"model shape mismatch.*{named}"):
            trainer.train([*run, *other, "--load", save, "--train-iters", "7"])
