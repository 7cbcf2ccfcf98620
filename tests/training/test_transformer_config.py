"""The model options are declared once, in the run config, and reach the model: every run option
that names a ``TransformerConfig`` field (``transformer=`` in ``run_config``), set on the command
line to a value other than its default, arrives in the config ``arguments.transformer_config``
builds, and the values it computes from options do too; the LIMe and Hyper-Connections options
arrive in the model the trainer builds from that config; every field ``LimeTransformerConfig`` adds
to megatron's has an option; and a LIMe option's default is the config's or unset.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from megatron.core.transformer.enums import AttnBackend
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import unwrap_model

from lime_megatron.models.config import LimeTransformerConfig
from lime_megatron.models.hyper_connections.connection import HyperConnection
from lime_megatron.models.hyper_connections.manifold import ManifoldHyperConnection
from lime_megatron.planning.routing_block import MACHINES, routing_machine
from lime_megatron.training import arguments, trainer
from lime_megatron.training.run_config import GROUPS, transformer_field

# megatron-core's notices on CPU (no apex/TE, deprecated defaults) repeat for every model built.
pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]

VOCAB = 128
BASE = (
    f"--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 16 --micro-batch-size 1 "
    f"--train-iters 2 --lr 1e-3 --mock-data --vocab-size {VOCAB}"
).split()
PIPELINE = ["--pipeline-model-parallel-size", "2"]
INTERLEAVED = ["--num-layers", "8", *PIPELINE, "--num-virtual-stages-per-pipeline-rank", "2"]
TE = ["--dry-run", "--transformer-impl", "transformer_engine"]  # the dry run checks no GPU

CASES = [  # flags added to BASE, world size -> the config fields they set, with their values
    (["--num-layers", "8"], 1, dict(num_layers=8)),
    (["--hidden-size", "128"], 1, dict(hidden_size=128)),
    (["--ffn-hidden-size", "96"], 1, dict(ffn_hidden_size=96)),
    (["--num-attention-heads", "8"], 1, dict(num_attention_heads=8)),
    (["--group-query-attention", "--num-query-groups", "2"], 1, dict(num_query_groups=2)),
    (["--kv-channels", "8"], 1, dict(kv_channels=8)),
    (["--norm-epsilon", "1e-6"], 1, dict(layernorm_epsilon=1e-6)),
    (["--init-method-std", "0.01"], 1, dict(init_method_std=0.01)),
    (["--hidden-dropout", "0.1"], 1, dict(hidden_dropout=0.1)),
    (["--attention-dropout", "0.1"], 1, dict(attention_dropout=0.1)),
    (TE, 1, dict(transformer_impl="transformer_engine")),
    ([*TE, "--attention-backend", "flash"], 1, dict(attention_backend=AttnBackend.flash)),
    (["--init-style", "official"], 1, dict(init_style="official")),
    (["--seed", "7"], 1, dict(init_seed=7)),
    (
        ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "2"],
        1,
        dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2),
    ),
    (
        ["--hyper-connections", "2", "--hyper-connections-static"],
        1,
        dict(hyper_connections=2, hyper_connections_static=True),
    ),
    (
        ["--hyper-connections", "2", "--hyper-connections-manifold", "--hyper-connections-sinkhorn-iterations", "5"],
        1,
        dict(hyper_connections_manifold=True, hyper_connections_sinkhorn_iterations=5),
    ),
    (["--lime"], 1, dict(lime=True)),
    (
        ["--lime", "--lime-router", "last", "--lime-router-window", "2"],
        1,
        dict(lime_router="last", lime_router_window=2),
    ),
    (["--lime", "--lime-routing-block", "2"], 1, dict(lime_routing_block=2)),
    (["--lime", "--lime-machine", "h100"], 1, dict(lime_machine="h100")),
    (["--lime", "--lime-routing-kernel", "torch"], 1, dict(lime_routing_kernel="torch")),
    (["--lime", "--lime-recompute-routed-kv"], 1, dict(lime_recompute_routed_kv=True)),
    (["--lime", "--lime-prune-top-p", "0.5", "--lime-prune-iters", "1"], 1, dict(lime_prune_top_p=0.5)),
    (
        ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
        2,
        dict(tensor_model_parallel_size=2, sequence_parallel=True),
    ),
    (
        INTERLEAVED,
        2,
        dict(
            pipeline_model_parallel_size=2,
            virtual_pipeline_model_parallel_size=2,
            overlap_p2p_comm=True,
            batch_p2p_comm=False,
        ),
    ),
    ([*PIPELINE, "--decoder-first-pipeline-num-layers", "1"], 2, dict(num_layers_in_first_pipeline_stage=1)),
    ([*PIPELINE, "--decoder-last-pipeline-num-layers", "1"], 2, dict(num_layers_in_last_pipeline_stage=1)),
    (
        ["--bf16"],
        1,
        dict(bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16, autocast_dtype=torch.bfloat16),
    ),
    (["--dry-run", "--fp16"], 1, dict(fp16=True, params_dtype=torch.float16)),
    (
        [
            *TE,
            "--bf16",
            "--fp8-format",
            "hybrid",
            "--fp8-recipe",
            "tensorwise",
            "--fp8-margin",
            "1",
            "--fp8-amax-history-len",
            "16",
            "--fp8-amax-compute-algo",
            "max",
        ],
        1,
        dict(fp8="hybrid", fp8_recipe="tensorwise", fp8_margin=1, fp8_amax_history_len=16, fp8_amax_compute_algo="max"),
    ),
    (["--dry-run", "--sft"], 1, dict(calculate_per_token_loss=True)),
]

NOT_OPTIONS = {"lime_route_reads"}
"""``LimeTransformerConfig`` fields no option sets (route pruning fills this one in the model)."""

RUN_DEFAULTS_OF_THEIR_OWN = {"lime"}
"""LIMe fields whose option defaults to another value than the config: the trainer runs the LLaMA
baseline unless ``--lime``; a ``LimeTransformerConfig`` is LIMe unless ``lime=False``."""


def config_of(flags: list[str], world_size: int = 1) -> LimeTransformerConfig:
    """``transformer_config`` of the run of ``BASE + flags``, parsed as ``pretrain_lime.py`` does."""
    return arguments.transformer_config(arguments.parse_run(BASE + flags, world_size=world_size))


def model_of(flags: list[str]):
    """The model the trainer builds for the run of ``BASE + flags`` (one process, one chunk), unwrapped."""
    run = arguments.parse_run(BASE + flags, world_size=1)
    with trainer.distributed(run):
        (chunk,) = trainer.build_model_chunks(
            arguments.transformer_config(run), VOCAB, run.model.max_sequence_length, seq_length=run.model.seq_length
        )
    return unwrap_model(chunk)


def declared_fields() -> dict[str, str]:
    """The ``TransformerConfig`` field of each run option that declares one, by option name."""
    return {
        spec.name: transformer_field(spec)
        for group in GROUPS.values()
        for spec in dataclasses.fields(group)
        if transformer_field(spec)
    }


@pytest.mark.parametrize("flags,world_size,expected", CASES, ids=[" ".join(case[0]) for case in CASES])
def test_each_option_reaches_the_transformer_config(flags, world_size, expected):
    config, default = config_of(flags, world_size), config_of([])
    for name, value in expected.items():
        assert getattr(config, name) == value != getattr(default, name), name


def test_every_declared_option_has_a_case_and_a_config_field():
    covered = {name for _, _, expected in CASES for name in expected}
    declared = declared_fields()
    assert set(declared.values()) <= covered
    assert set(declared.values()) <= {spec.name for spec in dataclasses.fields(LimeTransformerConfig)}


def test_cpu_initialisation_follows_the_device():
    assert config_of([]).use_cpu_initialization == (not torch.cuda.is_available())


def test_every_lime_config_field_has_an_option():
    megatron = {spec.name for spec in dataclasses.fields(TransformerConfig)}
    added = {spec.name for spec in dataclasses.fields(LimeTransformerConfig)} - megatron
    assert added - NOT_OPTIONS <= set(declared_fields().values())


def test_lime_option_defaults_are_the_configs_or_unset():
    defaults = {spec.name: spec.default for spec in dataclasses.fields(LimeTransformerConfig)}
    added = set(defaults) - {spec.name for spec in dataclasses.fields(TransformerConfig)}
    for group in GROUPS.values():
        for spec in dataclasses.fields(group):
            target = transformer_field(spec)
            if target in added - RUN_DEFAULTS_OF_THEIR_OWN:
                assert spec.default in (None, defaults[target]), spec.name
    # unset: the config's default, in the run's config as in the model library's
    assert (config_of(["--lime"]).lime_router, config_of([]).lime_machine) == ("full", "auto")
    assert routing_machine(config_of(["--lime", "--lime-machine", "h100"])) is MACHINES["h100"]


@pytest.mark.parametrize(
    "flags,sources",
    [
        (["--lime"], [[0], [0, 1], [0, 1, 2], [0, 1, 2, 3]]),
        (["--lime", "--lime-router", "last", "--lime-router-window", "2"], [[0], [0, 1], [1, 2], [2, 3]]),
        (["--lime", "--lime-router", "first", "--lime-router-window", "1"], [[0], [0, 1], [0, 2], [0, 3]]),
    ],
)
def test_router_options_reach_the_models_routers(flags, sources):
    routers = [layer.self_attention.router for layer in model_of(flags).decoder.layers]
    assert [router.sources for router in routers] == sources


def test_lime_options_reach_the_model():
    lime = model_of(["--lime"])
    assert not any(hasattr(layer.self_attention, "router") for layer in model_of([]).decoder.layers)
    model = model_of(
        [
            "--lime",
            "--lime-routing-block",
            "3",
            "--lime-recompute-routed-kv",
            "--lime-prune-top-p",
            "0.5",
            "--lime-prune-iters",
            "1",
        ]
    )
    routers = [layer.self_attention.router for layer in model.decoder.layers]
    assert model.routing_block == 3 != lime.routing_block
    assert [router.prunable for router in routers] == [False, True, True, True]  # layer 0 routes by identity
    assert all(layer.self_attention.config.lime_recompute_routed_kv for layer in model.decoder.layers)
    dynamic = model_of(["--lime", "--lime-router", "dynamic"])
    assert [layer.self_attention.router.dynamic for layer in dynamic.decoder.layers] == [False, True, True, True]


def test_hyper_connection_options_reach_the_model():
    static = model_of(["--hyper-connections", "2", "--hyper-connections-static"])
    assert {(hc.streams, hc.dynamic) for hc in static.modules() if isinstance(hc, HyperConnection)} == {(2, False)}
    manifold = model_of(
        ["--hyper-connections", "3", "--hyper-connections-manifold", "--hyper-connections-sinkhorn-iterations", "5"]
    )
    assert {(hc.streams, hc.iterations) for hc in manifold.modules() if isinstance(hc, ManifoldHyperConnection)} == {
        (3, 5)
    }


def test_initialisation_options_reach_the_models_weights():
    # the attention output projection: another seed draws other values, the official style unscaled ones
    default, seeded, official = [
        model_of(flags).decoder.layers[0].self_attention.linear_proj.weight
        for flags in ([], ["--seed", "7"], ["--init-style", "official"])
    ]
    assert not torch.equal(default, seeded) and not torch.equal(default, official)
