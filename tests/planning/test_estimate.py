"""lime_megatron.planning.estimate against measured reality: parameter counts of models megatron builds
(one process, and every rank of TP/PP/VPP/uneven layouts on 4 gloo ranks), saved activation
bytes against ``saved_tensors.SavedTensorBytes`` (TP=1 in-process; TP=2 with and without sequence
parallelism on ranks), megatron's pipeline schedule order, the report and bad input."""

from __future__ import annotations

import re

import pytest
import torch
from megatron.core.pipeline_parallel.schedules import get_schedule_table

from lime_megatron.models.config import PAPER_1B, PAPER_VOCAB_SIZE, lime_config
from lime_megatron.models.gpt_model import build_model
from lime_megatron.models.lime.head_parallel import HeadSharding
from lime_megatron.models.lime.router import LimeRouter
from lime_megatron.models.lime.routing_blocks import RouterStack
from lime_megatron.parallel.process_groups import initialize_parallel
from lime_megatron.planning import activations
from lime_megatron.planning import estimate as E
from lime_megatron.planning.schedule_model import rank_operations
from lime_megatron.testing.saved_tensors import SavedTensorBytes
from tests.lime_fixtures import TABLE_8

VOCAB, SEQ, BATCH = 128, 32, 2
# Saved bytes the estimate leaves out on purpose: LIMe's 8-byte memory handle and a few scalars.
SAVED_BYTES_SLACK = 16
TINY = dict(
    num_layers=3,
    hidden_size=64,
    ffn_hidden_size=96,
    num_attention_heads=4,
    use_cpu_initialization=True,
    transformer_impl="local",
)


def tiny_config(**overrides):
    return lime_config(**{**TINY, **overrides})


def one_chunk(config, **kwargs):
    """The single chunk of a PP=1 estimate."""
    result = E.estimate(config, vocab_size=VOCAB, seq_length=SEQ, micro_batch_size=BATCH, num_microbatches=1, **kwargs)
    (stage,) = result.stages
    (chunk,) = stage.chunks
    return result, chunk


def saved_bytes(config) -> int:
    """Bytes autograd saves in one forward (with loss) of a freshly built model."""
    torch.manual_seed(0)
    model = build_model(config, vocab_size=VOCAB, max_sequence_length=SEQ)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ))
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    with SavedTensorBytes(model) as saved:
        model(tokens, positions, None, labels=tokens)
    return saved.bytes


def router_stacks_built(config) -> dict[str, int]:
    """Bytes of the ``RouterStack`` matrices one forward (with loss) and its backward build, by
    pass, in a freshly built model."""
    torch.manual_seed(0)
    model = build_model(config, vocab_size=VOCAB, max_sequence_length=SEQ)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ))
    built, build, phase = {"forward": 0, "backward": 0}, RouterStack.__init__, ["forward"]

    def counted_build(stack, *args):
        build(stack, *args)
        built[phase[0]] += stack.matrix.numel() * stack.matrix.element_size()

    RouterStack.__init__ = counted_build
    try:
        loss = model(tokens, torch.arange(SEQ).expand(BATCH, SEQ), None, labels=tokens).float().sum()
        phase[0] = "backward"
        loss.backward()
    finally:
        RouterStack.__init__ = build
    return built


SAVED_CASES = {
    "llama": dict(lime=False),
    "llama-gqa": dict(lime=False, num_query_groups=2),
    "lime": dict(),
    "lime-gqa": dict(num_query_groups=2),
    "lime-mqa-last2": dict(num_query_groups=1, lime_router="last", lime_router_window=2),
    "lime-kv-recompute": dict(lime_recompute_routed_kv=True),
    "lime-gqa-kv-recompute": dict(num_query_groups=2, lime_recompute_routed_kv=True),
    "llama-selective": dict(lime=False, recompute_granularity="selective"),
    "lime-selective": dict(recompute_granularity="selective"),
    "lime-gqa-selective-mlp": dict(
        num_query_groups=2, recompute_granularity="selective", recompute_modules=["core_attn", "mlp"]
    ),
    "llama-selective-mlp": dict(lime=False, recompute_granularity="selective", recompute_modules=["mlp"]),
    "llama-full-uniform": dict(
        lime=False, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
    ),
    "lime-full-block": dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=2),
    "llama-bf16": dict(lime=False, bf16=True, params_dtype=torch.bfloat16),
    "lime-gqa-bf16": dict(num_query_groups=2, bf16=True, params_dtype=torch.bfloat16),
    "dynamic": dict(lime_router="dynamic"),
    "dynamic-gqa-bf16": dict(lime_router="dynamic", num_query_groups=2, bf16=True, params_dtype=torch.bfloat16),
    "dynamic-full-block": dict(
        lime_router="dynamic", recompute_granularity="full", recompute_method="block", recompute_num_layers=2
    ),
}


@pytest.mark.parametrize("overrides", SAVED_CASES.values(), ids=SAVED_CASES.keys())
def test_activation_estimate_equals_saved_tensor_bytes(overrides):
    initialize_parallel()
    config = tiny_config(**overrides)
    _, chunk = one_chunk(config)
    kept = chunk.activations.total - chunk.activations.router_stack  # not a saved tensor
    assert abs(kept - saved_bytes(config)) <= SAVED_BYTES_SLACK


STACK_CASES = {
    "per-layer": dict(lime_routing_block=1),
    "blocked": dict(lime_routing_block=2),
    "blocked-gqa-bf16": dict(lime_routing_block=2, num_query_groups=2, bf16=True, params_dtype=torch.bfloat16),
    "blocked-last1": dict(lime_routing_block=2, lime_router="last", lime_router_window=1),
    "blocked-average": dict(lime_routing_block=2, lime_router="average"),
    "dynamic": dict(lime_router="dynamic"),
    "llama": dict(lime=False),
}


def test_router_stack_of_a_later_chunk_has_the_columns_of_every_earlier_layer():
    """A pipeline chunk's stack (layers 2-4 of 6, GQA) holds its routers' columns of layers 0-4."""
    initialize_parallel()
    config = tiny_config(num_layers=6, num_query_groups=2)
    chunk = range(2, 5)
    routers = {layer: LimeRouter(config, layer, HeadSharding(config.kv_heads)) for layer in chunk}
    matrix = RouterStack(routers, chunk, torch.empty(0)).matrix
    assert matrix.shape == (3 * 2, 5 * 2)
    geometry = activations.Geometry.of(config, SEQ, BATCH, VOCAB)
    assert activations.router_stack_bytes(config, geometry, chunk) == matrix.numel() * matrix.element_size()
    assert activations.forward_builds_router_stack(config, chunk, 3)  # the block reads layers 0-1


@pytest.mark.parametrize("overrides", STACK_CASES.values(), ids=STACK_CASES.keys())
def test_router_stack_estimate_equals_the_stack_built(overrides):
    """The estimate's router stack is the one the memory builds: in forward where a block mixes
    sources before it (kept per microbatch), else in backward (the working set); none without
    static routers."""
    initialize_parallel()
    config = tiny_config(**overrides)
    _, chunk = one_chunk(config)
    built = router_stacks_built(config)
    assert built == {"forward": chunk.activations.router_stack, "backward": chunk.backward_working_bytes}
    assert (built["forward"] + built["backward"] > 0) == (config.lime and config.lime_router != "dynamic")


def test_full_recompute_keeps_the_lime_memory_live_but_not_saved():
    """Uniform full recompute saves only group inputs; LIMe's memory buffer is referenced by the
    memory object every checkpoint keeps (not a saved tensor), so it is added on top."""
    initialize_parallel()
    config = tiny_config(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=3)
    _, chunk = one_chunk(config)
    measured = saved_bytes(config)
    assert chunk.activations.lime_memory == 3 * 2 * SEQ * BATCH * 4 * 16 * 4  # layers*K,V*s*b*g*d*4
    assert abs(chunk.activations.total - chunk.activations.lime_memory - measured) <= SAVED_BYTES_SLACK
    geometry = activations.Geometry.of(config, SEQ, BATCH, VOCAB)
    stack_in_backward = activations.router_stack_bytes(config, geometry, range(3)) - chunk.activations.router_stack
    assert (
        chunk.backward_working_bytes
        == 3 * activations.layer_activation_bytes(config, geometry, "local") + stack_in_backward
    )


ROUTER_CASES = {
    "lime-full": dict(),
    "lime-last2-gqa": dict(num_query_groups=2, lime_router="last", lime_router_window=2),
    "lime-first1": dict(lime_router="first", lime_router_window=1),
    "lime-average": dict(lime_router="average"),
    "lime-dynamic-gqa": dict(num_query_groups=2, lime_router="dynamic"),
    "llama": dict(lime=False),
}


@pytest.mark.parametrize("overrides", ROUTER_CASES.values(), ids=ROUTER_CASES.keys())
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_parameters_equal_a_built_model(overrides, tied):
    initialize_parallel()
    config = tiny_config(num_layers=5, **overrides)
    result, chunk = one_chunk(config, share_embeddings_and_output_weights=tied)
    model = build_model(config, vocab_size=VOCAB, max_sequence_length=SEQ, share_embeddings_and_output_weights=tied)
    assert chunk.parameters == result.total_parameters == sum(p.numel() for p in model.parameters())
    routers = [p for name, p in model.named_parameters() if "router" in name]
    assert chunk.router_parameters == result.router_parameters == sum(p.numel() for p in routers)


@pytest.mark.parametrize("name,lime,kv_heads", list(TABLE_8), ids=[k[0] for k in TABLE_8])
def test_paper_table_8_counts_at_any_layout(name, lime, kv_heads):
    """The 1B models of Table 8: the same total at PP=1 and split over TP2 x PP2 x VPP2."""
    exact = TABLE_8[(name, lime, kv_heads)][1]
    for layout in (
        dict(),
        dict(
            tensor_model_parallel_size=2,
            pipeline_model_parallel_size=2,
            virtual_pipeline_model_parallel_size=2,
            pipeline_dtype=torch.float32,
        ),
    ):
        config = lime_config(**PAPER_1B, num_query_groups=kv_heads, lime=lime, **layout)
        # The paper counts the unpadded GPT-2 vocabulary; TP=2 needs an even one.
        vocab = PAPER_VOCAB_SIZE + (1 if layout else 0)
        result = E.estimate(config, vocab_size=vocab, seq_length=2048, micro_batch_size=1, num_microbatches=4)
        assert result.total_parameters == exact + (config.hidden_size if layout else 0)


# ------------------------------------------------------------------------------ schedules


def test_one_f_one_b_keeps_p_minus_r_microbatches():
    config = tiny_config(num_layers=4, pipeline_model_parallel_size=4, pipeline_dtype=torch.float32)
    assert [E.peak_in_flight(config, r, 8, [10])[0] for r in range(4)] == [4, 3, 2, 1]
    assert [E.peak_in_flight(config, r, 2, [10])[0] for r in range(4)] == [2, 2, 2, 1]
    assert E.peak_in_flight(tiny_config(), 0, 8, [10]) == (1, 10)


def test_interleaved_peak_replays_megatron_order():
    config = tiny_config(
        num_layers=4,
        pipeline_model_parallel_size=2,
        virtual_pipeline_model_parallel_size=2,
        pipeline_dtype=torch.float32,
    )
    forwards = [op.chunk for op in rank_operations(2, 2, 0, 4, 2) if op.forward]
    assert forwards == [chunk for _, chunk in get_schedule_table(4, 2, 2)] == [0, 0, 1, 1, 0, 0, 1, 1]
    # Rank 0 warms up 2*(2-0-1) + (2-1)*2 = 4 forwards ([2, 2] per chunk), then alternates one
    # forward and one backward (backwards walk the chunks in reverse): peaks [3, 2], [4, 1].
    assert E.peak_in_flight(config, 0, 4, [1, 10]) == (5, 23)
    assert E.peak_in_flight(config, 0, 4, [10, 1]) == (5, 41)
    # The last rank warms up (2-1)*2 = 2 forwards.
    assert E.peak_in_flight(config, 1, 4, [1, 1]) == (3, 3)


# ------------------------------------------------------------------------------ pipeline parts


def test_lime_stage_tensors_follow_the_router_window():
    """Full router: the stage after layer b receives all b earlier layers' K/V rows; last-2:
    only the one layer its first layer reads; the sender keeps the hidden state it sent. With
    virtual stages each hop carries only the rows the receiving rank lacks."""
    layout = dict(num_layers=8, pipeline_model_parallel_size=2, pipeline_dtype=torch.float32)
    geometry = activations.Geometry.of(tiny_config(**layout), SEQ, BATCH, VOCAB)
    rows = geometry.kv_rows
    for router, carried in ((dict(), 4), (dict(lime_router="last", lime_router_window=2), 1)):
        result = E.estimate(
            tiny_config(**layout, **router),
            vocab_size=VOCAB,
            seq_length=SEQ,
            micro_batch_size=BATCH,
            num_microbatches=4,
        )
        first, second = (stage.chunks[0].activations for stage in result.stages)
        assert second.received_stage == carried * rows and first.received_stage == 0
        assert first.sent_stage == geometry.hidden_state
        assert second.sent_stage == 0 and second.output > 0 and first.embedding > 0
    deallocated = E.estimate(
        tiny_config(**layout, deallocate_pipeline_outputs=True),
        vocab_size=VOCAB,
        seq_length=SEQ,
        micro_batch_size=BATCH,
        num_microbatches=4,
    )
    assert deallocated.stages[0].chunks[0].activations.sent_stage == 0
    # Chunks of 2 layers; rank 0 runs chunks 0 and 2, rank 1 chunks 1 and 3: each hop carries
    # the 2 layers of the chunk before it (the rank holds the others already).
    interleaved = E.estimate(
        tiny_config(**layout, virtual_pipeline_model_parallel_size=2),
        vocab_size=VOCAB,
        seq_length=SEQ,
        micro_batch_size=BATCH,
        num_microbatches=4,
    )
    chunks = {(s.pp_rank, c.vp_stage): c.activations for s in interleaved.stages for c in s.chunks}
    assert {key: (a.received_stage, a.sent_stage) for key, a in chunks.items()} == {
        (0, 0): (0, geometry.hidden_state),
        (1, 0): (2 * rows, geometry.hidden_state),
        (0, 1): (2 * rows, geometry.hidden_state),
        (1, 1): (2 * rows, 0),
    }


def test_stage_flops_add_up_to_the_model():
    config = tiny_config(
        num_layers=8,
        pipeline_model_parallel_size=4,
        virtual_pipeline_model_parallel_size=2,
        pipeline_dtype=torch.float32,
    )
    result = E.estimate(config, vocab_size=VOCAB, seq_length=SEQ, micro_batch_size=BATCH, num_microbatches=4)
    assert sum(s.forward_flops_per_token for s in result.stages) == pytest.approx(
        result.forward_flops_per_token, rel=1e-12
    )
    assert result.training_flops_per_token == 3 * result.forward_flops_per_token


# ------------------------------------------------------------------------------ report, errors


def test_report_of_the_paper_layout():
    config = lime_config(
        **PAPER_1B,
        num_query_groups=8,
        tensor_model_parallel_size=2,
        sequence_parallel=True,
        pipeline_model_parallel_size=2,
        virtual_pipeline_model_parallel_size=2,
        bf16=True,
        params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16,
        recompute_granularity="selective",
    )
    report = E.dry_run_report(
        config,
        vocab_size=50304,
        seq_length=2048,
        micro_batch_size=2,
        num_microbatches=8,
        transformer_impl="transformer_engine",
    )
    assert "LIMe (full router): 16 layers, hidden 2048, FFN 8192, 32 heads (8 kv)" in report
    assert "TP 2, PP 2, VPP 2, sequence parallel (4 GPUs per model replica)" in report
    assert "recompute: selective (core_attn)" in report
    assert "0-3, 8-11" in report and "4-7, 12-15" in report
    assert "training (3x forward)" in report and "peak activation memory per GPU" in report
    assert "step time (schedule model, 400 TFLOP/s per GPU" in report
    assert "NVLink-like 3600 Gb/s 3 us" in report and "InfiniBand-like 400 Gb/s 5 us" in report
    assert report.count("LIMe over baseline") == 2
    one_link = E.dry_run_report(
        config,
        vocab_size=50304,
        seq_length=2048,
        micro_batch_size=2,
        num_microbatches=8,
        compute_tflops=100,
        link_bandwidth_gbps=800,
    )
    assert "link 800 Gb/s 5 us" in one_link and "NVLink" not in one_link and "100 TFLOP/s" in one_link


@pytest.mark.parametrize(
    "overrides, family",
    [
        (dict(lime=False), "LLaMA baseline"),
        (dict(lime=False, hyper_connections=4), "Hyper-Connections (dynamic, 4 streams)"),
        (dict(lime=False, hyper_connections=2, hyper_connections_static=True), "Hyper-Connections (static, 2 streams)"),
        (dict(lime=False, hyper_connections=4, hyper_connections_manifold=True), "mHC (4 streams)"),
        (dict(lime_router="last", lime_router_window=2), "LIMe (last-2 router)"),
    ],
    ids=["llama", "hc", "hc-static", "mhc", "lime-last"],
)
def test_report_names_the_family(overrides, family):
    report = E.dry_run_report(
        tiny_config(**overrides), vocab_size=VOCAB, seq_length=SEQ, micro_batch_size=BATCH, num_microbatches=1
    )
    assert report.splitlines()[0].startswith(f"dry run: {family}: ")


@pytest.mark.parametrize("router, ours", [("full", 8**2 * 527), ("dynamic", 8 * 527)])
def test_report_counts_pruning_in_both_units(router, ours):
    """32 layers, 8 kv heads: ours kv^2 (static) or kv (dynamic) per source, L(L+1)/2 - 1 = 527
    sources; v1 Table 5's unit 8 * L(L-1)/2 = 3,968 for both."""
    config = tiny_config(num_layers=32, num_attention_heads=8, lime_router=router, lime_prune_top_p=0.9)
    report = E.dry_run_report(config, vocab_size=VOCAB, seq_length=SEQ, micro_batch_size=BATCH, num_microbatches=1)
    assert f"over {ours:,} " in report and "3,968 routes in v1 Table 5's unit" in report


@pytest.mark.parametrize(
    "overrides, kwargs, message",
    [
        (dict(tensor_model_parallel_size=2), dict(vocab_size=127), "embedding.word_embeddings.weight has 127 rows"),
        (
            dict(tensor_model_parallel_size=2, sequence_parallel=True),
            dict(seq_length=31),
            "seq_length=31 is not divisible by tensor_model_parallel_size=2",
        ),
        (
            dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2),
            dict(),
            "divisible by recompute_num_layers=2",
        ),
        (dict(recompute_granularity="selective", recompute_modules=["layernorm"]), dict(), "not ['layernorm']"),
        (
            dict(
                num_layers=4,
                pipeline_model_parallel_size=2,
                virtual_pipeline_model_parallel_size=2,
                pipeline_dtype=torch.float32,
            ),
            dict(num_microbatches=1),
            "microbatch_group_size_per_vp_stage=2 <= num_microbatches=1",
        ),
        (dict(), dict(transformer_impl="te"), "transformer_impl must be one of"),
        (dict(), dict(seq_length=0), "seq_length must be at least 1"),
    ],
)
def test_bad_input_fails_with_one_clear_message(overrides, kwargs, message):
    config = tiny_config(**overrides)
    arguments = dict(vocab_size=VOCAB, seq_length=SEQ, micro_batch_size=BATCH, num_microbatches=4)
    with pytest.raises(ValueError, match=re.escape(message)):
        E.estimate(config, **{**arguments, **kwargs})


# ------------------------------------------------------------------------------ on ranks

LAYOUTS = {  # name: (Layout fields, config overrides)
    "tp2-pp2-lime-gqa": (dict(tp=2, pp=2), dict(num_query_groups=2)),
    "pp4-vpp2-lime-last2": (dict(pp=4, vpp=2), dict(lime_router="last", lime_router_window=2)),
    "pp4-uneven-lime-first2": (
        dict(pp=4),
        dict(
            num_layers_in_first_pipeline_stage=1,
            num_layers_in_last_pipeline_stage=1,
            lime_router="first",
            lime_router_window=2,
        ),
    ),
    "pp2-vpp2-uneven-first": (dict(pp=2, vpp=2), dict(num_layers=10, num_layers_in_first_pipeline_stage=4)),
    "tp4-sp-lime-kv2": (dict(tp=4, sp=True), dict(num_query_groups=2)),
    "tp2-sp-pp2-vpp2-llama-untied": (dict(tp=2, pp=2, vpp=2, sp=True), dict(lime=False)),
}
TP_ACTIVATION_CASES = {  # saved bytes per rank of a TP=2 forward
    "tp2-lime": (dict(tp=2), dict()),
    "tp2-sp-lime-gqa": (dict(tp=2, sp=True), dict(num_query_groups=2)),
    "tp2-sp-llama-bf16": (dict(tp=2, sp=True), dict(lime=False, bf16=True, params_dtype=torch.bfloat16)),
    "tp2-lime-mqa": (dict(tp=2), dict(num_query_groups=1)),
}
TP_STACK_CASES = {  # router stacks a TP=2 forward and backward build per rank (this rank's columns)
    "tp2-lime-gqa-blocked": (dict(tp=2), dict(num_query_groups=2, lime_routing_block=3)),
    "tp2-lime-per-layer": (dict(tp=2), dict(lime_routing_block=1)),
}


def _layout_config(layout, overrides):
    from lime_megatron.testing.distributed import layout_config_kwargs

    settings = {**TINY, "num_layers": 8, **layout_config_kwargs(layout), **overrides}
    return lime_config(**settings)


def _rank_checks(layouts: dict, activation_cases: dict, stack_cases: dict) -> dict:
    """On every rank: per layout, (pp rank, vp stage, tp rank, parameters, router parameters)
    of each chunk megatron builds; per TP activation case, this rank's saved bytes; per TP stack
    case, the router stacks this rank built (``router_stacks_built``)."""
    from megatron.core import parallel_state
    from megatron.core.utils import unwrap_model

    from lime_megatron.testing.distributed import Layout, initialize_layout
    from lime_megatron.training.trainer import build_model_chunks

    results = {}
    for name, (fields, overrides) in layouts.items():
        layout = Layout(**fields)
        initialize_layout(layout)
        config = _layout_config(layout, overrides)
        rows = []
        for chunk in build_model_chunks(config, VOCAB, SEQ, share_embeddings_and_output_weights=config.lime):
            model = unwrap_model(chunk)
            routers = sum(p.numel() for n, p in model.named_parameters() if "router" in n)
            rows.append(
                (
                    parallel_state.get_pipeline_model_parallel_rank(),
                    model.vp_stage,
                    parallel_state.get_tensor_model_parallel_rank(),
                    sum(p.numel() for p in model.parameters()),
                    routers,
                )
            )
        results[name] = rows
    for name, (fields, overrides) in activation_cases.items():
        layout = Layout(**fields)
        initialize_layout(layout)
        results[name] = saved_bytes(_layout_config(layout, overrides))
    for name, (fields, overrides) in stack_cases.items():
        initialize_layout(Layout(**fields))
        results[name] = router_stacks_built(_layout_config(Layout(**fields), overrides))
    return results


@pytest.mark.slow
def test_estimate_equals_every_rank_of_parallel_layouts():
    from lime_megatron.testing.distributed import Layout, run_distributed

    per_rank = run_distributed(_rank_checks, 4, LAYOUTS, TP_ACTIVATION_CASES, TP_STACK_CASES)
    for name, (fields, overrides) in LAYOUTS.items():
        config = _layout_config(Layout(**fields), overrides)
        result = E.estimate(
            config,
            vocab_size=VOCAB,
            seq_length=SEQ,
            micro_batch_size=BATCH,
            num_microbatches=4,
            share_embeddings_and_output_weights=config.lime,
        )
        expected = {
            (s.pp_rank, c.vp_stage): (c.parameters, c.router_parameters) for s in result.stages for c in s.chunks
        }
        built = {}
        for rows in per_rank:
            for pp_rank, vp, _tp_rank, params, routers in rows[name]:
                built.setdefault((pp_rank, vp), set()).add((params, routers))
        assert built == {key: {value} for key, value in expected.items()}, name
    for name, (fields, overrides) in TP_ACTIVATION_CASES.items():
        config = _layout_config(Layout(**fields), overrides)
        result = E.estimate(config, vocab_size=VOCAB, seq_length=SEQ, micro_batch_size=BATCH, num_microbatches=1)
        activations = result.stages[0].chunks[0].activations
        estimated = activations.total - activations.router_stack  # not a saved tensor
        for rows in per_rank:
            assert abs(rows[name] - estimated) <= SAVED_BYTES_SLACK, (name, rows[name], estimated)
    for name, (fields, overrides) in TP_STACK_CASES.items():
        config = _layout_config(Layout(**fields), overrides)
        (stage,) = E.estimate(
            config, vocab_size=VOCAB, seq_length=SEQ, micro_batch_size=BATCH, num_microbatches=1
        ).stages
        expected = {
            "forward": stage.chunks[0].activations.router_stack,
            "backward": stage.chunks[0].backward_working_bytes,
        }
        assert sum(expected.values()) > 0
        assert all(rows[name] == expected for rows in per_rank), (name, [rows[name] for rows in per_rank], expected)
