"""An independent, deliberately plain implementation of LIMe (paper §3-4, App. D-E).

No megatron, no buffers, no custom autograd: every layer keeps a Python list of all earlier
layers' per-head keys/values and mixes them with explicit sums over (source layer, head), exactly
as Eq. 2 is written.  The weights live in ordinary per-layer dicts in their natural layout
(``wq`` [H*d, hidden], ``wk``/``wv`` [kvH*d, hidden], ...); tests copy them from the megatron
model and compare logits and gradients.

The architecture is the paper's LLaMA (Table 3): pre-norm RMSNorm, causal attention with RoPE
(rotate-half form, applied to the queries and to the *routed* keys), SwiGLU MLP, no biases, tied
input/output embeddings, GQA by sharing each kv head among H/kvH consecutive query heads.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def sources_of(layer: int, variant: str, window: int | None) -> list[int]:
    """Layers mixed by ``layer`` (App. D), written out from the paper's definitions."""
    if variant in ("full", "average", "dynamic"):
        return [j for j in range(layer + 1)]
    if variant == "last":  # the most recent min(l+1, j) buffered layers, own one included
        return [j for j in range(layer + 1) if j > layer - window]
    if variant == "first":  # the first j buffered layers plus the layer's own
        return [j for j in range(layer + 1) if j < window or j == layer]
    raise ValueError(variant)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope_tables(seq: int, head_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [seq, head_dim] of rotate-half RoPE.  Angles are computed in float32, as
    megatron computes them, so float64 comparisons are exact up to float64 rounding."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on x [b, heads, s, d]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


def heads(x: torch.Tensor, n: int) -> torch.Tensor:
    """[b, s, n*d] -> [b, n, s, d]."""
    b, s, _ = x.shape
    return x.view(b, s, n, -1).transpose(1, 2)


def route(router: torch.Tensor | None, buffer: list[torch.Tensor], srcs: list[int]) -> torch.Tensor:
    """Eq. 2: head h of the result = sum over (source j, head h') of R[h, (j, h')] * buffer[j][h'].

    buffer[j] is [b, kvH, s, d]; router [kvH, len(srcs)*kvH] (None: the identity of layer 0).
    """
    if router is None:
        return buffer[srcs[-1]]
    kv_heads = buffer[0].shape[1]
    out_heads = []
    for h in range(kv_heads):
        total = 0
        for pos, j in enumerate(srcs):
            for h_src in range(kv_heads):
                total = total + router[h, pos * kv_heads + h_src] * buffer[j][:, h_src]
        out_heads.append(total)
    return torch.stack(out_heads, dim=1)


def dynamic_route(
    router: torch.Tensor, h: torch.Tensor, buffer: list[torch.Tensor], layer: int, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Dynamic LIMe (v1): per token t and head c, weights p = softmax over sources j of
    (router @ h_t)[c * (layer+1) + j], plus the fixed offset ln(0.9 * layer / 0.1) on the own layer;
    head c of the result = sum over j of p[t, c, j] * buffer[j][:, c] at token t.

    router [kvH * (layer+1), hidden] (rows head-major), h [b, s, hidden] the normalised layer input,
    buffer[j] [b, kvH, s, d]; ``mask`` [kvH, sources] (route pruning): a False route has weight 0
    (its logit -inf)."""
    kv_heads, sources = buffer[0].shape[1], layer + 1
    logits = (h @ router.t()).view(h.shape[0], h.shape[1], kv_heads, sources)
    offset = torch.zeros(sources, dtype=logits.dtype)
    offset[layer] = math.log(0.9 * layer / 0.1)
    if mask is not None:
        logits = logits.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(logits + offset, dim=-1)  # [b, s, kvH, sources]
    out_heads = []
    for c in range(kv_heads):
        total = 0
        for j in range(sources):
            total = total + weights[:, :, c, j, None] * buffer[j][:, c]
        out_heads.append(total)
    return torch.stack(out_heads, dim=1)


def attention(q, k, v):
    """Causal softmax attention; q [b, H, s, d], k/v [b, kvH, s, d] shared by H/kvH query heads."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    s = q.shape[2]
    future = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)
    scores = scores.masked_fill(future, float("-inf"))
    return scores.softmax(-1) @ v


def forward(params: dict, tokens: torch.Tensor, spec: dict) -> torch.Tensor:
    """Logits [b, s, vocab] of LIMe (``spec['lime']``) or the LLaMA baseline.

    ``params``: ``embedding`` [V, hidden], ``final_norm`` [hidden], and ``layers``: a list of
    dicts with ``attn_norm``, ``wq``, ``wk``, ``wv``, ``wo``, ``mlp_norm``, ``w_gate``, ``w_up``,
    ``w_down`` and (LIMe, layers >= 1) ``router`` (``dynamic_router`` for the dynamic variant).
    ``spec``: heads, kv_heads, eps, rope_base, lime, variant, window.
    """
    x = params["embedding"][tokens]
    b, s, _ = x.shape
    cos, sin = rope_tables(s, x.shape[-1] // spec["heads"], spec["rope_base"])
    kv_buffer: list[tuple[torch.Tensor, torch.Tensor]] = []
    for index, layer in enumerate(params["layers"]):
        h = rms_norm(x, layer["attn_norm"], spec["eps"])
        q = heads(h @ layer["wq"].t(), spec["heads"])
        k = heads(h @ layer["wk"].t(), spec["kv_heads"])
        v = heads(h @ layer["wv"].t(), spec["kv_heads"])
        if spec["lime"]:
            kv_buffer.append((k, v))
            srcs = sources_of(index, spec["variant"], spec["window"])
            router = layer.get("router")
            if spec["variant"] == "dynamic" and index > 0:
                mask = layer.get("dynamic_mask")
                k = dynamic_route(layer["dynamic_router"], h, [kk for kk, _ in kv_buffer], index, mask)
                v = dynamic_route(layer["dynamic_router"], h, [vv for _, vv in kv_buffer], index, mask)
            else:
                k = route(router, [kk for kk, _ in kv_buffer], srcs)
                v = route(router, [vv for _, vv in kv_buffer], srcs)
        out = attention(rotate(q, cos, sin), rotate(k, cos, sin), v)
        x = x + out.transpose(1, 2).reshape(b, s, -1) @ layer["wo"].t()
        h = rms_norm(x, layer["mlp_norm"], spec["eps"])
        x = x + (F.silu(h @ layer["w_gate"].t()) * (h @ layer["w_up"].t())) @ layer["w_down"].t()
    x = rms_norm(x, params["final_norm"], spec["eps"])
    return x @ params["embedding"].t()


def average_router(layer: int, kv_heads: int) -> torch.Tensor:
    """The fixed router of the ``average`` variant: each head averages its own head over layers
    0..layer (App. D), written as an explicit matrix."""
    router = torch.zeros(kv_heads, (layer + 1) * kv_heads, dtype=torch.float64)
    for h in range(kv_heads):
        for j in range(layer + 1):
            router[h, j * kv_heads + h] = 1.0 / (layer + 1)
    return router
