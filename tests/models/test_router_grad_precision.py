"""The router weight gradient of bf16 activations is accumulated and returned in float32
(``memory.float32_product``), and a bf16 run keeps its learned routers in float32.

dL/dW_l = g_l @ rows^T reduces over N = 2*s*b*d elements (about 2M at the paper's 1B shape,
micro-batch 8).  Here N = 2^20 (s 2048, b 4, d 64, keys and values), bf16 operands: the
float32-accumulated product against the float64 product of the same bf16 values.

Bound: relative (Frobenius) error <= 1e-5.  float32 accumulation over chunks of N adds errors of
about u32 * sqrt(N / chunk) * ... << 1e-5 (u32 = 6e-8); a product returned in bf16 is off by its
final rounding alone, about 2e-3 relative (u_bf16 / 2 per element), which the bound rejects.
"""

from __future__ import annotations

import pytest
import torch

from lime_megatron.models.lime.memory import float32_product

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning")]

KV_HEADS, SOURCES, N = 2, 4, 2 ** 20
BOUND = 1e-5


def bf16_operands() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    grad_rows = torch.randn(KV_HEADS, N, generator=generator).to(torch.bfloat16)
    rows = torch.randn(SOURCES * KV_HEADS, N, generator=generator).to(torch.bfloat16)
    return grad_rows, rows


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected).norm() / expected.norm()).item()


def test_router_weight_gradient_of_bf16_rows_is_float32_accurate(monkeypatch):
    grad_rows, rows = bf16_operands()
    reference = grad_rows.double() @ rows.double().t()
    monkeypatch.setattr("lime_megatron.models.lime.memory.FLOAT32_CHUNK_BYTES", 2 ** 20)  # 32 chunks of N
    product = float32_product(grad_rows, rows)
    assert product.dtype == torch.float32
    error = relative_error(product, reference)
    bf16_result = relative_error(grad_rows @ rows.t(), reference)  # what a bf16 product returns
    print(f"router weight gradient, N = 2^20: float32 accumulation {error:.1e}, bf16 result {bf16_result:.1e}")
    assert error <= BOUND < bf16_result


def test_float32_and_float64_operands_multiply_as_they_are():
    generator = torch.Generator().manual_seed(1)
    for dtype in (torch.float32, torch.float64):
        grad_rows, rows = torch.randn(2, 64, generator=generator, dtype=dtype), torch.randn(6, 64, dtype=dtype)
        assert torch.equal(float32_product(grad_rows, rows), grad_rows @ rows.t())
