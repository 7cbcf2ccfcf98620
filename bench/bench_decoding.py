"""Decoding throughput: KV cache against recomputing the full sequence per token, LIMe and baseline.

Builds LIMe and the LLaMA baseline with the same tiny shape and, in one process, interleaving the
two models, generates ``--new-tokens`` tokens greedily after a ``--prompt-length``-token prompt
with ``lime_megatron.inference.generation`` (KV cache) and with full recomputation per token
(``use_cache=False``).  Reports the median tokens/s over ``--repeats`` runs, the cache's speed-up
and LIMe over the baseline, and checks that both modes generated the same tokens.  One untimed run
of each model and mode comes first: on a GPU the first run of a shape compiles LIMe's Triton
kernels and builds TransformerEngine's attention plans (one per sequence length the cache grows
through), seconds that are no part of decoding's steady state (the H200 session of 2026-11-28
timed them: 26 tokens/s for the baseline, 17 for LIMe, at a 1B shape).

``--profile N`` then runs one more KV-cache generation of each model under Python's profiler
(``host_profile``) and, on a GPU, one under ``torch.profiler``: per generated token, the wall ms,
the device's busy ms (all kernels' time; where it is far below the wall, the step waits on the
host), and the N functions whose cumulative ms LIMe exceeds the baseline's by most, and the N the
baseline spends most in (where a decoding step's host time goes: on the H200 of 2026-11-29, TE
spec, the kernels were busy 1.3 ms of a 33-41 ms token, both models; BENCHMARKS.md).

Run (the figures in BENCHMARKS.md):
    python bench/bench_decoding.py
On a GPU at the paper's 1B GQA-8 shape (the GPU session's decoding step, ``tools/gpu/session.py``):
    python bench/bench_decoding.py --device cuda --dtype bfloat16 --transformer-impl transformer_engine \
        --num-layers 16 --hidden-size 2048 --num-attention-heads 32 --kv-heads 8 --ffn-hidden-size 8192 \
        --vocab-size 50304 --prompt-length 128 --new-tokens 32 --repeats 1 --profile 12
"""

from __future__ import annotations

import argparse
import statistics

import torch
from bench_lime_overhead import add_device_options, build_on_device, device_config, profile_total, self_times
from host_profile import function_differences, function_times
from tables import field, print_table, write_json
from torch.profiler import ProfilerActivity, profile
from tqdm import tqdm

from lime_megatron.inference.generation import Generator, SamplingOptions
from lime_megatron.parallel.process_groups import initialize_parallel


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--num-attention-heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--ffn-hidden-size", type=int, default=512)
    parser.add_argument("--vocab-size", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--prompt-length", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="profile one more KV-cache generation of each model: wall and device ms per token, the N functions "
        "with the most LIMe-minus-baseline host time, the N the baseline spends most in",
    )
    add_device_options(parser)
    parser.add_argument("--json", metavar="PATH", help="also write the measured rows to PATH")
    return parser.parse_args(argv)


def build(args, lime: bool):
    config = device_config(
        args,
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.kv_heads,
        lime=lime,
    )
    return build_on_device(args, config, args.prompt_length + args.new_tokens).eval()


def timed_runs(args, models: dict, prompts: list[list[int]], options: SamplingOptions) -> tuple[dict, dict]:
    """One untimed run of each model and mode, then ``--repeats`` timed ones, interleaved: the
    median tokens/s and the first timed run's tokens of each (model, uses the cache)."""
    rates = {(name, cache): [] for name in models for cache in (True, False)}
    tokens = {}
    warmups = [(name, cache) for cache in (True, False) for name in models]
    runs = [(name, cache) for _ in range(args.repeats) for cache in (True, False) for name in models]
    for index, (name, cache) in enumerate(tqdm(warmups + runs, desc="decoding runs (warm-up first)")):
        result = Generator(models[name], use_cache=cache).generate(prompts, options)
        if index >= len(warmups):
            rates[name, cache].append(result.tokens_per_second)
            tokens.setdefault((name, cache), result.tokens)
    return {key: statistics.median(values) for key, values in rates.items()}, tokens


def profiled_generation(model, prompts: list[list[int]], options: SamplingOptions, tokens: int) -> dict:
    """One KV-cache generation of ``model`` under Python's profiler (its function times) and, on a
    GPU, one under ``torch.profiler`` (its kernels' device ms per generated token, of ``tokens``)."""
    generate = Generator(model, use_cache=True).generate
    result = dict(functions=function_times(lambda: generate(prompts, options)))
    if next(model.parameters()).is_cuda:
        with profile(activities=[ProfilerActivity.CUDA]) as profiler:
            generate(prompts, options)
        result["device_ms_per_token"] = profile_total(self_times(profiler.key_averages(), True))[0] / tokens
    return result


def profile_section(args, models: dict, prompts: list[list[int]], options: SamplingOptions) -> dict:
    """``--profile``'s JSON section: per model its device ms per token (GPU), and the functions
    (``host_profile.function_differences``, ms per token) with the most LIMe-minus-baseline time
    and the most baseline time."""
    per = len(prompts) * options.max_new_tokens
    lime, base = (profiled_generation(models[name], prompts, options, per) for name in ("LIMe", "baseline"))
    section = dict(
        functions=function_differences(lime["functions"], base["functions"], args.profile, per),
        functions_base=function_differences(lime["functions"], base["functions"], args.profile, per, by="base_ms"),
    )
    if "device_ms_per_token" in lime:
        section["device_ms_per_token"] = dict(LIMe=lime["device_ms_per_token"], baseline=base["device_ms_per_token"])
    return section


def main(argv=None) -> None:
    args = parse_args(argv)
    initialize_parallel()
    models = {"LIMe": build(args, True), "baseline": build(args, False)}
    prompts = torch.randint(
        0, args.vocab_size, (args.batch_size, args.prompt_length), generator=torch.Generator().manual_seed(0)
    ).tolist()
    options = SamplingOptions(max_new_tokens=args.new_tokens, stop_at_eod=False)
    median, tokens = timed_runs(args, models, prompts, options)
    profiled = profile_section(args, models, prompts, options) if args.profile else {}
    if args.json:
        records = [
            dict(
                model=name,
                cached_tokens_per_s=median[name, True],
                recompute_tokens_per_s=median[name, False],
                same_tokens=tokens[name, True] == tokens[name, False],
            )
            for name in models
        ]
        write_json(args.json, args, records, **({"profile": profiled} if profiled else {}))
    print_rates(args, models, median, tokens)
    if profiled:
        print_profile(profiled, median)


def print_rates(args, models: dict, median: dict, tokens: dict) -> None:
    """The tokens/s table: each model's KV-cache and recompute rates, the cache's speed-up, LIMe over
    the baseline."""
    print(
        f"\n{args.num_layers} layers, hidden {args.hidden_size}, {args.num_attention_heads} heads / "
        f"{args.kv_heads} kv heads, batch {args.batch_size}, prompt {args.prompt_length}, "
        f"{args.new_tokens} new tokens, "
        f"median of {args.repeats} after one warm-up run each, {torch.get_num_threads()} threads"
    )
    rows = [
        dict(
            model=name,
            cached=f"{median[name, True]:.1f}",
            full=f"{median[name, False]:.1f}",
            speedup=f"{median[name, True] / median[name, False]:.2f}x",
            same=str(tokens[name, True] == tokens[name, False]),
        )
        for name in models
    ]
    rows.append(
        dict(
            model="LIMe/base",
            cached=f"{median['LIMe', True] / median['baseline', True]:.2f}",
            full=f"{median['LIMe', False] / median['baseline', False]:.2f}",
            speedup="",
            same="",
        )
    )
    print_table(
        [
            ("model", field("model")),
            ("KV cache tok/s", field("cached")),
            ("recompute tok/s", field("full")),
            ("cache speed-up", field("speedup")),
            ("same tokens", field("same")),
        ],
        rows,
    )


def print_profile(profiled: dict, median: dict) -> None:
    """``--profile``'s tables: wall and device ms per KV-cache token, then the two function lists."""
    device = profiled.get("device_ms_per_token", {})
    for name in ("LIMe", "baseline"):
        busy = f", device busy {device[name]:.2f} ms" if name in device else ""
        print(f"{name}: {1e3 / median[name, True]:.2f} ms a KV-cache token (prefill included){busy}")
    columns = [
        ("function", field("name")),
        ("LIMe ms/token", field("lime_ms", ".3f")),
        ("base ms/token", field("base_ms", ".3f")),
        ("LIMe own ms", field("lime_own_ms", ".3f")),
        ("base own ms", field("base_own_ms", ".3f")),
        ("LIMe calls", field("lime_calls", ".1f")),
        ("base calls", field("base_calls", ".1f")),
    ]
    for title, key in (("most LIMe - baseline", "functions"), ("most baseline", "functions_base")):
        print(f"\nPython's profiler, one KV-cache generation each, per token: {title}")
        print_table(columns, profiled[key])


if __name__ == "__main__":
    main()
