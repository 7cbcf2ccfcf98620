"""The training loop of ``pretrain_lime.py``: megatron-core building blocks, composed.

megatron-core's pip package ships the pieces of a trainer but not Megatron-LM's loop; this module
is that loop, kept short. ``train(argv)`` parses the flags into a typed
``lime_megatron.training.run_config.RunConfig`` and then:

1. ``torch.distributed`` and megatron's parallel state, seeded (``lime_megatron.parallel.process_groups``);
2. :func:`build_trainer`: the tokenizer and datasets (``lime_megatron.training.data``), checked before any
   model is built; one LIMe/LLaMA chunk per virtual pipeline stage (:func:`build_model_chunks`,
   ``Float16Module`` for bf16/fp16, megatron's ``DistributedDataParallel``); megatron's optimizer
   with the router group and the LR schedule (``lime_megatron.training.optimizer``); resume from
   ``--load`` (``lime_megatron.training.checkpointing``). All of it is held by one :class:`Trainer`;
3. the loop, one named step after the other: :func:`_step` (this rank's microbatches, megatron's
   forward-backward schedule through :func:`train_step`, the optimizer and scheduler step),
   :func:`_maybe_evaluate` (every ``--eval-interval``), :func:`_record` (metrics sinks),
   :func:`_maybe_save` (every ``--save-interval`` and at the end), stop on SIGTERM/SIGINT (noticed
   at the next iteration boundary on every rank, saved first).

:func:`build_model_chunks`, :func:`forward_backward`, :func:`train_step` and :func:`run_schedule`
take explicit parameters: the parallel-exactness tests build and train their models with them.

``main(argv)`` returns an exit status and prints a usage error as one line, once per launch
(``lime_megatron.training.error_report``); ``train(argv)`` raises instead and returns a
:class:`TrainingResult` (tests call it in-process). Both take
``evaluators``: further evaluations at every validation point (:data:`Evaluator`), such as
``lime_megatron.inference.scoring.generation_evaluator``, which ``pretrain_lime.py`` passes for
``--eval-generation-file`` (the trainer cannot import the inference package, which sits above it).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import signal
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import MegatronOptimizer, OptimizerConfig
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.module import Float16Module
from megatron.core.utils import get_model_config, unwrap_model

from lime_megatron.models.config import LimeConfigError, LimeTransformerConfig
from lime_megatron.models.gpt_model import build_model
from lime_megatron.models.lime import pruning, recompute
from lime_megatron.models.lime.router import ROUTER_PARAM_ATTR
from lime_megatron.parallel import fusions
from lime_megatron.parallel.compat import default_device
from lime_megatron.parallel.pipeline import chunk_layers, finish_schedule, schedule_arguments
from lime_megatron.parallel.process_groups import destroy_parallel, initialize_parallel
from lime_megatron.planning import estimate, flops
from lime_megatron.planning.routing_block import chunk_routing_block
from lime_megatron.training import arguments, checkpointing, data
from lime_megatron.training.arguments import UsageError
from lime_megatron.training.error_report import print_usage_error
from lime_megatron.training.metrics import (
    IterationMetrics,
    MetricsLogger,
    gpu_peak_tflops,
    perplexity,
)
from lime_megatron.training.optimizer import (
    LRSchedule,
    RouterGroup,
    build_optimizer,
    build_scheduler,
    group_learning_rates,
)
from lime_megatron.training.profiling import IterationProfiler
from lime_megatron.training.run_config import CheckpointOptions, RunConfig, TrainingOptions


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
    dry_run_report: str | None = None
    """The estimate report of a ``--dry-run`` (which trains nothing)."""
    pruned_routes: pruning.RouteCounts | None = None
    """(routes, masked routes) of the model after the last route pruning (``--lime-prune-iters``)."""


# --------------------------------------------------------------------------- entry points


Evaluator = Callable[["Trainer"], dict]
"""An evaluation beside the validation loss: called on every rank at each evaluation with the
:class:`Trainer` (model chunks in train mode, as it must leave them); returns metrics by name
(the reporting rank's are logged)."""


def main(argv=None, evaluators: Sequence[Evaluator] = ()) -> int:
    """Run the trainer; returns the process exit status (2 for a usage error, printed as one line
    by one process of the launch: ``lime_megatron.training.error_report``)."""
    try:
        train(argv, evaluators)
    except (UsageError, LimeConfigError) as error:
        print_usage_error(error, _first_to_fail.get(error))
        return 2
    return 0


def train(argv=None, evaluators: Sequence[Evaluator] = ()) -> TrainingResult:
    """Parse ``argv`` and train, running ``evaluators`` at every evaluation; with ``--dry-run``
    print the estimate report instead (it is the result's ``dry_run_report``)."""
    run = arguments.parse_run(argv)
    if run.dry_run:
        report = dry_run_report(run)
        print(report, flush=True)
        return TrainingResult(dry_run_report=report)
    if run.logging.eval_generation_file and not evaluators:
        raise UsageError(
            "--eval-generation-file needs the generation evaluator: run pretrain_lime.py, or pass "
            "lime_megatron.inference.scoring.generation_evaluator to train()"
        )
    with distributed(run):
        return pretrain(run, evaluators)


def dry_run_report(run: RunConfig) -> str:
    """``lime_megatron.planning.estimate``'s report for the requested model and layout (one process, no
    ``torch.distributed``)."""
    config = arguments.transformer_config(run)
    step_time = run.step_time
    return (
        fusions.report(run)
        + "\n"
        + estimate.dry_run_report(
            config,
            vocab_size=data.tokenizer_of(run.data, run.model.vocab_size).vocab_size,
            seq_length=run.model.seq_length,
            micro_batch_size=run.training.micro_batch_size,
            num_microbatches=run.training.num_microbatches,
            transformer_impl=run.model.transformer_impl,
            share_embeddings_and_output_weights=not run.model.untie_embeddings_and_output_weights,
            compute_tflops=step_time.compute_tflops,
            link_bandwidth_gbps=step_time.link_bandwidth_gbps,
            link_latency_us=step_time.link_latency_us,
        )
    )


@contextlib.contextmanager
def distributed(run: RunConfig):
    """torch.distributed (created if needed, then destroyed) and megatron's parallel state for
    the run's layout, seeded (``lime_megatron.parallel.process_groups.set_random_seed``)."""
    created = not torch.distributed.is_initialized()
    launch = next(_launches)
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    destroy_parallel()
    layout = run.parallel
    initialize_parallel(
        layout.tensor_model_parallel_size,
        layout.pipeline_model_parallel_size,
        layout.virtual_pipeline_size,
        seed=run.training.seed,
    )
    try:
        yield
    except (UsageError, LimeConfigError) as error:
        _first_to_fail[error] = _count_failure(launch)
        raise
    finally:
        destroy_parallel()
        if created:
            torch.distributed.destroy_process_group()


_first_to_fail: weakref.WeakKeyDictionary[BaseException, bool] = weakref.WeakKeyDictionary()
"""Whether this process was the first of the launch to fail, for each usage error raised while
:func:`distributed` was up (:func:`main` prints the error only then)."""
_launches = itertools.count()
"""Numbers the runs of :func:`distributed` in this process, alike on every rank."""


def _count_failure(launch: int) -> bool:
    """Count this process's failure in run ``launch`` in torch.distributed's store, shared by the
    processes; True for the first. Where the store is gone (a launcher whose rank 0 hosted it and
    has exited), True: the error is then printed by more than one process rather than by none."""
    if torch.distributed.get_world_size() == 1:
        return True
    try:
        return torch.distributed.distributed_c10d._get_default_store().add(f"lime_megatron/failures/{launch}", 1) == 1
    except torch.distributed.DistError:
        return True


# --------------------------------------------------------------------------- building


def build_model_chunks(
    config,
    vocab_size: int,
    max_sequence_length: int,
    *,
    transformer_impl: str = "local",
    share_embeddings_and_output_weights: bool = True,
    rotary_base: int = 10000,
    use_distributed_optimizer: bool = False,
    seq_length: int | None = None,
    micro_batch_size: int = 1,
) -> list:
    """This rank's model chunks (one per virtual pipeline stage), ``Float16Module`` for bf16/fp16,
    each wrapped in megatron's ``DistributedDataParallel``; ``config`` gets the schedule's hooks
    (gradient finalisation, no-sync).

    ``vocab_size`` is the padded vocabulary; ``transformer_impl`` megatron's layer backend
    (``local`` or ``transformer_engine``).  Each chunk's LIMe routing block size comes from the cost
    model (``planning.routing_block.chunk_routing_block``: the chunk's layers, rows of
    ``seq_length * micro_batch_size`` tokens, ``seq_length`` the training sequence, by default
    ``max_sequence_length``; the dry run chooses with the same)."""
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    layers_of_chunk = chunk_layers(config)
    chunks = []
    for vp_stage in range(vpp) if vpp else [None]:
        global_chunk = (
            vp_stage or 0
        ) * config.pipeline_model_parallel_size + parallel_state.get_pipeline_model_parallel_rank()
        chunk = build_model(
            config,
            vocab_size,
            max_sequence_length,
            transformer_impl=transformer_impl,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            vp_stage=vp_stage,
            share_embeddings_and_output_weights=share_embeddings_and_output_weights,
            rotary_base=rotary_base,
            routing_block=chunk_routing_block(
                config, layers_of_chunk[global_chunk], seq_length or max_sequence_length, micro_batch_size
            ),
        )
        for param in chunk.parameters():
            tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(param)
        if torch.cuda.is_available():
            chunk.cuda(torch.cuda.current_device())
        if config.bf16 or config.fp16:
            chunk = Float16Module(config, chunk)
            keep_routers_in_float32(chunk)
        chunks.append(chunk)
    ddp_config = DistributedDataParallelConfig(  # float32 gradients, float64 ones for a float64 model
        grad_reduce_in_fp32=config.params_dtype != torch.float64, use_distributed_optimizer=use_distributed_optimizer
    )
    model = [DistributedDataParallel(config, ddp_config, chunk) for chunk in chunks]
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = [chunk.no_sync for chunk in model] if len(model) > 1 else model[0].no_sync
    return model


def keep_routers_in_float32(chunk) -> None:
    """Give the learned LIMe routers of a ``Float16Module`` chunk float32 weights again (it cast
    the whole model to bf16/fp16): their gradient ``float32_product`` returns reaches the float32
    ``main_grad`` without a bf16 rounding, and their 10x learning rate updates float32 weights
    (megatron's mixed-precision optimizers keep float32 model parameters as they are).  The routing
    products cast the weight to the activations' dtype."""
    for router in unwrap_model(chunk).routers():
        if router.learned:
            router.weight.data = router.weight.data.float()


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
                    tensor_parallel.param_is_not_tensor_parallel_duplicate(param)
                )
            is_router = getattr(param, ROUTER_PARAM_ATTR, False)  # the dynamic router's W_l too
            if counted:
                counts += torch.tensor(
                    [param.numel(), param.numel() if is_router else 0], dtype=counts.dtype, device=counts.device
                )
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
    accumulate in each parameter's ``main_grad``. The stage tensor between pipeline stages is
    ``[s, mbs * config.residual_streams, hidden]`` (Hyper-Connections fold their streams into it)."""
    config = get_model_config(model[0])
    micro_batch_size, seq_length = batches[0]["tokens"].shape
    iterators = [iter(batches) for _ in model]
    reports = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iterators if len(model) > 1 else iterators[0],
        model=model,
        num_microbatches=len(batches),
        seq_length=seq_length,
        micro_batch_size=micro_batch_size * config.residual_streams,  # Hyper-Connections' stage tensor
        forward_only=forward_only,
        **schedule_arguments(config, len(batches), forward_only, model),
    )
    finish_schedule()
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
    """One iteration: (loss, gradient norm, skipped); masked router weights stay zero
    (``pruning.enforce_route_masks``: Adam's moments would move them)."""
    optimizer.zero_grad()
    loss = forward_backward(model, batches)
    result = (loss, *optimizer_step(optimizer, scheduler))
    if getattr(model[0].config, "lime_prune_top_p", None) is not None:  # a pruning run
        pruning.enforce_route_masks(model)
    return result


def prune_routes(model: list, top_p: float, iteration: int) -> pruning.RouteCounts:
    """Set the route masks (``pruning.set_route_masks``) and the source layers every rank sees
    read (``pruning.share_route_reads``), and report the masked share of the whole model's routes
    (summed over the model-parallel ranks) in this project's unit and in v1 Table 5's
    (``pruning.RouteCounts``)."""
    pruning.set_route_masks(model, top_p)
    pruning.share_route_reads(model)
    counts = torch.tensor(pruning.pruned_counts(model), dtype=torch.float64, device=default_device())
    torch.distributed.all_reduce(counts, group=parallel_state.get_model_parallel_group())
    result = pruning.RouteCounts(*(int(count) for count in counts))
    ours, v1 = (
        f"{masked:,} of {total:,} ({100 * masked / max(total, 1):.1f}%)" for total, masked in (result[:2], result[2:])
    )
    _print0(
        f"route pruning at iteration {iteration} (top-p {top_p}): masked {ours} routes; "
        f"in v1 Table 5's unit (head, earlier source) {v1}"
    )
    return result


def evaluate(model: list, dataset, eval_iters: int, training: TrainingOptions) -> float:
    """Mean loss per token over the first ``eval_iters`` global batches of ``dataset``."""
    for chunk in model:
        chunk.eval()
    total = 0.0
    with torch.no_grad():
        for index in range(eval_iters):
            batches = data.microbatches(dataset, index * training.global_batch_size, training)
            total += run_schedule(model, batches, forward_only=True)
    for chunk in model:
        chunk.train()
    return total / eval_iters


# --------------------------------------------------------------------------- signals


class StopSignals:
    """Records SIGTERM and SIGINT while open; :meth:`received` tells every rank whether any
    rank got one (collective)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self._received = 0
        self._previous = {}

    def __enter__(self) -> StopSignals:
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


# --------------------------------------------------------------------------- the trainer


@dataclass
class Trainer:
    """Everything a run holds while it trains."""

    run: RunConfig
    config: LimeTransformerConfig
    tokenizer: Any
    datasets: data.Datasets
    model: list
    """This rank's DDP-wrapped model chunks."""
    optimizer: MegatronOptimizer
    scheduler: OptimizerParamScheduler
    metrics: MetricsLogger
    profiler: IterationProfiler
    progress: checkpointing.TrainingState
    """Completed iterations and consumed samples."""
    description: dict
    """What checkpoints record about the run (``checkpointing.run_description``)."""
    result: TrainingResult
    flops_per_iteration: float
    peak_tflops: float | None
    evaluators: tuple = ()
    """:data:`Evaluator` s run at every evaluation."""


def _print0(*parts) -> None:
    if torch.distributed.get_rank() == 0:
        print(*parts, flush=True)


def optimizer_config(run: RunConfig) -> OptimizerConfig:
    """megatron ``OptimizerConfig`` of the run (Adam is AdamW)."""
    training, precision = run.training, run.precision
    return OptimizerConfig(
        optimizer=training.optimizer,
        lr=training.lr,
        min_lr=training.min_lr,
        weight_decay=training.weight_decay,
        adam_beta1=training.adam_beta1,
        adam_beta2=training.adam_beta2,
        adam_eps=training.adam_eps,
        sgd_momentum=training.sgd_momentum,
        clip_grad=training.clip_grad,
        bf16=precision.bf16,
        fp16=precision.fp16,
        params_dtype=precision.params_dtype,
        loss_scale=precision.loss_scale,
        initial_loss_scale=precision.initial_loss_scale,
        min_loss_scale=precision.min_loss_scale,
        loss_scale_window=precision.loss_scale_window,
        hysteresis=precision.hysteresis,
        use_distributed_optimizer=run.parallel.use_distributed_optimizer,
    )


def router_group(run: RunConfig) -> RouterGroup | None:
    """The LIMe routers' parameter group of the run (None for the LLaMA baseline)."""
    lime = run.lime
    return RouterGroup(lime.lime_router_lr, lime.lime_router_weight_decay) if lime.lime else None


def lr_schedule(run: RunConfig) -> LRSchedule:
    """The learning-rate schedule of the run."""
    training = run.training
    return LRSchedule(
        max_lr=training.lr,
        decay_iters=training.lr_decay_iters,
        train_iters=training.train_iters,
        min_lr=training.min_lr,
        init_lr=training.lr_warmup_init,
        warmup_iters=training.lr_warmup_iters,
        decay_style=training.lr_decay_style,
        weight_decay=training.weight_decay,
    )


def build_trainer(run: RunConfig, evaluators: Sequence[Evaluator] = ()) -> Trainer:
    """Tokenizer, datasets, model, optimizer, scheduler and metrics of ``run``, resumed from
    ``--load`` when it holds a checkpoint (inside an initialised :func:`distributed`)."""
    config = arguments.transformer_config(run)
    tokenizer = data.tokenizer_of(run.data, run.model.vocab_size)
    datasets = data.build_datasets(run, tokenizer)
    model = build_model_chunks(
        config,
        tokenizer.vocab_size,
        run.model.max_sequence_length,
        transformer_impl=run.model.transformer_impl,
        share_embeddings_and_output_weights=not run.model.untie_embeddings_and_output_weights,
        rotary_base=run.model.rotary_base,
        use_distributed_optimizer=run.parallel.use_distributed_optimizer,
        seq_length=run.model.seq_length,
        micro_batch_size=run.training.micro_batch_size or 1,
    )
    optimizer = build_optimizer(model, optimizer_config(run), router_group(run), run.training.weight_decay_grouping)
    scheduler = build_scheduler(optimizer, lr_schedule(run))
    result = TrainingResult()
    result.parameters, result.router_parameters = count_parameters(model)
    description = checkpointing.run_description(run, config, tokenizer)
    progress = _resume(run.checkpointing, model, optimizer, scheduler, description, result)
    if getattr(config, "lime_prune_top_p", None) is not None:  # masks may have come with the checkpoint
        pruning.share_route_reads(model)
    reporting = torch.distributed.get_rank() == torch.distributed.get_world_size() - 1
    return Trainer(
        run=run,
        config=config,
        tokenizer=tokenizer,
        datasets=datasets,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        progress=progress,
        description=description,
        result=result,
        metrics=MetricsLogger(run.logging, run.training.train_iters, reporting, run.name, run.as_flat_dict()),
        profiler=IterationProfiler(run.logging, torch.distributed.get_rank()),
        flops_per_iteration=flops.training_flops_per_iteration(
            config, run.model.seq_length, tokenizer.vocab_size, run.training.global_batch_size
        ),
        peak_tflops=gpu_peak_tflops(run.logging.gpu_peak_tflops),
        evaluators=tuple(evaluators),
    )


def _resume(
    options: CheckpointOptions, model: list, optimizer, scheduler, description: dict, result: TrainingResult
) -> checkpointing.TrainingState:
    """Load ``--load`` if it holds a checkpoint, else the weights of ``--pretrained-checkpoint`` if
    given; the progress to start from."""
    outcome = None
    if options.load is not None:
        weights_only = options.finetune or options.no_load_optim
        outcome = checkpointing.load_checkpoint(
            options.load,
            model,
            optimizer,
            scheduler,
            description,
            load_optim=not weights_only,
            load_rng=not (options.finetune or options.no_load_rng),
        )
        if outcome is None:
            _check_missing_load(options)
    if outcome is None and options.pretrained_checkpoint is not None:
        outcome = checkpointing.load_checkpoint(
            options.pretrained_checkpoint, model, optimizer, scheduler, description, load_optim=False, load_rng=False
        )
        if outcome is None:
            raise _no_checkpoint("--pretrained-checkpoint", options.pretrained_checkpoint)
    if outcome is None:
        if options.load is not None:
            _print0(f"no checkpoint in {options.load} yet: training from scratch")
        return checkpointing.TrainingState()
    result.resumed_from = outcome.directory
    notes = [] if outcome.rng_restored else ["RNG states not restored (layout changed or --no-load-rng)"]
    if not outcome.optimizer_restored:
        notes.append(
            "weights only (--finetune, --no-load-optim or --pretrained-checkpoint): fresh optimizer, iteration 0"
        )
    _print0(
        f"resumed from {outcome.directory} at iteration {outcome.state.iteration}"
        + "".join(f"; {note}" for note in notes)
    )
    return outcome.state


def _check_missing_load(options: CheckpointOptions) -> None:
    """An empty ``--load`` is an error unless it is the ``--save`` directory (resume-if-present)."""
    same_as_save = options.save is not None and os.path.abspath(options.save) == os.path.abspath(options.load)
    if options.exit_on_missing_checkpoint or not same_as_save:
        raise _no_checkpoint("--load", options.load)


def _no_checkpoint(flag: str, directory: str) -> checkpointing.CheckpointError:
    return checkpointing.CheckpointError(f"no checkpoint in {flag} {directory} (no {checkpointing.TRACKER} there)")


def pretrain(run: RunConfig, evaluators: Sequence[Evaluator] = ()) -> TrainingResult:
    """Train as ``run`` says, inside an initialised :func:`distributed` context."""
    trainer = build_trainer(run, evaluators)
    training, result = run.training, trainer.result
    _print0(
        f"{run.name}: {result.parameters:,} parameters ({result.router_parameters:,} router), "
        f"layout {trainer.description['layout']}, {training.num_microbatches} microbatches of "
        f"{training.micro_batch_size} x {run.model.seq_length} tokens per data-parallel rank, "
        f"vocabulary {trainer.tokenizer.vocab_size}"
    )
    try:
        with StopSignals() as signals, trainer.profiler:
            _loop(trainer, signals)
        if trainer.datasets.test is not None and run.logging.eval_iters:
            result.test_loss = evaluate(trainer.model, trainer.datasets.test, run.logging.eval_iters, training)
    finally:
        trainer.metrics.close()
    _summary(run.name, result)
    return result


# --------------------------------------------------------------------------- the loop


def _loop(trainer: Trainer, signals: StopSignals) -> None:
    """Step, record, maybe evaluate, maybe save, until the last iteration or a stop signal."""
    last = trainer.run.training.last_iteration
    while trainer.progress.iteration < last:
        record = _step(trainer)
        stop = signals.received()
        _maybe_evaluate(trainer, record, final=stop is not None or trainer.progress.iteration == last)
        _record(trainer, record)
        _maybe_save(trainer, final=stop is not None or trainer.progress.iteration == last)
        if stop:
            _stop(trainer, stop)
            return


def _step(trainer: Trainer) -> IterationMetrics:
    """One training iteration on the next global batch; its metrics."""
    training, progress = trainer.run.training, trainer.progress
    start = time.perf_counter()
    batches = data.microbatches(trainer.datasets.train, progress.consumed_samples, training)
    lime = trainer.run.lime
    prune = progress.iteration + 1 in (lime.lime_prune_iters or ())
    if prune:
        pruning.collect_dynamic_prior(trainer.model, True)  # the dynamic prior of this global batch
    with trainer.profiler.iteration(progress.iteration + 1):
        loss, grad_norm, skipped = train_step(trainer.model, trainer.optimizer, trainer.scheduler, batches)
    if prune:
        trainer.result.pruned_routes = prune_routes(trainer.model, lime.lime_prune_top_p, progress.iteration + 1)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    progress.iteration += 1
    progress.consumed_samples += training.global_batch_size
    routed_kv = recompute.routed_kv_log.take()  # counts per step; the first step's are printed
    if progress.iteration == 1 and routed_kv:
        _print0(recompute.describe(routed_kv))
    rates = group_learning_rates(trainer.optimizer, training.lr)
    record = IterationMetrics(
        iteration=progress.iteration,
        lm_loss=loss,
        lr=rates["lr"],
        grad_norm=grad_norm,
        tokens_per_sec=training.global_batch_size * trainer.run.model.seq_length / seconds,
        router_lr=rates.get("router_lr"),
        skipped=skipped,
        epoch=trainer.datasets.epochs(progress.consumed_samples),
    )
    if torch.cuda.is_available():
        record.tflops_per_gpu = trainer.flops_per_iteration / seconds / torch.distributed.get_world_size() / 1e12
        record.mfu = record.tflops_per_gpu / trainer.peak_tflops if trainer.peak_tflops else None
        record.loss_scale = trainer.optimizer.get_loss_scale().item() if trainer.run.precision.fp16 else None
    return record


def _maybe_evaluate(trainer: Trainer, record: IterationMetrics, final: bool) -> None:
    """Validation every ``--eval-interval`` iterations and at the end of the run."""
    logging, iteration = trainer.run.logging, trainer.progress.iteration
    if iteration % logging.eval_interval and not final:
        return
    if trainer.evaluators:
        record.evaluations = {
            name: value for evaluator in trainer.evaluators for name, value in evaluator(trainer).items()
        }
    if trainer.datasets.valid is None or not logging.eval_iters:
        return
    record.validation_loss = evaluate(trainer.model, trainer.datasets.valid, logging.eval_iters, trainer.run.training)
    record.validation_ppl = perplexity(record.validation_loss)
    trainer.result.validation[iteration] = record.validation_loss


def _record(trainer: Trainer, record: IterationMetrics) -> None:
    """Send the iteration's metrics to the sinks and keep them in the result."""
    trainer.metrics.log(record)
    result = trainer.result
    result.losses[record.iteration] = record.lm_loss
    result.tokens_per_sec.append(record.tokens_per_sec)
    result.iteration = record.iteration


def _maybe_save(trainer: Trainer, final: bool) -> None:
    """A checkpoint every ``--save-interval`` iterations and at the end of the run."""
    options, progress = trainer.run.checkpointing, trainer.progress
    due = options.save_interval and progress.iteration % options.save_interval == 0
    if not options.save or not (due or final):
        return
    saved = checkpointing.save_checkpoint(
        options.save,
        trainer.model,
        trainer.optimizer,
        trainer.scheduler,
        progress,
        trainer.description,
        keep_last=options.ckpt_keep_last,
    )
    trainer.result.checkpoint = saved or trainer.result.checkpoint
    if saved:
        _print0(f" saved checkpoint {saved}")


def _stop(trainer: Trainer, signal_name: str) -> None:
    trainer.result.stopped_by = signal_name
    _print0(
        f"{signal_name} received: stopped after iteration {trainer.progress.iteration}"
        + (" (checkpoint saved)" if trainer.run.checkpointing.save else " (no --save: nothing saved)")
    )


def _summary(name: str, result: TrainingResult) -> None:
    if not result.losses:
        _print0(f"{name}: nothing to train (already at iteration {result.iteration})")
        return
    first, last = min(result.losses), max(result.losses)
    rate = np.median(result.tokens_per_sec)
    parts = [
        f"{name} summary: iterations {first}-{last}",
        f"loss {result.losses[first]:.4f} -> {result.losses[last]:.4f}",
    ]
    if result.validation:
        parts.append(f"validation loss {result.validation[max(result.validation)]:.4f}")
    if result.test_loss is not None:
        parts.append(f"test loss {result.test_loss:.4f}")
    parts.append(f"median {rate:,.0f} tokens/s")
    if result.checkpoint:
        parts.append(f"checkpoint {result.checkpoint}")
    _print0(" | ".join(parts))
