"""One manifold-constrained hyper-connection (mHC, Xie et al. 2025, arXiv:2512.24880), with the
equations, parameter names and initial values megatron-core main gives its ``HyperConnectionModule``.

For streams ``H = [h_1 .. h_n]`` (``[s, b, n, hidden]``) and one sublayer F (attention or MLP with its
own pre-norm, the LLaMA RMSNorms kept), per position:

- ``x = flatten(H)`` ``[n * hidden]``, ``r = 1 / (||x|| / sqrt(n * hidden) + eps)``;
- ``m = r * alpha (.) (W x) + b`` with ``W = mapping_proj.weight`` ``[n^2 + 2n, n * hidden]``,
  ``alpha = [alpha_pre] * n ++ [alpha_post] * n ++ [alpha_res] * n^2`` and ``b = bias`` (mHC Eq. 5);
- ``pre = sigmoid(m[:n]) + eps``, ``post = 2 sigmoid(m[n:2n])``,
  ``res = Sinkhorn(m[2n:] as [n, n])`` (doubly stochastic; Eq. 8);
- ``H' = res^T H + post (x) F(sum_i pre_i h_i)``.

``Sinkhorn`` is megatron's: a row softmax plus eps, a column normalisation, then ``iterations - 1``
row and column normalisations (each divides by the sum plus eps); backward runs it again from the
logits (``RecomputedSinkhorn``), as megatron does, instead of keeping every iteration. The mappings
are computed in at least float32 (megatron keeps them in float32) and applied in the activations'
dtype.

Initial values: ``mapping_proj`` Xavier-uniform (the module draws it from the RNG it is given;
``lime_megatron.models.initialization`` seeds that by layer and name, so it is the same at every
layout), ``alpha_*`` 0.01, ``bias`` 0. The parameters are replicated across tensor-parallel ranks
and marked ``sequence_parallel`` under sequence parallelism (their gradients are sums over the
ranks' positions); megatron's weight-decay rule applies (``mapping_proj`` decayed, the 1-D ones not).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

EPS = 1e-6
"""megatron's ``_MHC_SINKHORN_EPS`` and ``_MHC_COMPUTE_H_EPS`` (and its RMS epsilon for mHC)."""

GATING_INIT = 0.01
"""Initial ``alpha_pre``/``alpha_post``/``alpha_res`` (megatron's ``mhc_init_gating_factor``)."""


def sinkhorn(logits: torch.Tensor, iterations: int) -> torch.Tensor:
    """Sinkhorn-Knopp projection of ``logits`` ``[.., n, n]`` onto (nearly) doubly stochastic matrices."""
    matrix = logits.softmax(dim=-1) + EPS
    matrix = matrix / (matrix.sum(dim=-2, keepdim=True) + EPS)
    for _ in range(iterations - 1):
        matrix = matrix / (matrix.sum(dim=-1, keepdim=True) + EPS)
        matrix = matrix / (matrix.sum(dim=-2, keepdim=True) + EPS)
    return matrix


class RecomputedSinkhorn(torch.autograd.Function):
    """``sinkhorn`` that keeps only its logits for backward and runs the iterations again there (the
    iterations would otherwise keep two tensors each, ``[.., n, n]`` and ``[.., n]``: at n = 4 and 20
    iterations 800 floats per position, about a bf16 hidden state of the 1B model); megatron-core
    recomputes them the same way."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, iterations: int) -> torch.Tensor:
        ctx.save_for_backward(logits)
        ctx.iterations = iterations
        return sinkhorn(logits, iterations)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (logits,) = ctx.saved_tensors
        with torch.enable_grad():
            leaf = logits.detach().requires_grad_(True)
            (logits_grad,) = torch.autograd.grad(sinkhorn(leaf, ctx.iterations), leaf, grad)
        return logits_grad, None


class ManifoldHyperConnection(torch.nn.Module):
    """The manifold-constrained hyper-connection around one sublayer (same call as
    ``HyperConnection``: ``forward(streams, sublayer)``)."""

    def __init__(self, config, layer: int):
        super().__init__()
        streams, hidden = config.hyper_connections, config.hidden_size
        self.streams, self.iterations = streams, config.hyper_connections_sinkhorn_iterations
        dtype = config.params_dtype
        self.mapping_proj = torch.nn.Linear(streams * hidden, streams * streams + 2 * streams, bias=False, dtype=dtype)
        self.alpha_pre = torch.nn.Parameter(torch.empty(1, dtype=dtype))
        self.alpha_post = torch.nn.Parameter(torch.empty(1, dtype=dtype))
        self.alpha_res = torch.nn.Parameter(torch.empty(1, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.empty(streams * streams + 2 * streams, dtype=dtype))
        self.reset_parameters()
        for param in self.parameters():
            param.sequence_parallel = config.sequence_parallel

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """megatron's initial values; ``mapping_proj`` drawn in float32 (as every drawn weight here,
        so all parameter dtypes start from the same values) from the current RNG."""
        weight = self.mapping_proj.weight
        weight.copy_(torch.nn.init.xavier_uniform_(torch.empty(weight.shape, device=weight.device)))
        for alpha in (self.alpha_pre, self.alpha_post, self.alpha_res):
            alpha.fill_(GATING_INIT)
        self.bias.zero_()

    @staticmethod
    def contract(streams: torch.Tensor) -> torch.Tensor:
        """The model's single stream after the last layer: the streams' mean (megatron's
        ``output_contract``), ``[.., n, hidden]`` -> ``[.., hidden]``."""
        return streams.mean(-2)

    def mappings(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(pre ``[s, b, n]``, post ``[s, b, n]``, res ``[s, b, n, n]``) for streams ``[s, b, n, hidden]``."""
        n = self.streams
        dtype = torch.promote_types(streams.dtype, torch.float32)
        flat = streams.flatten(-2).to(dtype)
        inverse_rms = 1.0 / (flat.norm(dim=-1, keepdim=True) / math.sqrt(flat.shape[-1]) + EPS)
        gates = torch.cat([self.alpha_pre.expand(n), self.alpha_post.expand(n), self.alpha_res.expand(n * n)])
        mixes = inverse_rms * (flat @ self.mapping_proj.weight.to(dtype).t()) * gates.to(dtype) + self.bias.to(dtype)
        pre = torch.sigmoid(mixes[..., :n]) + EPS
        post = 2.0 * torch.sigmoid(mixes[..., n : 2 * n])
        res = RecomputedSinkhorn.apply(mixes[..., 2 * n :].unflatten(-1, (n, n)), self.iterations)
        return pre.to(streams.dtype), post.to(streams.dtype), res.to(streams.dtype)

    def forward(self, streams: torch.Tensor, sublayer: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """``H' = res^T H + post (x) F(pre^T H)``: streams ``[s, b, n, hidden]`` in and out; ``sublayer``
        maps ``[s, b, hidden]`` to ``[s, b, hidden]``."""
        pre, post, res = self.mappings(streams)
        output = sublayer(torch.einsum("...i,...ih->...h", pre, streams))
        mixed = torch.einsum("...ij,...ih->...jh", res, streams)
        return mixed + post.unsqueeze(-1) * output.unsqueeze(-2)
