"""What LIMe's pipeline side channel leaves alive from step to step, with Python's cyclic garbage
collector off: a step must leave no memory, kept rows or pending send behind.

PP 4 on 4 gloo processes (this machine's CPU), LIMe hidden 256, 8 layers, sequence 512, 8
micro-batches of 1 per step, SGD through the trainer's functions (``build_model_chunks``,
``train_step``): after each of ``--steps`` steps, rank 0's live ``LayerIntegratedMemory`` objects,
kept row blocks, pending sends, and the process's resident memory (``/proc/self/statm``).  Flat
means nothing of a step outlives it.

Run:
    python bench/bench_side_channel_memory.py [--steps 20]
"""

from __future__ import annotations

import argparse
import gc
import os
from datetime import timedelta

import torch
import torch.multiprocessing as mp
from tables import field, print_table

WORLD, LAYERS, HIDDEN, SEQ, MICRO_BATCHES, VOCAB = 4, 8, 256, 512, 8, 256


def resident_mib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def live_counts() -> tuple[int, int, int]:
    """(live layer-integrated memories, kept blocks, pending sends) of this process."""
    from lime_megatron.models.lime.memory import LayerIntegratedMemory
    from lime_megatron.parallel import pipeline

    memories = sum(isinstance(obj, LayerIntegratedMemory) for obj in gc.get_objects())
    kept = pipeline._KEPT
    sends = 0 if kept is None else sum(map(len, kept.sends.values())) + len(kept.grad_sends)
    return memories, 0 if kept is None else len(kept.blocks), sends


def batches(generator: torch.Generator) -> list[dict]:
    tokens = torch.randint(VOCAB, (MICRO_BATCHES, 1, SEQ + 1), generator=generator)
    return [
        dict(tokens=t[:, :-1], labels=t[:, 1:], position_ids=torch.arange(SEQ)[None], loss_mask=torch.ones(1, SEQ))
        for t in tokens
    ]


def rank_main(rank: int, port: int, steps: int, out) -> None:
    from megatron.core.optimizer import OptimizerConfig

    from lime_megatron.models.config import lime_config
    from lime_megatron.parallel.compat import enable_cpu_support
    from lime_megatron.parallel.process_groups import initialize_parallel
    from lime_megatron.training.optimizer import LRSchedule, build_optimizer, build_scheduler
    from lime_megatron.training.trainer import build_model_chunks, train_step

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD))
    torch.set_num_threads(1)
    enable_cpu_support()
    store = torch.distributed.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(minutes=5))
    torch.distributed.init_process_group("gloo", store=store, rank=rank, world_size=WORLD)
    initialize_parallel(pipeline_model_parallel_size=WORLD)
    config = lime_config(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=8,
        lime=True,
        pipeline_model_parallel_size=WORLD,
        pipeline_dtype=torch.float32,
        deallocate_pipeline_outputs=True,
        use_cpu_initialization=True,
    )
    chunks = build_model_chunks(config, VOCAB, SEQ)
    optimizer = build_optimizer(chunks, OptimizerConfig(optimizer="sgd", lr=1e-3, weight_decay=0.0, clip_grad=0.0))
    scheduler = build_scheduler(optimizer, LRSchedule(max_lr=1e-3, decay_iters=steps, decay_style="constant"))
    generator = torch.Generator().manual_seed(0)
    gc.collect()
    gc.disable()
    rows = []
    for step in range(steps):
        train_step(chunks, optimizer, scheduler, batches(generator))
        rows.append((step + 1, *live_counts(), resident_mib()))
    gc.enable()
    if rank == 0:
        out.put(rows)
    torch.distributed.destroy_process_group()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    steps = parser.parse_args(argv).steps
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    context = mp.get_context("spawn")
    out = context.Queue()
    processes = [context.Process(target=rank_main, args=(rank, store.port, steps, out)) for rank in range(WORLD)]
    for process in processes:
        process.start()
    rows = out.get()
    for process in processes:
        process.join()
    print(
        f"PP{WORLD}, LIMe {LAYERS} layers x hidden {HIDDEN}, seq {SEQ}, {MICRO_BATCHES} micro-batches/step, "
        "gc disabled; rank 0 after each step\n"
    )
    keys = ("step", "memories", "kept", "sends", "resident")
    print_table(
        [
            ("step", field("step")),
            ("live memories", field("memories")),
            ("kept blocks", field("kept")),
            ("pending sends", field("sends")),
            ("resident MiB", field("resident", ",.0f")),
        ],
        [dict(zip(keys, row)) for row in rows],
        markdown=True,
    )
    first, last = rows[len(rows) // 2][-1], rows[-1][-1]
    print(f"\nresident memory over the second half of the run: {last - first:+,.0f} MiB")


if __name__ == "__main__":
    main()
