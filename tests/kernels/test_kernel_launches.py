"""The launch profile (``testing.kernel_launches``, ``bench_lime_overhead --launch-profile``): each
routing-kernel launch timed and named by what it does, with the least bytes it must move counted
from its own arguments, here against the operands' sizes counted by hand."""

from __future__ import annotations

import pytest
import torch

from lime_megatron.kernels.operands import Columns, Halves, mix, weight_grad_sums
from lime_megatron.testing.kernel_launches import KernelLaunches
from tests.lime_fixtures import batch, loss_of, megatron_logits, tiny_model

S, B, HEADS, D, SOURCES = 6, 2, 3, 8, 5
ROW_BYTES = 2 * S * B * D * 2  # a row: keys and values of S x B positions, D bf16 elements each


def test_a_forward_mix_with_the_store_moves_each_row_once():
    """Sources and the layer's own rows read, the output and the stored copy of its own rows
    written, and the fp32 router columns read."""
    rows = torch.randn(SOURCES + HEADS, 2 * S * B * D, dtype=torch.bfloat16)
    weight = torch.randn(HEADS, SOURCES + HEADS)
    key, value = (torch.randn(S, B, HEADS, D, dtype=torch.bfloat16) for _ in range(2))
    keys, values = (torch.empty(S, B, HEADS, D, dtype=torch.bfloat16) for _ in range(2))
    first = (Columns.of(weight, slice(0, HEADS), slice(0, SOURCES)), Halves.of_rows(rows, 0, SOURCES, D))
    own = (Columns.of(weight, slice(0, HEADS), slice(SOURCES, SOURCES + HEADS)), Halves.of_heads(key, value))
    with KernelLaunches() as launches:
        mix(Halves.of_heads(keys, values), first, own, store=Halves.of_rows(rows, SOURCES, HEADS, D))
    [kind] = launches.kinds()
    moved = (SOURCES + HEADS + HEADS + HEADS) * ROW_BYTES + HEADS * (SOURCES + HEADS) * 4
    assert (kind["kind"], kind["launches"], kind["gb"]) == ("mix +store", 1, moved / 1e9)
    assert kind["ms"] > 0 and kind["gb_per_s"] > 0


def test_a_weight_gradient_reads_its_rows_once_and_writes_float32_sums():
    grads = Halves.of_heads(*(torch.randn(S, B, HEADS, D, dtype=torch.bfloat16) for _ in range(2)))
    rows = torch.randn(SOURCES, 2 * S * B * D, dtype=torch.bfloat16)
    with KernelLaunches() as launches:
        weight_grad_sums(grads, [(0, Halves.of_rows(rows, 0, SOURCES, D))], SOURCES, torch.float32, False)
    [kind] = launches.kinds()
    moved = (HEADS + SOURCES) * ROW_BYTES + 4 * HEADS * SOURCES
    assert (kind["kind"], kind["launches"], kind["gb"]) == ("weight grad", 1, moved / 1e9)


@pytest.mark.usefixtures("megatron")
def test_a_blocked_steps_launches_by_kind():
    """A blocked model's step launches every kind the fused path has, and nothing is timed outside
    the ``with`` block."""
    model = tiny_model(torch.float32, num_layers=6, lime_routing_block=3, lime_routing_kernel="triton")
    tokens, positions, mask = batch()
    with KernelLaunches() as launches:
        loss_of(megatron_logits(model, tokens, positions, mask), tokens).backward()
    kinds = {kind["kind"]: kind["launches"] for kind in launches.kinds()}
    assert {"mix +store", "mix +dW"} <= set(kinds), kinds
    loss_of(megatron_logits(model, tokens, positions, mask), tokens).backward()
    assert {kind["kind"]: kind["launches"] for kind in launches.kinds()} == kinds
