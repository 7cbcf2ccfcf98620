#!/usr/bin/env python
"""Export and import throughput of lime-convert-checkpoint at the paper's 1B shapes.

    python bench/bench_convert.py [--num-layers 4] [--models llama-mha lime-gqa8] [--workdir DIR]

Per model: a weights-only checkpoint of the 1B shape of paper Table 3 (hidden 2048, ffn 8192,
32 heads, GPT-2 vocabulary padded to 50304) at ``--num-layers`` (16 is the full depth; the
default 4 keeps the float32 model at ~1.5 GB on small machines) is written with uninitialised
weights (``checkpoint_model.new_model``: no init cost, the bytes are what counts), then

- export: ``export_checkpoint`` (read the distributed checkpoint, map to the Hugging Face layout,
  write safetensors and config.json),
- import: ``import_checkpoint`` (read safetensors, map back, write the distributed checkpoint),

each timed end to end in this process (imports excluded), with its steps; GB/s = safetensors
bytes / seconds.
Prints a markdown table.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from tables import field, print_table

from lime_megatron.interop.checkpoint_model import new_model, save_model
from lime_megatron.interop.hf_export import export_checkpoint, import_checkpoint
from lime_megatron.models.config import PAPER_1B
from lime_megatron.parallel.process_groups import initialize_parallel
from lime_megatron.training import arguments, checkpointing, data

MODELS = {
    "llama-mha": [],
    "llama-gqa8": ["--num-query-groups", "8"],
    "lime-mha": ["--lime"],
    "lime-gqa8": ["--lime", "--num-query-groups", "8"],
}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-layers", type=int, default=4, help="depth (the 1B model has 16)")
    parser.add_argument("--models", nargs="+", default=["llama-mha", "lime-gqa8"], choices=MODELS)
    parser.add_argument("--workdir", help="where the checkpoints go (default: a temporary directory)")
    return parser.parse_args(argv)


def make_checkpoint(root: Path, flags: list[str], num_layers: int) -> tuple[str, int]:
    """A weights-only checkpoint of the 1B shape; returns (directory, parameter count)."""
    shape = [f"--{key.replace('_', '-')}={value}" for key, value in {**PAPER_1B, "num_layers": num_layers}.items()]
    options = arguments.parse_run(
        shape
        + flags
        + "--seq-length 2048 --micro-batch-size 1 --train-iters 1 --lr 1e-3 --mock-data --vocab-size 50257".split()
    )
    tokenizer = data.tokenizer_of(options.data, options.model.vocab_size)
    run = checkpointing.run_description(options, arguments.transformer_config(options), tokenizer)
    model = new_model(run, torch.float32)
    count = sum(param.numel() for param in model.parameters())
    return save_model(model, run, str(root)), count


def measure(workdir: Path, name: str, num_layers: int) -> dict:
    """Export and import times of one model."""
    source, count = make_checkpoint(workdir / f"{name}-ckpt", MODELS[name], num_layers)
    exported = export_checkpoint(source, str(workdir / f"{name}-hf"), progress=False)
    imported = import_checkpoint(str(workdir / f"{name}-hf"), str(workdir / f"{name}-back"), progress=False)
    return dict(model=name, params=count, gb=exported.bytes / 1e9, export=exported, imported=imported)


def _steps(summary) -> str:
    return " + ".join(f"{seconds:.1f}" for seconds in summary.phases.values())


COLUMNS = [
    ("model", field("model")),
    ("parameters", lambda row: f"{row['params'] / 1e6:.0f} M"),
    ("safetensors GB", field("gb", ".2f")),
    ("export s", lambda row: f"{row['export'].seconds:.1f} ({_steps(row['export'])})"),
    ("export GB/s", lambda row: f"{row['export'].gigabytes_per_second:.3f}"),
    ("import s", lambda row: f"{row['imported'].seconds:.1f} ({_steps(row['imported'])})"),
    ("import GB/s", lambda row: f"{row['imported'].gigabytes_per_second:.3f}"),
]
"""The table's columns: each conversion's seconds (its steps in brackets) and rate."""


def main(argv=None) -> int:
    args = parse_args(argv)
    initialize_parallel()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench-convert-"))
    rows = []
    try:
        for name in args.models:
            rows.append(measure(workdir, name, args.num_layers))
            print(f"done {name}", file=sys.stderr)
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    print(f"\n1B shapes at {args.num_layers} layers, float32, 1 process\n")
    print(
        "export s = read checkpoint + map and write safetensors; import s = read safetensors + map + write checkpoint\n"
    )
    print_table(COLUMNS, rows, markdown=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
