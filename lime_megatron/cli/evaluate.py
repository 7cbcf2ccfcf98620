#!/usr/bin/env python
"""lm-evaluation-harness's command line with the ``lime_megatron`` model registered.

    python tools/evaluate.py --model lime_megatron --model_args checkpoint=ckpt/lime-1b --batch_size 16 \\
        --tasks arc_easy,piqa --num_fewshot 3
    torchrun --nproc-per-node 8 tools/evaluate.py --model lime_megatron ...   # data parallel

Every lm-eval option works as with ``lm_eval`` itself; see ``lime_megatron.inference.lm_eval_adapter`` and
docs/evaluation.md (offline use, the paper's Table 1 tasks).  Needs ``pip install .[eval]``.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lm_eval.__main__ import cli_evaluate  # noqa: E402

import lime_megatron.inference.lm_eval_adapter  # noqa: E402,F401  - registers --model lime_megatron

if __name__ == "__main__":
    cli_evaluate()
