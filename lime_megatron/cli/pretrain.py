"""Pretrain LIMe or the LLaMA baseline with megatron-core (launch with torchrun).

    torchrun --nproc-per-node 8 pretrain_lime.py --config examples/lime_1b_gqa8.yaml \\
        --data-path data/fwe10bt_text_document --save ckpt/lime-1b --load ckpt/lime-1b
    torchrun --nproc-per-node 8 -m lime_megatron.cli.pretrain ...    # the same module, run by name
    lime-pretrain ...                                                # one process

Options: Megatron-LM's flag names plus the LIMe ones (``--help``; ``docs/training.md``).

The command line is parsed and checked (options, config file, data paths) before the trainer,
megatron-core and torch are imported, so ``--help`` and a wrong option or path are answered at
once; the trainer parses it again when it starts.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from lime_megatron.training import arguments
from lime_megatron.training.error_report import print_usage_error

if TYPE_CHECKING:
    from lime_megatron.training.trainer import Evaluator, TrainingResult


def main(argv=None) -> int:
    """Run the trainer on ``argv`` (default: the command line), with the accuracy by generation of
    ``--eval-generation-file`` at evaluations; returns the exit status."""
    try:
        run = arguments.parse_run(argv)
        if not run.dry_run:
            arguments.check_data_paths(run.data)
    except arguments.UsageError as error:
        print_usage_error(error)
        return 2
    from lime_megatron.inference.scoring import generation_evaluator
    from lime_megatron.training.trainer import main as train_main

    return train_main(argv, evaluators=[generation_evaluator])


def train(argv=None, evaluators: Sequence[Evaluator] = ()) -> TrainingResult:
    """``lime_megatron.training.trainer.train`` (imported at the first call): parse ``argv`` and
    train, raising on a usage error; returns the :class:`TrainingResult`."""
    from lime_megatron.training import trainer

    return trainer.train(argv, evaluators)


__all__ = ["main", "train"]

if __name__ == "__main__":
    sys.exit(main())
