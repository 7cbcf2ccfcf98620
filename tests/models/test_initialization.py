"""Layout-invariant initialisation (lime_megatron.models.initialization): the drawn distributions of
each init style, the same full weights at every layout, and from-scratch runs of
pretrain_lime.py at pipeline/tensor/data-parallel layouts reproducing the single-process losses."""

from __future__ import annotations

import math

import pytest
import torch

from lime_megatron.models.config import lime_config
from lime_megatron.models.gpt_model import build_model
from lime_megatron.models.initialization import INIT_STYLES, initialize_weights, local_shard
from lime_megatron.models.lime.head_parallel import HeadSharding
from lime_megatron.parallel.process_groups import initialize_parallel
from lime_megatron.testing.distributed import ShardRule, run_distributed

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]

VOCAB, SEQ = 512, 16
HIDDEN, HEADS, KV_HEADS, LAYERS = 256, 8, 2, 4
HEAD_DIM = HIDDEN // HEADS


def _model(init_style: str = "megatron", seed: int = 1234, **overrides):
    initialize_parallel()
    settings = dict(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        ffn_hidden_size=512,
        num_attention_heads=HEADS,
        num_query_groups=KV_HEADS,
        use_cpu_initialization=True,
        init_style=init_style,
        init_seed=seed,
    )
    settings.update(overrides)
    return build_model(lime_config(**settings), VOCAB, SEQ)


def _params(model) -> dict[str, torch.Tensor]:
    return {name: param.detach().clone() for name, param in model.named_parameters()}


def _split_qkv(qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(query rows, key/value rows) of megatron's fused QKV weight (rows grouped per kv head)."""
    grouped = qkv.view(KV_HEADS, HEADS // KV_HEADS + 2, HEAD_DIM, HIDDEN)
    return grouped[:, :-2].reshape(-1, HIDDEN), grouped[:, -2:].reshape(-1, HIDDEN)


def _assert_normal(tensor: torch.Tensor, std: float) -> None:
    assert abs(tensor.mean().item()) < 4 * std / math.sqrt(tensor.numel())
    assert tensor.std().item() == pytest.approx(std, rel=0.05)
    assert tensor.abs().max().item() > 2.5 * std  # a normal, not a uniform of that std


def _assert_uniform(tensor: torch.Tensor, bound: float) -> None:
    assert tensor.abs().max().item() <= bound
    assert tensor.abs().max().item() > 0.98 * bound
    assert tensor.std().item() == pytest.approx(bound / math.sqrt(3), rel=0.05)


def _assert_router(weight: torch.Tensor, layer: int) -> None:
    """Paper App. A/E: identity on the own layer's heads, Kaiming-uniform sqrt(3 / fan_in) elsewhere."""
    fan_in = (layer + 1) * KV_HEADS
    assert weight.shape == (KV_HEADS, fan_in)
    torch.testing.assert_close(weight[:, -KV_HEADS:], torch.eye(KV_HEADS), rtol=0, atol=0)
    others = weight[:, :-KV_HEADS]
    assert others.abs().max().item() <= math.sqrt(3 / fan_in)
    assert others.unique().numel() == others.numel()


@pytest.mark.parametrize("style", INIT_STYLES)
def test_each_weight_has_its_styles_distribution(style):
    params = _params(_model(style))
    std, scaled = 0.02, 0.02 / math.sqrt(2 * LAYERS)
    _assert_normal(params["embedding.word_embeddings.weight"], std)
    for layer in range(LAYERS):
        prefix = f"decoder.layers.{layer}."
        queries, keys_values = _split_qkv(params[prefix + "self_attention.linear_qkv.weight"])
        _assert_normal(queries, std)
        if style == "official":
            _assert_uniform(keys_values, 1 / math.sqrt(HIDDEN))
        else:
            _assert_normal(keys_values, std)
        _assert_normal(params[prefix + "mlp.linear_fc1.weight"], std)
        output_std = std if style == "official" else scaled
        _assert_normal(params[prefix + "self_attention.linear_proj.weight"], output_std)
        _assert_normal(params[prefix + "mlp.linear_fc2.weight"], output_std)
        for norm in ("input_layernorm.weight", "pre_mlp_layernorm.weight"):
            assert torch.equal(params[prefix + norm], torch.ones(HIDDEN))
        if layer:
            _assert_router(params[prefix + "self_attention.router.weight"], layer)
    assert torch.equal(params["decoder.final_layernorm.weight"], torch.ones(HIDDEN))


def test_official_style_keeps_the_baselines_key_values_normal():
    """The released baseline is a plain HF LLaMA: its k/v projections are nn.Linear, N(0, 0.02)."""
    params = _params(_model("official", lime=False))
    _, keys_values = _split_qkv(params["decoder.layers.1.self_attention.linear_qkv.weight"])
    _assert_normal(keys_values, 0.02)


def test_weights_depend_on_the_seed_and_differ_between_layers():
    first, again, other = _params(_model(seed=7)), _params(_model(seed=7)), _params(_model(seed=8))
    for name in first:
        assert torch.equal(first[name], again[name]), name
    qkv = "self_attention.linear_qkv.weight"
    assert not torch.equal(first[f"decoder.layers.0.{qkv}"], other[f"decoder.layers.0.{qkv}"])
    assert not torch.equal(first[f"decoder.layers.0.{qkv}"], first[f"decoder.layers.1.{qkv}"])


def test_an_unknown_style_is_refused():
    with pytest.raises(ValueError, match="unknown init style 'torch'"):
        initialize_weights(_model(), 1, "torch")


def test_a_pipeline_chunk_draws_the_single_process_weights_of_its_layers():
    """The chunks of virtual stage 1 (global layer 2, here at local index 0) and of a last stage
    with a tied output layer get the weights the single-process model has for those names."""
    full = _params(_model())
    split = dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2, pipeline_dtype=torch.float32)
    chunk = build_model(
        lime_config(
            num_layers=LAYERS,
            hidden_size=HIDDEN,
            ffn_hidden_size=512,
            num_attention_heads=HEADS,
            num_query_groups=KV_HEADS,
            use_cpu_initialization=True,
            **split,
        ),
        VOCAB,
        SEQ,
        pre_process=False,
        post_process=True,
        vp_stage=1,
    )
    got = _params(chunk)
    assert [layer.layer_number for layer in chunk.decoder.layers] == [3]
    for name, tensor in got.items():
        single = name.replace("decoder.layers.0.", "decoder.layers.2.")
        single = "embedding.word_embeddings.weight" if name == "output_layer.weight" else single
        assert torch.equal(tensor, full[single]), name


def test_tensor_parallel_shards_reassemble_the_full_weights():
    """Every parameter's shards (production split, TP 2 and 4) put together by the test-side
    ShardRule give the single-process tensor; routers split by input head, replicated when
    kv heads < TP."""
    model = _model()
    gated_fc1 = ShardRule(dim=0, blocks=2)
    rules = {
        "linear_qkv": ShardRule(dim=0),
        "linear_fc1": gated_fc1,
        "linear_proj": ShardRule(dim=1),
        "linear_fc2": ShardRule(dim=1),
        "word_embeddings": ShardRule(dim=0),
    }
    for tp in (2, 4):
        for name, param in model.named_parameters():
            if "router" in name:
                continue
            rule = next((r for key, r in rules.items() if key in name), ShardRule())
            shards = [local_shard(param.detach(), name, param, None, True, rank, tp) for rank in range(tp)]
            assert torch.equal(rule.unshard(shards), param.detach()), (name, tp)
    for router in model.routers():
        if not router.learned:
            continue
        full = router.weight.detach()
        for tp in (2, 4):
            heads = {}
            for rank in range(tp):
                router.sharding = HeadSharding(KV_HEADS, rank, tp)
                shard = local_shard(full, "", router.weight, router, True, rank, tp)
                columns = shard.view(KV_HEADS, len(router.sources), -1)
                for i, head in enumerate(router.sharding.local_heads):
                    heads.setdefault(head, []).append(columns[..., i])
            assert sorted(heads) == list(range(KV_HEADS))
            for head, copies in heads.items():
                for copy in copies:
                    assert torch.equal(copy, full.view(KV_HEADS, len(router.sources), KV_HEADS)[..., head])
        router.sharding = HeadSharding(KV_HEADS)


# --------------------------------------------------------------------------- through the trainer

TRAIN = (
    "--num-layers 4 --hidden-size 64 --num-attention-heads 4 --num-query-groups 2 "
    "--seq-length 32 --micro-batch-size 2 --global-batch-size 8 --lr 1e-3 --mock-data "
    "--vocab-size 128 --log-interval 100 --eval-iters 0 --lime --train-iters 4"
).split()
LAYOUTS = {
    "pp4": ["--pipeline-model-parallel-size", "4"],
    "tp2-pp2-vpp2-sp": [
        "--tensor-model-parallel-size",
        "2",
        "--pipeline-model-parallel-size",
        "2",
        "--num-virtual-stages-per-pipeline-rank",
        "2",
        "--sequence-parallel",
    ],
    "pp2-dp2": ["--pipeline-model-parallel-size", "2"],
}


def _train_runs(runs: list) -> list:
    from lime_megatron.training.trainer import train

    return [train(argv).losses for argv in runs]


@pytest.mark.slow
def test_from_scratch_layouts_reproduce_the_single_process_losses():
    [reference] = run_distributed(_train_runs, 1, [TRAIN])[0]
    results = run_distributed(_train_runs, 4, [TRAIN + flags for flags in LAYOUTS.values()], nccl_rules=True)[0]
    for name, losses in zip(LAYOUTS, results):
        assert sorted(losses) == sorted(reference), name
        errors = {i: abs(losses[i] - reference[i]) for i in reference}
        assert max(errors.values()) <= 1e-5, (name, errors)


def test_init_style_and_seed_come_from_the_trainer_flags():
    from lime_megatron.training import arguments

    flags = (
        "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --micro-batch-size 1 "
        "--lr 1e-3 --train-iters 1 --mock-data --vocab-size 64 --lime --seed 77"
    ).split()
    default = arguments.transformer_config(arguments.parse_run(flags))
    official = arguments.transformer_config(arguments.parse_run(flags + ["--init-style", "official"]))
    assert (default.init_style, default.init_seed) == ("megatron", 77)
    assert (official.init_style, official.init_seed) == ("official", 77)
