"""Join several megatron-core indexed datasets into one.

    python tools/merge_datasets.py --input data/fwe-00_text_document data/parts/ \\
        --output-prefix data/fwe_text_document

Each ``--input`` is a dataset prefix (``.bin``/``.idx`` suffixes accepted) or a directory whose
pairs are taken in sorted order (as Megatron-LM's merge_datasets.py does). Documents keep their
order; all inputs must share one token dtype. The output appears only when complete.
"""

import argparse
import os
import sys

from tqdm import tqdm

from lime_megatron.data.corpus import DatasetWriter, dataset_prefix, require_dataset
from lime_megatron.training.arguments import CommandParser


def parse_args(argv=None) -> argparse.Namespace:
    """Command-line flags (Megatron-LM names)."""
    parser = CommandParser(description=__doc__.split("\n")[0])
    parser.add_argument("--input", nargs="+", required=True, help="dataset prefixes or directories of .bin/.idx pairs")
    parser.add_argument("--output-prefix", required=True)
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser.parse_args(argv)


def find_prefixes(inputs: list[str]) -> list[str]:
    """Dataset prefixes named by `inputs`; every one must have both its .bin and .idx."""
    prefixes = []
    for path in inputs:
        if os.path.isdir(path):
            found = sorted(dataset_prefix(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".idx"))
            if not found:
                raise FileNotFoundError(f"no .idx files in directory {path}")
            prefixes += found
        else:
            prefixes.append(dataset_prefix(path))
    for prefix in prefixes:
        require_dataset(prefix)
    return prefixes


def run(args: argparse.Namespace) -> dict:
    """Merge the inputs; return per-input and total document/token counts."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    prefixes = find_prefixes(args.input)
    output = dataset_prefix(args.output_prefix)
    if output in prefixes:
        raise ValueError(f"output {output} is also an input")
    datasets = [IndexedDataset(prefix) for prefix in prefixes]
    dtypes = {ds.index.dtype for ds in datasets}
    if len(dtypes) > 1:
        raise ValueError(
            "inputs have different token dtypes: "
            + ", ".join(f"{p} ({ds.index.dtype.__name__})" for p, ds in zip(prefixes, datasets))
        )
    counts = [(len(ds.document_indices) - 1, int(ds.sequence_lengths.sum())) for ds in datasets]
    with DatasetWriter([output], dtypes.pop()) as writer:
        for prefix in tqdm(prefixes, desc="merging", unit="dataset", disable=args.no_progress):
            writer.add_dataset(0, prefix)
        writer.commit()
    return dict(
        inputs=list(zip(prefixes, counts)),
        output=output,
        documents=sum(d for d, _ in counts),
        tokens=sum(t for _, t in counts),
    )


def main(argv=None) -> int:
    """Entry point; returns the process exit status."""
    args = parse_args(argv)
    try:
        result = run(args)
    except (OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    for prefix, (documents, tokens) in result["inputs"]:
        print(f"  {prefix}: {documents:,} documents, {tokens:,} tokens")
    print(
        f"wrote {result['output']}.bin / .idx: {len(result['inputs'])} datasets, "
        f"{result['documents']:,} documents, {result['tokens']:,} tokens"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
