"""The training loop of ``pretrain_lime.py``: megatron-core building blocks, composed.

megatron-core's pip package ships the pieces of a trainer but not Megatron-LM's loop; this module
is that loop, kept short:

1. ``torch.distributed`` and megatron's parallel state (``lime_megatron.parallel``), seeds;
2. the tokenizer and datasets (``lime_megatron.data``), checked before any model is built;
3. one LIMe/LLaMA chunk per virtual pipeline stage (``lime_megatron.model.build_model``), in
   ``Float16Module`` for bf16/fp16, wrapped in megatron's ``DistributedDataParallel``;
4. ``get_megatron_optimizer`` with the router group and the LR schedule
   (``lime_megatron.optimizer``);
5. resume from ``--load`` (``lime_megatron.checkpointing``);
6. per iteration: this rank's microbatches, megatron's forward-backward schedule (no pipelining,
   1F1B or interleaved; LIMe's stage tensors through ``pipeline.schedule_arguments``), the
   optimizer step (gradient clipping, loss scaling), one scheduler step, metrics, validation
   every ``--eval-interval``, checkpoints every ``--save-interval``, at the end and when SIGTERM or
   SIGINT arrives (the signal is noticed at the next iteration boundary on every rank).

``main(argv)`` returns an exit status and prints one line per usage error; ``train(argv)`` raises
instead and returns a :class:`TrainingResult` (tests call it in-process).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import random
import signal
import sys
import time
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed import finalize_model_grads
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.module import Float16Module
from megatron.core.utils import get_model_config, unwrap_model

from lime_megatron import arguments, checkpointing, data, estimate, fusions
from lime_megatron.arguments import UsageError
from lime_megatron.compat import default_device
from lime_megatron.config import LimeConfigError
from lime_megatron.metrics import (
    IterationMetrics,
    MetricsLogger,
    gpu_peak_tflops,
    perplexity,
    training_flops_per_iteration,
)
from lime_megatron.model import build_model
from lime_megatron.optimizer import build_optimizer, build_scheduler, group_learning_rates
from lime_megatron.parallel import initialize_parallel
from lime_megatron.pipeline import schedule_arguments


@dataclass
class TrainingResult:
    """What a run did (identical on every rank)."""

    losses: dict[int, float] = field(default_factory=dict)
    """Training loss of each iteration run by this process."""
    validation: dict[int, float] = field(default_factory=dict)
    """Validation loss by iteration."""
    test_loss: float | None = None
    tokens_per_sec: list[float] = field(default_factory=list)
    """Throughput of each iteration run by this process."""
    iteration: int = 0
    """Last completed iteration."""
    resumed_from: str | None = None
    checkpoint: str | None = None
    """Newest checkpoint written by this process."""
    stopped_by: str | None = None
    """Name of the signal that stopped the run, if any."""
    parameters: int = 0
    router_parameters: int = 0


# --------------------------------------------------------------------------- entry points


def main(argv=None) -> int:
    """Run the trainer; returns the process exit status (2 for a usage error)."""
    try:
        train(argv)
    except (UsageError, LimeConfigError) as error:
        print(f"pretrain_lime.py: error: {error}", file=sys.stderr, flush=True)
        return 2
    return 0


def train(argv=None) -> TrainingResult | str:
    """Parse ``argv`` and train (or, with ``--dry-run``, return the estimate report)."""
    args = arguments.parse_args(argv)
    if args.dry_run:
        report = dry_run_report(args)
        print(report, flush=True)
        return report
    with distributed(args):
        return pretrain(args)


def dry_run_report(args: argparse.Namespace) -> str:
    """``lime_megatron.estimate``'s report for the requested model and layout (one process, no
    ``torch.distributed``)."""
    config = arguments.transformer_config(args)
    return fusions.report(args) + "\n" + estimate.dry_run_report(
        config, vocab_size=data.tokenizer_of(args).vocab_size, seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size, num_microbatches=args.num_microbatches,
        transformer_impl=args.transformer_impl,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights)


@contextlib.contextmanager
def distributed(args: argparse.Namespace):
    """torch.distributed (created if needed, then destroyed) and megatron's parallel state for
    the run's layout, seeded as Megatron-LM does (seed + 100 x pipeline rank)."""
    created = not torch.distributed.is_initialized()
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    parallel_state.destroy_model_parallel()
    initialize_parallel(args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                        args.virtual_pipeline_size, seed=args.seed)
    seed = args.seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        if created:
            torch.distributed.destroy_process_group()


# --------------------------------------------------------------------------- building


def build_model_chunks(config, vocab_size: int, max_sequence_length: int, *,
                       transformer_impl: str = "local", share_embeddings_and_output_weights: bool = True,
                       rotary_base: int = 10000, use_distributed_optimizer: bool = False) -> list:
    """This rank's model chunks (one per virtual pipeline stage), ``Float16Module`` for bf16/fp16,
    each wrapped in megatron's ``DistributedDataParallel``; ``config`` gets the schedule's hooks
    (gradient finalisation, no-sync).

    ``vocab_size`` is the padded vocabulary; ``transformer_impl`` megatron's layer backend
    (``local`` or ``transformer_engine``)."""
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    chunks = []
    for vp_stage in range(vpp) if vpp else [None]:
        chunk = build_model(
            config, vocab_size, max_sequence_length,
            backend="te" if transformer_impl == "transformer_engine" else "local",
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            vp_stage=vp_stage,
            share_embeddings_and_output_weights=share_embeddings_and_output_weights,
            rotary_base=rotary_base,
        )
        for param in chunk.parameters():
            tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(param)
        if torch.cuda.is_available():
            chunk.cuda(torch.cuda.current_device())
        if config.bf16 or config.fp16:
            chunk = Float16Module(config, chunk)
        chunks.append(chunk)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=use_distributed_optimizer)
    model = [DistributedDataParallel(config, ddp_config, chunk) for chunk in chunks]
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = [chunk.no_sync for chunk in model] if len(model) > 1 else model[0].no_sync
    return model


def count_parameters(model: list) -> tuple[int, int]:
    """(all, router) parameters of the whole model, summed over the model-parallel ranks:
    tensor-parallel replicas and the last stage's copy of a tied embedding counted once (router
    weights are split by input head; replicated heads count on their primary rank)."""
    counts = torch.zeros(2, dtype=torch.float64, device=default_device())
    for chunk in model:
        routers = {id(router.weight): router for router in unwrap_model(chunk).routers() if router.learned}
        for param in chunk.parameters():
            router = routers.get(id(param))
            if router is not None:
                counted = router.sharding.primary
            else:
                counted = not getattr(param, "shared", False) and (
                    tensor_parallel.param_is_not_tensor_parallel_duplicate(param))
            if counted:
                counts += torch.tensor([param.numel(), param.numel() if router else 0], dtype=counts.dtype,
                                       device=counts.device)
    torch.distributed.all_reduce(counts, group=parallel_state.get_model_parallel_group())
    return int(counts[0]), int(counts[1])


# --------------------------------------------------------------------------- one iteration


def _loss_func(loss_mask: torch.Tensor, per_token_loss: torch.Tensor):
    """megatron loss function: (loss sum, token count, report [sum, count]) of a microbatch."""
    mask = loss_mask.reshape(-1).float()
    total = (per_token_loss.reshape(-1).float() * mask).sum()
    tokens = mask.sum()
    return total, tokens.to(torch.int), {"lm loss": torch.stack([total.detach(), tokens])}


def forward_step(data_iterator, model):
    """megatron ``forward_step_func``: the model's per-token loss on the next microbatch."""
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, partial(_loss_func, batch["loss_mask"])


def run_schedule(model: list, batches: list, forward_only: bool = False) -> float:
    """megatron's forward(-backward) schedule (no pipelining, 1F1B or interleaved, as the parallel
    state says) over this rank's microbatches ``batches`` (dicts of ``[mbs, seq]`` tensors);
    returns the mean loss per token over the global batch (identical on every rank). Gradients
    accumulate in each parameter's ``main_grad``."""
    config = get_model_config(model[0])
    micro_batch_size, seq_length = batches[0]["tokens"].shape
    iterators = [iter(batches) for _ in model]
    reports = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iterators if len(model) > 1 else iterators[0],
        model=model,
        num_microbatches=len(batches),
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        forward_only=forward_only,
        **schedule_arguments(config),
    )
    counted = bool(reports) and parallel_state.get_tensor_model_parallel_rank() == 0
    totals = torch.zeros(2, dtype=torch.float64, device=default_device())
    if counted:
        totals += torch.stack([report["lm loss"] for report in reports]).double().sum(0)
    torch.distributed.all_reduce(totals)
    return (totals[0] / totals[1]).item()


def forward_backward(model: list, batches: list) -> float:
    """Zero the gradient buffers, then :func:`run_schedule` with backward; the loss."""
    for chunk in model:
        chunk.zero_grad_buffer()
    return run_schedule(model, batches)


def optimizer_step(optimizer, scheduler) -> tuple[float, bool]:
    """The optimizer step on the gradients in ``main_grad``: (gradient norm, skipped). The
    scheduler advances only after a successful update (fp16 overflow skips it)."""
    updated, grad_norm, _ = optimizer.step()
    if updated:
        scheduler.step(increment=1)
    return float(grad_norm) if grad_norm is not None else math.nan, not updated


def train_step(model: list, optimizer, scheduler, batches: list) -> tuple[float, float, bool]:
    """One iteration: (loss, gradient norm, skipped)."""
    optimizer.zero_grad()
    loss = forward_backward(model, batches)
    return (loss, *optimizer_step(optimizer, scheduler))


def evaluate(args, model, config, dataset) -> float:
    """Mean loss per token over the first ``--eval-iters`` global batches of ``dataset``."""
    for chunk in model:
        chunk.eval()
    total = 0.0
    with torch.no_grad():
        for index in range(args.eval_iters):
            batches = data.microbatches(dataset, index * args.global_batch_size, args)
            total += run_schedule(model, batches, forward_only=True)
    for chunk in model:
        chunk.train()
    return total / args.eval_iters


# --------------------------------------------------------------------------- signals


class StopSignals:
    """Records SIGTERM and SIGINT while open; :meth:`received` tells every rank whether any
    rank got one (collective)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self._received = 0
        self._previous = {}

    def __enter__(self) -> "StopSignals":
        for number in self.SIGNALS:
            self._previous[number] = signal.signal(number, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)

    def _handle(self, number, _frame) -> None:
        self._received = number

    def received(self) -> str | None:
        """Name of a signal received by any rank since opening, or None."""
        flag = torch.tensor([self._received], dtype=torch.int64, device=default_device())
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return signal.Signals(int(flag)).name if int(flag) else None


# --------------------------------------------------------------------------- the loop


def _print0(*parts) -> None:
    if torch.distributed.get_rank() == 0:
        print(*parts, flush=True)


def _resume(args, model, optimizer, scheduler, run: dict, result: TrainingResult):
    """Load ``--load`` if it holds a checkpoint; the training state to start from."""
    if args.load is None:
        return checkpointing.TrainingState()
    outcome = checkpointing.load_checkpoint(
        args.load, model, optimizer, scheduler, run, load_optim=not args.no_load_optim,
        load_rng=not args.no_load_rng)
    if outcome is None:
        same_as_save = args.save is not None and os.path.abspath(args.save) == os.path.abspath(args.load)
        if args.exit_on_missing_checkpoint or not same_as_save:
            raise checkpointing.CheckpointError(
                f"no checkpoint in --load {args.load} (no {checkpointing.TRACKER} there)")
        _print0(f"no checkpoint in {args.load} yet: training from scratch")
        return checkpointing.TrainingState()
    result.resumed_from = outcome.directory
    notes = [] if outcome.rng_restored else ["RNG states not restored (layout changed or --no-load-rng)"]
    if not outcome.optimizer_restored:
        notes.append("weights only (--no-load-optim): fresh optimizer, iteration 0")
    _print0(f"resumed from {outcome.directory} at iteration {outcome.state.iteration}"
            + "".join(f"; {note}" for note in notes))
    return outcome.state


def pretrain(args: argparse.Namespace) -> TrainingResult:
    """Train as ``args`` say, inside an initialised :func:`distributed` context."""
    config = arguments.transformer_config(args)
    tokenizer = data.tokenizer_of(args)
    datasets = data.build_datasets(args, tokenizer)
    model = build_model_chunks(
        config, tokenizer.vocab_size, args.max_position_embeddings or args.seq_length,
        transformer_impl=args.transformer_impl,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        rotary_base=args.rotary_base, use_distributed_optimizer=args.use_distributed_optimizer)
    optimizer = build_optimizer(model, arguments.optimizer_config(args), arguments.router_group(args))
    scheduler = build_scheduler(optimizer, arguments.lr_schedule(args))
    run = checkpointing.run_description(args, config, tokenizer)
    result = TrainingResult()
    result.parameters, result.router_parameters = count_parameters(model)
    state = _resume(args, model, optimizer, scheduler, run, result)
    name = "LIMe" if args.lime else "LLaMA"
    _print0(f"{name}: {result.parameters:,} parameters ({result.router_parameters:,} router), "
            f"layout {run['layout']}, {args.num_microbatches} microbatches of {args.micro_batch_size}"
            f" x {args.seq_length} tokens per data-parallel rank, vocabulary {tokenizer.vocab_size}")
    reporting = torch.distributed.get_rank() == torch.distributed.get_world_size() - 1
    metrics = MetricsLogger(args, reporting, name)
    try:
        with StopSignals() as signals:
            _loop(args, model, optimizer, scheduler, config, datasets, tokenizer, run, state,
                  metrics, signals, result)
        if datasets.test is not None and args.eval_iters:
            result.test_loss = evaluate(args, model, config, datasets.test)
    finally:
        metrics.close()
    _summary(args, name, result)
    return result


def _loop(args, model, optimizer, scheduler, config, datasets, tokenizer, run, state, metrics,
          signals, result) -> None:
    flops = training_flops_per_iteration(config, args, tokenizer.vocab_size)
    peak = gpu_peak_tflops(args)
    tokens = args.global_batch_size * args.seq_length
    last = min(args.train_iters, args.exit_interval or args.train_iters)
    while state.iteration < last:
        start = time.perf_counter()
        batches = data.microbatches(datasets.train, state.consumed_samples, args)
        loss, grad_norm, skipped = train_step(model, optimizer, scheduler, batches)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        state.iteration += 1
        state.consumed_samples += args.global_batch_size
        rates = group_learning_rates(optimizer, args.lr)
        record = IterationMetrics(
            iteration=state.iteration, lm_loss=loss, lr=rates["lr"], grad_norm=grad_norm,
            tokens_per_sec=tokens / seconds, router_lr=rates.get("router_lr"), skipped=skipped)
        if torch.cuda.is_available():
            record.tflops_per_gpu = flops / seconds / torch.distributed.get_world_size() / 1e12
            record.mfu = record.tflops_per_gpu / peak if peak else None
            record.loss_scale = optimizer.get_loss_scale().item() if args.fp16 else None
        stop = signals.received()
        if datasets.valid is not None and args.eval_iters and (
                state.iteration % args.eval_interval == 0 or state.iteration == last or stop):
            record.validation_loss = evaluate(args, model, config, datasets.valid)
            record.validation_ppl = perplexity(record.validation_loss)
            result.validation[state.iteration] = record.validation_loss
        metrics.log(record)
        result.losses[state.iteration] = loss
        result.tokens_per_sec.append(record.tokens_per_sec)
        result.iteration = state.iteration
        due = args.save_interval and state.iteration % args.save_interval == 0
        if args.save and (due or stop or state.iteration == last):
            saved = checkpointing.save_checkpoint(args.save, model, optimizer, scheduler, state, run,
                                                  keep_last=args.ckpt_keep_last)
            result.checkpoint = saved or result.checkpoint
            if saved:
                _print0(f" saved checkpoint {saved}")
        if stop:
            result.stopped_by = stop
            _print0(f"{stop} received: stopped after iteration {state.iteration}"
                    + (" (checkpoint saved)" if args.save else " (no --save: nothing saved)"))
            return


def _summary(args, name: str, result: TrainingResult) -> None:
    if not result.losses:
        _print0(f"{name}: nothing to train (already at iteration {result.iteration})")
        return
    first, last = min(result.losses), max(result.losses)
    rate = np.median(result.tokens_per_sec)
    parts = [f"{name} summary: iterations {first}-{last}",
             f"loss {result.losses[first]:.4f} -> {result.losses[last]:.4f}"]
    if result.validation:
        parts.append(f"validation loss {result.validation[max(result.validation)]:.4f}")
    if result.test_loss is not None:
        parts.append(f"test loss {result.test_loss:.4f}")
    parts.append(f"median {rate:,.0f} tokens/s")
    if result.checkpoint:
        parts.append(f"checkpoint {result.checkpoint}")
    _print0(" | ".join(parts))
