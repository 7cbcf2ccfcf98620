"""Small LIMe/LLaMA models and the weight map to the plain reference of ``reference_lime``."""

from __future__ import annotations

from collections.abc import Callable

import torch

from lime_megatron.models.config import lime_config
from lime_megatron.models.gpt_model import LimeGPTModel, build_model

VOCAB = 96
SEQ = 12
BATCH = 2

# Paper Table 8 (1B models): name, LIMe, kv heads -> (billions as printed, exact count here).
TABLE_8 = {
    ("LLaMA-GQA8", False, 8): (1.07607, 1_076_072_448),
    ("LIMe-GQA8", True, 8): (1.07608, 1_076_081_088),
    ("LLaMA", False, 32): (1.17674, 1_176_735_744),
    ("LIMe", True, 32): (1.17687, 1_176_873_984),
}


def tiny_model(dtype=torch.float64, seed: int = 1234, **overrides) -> LimeGPTModel:
    """A 5-layer tiny model (hidden 32, 4 heads, kv_heads from ``overrides``) in ``dtype``."""
    settings = dict(
        num_layers=5,
        hidden_size=32,
        ffn_hidden_size=48,
        num_attention_heads=4,
        params_dtype=dtype,
        use_cpu_initialization=True,
    )
    settings.update(overrides)
    torch.manual_seed(seed)
    model = build_model(lime_config(**settings), vocab_size=VOCAB, max_sequence_length=SEQ)
    with torch.no_grad():  # megatron zero-initialises nothing we rely on; make norms non-trivial
        for name, param in model.named_parameters():
            if "layernorm" in name:
                param.uniform_(0.5, 1.5)
            if "router.logits" in name:  # the dynamic router's W_l start at zero: make the weights per token
                param.uniform_(-0.5, 0.5)
    return model


def batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens [b, s], position ids [b, s], causal mask [1, 1, s, s] with True = masked)."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1)[None, None]
    return tokens, positions, mask


def megatron_logits(model: LimeGPTModel, tokens, positions, mask) -> torch.Tensor:
    """Logits [b, s, vocab] of the megatron model."""
    return model(tokens, positions, mask)


def reference_params(model: LimeGPTModel) -> tuple[dict, dict[str, torch.Tensor]]:
    """Leaf copies of the megatron parameters (by megatron name) and the reference-layout
    parameter dict built from them differentiably, so reference gradients land on the leaves."""
    cfg = model.config
    leaves = {name: param.detach().clone().requires_grad_(True) for name, param in model.named_parameters()}
    heads, kv_heads, d = cfg.num_attention_heads, cfg.kv_heads, cfg.kv_channels
    layers = []
    for i in range(cfg.num_layers):
        prefix = f"decoder.layers.{i}."
        qkv = leaves[prefix + "self_attention.linear_qkv.weight"]
        # megatron interleaves per kv group: [q heads of the group, k, v] x kv_heads
        grouped = qkv.view(kv_heads, heads // kv_heads + 2, d, cfg.hidden_size)
        gate, up = leaves[prefix + "mlp.linear_fc1.weight"].chunk(2, dim=0)
        layer = dict(
            attn_norm=leaves.get(prefix + "input_layernorm.weight"),
            wq=grouped[:, : heads // kv_heads].reshape(heads * d, -1),
            wk=grouped[:, -2].reshape(kv_heads * d, -1),
            wv=grouped[:, -1].reshape(kv_heads * d, -1),
            wo=leaves[prefix + "self_attention.linear_proj.weight"],
            mlp_norm=leaves.get(prefix + "pre_mlp_layernorm.weight"),
            w_gate=gate,
            w_up=up,
            w_down=leaves[prefix + "mlp.linear_fc2.weight"],
        )
        for connection in ("hc_attn", "hc_mlp"):  # Hyper-Connections: the official parameter names
            start = prefix + connection + "."
            named = {name[len(start) :]: leaf for name, leaf in leaves.items() if name.startswith(start)}
            if named:
                layer[connection] = named
        router = leaves.get(prefix + "self_attention.router.weight")
        if router is not None:
            layer["router"] = router
        dynamic_router = leaves.get(prefix + "self_attention.router.logits.weight")
        if dynamic_router is not None:
            layer["dynamic_router"] = dynamic_router
        layers.append(layer)
    params = dict(
        embedding=leaves["embedding.word_embeddings.weight"],
        final_norm=leaves["decoder.final_layernorm.weight"],
        layers=layers,
    )
    return params, leaves


def reference_spec(model: LimeGPTModel) -> dict:
    """The reference's description of ``model``'s architecture."""
    cfg = model.config
    return dict(
        heads=cfg.num_attention_heads,
        kv_heads=cfg.kv_heads,
        eps=cfg.layernorm_epsilon,
        rope_base=10000,
        lime=cfg.lime,
        variant=cfg.lime_router,
        window=cfg.lime_router_window,
        hyper_connections=cfg.hyper_connections,
        dynamic=not cfg.hyper_connections_static,
        manifold=cfg.hyper_connections_manifold,
        sinkhorn_iterations=cfg.hyper_connections_sinkhorn_iterations,
    )


def loss_of(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of logits [b, s, V] against tokens shifted by one."""
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def compare_with_reference(model: LimeGPTModel, reference_forward) -> dict:
    """One batch through ``model`` and through ``reference_forward(params, tokens, spec)`` on the same
    weights, loss backward on both: ``logits`` and ``loss`` relative errors, and per parameter name
    ``(relative gradient error, |model gradient| sum)`` in ``grads`` (the model's gradients stay on it;
    the reference's are in ``reference_grads``)."""
    tokens, positions, mask = batch()
    logits = megatron_logits(model, tokens, positions, mask)
    loss = loss_of(logits, tokens)
    loss.backward()
    params, leaves = reference_params(model)
    ref_logits = reference_forward(params, tokens, reference_spec(model))
    ref_loss = loss_of(ref_logits, tokens)
    ref_loss.backward()
    grads = {
        name: (relative_error(param.grad, leaves[name].grad), param.grad.abs().sum().item())
        for name, param in model.named_parameters()
    }
    return dict(
        logits=relative_error(logits, ref_logits),
        loss=abs(loss.item() - ref_loss.item()) / ref_loss.item(),
        grads=grads,
        reference_grads={name: leaf.grad for name, leaf in leaves.items()},
    )


def twin_errors(model: LimeGPTModel, twin: LimeGPTModel, name_in_twin=lambda name: name) -> tuple[float, dict]:
    """Two builds of one model (``twin`` holds ``model``'s weights, its parameter names given by
    ``name_in_twin``) on one batch: (relative loss error, {name: relative gradient error})."""
    tokens, positions, mask = batch()
    losses = []
    for each in (model, twin):
        losses.append(loss_of(megatron_logits(each, tokens, positions, mask), tokens))
        losses[-1].backward()
    twins = dict(twin.named_parameters())
    return relative_error(losses[1], losses[0]), {
        name: relative_error(twins[name_in_twin(name)].grad, param.grad) for name, param in model.named_parameters()
    }


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| (absolute when expected is zero)."""
    scale = expected.norm().item()
    diff = (actual - expected).norm().item()
    return diff / scale if scale > 0 else diff


RECOMPUTE = {
    "full-uniform": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    "full-block": dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=3),
    "selective": dict(recompute_granularity="selective"),
}
"""megatron's activation-recompute settings the model tests cover."""


def recompute_gradient_errors(build, recompute: dict) -> dict[str, float]:
    """Relative gradient error, per parameter, of ``build(**recompute)`` against ``build()`` on the
    same weights and batch."""
    plain, recomputed = build(), build(**recompute)
    recomputed.load_state_dict(plain.state_dict())
    tokens, positions, mask = batch()
    for model in (plain, recomputed):
        loss_of(megatron_logits(model, tokens, positions, mask), tokens).backward()
    return {
        name: relative_error(b.grad, a.grad)
        for (name, a), (_, b) in zip(plain.named_parameters(), recomputed.named_parameters())
    }


def prune_by_hand(chunks: list, keep: Callable[[int, int], bool]) -> None:
    """Mask, for every head, the routes of each learned router from the sources ``keep`` rejects,
    then share the reads as the trainer's pruning does (``pruning.share_route_reads``)."""
    from lime_megatron.models.lime.pruning import routers_of, share_route_reads

    for router in routers_of(chunks):
        kept = torch.tensor([keep(router.layer, source) for source in router.sources])
        if router.dynamic:  # [local heads, l + 1]
            router.set_route_mask(kept.expand(router.route_mask.shape))
        else:  # all heads: [kv, n_sources * kv], column j * kv + h reads head h of source j
            kv = router.weight.shape[0]
            router.set_route_mask(kept.repeat_interleave(kv).expand(kv, -1))
    share_route_reads(chunks)
