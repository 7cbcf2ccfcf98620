"""Dynamic LIMe (the paper's first version, v1 §3): a router whose weights depend on the token.

Layer l >= 1 computes, for every token t and key/value head h, a distribution over its sources
0..l from the layer's normalised input x_t (the output of the attention's input norm, the
tensor the QKV projection reads):

    p_l(t)[h, :] = softmax_j( (W_l x_t)[h, j] + tau_l [j = l] )          W_l: [kv_heads * (l+1), hidden]
    K~_l(t)[h] = sum_j p_l(t)[h, j] K_j(t)[h],   V~ likewise           (one distribution for K and V)

so, unlike the static router, head h of the routed keys reads head h of every source layer only.
Rows of ``W_l`` are head-major (row ``h * (l+1) + j``), so megatron's column-parallel split of the
rows gives each tensor-parallel rank the logits of its own heads, and the mixing needs no
collective at all.  ``tau_l = ln(9 l)`` is a fixed offset (a constant, not a parameter): with
``W_l = 0`` at initialisation the own layer's weight is 0.9 and each earlier one 0.1 / l, so the
model starts near the plain transformer; the parameter count is v1's (Table 6: 1.1856B).

The products live beside this module in ``token_routing`` (``TokenRouting.mix_by_token``,
``token_weight_grad`` and the row gradient ``sum_m p_m[..., l] * g_m``), over the memory's rows;
``RouteKeysValuesByToken`` connects them to autograd, which differentiates the softmax and ``W_l``.
"""

from __future__ import annotations

import math

import torch
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from torch import nn

from lime_megatron.models.config import LimeTransformerConfig
from lime_megatron.models.lime.head_parallel import HeadSharding
from lime_megatron.models.lime.key_value_rows import KeyValueRows
from lime_megatron.models.lime.memory import LayerIntegratedMemory
from lime_megatron.models.lime.router import ROUTER_PARAM_ATTR, add_route_mask, refresh_read_sources

OWN_WEIGHT_AT_INIT = 0.9
"""The own layer's routing weight with ``W_l = 0`` (fixes ``tau_l``)."""


def own_logit_offset(layer: int) -> float:
    """tau_l: the fixed logit added to the own source so that softmax gives it
    ``OWN_WEIGHT_AT_INIT`` when the other l logits are equal: ln(0.9 l / 0.1)."""
    return math.log(OWN_WEIGHT_AT_INIT * layer / (1.0 - OWN_WEIGHT_AT_INIT))


class DynamicLimeRouter(nn.Module):
    """p_l of one layer l >= 1: ``logits`` maps ``[s, b, hidden]`` to ``[s, b, local heads * (l+1)]``.

    ``sources`` is ``0..l`` (column j of the weights is source layer j); ``sharding`` the
    tensor-parallel heads (no replicas: ``config`` rejects tensor parallelism beyond kv_heads).
    """

    identity = False
    learned = True
    dynamic = True

    def __init__(self, config: LimeTransformerConfig, layer: int, sharding: HeadSharding, tp_group=None):
        super().__init__()
        if layer < 1:
            raise ValueError("layer 0 has no router (its routing is the identity)")
        self.layer, self.sharding = layer, sharding
        self.sources = list(range(layer + 1))
        self.logits = ColumnParallelLinear(
            config.hidden_size,
            config.kv_heads * len(self.sources),
            config=config,
            init_method=nn.init.zeros_,
            bias=False,
            gather_output=False,
            tp_group=tp_group,
        )
        setattr(self.logits.weight, ROUTER_PARAM_ATTR, True)
        self.own_offset = own_logit_offset(layer)
        self._prior = None
        add_route_mask(self, config, (len(sharding.local_heads), len(self.sources)))

    def set_route_mask(self, mask: torch.Tensor) -> None:
        """Mask the routes (local head, source) where ``mask`` ``[local heads, l + 1]`` is False."""
        self.route_mask.copy_(mask)
        refresh_read_sources(self)

    def collect_prior(self, collecting: bool) -> None:
        """Start (or stop) summing p_l over the tokens of training forward passes (``take_prior``)."""
        self._prior = self.route_mask.new_zeros(self.route_mask.shape, dtype=torch.float64) if collecting else None

    def take_prior(self) -> torch.Tensor:
        """The summed p_l ``[local heads, l + 1]`` since ``collect_prior(True)``; stops collecting."""
        if self._prior is None:
            raise RuntimeError(f"the dynamic router of layer {self.layer} collected no prior (collect_prior)")
        prior, self._prior = self._prior, None
        return prior

    @property
    def weight(self) -> torch.Tensor:
        """W_l, this rank's rows ``[local heads * (l+1), hidden]``."""
        return self.logits.weight

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """p_l for the normalised input ``[s, b, hidden]`` (sequence-parallel: ``[s/tp, b, hidden]``,
        gathered by the linear layer): ``[s, b, local heads, l + 1]`` in the input's dtype (the
        softmax runs in at least float32)."""
        logits, _ = self.logits(hidden_states)
        logits = logits.view(*logits.shape[:2], len(self.sharding.local_heads), len(self.sources))
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        logits[..., -1] += self.own_offset
        if self.pruned:  # masked routes: weight 0, no gradient to their rows of W_l
            logits = logits.masked_fill(~self.route_mask, float("-inf"))
        probs = torch.softmax(logits, dim=-1).to(hidden_states.dtype)
        if self._prior is not None and torch.is_grad_enabled():  # a training pass (once under recompute)
            self._prior += probs.detach().sum(dim=(0, 1)).double()
        return probs

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        """megatron distributed-checkpoint entries of W_l (and a pruning run's route mask): one
        tensor per layer (shapes differ by layer, so not stacked on megatron's layer axis), split by
        rows = by head across TP sizes."""
        dp_rank = parallel_state.get_data_parallel_rank(with_context_parallel=True)
        tp_rank, tp_size = self.sharding.rank, self.sharding.size
        entries = (
            {"logits.weight": self.weight, "route_mask": self.route_mask}
            if self.prunable
            else {"logits.weight": self.weight}
        )
        return {
            f"{prefix}{name}": ShardedTensor.from_rank_offsets(
                f"{prefix}{name.replace('.', '_')}_of_layer_{self.layer}",
                tensor,
                (0, tp_rank, tp_size),
                replica_id=(0, 0, dp_rank),
            )
            for name, tensor in entries.items()
        }

    def extra_repr(self) -> str:
        return f"layer={self.layer}, sources=0..{self.layer}, dynamic"


class RouteKeysValuesByToken(torch.autograd.Function):
    """Store a layer's keys/values in the memory and return the keys/values routed by ``probs``.

    forward(probs [s, b, h, l+1], key [s, b, h, d], value [s, b, h, d], memory, router)
        -> routed keys [s, b, h, d], routed values [s, b, h, d]
    backward: dL/dprobs [s, b, h, l+1] (read from the rows before they are overwritten with g_l)
    and the gradient of the layer's keys/values from all its consumers
    (``ConsumerGradients.kv_grad``).
    """

    @staticmethod
    def forward(ctx, probs, key, value, memory: LayerIntegratedMemory, router: DynamicLimeRouter):
        own_rows = memory.key_values.store(router.layer, key, value)
        memory.gradients.register(router)
        ctx.save_for_backward(own_rows, probs)
        ctx.memory, ctx.router = memory, router
        return memory.by_token.mix_by_token(router, probs)

    @staticmethod
    def backward(ctx, grad_keys, grad_values):
        _, probs = ctx.saved_tensors
        memory, router = ctx.memory, ctx.router
        grad_rows = KeyValueRows.to_rows(grad_keys, grad_values)
        grad_probs = memory.by_token.token_weight_grad(router, grad_rows) if ctx.needs_input_grad[0] else None
        memory.by_token.keep_token_weights(router.layer, probs)
        grad_key, grad_value = memory.gradients.kv_grad(router, grad_rows)
        return grad_probs, grad_key, grad_value, None, None


def route_keys_values_by_token(
    memory: LayerIntegratedMemory,
    router: DynamicLimeRouter,
    hidden_states: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """((routed keys, routed values) ``[s, b, kv_heads, d]`` each, the weights p_l ``[s, b, kv_heads, l+1]``)."""
    probs = router(hidden_states)
    return RouteKeysValuesByToken.apply(probs, key, value, memory, router), probs


def route_new_tokens_by_token(
    memory: LayerIntegratedMemory,
    router: DynamicLimeRouter,
    hidden_states: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """KV-cache decoding step: the new tokens' p_l from their own inputs, their keys/values stored
    and routed (no autograd): ``([s_new, b, h, d], [s_new, b, h, d])``."""
    if torch.is_grad_enabled():
        raise RuntimeError("LIMe KV-cache decoding runs without autograd: call the model under torch.no_grad()")
    probs = router(hidden_states)
    memory.key_values.store(router.layer, key, value)
    return memory.by_token.mix_by_token(router, probs)
