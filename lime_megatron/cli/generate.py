"""Generate text from a trained checkpoint (any layout) with the KV cache.

    python tools/generate.py ckpt/lime-150m --prompt "The meaning of life is" --max-new-tokens 64
    python tools/generate.py ckpt/lime-150m --prompt-file prompts.txt --temperature 0.8 --top-p 0.95 \\
        --seed 7 --stop "\\n\\n" --output generations.jsonl
    torchrun --nproc-per-node 2 tools/generate.py ckpt/lime-150m --tensor-parallel 2 --prompt "2+3="

The checkpoint (any layout) is read into one process, or with ``--tensor-parallel N`` into N
tensor-parallel ranks launched by ``torchrun --nproc-per-node N``, with the tokenizer its run
trained with (``lime_megatron.interop.checkpoint_model``).  Every rank decodes the same prompts with the
logits gathered over the vocabulary shards and the same seeded sampler, so all ranks take the
same tokens; only rank 0 prints and writes ``--output``.  A launch whose process count is not N,
or a model whose heads or padded vocabulary do not split over N ranks, fails with one message.

Prompts come from ``--prompt`` (repeatable) and/or ``--prompt-file`` (one prompt per line;
``.jsonl``: a ``prompt`` field per line), decoded in batches of ``--batch-size``.  Each prompt is
fed after the end-of-document token (EOD), as training put EOD before every document and as
``inference.scoring`` prompts (``[EOD, *tokenize(prompt)]``); ``--no-eod-prefix`` feeds the
prompt's tokens alone.  Greedy by default; ``--temperature`` > 0 samples (``--top-k``,
``--top-p``, ``--seed``).  Stop strings take backslash escapes (``\\n``).  Prints each prompt and
its continuation apart (``repr``, so spaces and newlines show), then a summary with tokens/s;
``--no-cache`` recomputes the full sequence per token (for comparison).
"""

import argparse
import codecs
import json
import os
import sys

import torch

from lime_megatron.inference.generation import DTYPES, Generator, SamplingOptions
from lime_megatron.interop.checkpoint_model import load_model
from lime_megatron.parallel.process_groups import launch_world_size
from lime_megatron.training.arguments import CommandParser
from lime_megatron.training.checkpointing import CheckpointError


def parse_args(argv=None) -> argparse.Namespace:
    """Command-line flags."""
    parser = CommandParser(description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint", help="a --save directory (newest checkpoint) or one iter_NNNNNNN directory")
    parser.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    parser.add_argument("--prompt-file", help="prompts, one per line (.jsonl: a 'prompt' field per line)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top-k", type=int, default=0, help="0: no top-k cut")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable, backslash escapes)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--dtype", choices=DTYPES, help="weights' dtype (default: as trained)")
    parser.add_argument(
        "--tensor-parallel",
        type=int,
        default=1,
        metavar="N",
        help="tensor-parallel ranks (launch with torchrun --nproc-per-node N)",
    )
    parser.add_argument(
        "--no-eod-prefix",
        action="store_true",
        help="feed a prompt's tokens alone (default: after the end-of-document token, as in training and scoring)",
    )
    parser.add_argument("--no-cache", action="store_true", help="recompute the full sequence per token")
    parser.add_argument("--output", help="also write one JSON line per prompt here")
    return parser.parse_args(argv)


def read_prompts(args: argparse.Namespace) -> list[str]:
    """The prompts of ``--prompt`` then ``--prompt-file``."""
    prompts = list(args.prompt)
    if args.prompt_file:
        with open(args.prompt_file, encoding="utf-8") as handle:
            lines = [line.rstrip("\n") for line in handle if line.strip()]
        prompts += [json.loads(line)["prompt"] for line in lines] if args.prompt_file.endswith(".jsonl") else lines
    if not prompts:
        raise ValueError("no prompts: give --prompt TEXT or --prompt-file FILE")
    return prompts


def prompt_tokens(tokenizer, prompt: str, eod_prefix: bool = True) -> list[int]:
    """The tokens fed for ``prompt``: ``[EOD, *tokenize(prompt)]`` (``inference.scoring``'s
    convention: training puts EOD before every document), or the prompt's alone."""
    return [tokenizer.eod] * eod_prefix + tokenizer.tokenize(prompt)


def format_generation(number: int, prompt: str, continuation: str, new_tokens: int, stopped_by: str) -> str:
    """The printed record of one prompt: prompt and continuation on their own labelled lines."""
    return (
        f"=== {number}\n"
        f"prompt:       {prompt!r}\n"
        f"continuation: {continuation!r}\n"
        f"({new_tokens} new tokens, stopped by {stopped_by})\n"
    )


def check_world(tensor_parallel: int) -> None:
    """ValueError unless this launch has exactly ``tensor_parallel`` processes."""
    world = launch_world_size()
    if world != tensor_parallel:
        processes = f"{tensor_parallel} process" + ("es" if tensor_parallel > 1 else "")
        raise ValueError(
            f"--tensor-parallel {tensor_parallel} needs exactly {processes} "
            f"(torchrun --nproc-per-node {tensor_parallel}); this launch has {world}"
        )


def main(argv=None) -> int:
    """The command: :func:`run`, then the process group it started is destroyed; the exit status."""
    status = run(argv)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return status


def run(argv=None) -> int:
    """Generate as the command line ``argv`` says, in a process that may go on (tests, ranks of a
    harness); returns the exit status."""
    args = parse_args(argv)
    printing = int(os.environ.get("RANK", 0)) == 0
    try:
        prompts = read_prompts(args)
        options = SamplingOptions(
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            seed=args.seed,
            stop_strings=tuple(codecs.decode(stop, "unicode_escape") for stop in args.stop),
        )
        check_world(args.tensor_parallel)
        loaded = load_model(args.checkpoint, dtype=DTYPES.get(args.dtype), tensor_parallel=args.tensor_parallel)
        tokenizer = loaded.tokenizer()
        generator = Generator(loaded.model.to(_device()), tokenizer, use_cache=not args.no_cache)
        records, tokens, seconds = [], 0, 0.0
        for start in range(0, len(prompts), args.batch_size):
            batch = prompts[start : start + args.batch_size]
            fed = [prompt_tokens(tokenizer, prompt, not args.no_eod_prefix) for prompt in batch]
            result = generator.generate(fed, options)
            tokens, seconds = tokens + result.new_tokens, seconds + result.seconds
            for prompt, text, new, reason in zip(batch, result.texts, result.tokens, result.stopped_by):
                records.append(dict(prompt=prompt, generation=text, new_tokens=len(new), stopped_by=reason))
                if printing:
                    print(format_generation(len(records), prompt, text, len(new), reason))
    except (ValueError, OSError, CheckpointError) as error:
        if printing:
            print(f"error: {error}", file=sys.stderr)
        return 1
    if not printing:
        return 0
    if args.output:
        with open(args.output, "w", encoding="utf-8") as handle:
            handle.writelines(json.dumps(record) + "\n" for record in records)
    print(
        f"{len(prompts)} prompts, {tokens} new tokens in {seconds:.2f} s: {tokens / max(seconds, 1e-9):.1f} tokens/s "
        f"({'full recomputation' if args.no_cache else 'KV cache'}, TP={args.tensor_parallel}, "
        f"iteration {loaded.iteration} of {loaded.directory})"
    )
    return 0


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


if __name__ == "__main__":
    sys.exit(main())
