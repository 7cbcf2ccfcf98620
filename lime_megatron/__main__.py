"""``python -m lime_megatron``: train a tiny LIMe and its LLaMA baseline side by side.

Both models share every non-router weight at initialisation and see the same batches of a
synthetic copy task (the second half of each sequence repeats the first), trained with AdamW
(router: lr 1e-2, no weight decay, as in the paper).  Prints per-step losses and a summary.
"""

from __future__ import annotations

import argparse
import time

import torch
from tqdm import tqdm

from lime_megatron.config import lime_config
from lime_megatron.model import build_model
from lime_megatron.parallel import initialize_parallel
from lime_megatron.router import ROUTER_PARAM_ATTR


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--num-attention-heads", type=int, default=4)
    parser.add_argument("--num-query-groups", type=int, default=2)
    parser.add_argument("--seq-length", type=int, default=64)
    parser.add_argument("--micro-batch-size", type=int, default=16)
    parser.add_argument("--vocab-size", type=int, default=64)
    parser.add_argument("--train-iters", type=int, default=60)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--lime-router-lr", type=float, default=1e-2)
    return parser.parse_args(argv)


def copy_task_batch(args, generator: torch.Generator) -> torch.Tensor:
    """Tokens [b, s] whose second half repeats the first half."""
    half = torch.randint(0, args.vocab_size, (args.micro_batch_size, args.seq_length // 2), generator=generator)
    return torch.cat([half, half], dim=1)


def optimizer_for(model, args) -> torch.optim.Optimizer:
    """AdamW with the paper's router group: lr ``--lime-router-lr``, no weight decay."""
    routers = [p for p in model.parameters() if getattr(p, ROUTER_PARAM_ATTR, False)]
    others = [p for p in model.parameters() if not getattr(p, ROUTER_PARAM_ATTR, False)]
    groups = [dict(params=others, lr=args.lr, weight_decay=0.1)]
    if routers:
        groups.append(dict(params=routers, lr=args.lime_router_lr, weight_decay=0.0))
    return torch.optim.AdamW(groups, betas=(0.9, 0.95))


def build_pair(args):
    """(baseline, LIMe) with identical non-router weights."""
    models = {}
    for lime in (False, True):
        torch.manual_seed(0)
        config = lime_config(
            num_layers=args.num_layers,
            hidden_size=args.hidden_size,
            num_attention_heads=args.num_attention_heads,
            num_query_groups=args.num_query_groups,
            use_cpu_initialization=True,
            lime=lime,
        )
        models[lime] = build_model(config, vocab_size=args.vocab_size, max_sequence_length=args.seq_length)
    models[True].load_state_dict(models[False].state_dict(), strict=False)
    return models[False], models[True]


def main(argv=None) -> dict[str, list[float]]:
    args = parse_args(argv)
    initialize_parallel()
    baseline, lime = build_pair(args)
    runs = {"LLaMA": (baseline, optimizer_for(baseline, args)), "LIMe": (lime, optimizer_for(lime, args))}
    losses = {name: [] for name in runs}
    seconds = {name: 0.0 for name in runs}
    positions = torch.arange(args.seq_length).expand(args.micro_batch_size, -1)
    generator = torch.Generator().manual_seed(0)
    for _ in tqdm(range(args.train_iters), desc="training LLaMA and LIMe"):
        tokens = copy_task_batch(args, generator)
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        for name, (model, optimizer) in runs.items():
            start = time.perf_counter()
            optimizer.zero_grad()
            loss = model(inputs, positions[:, :-1], None, labels=labels)[:, args.seq_length // 2 :].mean()
            loss.backward()
            optimizer.step()
            seconds[name] += time.perf_counter() - start
            losses[name].append(loss.item())
    print(f"\n{'iter':>5} {'LLaMA loss':>11} {'LIMe loss':>10}")
    for step in range(0, args.train_iters, max(1, args.train_iters // 10)):
        print(f"{step + 1:>5} {losses['LLaMA'][step]:>11.4f} {losses['LIMe'][step]:>10.4f}")
    params = {name: sum(p.numel() for p in model.parameters()) for name, (model, _) in runs.items()}
    print(
        f"\nsummary after {args.train_iters} steps (copy task, loss on the copied half): "
        f"LLaMA {losses['LLaMA'][-1]:.4f}, LIMe {losses['LIMe'][-1]:.4f}; "
        f"parameters {params['LLaMA']:,} vs {params['LIMe']:,}; "
        f"step time LIMe/LLaMA {seconds['LIMe'] / seconds['LLaMA']:.2f}"
    )
    return losses


if __name__ == "__main__":
    main()
