"""checkpoint_model: a trainer checkpoint read back into one process, and written back.

The trainer saves LIMe after two iterations with one validation batch; the model read back by
``load_model`` gives the validation loss the trainer reported on the same batch.  ``save_model``
round-trips every tensor bit for bit and the trainer resumes from its output.
"""

import pytest
import torch

from lime_megatron.interop.checkpoint_model import load_model, resolve_checkpoint, save_model
from lime_megatron.training import arguments, data, trainer
from lime_megatron.training.checkpointing import CheckpointError

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]

TINY = (
    "--num-layers 3 --hidden-size 32 --num-attention-heads 4 --num-query-groups 2 "
    "--seq-length 16 --micro-batch-size 2 --global-batch-size 2 --lr 1e-3 --mock-data "
    "--vocab-size 100 --log-interval 100 --eval-iters 1 --eval-interval 2 --train-iters 2 "
    "--lime --rotary-base 5000 --norm-epsilon 1e-6"
).split()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    result = trainer.train(TINY + ["--save", str(root)])
    return root, result


def _validation_loss(loaded) -> float:
    """Mean loss per token of ``loaded.model`` on the run's first validation batch."""
    run = arguments.parse_run(TINY)
    datasets = data.build_datasets(run, loaded.tokenizer())
    batch = data.microbatches(datasets.valid, 0, run.training)[0]
    with torch.no_grad():
        losses = loaded.model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    mask = batch["loss_mask"].float()
    return float((losses.float() * mask).sum() / mask.sum())


def test_loaded_model_reproduces_the_trainers_validation_loss(trained):
    root, result = trained
    loaded = load_model(str(root))
    assert loaded.iteration == 2 and loaded.config.lime
    assert loaded.config.layernorm_epsilon == 1e-6
    assert loaded.model.rotary_pos_emb.inv_freq[1].item() == pytest.approx(5000 ** (-2 / 8))
    assert _validation_loss(loaded) == pytest.approx(result.validation[2], abs=1e-6)


def test_save_model_round_trips_and_the_trainer_starts_from_it(trained, tmp_path):
    root, _ = trained
    loaded = load_model(str(root))
    directory = save_model(loaded.model, loaded.run, str(tmp_path / "copy"), iteration=7)
    again = load_model(directory)
    before, after = loaded.model.state_dict(), again.model.state_dict()
    tensors = [name for name, value in before.items() if isinstance(value, torch.Tensor)]
    assert tensors and all(torch.equal(before[name], after[name]) for name in tensors)
    with pytest.raises(CheckpointError, match="holds weights only"):
        trainer.train(TINY + ["--load", str(tmp_path / "copy"), "--train-iters", "3"])
    result = trainer.train(TINY + ["--load", str(tmp_path / "copy"), "--no-load-optim"])
    assert result.resumed_from == directory and result.iteration == 2


def test_missing_or_foreign_directories_fail_with_one_message(tmp_path):
    with pytest.raises(CheckpointError, match="not a directory"):
        resolve_checkpoint(str(tmp_path / "absent"))
    with pytest.raises(CheckpointError, match="neither a --save directory"):
        resolve_checkpoint(str(tmp_path))
