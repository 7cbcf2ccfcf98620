"""Run megatron-core on CPU over gloo when CUDA is absent.

Entry points and tests call :func:`enable_cpu_support` once, before building models. It is
idempotent and does nothing (returns False) when ``torch.cuda.is_available()``. This module is the
only place in the project that patches megatron-core; every patch below was needed on megatron-core
0.16.1 (CPU machines) and the same calls exist in 0.19.2 (GPU users).

Patches, all applied together by :func:`enable_cpu_support`:

1. A stand-in for ``torch`` (``_CpuTorch``) is bound as the global ``torch`` of a few megatron
   modules. Everything is forwarded to the real ``torch`` except that ``torch.cuda``'s
   ``current_device``/``synchronize``/``current_stream``/``get_rng_state``/``manual_seed`` act on
   the CPU, and the factories ``tensor``/``zeros``/``ones`` build on the CPU when asked for a CUDA
   device. Modules (see ``_TORCH_STANDIN_MODULES``):

   - ``tensor_parallel.random``: ``CudaRNGStatesTracker.add`` and
     ``model_parallel_cuda_manual_seed`` seed and read ``torch.cuda``'s generator.
   - ``utils``: ``GlobalMemoryBuffer.get_tensor`` allocates on ``torch.cuda.current_device()``
     (sequence-parallel all-gathers in the linear layers); ``local_multi_tensor_l2_norm``, the
     gradient norm without apex, returns a ``device="cuda"`` tensor.
   - ``tensor_parallel.layers``: weight allocation without ``use_cpu_initialization`` and the
     sequence-parallel all-gather buffers use ``torch.cuda.current_device()``.
   - ``tensor_parallel.mappings``: sequence-parallel gather/scatter buffers, same call.
   - ``models.common.embeddings.rotary_pos_embedding``: ``RotaryEmbedding.get_emb`` moves
     ``inv_freq`` to ``torch.cuda.current_device()`` on every forward.
   - ``transformer.utils``: ``get_default_causal_mask`` builds the mask with ``device="cuda"``
     (attention with ``attention_mask=None``).
   - ``pipeline_parallel.schedules``: every schedule counts tokens in a
     ``torch.zeros(..., device="cuda")``.
   - ``pipeline_parallel.p2p_communication``: receive buffers on
     ``torch.cuda.current_device()``; the shape exchange of ``variable_seq_lengths`` and batched
     send/recv also call ``torch.cuda.synchronize()``.
   - ``distributed.param_and_grad_buffer``: DDP's param/grad buffers on
     ``torch.cuda.current_device()``; 0.19's ``start_grad_sync`` also calls
     ``torch.cuda.current_stream()``.
   - ``optimizer.optimizer``: ``FP32Optimizer._scale`` (and the mixed-precision optimizers'
     ``found_inf``/``_scale_one``; 0.19's grad-norm-group flag) use ``device="cuda"``.
   - ``optimizer.clip_grads``: gradient-norm buffers with ``device="cuda"``.
   - ``optimizer.distrib_optimizer``: ``DistributedOptimizer.load_state_dict`` into a fresh
     optimizer (resuming) allocates state shards on ``torch.cuda.current_device()``.
   - ``dist_checkpointing.strategies.filesystem_async``: ``preload_tensors`` calls
     ``torch.cuda.synchronize()`` on every ``dist_checkpointing.save``.
   - ``dist_checkpointing.strategies.state_dict_saver``: ``save_state_dict_async_finalize``
     broadcasts a failure flag built on ``torch.cuda.current_device()``.

   Not covered: the fully-parallel *load* wrapper (``FullyParallelLoadStrategyWrapper``), whose
   tensor exchange calls ``.cuda()`` and ``torch.empty(..., device="cuda")``.

2. ``tensor_parallel.random._get_cuda_rng_state``/``_set_cuda_rng_state`` are replaced by their
   CPU-generator equivalents: ``CudaRNGStatesTracker.fork`` (entered by ``DotProductAttention``
   and weight initialisation even without dropout) and activation checkpointing call them.

3. Five megatron functions run with CPU-tolerant tensor methods (``Tensor.cuda()`` returns the
   CPU tensor, ``Tensor.type()`` names the CUDA type) for the duration of the call only:

   - ``optimizer.clip_grads.clip_grad_by_total_norm_fp32`` (and its alias imported into
     ``optimizer.optimizer``) asserts ``param.grad.type() == 'torch.cuda.FloatTensor'``.
   - ``DistributedOptimizer._build_model_and_main_param_groups`` and, for bf16/fp16 with the
     plain optimizer, ``Float16OptimizerWithFloat16Params.__init__`` (which makes the fp32 main
     copies) reject parameters whose ``type()`` is not a ``torch.cuda`` type.
   - ``DistributedOptimizer.get_parameter_state_dp_zero`` (distributed-optimizer checkpoints in
     the ``fully_reshardable`` format) moves each state shard to the GPU with ``.cuda()`` before
     gathering it over the data-parallel group.
   - ``LanguageModule.setup_embeddings_and_output_layer`` calls ``weight.data.cuda()`` before the
     all-reduce that ties the word embeddings of the first and last pipeline stages.

4. A logging filter drops ``tensor_parallel.random``'s "CPU RNG state changed within GPU RNG
   context" warning: on CPU the tracker forks the CPU generator itself, so every random draw
   inside ``CudaRNGStatesTracker.fork`` (weight initialisation, dropout) would log it.

5. Resuming the distributed optimizer around torch's own AdamW (no apex/TE, as on CPU machines):

   - ``DistributedOptimizer.state_dict`` reads the ``step`` of every parameter's state and asserts
     there is exactly one value, so it fails on a freshly built optimizer (no state yet), which is
     what a checkpoint load calls it on (``sharded_state_dict(is_loading=True)``). The wrapper
     first gives every parameter a zero Adam state (``exp_avg``, ``exp_avg_sq``, ``step`` 0).
   - ``DistributedOptimizer.load_state_dict`` stores one ``step`` tensor object in every
     parameter's state; torch's AdamW increments each parameter's ``step`` in place, so the
     shared counter would advance once per parameter per iteration and bias correction would go
     wrong. The wrapper gives every parameter its own copy.
   - ``DistributedOptimizer._set_main_param_and_optimizer_states`` copies every key of a
     parameter's state from the loaded tensors, but ``fully_reshardable`` checkpoints carry no
     per-parameter ``step`` (it comes from the parameter groups): the wrapper keeps the ``step``
     already set.

6. ``pipeline_parallel.p2p_communication._p2p_ops`` (the unbatched sends and receives between
   pipeline stages) is handed aliases of the tensors it sends (``Tensor.detach()``: same storage,
   new tensor object).  gloo's ``isend`` keeps the tensor *object* it was given until the send
   completes, not its storage.  Under ``overlap_p2p_comm`` megatron's interleaved schedule calls
   ``deallocate_output_tensor`` right after posting a send and waits for it only at the next one;
   that swaps the output tensor's storage for a one-element one (``out.data = ...``), so the sent
   storage was freed while gloo still read it: measured, loss off by 4e-2 to 6e-2 (LLaMA baseline)
   and 3e-4 (LIMe) at TP2 x PP2 x VPP2 + SP and PP4 x VPP2, exact with the deallocation off.  The
   alias holds the storage until gloo is done, as NCCL's caching allocator does for a CUDA tensor
   recorded on the communication stream.

7. megatron-core's notices about GPUs alone are filtered (``harmless_warnings.CPU_NOTICES``: the
   ``CUDA_DEVICE_MAX_CONNECTIONS`` speed hint of tensor-parallel layers).

No configuration changes on CPU: megatron's GPU defaults (``batch_p2p_comm`` without overlap)
run over gloo as they are.  megatron's own batched posting order swaps activations and gradients
at two stages with virtual stages, on NCCL as on gloo; ``pipeline.PipelineCommunicator``, which
every pipelined schedule call of the trainer uses, posts in an order that does not.

Private and internal APIs the project relies on
------------------------------------------------
Tested range: megatron-core 0.16.1 (CPU machines) to 0.19.x (GPU machines; ``pyproject.toml`` bounds
it), torch 2.4 and later.  Every private (``_``-prefixed) or internal megatron-core / torch API the
project touches, what it expects, and who uses it; :func:`private_api_problems` probes each one
(signatures and small behavioural checks) and names those that differ
(``tests/parallel/test_compat_apis.py`` fails on any).  ``PRIVATE_APIS`` maps every private name
the code spells (``torch``'s, megatron-core's and ``argparse``'s) to its probe; the same test
parses the package and fails on a private name it reaches into that is not registered there:

- megatron's pipeline schedules run each model chunk's forwards, and its backwards, in
  micro-batch order (``pipeline.KeptRows`` numbers the micro-batches of its side channel by
  counting calls; the pipeline exactness tests fail if that changes).
- The decoder ``context`` threading: ``GPTModel.forward(extra_block_kwargs=...)``,
  ``TransformerBlock.forward(context=...)`` passing ``context=context`` to every layer and to
  the full-recompute entry (``TransformerBlock._checkpointed_forward(..., context, ...)`` up to 0.18,
  ``megatron.core.recompute.checkpointed_forward(block, ..., context, ...)`` from 0.19; ``model.LimeGPTModel`` hands the
  memory handle through it; ``layer_spec.LimeTransformerLayer`` reads it).
- ``SelfAttention.get_query_key_value_tensors(hidden_states, ...)`` and
  ``SelfAttention._checkpointed_attention_forward(query, key, value, attention_mask, ...,
  attn_mask_type=...)`` (``attention.LimeSelfAttention``); ``rope_utils.apply_rotary_pos_emb(t,
  freqs, config, ..., cp_group=...)`` and its module global ``fused_apply_rotary_pos_emb``
  (``fusions``, RoPE fusion after routing).
- ``parallel_state._MPU_PIPELINE_MODEL_PARALLEL_RANK``, set by
  ``set_pipeline_model_parallel_rank`` (``estimate`` builds each pipeline rank's chunk on meta);
  ``schedules.get_schedule_table(num_microbatches, num_model_chunks,
  microbatch_group_size_per_vp_stage)`` (``estimate``'s interleaved in-flight count).
- ``schedules.deallocate_output_tensor(out, deallocate_pipeline_outputs)`` (``fusions`` turns it
  on for pipeline runs; LIMe's sent hidden state is not a view); it swaps ``out``'s storage for
  one element (probed: patch 6 depends on it).
- ``P2PCommunicator._communicate(*, tensor_send_next, tensor_send_prev, recv_prev, recv_next,
  tensor_shape, wait_on_reqs)`` and its ``pp_group``/``next_rank``/``prev_rank``/``config``, and
  the ``p2p_communicator``/``pg_collection`` arguments of both pipeline schedules
  (``pipeline.PipelineCommunicator`` posts LIMe's rows in megatron's calls).
- KV-cache decoding: ``Attention._adjust_key_value_for_inference(inference_context, query, key,
  value, rotary_pos_emb, ...)`` returning a 6-tuple, ``StaticInferenceContext``'s
  ``key_value_memory_dict``/``sequence_len_offset``/``is_static_batching``, and attention's
  ``pg_collection.cp`` (RoPE after routing).
- ``argparse``'s ``parser._actions``, ``_group_actions`` and ``_StoreTrueAction``
  (``training.arguments`` translates YAML configs to flags).
- torch's ``torch._C._autograd._top_saved_tensors_default_hooks(False)``: the innermost
  ``saved_tensors_hooks`` pair ``(pack, unpack)``, or None outside any (``recompute``).
- torch's ``torch.utils._python_dispatch.TorchDispatchMode`` and ``aten._to_copy``
  (``testing.copied_bytes`` counts copies with them); ``torch._foreach_copy_`` (one operator
  refreshes the router stack, ``routing_blocks.RouterStack``); ``NamedTuple._asdict``.
- torch's ``distributed_c10d._world.pg_map`` (every live process group) and
  ``distributed_c10d._get_default_group()`` (``parallel.destroy_parallel``);
  ``distributed_c10d._get_default_store()``, the default group's store, whose ``add`` counts the
  ranks that failed (``training.trainer`` prints a usage error from the first only).
- The targets of the patches above: ``tensor_parallel.random._get_cuda_rng_state`` /
  ``_set_cuda_rng_state``; ``DistributedOptimizer._build_model_and_main_param_groups`` (a
  classmethod), ``get_parameter_state_dp_zero``, ``state_dict``, ``load_state_dict``,
  ``_set_main_param_and_optimizer_states(model_param, tensors)``;
  ``distrib_optimizer.HAVE_APEX_OR_TE``; ``Float16OptimizerWithFloat16Params.__init__``;
  ``p2p_communication._p2p_ops`` (keyword-only
  ``tensor_send_prev``/``tensor_send_next``, called by name from ``_communicate``);
  ``clip_grad_by_total_norm_fp32`` in
  ``optimizer.clip_grads`` and ``optimizer.optimizer``;
  ``LanguageModule.setup_embeddings_and_output_layer``; a module global ``torch`` in every module
  of ``_TORCH_STANDIN_MODULES``.
"""

import contextlib
import functools
import importlib
import inspect
import logging
from collections.abc import Callable

import torch

from lime_megatron import harmless_warnings

__all__ = [
    "default_device",
    "distributed_backend",
    "enable_cpu_support",
    "PRIVATE_APIS",
    "private_api_problems",
]

_PREFIX = "megatron.core."

# Patch 1: megatron modules whose global ``torch`` becomes ``_CpuTorch``, with the calls that need
# it (all in 0.16.1 and 0.19.2 unless noted; the module docstring has the details).
_TORCH_STANDIN_MODULES = (
    "tensor_parallel.random",  # CudaRNGStatesTracker.add, model_parallel_cuda_manual_seed
    "utils",  # GlobalMemoryBuffer.get_tensor, local_multi_tensor_l2_norm
    "tensor_parallel.layers",  # GPU weight init, sequence-parallel all-gather buffers
    "tensor_parallel.mappings",  # sequence-parallel gather/scatter buffers
    "models.common.embeddings.rotary_pos_embedding",  # RotaryEmbedding.get_emb
    "transformer.utils",  # get_default_causal_mask
    "pipeline_parallel.schedules",  # total_num_tokens in every schedule
    "pipeline_parallel.p2p_communication",  # receive buffers, shape exchange, synchronize
    "distributed.param_and_grad_buffer",  # DDP buffers; current_stream in 0.19 start_grad_sync
    "optimizer.optimizer",  # FP32Optimizer._scale and friends
    "optimizer.clip_grads",  # get_grad_norm_fp32 / clip buffers
    "optimizer.distrib_optimizer",  # DistributedOptimizer.load_state_dict on a fresh optimizer
    "dist_checkpointing.strategies.filesystem_async",  # preload_tensors: synchronize on save
    "dist_checkpointing.strategies.state_dict_saver",  # save_state_dict_async_finalize flag
)

_SPURIOUS_RNG_WARNING = "CPU RNG state changed within GPU RNG context"
_REAL_TENSOR_TYPE = torch.Tensor.type
_enabled = False


def default_device() -> str:
    """Device new tensors and models should live on: ``"cuda"`` if available, else ``"cpu"``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def distributed_backend() -> str:
    """``torch.distributed`` backend matching :func:`default_device`: ``"nccl"`` or ``"gloo"``."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def _is_cuda_device(device) -> bool:
    """True for ``"cuda"``, ``"cuda:N"``, ``torch.device("cuda")`` and bare CUDA ordinals."""
    if isinstance(device, int):
        return True
    return isinstance(device, (str, torch.device)) and torch.device(device).type == "cuda"


def _cpu_factory(factory):
    """Wrap a tensor factory so that a CUDA ``device=`` argument builds on the CPU instead."""

    @functools.wraps(factory)
    def build(*args, **kwargs):
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
        return factory(*args, **kwargs)

    return build


def _cpu_rng_state(*_args, **_kwargs) -> torch.Tensor:
    """CPU stand-in for ``torch.cuda.get_rng_state`` and megatron's ``_get_cuda_rng_state``."""
    return torch.get_rng_state()


def _set_cpu_rng_state(new_state: torch.Tensor, *_args, **_kwargs) -> None:
    """CPU stand-in for megatron's ``_set_cuda_rng_state``."""
    torch.set_rng_state(new_state)


class _CpuCuda:
    """``torch.cuda`` as seen by the patched megatron modules: the calls they make on every
    step act on the CPU; any other attribute is the real ``torch.cuda`` one."""

    current_device = staticmethod(torch.cpu.current_device)
    synchronize = staticmethod(torch.cpu.synchronize)
    current_stream = staticmethod(torch.cpu.current_stream)
    get_rng_state = staticmethod(_cpu_rng_state)
    manual_seed = staticmethod(torch.default_generator.manual_seed)  # not queued for CUDA (torch.manual_seed)

    def __getattr__(self, name):
        return getattr(torch.cuda, name)


class _CpuTorch:
    """``torch`` as seen by the patched megatron modules: ``torch.cuda`` is :class:`_CpuCuda`
    and the factories they call with ``device="cuda"`` build on the CPU."""

    cuda = _CpuCuda()
    tensor = staticmethod(_cpu_factory(torch.tensor))
    zeros = staticmethod(_cpu_factory(torch.zeros))
    ones = staticmethod(_cpu_factory(torch.ones))

    def __getattr__(self, name):
        return getattr(torch, name)


def _stay_on_cpu(tensor, *_args, **_kwargs):
    """``Tensor.cuda`` replacement: the tensor itself, on the CPU."""
    return tensor


def _cuda_type_name(tensor, dtype=None, *args, **kwargs):
    """``Tensor.type`` replacement: a CPU tensor reports its CUDA type name (``torch.cuda.X``)."""
    if dtype is not None or tensor.device.type != "cpu":
        return _REAL_TENSOR_TYPE(tensor, dtype, *args, **kwargs)
    return _REAL_TENSOR_TYPE(tensor).replace("torch.", "torch.cuda.", 1)


@contextlib.contextmanager
def _cuda_tensor_methods():
    """While open, ``Tensor.cuda()`` keeps CPU tensors where they are and ``Tensor.type()``
    reports CUDA type names, so megatron's CUDA-only assertions accept CPU tensors."""
    saved = torch.Tensor.cuda, torch.Tensor.type
    torch.Tensor.cuda, torch.Tensor.type = _stay_on_cpu, _cuda_type_name
    try:
        yield
    finally:
        torch.Tensor.cuda, torch.Tensor.type = saved


def _with_cuda_tensor_methods(function):
    """Wrap ``function`` so that it runs inside :func:`_cuda_tensor_methods`."""

    @functools.wraps(function)
    def run(*args, **kwargs):
        with _cuda_tensor_methods():
            return function(*args, **kwargs)

    return run


def _module(name: str):
    """The megatron-core module ``megatron.core.<name>``."""
    return importlib.import_module(_PREFIX + name)


def _patch_torch_standins() -> None:
    """Patch 1: bind ``_CpuTorch`` as ``torch`` in each module of ``_TORCH_STANDIN_MODULES``."""
    standin = _CpuTorch()
    for name in _TORCH_STANDIN_MODULES:
        _module(name).torch = standin


def _patch_rng_state_functions() -> None:
    """Patch 2: megatron's CUDA RNG state getter/setter use the CPU generator."""
    random = _module("tensor_parallel.random")
    random._get_cuda_rng_state = _cpu_rng_state
    random._set_cuda_rng_state = _set_cpu_rng_state


def _patch_tensor_method_users() -> None:
    """Patch 3: run the functions that call ``.cuda()``/``.type()`` on CPU-tolerant methods."""
    # Asserts param.grad.type() == 'torch.cuda.FloatTensor' (0.16, 0.19); FP32Optimizer calls it
    # through the name imported into optimizer.optimizer.
    clip_grads = _module("optimizer.clip_grads")
    clip = _with_cuda_tensor_methods(clip_grads.clip_grad_by_total_norm_fp32)
    clip_grads.clip_grad_by_total_norm_fp32 = clip
    _module("optimizer.optimizer").clip_grad_by_total_norm_fp32 = clip

    # bf16/fp16 (plain optimizer): sorts parameters into fp32 main copies by param.type() and raises
    # TypeError unless it names a torch.cuda type (0.16, 0.19).
    float16_cls = _module("optimizer.optimizer").Float16OptimizerWithFloat16Params
    float16_cls.__init__ = _with_cuda_tensor_methods(float16_cls.__init__)

    # Raises TypeError unless model_param.type() is a torch.cuda type (0.16, 0.19).
    optimizer_cls = _module("optimizer.distrib_optimizer").DistributedOptimizer
    build_groups = optimizer_cls._build_model_and_main_param_groups.__func__
    optimizer_cls._build_model_and_main_param_groups = classmethod(_with_cuda_tensor_methods(build_groups))
    # Calls send_tensor.cuda() before gathering optimizer state shards (0.16, 0.19).
    optimizer_cls.get_parameter_state_dp_zero = _with_cuda_tensor_methods(optimizer_cls.get_parameter_state_dp_zero)

    # Calls weight.data.cuda() before tying the first and last stages' embeddings (0.16, 0.19).
    language_module_cls = _module("models.common.language_module.language_module").LanguageModule
    language_module_cls.setup_embeddings_and_output_layer = _with_cuda_tensor_methods(
        language_module_cls.setup_embeddings_and_output_layer
    )


def _zero_adam_state(optimizer) -> None:
    """Give every parameter of torch optimizer ``optimizer`` a zero Adam state with step 0."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            if not optimizer.state[param]:
                optimizer.state[param].update(
                    exp_avg=torch.zeros_like(param), exp_avg_sq=torch.zeros_like(param), step=torch.tensor(0.0)
                )


def _patch_distributed_optimizer_torch_adam() -> None:
    """Patch 5: distributed-optimizer checkpoints with torch's AdamW (no apex/TE)."""
    module = _module("optimizer.distrib_optimizer")
    if module.HAVE_APEX_OR_TE:
        return
    optimizer_cls = module.DistributedOptimizer
    state_dict, load_state_dict = optimizer_cls.state_dict, optimizer_cls.load_state_dict

    @functools.wraps(state_dict)
    def state_dict_with_state(self):
        if isinstance(self.optimizer, torch.optim.Adam | torch.optim.AdamW) and not self.optimizer.state:
            _zero_adam_state(self.optimizer)
        return state_dict(self)

    @functools.wraps(load_state_dict)
    def load_own_steps(self, *args, **kwargs):
        load_state_dict(self, *args, **kwargs)
        for state in self.optimizer.state.values():
            if "step" in state:
                state["step"] = state["step"].clone()

    set_states = optimizer_cls._set_main_param_and_optimizer_states

    @functools.wraps(set_states)
    def set_states_keeping_step(self, model_param, tensors):
        group_index, group_order = self.model_param_group_index_map[model_param]
        state = self.optimizer.state[self.optimizer.param_groups[group_index]["params"][group_order]]
        if "step" in state and "step" not in tensors:
            tensors = {**tensors, "step": state["step"]}
        return set_states(self, model_param, tensors)

    optimizer_cls.state_dict = state_dict_with_state
    optimizer_cls.load_state_dict = load_own_steps
    optimizer_cls._set_main_param_and_optimizer_states = set_states_keeping_step


def _alias(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """A new tensor object on ``tensor``'s storage (None stays None)."""
    return None if tensor is None else tensor.detach()


def _patch_sends_keep_storage() -> None:
    """Patch 6: megatron's unbatched pipeline sends hand gloo aliases that keep the sent storage."""
    p2p = _module("pipeline_parallel.p2p_communication")
    p2p_ops = p2p._p2p_ops

    @functools.wraps(p2p_ops)
    def send_aliases(*, tensor_send_prev=None, tensor_send_next=None, **kwargs):
        return p2p_ops(tensor_send_prev=_alias(tensor_send_prev), tensor_send_next=_alias(tensor_send_next), **kwargs)

    p2p._p2p_ops = send_aliases


def _drop_spurious_rng_warning(record: logging.LogRecord) -> bool:
    """Logging filter for patch 4: False (drop) for the CPU-RNG-changed warning only."""
    return record.getMessage() != _SPURIOUS_RNG_WARNING


def enable_cpu_support() -> bool:
    """Make megatron-core usable on CPU over gloo; see the module docstring for each patch.

    Returns True when CPU support is active (patched by this call or an earlier one) and False,
    without touching megatron, when CUDA is available.
    """
    global _enabled
    if torch.cuda.is_available():
        return False
    if not _enabled:
        _patch_torch_standins()
        _patch_rng_state_functions()
        _patch_tensor_method_users()
        _patch_distributed_optimizer_torch_adam()
        _patch_sends_keep_storage()
        logging.getLogger(_PREFIX + "tensor_parallel.random").addFilter(_drop_spurious_rng_warning)
        harmless_warnings.ignore_cpu_notices()
        _enabled = True
    return True


# --------------------------------------------------------------------------- private API probes


def missing_parameters(api: str, function, *names: str, keyword_only: bool = False) -> str | None:
    """None if ``function`` takes every parameter of ``names`` (keyword-only ones when
    ``keyword_only``), else one line naming ``api`` and what differs."""
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError) as error:
        return f"{api}: no signature ({error})"
    missing = [name for name in names if name not in parameters]
    if keyword_only:
        missing += [
            name for name in names if name in parameters and parameters[name].kind is not inspect.Parameter.KEYWORD_ONLY
        ]
    if missing:
        return f"{api}: expected parameters {list(names)}, missing or not keyword-only: {missing}"
    return None


def _source_passes(api: str, function, text: str) -> str | None:
    """None if ``function``'s source contains ``text`` (e.g. a keyword argument it passes on)."""
    return None if text in inspect.getsource(function) else f"{api}: its source no longer passes {text!r}"


def _present(api: str, value) -> str | None:
    """None if ``value`` (an attribute looked up for ``api``) exists, else one line."""
    return None if value is not None else f"{api}: missing"


def _probe_schedules() -> list[str | None]:
    from megatron.core.pipeline_parallel import schedules

    return [
        missing_parameters(
            "schedules.deallocate_output_tensor",
            schedules.deallocate_output_tensor,
            "out",
            "deallocate_pipeline_outputs",
        ),
        missing_parameters(
            "schedules.get_schedule_table",
            schedules.get_schedule_table,
            "num_microbatches",
            "num_model_chunks",
            "microbatch_group_size_per_vp_stage",
        ),
    ]


def _full_recompute_entry() -> tuple[str, Callable]:
    """The function full activation recompute runs the layers through: megatron-core 0.19 moved
    ``TransformerBlock._checkpointed_forward`` to ``megatron.core.recompute.checkpointed_forward``."""
    from megatron.core.transformer.transformer_block import TransformerBlock

    if hasattr(TransformerBlock, "_checkpointed_forward"):
        return "TransformerBlock._checkpointed_forward", TransformerBlock._checkpointed_forward
    return "recompute.checkpointed_forward", _module("recompute").checkpointed_forward


def _probe_context_threading() -> list[str | None]:
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_block import TransformerBlock

    return [
        missing_parameters("GPTModel.forward", GPTModel.forward, "extra_block_kwargs"),
        missing_parameters("TransformerBlock.forward", TransformerBlock.forward, "context"),
        missing_parameters(*_full_recompute_entry(), "context"),
        _source_passes("TransformerBlock.forward (context to its layers)", TransformerBlock.forward, "context=context"),
    ]


def _probe_attention() -> list[str | None]:
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.transformer.attention import SelfAttention

    return [
        missing_parameters(
            "SelfAttention.get_query_key_value_tensors", SelfAttention.get_query_key_value_tensors, "hidden_states"
        ),
        missing_parameters(
            "SelfAttention._checkpointed_attention_forward",
            SelfAttention._checkpointed_attention_forward,
            "query",
            "key",
            "value",
            "attention_mask",
            "attn_mask_type",
        ),
        missing_parameters(
            "rope_utils.apply_rotary_pos_emb", rope_utils.apply_rotary_pos_emb, "t", "freqs", "config", "cp_group"
        ),
        None
        if hasattr(rope_utils, "fused_apply_rotary_pos_emb")
        else "rope_utils.fused_apply_rotary_pos_emb: module global missing",
    ]


def _probe_pipeline_rank() -> list[str | None]:
    """Behaviour: ``set_pipeline_model_parallel_rank`` sets ``_MPU_PIPELINE_MODEL_PARALLEL_RANK``."""
    from megatron.core import parallel_state

    api = "parallel_state._MPU_PIPELINE_MODEL_PARALLEL_RANK"
    if not hasattr(parallel_state, "_MPU_PIPELINE_MODEL_PARALLEL_RANK"):
        return [f"{api}: missing"]
    previous = parallel_state._MPU_PIPELINE_MODEL_PARALLEL_RANK
    try:
        parallel_state.set_pipeline_model_parallel_rank(3)
        seen = parallel_state._MPU_PIPELINE_MODEL_PARALLEL_RANK
    finally:
        parallel_state._MPU_PIPELINE_MODEL_PARALLEL_RANK = previous
    return [None if seen == 3 else f"{api}: set_pipeline_model_parallel_rank(3) left it at {seen!r}"]


def _probe_saved_tensor_hooks() -> list[str | None]:
    """Behaviour: the innermost hooks pair inside ``saved_tensors_hooks``, None outside."""
    api = "torch._C._autograd._top_saved_tensors_default_hooks"
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is None:
        return [f"{api}: missing"]

    def pack(tensor):
        return tensor

    def unpack(tensor):
        return tensor

    outside = top(False)
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        inside = top(False)
    if outside is not None or inside is None or tuple(inside) != (pack, unpack):
        return [f"{api}(False): expected None outside hooks and (pack, unpack) inside, got {outside!r}, {inside!r}"]
    return [None]


def _probe_process_groups() -> list[str | None]:
    from torch.distributed import distributed_c10d

    return [
        _present(
            "torch.distributed.distributed_c10d._world.pg_map",
            getattr(getattr(distributed_c10d, "_world", None), "pg_map", None),
        ),
        _present(
            "torch.distributed.distributed_c10d._get_default_group",
            getattr(distributed_c10d, "_get_default_group", None),
        ),
        _present(
            "torch.distributed.distributed_c10d._get_default_store",
            getattr(distributed_c10d, "_get_default_store", None),
        ),
    ]


def _probe_patch_targets() -> list[str | None]:
    random = _module("tensor_parallel.random")
    distrib = _module("optimizer.distrib_optimizer")
    optimizer_cls = distrib.DistributedOptimizer
    language_module = _module("models.common.language_module.language_module").LanguageModule
    build = inspect.getattr_static(optimizer_cls, "_build_model_and_main_param_groups", None)
    return [
        *(
            _present(f"tensor_parallel.random.{name}", getattr(random, name, None))
            for name in ("_get_cuda_rng_state", "_set_cuda_rng_state")
        ),
        None
        if isinstance(build, classmethod)
        else "DistributedOptimizer._build_model_and_main_param_groups: not a classmethod",
        *(
            _present(f"DistributedOptimizer.{name}", getattr(optimizer_cls, name, None))
            for name in ("get_parameter_state_dp_zero", "state_dict", "load_state_dict")
        ),
        missing_parameters(
            "DistributedOptimizer._set_main_param_and_optimizer_states",
            optimizer_cls._set_main_param_and_optimizer_states,
            "model_param",
            "tensors",
        ),
        _present("distrib_optimizer.HAVE_APEX_OR_TE", getattr(distrib, "HAVE_APEX_OR_TE", None)),
        _present(
            "optimizer.Float16OptimizerWithFloat16Params",
            getattr(_module("optimizer.optimizer"), "Float16OptimizerWithFloat16Params", None),
        ),
        *(
            _present(
                f"{name}.clip_grad_by_total_norm_fp32", getattr(_module(name), "clip_grad_by_total_norm_fp32", None)
            )
            for name in ("optimizer.clip_grads", "optimizer.optimizer")
        ),
        missing_parameters(
            "p2p_communication._p2p_ops",
            _module("pipeline_parallel.p2p_communication")._p2p_ops,
            "tensor_send_prev",
            "tensor_send_next",
            keyword_only=True,
        ),
        _present(
            "LanguageModule.setup_embeddings_and_output_layer",
            getattr(language_module, "setup_embeddings_and_output_layer", None),
        ),
        *(
            _present(f"megatron.core.{name}.torch (module global)", getattr(_module(name), "torch", None))
            for name in _TORCH_STANDIN_MODULES
        ),
    ]


def _probe_decoding() -> list[str | None]:
    """KV-cache decoding (``inference.decoding``, ``LimeSelfAttention._decoding_forward``): megatron's
    ``Attention._adjust_key_value_for_inference`` returns the 6-tuple (query, key, value, rotary
    embeddings, mask type, block table), a ``StaticInferenceContext`` holds the cache in
    ``key_value_memory_dict`` at ``sequence_len_offset``, and attention keeps ``pg_collection.cp``."""
    from megatron.core.inference.contexts import StaticInferenceContext
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.attention import Attention

    adjust = Attention._adjust_key_value_for_inference
    context = StaticInferenceContext(1, 4)
    missing_state = [
        name
        for name in ("key_value_memory_dict", "sequence_len_offset", "is_static_batching")
        if not hasattr(context, name)
    ]
    returns = str(inspect.signature(adjust).return_annotation)
    return [
        missing_parameters(
            "Attention._adjust_key_value_for_inference",
            adjust,
            "inference_context",
            "query",
            "key",
            "value",
            "rotary_pos_emb",
        ),
        None
        if returns.count(",") == 5
        else f"Attention._adjust_key_value_for_inference: expected a 6-tuple result, annotated {returns}",
        None if not missing_state else f"StaticInferenceContext: missing {missing_state}",
        missing_parameters("Attention.__init__ (pg_collection)", Attention.__init__, "pg_collection"),
        None
        if "cp" in getattr(ProcessGroupCollection, "__dataclass_fields__", {})
        else "ProcessGroupCollection.cp: missing",
    ]


def _probe_pipeline_communicator() -> list[str | None]:
    """``pipeline.PipelineCommunicator`` overrides ``P2PCommunicator._communicate`` (keyword-only
    arguments, returning the two receive buffers and the requests), uses its ``pp_group``,
    ``next_rank``, ``prev_rank`` and ``config``, and is handed to both pipeline schedules with a
    ``pg_collection``."""
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    init = inspect.getsource(P2PCommunicator.__init__)
    return [
        missing_parameters(
            "P2PCommunicator._communicate",
            P2PCommunicator._communicate,
            "tensor_send_next",
            "tensor_send_prev",
            "recv_prev",
            "recv_next",
            "tensor_shape",
            "wait_on_reqs",
            keyword_only=True,
        ),
        *(
            None if f"self.{name}" in init else f"P2PCommunicator.__init__: no longer sets self.{name}"
            for name in ("pp_group", "next_rank", "prev_rank", "config")
        ),
        *(
            missing_parameters(f"schedules.{name}", getattr(schedules, name), "p2p_communicator", "pg_collection")
            for name in (
                "forward_backward_pipelining_without_interleaving",
                "forward_backward_pipelining_with_interleaving",
            )
        ),
    ]


def _probe_output_deallocation() -> list[str | None]:
    """Behaviour: ``deallocate_output_tensor(out, True)`` swaps ``out``'s storage for one element
    (the storage swap patch 6 protects in-flight sends from)."""
    from megatron.core.pipeline_parallel import schedules

    out = torch.ones(4)
    schedules.deallocate_output_tensor(out, True)
    return [
        None
        if out.numel() == 1
        else f"schedules.deallocate_output_tensor: left {out.numel()} elements, expected a 1-element storage swap"
    ]


def _probe_argparse() -> list[str | None]:
    """The standard library's ``argparse`` internals ``training.arguments`` reads (YAML configs
    translated to flags): ``parser._actions``, a group's ``_group_actions``, ``_StoreTrueAction``."""
    import argparse

    parser = argparse.ArgumentParser()
    group = parser.add_argument_group("probe")
    action = group.add_argument("--flag", action="store_true")
    found = (
        getattr(parser, "_actions", None)
        and action in parser._actions
        and action in getattr(group, "_group_actions", ())
        and isinstance(action, getattr(argparse, "_StoreTrueAction", ()))
    )
    return [None if found else "argparse: _actions / _group_actions / _StoreTrueAction changed"]


# Every private (``_``-prefixed) name of torch, megatron-core or the standard library that the
# project's code spells, with the probe that checks it (``tests/parallel/test_compat_apis.py``
# scans the package's source and fails on one missing here, and on an entry no code uses).
def _probe_copy_counting() -> list[str | None]:
    """Presence: the copy operator and the dispatch-mode base ``testing.copied_bytes`` (and
    ``testing.dispatched_operators``) count with
    (what the mode sees is tested by ``tests/models/test_memory.py``'s copy count)."""
    from torch.utils import _python_dispatch

    return [
        _present("torch.ops.aten._to_copy", getattr(torch.ops.aten, "_to_copy", None)),
        _present(
            "torch.utils._python_dispatch.TorchDispatchMode", getattr(_python_dispatch, "TorchDispatchMode", None)
        ),
    ]


def _probe_foreach_copy() -> list[str | None]:
    """Behaviour: ``torch._foreach_copy_(places, sources)`` copies each source into its place,
    casting (a float32 weight into a bf16 strided view), as ``routing_blocks.RouterStack.refresh``
    relies on."""
    matrix = torch.zeros(2, 4, dtype=torch.bfloat16)
    places, sources = [matrix[:, 1:3], matrix[:1, :1]], [torch.ones(2, 2), torch.full((1, 1), 2.0)]
    torch._foreach_copy_(places, sources)
    expected = torch.tensor([[2, 1, 1, 0], [0, 1, 1, 0]], dtype=torch.bfloat16)
    return [None if torch.equal(matrix, expected) else "torch._foreach_copy_ no longer copies into strided places"]


def _probe_namedtuple_fields() -> list[str | None]:
    """Presence: ``NamedTuple._asdict`` (the documented namedtuple API, ``analysis.measures``)."""
    from typing import NamedTuple

    class Pair(NamedTuple):
        first: int
        second: int

    return [None if Pair(1, 2)._asdict() == {"first": 1, "second": 2} else "NamedTuple._asdict changed"]


PRIVATE_APIS: dict[str, Callable[[], list[str | None]]] = {
    "_foreach_copy_": _probe_foreach_copy,
    "_asdict": _probe_namedtuple_fields,
    "_C": _probe_saved_tensor_hooks,
    "_autograd": _probe_saved_tensor_hooks,
    "_top_saved_tensors_default_hooks": _probe_saved_tensor_hooks,
    "_world": _probe_process_groups,
    "_get_default_group": _probe_process_groups,
    "_get_default_store": _probe_process_groups,
    "_checkpointed_forward": _probe_context_threading,
    "_checkpointed_attention_forward": _probe_attention,
    "_adjust_key_value_for_inference": _probe_decoding,
    "_MPU_PIPELINE_MODEL_PARALLEL_RANK": _probe_pipeline_rank,
    "_get_cuda_rng_state": _probe_patch_targets,
    "_set_cuda_rng_state": _probe_patch_targets,
    "_build_model_and_main_param_groups": _probe_patch_targets,
    "_set_main_param_and_optimizer_states": _probe_patch_targets,
    "_p2p_ops": _probe_patch_targets,
    "_actions": _probe_argparse,
    "_group_actions": _probe_argparse,
    "_StoreTrueAction": _probe_argparse,
    "_to_copy": _probe_copy_counting,
    "_python_dispatch": _probe_copy_counting,
}

# Probes of internal APIs without an underscore name (behaviour and signatures), then those of
# the registry above.
_PROBES: tuple[Callable[[], list[str | None]], ...] = (
    _probe_schedules,
    _probe_output_deallocation,
    _probe_pipeline_communicator,
    *dict.fromkeys(PRIVATE_APIS.values()),
)


def private_api_problems() -> list[str]:
    """One line per private/internal API (module docstring) whose signature or behaviour differs
    from what the project expects under the installed megatron-core and torch; empty when all hold."""
    return [problem for probe in _PROBES for problem in probe() if problem is not None]
