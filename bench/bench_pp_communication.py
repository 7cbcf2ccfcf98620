"""Bytes sent between pipeline stages per micro-batch: LIMe over the LLaMA baseline.

For each setting it launches one gloo process per pipeline stage, builds LIMe and the baseline
with the same shape, runs one micro-batch of forward+backward through megatron's 1F1B schedule,
and counts every tensor handed to megatron's point-to-point calls (through a counting subclass of
``lime_megatron.pipeline.StageTensorCommunicator``): forward = activations sent to the next stage,
backward = gradients sent to the previous one, per boundary ("after layer b").  Weights are left
uninitialised (bytes do not depend on them).

Run (the figures in BENCHMARKS.md):
    python bench/bench_pp_communication.py
    python bench/bench_pp_communication.py --settings 1b-gqa:2 1b-gqa:4 1b-mha:2 1b-mha:4 --seq-length 256
"""

from __future__ import annotations

import argparse
import os
import socket
from collections import defaultdict

import torch
import torch.multiprocessing as mp
from tqdm import tqdm

SHAPES = {  # name -> model shape (paper §5.4 deep settings at hidden 256; Table 3 1B)
    "deep32": dict(num_layers=32, hidden_size=256, ffn_hidden_size=1024, num_attention_heads=8),
    "deep64": dict(num_layers=64, hidden_size=256, ffn_hidden_size=1024, num_attention_heads=8),
    "deep128": dict(num_layers=128, hidden_size=256, ffn_hidden_size=1024, num_attention_heads=8),
    "1b-gqa": dict(num_layers=16, hidden_size=2048, ffn_hidden_size=8192, num_attention_heads=32, num_query_groups=8),
    "1b-mha": dict(num_layers=16, hidden_size=2048, ffn_hidden_size=8192, num_attention_heads=32),
}
DEFAULT_SETTINGS = [f"{name}:{stages}" for name in ("deep32", "deep64", "deep128") for stages in (4, 8)]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--settings", nargs="+", default=DEFAULT_SETTINGS,
                        help=f"SHAPE:STAGES with SHAPE one of {sorted(SHAPES)}")
    parser.add_argument("--seq-length", type=int, default=256)
    parser.add_argument("--micro-batch-size", type=int, default=1)
    parser.add_argument("--vocab-size", type=int, default=256)
    return parser.parse_args(argv)


def _counting_communicator(counts: dict):
    """A ``StageTensorCommunicator`` adding the bytes of every tensor it sends to ``counts``."""
    from lime_megatron.pipeline import StageTensorCommunicator

    class CountingCommunicator(StageTensorCommunicator):
        def _communicate(self, *, tensor_send_next, tensor_send_prev, **kwargs):
            for direction, tensor in (("forward", tensor_send_next), ("backward", tensor_send_prev)):
                if tensor is not None:
                    counts[direction] += tensor.numel() * tensor.element_size()
            return super()._communicate(tensor_send_next=tensor_send_next, tensor_send_prev=tensor_send_prev, **kwargs)

    return CountingCommunicator


def _stage_bytes(shape: dict, lime: bool, args) -> dict:
    """Bytes this rank sends in one forward+backward of one micro-batch."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from lime_megatron.config import lime_config
    from lime_megatron.model import build_model
    from lime_megatron.pipeline import schedule_groups

    stages = parallel_state.get_pipeline_model_parallel_world_size()
    config = lime_config(lime=lime, use_cpu_initialization=True, perform_initialization=False,
                         pipeline_model_parallel_size=stages, pipeline_dtype=torch.float32,
                         batch_p2p_comm=False, **shape)
    model = build_model(config, args.vocab_size, args.seq_length,
                        pre_process=parallel_state.is_pipeline_first_stage(),
                        post_process=parallel_state.is_pipeline_last_stage())
    counts = defaultdict(int)
    groups = schedule_groups()
    arguments = dict(p2p_communicator=_counting_communicator(counts)(groups.pp, config), pg_collection=groups)
    tokens = torch.randint(0, args.vocab_size, (args.micro_batch_size, args.seq_length))
    positions = torch.arange(args.seq_length).expand_as(tokens)

    def forward_step(_, chunk):
        loss = chunk(tokens, positions, None, labels=tokens)
        return loss, lambda output: (output.float().mean(), {})

    get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter([None]), model=[model], num_microbatches=1,
        seq_length=args.seq_length, micro_batch_size=args.micro_batch_size, forward_only=False, **arguments,
    )
    return dict(counts)


def _worker(rank: int, world: int, port: int, settings: list, args, results) -> None:
    from lime_megatron.parallel import initialize_parallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    initialize_parallel(pipeline_model_parallel_size=world)
    for name in settings:
        results[(name, rank)] = {lime: _stage_bytes(SHAPES[name], lime, args) for lime in (False, True)}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def measure(args) -> list[dict]:
    """Rows per (setting, boundary): forward/backward bytes of both models."""
    by_stages = defaultdict(list)
    for setting in args.settings:
        name, stages = setting.split(":")
        if name not in SHAPES:
            raise SystemExit(f"unknown shape {name!r} in {setting!r}; choose from {sorted(SHAPES)}")
        by_stages[int(stages)].append(name)
    rows = []
    for stages, names in tqdm(sorted(by_stages.items()), desc="pipeline sizes"):
        results = mp.Manager().dict()
        mp.spawn(_worker, args=(stages, _free_port(), names, args, results), nprocs=stages)
        for name in names:
            layers = SHAPES[name]["num_layers"]
            for rank in range(stages - 1):
                sent = results[(name, rank)]
                back = results[(name, rank + 1)]
                rows.append(dict(
                    setting=f"{name}:{stages}", boundary=(rank + 1) * layers // stages,
                    base_fwd=sent[False].get("forward", 0), lime_fwd=sent[True].get("forward", 0),
                    base_bwd=back[False].get("backward", 0), lime_bwd=back[True].get("backward", 0),
                ))
    return rows


def print_table(rows: list[dict]) -> None:
    mib = 2 ** 20
    header = (f"{'setting':>11} {'after layer':>11} {'base fwd MiB':>12} {'LIMe fwd MiB':>12} "
              f"{'base bwd MiB':>12} {'LIMe bwd MiB':>12} {'LIMe/base':>9}")
    print(header)
    print("-" * len(header))
    for r in rows:
        ratio = (r["lime_fwd"] + r["lime_bwd"]) / (r["base_fwd"] + r["base_bwd"])
        print(f"{r['setting']:>11} {r['boundary']:>11} {r['base_fwd'] / mib:>12.2f} {r['lime_fwd'] / mib:>12.2f} "
              f"{r['base_bwd'] / mib:>12.2f} {r['lime_bwd'] / mib:>12.2f} {ratio:>9.2f}")


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    rows = measure(args)
    print_table(rows)
    totals = defaultdict(lambda: [0, 0])
    for r in rows:
        totals[r["setting"]][0] += r["base_fwd"] + r["base_bwd"]
        totals[r["setting"]][1] += r["lime_fwd"] + r["lime_bwd"]
    print("\nsummary (all boundaries, forward+backward, per micro-batch): " + "; ".join(
        f"{setting} {lime / base:.1f}x" for setting, (base, lime) in totals.items()))
    return rows


if __name__ == "__main__":
    main()
