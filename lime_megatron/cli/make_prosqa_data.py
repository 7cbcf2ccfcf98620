"""Write ProsQA-style train/test JSON files (``lime_megatron.data.prosqa``; Coconut's published format).

    python tools/make_prosqa_data.py --output-dir data/prosqa --train-samples 17886 --test-samples 500

    python tools/make_prosqa_data.py --output-dir data/prosqa --from-json prosqa_train.json

Writes ``prosqa_train.json`` and ``prosqa_test.json`` (no test question in training), and
``prosqa_train.jsonl`` with one ``{"text", "prompt", "response"}`` per training record for
``tools/preprocess_data.py``: ``text`` is Coconut's training text (pretraining), ``prompt`` and
``response`` its split for fine-tuning with the loss on the response (``--prompt-key prompt
--json-keys response``, then ``pretrain_lime.py --sft``). ``--from-json`` writes only that JSONL,
for a ProsQA file made elsewhere (Coconut's published ``prosqa_train.json``).
"""

import argparse
import json
import os
import sys

from lime_megatron.data import prosqa
from lime_megatron.training.arguments import CommandParser


def parse_args(argv=None) -> argparse.Namespace:
    defaults = prosqa.ProsQASpec()
    parser = CommandParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--train-samples", type=int)
    parser.add_argument("--test-samples", type=int)
    parser.add_argument(
        "--from-json", help="write the training JSONL of this ProsQA JSON file instead of generating questions"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-concepts", type=int, default=defaults.num_concepts)
    parser.add_argument("--max-parents", type=int, default=defaults.max_parents)
    parser.add_argument("--min-hops", type=int, default=defaults.min_hops)
    args = parser.parse_args(argv)
    try:
        args.spec = prosqa.ProsQASpec(args.num_concepts, args.max_parents, args.min_hops)
    except ValueError as error:
        parser.error(str(error).replace("_", "-"))
    if args.from_json:
        if args.train_samples is not None or args.test_samples is not None:
            parser.error("--from-json reads its questions: no --train-samples or --test-samples")
    elif args.train_samples is None or args.test_samples is None:
        parser.error("--train-samples and --test-samples are required (or --from-json FILE)")
    elif args.train_samples < 1 or args.test_samples < 1:
        parser.error("--train-samples and --test-samples must be at least 1")
    return args


def write_training_jsonl(records: list[dict], path: str) -> None:
    """One ``{"text", "prompt", "response"}`` line per record."""
    with open(path, "w", encoding="utf-8") as out:
        out.writelines(
            json.dumps(
                {
                    "text": prosqa.text_of(record),
                    "prompt": prosqa.prompt_of(record),
                    "response": prosqa.response_of(record),
                }
            )
            + "\n"
            for record in records
        )


def main(argv=None) -> int:
    args = parse_args(argv)
    os.makedirs(args.output_dir, exist_ok=True)
    if args.from_json:
        try:
            records = prosqa.read(args.from_json)
        except (OSError, ValueError) as error:
            print(f"error: {error}", file=sys.stderr)
            return 1
        write_training_jsonl(records, os.path.join(args.output_dir, "prosqa_train.jsonl"))
        print(f"wrote the training JSONL of {len(records):,} questions from {args.from_json} to {args.output_dir}")
        return 0
    test = prosqa.generate(args.test_samples, -1 - args.seed, args.spec)
    held_out = {record["question"] for record in test}
    train = [
        record
        for record in prosqa.generate(args.train_samples, args.seed, args.spec)
        if record["question"] not in held_out
    ]
    for split, records in (("train", train), ("test", test)):
        with open(os.path.join(args.output_dir, f"prosqa_{split}.json"), "w", encoding="utf-8") as out:
            json.dump(records, out)
    write_training_jsonl(train, os.path.join(args.output_dir, "prosqa_train.jsonl"))
    print(
        f"wrote {len(train):,} training and {len(test):,} test questions to {args.output_dir} "
        f"({args.train_samples - len(train)} training draws equal to a test question dropped)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
