"""FLOP formulas of LIMe and the LLaMA baseline: per layer, router, model chunk, model and
training iteration (the one home of FLOP counting: ``estimate`` and ``metrics`` call it).

The project's convention, used by the dry run, TFLOP/s and MFU: only matrix products are
counted, a multiply-add counts 2 FLOPs, and causal attention counts half of its two s x s
products (the useful triangle; s^2/2 per head, the diagonal is not added).  Norms, softmax,
RoPE and element-wise work are left out, as in the usual 6*N*T accounting.  With a the query
heads, g the kv heads, d the head dim, h hidden, f the FFN size, V the vocabulary and s the
sequence, one token costs in forward:

- per layer: QKV 2h(a + 2g)d, output projection 2adh, MLP 2*3hf (SwiGLU; 2*2hf without gate),
  causal attention 2 * 2sad / 2;
- LIMe router of layer l >= 1 (paper Eq. 2, keys and values): 2 * 2 g^2 d * |sources(l)|
  (``router.router_source_count``); the dynamic router 2 * 2gd + 2hg per source (mixing and logits);
- logits: 2hV;
- Hyper-Connections with n streams, per sublayer (two per layer): the mixing ``alpha^T H``
  2(n+1)nh and, dynamic, the projections of the normed streams onto alpha and beta 2nh(n+2)
  (``hyper_connection_flops_per_token``); mHC per sublayer: the mapping projection of the
  flattened streams 2nh(n^2 + 2n), the aggregation 2nh and the residual mixing 2n^2 h.

A training iteration counts 3x forward (recomputation not counted).

``paper_table_8_forward_flops`` counts instead as the paper's Table 8 did (see its docstring and
docs/estimate.md, "FLOPs and the paper's Table 8").
"""

from __future__ import annotations

from lime_megatron.models.config import LimeTransformerConfig
from lime_megatron.models.lime.router import router_source_count


def router_flops_per_token(config: LimeTransformerConfig, layers: range | None = None) -> float:
    """Forward FLOPs per token of the routers of ``layers`` (default all): Eq. 2 mixes, for keys
    and values, g source heads into g heads per source layer, per head-dim element.  The dynamic
    router mixes one head per head (2 * 2gd per source) and computes its logits (2hg per source)."""
    sources = router_source_count(config, layers)
    if config.lime_router == "dynamic":
        return (2.0 * 2.0 * config.kv_heads * config.kv_channels + 2.0 * config.hidden_size * config.kv_heads) * sources
    return 2.0 * 2.0 * config.kv_heads**2 * config.kv_channels * sources


def layer_flops_per_token(config: LimeTransformerConfig, seq_len: int) -> float:
    """Forward FLOPs per token of one transformer layer without its router or hyper-connections."""
    d = config.hidden_size
    q_width = config.num_attention_heads * config.kv_channels
    kv_width = config.kv_heads * config.kv_channels
    mlp_matrices = 3 if config.gated_linear_unit else 2
    projections = 2.0 * d * (q_width + 2 * kv_width) + 2.0 * q_width * d
    mlp = 2.0 * mlp_matrices * d * config.ffn_hidden_size
    causal_attention = 2.0 * 2.0 * seq_len * q_width / 2
    return projections + mlp + causal_attention


def hyper_connection_flops_per_token(config: LimeTransformerConfig) -> float:
    """Forward FLOPs per token of one layer's two hyper-connections (0 without them)."""
    n, h = config.hyper_connections, config.hidden_size
    if config.hyper_connections_manifold:  # needs n >= 1 (validated)
        return 2 * (2.0 * n * h * (n * n + 2 * n) + 2.0 * n * h + 2.0 * n * n * h)
    dynamic = 0.0 if config.hyper_connections_static else 2.0 * n * h * (n + 2)
    return 2 * (2.0 * (n + 1) * n * h + dynamic) if n else 0.0


def logits_flops_per_token(config: LimeTransformerConfig, vocab_size: int) -> float:
    """Forward FLOPs per token of the output layer."""
    return 2.0 * config.hidden_size * vocab_size


def chunk_forward_flops_per_token(
    config: LimeTransformerConfig, layers: range, seq_len: int, vocab_size: int, post_process: bool
) -> float:
    """Forward FLOPs per token of a model chunk: its layers, their routers and, on the chunk
    holding the output layer (``post_process``), the logits."""
    per_layer = layer_flops_per_token(config, seq_len) + hyper_connection_flops_per_token(config)
    flops = len(layers) * per_layer + router_flops_per_token(config, layers)
    return flops + (logits_flops_per_token(config, vocab_size) if post_process else 0.0)


def forward_flops_per_token(config: LimeTransformerConfig, seq_len: int, vocab_size: int) -> float:
    """Forward FLOPs per token of the whole model, routers included."""
    return chunk_forward_flops_per_token(config, range(config.num_layers), seq_len, vocab_size, True)


def training_flops_per_iteration(config: LimeTransformerConfig, seq_len: int, vocab_size: int, sequences: int) -> float:
    """Model FLOPs of one training iteration over ``sequences`` sequences (the global batch):
    3x forward (forward and backward), recomputation not counted."""
    return 3.0 * forward_flops_per_token(config, seq_len, vocab_size) * seq_len * sequences


def paper_table_8_forward_flops(config: LimeTransformerConfig, seq_len: int, vocab_size: int) -> float:
    """Forward FLOPs of one sequence [1, seq_len] counted as the paper's Table 8 counts them.

    The official implementation (corl-team/lime, ``src/utils/flops_counter.py``) runs fvcore's
    ``FlopCountAnalysis`` on a ``torch.jit`` trace of its HF-LLaMA-based model for input
    [1, 2048], with its own operator handlers:

    - linear layers, ``matmul`` and ``mm`` (the routers): one FLOP per multiply-add;
    - fused ``scaled_dot_product_attention``: 4 a s^2 d + 3 a s^2, i.e. both products over the
      whole s x s square at two FLOPs per multiply-add, plus 3 per score (not causal);
    - element-wise ops one FLOP per output element (``pow`` 2, ``rsqrt`` 6, ``cos``/``sin`` 15;
      ``mean`` per input element); embedding lookups zero.

    Per layer that is, besides the linear layers and attention: two RMSNorms (5h + 7 per token:
    square, mean, +eps, rsqrt, two products), two residual additions (2h), SwiGLU (silu and
    product, 2f) and RoPE on queries and keys (3.5 per element: two products, a sum, a negated
    half); once per model the final RMSNorm and the rotary tables (their s x d/2 outer product,
    then cos and sin at 15 and the attention-scaling product on [s, d]). Hyper-Connections:
    ``_table_8_hyper_connection_flops``.
    """
    if not config.gated_linear_unit:
        raise ValueError("the paper's FLOP count is defined for the LLaMA (SwiGLU) layer")
    if config.hyper_connections_manifold:
        raise ValueError("the paper's FLOP count has no mHC row (the paper compares LIMe with HC, not mHC)")
    h, f, d, s = config.hidden_size, config.ffn_hidden_size, config.kv_channels, seq_len
    a, g = config.num_attention_heads, config.kv_heads
    linear = h * (a + 2 * g) * d + a * d * h + 3 * h * f
    norm = 5 * h + 7
    elementwise = 2 * norm + 2 * h + 2 * f + 3.5 * (a + g) * d
    attention = 4 * a * s * s * d + 3 * a * s * s
    routers = router_flops_per_token(config) / 2  # one FLOP per multiply-add
    per_sequence = config.num_layers * (s * (linear + elementwise) + attention) + s * routers
    rotary_tables = s * d // 2 + 2 * (15 + 1) * s * d
    if config.hyper_connections:
        per_sequence += s * (
            config.num_layers * _table_8_hyper_connection_flops(config)
            - 2 * config.num_layers * (norm + h)
            + config.hyper_connections * h
        )
    return per_sequence + s * (norm + h * vocab_size) + rotary_tables


def _table_8_hyper_connection_flops(config: LimeTransformerConfig) -> float:
    """Per token and layer, the official ``hc.py`` under the official counter: per sublayer the
    width connection (dynamic: a LayerNorm without affine 4nh, fvcore's count, the matmuls onto
    alpha nh(n+1) and beta nh, tanh/scale/add on alpha and beta 3(n+1)n + 3n; the mixing matmul
    (n+1)nh), the sublayer's LayerNorm 4h and the depth connection (the einsum ``blh,bln->blnh``:
    numpy's optimised count of an outer product halved, nh/2; the add nh). The caller removes the
    LLaMA RMSNorms and residual adds these replace and adds the streams' sum before the final norm
    (nh)."""
    n, h = config.hyper_connections, config.hidden_size
    dynamic = 0 if config.hyper_connections_static else 4 * n * h + n * h * (n + 1) + n * h + 3 * (n + 1) * n + 3 * n
    per_sublayer = dynamic + (n + 1) * n * h + 4 * h + n * h // 2 + n * h
    return 2 * per_sublayer
