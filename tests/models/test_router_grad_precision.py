"""The router weight gradient of bf16 activations is accumulated and returned in float32.

dL/dW_l = g_l @ buffer[sources]^T reduces over N = 2*s*b*d elements (about 2M at the paper's 1B
shape, micro-batch 8).  Here N = 2^20 (s 2048, b 4, d 64), bf16 keys/values and output gradients,
float32 routers (as mixed-precision training keeps master weights): the router gradients of a
4-layer memory, at B = 1 and blocked, against float64 products of the same bf16 values.
Bound: relative error (Frobenius) <= 1e-5, float32 accumulation (a bf16 result is off by ~2e-3,
its rounding alone; printed by ``bench/bench_router_grad_precision.py``).
"""

from __future__ import annotations

import pytest
import torch

from lime_megatron.models.config import lime_config
from lime_megatron.models.lime.memory import LayerIntegratedMemory, route_keys_values
from lime_megatron.models.lime.router import LimeRouter

pytestmark = [pytest.mark.usefixtures("megatron"), pytest.mark.filterwarnings("ignore::UserWarning")]

LAYERS, KV_HEADS, SEQ, BATCH, HEAD_DIM = 4, 2, 2048, 4, 64
BOUND = 1e-5


def bf16_router_grads(block: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(router .grad of layers 1..3, their float64 reference from the same bf16 inputs)."""
    config = lime_config(num_layers=LAYERS, hidden_size=128, num_attention_heads=2, num_query_groups=KV_HEADS,
                         use_cpu_initialization=True)
    routers = {layer: LimeRouter(config, layer) for layer in range(LAYERS)}
    memory = LayerIntegratedMemory(LAYERS, "full", None, block=block, routers=routers)
    generator = torch.Generator().manual_seed(0)

    def bf16(*shape):
        return torch.randn(*shape, generator=generator).to(torch.bfloat16)

    keys = [bf16(SEQ, BATCH, KV_HEADS, HEAD_DIM) for _ in range(LAYERS)]
    values = [bf16(SEQ, BATCH, KV_HEADS, HEAD_DIM) for _ in range(LAYERS)]
    upstream = [bf16(2, SEQ, BATCH, KV_HEADS, HEAD_DIM) for _ in range(LAYERS)]
    routed = [route_keys_values(memory, routers[layer], keys[layer], values[layer]) for layer in range(LAYERS)]
    sum((out.float() * grad.float()).sum() for out, grad in zip(routed[1:], upstream[1:])).backward()

    def rows(layer):  # [kv, 2*s*b*d] in float64
        return torch.stack([keys[layer], values[layer]]).permute(3, 0, 1, 2, 4).reshape(KV_HEADS, -1).double()

    references = []
    for layer in range(1, LAYERS):
        g = upstream[layer].permute(3, 0, 1, 2, 4).reshape(KV_HEADS, -1).double()
        references.append(g @ torch.cat([rows(source) for source in range(layer + 1)]).t())
    return [routers[layer].weight.grad for layer in range(1, LAYERS)], references


@pytest.mark.parametrize("block", [1, 2])
def test_bf16_router_gradient_is_float32_accurate(block):
    grads, references = bf16_router_grads(block)
    for layer, (grad, reference) in enumerate(zip(grads, references), start=1):
        assert grad.dtype == torch.float32
        error = ((grad.double() - reference).norm() / reference.norm()).item()
        assert error <= BOUND, f"layer {layer}: relative error {error:.1e}"
