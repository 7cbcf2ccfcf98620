"""The model: megatron's ``GPTModel`` carrying LIMe's layer-integrated memory through the decoder.

``build_model`` is the one builder for LIMe and the LLaMA baseline (``config.lime=False``): the
same class, the same megatron modules, the paper's architecture (Table 3: RMSNorm, SwiGLU, RoPE,
no biases, tied embeddings, optional GQA via ``num_query_groups``).

``LimeGPTModel.forward`` opens a fresh ``LayerIntegratedMemory`` per pass and hands its handle to
megatron's ``TransformerBlock`` as the decoder ``context``: megatron threads that argument through
every layer and through its activation-recompute checkpoints, and the decoder-only GPT leaves it
otherwise unused, so each LIMe layer finds the memory of the pass it is (re)computing.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from lime_megatron.kernels.launch_plans import LaunchPlans
from lime_megatron.kernels.routing_path import routing_kernel
from lime_megatron.models.config import LimeTransformerConfig
from lime_megatron.models.initialization import initialize_weights
from lime_megatron.models.layer_specs import lime_block_spec
from lime_megatron.models.lime.memory import LayerIntegratedMemory
from lime_megatron.models.lime.router import LimeRouter
from lime_megatron.models.lime.routing_blocks import StandingRouterStack, default_routing_block


class LimeGPTModel(GPTModel):
    """``GPTModel`` whose forward provides the layer-integrated memory to LIMe layers.

    Inputs and outputs as ``GPTModel.forward``: input_ids/position_ids ``[b, s]``; returns the
    per-token loss ``[b, s]`` when labels are given, else the logits.  Under pipeline parallelism
    a chunk exchanges megatron's hidden state as usual (``set_input_tensor``, output) and the
    keys/values later chunks read through ``lime_megatron.parallel.pipeline``'s side channel.
    """

    def __init__(self, *args, routing_block: int | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self._stage_input: torch.Tensor | None = None
        self.side_channel = None  # the pipeline's KeptRows of the current schedule call (``_side_channel``)
        self.own_layers = self._own_layers()
        pipeline = self.config.pipeline_model_parallel_size
        self.global_chunk = (
            (self.vp_stage or 0) * pipeline + parallel_state.get_pipeline_model_parallel_rank() if pipeline > 1 else 0
        )
        # The routing block size B of this chunk, decided by its builder (``routing_blocks``)
        self.routing_block = routing_block or default_routing_block(self.config)

    def _own_layers(self) -> range:
        """Global indices of the layers built in this chunk."""
        numbers = [layer.layer_number - 1 for layer in self.decoder.layers]
        if numbers:
            return range(numbers[0], numbers[-1] + 1)
        offset = get_transformer_layer_offset(self.config, vp_stage=self.vp_stage)
        return range(offset, offset)

    def set_input_tensor(self, input_tensor) -> None:
        """Keep the incoming hidden state for ``forward`` (baseline: megatron's way)."""
        if not self.config.lime:
            return super().set_input_tensor(input_tensor)
        tensors = input_tensor if isinstance(input_tensor, list) else [input_tensor]
        if len(tensors) != 1:
            raise ValueError(f"a GPT chunk takes one stage tensor, got {len(tensors)}")
        self._stage_input = tensors[0]

    def forward(self, *args, extra_block_kwargs: dict | None = None, **kwargs):
        if not self.config.lime:
            return super().forward(*args, extra_block_kwargs=extra_block_kwargs, **kwargs)
        memory = LayerIntegratedMemory(
            self.config.num_layers,
            self.config.lime_router,
            self.config.lime_router_window,
            self.own_layers,
            block=self.routing_block,
            routers=self._routers_by_layer(),
            **self._routing_kernel_settings(),
        )
        pipelined = not (self.pre_process and self.post_process)
        kept = self._side_channel() if pipelined else None
        micro_batch = kept.start_forward(self.global_chunk) if pipelined else 0
        if not self.pre_process:
            stage, self._stage_input = self._stage_input, None
            if stage is None:
                raise RuntimeError("a chunk after the first pipeline stage ran without its stage tensor")
            kept.receive(self.global_chunk, micro_batch, memory, stage)
            self.decoder.set_input_tensor(stage)
        extra_block_kwargs = {**(extra_block_kwargs or {}), "context": memory.handle()}
        output = super().forward(*args, extra_block_kwargs=extra_block_kwargs, **kwargs)
        if not self.post_process:
            kept.send(self.global_chunk, micro_batch, memory, output)
        if pipelined:
            kept.end_forward(self.global_chunk, micro_batch)
        return output

    def _side_channel(self):
        """This schedule call's pipeline side channel (``parallel.pipeline.KeptRows``), handed to the
        chunk by ``parallel.pipeline.schedule_arguments``."""
        kept = self.side_channel
        if kept is None or kept.config is not self.config:
            raise RuntimeError(
                "LIMe under pipeline parallelism needs lime_megatron.parallel.pipeline."
                "schedule_arguments(config, num_microbatches, forward_only, model_chunks) called "
                "for each call of megatron's forward-backward function"
            )
        return kept

    def _routing_kernel_settings(self) -> dict:
        """How this chunk's routing products run on the device its routers are on
        (``kernels.routing_path.routing_kernel``, decided once per device): the memory's
        ``triton``, ``deterministic`` (megatron's ``deterministic_mode``) and, on the Triton path,
        the chunk's ``standing_stack`` of routers and its ``launch_plans``
        (``kernels.launch_plans``), both kept across passes."""
        routers = self._routers_by_layer()
        if not routers:  # a pipeline chunk without layers: nothing is routed
            return {}
        device = next(iter(routers.values())).weight.device
        chosen = getattr(self, "_routing_kernel_of", {})
        if device not in chosen:
            triton = routing_kernel(self.config, device) == "triton"
            standing = triton and bool(self.own_layers)  # kept by the chunk across passes
            settings = dict(
                triton=triton,
                deterministic=self.config.deterministic_mode,
                standing_stack=StandingRouterStack(routers, self.own_layers) if standing else None,
                launch_plans=LaunchPlans() if standing else None,
            )
            self._routing_kernel_of = chosen = {**chosen, device: settings}
        return chosen[device]

    def _routers_by_layer(self) -> dict[int, LimeRouter]:
        """This chunk's routers by global layer index (found once)."""
        if getattr(self, "_router_of_layer", None) is None:
            self._router_of_layer = {router.layer: router for router in self.routers()}
        return self._router_of_layer

    def routers(self) -> list[LimeRouter]:
        """The LIMe routers of this model (chunk), in layer order."""
        return [module for module in self.modules() if isinstance(module, LimeRouter)]


def build_model(
    config: LimeTransformerConfig,
    vocab_size: int,
    max_sequence_length: int,
    *,
    transformer_impl: str = "local",
    pre_process: bool = True,
    post_process: bool = True,
    vp_stage: int | None = None,
    share_embeddings_and_output_weights: bool = True,
    rotary_base: int = 10000,
    routing_block: int | None = None,
) -> LimeGPTModel:
    """LIMe (or, with ``config.lime=False``, the LLaMA baseline) as a megatron GPT model.

    ``vocab_size`` is the padded vocabulary; ``transformer_impl`` picks the layer spec (``local``
    or ``transformer_engine``).  RoPE positions, no learned absolute embeddings, tied input/output
    embeddings by default (paper Table 3).  ``routing_block``: LIMe's routing block size B for this
    chunk (``planning.routing_block.chunk_routing_block`` chooses one; default
    ``routing_blocks.default_routing_block``).  Weights are drawn by ``lime_megatron.models.initialization``
    from ``config.init_seed`` and ``config.init_style``, the same at every parallel layout.
    """
    model = LimeGPTModel(
        config=config,
        transformer_layer_spec=lime_block_spec(config, transformer_impl, vp_stage),
        vocab_size=vocab_size,
        max_sequence_length=max_sequence_length,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=share_embeddings_and_output_weights,
        position_embedding_type="rope",
        rotary_base=rotary_base,
        vp_stage=vp_stage,
        routing_block=routing_block,
    )
    if config.perform_initialization:
        # Layout-invariant initial weights (megatron's own draw depends on the layout).
        initialize_weights(model, config.init_seed, config.init_style)
    return model
