"""An independent float64 reference of the paper's Hyper-Connections baseline, written from the
official code (corl-team/lime ``src/lm/hc.py``: ``HyperConnection``, ``LlamaHCDecoderLayer``,
``LlamaHCModel``) in its own layout: hidden states ``[b, l, n, d]`` (batch, positions, streams).

- the first layer expands the embedding into n equal streams;
- per sublayer: ``width_connection`` (alpha, beta; ``mix_h = alpha^T h``), the sublayer on
  ``LayerNorm(mix_h[..., 0, :])`` (no affine parameters, eps 1e-5: ``nn.LayerNorm``'s default;
  the LLaMA RMSNorms are deleted), ``depth_connection`` (``beta * out + mix_h[..., 1:, :]``);
- the streams are summed before the LLaMA final RMSNorm, tied output embedding.

The LLaMA attention and MLP are ``reference_lime``'s (RoPE rotate-half, GQA, SwiGLU).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tests.reference_lime import attention, heads, rms_norm, rope_tables, rotate

LAYER_NORM_EPS = 1e-5


def layer_norm(x: torch.Tensor) -> torch.Tensor:
    """``nn.LayerNorm(d, elementwise_affine=False)`` written out: biased variance, eps 1e-5."""
    mean = x.mean(-1, keepdim=True)
    variance = (x - mean).pow(2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(variance + LAYER_NORM_EPS)


def width_connection(hc: dict, h: torch.Tensor, dynamic: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Official ``HyperConnection.width_connection``: (mix_h [b, l, n+1, d], beta [b, l, n])."""
    if dynamic:
        norm_h = layer_norm(h)
        wc_weight = torch.tanh(norm_h @ hc["dynamic_alpha_fn"])
        alpha = wc_weight * hc["dynamic_alpha_scale"] + hc["static_alpha"][None, None, ...]
        dc_weight = torch.tanh((norm_h @ hc["dynamic_beta_fn"].unsqueeze(-1)).squeeze(-1))
        beta = dc_weight * hc["dynamic_beta_scale"] + hc["static_beta"][None, None, ...]
    else:
        alpha = hc["static_alpha"][None, None, ...]
        beta = hc["static_beta"][None, None, ...]
    return alpha.transpose(-1, -2) @ h, beta


def depth_connection(mix_h: torch.Tensor, h_o: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """Official ``HyperConnection.depth_connection``: streams [b, l, n, d]."""
    return torch.einsum("blh,bln->blnh", h_o, beta) + mix_h[..., 1:, :]


def self_attention(layer: dict, x: torch.Tensor, spec: dict, cos, sin) -> torch.Tensor:
    """LLaMA attention of x [b, l, d] (no norm: the caller normalises)."""
    b, s, _ = x.shape
    q = heads(x @ layer["wq"].t(), spec["heads"])
    k = heads(x @ layer["wk"].t(), spec["kv_heads"])
    v = heads(x @ layer["wv"].t(), spec["kv_heads"])
    out = attention(rotate(q, cos, sin), rotate(k, cos, sin), v)
    return out.transpose(1, 2).reshape(b, s, -1) @ layer["wo"].t()


def swiglu(layer: dict, x: torch.Tensor) -> torch.Tensor:
    return (F.silu(x @ layer["w_gate"].t()) * (x @ layer["w_up"].t())) @ layer["w_down"].t()


def forward(params: dict, tokens: torch.Tensor, spec: dict) -> torch.Tensor:
    """Logits [b, s, vocab] of the official HC model. ``params`` as ``reference_lime.forward``'s
    (no per-layer norms) plus per layer ``hc_attn`` and ``hc_mlp``: dicts of the official parameter
    names; ``spec`` adds ``hyper_connections`` (n) and ``dynamic``."""
    x = params["embedding"][tokens]
    b, s, d = x.shape
    cos, sin = rope_tables(s, d // spec["heads"], spec["rope_base"])
    h = x.unsqueeze(-2).expand(-1, -1, spec["hyper_connections"], -1)
    for layer in params["layers"]:
        mix_h, beta = width_connection(layer["hc_attn"], h, spec["dynamic"])
        out = self_attention(layer, layer_norm(mix_h[..., 0, :]), spec, cos, sin)
        h = depth_connection(mix_h, out, beta)
        mix_h, beta = width_connection(layer["hc_mlp"], h, spec["dynamic"])
        h = depth_connection(mix_h, swiglu(layer, layer_norm(mix_h[..., 0, :])), beta)
    return rms_norm(h.sum(-2), params["final_norm"], spec["eps"]) @ params["embedding"].t()
