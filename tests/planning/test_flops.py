"""lime_megatron.planning.flops checked independently: a tiny model's matrix products counted by hand,
the products a built model actually runs counted by torch's FlopCounterMode, and the paper's
Table 8 forward FLOPs reproduced under the official implementation's counting convention."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from lime_megatron.models.config import PAPER_1B, PAPER_VOCAB_SIZE, lime_config
from lime_megatron.models.gpt_model import build_model
from lime_megatron.parallel.process_groups import initialize_parallel
from lime_megatron.planning import flops

# 2 layers, hidden 8, 4 query heads of dim 2 sharing 2 kv heads (GQA), FFN 12 (SwiGLU), vocab 16.
TINY = dict(
    num_layers=2,
    hidden_size=8,
    ffn_hidden_size=12,
    num_attention_heads=4,
    num_query_groups=2,
    use_cpu_initialization=True,
    transformer_impl="local",
)
VOCAB, SEQ, BATCH = 16, 4, 2
TOKENS = SEQ * BATCH  # 8

# Every matrix product of one forward of TINY over [BATCH=2, SEQ=4], as (m, n, k): m x k times k x n,
# m*n*k multiply-adds.
LAYER_PRODUCTS = [
    (8, 16, 8),  # QKV: tokens x hidden times hidden x (4 q + 2 k + 2 v heads) * dim 2
    (8, 8, 8),  # output projection: tokens x (4 heads * dim 2) times 8 x hidden
    (8, 24, 8),  # FC1: tokens x hidden times hidden x (gate + up) 2 * 12
    (8, 8, 12),  # FC2: tokens x 12 times 12 x hidden
]
# Core attention, per (sequence, query head): 8 of them. Scores Q K^T: s x d times d x s; output
# P V: s x s times s x d. Whole squares; the causal mask makes half of them (s^2/2 per head) useful.
ATTENTION_PRODUCTS = [(4, 4, 2)] * 8 + [(4, 2, 4)] * 8
# Layer 1's router (full: sources 0 and 1), keys and values at once: W [kv 2, 2 sources * 2 kv]
# times the buffered rows [4, 2 (k, v) * s 4 * b 2 * d 2]. Layer 0 has no router: its fixed identity
# routing is no product (memory.py's mix hands it its own keys/values).
ROUTER_PRODUCTS = [(2, 32, 4)]
LOGIT_PRODUCTS = [(8, 16, 8)]  # tokens x hidden times hidden x vocab


def multiply_adds(products) -> int:
    return sum(m * n * k for m, n, k in products)


def test_hand_counted_tiny_model():
    """The formula is 2 FLOPs per multiply-add with attention at half its squares (causal)."""
    layers = 2 * multiply_adds(LAYER_PRODUCTS)  # 7680
    attention = 2 * multiply_adds(ATTENTION_PRODUCTS)  # 1024 (whole squares)
    router, logits = multiply_adds(ROUTER_PRODUCTS), multiply_adds(LOGIT_PRODUCTS)  # 256, 1024
    config = lime_config(**TINY)
    assert flops.forward_flops_per_token(config, SEQ, VOCAB) * TOKENS == 2 * (layers + attention / 2 + router + logits)
    assert flops.router_flops_per_token(config) * TOKENS == 2 * router
    baseline = lime_config(**TINY, lime=False)
    assert flops.router_flops_per_token(baseline) == 0
    assert flops.forward_flops_per_token(baseline, SEQ, VOCAB) * TOKENS == 2 * (layers + attention / 2 + logits)
    # One training iteration of 3 sequences: 3x forward.
    assert flops.training_flops_per_iteration(config, SEQ, VOCAB, 3) == 3 * 3 * SEQ * (
        2 * (layers + attention / 2 + router + logits) / TOKENS
    )


def measured_forward_flops(config) -> int:
    """FLOPs of the matrix products one forward (with loss) of a built model runs, as counted by
    torch's FlopCounterMode: 2 per multiply-add of mm/addmm/bmm/baddbmm/SDPA, whole squares for
    attention (it does not see the causal mask), nothing else."""
    initialize_parallel()
    torch.manual_seed(0)
    model = build_model(config, vocab_size=VOCAB, max_sequence_length=SEQ)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ))
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(tokens, positions, None, labels=tokens)
    return counter.get_total_flops()


def test_measured_products_of_the_tiny_model_match_the_hand_count():
    """The model runs exactly the products listed above, no more."""
    every = 2 * LAYER_PRODUCTS + 2 * ATTENTION_PRODUCTS + LOGIT_PRODUCTS
    assert measured_forward_flops(lime_config(**TINY, lime=False)) == 2 * multiply_adds(every)
    lime = every + ROUTER_PRODUCTS
    assert measured_forward_flops(lime_config(**TINY)) == 2 * multiply_adds(lime)


ROUTERS = {
    "full": dict(),
    "average": dict(lime_router="average"),
    "last-2": dict(lime_router="last", lime_router_window=2),
    "first-1": dict(lime_router="first", lime_router_window=1),
    "mha": dict(num_query_groups=4),
    "mqa": dict(num_query_groups=1),
}


@pytest.mark.parametrize("overrides", list(ROUTERS.values()), ids=list(ROUTERS))
def test_formula_matches_measured_products(overrides):
    """Formula = FlopCounterMode's count under a stated convention. Attention: the formula counts
    the causal half, 2 * 2 * s * (heads * d) / 2 per token and layer; the counter sees whole
    squares, exactly that much again. Routers: both leave layer 0 out (its identity routing runs
    no product; backward and decoding: tests/models/test_memory.py)."""
    shape = dict(TINY, num_layers=5, **overrides)
    lime, baseline = lime_config(**shape), lime_config(**shape, lime=False)
    unmasked_half = lime.num_layers * 2 * 2 * SEQ * lime.num_attention_heads * lime.kv_channels / 2 * TOKENS
    measured = {config.lime: measured_forward_flops(config) for config in (lime, baseline)}
    for config in (lime, baseline):
        assert measured[config.lime] == flops.forward_flops_per_token(config, SEQ, VOCAB) * TOKENS + unmasked_half
    assert measured[True] - measured[False] == flops.router_flops_per_token(lime) * TOKENS > 0


# Paper Table 8 forward FLOPs (TFLOP, one sequence of 2048 tokens) and the LIMe/LLaMA ratios.
TABLE_8_TFLOPS = {(False, 8): 2.7615, (True, 8): 2.7638, (False, 32): 2.9679, (True, 32): 3.0041}
TABLE_8_RATIO_PERCENT = {8: 0.08, 32: 1.22}
# The same ratios under this project's convention (2 FLOPs per multiply-add, causal attention at half).
PROJECT_RATIO_PERCENT = {8: 0.10, 32: 1.42}


def paper_1b(lime: bool, kv_heads: int):
    return lime_config(**PAPER_1B, num_query_groups=kv_heads, lime=lime)


@pytest.mark.parametrize("kv_heads", [8, 32], ids=["GQA", "full attention"])
def test_paper_table_8_forward_flops(kv_heads):
    """Table 8 reproduced to its 5 digits under the official counter's convention at 2048 tokens
    (docs/estimate.md); this project's convention gives larger ratios (attention counted at a
    quarter of the official counter's weight relative to the linear layers)."""
    counted = {
        lime: flops.paper_table_8_forward_flops(paper_1b(lime, kv_heads), 2048, PAPER_VOCAB_SIZE)
        for lime in (False, True)
    }
    for lime, value in counted.items():
        assert round(value / 1e12, 4) == TABLE_8_TFLOPS[lime, kv_heads]
    assert round(100 * (counted[True] / counted[False] - 1), 2) == TABLE_8_RATIO_PERCENT[kv_heads]
    project = {
        lime: flops.forward_flops_per_token(paper_1b(lime, kv_heads), 2048, PAPER_VOCAB_SIZE) for lime in (False, True)
    }
    assert round(100 * (project[True] / project[False] - 1), 2) == PROJECT_RATIO_PERCENT[kv_heads]
