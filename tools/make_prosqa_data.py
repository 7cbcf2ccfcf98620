#!/usr/bin/env python
"""Write ProsQA-style train/test JSON files (``lime_megatron.data.prosqa``; Coconut's published format).

    python tools/make_prosqa_data.py --output-dir data/prosqa --train-samples 17886 --test-samples 500

Writes ``prosqa_train.json`` and ``prosqa_test.json`` (no test question in training), and
``prosqa_train.jsonl`` with one ``{"text": ...}`` per record (Coconut's training text) for
``tools/preprocess_data.py``.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lime_megatron.data import prosqa  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    defaults = prosqa.ProsQASpec()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--train-samples", type=int, required=True)
    parser.add_argument("--test-samples", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-concepts", type=int, default=defaults.num_concepts)
    parser.add_argument("--max-parents", type=int, default=defaults.max_parents)
    parser.add_argument("--min-hops", type=int, default=defaults.min_hops)
    args = parser.parse_args(argv)
    try:
        args.spec = prosqa.ProsQASpec(args.num_concepts, args.max_parents, args.min_hops)
    except ValueError as error:
        parser.error(str(error).replace("_", "-"))
    if args.train_samples < 1 or args.test_samples < 1:
        parser.error("--train-samples and --test-samples must be at least 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    test = prosqa.generate(args.test_samples, -1 - args.seed, args.spec)
    held_out = {record["question"] for record in test}
    train = [record for record in prosqa.generate(args.train_samples, args.seed, args.spec)
             if record["question"] not in held_out]
    os.makedirs(args.output_dir, exist_ok=True)
    for split, records in (("train", train), ("test", test)):
        with open(os.path.join(args.output_dir, f"prosqa_{split}.json"), "w", encoding="utf-8") as out:
            json.dump(records, out)
    with open(os.path.join(args.output_dir, "prosqa_train.jsonl"), "w", encoding="utf-8") as out:
        out.writelines(json.dumps({"text": prosqa.text_of(record)}) + "\n" for record in train)
    print(f"wrote {len(train):,} training and {len(test):,} test questions to {args.output_dir} "
          f"({args.train_samples - len(train)} training draws equal to a test question dropped)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
