"""Score a checkpoint on held-out arithmetic expressions by greedy generation with the KV cache.

    python tools/score_generation.py ckpt/lime-aet --test-file data/aet_test.jsonl --output scores.json
    python tools/score_generation.py ckpt/lime-prosqa --task prosqa --test-file data/prosqa_test.json

The checkpoint (any layout) is read into this process with the tokenizer it trained with
(``lime_megatron.interop.checkpoint_model.load_model``); each test expression
(``tools/make_arithmetic_data.py --test-output``) is continued greedily and scored by exact match
of the final answer, per tier (operators or operands, as the file says), with a 95% Wilson interval
(``lime_megatron.inference.scoring``). ``--task prosqa`` scores a ProsQA JSON file (ours from
``tools/make_prosqa_data.py`` or Coconut's published ``prosqa_test.json``): answer and step
accuracy. Prints the table; ``--output`` writes it as JSON with every generation.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import TYPE_CHECKING

from lime_megatron.choices import GENERATION_TASKS
from lime_megatron.training.arguments import CommandParser

if TYPE_CHECKING:
    from lime_megatron.inference import scoring


def parse_args(argv=None) -> argparse.Namespace:
    parser = CommandParser(description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint", help="a --save directory (newest checkpoint) or one iter_NNNNNNN directory")
    parser.add_argument("--task", choices=GENERATION_TASKS, default="arithmetic")
    parser.add_argument(
        "--test-file",
        required=True,
        help="arithmetic: JSONL with expression, answer, num_operands per line; prosqa: ProsQA JSON",
    )
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--output", help="write the accuracies and every generation here (JSON)")
    parser.add_argument("--no-progress", action="store_true")
    return parser.parse_args(argv)


def table(tiers: list[scoring.Accuracy], group: str) -> str:
    """The accuracies as printed."""
    lines = [f"{group:>8} {'correct':>8} {'total':>6} {'accuracy':>9} {'95% Wilson CI':>16}"]
    for tier in tiers:
        low, high = tier.interval
        lines.append(
            f"{tier.group:>8} {tier.correct:>8} {tier.total:>6} {tier.accuracy:>9.1%} {f'[{low:.1%}, {high:.1%}]':>16}"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    for what, path in (("test file", args.test_file), ("checkpoint", args.checkpoint)):
        if not os.path.exists(path):  # said before the model code is imported
            print(f"error: no {what} at {path}", file=sys.stderr)
            return 1
    from lime_megatron.inference import scoring
    from lime_megatron.interop.checkpoint_model import load_model
    from lime_megatron.training.checkpointing import CheckpointError

    try:
        read, _, group_of = scoring.TASKS[args.task]
        records = read(args.test_file)
        group = group_of(records)
        loaded = load_model(args.checkpoint)
    except (OSError, ValueError, CheckpointError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    tiers, rows = scoring.score_model(
        loaded.model, loaded.tokenizer(), args.task, records, args.max_new_tokens, args.batch_size, not args.no_progress
    )
    print(f"{loaded.directory} (iteration {loaded.iteration}) on {args.test_file}:\n{table(tiers, group)}")
    if args.output:
        with open(args.output, "w", encoding="utf-8") as out:
            json.dump(
                {
                    "checkpoint": loaded.directory,
                    "iteration": loaded.iteration,
                    "tiers": [tier.as_dict() for tier in tiers],
                    "generations": rows,
                },
                out,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
