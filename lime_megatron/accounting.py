"""FLOPs and activation-memory accounting for LIMe and the baseline.

FLOPs count multiply-adds as 2 and only matrix products (norms, softmax and element-wise work
are left out, as in the usual 6*N*T accounting).  Causal attention is counted at half of the
s x s score/value products (the useful triangle).
"""

from __future__ import annotations

import torch

from lime_megatron.config import LimeTransformerConfig
from lime_megatron.router import routing_sources


def router_flops_per_token(config: LimeTransformerConfig) -> float:
    """Forward FLOPs per token of all routers (Eq. 2 on keys and values, layers >= 1)."""
    if not config.lime:
        return 0.0
    kv_heads, head_dim = config.kv_heads, config.kv_channels
    sources = sum(
        len(routing_sources(layer, config.lime_router, config.lime_router_window))
        for layer in range(1, config.num_layers)
    )
    return 2.0 * 2.0 * kv_heads * kv_heads * head_dim * sources


def layer_flops_per_token(config: LimeTransformerConfig, seq_len: int) -> float:
    """Forward FLOPs per token of one baseline transformer layer (no router)."""
    d = config.hidden_size
    q_width = config.num_attention_heads * config.kv_channels
    kv_width = config.kv_heads * config.kv_channels
    mlp_matrices = 3 if config.gated_linear_unit else 2
    projections = 2.0 * d * (q_width + 2 * kv_width) + 2.0 * q_width * d
    mlp = 2.0 * mlp_matrices * d * config.ffn_hidden_size
    causal_attention = 2.0 * 2.0 * seq_len * q_width / 2
    return projections + mlp + causal_attention


def forward_flops_per_token(config: LimeTransformerConfig, seq_len: int, vocab_size: int) -> float:
    """Forward FLOPs per token of the whole model, router included."""
    logits = 2.0 * config.hidden_size * vocab_size
    return config.num_layers * layer_flops_per_token(config, seq_len) + logits + router_flops_per_token(config)


class SavedTensorBytes:
    """Bytes autograd saves for backward: unique storages, parameters excluded.

    Use ``with SavedTensorBytes(model) as saved: loss = model(...)``; read ``saved.bytes``.
    """

    def __init__(self, model: torch.nn.Module):
        self._parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self._storages: dict[int, int] = {}

    @property
    def bytes(self) -> int:
        """Total bytes of the distinct storages seen."""
        return sum(self._storages.values())

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self._parameters:
            self._storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    def __enter__(self) -> "SavedTensorBytes":
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
