"""The layer-integrated memory of one forward pass (paper §4, Eqs. 1-2), and a layer's way in.

Layer l writes its raw keys/values K_l, V_l into the pass's buffer B (Eq. 1) and reads back the
routed keys/values of its sources, one router over all of them (Eq. 2):

    B[rows of l] = (K_l | V_l)                              [kv_heads, 2 * s * b * d]
    routed_l = W_l @ B[rows of sources(l)]                  [kv_heads, 2 * s * b * d]

A ``LayerIntegratedMemory`` is the composition of one pass's parts, one module each:

- ``key_values`` (``key_value_rows.KeyValueRows``): the buffer and its layout, external row
  blocks of earlier pipeline chunks, Eq. 1;
- ``routing`` (``static_routing.StaticRouting``): Eq. 2 for static routers, per layer, and its
  router-weight gradient;
- ``stacked`` (``stacked_routing.StackedRouting``): the products of several static routers at
  once: a block's sums over its earlier sources (``routing_blocks``) and the row gradients;
- ``by_token`` (``token_routing.TokenRouting``): Eq. 2 for dynamic routers (``dynamic_router``);
- ``kept`` (``kept_gradients.KeptGradients``): the row gradients g_m backward keeps;
- ``gradients`` (``consumer_gradients.ConsumerGradients``): the gradient of each layer's keys and
  values, sum_m W_m[:, block l]^T g_m over its consumers m, and the pipeline's shares;
- ``fused`` (``fused_routing.FusedRouting``): a layer's routing on the Triton path, Eqs. 1-2 and
  each gradient in one kernel launch; its ``blocks`` (``fused_blocks.FusedBlocks``) a routing
  block's tensors, shared by its layers.

``RouteKeysValues`` connects a layer with a static router to them in autograd
(``dynamic_router.RouteKeysValuesByToken`` one with a dynamic router).

Backward.  ``RouteKeysValues`` gives the router weight gradient ``g_l @ buffer[sources]^T``
(float32) and the gradient of layer l's own keys/values, which collects the contributions of every
consumer m >= l of layer l.  Autograd runs layer l's backward only after every later layer's, so
when layer m's backward finishes its raw rows are dead: they are overwritten with g_m, and
grad(kv_l) is one matrix product over the rows l..stop of consumers.  No second buffer is
allocated for gradients.

Order.  Every read of layer l's raw rows comes before their overwrite, and every read of a kept
g_m after its write, by an autograd edge, never by the engine's choice among ready nodes
(``tests/models/test_backward_ordering.py`` checks the edges and runs the engine with that choice
inverted):

- a consumer m > l (its weight gradient, a dynamic router's ``token_weight_grad``; its g_m and p_m
  kept for the consumer gradient): layer m's keys are computed from layer l's output (the
  residual stream), so the gradient m's ``RouteKeysValues`` returns for them flows down to l's;
- layer l itself reads its rows (weight gradient, ``token_weight_grad``) in its own backward,
  before ``ConsumerGradients.kv_grad`` writes g_l;
- a block's ``routing_blocks.MixEarlierSources`` (``fused_blocks.MixEarlierRows`` on the Triton
  path): its input ``key`` (raw keys of the block's first reader, gradient None) makes that
  reader's QKV projection, and so every earlier layer's backward, wait for it; it runs after the
  readers' ``RouteKeysValues``, which take its outputs;
- the rebuild of layer m's dropped routed K/V (``lime_recompute_routed_kv``) runs when a node of
  m's core attention unpacks a saved tensor: those nodes take the routed K/V, so they lie above
  m's ``RouteKeysValues`` and every earlier layer's;
- full activation recompute reruns a chunk's forward, edges included, inside its backward; rows of
  an earlier chunk are written by that chunk's backward, which needs the gradient of this chunk's
  input, returned when its backward ends;
- pipeline stages: external rows received from another rank are never written; those kept from
  this rank's earlier chunk are written by that chunk's backward, which needs the gradient of
  its output, the later chunks' input (as above); the own rows' downstream gradient is handed
  over in a hook on the chunk's output, before any layer's backward
  (``lime_megatron.parallel.pipeline``).

Decoding.  With a KV cache (``lime_megatron.inference.decoding``) each forward pass is one decoding
step over the step's new tokens only; the routed keys/values go to the per-layer cache.
``route_new_tokens`` is that path: Eqs. 1-2 without autograd, over all of a layer's sources
(no block mixes earlier sources), one launch per layer on the Triton path.

The memory of a pass is found by layers through a small handle tensor that megatron threads
through every layer (and through its activation-recompute checkpoints) as the decoder's
``context``; see ``lime_megatron.models.gpt_model``.
"""

from __future__ import annotations

import itertools
import weakref

import torch

from lime_megatron.kernels.launch_plans import LaunchPlans
from lime_megatron.models.lime.consumer_gradients import ConsumerGradients
from lime_megatron.models.lime.fused_routing import FusedRouting, gathers_heads
from lime_megatron.models.lime.head_parallel import gather_heads
from lime_megatron.models.lime.kept_gradients import KeptGradients
from lime_megatron.models.lime.key_value_rows import KeyValueRows
from lime_megatron.models.lime.router import LimeRouter
from lime_megatron.models.lime.routing_blocks import StandingRouterStack
from lime_megatron.models.lime.routing_products import key_value_halves, placed_columns
from lime_megatron.models.lime.stacked_routing import StackedRouting
from lime_megatron.models.lime.static_routing import StaticRouting
from lime_megatron.models.lime.token_routing import TokenRouting

_MEMORIES: weakref.WeakValueDictionary[int, LayerIntegratedMemory] = weakref.WeakValueDictionary()
_NEXT_ID = itertools.count()


class LayerIntegratedMemory:
    """The memory of one forward pass of one model chunk: buffer B and the routing over it, as the
    parts the module docstring lists.

    Args:
        num_layers: layers of the whole model (fixes which layers read each layer).
        variant, window: router variant (App. D).
        layers: this chunk's own layers (global 0-based indices; all layers without pipelining).
        block: routing block size B (``routing_blocks``; 1: every product per layer).
        routers: the chunk's routers by layer (a block's first layer mixes the earlier sources of
            all its layers; every product of several routers reads their weights from one
            ``RouterStack`` per pass).
        triton: the routing products run as Triton kernels (``lime_megatron.kernels``; the run's
            ``--lime-routing-kernel``, ``kernels.routing_path``), else as torch operators.
        deterministic: the kernels' router-weight gradients sum in a fixed order.
        standing_stack: the chunk's ``RouterStack`` kept across passes (the Triton path), else
            each pass builds its own.
        launch_plans: the chunk's routing launches kept across passes (the Triton path,
            ``kernels.launch_plans``), else each pass builds its own.
    """

    def __init__(
        self,
        num_layers: int,
        variant: str,
        window: int | None,
        layers: range | None = None,
        block: int = 1,
        *,
        routers: dict[int, LimeRouter],
        triton: bool = False,
        deterministic: bool = True,
        standing_stack: StandingRouterStack | None = None,
        launch_plans: LaunchPlans | None = None,
    ):
        layers = range(num_layers) if layers is None else layers
        self.key_values = KeyValueRows(layers, triton, deterministic)
        self.routing = StaticRouting(self.key_values, block)
        self.kept = KeptGradients(self.key_values, gathers_heads(routers, triton, self.routing))
        self.stacked = StackedRouting(self.key_values, self.kept, self.routing, routers, standing_stack)
        self.by_token = TokenRouting(self.key_values, self.kept)
        self.gradients = ConsumerGradients(
            num_layers, variant, window, self.key_values, self.kept, self.routing, self.stacked, self.by_token
        )
        self.fused = FusedRouting(self.key_values, self.kept, self.routing, self.stacked, self.gradients, launch_plans)
        self.id = next(_NEXT_ID)
        _MEMORIES[self.id] = self

    def handle(self) -> torch.Tensor:
        """A one-element tensor naming this memory, passed through megatron as ``context``.

        The handle keeps the memory alive (megatron's recompute checkpoints save it); detached
        copies made by the checkpoints still resolve through ``from_handle``.
        """
        handle = torch.tensor([self.id], dtype=torch.int64)
        handle.lime_memory = self
        return handle

    @staticmethod
    def from_handle(handle: torch.Tensor | None) -> LayerIntegratedMemory:
        """The memory named by ``handle`` (the ``context`` a LIMe layer receives)."""
        if handle is None:
            raise RuntimeError(
                "a LIMe layer ran without its layer-integrated memory: build the model with "
                "lime_megatron.models.gpt_model.LimeGPTModel, whose forward passes it to the decoder"
            )
        memory = getattr(handle, "lime_memory", None) or _MEMORIES.get(int(handle))  # a copy: by its id
        if memory is None:
            raise RuntimeError(f"the LIMe memory {int(handle)} of this pass was already freed")
        return memory


class RouteKeysValues(torch.autograd.Function):
    """Store a layer's keys/values in the memory and return the routed ones (Eqs. 1-2).

    forward(weight [h, n_src*h], key [s,b,h,d], value [s,b,h,d], earlier keys, earlier values,
            memory, router) -> routed keys [s, b, h, d], routed values [s, b, h, d]

    ``earlier``: the block's sums over the sources before the block, keys and values (blocked
    routing; ``[s, b, h, d]`` each without tensor parallelism, else halves ``[h, s*b*d]`` of rows;
    on the Triton path in a fused block its ``MixEarlierRows``' output and None, the sums being
    the block's tensor; None otherwise); the product then covers the in-block sources, and
    backward leaves their columns' weight gradient to the block's node, which returns the
    router's whole gradient.  ``weight`` is the input whose gradient backward returns (unblocked); the
    products read the router's weight (``StaticRouting.mix``).
    """

    @staticmethod
    def forward(
        ctx, weight, key, value, earlier_keys, earlier_values, memory: LayerIntegratedMemory, router: LimeRouter
    ):
        earlier = (earlier_keys, earlier_values) if earlier_keys is not None else None
        if memory.fused.serves(router):
            routed = memory.fused.store_and_mix(router, key, value)
        else:
            memory.key_values.store(router.layer, key, value)
            routed = memory.routing.mix(router, earlier)
        memory.gradients.register(router)
        # Saved so that saved-tensor accounting (and offloading hooks) see the buffer.
        ctx.save_for_backward(memory.key_values.buffer)
        ctx.memory, ctx.router, ctx.blocked = memory, router, earlier is not None
        return routed

    @staticmethod
    def backward(ctx, grad_keys, grad_values):
        ctx.saved_tensors  # noqa: B018 - releases the saved buffer through the hooks
        if ctx.memory.fused.serves(ctx.router):
            return RouteKeysValues._fused_backward(ctx, grad_keys, grad_values)
        memory, router = ctx.memory, ctx.router
        grad_rows = KeyValueRows.to_rows(grad_keys, grad_values)
        if not router.identity:  # the identity routes each rank's own heads: nothing to gather
            grad_rows = gather_heads(grad_rows, router.sharding)
        grad_weight = None
        if ctx.needs_input_grad[0]:
            since = memory.routing.block_of(router.layer).start if ctx.blocked else 0
            pieces = memory.routing.weight_grad_pieces(router, grad_rows, since)
            if ctx.blocked:  # placed beside the earlier columns' by ``routing_blocks.MixEarlierSources``
                memory.kept.leave_in_block(router.layer, pieces)
            else:
                grad_weight = placed_columns(pieces, router.weight)
        grad_key, grad_value = memory.gradients.kv_grad(router, grad_rows)
        grad_earlier = (None, None)  # else in the layout of ``earlier`` (``routing_blocks.mix_earlier``)
        if ctx.blocked and router.sharding.size == 1:
            grad_earlier = (grad_keys, grad_values)
        elif ctx.blocked:
            grad_earlier = key_value_halves(grad_rows)
        return grad_weight, grad_key, grad_value, *grad_earlier, None, None

    @staticmethod
    def _fused_backward(ctx, grad_keys, grad_values):
        """``backward`` on the Triton path (``fused_routing.FusedRouting``): the incoming gradients read where
        they lie, the router-weight gradient and the keys' and values' in one launch."""
        memory, router = ctx.memory, ctx.router
        since = None
        if ctx.needs_input_grad[0]:
            since = memory.routing.block_of(router.layer).start if ctx.blocked else 0
        piece, grad_key, grad_value = memory.fused.backward(router, grad_keys, grad_values, since)
        grad_weight = None if piece is None else placed_columns([piece], router.weight)
        return grad_weight, grad_key, grad_value, None, None, None, None


def route_keys_values(
    memory: LayerIntegratedMemory, router: LimeRouter, key: torch.Tensor, value: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Routed keys and values of ``router``'s layer, ``[s, b, kv_heads, d]`` each."""
    if memory.fused.serves(router) and memory.routing.blocked(router):  # its block's tensor (``fused_blocks``)
        earlier = (memory.fused.blocks.earlier_sums(router, key, value), None)
    else:
        earlier = memory.stacked.earlier_partial(router, key) or (None, None)
    return RouteKeysValues.apply(router.weight, key, value, *earlier, memory, router)


def route_new_tokens(
    memory: LayerIntegratedMemory, router: LimeRouter, key: torch.Tensor, value: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """KV-cache decoding step (no autograd): store the new tokens' keys/values ``[s_new, b, h, d]``
    of ``router``'s layer in the step's memory (Eq. 1) and return their routed keys and values
    ``([s_new, b, h, d], [s_new, b, h, d])`` (Eq. 2), which the caller copies into the layer's
    cache: for the identity routing (layer 0) ``key`` and ``value`` themselves.  On the Triton path
    both equations are one launch (``FusedRouting.store_and_mix``, over all the layer's sources)."""
    if torch.is_grad_enabled():
        raise RuntimeError("LIMe KV-cache decoding runs without autograd: call the model under torch.no_grad()")
    if memory.fused.routes_new_tokens(router):
        return memory.fused.store_and_mix(router, key, value, in_block=False)
    memory.key_values.store(router.layer, key, value)
    if router.identity:
        return key, value
    return memory.routing.mix(router)
