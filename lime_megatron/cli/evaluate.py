"""lm-evaluation-harness's command line with the ``lime_megatron`` model registered.

    python tools/evaluate.py --model lime_megatron --model_args checkpoint=ckpt/lime-1b --batch_size 16 \\
        --tasks arc_easy,piqa --num_fewshot 3
    torchrun --nproc-per-node 8 tools/evaluate.py --model lime_megatron ...   # data parallel

Every lm-eval option works as with ``lm_eval`` itself; see ``lime_megatron.inference.lm_eval_adapter`` and
docs/evaluation.md (offline use, the paper's Table 1 tasks).  Needs the ``eval`` extra.
"""

import sys

from lime_megatron.extras import requires_extra


def main(argv=None) -> int:
    """lm-eval's command line on ``argv`` (default: this process's arguments) with ``--model
    lime_megatron`` registered; returns the exit status."""
    with requires_extra("eval"):
        from lm_eval.__main__ import cli_evaluate

    import lime_megatron.inference.lm_eval_adapter  # noqa: F401 - registers --model lime_megatron

    if argv is not None:  # lm-eval parses sys.argv itself
        sys.argv = [sys.argv[0], *argv]
    cli_evaluate()
    return 0


if __name__ == "__main__":
    sys.exit(main())
