"""Layout-invariant initial weights: the same model and seed start from the same weights at any
tensor/pipeline/virtual-pipeline/data-parallel layout.

Megatron-LM seeds each pipeline stage differently (``seed + 100 * pipeline rank``) and, on GPU,
draws each tensor-parallel shard from the model-parallel RNG of the tracker, so the weights of a
run depend on its layout.  ``initialize_weights`` redraws every parameter of a built chunk:

1. each parameter gets a key (seed, global layer, parameter name inside the layer), or
   (seed, ``"model"``, name) outside the decoder layers; a tied output layer on the last
   pipeline stage is keyed as the word embedding it copies;
2. the key seeds the RNG (``parameter_seed``) and the *full* single-process tensor is drawn on
   the parameter's device (CPU or GPU init alike);
3. the rank keeps its tensor-parallel shard (``local_shard``): megatron's ``partition_dim`` split,
   the gated MLP's fc1 as two blocks ``[gate; up]``, the LIMe router by input head
   (``LimeRouter._local_columns``, replicated heads when kv heads < TP).

Hyper-connection parameters take their module's own initial values in both styles
(``reset_parameters``: the official code's constants for HC, megatron's for mHC, whose
Xavier-uniform ``mapping_proj`` is drawn from the RNG seeded with its first parameter's key).

Distributions (``INIT_STYLES``):

- ``megatron`` (default): megatron's defaults, N(0, init_method_std) for every matrix, the scaled
  N(0, init_method_std / sqrt(2 L)) for the output projections ``linear_proj`` and ``linear_fc2``,
  norm scales 1, biases 0, the routers as paper App. A/E (``router.init_router_weight``), the
  dynamic router's W_l zero (``dynamic_router``).
- ``official``: the paper's released code (corl-team/lime, a Hugging Face LLaMA): unscaled
  N(0, 0.02)-style normal (init_method_std) for every linear layer including the output
  projections, and, for LIMe, Kaiming-uniform with a = sqrt(5) (bound 1 / sqrt(hidden)) for the
  key/value projection (a bare parameter there, which HF's initialiser leaves at torch's
  default); the released code also uses RMSNorm epsilon 1e-6 (``--norm-epsilon``, set with
  ``--init-style official`` in the paper's example configs).
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from collections.abc import Iterator

import torch
from megatron.core import parallel_state
from torch import nn

from lime_megatron.choices import INIT_STYLES
from lime_megatron.models.hyper_connections.connection import HyperConnection
from lime_megatron.models.hyper_connections.manifold import ManifoldHyperConnection
from lime_megatron.models.lime.router import LimeRouter, init_router_weight

HYPER_CONNECTIONS = (HyperConnection, ManifoldHyperConnection)
"""Modules that set their own initial values (``reset_parameters``), seeded by their first parameter's key."""

OUTPUT_PROJECTIONS = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight")
QKV = "self_attention.linear_qkv.weight"
GATED_FC1 = "mlp.linear_fc1.weight"
DYNAMIC_ROUTER = "self_attention.router.logits.weight"
"""W_l of the dynamic router: zero in both styles (``dynamic_router``: the own layer's weight 0.9)."""


def parameter_seed(seed: int, layer: int | str, name: str) -> int:
    """A 63-bit RNG seed for parameter ``name`` of global layer ``layer`` (or ``"model"``)."""
    digest = hashlib.sha256(f"{seed}|{layer}|{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


@contextlib.contextmanager
def seeded_rng(seed: int, device: torch.device) -> Iterator[None]:
    """Run the block with the CPU's default generator and, for a CUDA ``device``, that device's
    seeded by ``seed``; the previous RNG states are restored afterwards, so training's own random
    streams are untouched.  (Not ``torch.manual_seed``: it also queues a seed for every CUDA device,
    which, before CUDA is initialised or on a machine without it, records the Python stack each
    time: 4-5 ms per parameter on a CPU.)"""
    cuda = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):
        torch.default_generator.manual_seed(seed)
        if cuda:
            with torch.cuda.device(device):
                torch.cuda.manual_seed(seed)
        yield


def keyed_parameters(model: nn.Module) -> Iterator[tuple[int | str, str, nn.Parameter]]:
    """``(layer, name, parameter)`` of every parameter of ``model`` (one chunk): ``layer`` is the
    0-based global layer of a decoder layer's parameter (``name`` relative to that layer), else
    ``"model"`` with the chunk-level name (a tied output layer named as the word embedding)."""
    layers = {
        f"{name}.": module.layer_number - 1
        for name, module in model.named_modules()
        if isinstance(getattr(module, "layer_number", None), int) and name.rpartition(".")[2].isdigit()
    }
    tied = getattr(model, "share_embeddings_and_output_weights", False)
    for name, param in model.named_parameters():
        prefix = next((p for p in layers if name.startswith(p)), None)
        if prefix is not None:
            yield layers[prefix], name[len(prefix) :], param
        elif name == "output_layer.weight" and tied:
            yield "model", "embedding.word_embeddings.weight", param
        else:
            yield "model", name, param


def full_shape(param: nn.Parameter, router: LimeRouter | None, tp_size: int) -> tuple[int, ...]:
    """Shape of ``param`` in the single-process model."""
    if router is not None:
        return router.weight.shape[0], len(router.sources) * router.sharding.kv_heads
    shape = list(param.shape)
    if getattr(param, "tensor_model_parallel", False) and tp_size > 1:
        shape[param.partition_dim] *= tp_size
    return tuple(shape)


def local_shard(
    full: torch.Tensor,
    name: str,
    param: nn.Parameter,
    router: LimeRouter | None,
    gated: bool,
    tp_rank: int,
    tp_size: int,
) -> torch.Tensor:
    """This tensor-parallel rank's part of the full tensor ``full`` of parameter ``name``."""
    if router is not None:
        return router._local_columns(full)
    if tp_size == 1 or not getattr(param, "tensor_model_parallel", False):
        return full
    dim = param.partition_dim
    blocks = full.chunk(2, dim=dim) if gated and name.endswith(GATED_FC1) else (full,)
    return torch.cat([block.chunk(tp_size, dim=dim)[tp_rank] for block in blocks], dim=dim)


def draw_full(
    config,
    layer: int | str,
    name: str,
    shape: tuple[int, ...],
    router: LimeRouter | None,
    style: str,
    device: torch.device,
) -> torch.Tensor:
    """The full float32 initial tensor of one parameter (drawn from the already seeded RNG)."""
    tensor = torch.empty(shape, dtype=torch.float32, device=device)
    if router is not None:
        return init_router_weight(tensor, router.sharding.kv_heads)
    if name.endswith(DYNAMIC_ROUTER):
        return tensor.zero_()
    if tensor.dim() == 1:
        return tensor.zero_() if name.endswith("bias") else tensor.fill_(1.0)
    if layer == "model" and name.startswith("embedding."):
        (getattr(config, "embedding_init_method", None) or config.init_method)(tensor)
    elif name.endswith(OUTPUT_PROJECTIONS) and style == "megatron":
        config.output_layer_init_method(tensor)
    else:
        config.init_method(tensor)
    if style == "official" and config.lime and name.endswith(QKV):
        _kaiming_uniform_key_values(tensor, config)
    return tensor


def _kaiming_uniform_key_values(qkv: torch.Tensor, config) -> None:
    """Redraw the key/value rows of megatron's fused QKV weight ``[(heads + 2 kv) d, hidden]``
    (rows grouped per query group: the group's queries, then its key, then its value) as torch's
    ``nn.Linear`` default, Kaiming-uniform a = sqrt(5), i.e. U(-1/sqrt(hidden), 1/sqrt(hidden))."""
    kv_heads = config.num_query_groups or config.num_attention_heads
    grouped = qkv.view(kv_heads, -1, qkv.shape[1])
    head_dim = config.kv_channels or config.hidden_size // config.num_attention_heads
    bound = 1.0 / math.sqrt(qkv.shape[1])
    grouped[:, -2 * head_dim :].uniform_(-bound, bound)


def initialize_weights(model: nn.Module, seed: int, style: str = "megatron") -> None:
    """Redraw every parameter of ``model`` (one chunk, built but not yet wrapped) from its key:
    the same ``seed`` gives the same full weights at any layout (see the module docstring)."""
    if style not in INIT_STYLES:
        raise ValueError(f"unknown init style {style!r}; choose one of {INIT_STYLES}")
    config = model.config
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    routers = {
        id(module.weight): module for module in model.modules() if isinstance(module, LimeRouter) and module.learned
    }
    keyed = list(keyed_parameters(model))
    keys = {id(param): (layer, name) for layer, name, param in keyed}
    connections = [module for module in model.modules() if isinstance(module, HYPER_CONNECTIONS)]
    own = {id(param) for module in connections for param in module.parameters()}
    with torch.no_grad():
        for module in connections:
            first = next(module.parameters())
            with seeded_rng(parameter_seed(seed, *keys[id(first)]), first.device):
                module.reset_parameters()
        for layer, name, param in keyed:
            if id(param) in own:
                continue
            router = routers.get(id(param))
            with seeded_rng(parameter_seed(seed, layer, name), param.device):
                full = draw_full(config, layer, name, full_shape(param, router, tp_size), router, style, param.device)
            param.copy_(local_shard(full, name, param, router, config.gated_linear_unit, tp_rank, tp_size))
