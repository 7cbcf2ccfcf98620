"""Convert between distributed checkpoints and Hugging Face model directories.

    python tools/convert_checkpoint.py export ckpt/lime-1b hf/lime-1b [--dtype bfloat16]
    python tools/convert_checkpoint.py import hf/lime-1b ckpt/from-hf [--iteration 0]
    python pretrain_lime.py --config ... --load ckpt/from-hf --no-load-optim   # any TP/PP layout

Export reads a checkpoint of any layout (a --save root: its newest checkpoint; or one
iter_NNNNNNN directory) and writes config.json, generation_config.json, safetensors and the run's
tokenizer, which puts the end-of-document token before every text as training did (so
AutoTokenizer + generate continue a prompt as tools/generate.py does): the LLaMA baseline as
transformers' LlamaForCausalLM, LIMe in the layout of the paper's official LIMeForCausalLM.
Import writes a weights-only checkpoint of global tensors, which the trainer reads at any
layout.  See docs/export.md.
"""

from __future__ import annotations

import argparse
import sys

import torch

from lime_megatron.interop.hf_export import SHARD_BYTES, export_checkpoint, import_checkpoint
from lime_megatron.training.arguments import CommandParser, UsageError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_args(argv=None) -> argparse.Namespace:
    """Command-line flags."""
    parser = CommandParser(description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    export = commands.add_parser("export", help="distributed checkpoint -> Hugging Face directory")
    export.add_argument("checkpoint", help="a --save directory (newest checkpoint) or an iter_NNNNNNN directory")
    export.add_argument("output", help="Hugging Face directory to create")
    export.add_argument("--dtype", choices=DTYPES, help="weights' dtype (default: the checkpoint's)")
    export.add_argument(
        "--shard-size-gb",
        type=float,
        default=SHARD_BYTES / 2**30,
        help="largest safetensors file in GiB (default %(default)s)",
    )
    imported = commands.add_parser("import", help="Hugging Face directory -> weights-only checkpoint")
    imported.add_argument("model", help="Hugging Face directory (config.json + safetensors [+ tokenizer])")
    imported.add_argument("save", help="checkpoint root to write (iter_NNNNNNN + tracker); --load it")
    imported.add_argument(
        "--dtype", choices=DTYPES, help="weights' dtype (default: the files' if bfloat16/float16, else float32)"
    )
    imported.add_argument("--iteration", type=int, default=0, help="iteration number of the checkpoint")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    """Entry point; returns the process exit status."""
    args = parse_args(argv)
    dtype = DTYPES.get(args.dtype) if args.dtype else None
    try:
        if args.command == "export":
            summary = export_checkpoint(
                args.checkpoint, args.output, dtype=dtype, shard_bytes=int(args.shard_size_gb * 2**30)
            )
        else:
            summary = import_checkpoint(args.model, args.save, dtype=dtype, iteration=args.iteration)
    except UsageError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"{args.command}: {summary}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
