"""Write ProsQA train/test JSON files (``lime_megatron.data.prosqa``; Coconut's published format).

    python tools/make_prosqa_data.py --output-dir data/prosqa --train-samples 17886 --test-samples 500

    python tools/make_prosqa_data.py --output-dir data/prosqa --from-coconut coconut/data

Writes ``prosqa_train.json`` and ``prosqa_test.json`` (no test question in training), and
``prosqa_train.jsonl`` with one ``{"text", "prompt", "response"}`` per training record for
``tools/preprocess_data.py``: ``text`` is Coconut's training text (pretraining), ``prompt`` and
``response`` its split for fine-tuning with the loss on the response (``--prompt-key prompt
--json-keys response``, then ``pretrain_lime.py --sft``). It prints the graph statistics of each
split (``prosqa.graph_statistics``: quartiles of nodes, edges, steps and entities).

Coconut's own questions instead of generated ones: clone facebookresearch/coconut (its ``data/``
holds ``prosqa_train.json``, ``prosqa_valid.json`` and ``prosqa_test.json``, lists of records with
``question``, ``steps``, ``answer``, ``idx_to_symbol``, ``edges``, ``root``, ``target`` and
``neg_target``, the format of ours) and pass that directory to ``--from-coconut``: its train and
test files are checked (every field present, the target reachable from the root by the steps'
length, the negative not) and written out as above, the same three files. They stay outside this
repository.
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
        "--from-coconut",
        metavar="DIR",
        help="Coconut's data directory (prosqa_train.json, prosqa_test.json) to convert",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--min-hops", type=int, default=defaults.min_hops, help="fewest steps of a question")
    parser.add_argument("--max-hops", type=int, default=defaults.max_hops, help="most steps of a question")
    parser.add_argument("--min-nodes", type=int, default=defaults.min_nodes, help="smallest graph (nodes)")
    args = parser.parse_args(argv)
    try:
        args.spec = prosqa.ProsQASpec(min_nodes=args.min_nodes, min_hops=args.min_hops, max_hops=args.max_hops)
    except ValueError as error:
        parser.error(str(error).replace("_", "-"))
    if args.from_coconut:
        if args.train_samples is not None or args.test_samples is not None:
            parser.error("--from-coconut reads its questions: no --train-samples or --test-samples")
    elif args.train_samples is None or args.test_samples is None:
        parser.error("--train-samples and --test-samples are required (or --from-coconut DIR)")
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


def generated_splits(args: argparse.Namespace) -> tuple[list[dict], list[dict], str]:
    """(train, test, what was done): generated questions, training draws equal to a test one dropped."""
    test = prosqa.generate(args.test_samples, -1 - args.seed, args.spec)
    held_out = {record["question"] for record in test}
    draws = prosqa.generate(args.train_samples, args.seed, args.spec)
    train = [record for record in draws if record["question"] not in held_out]
    return train, test, f"generated ({len(draws) - len(train)} training draws equal to a test question dropped)"


def coconut_splits(directory: str) -> tuple[list[dict], list[dict], str]:
    """(train, test, what was done) from Coconut's files, each record checked (``prosqa.check_graph``)."""
    train, test = (
        prosqa.read(os.path.join(directory, f"prosqa_{split}.json"), graph=True) for split in ("train", "test")
    )
    return train, test, f"converted from {directory}"


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        train, test, origin = coconut_splits(args.from_coconut) if args.from_coconut else generated_splits(args)
    except (OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    os.makedirs(args.output_dir, exist_ok=True)
    for split, records in (("train", train), ("test", test)):
        with open(os.path.join(args.output_dir, f"prosqa_{split}.json"), "w", encoding="utf-8") as out:
            json.dump(records, out)
        print(f"{split}: {prosqa.describe(prosqa.graph_statistics(records))}")
    write_training_jsonl(train, os.path.join(args.output_dir, "prosqa_train.jsonl"))
    print(f"wrote {len(train):,} training and {len(test):,} test questions to {args.output_dir}, {origin}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
