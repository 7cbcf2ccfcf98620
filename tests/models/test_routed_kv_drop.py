"""The routed-K/V drop says what it did (``lime_megatron.models.lime.recompute.routed_kv_log``).

With ``lime_recompute_routed_kv`` and megatron's own attention (MHA) every layer's routed keys
and values are dropped from the saved tensors and rebuilt once in backward; without it (the
default) nothing is dropped or logged.  A core attention that saves copies (put in through
the layer spec) drops nothing: one warning names it and the bytes that stay, and the gradients
are those of the default attention.  ``drops_routed_kv`` (the memory estimate's decision) agrees.

TransformerEngine per backend, on CPU: stand-ins with ``TEDotProductAttention.forward``'s signature
save what its backends save (cuDNN fused: q, k, v as given and the output handed on; flash-attn:
contiguous ``bshd`` copies of q, k, v and of the output), and the log, the decision and the dry-run
activation estimate (``--attention-backend``) agree with what each really keeps.
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnBackend

from lime_megatron.models.config import lime_config
from lime_megatron.models.gpt_model import LimeGPTModel
from lime_megatron.models.layer_specs import lime_block_spec
from lime_megatron.models.lime.recompute import RoutedKVLog, drops_routed_kv, routed_kv_log
from lime_megatron.parallel.process_groups import initialize_parallel as init_single_process
from lime_megatron.planning.activations import Geometry, layer_activation_bytes
from lime_megatron.testing.saved_tensors import SavedTensorBytes
from tests.lime_fixtures import SEQ, batch, loss_of, relative_error, tiny_model

LAYERS = 5


class CopyingAttention(DotProductAttention):
    """megatron's attention on contiguous copies of its keys and values (as a packing or
    quantizing attention would save them)."""

    def forward(self, query, key, value, *args, **kwargs):
        return super().forward(query, key.clone(), value.clone(), *args, **kwargs)


def with_core_attention(model: LimeGPTModel, core_attention: type) -> LimeGPTModel:
    """A model of ``model``'s config and weights whose layers' core attention is ``core_attention``."""
    block = lime_block_spec(model.config)
    layer = block.layer_specs[0]
    attention = layer.submodules.self_attention
    attention = dataclasses.replace(
        attention, submodules=dataclasses.replace(attention.submodules, core_attention=core_attention)
    )
    layer = dataclasses.replace(layer, submodules=dataclasses.replace(layer.submodules, self_attention=attention))
    copy = LimeGPTModel(
        config=model.config,
        transformer_layer_spec=dataclasses.replace(block, layer_specs=[layer] * len(block.layer_specs)),
        vocab_size=model.vocab_size,
        max_sequence_length=model.max_sequence_length,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=True,
    )
    copy.load_state_dict(model.state_dict())
    return copy


def gradients(model: LimeGPTModel) -> dict[str, torch.Tensor]:
    tokens, positions, mask = batch()
    model.zero_grad()
    loss_of(model(tokens, positions, mask), tokens).backward()
    return {name: param.grad.clone() for name, param in model.named_parameters()}


@pytest.fixture(scope="module", autouse=True)
def megatron():
    init_single_process()


@pytest.fixture()
def fresh_log(monkeypatch):
    """A fresh process log (no earlier warning), in place of ``routed_kv_log``."""
    log = RoutedKVLog()
    for name, value in vars(routed_kv_log).items():
        monkeypatch.setattr(routed_kv_log, name, vars(log)[name] if name in vars(log) else value)
    routed_kv_log.take()
    return routed_kv_log


def test_megatron_attention_drops_and_rebuilds_every_layer(fresh_log, caplog):
    model = tiny_model(lime_recompute_routed_kv=True)
    gradients(model)
    counts = fresh_log.take()
    assert list(counts) == list(range(LAYERS))
    for layer, drops in counts.items():
        assert drops.dropped == {"keys": 1, "values": 1}, layer
        assert not drops.kept, layer
        assert drops.rebuilt == {"routed": 1, "rotated keys": 1}, layer
    assert not fresh_log.warned and "saved its own copies" not in caplog.text
    assert fresh_log.take() == {}  # take() resets: one step's counts


def test_keeping_routed_kv_drops_nothing(fresh_log):
    gradients(tiny_model())
    assert fresh_log.take() == {}


def test_copying_attention_warns_once_and_keeps_the_gradients(fresh_log, caplog):
    model = tiny_model(lime_recompute_routed_kv=True)
    expected = gradients(model)
    fresh_log.take()
    copying = with_core_attention(model, CopyingAttention)
    with caplog.at_level(logging.WARNING, logger="lime_megatron.models.lime.recompute"):
        actual = gradients(copying)
        gradients(copying)
    warnings = [record for record in caplog.records if "saved its own copies" in record.getMessage()]
    assert len(warnings) == 1
    config = model.config
    kv_bytes = SEQ * 2 * config.kv_heads * config.kv_channels * 8  # [s, b, kv heads, d] float64
    message = warnings[0].getMessage()
    assert "CopyingAttention" in message and f"{2 * kv_bytes:,} bytes" in message, message
    # and why: the layout of the keys given, and those of what was saved instead (the clones, as
    # megatron's attention views them: [b * heads, s, d])
    assert f"given keys [{SEQ}, 2, {config.kv_heads}, {config.kv_channels}] float64 stride" in message, message
    assert f"saved instead [{2 * config.kv_heads}, {SEQ}, {config.kv_channels}] float64 stride" in message, message
    counts = fresh_log.take()
    assert all(
        drops.kept == {"keys": 2, "values": 2} and not drops.dropped and not drops.rebuilt for drops in counts.values()
    ), counts
    assert set(actual) == set(expected)
    for name in expected:
        assert relative_error(actual[name], expected[name]) <= 1e-12, name


def test_estimate_decision_matches_the_attention():
    mha = lime_config(num_layers=2, hidden_size=32, num_attention_heads=4, lime_recompute_routed_kv=True)
    gqa = lime_config(
        num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, lime_recompute_routed_kv=True
    )
    assert drops_routed_kv(mha, "local") and not drops_routed_kv(gqa, "local")  # GQA repeats K/V
    assert drops_routed_kv(gqa, "transformer_engine")
    fp8_attention = dataclasses.replace(gqa)
    fp8_attention.fp8, fp8_attention.fp8_dot_product_attention = "e4m3", True
    assert not drops_routed_kv(fp8_attention, "transformer_engine")
    assert not drops_routed_kv(lime_config(num_layers=2, hidden_size=32, num_attention_heads=4), "local")


@pytest.mark.parametrize(
    "settings",
    [dict(), dict(num_query_groups=2), dict(num_query_groups=2, recompute_granularity="selective")],
    ids=["mha", "gqa-repeats-kv", "gqa-checkpointed-core-attention"],
)
def test_the_estimate_decision_is_what_the_attention_does(fresh_log, settings):
    model = tiny_model(lime_recompute_routed_kv=True, **settings)
    gradients(model)
    counts = fresh_log.take()
    dropped = all(drops.dropped == {"keys": 1, "values": 1} and not drops.kept for drops in counts.values())
    kept = all(drops.kept == {"keys": 1, "values": 1} and not drops.dropped for drops in counts.values())
    assert (dropped, kept) == ((True, False) if drops_routed_kv(model.config, "local") else (False, True)), counts


def test_the_estimate_counts_fp8_attention_copies():
    config = lime_config(
        num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, lime_recompute_routed_kv=True
    )
    geometry = Geometry.of(config, seq_length=32, micro_batch_size=2, vocab_size=128)
    dropped = layer_activation_bytes(config, geometry, "transformer_engine")
    config.fp8, config.fp8_dot_product_attention = "e4m3", True
    assert layer_activation_bytes(config, geometry, "transformer_engine") - dropped == 2 * geometry.heads_bytes(
        config.kv_heads
    )  # the routed values and the rotated keys stay


class _StandInAttention(torch.autograd.Function):
    """Attention ``softmax(q k^T * scale + mask) v`` with GQA groups, saving what a TransformerEngine
    backend saves: ``flash`` False (cuDNN fused) the q ``[s, b, h, d]``, k, v ``[s, b, g, d]`` given and
    the output ``[s, b, h*d]`` returned; True (flash-attn) contiguous ``[b, s, heads, d]`` copies of
    q, k, v and of the output, returning an ``sbhd`` copy.  Both keep the fp32 log-sum-exp ``[b, h, s]``."""

    @staticmethod
    def _attend(query, key, value, mask, scale):
        """``[s, b, h, d]`` output and ``[b, h, s]`` log-sum-exp from ``sbhd``-indexed q, k, v."""
        groups = query.shape[2] // key.shape[2]
        key, value = key.repeat_interleave(groups, dim=2), value.repeat_interleave(groups, dim=2)
        scores = torch.einsum("sbhd,tbhd->bhst", query, key) * scale
        scores = scores.masked_fill(mask, float("-inf"))
        out = torch.einsum("bhst,tbhd->sbhd", scores.softmax(-1), value)
        return out, scores.logsumexp(-1).float()

    @staticmethod
    def forward(ctx, query, key, value, mask, scale, flash):
        inputs = tuple(t.transpose(0, 1).contiguous() for t in (query, key, value)) if flash else (query, key, value)
        as_sbhd = (lambda t: t.transpose(0, 1)) if flash else (lambda t: t)
        out, lse = _StandInAttention._attend(*map(as_sbhd, inputs), mask, scale)
        s, b = query.shape[:2]
        if flash:
            saved_out = out.transpose(0, 1).contiguous()
            returned = saved_out.transpose(0, 1).reshape(s, b, -1).contiguous()
        else:
            saved_out = returned = out.reshape(s, b, -1)
        ctx.save_for_backward(*inputs, saved_out, lse)
        ctx.mask, ctx.scale, ctx.as_sbhd = mask, scale, as_sbhd
        return returned

    @staticmethod
    def backward(ctx, grad_out):
        *inputs, _, _ = ctx.saved_tensors
        inputs = [ctx.as_sbhd(t).detach().requires_grad_() for t in inputs]
        with torch.enable_grad():
            out, _ = _StandInAttention._attend(*inputs, ctx.mask, ctx.scale)
            grads = torch.autograd.grad(out.reshape(grad_out.shape), inputs, grad_out)
        return (*grads, None, None, None)


class FusedAttentionStandIn(DotProductAttention):
    """TransformerEngine's cuDNN fused attention as far as saved tensors go (``_StandInAttention``)."""

    flash = False

    def forward(
        self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None
    ):
        return _StandInAttention.apply(query, key, value, attention_mask, self.softmax_scale, self.flash)


class FlashAttentionStandIn(FusedAttentionStandIn):
    """TransformerEngine's flash-attn backend as far as saved tensors go."""

    flash = True


STAND_INS = {"fused": FusedAttentionStandIn, "flash": FlashAttentionStandIn}


def te_config(model: LimeGPTModel, backend: str):
    config = dataclasses.replace(model.config)
    config.attention_backend = AttnBackend[backend]
    return config


@pytest.mark.parametrize("backend", sorted(STAND_INS))
def test_te_attention_stand_ins_log_what_the_estimate_decides(fresh_log, backend):
    model = tiny_model(num_query_groups=2, lime_recompute_routed_kv=True)
    expected = gradients(model)
    fresh_log.take()
    actual = gradients(with_core_attention(model, STAND_INS[backend]))
    counts = fresh_log.take()
    dropped = drops_routed_kv(te_config(model, backend), "transformer_engine")
    assert dropped == (backend == "fused")
    names = {"keys": 1, "values": 1}
    assert all((drops.dropped, drops.kept) == ((names, {}) if dropped else ({}, names)) for drops in counts.values()), (
        counts
    )
    for name in expected:  # the stand-ins compute megatron's attention
        assert relative_error(actual[name], expected[name]) <= 1e-12, name


def test_dry_run_estimate_per_te_backend_equals_the_bytes_kept():
    """The estimate's difference between the flash and fused backends, per layer, equals the
    difference of the bytes autograd saves with the two stand-ins."""
    model = tiny_model(num_query_groups=2, lime_recompute_routed_kv=True)
    tokens, positions, mask = batch()
    saved = {}
    for backend, attention in STAND_INS.items():
        stand_in = with_core_attention(model, attention)
        with SavedTensorBytes(stand_in) as counter:
            loss_of(stand_in(tokens, positions, mask), tokens)
        saved[backend] = counter.bytes
    geometry = Geometry.of(model.config, seq_length=SEQ, micro_batch_size=tokens.shape[0], vocab_size=model.vocab_size)
    estimate = {
        backend: layer_activation_bytes(te_config(model, backend), geometry, "transformer_engine")
        for backend in STAND_INS
    }
    print(
        f"saved bytes fused {saved['fused']:,} flash {saved['flash']:,}; per-layer estimate fused "
        f"{estimate['fused']:,} flash {estimate['flash']:,}"
    )
    assert saved["flash"] - saved["fused"] == LAYERS * (estimate["flash"] - estimate["fused"]) > 0
