"""Tensor names and layouts of the Hugging Face models, and the map to and from megatron's.

Four Hugging Face layouts are written and read:

- the LLaMA baseline as transformers' ``LlamaForCausalLM`` (``model.layers.{i}.self_attn.q_proj``
  ... ``lm_head``);
- LIMe as the paper's official implementation (github.com/corl-team/lime, ``src/lm/lime.py``,
  ``LIMeForCausalLM``): ``LlamaForCausalLM`` with ``k_proj``/``v_proj`` replaced by one
  ``self_attn.kv_proj_weight`` and a router ``self_attn.lime_router.static_weights`` per layer >= 1;
- dynamic LIMe (v1's router, ``models.lime.dynamic_router``; the official code has none) as
  ``DynamicLIMeForCausalLM``: the LIMe layout with ``self_attn.lime_router.dynamic_weights`` per
  layer >= 1 instead of ``static_weights`` (a name the official class does not load, so it cannot
  be mistaken for the static router);
- Hyper-Connections as the official ``LlamaHCForCausalLM`` (``src/lm/hc.py``): ``LlamaForCausalLM``
  without the layers' two RMSNorms (its ``attn_norm``/``mlp_norm`` are LayerNorms without
  parameters) and with ``hc_attn.*``/``hc_mlp.*`` per layer, the same names and shapes as
  megatron's ``HyperConnection`` parameters (``static_alpha`` [n, n+1], ``static_beta`` [n]; dynamic:
  ``dynamic_alpha_fn`` [h, n+1], ``dynamic_alpha_scale`` [1], ``dynamic_beta_fn`` [h],
  ``dynamic_beta_scale`` [1]), copied as they are.

Megatron's tensors (single-process model, ``LimeGPTModel.state_dict()``) and how they map:

==========================================  ====================================================
megatron                                    Hugging Face
==========================================  ====================================================
embedding.word_embeddings.weight [V, h]     model.embed_tokens.weight (V = the padded vocabulary)
output_layer.weight [V, h] (untied only)    lm_head.weight (absent when tie_word_embeddings)
decoder.final_layernorm.weight              model.norm.weight
layers.i.input_layernorm.weight             layers.i.input_layernorm.weight
layers.i.pre_mlp_layernorm.weight           layers.i.post_attention_layernorm.weight
layers.i.self_attention.linear_qkv.weight   q_proj [H d, h] + k_proj, v_proj [G d, h] (LLaMA) or
  [G (H/G + 2) d, h], rows per query group  q_proj + kv_proj_weight [2 d G, h] (LIMe, see below)
  g: [q heads of g; k_g; v_g]
layers.i.self_attention.linear_proj.weight  layers.i.self_attn.o_proj.weight
layers.i.mlp.linear_fc1.weight [2 f, h]     gate_proj [f, h] (first half) + up_proj (second half)
layers.i.mlp.linear_fc2.weight              layers.i.mlp.down_proj.weight
layers.i.self_attention.router.weight       layers.i.self_attn.lime_router.static_weights
  [G, n_sources G]                            [G, (i + 1) G]
layers.i.self_attention.router.logits.weight  layers.i.self_attn.lime_router.dynamic_weights
  [G (i + 1), h], row g (i + 1) + j           [(i + 1) G, h], row j G + g (dynamic LIMe)
layers.i.self_attention.router.route_mask   layers.i.self_attn.lime_router.route_mask (pruning
  (bool, runs with --lime-prune-top-p)        runs only): static full-width [G, (i + 1) G] like
                                              static_weights; dynamic [G, i + 1]
layers.i.hc_attn.*, layers.i.hc_mlp.*       the same names (Hyper-Connections; no layer norms)
==========================================  ====================================================

(H query heads, G key/value heads, d head dim, h hidden, f ffn.)  Query head ``n`` uses key/value
head ``n // (H/G)`` in both.  RoPE is the rotate-half form in both (megatron's
``rotary_interleaved=False`` and transformers' ``rotate_half``), so no row permutation is needed.

The official K/V projection.  Its output features are ordered ``(c, g)`` with c the 2d key-then-
value channels and g the head (``rearrange(kv, "(bt) (kv h) -> h (bt kv)")``): row ``c G + g``
holds key channel c (c < d) or value channel c - d of head g.

The official router.  Row g, column ``j G + g'`` weighs head g' of layer j, layers 0..i ascending
with the own layer last: megatron's column order for the ``full`` router (sources 0..i).  The other
router variants (App. D) are written in the same full shape with exact zeros on the layers they do
not read (``last``/``first``) or as the fixed per-head average (``average``), so the official code
computes the same forward for every variant; reading back checks those entries.

The dynamic router.  Row ``j G + g`` of ``dynamic_weights`` gives head g's logit for source
layer j (the static router's column order), so for a token's normalised attention input x (the
input RMSNorm's output) the weights are p[g, :] = softmax_j(dynamic_weights[j G + g] . x +
tau_i [j = i]) with the fixed own-layer offset tau_i = ln(w i / (1 - w)), w =
``config.json["lime_megatron"]["lime_dynamic_own_weight"]`` (0.9); a masked route (``route_mask``
False) has logit -inf.  Head g of layer i attends with sum_j p[g, j] (K, V of head g of layer j).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from lime_megatron.models.lime.router import fixed_routing_weight, routing_sources

Tensors = tuple[torch.Tensor, ...]

LLAMA_ARCHITECTURE = "LlamaForCausalLM"
LIME_ARCHITECTURE = "LIMeForCausalLM"
DYNAMIC_LIME_ARCHITECTURE = "DynamicLIMeForCausalLM"
HC_ARCHITECTURE = "LlamaHCForCausalLM"
HYPER_CONNECTION_TENSORS = {
    "static": ("static_alpha", "static_beta"),
    "dynamic": ("dynamic_alpha_fn", "dynamic_alpha_scale", "dynamic_beta_fn", "dynamic_beta_scale"),
}
"""The official names of a hyper-connection's tensors (megatron's are the same), by variant."""


class LayoutError(ValueError):
    """A Hugging Face tensor that does not fit the model it is read into (the message names it)."""


@dataclass(frozen=True)
class ModelShape:
    """What fixes the tensor names and shapes of a model in both layouts."""

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    kv_heads: int
    head_dim: int
    vocab_size: int
    """Rows of the embedding: the padded vocabulary."""
    tied: bool
    lime: bool
    router: str | None = None
    router_window: int | None = None
    hyper_connections: int = 0
    """Residual streams n of Hyper-Connections (0: not a Hyper-Connections model)."""
    hyper_connections_static: bool = False
    prune_top_p: float | None = None
    """A route-pruning run's top-p (``--lime-prune-top-p``): its route masks are written too."""

    @classmethod
    def of_model(cls, model) -> ModelShape:
        """The shape of a single-process ``LimeGPTModel``."""
        config = model.config
        return cls(
            config.num_layers,
            config.hidden_size,
            config.ffn_hidden_size,
            config.num_attention_heads,
            config.kv_heads,
            config.kv_channels,
            model.vocab_size,
            model.share_embeddings_and_output_weights,
            config.lime,
            config.lime_router if config.lime else None,
            config.lime_router_window if config.lime else None,
            config.hyper_connections,
            config.hyper_connections_static,
            config.lime_prune_top_p if config.lime else None,
        )

    @property
    def architecture(self) -> str:
        """The Hugging Face class of the layout (config.json's ``architectures``)."""
        if self.lime:
            return DYNAMIC_LIME_ARCHITECTURE if self.dynamic_router else LIME_ARCHITECTURE
        return HC_ARCHITECTURE if self.hyper_connections else LLAMA_ARCHITECTURE

    @property
    def dynamic_router(self) -> bool:
        return self.lime and self.router == "dynamic"

    def sources(self, layer: int) -> list[int]:
        """Layers the router of ``layer`` reads (megatron's column blocks, ascending)."""
        return routing_sources(layer, self.router, self.router_window)

    @property
    def learned_router(self) -> bool:
        return self.lime and self.router != "average"


@dataclass(frozen=True)
class TensorMap:
    """One megatron tensor and the Hugging Face tensor(s) it is written as."""

    megatron: str
    hf: tuple[str, ...]
    to_hf: Callable[[torch.Tensor], Tensors]
    from_hf: Callable[[Tensors], torch.Tensor]


def _same(tensor: torch.Tensor) -> Tensors:
    return (tensor,)


def _only(tensors: Tensors) -> torch.Tensor:
    return tensors[0]


def _one_to_one(megatron: str, hf: str) -> TensorMap:
    return TensorMap(megatron, (hf,), _same, _only)


def _split_qkv(shape: ModelShape, weight: torch.Tensor) -> Tensors:
    """megatron's fused QKV ``[G (H/G + 2) d, h]`` -> query ``[H d, h]``, keys, values ``[G d, h]``."""
    groups, d = shape.kv_heads, shape.head_dim
    grouped = weight.view(groups, shape.num_attention_heads // groups + 2, d, weight.shape[-1])
    query = grouped[:, :-2].reshape(-1, weight.shape[-1])
    return query, grouped[:, -2].reshape(-1, weight.shape[-1]), grouped[:, -1].reshape(-1, weight.shape[-1])


def _join_qkv(shape: ModelShape, tensors: Tensors) -> torch.Tensor:
    """Inverse of :func:`_split_qkv`."""
    query, key, value = tensors
    groups, d, hidden = shape.kv_heads, shape.head_dim, query.shape[-1]
    per_group = shape.num_attention_heads // groups
    parts = (
        query.reshape(groups, per_group, d, hidden),
        key.reshape(groups, 1, d, hidden),
        value.reshape(groups, 1, d, hidden),
    )
    return torch.cat(parts, dim=1).reshape(-1, hidden)


def _interleave_kv(shape: ModelShape, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """Keys and values ``[G d, h]`` -> the official ``kv_proj_weight`` ``[2 d G, h]`` (row c G + g)."""
    groups, d, hidden = shape.kv_heads, shape.head_dim, key.shape[-1]
    per_head = torch.cat([key.view(groups, d, hidden), value.view(groups, d, hidden)], dim=1)  # [G, 2d, h]
    return per_head.transpose(0, 1).reshape(2 * d * groups, hidden)


def _deinterleave_kv(shape: ModelShape, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`_interleave_kv`: ``(keys, values)``, each ``[G d, h]``."""
    groups, d, hidden = shape.kv_heads, shape.head_dim, weight.shape[-1]
    per_head = weight.view(2 * d, groups, hidden).transpose(0, 1)  # [G, 2d, h]
    return per_head[:, :d].reshape(-1, hidden), per_head[:, d:].reshape(-1, hidden)


def _qkv_map(shape: ModelShape, layer: int) -> TensorMap:
    megatron = f"decoder.layers.{layer}.self_attention.linear_qkv.weight"
    attn = f"model.layers.{layer}.self_attn."
    if not shape.lime:
        return TensorMap(
            megatron,
            (attn + "q_proj.weight", attn + "k_proj.weight", attn + "v_proj.weight"),
            lambda weight: _split_qkv(shape, weight),
            lambda tensors: _join_qkv(shape, tensors),
        )

    def to_hf(weight: torch.Tensor) -> Tensors:
        query, key, value = _split_qkv(shape, weight)
        return query, _interleave_kv(shape, key, value)

    def from_hf(tensors: Tensors) -> torch.Tensor:
        return _join_qkv(shape, (tensors[0], *_deinterleave_kv(shape, tensors[1])))

    return TensorMap(megatron, (attn + "q_proj.weight", attn + "kv_proj_weight"), to_hf, from_hf)


def _fc1_map(layer: int) -> TensorMap:
    mlp = f"model.layers.{layer}.mlp."
    return TensorMap(
        f"decoder.layers.{layer}.mlp.linear_fc1.weight",
        (mlp + "gate_proj.weight", mlp + "up_proj.weight"),
        lambda weight: tuple(weight.chunk(2, dim=0)),
        lambda tensors: torch.cat(tensors, dim=0),
    )


def router_name(layer: int, tensor: str = "static_weights") -> str:
    """The official name of layer ``layer``'s router weights (or ``tensor`` of its router)."""
    return f"model.layers.{layer}.self_attn.lime_router.{tensor}"


def _router_map(shape: ModelShape, layer: int, tensor: str = "weight") -> TensorMap:
    """megatron's static router ``tensor`` (``weight`` or ``route_mask``) ``[G, n_sources G]``
    <-> the official full-width ``[G, (layer + 1) G]`` (zeros, or False, on unread layers)."""
    groups, sources = shape.kv_heads, shape.sources(layer)
    name = router_name(layer, "static_weights" if tensor == "weight" else tensor)

    def to_hf(weight: torch.Tensor) -> Tensors:
        full = weight.new_zeros(groups, (layer + 1) * groups)
        for j, source in enumerate(sources):
            full[:, source * groups : (source + 1) * groups] = weight[:, j * groups : (j + 1) * groups]
        return (full,)

    def from_hf(tensors: Tensors) -> torch.Tensor:
        full = tensors[0].view(groups, layer + 1, groups)
        unread = [source for source in range(layer + 1) if source not in sources]
        if unread and full[:, unread].count_nonzero() > 0:
            raise LayoutError(
                f"{name}: non-zero weights on layers {unread}, which the '{shape.router}' router "
                f"(window {shape.router_window}) of layer {layer} does not read"
            )
        return full[:, sources].reshape(groups, -1)

    return TensorMap(f"decoder.layers.{layer}.self_attention.router.{tensor}", (name,), to_hf, from_hf)


def _dynamic_router_map(layer: int, kv_heads: int) -> TensorMap:
    """megatron's W_l ``[G (l+1), h]`` (row g (l+1) + j) <-> ``dynamic_weights`` ``[(l+1) G, h]``
    (row j G + g)."""

    def regroup(weight: torch.Tensor, rows: int, columns: int) -> torch.Tensor:
        return weight.view(rows, columns, -1).transpose(0, 1).reshape(rows * columns, -1)

    return TensorMap(
        f"decoder.layers.{layer}.self_attention.router.logits.weight",
        (router_name(layer, "dynamic_weights"),),
        lambda weight: (regroup(weight, kv_heads, layer + 1),),
        lambda tensors: regroup(tensors[0], layer + 1, kv_heads),
    )


def _router_maps(shape: ModelShape, layer: int) -> list[TensorMap]:
    """Layer ``layer``'s learned router weights and, in a pruning run, its route mask."""
    if not shape.learned_router or layer == 0:
        return []
    if shape.dynamic_router:
        maps = [_dynamic_router_map(layer, shape.kv_heads)]
        mask = _one_to_one(f"decoder.layers.{layer}.self_attention.router.route_mask", router_name(layer, "route_mask"))
    else:
        maps, mask = [_router_map(shape, layer)], _router_map(shape, layer, "route_mask")
    return maps + [mask] * (shape.prune_top_p is not None)


def _layer_norm_maps(shape: ModelShape, layer: int) -> list[TensorMap]:
    """The layer's two RMSNorm weights (none with Hyper-Connections: parameter-free LayerNorms)."""
    if shape.hyper_connections:
        return []
    megatron, hf = f"decoder.layers.{layer}.", f"model.layers.{layer}."
    return [
        _one_to_one(megatron + "input_layernorm.weight", hf + "input_layernorm.weight"),
        _one_to_one(megatron + "pre_mlp_layernorm.weight", hf + "post_attention_layernorm.weight"),
    ]


def _hyper_connection_maps(shape: ModelShape, layer: int) -> list[TensorMap]:
    """The layer's ``hc_attn``/``hc_mlp`` tensors, same names on both sides (none without HC)."""
    if not shape.hyper_connections:
        return []
    names = HYPER_CONNECTION_TENSORS["static"]
    if not shape.hyper_connections_static:
        names += HYPER_CONNECTION_TENSORS["dynamic"]
    return [
        _one_to_one(f"decoder.layers.{layer}.{module}.{name}", f"model.layers.{layer}.{module}.{name}")
        for module in ("hc_attn", "hc_mlp")
        for name in names
    ]


def tensor_maps(shape: ModelShape) -> list[TensorMap]:
    """Every megatron tensor of a model of ``shape`` with its Hugging Face name(s), in order."""
    maps = [_one_to_one("embedding.word_embeddings.weight", "model.embed_tokens.weight")]
    for layer in range(shape.num_layers):
        megatron, hf = f"decoder.layers.{layer}.", f"model.layers.{layer}."
        maps += (
            _layer_norm_maps(shape, layer)
            + _hyper_connection_maps(shape, layer)
            + [
                _qkv_map(shape, layer),
                _one_to_one(megatron + "self_attention.linear_proj.weight", hf + "self_attn.o_proj.weight"),
                _fc1_map(layer),
                _one_to_one(megatron + "mlp.linear_fc2.weight", hf + "mlp.down_proj.weight"),
            ]
            + _router_maps(shape, layer)
        )
    maps.append(_one_to_one("decoder.final_layernorm.weight", "model.norm.weight"))
    if not shape.tied:
        maps.append(_one_to_one("output_layer.weight", "lm_head.weight"))
    return maps


def fixed_tensors(shape: ModelShape, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Hugging Face tensors with no megatron parameter behind them: the ``average`` router's
    fixed weights, written for the official code (``[G, (l + 1) G]``, 1/(l+1) on the same head)."""
    if not shape.lime or shape.learned_router:
        return {}
    return {
        router_name(layer): fixed_routing_weight(layer + 1, shape.kv_heads, "average", dtype)
        for layer in range(1, shape.num_layers)
    }


def to_hf_tensors(state: dict[str, torch.Tensor], shape: ModelShape) -> dict[str, torch.Tensor]:
    """The Hugging Face tensors (contiguous) of a megatron ``state`` dict of a model of ``shape``."""
    out: dict[str, torch.Tensor] = {}
    for tensor_map in tensor_maps(shape):
        for name, tensor in zip(tensor_map.hf, tensor_map.to_hf(state[tensor_map.megatron])):
            out[name] = tensor.contiguous()
    out.update(fixed_tensors(shape, state["embedding.word_embeddings.weight"].dtype))
    return out


def hf_shapes(state: dict[str, torch.Tensor], shape: ModelShape) -> dict[str, torch.Size]:
    """The shape every Hugging Face tensor must have to be read into the megatron ``state``."""
    meta = {
        name: torch.empty(tensor.shape, device="meta", dtype=tensor.dtype)
        for name, tensor in state.items()
        if isinstance(tensor, torch.Tensor)
    }
    return {name: tensor.shape for name, tensor in to_hf_tensors(meta, shape).items()}


def from_hf_tensors(
    tensors: dict[str, torch.Tensor], state: dict[str, torch.Tensor], shape: ModelShape
) -> dict[str, torch.Tensor]:
    """The megatron tensors of ``state``'s names from Hugging Face ``tensors``.

    Raises one ``LayoutError`` naming the first missing, unexpected or mis-shaped tensor, or a
    fixed/zero router entry that does not hold what the router variant allows."""
    expected = hf_shapes(state, shape)
    tensors = dict(tensors)
    if shape.tied and "lm_head.weight" in tensors:  # some writers store the tied copy too
        if not torch.equal(tensors.pop("lm_head.weight"), tensors.get("model.embed_tokens.weight")):
            raise LayoutError(
                "lm_head.weight differs from model.embed_tokens.weight, but the config "
                "ties them (tie_word_embeddings): set tie_word_embeddings false"
            )
    for name, size in expected.items():
        if name not in tensors:
            raise LayoutError(f"missing tensor {name} (expected shape {list(size)})")
        if tensors[name].shape != size:
            raise LayoutError(f"tensor {name} has shape {list(tensors[name].shape)}, the config implies {list(size)}")
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        raise LayoutError(
            f"unexpected tensor {unexpected[0]} ({len(unexpected)} in all) for this {shape.architecture} config"
        )
    for name, fixed in fixed_tensors(shape, tensors["model.embed_tokens.weight"].dtype).items():
        if not torch.equal(tensors[name], fixed):
            raise LayoutError(f"{name} is not the fixed uniform average of the '{shape.router}' router")
    return {
        tensor_map.megatron: tensor_map.from_hf(tuple(tensors[name] for name in tensor_map.hf))
        for tensor_map in tensor_maps(shape)
    }
