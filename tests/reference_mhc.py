"""An independent float64 reference of manifold-constrained Hyper-Connections (mHC, Xie et al. 2025)
as megatron-core main defines them (``transformer/hyper_connection.py``), written from the equations
in the reference's own layout: streams ``[b, l, n, d]`` (batch, positions, streams).

Per sublayer F (the LLaMA pre-norm attention or SwiGLU MLP, RMSNorms kept), for each position:
``x = vec(H)`` (n d), ``m = alpha (.) (W x) / (rms(x) + 1e-6) + b``, ``pre = sigmoid(m_pre) + 1e-6``,
``post = 2 sigmoid(m_post)``, ``R = Sinkhorn(m_res)`` (n x n); ``H' = R^T H + post F(pre^T H)``. The
first layer repeats the embedding into n streams; the streams' mean enters the final RMSNorm.
"""

from __future__ import annotations

import torch

from tests.reference_hc import self_attention, swiglu
from tests.reference_lime import rms_norm, rope_tables

EPS = 1e-6


def sinkhorn(logits: torch.Tensor, iterations: int) -> torch.Tensor:
    """megatron's Sinkhorn-Knopp, written as exp-normalised rows followed by alternating
    column/row rescalings of a [.., n, n] matrix."""
    exp = torch.exp(logits - logits.amax(-1, keepdim=True))
    matrix = exp / exp.sum(-1, keepdim=True) + EPS
    for step in range(2 * iterations - 1):
        axis = -2 if step % 2 == 0 else -1
        matrix = matrix / (matrix.sum(axis, keepdim=True) + EPS)
    return matrix


def mappings(hc: dict, h: torch.Tensor, iterations: int):
    """(pre [b, l, n], post [b, l, n], R [b, l, n, n]) of streams h [b, l, n, d]."""
    n = h.shape[-2]
    x = h.reshape(*h.shape[:-2], -1)
    rms = torch.sqrt((x * x).mean(-1, keepdim=True))
    projected = torch.einsum("blk,ok->blo", x, hc["mapping_proj.weight"]) / (rms + EPS)
    pre_logits = projected[..., :n] * hc["alpha_pre"] + hc["bias"][:n]
    post_logits = projected[..., n : 2 * n] * hc["alpha_post"] + hc["bias"][n : 2 * n]
    res_logits = projected[..., 2 * n :] * hc["alpha_res"] + hc["bias"][2 * n :]
    pre = 1 / (1 + torch.exp(-pre_logits)) + EPS
    post = 2 / (1 + torch.exp(-post_logits))
    return pre, post, sinkhorn(res_logits.reshape(*res_logits.shape[:-1], n, n), iterations)


def connect(hc: dict, h: torch.Tensor, sublayer, iterations: int) -> torch.Tensor:
    """One mHC step around ``sublayer`` ([b, l, d] -> [b, l, d]) on streams h [b, l, n, d]."""
    pre, post, res = mappings(hc, h, iterations)
    out = sublayer((pre.unsqueeze(-1) * h).sum(-2))
    return res.transpose(-1, -2) @ h + post.unsqueeze(-1) * out.unsqueeze(-2)


def forward(params: dict, tokens: torch.Tensor, spec: dict) -> torch.Tensor:
    """Logits [b, s, vocab]: ``params`` as ``reference_lime.forward``'s plus per layer ``hc_attn``
    and ``hc_mlp`` (dicts of megatron's mHC parameter names); ``spec`` adds ``hyper_connections``
    (n) and ``sinkhorn_iterations``."""
    x = params["embedding"][tokens]
    b, s, d = x.shape
    cos, sin = rope_tables(s, d // spec["heads"], spec["rope_base"])
    h = torch.stack([x] * spec["hyper_connections"], dim=-2)
    iterations, eps = spec["sinkhorn_iterations"], spec["eps"]
    for layer in params["layers"]:
        h = connect(
            layer["hc_attn"],
            h,
            lambda y, layer=layer: self_attention(layer, rms_norm(y, layer["attn_norm"], eps), spec, cos, sin),
            iterations,
        )
        h = connect(
            layer["hc_mlp"], h, lambda y, layer=layer: swiglu(layer, rms_norm(y, layer["mlp_norm"], eps)), iterations
        )
    return rms_norm(h.mean(-2), params["final_norm"], eps) @ params["embedding"].t()
