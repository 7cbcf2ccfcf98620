"""Pretrain LIMe or the LLaMA baseline with megatron-core (launch with torchrun).

    torchrun --nproc-per-node 8 pretrain_lime.py --config examples/lime_1b_gqa8.yaml \\
        --data-path data/fwe10bt_text_document --save ckpt/lime-1b --load ckpt/lime-1b
    torchrun --nproc-per-node 8 -m lime_megatron.cli.pretrain ...    # the same module, run by name
    lime-pretrain ...                                                # one process

Options: Megatron-LM's flag names plus the LIMe ones (``--help``; ``docs/training.md``).
"""

import sys
import warnings

# megatron-core's notices that it falls back to torch where apex/TE are missing (every process
# prints them on import), and 0.16's notice about its own default CUDA-graph scope.
for notice in ("Transformer Engine and Apex are not installed", "Apex is not installed", "full scope is deprecated"):
    warnings.filterwarnings("ignore", message=notice)

from lime_megatron.inference.scoring import generation_evaluator  # noqa: E402
from lime_megatron.training.trainer import main as _main  # noqa: E402
from lime_megatron.training.trainer import train  # noqa: E402


def main(argv=None) -> int:
    """Run the trainer on ``argv`` (default: the command line), with the accuracy by generation of
    ``--eval-generation-file`` at evaluations; returns the exit status."""
    return _main(argv, evaluators=[generation_evaluator])


__all__ = ["main", "train"]

if __name__ == "__main__":
    sys.exit(main())
