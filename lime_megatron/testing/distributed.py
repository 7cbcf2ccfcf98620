"""Multi-process test harness for megatron-core on CPU (gloo).

Importing torch and megatron is the expensive part of a launch on a small machine, so the ranks
are forked from a fork server that imports them once per test session (the first launch pays
10-20 s on 2 cores, later ones well under a second), and one launch is meant to check many
things: :func:`run_distributed` runs one function on N ranks, which calls
:func:`initialize_layout` once per parallel layout it wants to check.

Models, optimizers and schedules are the trainer's own (``lime_megatron.training.trainer``:
``build_model_chunks``, ``forward_backward``/``train_step``; ``lime_megatron.training.optimizer``), so the
tests exercise the path ``pretrain_lime.py`` runs. This harness only launches ranks, initialises
layouts, makes data and moves weights: :func:`load_full` copies full single-process tensors into
a layout's shards and :func:`gather_full` gathers parameters or gradients back into full,
unsharded tensors in the single-process (TP=1, PP=1) naming and layout, so a parallel layout can
be compared with a single-process run. Models that add parameters with their own tensor-parallel
split pass ``extra_shard_rules``.
"""

import dataclasses
import gc
import itertools
import os
import pickle
import queue
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch
import torch.multiprocessing as mp

from lime_megatron.parallel.compat import distributed_backend, enable_cpu_support
from lime_megatron.testing.nccl_rules import MODES, Coordinator, announce_exit, install

MASTER_ADDR = "127.0.0.1"
# Imported once by the fork server that starts every rank, so no launch pays for them again.
_PRELOAD = (
    __name__,
    "lime_megatron.testing.nccl_rules",
    "megatron.core.distributed",
    "megatron.core.models.gpt",
    "megatron.core.optimizer",
    "megatron.core.pipeline_parallel",
    "lime_megatron.training.trainer",
)
_GRACE_S = 5.0  # how long the other ranks may still report once one rank failed
_EXIT_WAIT_S = 10.0  # how long ranks that all reported may take to exit


class DistributedTestError(RuntimeError):
    """One or more ranks failed; the message holds each failing rank's traceback."""


# --------------------------------------------------------------------------- launching


def rendezvous_store() -> torch.distributed.TCPStore:
    """The launch's rendezvous server, listening on a port the OS picks as it binds it (a port
    found free and bound later by a rank races with every other process on the machine: that
    race once failed a CI run with ``EADDRINUSE``); ranks connect to ``store.port`` as clients."""
    return torch.distributed.TCPStore(
        MASTER_ADDR, 0, is_master=True, wait_for_workers=False, timeout=timedelta(minutes=5)
    )


def run_distributed(
    fn: Callable, world_size: int, *args, timeout: float = 600.0, nccl_rules: bool | str = False, **kwargs
) -> list:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` gloo ranks (processes forked from the fork
    server) and return the list of their results, indexed by rank.

    ``fn`` and its arguments and results must be picklable (``fn`` a module-level function);
    ``timeout`` and ``nccl_rules`` are the keyword arguments not passed on to ``fn``.  With
    ``nccl_rules`` the ranks' point-to-point operations and collectives follow NCCL's rules
    (``nccl_rules`` module: a deadlock there fails the launch with every rank's pending operations
    listed); its value picks how communicators are created: ``"lazy"`` (or ``True``; no
    ``device_id`` given to ``init_process_group``: created at first use, unbatched point-to-point
    operations on 2-rank communicators of their own) or ``"eager"`` (``device_id`` bound: every
    group's communicator exists from its creation and carries all its operations).
    Each rank has the default process group initialised, megatron's CPU support enabled and one
    intra-op thread; megatron's parallel state and the process group are torn down afterwards.
    Raises :class:`DistributedTestError` with every failing rank's traceback, or
    ``TimeoutError`` naming the ranks that did not finish within ``timeout`` seconds.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(list(_PRELOAD))
    messages = context.Queue()
    store = rendezvous_store()
    port = store.port
    coordinator = None
    mode = "lazy" if nccl_rules is True else nccl_rules
    if mode and mode not in MODES:
        raise ValueError(f"nccl_rules must be False, True or one of {MODES}, got {nccl_rules!r}")
    if mode:
        coordinator = Coordinator(world_size, context.Queue(), [context.Queue() for _ in range(world_size)])
        coordinator.start()
    processes = [
        context.Process(
            target=_worker,
            args=(
                rank,
                world_size,
                port,
                fn,
                args,
                kwargs,
                messages,
                coordinator and (mode, coordinator.inbox, coordinator.outboxes[rank]),
            ),
        )
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    results: dict[int, bytes] = {}  # rank -> its pickled return value
    failures: dict[int, str] = {}  # rank -> its traceback
    try:
        _collect(processes, messages, timeout, results, failures)
    finally:
        _stop(processes, wait_s=_EXIT_WAIT_S if len(results) == world_size else 0.0)
        if coordinator is not None:
            coordinator.stop()
    if failures:
        details = "\n".join(f"--- rank {rank} ---\n{failures[rank]}" for rank in sorted(failures))
        raise DistributedTestError(f"{len(failures)} of {world_size} ranks failed:\n{details}")
    missing = sorted(set(range(world_size)) - set(results))
    if missing:
        raise TimeoutError(f"ranks {missing} did not finish within {timeout:.0f} s")
    return [pickle.loads(results[rank]) for rank in range(world_size)]


def _collect(processes, messages, timeout: float, results: dict, failures: dict) -> None:
    """Sort ``(rank, ok, payload)`` messages into ``results`` and ``failures`` until every rank
    reported, one failed and the grace period ran out, or ``timeout`` passed; a rank that dies
    silently counts as failed."""
    deadline = time.monotonic() + timeout
    while len(results) + len(failures) < len(processes) and time.monotonic() < deadline:
        try:
            rank, ok, payload = messages.get(timeout=0.5)
        except queue.Empty:
            _record_silent_deaths(processes, results, failures)
            continue
        (results if ok else failures)[rank] = payload
        if failures:
            deadline = min(deadline, time.monotonic() + _GRACE_S)


def _record_silent_deaths(processes, results, failures) -> None:
    """Mark ranks whose process exited with an error code without reporting."""
    for rank, process in enumerate(processes):
        code = process.exitcode
        if code not in (None, 0) and rank not in results and rank not in failures:
            failures[rank] = f"process exited with code {code} without reporting"


def _stop(processes, wait_s: float) -> None:
    """Give the processes ``wait_s`` seconds in all to exit, then terminate the stragglers."""
    deadline = time.monotonic() + wait_s
    for process in processes:
        process.join(timeout=max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.is_alive():
            process.terminate()
            process.join()


def _worker(rank, world_size, port, fn, args, kwargs, messages, nccl_queues) -> None:
    """Body of one spawned rank: set up, run ``fn``, tear down, report (``nccl_queues``: the
    NCCL-rules mode and this rank's (messages to, answers from) the coordinator, or None)."""
    os.environ.update(
        MASTER_ADDR=MASTER_ADDR,
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)
    # Everything the fork server imported stays alive for the rank's life: out of the collector's
    # sight, each collection (``destroy_parallel``'s between layouts, and Python's own full ones)
    # scans only what the rank made, ~1 s less per layout on 2 cores.
    gc.freeze()
    try:
        enable_cpu_support()
        store = torch.distributed.TCPStore(MASTER_ADDR, port, is_master=False, timeout=timedelta(minutes=5))
        torch.distributed.init_process_group(
            distributed_backend(), store=store, rank=rank, world_size=world_size, timeout=timedelta(minutes=5)
        )
        rules = install(rank, *nccl_queues) if nccl_queues else None
        try:
            message: tuple[int, bool, bytes | str] = (rank, True, pickle.dumps(fn(*args, **kwargs)))
        finally:
            if rules is not None:
                announce_exit(rules)
            if rules is None or rules.deadlock is None:  # gloo work left by a deadlock can hang it
                _teardown()
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises
        message = (rank, False, traceback.format_exc())
    messages.put(message)


def _teardown() -> None:
    """Destroy megatron's parallel state and the default process group."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


# --------------------------------------------------------------------------- layouts


@dataclasses.dataclass(frozen=True)
class Layout:
    """A parallel layout: tensor (``tp``), pipeline (``pp``), virtual pipeline stages per
    pipeline rank (``vpp``, None without interleaving) and sequence parallelism (``sp``).
    The data-parallel size is what the world size leaves over."""

    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    sp: bool = False

    def __post_init__(self):
        if self.tp < 1 or self.pp < 1:
            raise ValueError(f"tp and pp must be >= 1: {self}")
        if self.vpp is not None and (self.pp < 2 or self.vpp < 2):
            raise ValueError(f"vpp needs pp >= 2 and vpp >= 2 (None disables it): {self}")
        if self.sp and self.tp < 2:
            raise ValueError(f"sequence parallelism needs tp >= 2: {self}")

    @property
    def name(self) -> str:
        """Short id such as ``tp2-pp2-vpp2-sp``."""
        parts = [f"tp{self.tp}", f"pp{self.pp}"]
        parts += [f"vpp{self.vpp}"] if self.vpp else []
        parts += ["sp"] if self.sp else []
        return "-".join(parts)

    def data_parallel_size(self, world_size: int) -> int:
        """``world_size / (tp * pp)``; ValueError if that is not a whole number."""
        model_parallel = self.tp * self.pp
        if world_size % model_parallel:
            raise ValueError(f"world size {world_size} is not divisible by tp*pp = {model_parallel} ({self.name})")
        return world_size // model_parallel


def initialize_layout(layout: Layout, seed: int = 1234) -> int:
    """(Re)initialise megatron's parallel state for ``layout`` on the current world and seed as
    the trainer does (``lime_megatron.parallel.process_groups.set_random_seed``); returns the data-parallel
    size."""
    from megatron.core import parallel_state

    from lime_megatron.parallel.process_groups import destroy_parallel, set_random_seed

    dp = layout.data_parallel_size(torch.distributed.get_world_size())
    destroy_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp,
    )
    set_random_seed(seed)
    return dp


def layout_config_kwargs(layout: Layout) -> dict:
    """``TransformerConfig`` keyword arguments for ``layout`` on this machine (float32)."""
    return dict(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp,
        sequence_parallel=layout.sp,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
    )


# --------------------------------------------------------------------------- data


def make_batches(
    num_microbatches: int, micro_batch_size: int, seq_length: int, vocab_size: int, seed: int = 0
) -> list[dict[str, torch.Tensor]]:
    """Random language-model microbatches: ``tokens``, ``labels``, ``position_ids`` (int64) and a
    ``loss_mask`` (float32) that masks about a tenth of the positions."""
    generator = torch.Generator().manual_seed(seed)
    shape = (micro_batch_size, seq_length)
    batches = []
    for _ in range(num_microbatches):
        tokens = torch.randint(vocab_size, (micro_batch_size, seq_length + 1), generator=generator)
        batches.append(
            dict(
                tokens=tokens[:, :-1].contiguous(),
                labels=tokens[:, 1:].contiguous(),
                position_ids=torch.arange(seq_length).expand(shape).contiguous(),
                loss_mask=(torch.rand(shape, generator=generator) > 0.1).float(),
            )
        )
    return batches


def data_parallel_share(batches: Sequence) -> list:
    """This data-parallel rank's contiguous share of the global list of microbatches."""
    from megatron.core import parallel_state

    dp = parallel_state.get_data_parallel_world_size()
    if len(batches) % dp:
        raise ValueError(f"{len(batches)} microbatches cannot be split over {dp} data-parallel ranks")
    share = len(batches) // dp
    start = parallel_state.get_data_parallel_rank() * share
    return list(batches[start : start + share])


# --------------------------------------------------------------------------- sharding


@dataclasses.dataclass(frozen=True)
class ShardRule:
    """How a parameter is split over the tensor-parallel ranks.

    ``dim`` is the split dimension (None: replicated). The full tensor is ``blocks`` equal
    consecutive blocks along ``dim`` and each rank holds its slice of every block, in order:
    ``blocks=2`` describes a gated MLP's fused ``[gate; up]`` fc1, whose TP shards are
    ``[gate_r; up_r]``.
    """

    dim: int | None = None
    blocks: int = 1

    def shard(self, full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
        """The part of ``full`` held by tensor-parallel ``rank`` of ``size``."""
        if self.dim is None:
            return full
        if full.shape[self.dim] % (self.blocks * size):
            raise ValueError(
                f"dim {self.dim} of {tuple(full.shape)} does not split into {self.blocks} blocks x {size} ranks"
            )
        blocks = full.chunk(self.blocks, dim=self.dim)
        return torch.cat([block.chunk(size, dim=self.dim)[rank] for block in blocks], self.dim)

    def unshard(self, shards: Sequence[torch.Tensor]) -> torch.Tensor:
        """The full tensor from the shards of tensor-parallel ranks ``0..len(shards)-1``."""
        if self.dim is None:
            return shards[0]
        per_rank = [shard.chunk(self.blocks, dim=self.dim) for shard in shards]
        blocks = [torch.cat(pieces, self.dim) for pieces in zip(*per_rank)]
        return torch.cat(blocks, self.dim)


REPLICATED = ShardRule()


def default_shard_rule(name: str, param: torch.Tensor, config) -> ShardRule:
    """Rule for megatron's own parameters: split along ``param.partition_dim`` when megatron
    marks them ``tensor_model_parallel`` (column/row-parallel linears, fused QKV, vocab-parallel
    embedding and output layer), with two blocks for a gated MLP's fc1; replicated otherwise.

    The fused QKV weight needs no special rule: megatron orders its rows by query group, so the
    TP split is contiguous.
    """
    if not getattr(param, "tensor_model_parallel", False):
        return REPLICATED
    gated_fc1 = config.gated_linear_unit and ".mlp.linear_fc1." in f".{name}"
    return ShardRule(dim=param.partition_dim, blocks=2 if gated_fc1 else 1)


def _shard_rule(name: str, param, config, extra_shard_rules) -> ShardRule:
    """``extra_shard_rules(name, param)`` if it gives a rule, else :func:`default_shard_rule`."""
    rule = extra_shard_rules(name, param) if extra_shard_rules else None
    return rule if rule is not None else default_shard_rule(name, param, config)


def global_names(chunk) -> dict[str, torch.nn.Parameter]:
    """A chunk's parameters keyed by their name in the single-process (PP=1) model.

    A module named ``<prefix>.<i>`` with an integer ``layer_number`` (megatron's 1-based global
    layer number, set on every ``TransformerLayer``) is renamed ``<prefix>.<layer_number - 1>``,
    so per-layer parameters map across pipeline stages when they live inside such a module.
    The last stage's copy of a tied output layer is named after the word embedding.
    """
    from megatron.core.utils import unwrap_model

    model = unwrap_model(chunk)
    renames = {}
    for module_name, module in model.named_modules():
        prefix, _, index = module_name.rpartition(".")
        if index.isdigit() and isinstance(getattr(module, "layer_number", None), int):
            renames[f"{module_name}."] = f"{prefix}.{module.layer_number - 1}."
    named = {}
    for name, param in model.named_parameters():
        head = next((old for old in renames if name.startswith(old)), None)
        name = renames[head] + name[len(head) :] if head else name
        if name == "output_layer.weight" and getattr(model, "share_embeddings_and_output_weights", False):
            name = "embedding.word_embeddings.weight"
        named[name] = param
    return named


def load_full(chunks: list, weights: dict[str, torch.Tensor], extra_shard_rules=None) -> None:
    """Copy full single-process tensors ``weights`` into this rank's shards of ``chunks``."""
    from megatron.core import parallel_state
    from megatron.core.utils import get_model_config

    config = get_model_config(chunks[0])
    rank = parallel_state.get_tensor_model_parallel_rank()
    size = parallel_state.get_tensor_model_parallel_world_size()
    for chunk in chunks:
        for name, param in global_names(chunk).items():
            if name not in weights:
                raise KeyError(f"no full tensor for parameter {name!r}")
            shard = _shard_rule(name, param, config, extra_shard_rules).shard(weights[name], rank, size)
            if shard.shape != param.shape:
                raise ValueError(f"{name}: shard {tuple(shard.shape)} does not fit parameter {tuple(param.shape)}")
            with torch.no_grad():
                param.copy_(shard)


def gather_full(
    chunks: list, select: Callable = lambda param: param.data, extra_shard_rules=None
) -> dict[str, torch.Tensor]:
    """Full, unsharded tensors in single-process naming and layout, on every rank (collective).

    ``select(param)`` picks what to gather: the weight by default, ``param.main_grad`` for DDP
    gradients. Copies held by several ranks (data-parallel replicas, replicated parameters, the
    tied embedding of the first and last stage) must agree.
    """
    from megatron.core import parallel_state
    from megatron.core.utils import get_model_config

    config = get_model_config(chunks[0])
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    local = [
        (name, tp_rank, _shard_rule(name, param, config, extra_shard_rules), _as_bytes(select(param)))
        for chunk in chunks
        for name, param in global_names(chunk).items()
    ]
    everyone: list[list[tuple]] = [[] for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather_object(everyone, local)
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    entries = ((name, rank, rule, _from_bytes(*data)) for name, rank, rule, data in itertools.chain(*everyone))
    return merge_shards(entries, tp_size)


def _as_bytes(tensor: torch.Tensor) -> tuple:
    """A CPU tensor as ``(dtype, shape, a numpy array of its bytes)`` for ``all_gather_object``:
    the array pickles as one buffer, where a tensor's storage pickles through ``torch.save``
    (about 0.5 ms a tensor on the 2-core VM: a fifth of a pipeline layout's comparison).  The
    array may share the tensor's memory: ``all_gather_object`` pickles it before anything runs."""
    flat = tensor.detach().reshape(-1).contiguous()
    return tensor.dtype, tuple(tensor.shape), flat.view(torch.uint8).numpy()


def _from_bytes(dtype: torch.dtype, shape: tuple, data) -> torch.Tensor:
    """The tensor ``_as_bytes`` took apart, bit for bit."""
    return torch.from_numpy(data).view(dtype).reshape(shape)


def merge_shards(entries, tp_size: int, replica_tolerance: float = 1e-6) -> dict[str, torch.Tensor]:
    """Full tensors from ``(name, tp_rank, rule, shard)`` entries of all ranks.

    Raises ValueError when a name has conflicting rules, a tensor-parallel shard is missing, or
    two copies of the same shard differ by more than ``replica_tolerance`` relative to their
    largest magnitude.
    """
    grouped: dict[str, dict] = {}
    rules: dict[str, ShardRule] = {}
    for name, tp_rank, rule, tensor in entries:
        if rules.setdefault(name, rule) != rule:
            raise ValueError(f"{name}: conflicting shard rules {rules[name]} and {rule}")
        slot = tp_rank if rule.dim is not None else 0
        first = grouped.setdefault(name, {}).setdefault(slot, tensor)
        _check_replica(name, first, tensor, replica_tolerance)
    full = {}
    for name, shards in grouped.items():
        slots = range(tp_size) if rules[name].dim is not None else [0]
        if sorted(shards) != list(slots):
            raise ValueError(f"{name}: have tensor-parallel shards {sorted(shards)} of {tp_size}")
        full[name] = rules[name].unshard([shards[slot] for slot in slots])
    return full


def _check_replica(name: str, first: torch.Tensor, other: torch.Tensor, tolerance: float) -> None:
    """ValueError unless ``other`` is ``first`` within ``tolerance`` (relative to max |first|)."""
    if first is other:
        return
    if first.shape != other.shape:
        raise ValueError(f"{name}: copies have shapes {tuple(first.shape)} and {tuple(other.shape)}")
    scale = first.abs().max().clamp_min(torch.finfo(first.dtype).tiny)
    difference = ((first - other).abs().max() / scale).item()
    if difference > tolerance:
        raise ValueError(f"{name}: copies on different ranks differ (relative {difference:.3g})")
