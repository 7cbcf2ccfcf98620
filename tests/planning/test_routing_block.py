"""The routing block size (``planning.routing_block``): the chunk's absolute layers, the machine
present or named, the host's time per operator, the override, recomputed chunks, the block each
chunk is built with, and printed per chunk by the dry run."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

from lime_megatron.models.config import LimeConfigError, lime_config
from lime_megatron.planning import routing_block as R

pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning")]

ROOFLINE_ONLY = dataclasses.replace(R.H100_SXM, seconds_per_operator=0.0)
"""The H100's roofline without host time (the block size as chosen before host time counted)."""

ROW_1B = 2 * 2048 * 64  # one kv head's row at seq 2048, micro batch 1, head dim 64 (elements)


def chunks_of(num_layers: int, size: int) -> list[range]:
    return [range(start, start + size) for start in range(0, num_layers, size)]


def test_received_rows_raise_the_block_of_later_chunks():
    """8-layer chunks of a 64-layer model: chunk 0 keeps the single-stage choice at 8 layers (4);
    the chunk at layer 56 reads 56 earlier layers' rows, as the last 8 layers of a single stage
    do, and gets the B the roofline gives there (8), not the 4 of its own 8 layers alone."""
    blocks = [R.routing_block_size(chunk, 8, ROW_1B, 2, ROOFLINE_ONLY) for chunk in chunks_of(64, 8)]
    assert blocks[0] == R.routing_block_size(range(8), 8, ROW_1B, 2, ROOFLINE_ONLY) == 4
    assert blocks[-1] == 8
    assert blocks == sorted(blocks)


def test_forward_products_of_a_later_chunk_read_the_earlier_rows():
    """Chunk [4, 8) at B = 2: per block one product over all rows before it, per layer its
    in-block rows; at B = 1 each layer reads all its sources."""
    assert R.forward_products(range(4, 8), 1, 2) == [(4, 2), (1, 1), (2, 1), (6, 2), (1, 1), (2, 1)]
    assert R.forward_products(range(4, 8), 1, 1) == [(5, 1), (6, 1), (7, 1), (8, 1)]


def test_a_single_stage_is_a_chunk_from_layer_0():
    """Layer 0 runs no product, the first block none over earlier rows (kv 2, B = 2)."""
    assert R.forward_products(range(5), 2, 2) == [(4, 2), (4, 4), (2, 2), (4, 2), (8, 2), (2, 2)]


@pytest.mark.usefixtures("megatron")
@pytest.mark.parametrize("kernel, counts", [("torch", R.TORCH_OPERATORS), ("triton", R.TRITON_OPERATORS)])
def test_host_operators_model_the_operators_blocking_adds(kernel, counts):
    """What blocking adds to the operators one forward+backward dispatches (16 layers, MHA,
    counted by ``DispatchedOperators``, a Triton launch as one) is what ``host_operators`` adds
    with the path's ``HostOperators``, exactly: per block with earlier sources ``per_block``, per
    layer of it ``per_blocked_layer``, once ``per_first_block`` (Triton's: its blocks take fewer)."""
    from tests.lime_fixtures import tiny_model
    from tests.models.test_memory import step_operators

    counted = {
        block: step_operators(
            tiny_model(num_layers=16, lime_routing_block=block, dtype=torch.float32, lime_routing_kernel=kernel)
        )
        for block in (1, 4, 8)
    }
    modelled = {block: R.host_operators(range(16), block, counts=counts) for block in counted}
    added = {block: (counted[block] - counted[1], modelled[block] - modelled[1]) for block in counted}
    assert all(count == pytest.approx(model, abs=0.01) for count, model in added.values()), added


def test_the_path_a_run_takes_sets_its_operators():
    """A GPU machine counts the Triton path's operators unless the run asks for torch's; the CPU
    torch's unless the run asks for Triton's."""
    assert R.path_machine(_config(), R.H100_SXM).operators == R.TRITON_OPERATORS
    assert R.path_machine(_config(lime_routing_kernel="torch"), R.H100_SXM).operators == R.TORCH_OPERATORS
    assert R.path_machine(_config(), R.CPU_2_CORE).operators == R.TORCH_OPERATORS
    assert R.path_machine(_config(lime_routing_kernel="triton"), R.CPU_2_CORE).operators == R.TRITON_OPERATORS


def test_host_time_decides_in_a_launch_bound_regime():
    """Rows so short that the kernels cost nothing: the fewest operators win.  On the torch path
    fewer block products win among B > 1 (the time falls with B) and per layer (B = 1) over all;
    on the Triton path, where a fused block's layers cost fewer operators than unblocked ones, a
    block between the roofline's (the choice without host time) and the one of fewest operators."""
    layers, tiny_row = range(128), 64
    torch_path = dataclasses.replace(R.H200, operators=R.TORCH_OPERATORS)
    seconds = [R.routing_step_seconds(layers, 8, block, tiny_row, 2, torch_path) for block in range(2, 23)]
    assert seconds == sorted(seconds, reverse=True)
    assert R.routing_block_size(layers, 8, tiny_row, 2, torch_path) == 1
    operators = {block: R.host_operators(layers, block, counts=R.TRITON_OPERATORS) for block in range(1, 23)}
    fewest = min(operators, key=operators.get)
    roofline = R.routing_block_size(layers, 8, tiny_row, 2, dataclasses.replace(R.H200, seconds_per_operator=0))
    assert 1 < roofline < R.routing_block_size(layers, 8, tiny_row, 2, R.H200) <= fewest


def test_the_device_or_the_host_sets_the_pace_on_a_gpu():
    """A GPU runs kernels while the host dispatches.  Where the baseline's kernels outlast its host
    work (1B layers at micro batch 4) B is the roofline's; where its host work outlasts them (128
    narrow layers at micro batch 1) operators weigh: on the torch path B = 1 (the fewest), although
    the roofline alone would block; on the Triton path a block, which dispatches fewer than B = 1."""
    wide = _config(num_layers=16)
    host, device = R.baseline_work(wide, range(16), 2048, 4, R.H100_SXM)
    assert device > host
    roofline = R.routing_block_size(range(16), 32, 4 * ROW_1B, 2, ROOFLINE_ONLY)
    assert R.chunk_routing_block(wide, range(16), 2048, 4) == roofline > 1
    narrow = _config(num_layers=128, hidden_size=512, num_attention_heads=8, num_query_groups=8)
    host, device = R.baseline_work(narrow, range(128), 2048, 1, R.H100_SXM)
    assert host > device
    torch_path = _config(
        num_layers=128, hidden_size=512, num_attention_heads=8, num_query_groups=8, lime_routing_kernel="torch"
    )
    assert R.chunk_routing_block(torch_path, range(128), 2048, 1) == 1
    fused = R.chunk_routing_block(narrow, range(128), 2048, 1)
    operators = {block: R.host_operators(range(128), block, counts=R.TRITON_OPERATORS) for block in (1, fused)}
    assert fused > 1 and operators[fused] < operators[1]
    assert R.routing_block_size(range(128), 8, ROW_1B, 2, ROOFLINE_ONLY) > 1


def test_on_the_cpu_host_and_kernels_add():
    """The CPU runs each operator as it comes: the step is the baseline's work plus LIMe's kernels
    plus its host time, whatever the baseline's share."""
    layers, base = range(32), (0.5, 2.0)
    seconds = R.routing_step_seconds(layers, 8, 4, ROW_1B, 4, R.CPU_2_CORE, baseline=base)
    alone = R.routing_step_seconds(layers, 8, 4, ROW_1B, 4, R.CPU_2_CORE)
    assert seconds == pytest.approx(alone + sum(base))
    assert R.routing_block_size(layers, 8, ROW_1B, 4, R.CPU_2_CORE, baseline=base) == R.routing_block_size(
        layers, 8, ROW_1B, 4, R.CPU_2_CORE
    )


@pytest.mark.parametrize(
    "name,capability,machine",
    [
        ("NVIDIA H100 80GB HBM3", (9, 0), R.H100_SXM),
        ("NVIDIA H100 PCIe", (9, 0), R.H100_PCIE),
        ("NVIDIA H200", (9, 0), R.H200),
        ("NVIDIA A100-SXM4-80GB", (8, 0), R.A100_80GB),
        ("NVIDIA A100-PCIE-40GB", (8, 0), R.A100_40GB),
    ],
)
def test_known_gpus_map_to_their_figures(name, capability, machine):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert R.device_machine(name, capability) is machine


def test_an_unknown_gpu_warns_which_figures_it_assumed():
    with pytest.warns(UserWarning, match="unknown GPU 'NVIDIA L4'.*assuming the figures of A100 80GB"):
        assert R.device_machine("NVIDIA L4", (8, 9)) is R.A100_80GB
    with pytest.warns(UserWarning, match="assuming the figures of H100 SXM"):
        assert R.device_machine("Some GPU", (12, 0)) is R.H100_SXM


@pytest.fixture
def fresh_device_lookup():
    """``present_machine`` looked up again in the test, and again after it."""
    R.present_machine.cache_clear()
    yield
    R.present_machine.cache_clear()


@pytest.mark.usefixtures("fresh_device_lookup")
def test_the_present_device_decides_not_cuda_alone(monkeypatch):
    """No GPU: the CPU's figures; a GPU: its own (an A100 is not taken for an H100)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert R.present_machine() is R.CPU_2_CORE
    R.present_machine.cache_clear()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA A100-SXM4-80GB")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (8, 0))
    assert R.present_machine() is R.A100_80GB
    assert (
        R.routing_machine(lime_config(num_layers=2, hidden_size=32, num_attention_heads=4, lime_machine="h200"))
        is R.H200
    )


def test_a_machine_outside_the_table_is_refused():
    config = lime_config(num_layers=2, hidden_size=32, num_attention_heads=4, lime_machine="tpu")
    with pytest.raises(LimeConfigError, match="lime_machine must be auto or one of"):
        R.chunk_routing_block(config, range(2), 16, 1)


def _config(**overrides):
    settings = dict(
        num_layers=64,
        hidden_size=2048,
        num_attention_heads=32,
        num_query_groups=32,
        ffn_hidden_size=64,
        params_dtype=torch.bfloat16,
        bf16=True,
        use_cpu_initialization=True,
        lime_machine="h100",
    )
    return lime_config(**{**settings, **overrides})


def test_later_pipeline_chunks_choose_from_their_received_rows():
    """PP = 4 x VPP = 2 over 64 layers (H100, 1B-wide rows, micro batch 1): chunk 0 chooses as an
    8-layer model alone does; every later chunk, reading the earlier layers' rows in one product
    per received block at B = 1, blocks all its 8 layers."""
    from lime_megatron.parallel.pipeline import chunk_layers

    config = _config(
        pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=2, pipeline_dtype=torch.bfloat16
    )
    blocks = [R.chunk_routing_block(config, chunk, 2048, 1) for chunk in chunk_layers(config)]
    assert blocks[0] == R.chunk_routing_block(_config(num_layers=8), range(8), 2048, 1)
    assert blocks[1:] == [8] * 7


def test_the_chooser_takes_the_override_recompute_and_dynamic_rules():
    config = _config(ffn_hidden_size=8192)  # 1B-wide layers: the device sets the pace
    chosen = R.chunk_routing_block(config, range(56, 64), 2048, 1)
    baseline = R.baseline_work(config, range(56, 64), 2048, 1, R.H100_SXM)
    assert chosen == R.routing_block_size(range(56, 64), 32, ROW_1B, 2, R.H100_SXM, baseline=baseline) > 1
    assert R.chunk_routing_block(_config(lime_routing_block=3), range(56, 64), 2048, 1) == 3
    assert (
        R.chunk_routing_block(
            _config(
                lime_routing_block=6, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=4
            ),
            range(8),
            2048,
            1,
        )
        == 2
    )
    assert R.chunk_routing_block(_config(lime_router="dynamic"), range(56, 64), 2048, 1) == 1


@pytest.mark.usefixtures("megatron")
def test_the_trainer_builds_each_chunk_with_the_choosers_block():
    """``build_model_chunks`` (the path ``pretrain_lime.py`` runs) stores the chooser's block for the
    chunk's layers, sequence and micro batch; ``lime_routing_block`` overrides it; a chunk built
    without one runs ``lime_routing_block`` or 1.  The model imports no cost model."""
    import lime_megatron.models.gpt_model as gpt_model
    from lime_megatron.training.trainer import build_model_chunks
    from tests.lime_fixtures import tiny_model

    config = _config(
        num_layers=16,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=4,
        params_dtype=torch.float32,
        bf16=False,
        lime_machine="cpu",
    )
    (chunk,) = build_model_chunks(config, 64, 2048, micro_batch_size=4)
    assert chunk.module.routing_block == R.chunk_routing_block(config, range(16), 2048, 4) > 1
    (fixed,) = build_model_chunks(dataclasses.replace(config, lime_routing_block=3), 64, 2048, micro_batch_size=4)
    assert fixed.module.routing_block == 3
    assert tiny_model(num_layers=6).routing_block == 1
    assert tiny_model(num_layers=6, lime_routing_block=3).routing_block == 3
    assert not hasattr(gpt_model, "chunk_routing_block")


def test_recomputed_chunks_bound_the_block():
    """Under full recompute a block lies inside one recomputed chunk: ``uniform`` divides
    ``recompute_num_layers``; ``block`` recomputes each of its first layers alone, so B = 1 (an
    explicit larger B is refused with one message)."""
    from lime_megatron.models.config import LimeConfigError

    uniform = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=4)
    by_layer = dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=4)
    assert R.chunk_routing_block(_config(lime_routing_block=6, **uniform), range(8), 2048, 1) == 2
    assert R.chunk_routing_block(_config(lime_machine="h100", **by_layer), range(56, 64), 2048, 1) == 1
    with pytest.raises(LimeConfigError, match="recompute_method='block'"):
        _config(lime_routing_block=2, **by_layer)


def test_the_dry_run_prints_the_block_of_every_chunk():
    """PP = 4 x VPP = 2 over 64 layers: one B per chunk in layer order, the chooser's, and the
    machine whose figures chose it."""
    from lime_megatron.planning.estimate import estimate, report_lines

    config = _config(
        pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=2, pipeline_dtype=torch.bfloat16
    )
    result = estimate(config, vocab_size=128, seq_length=2048, micro_batch_size=1, num_microbatches=8)
    line = next(line for line in report_lines(result) if line.startswith("LIMe routing"))
    expected = ", ".join(
        f"layers {chunk.start}-{chunk.stop - 1}: {R.chunk_routing_block(config, chunk, 2048, 1)}"
        for chunk in chunks_of(64, 8)
    )
    assert f"block size B per chunk {expected} (cost model on {R.H100_SXM.name};" in line


PIPELINE_DEPTHS = {16: (1, 2, 8), 24: (1, 3, 12)}
"""Model depths (two stages of half of them each) and the block sizes counted at each."""

PIPELINE_PATHS = {  # id: (tensor-parallel size, kv heads, the path's counts)
    "pp2": (1, 4, R.TRITON_OPERATORS),
    "tp2-pp2": (2, 4, R.TENSOR_PARALLEL_TRITON_OPERATORS),
    "tp2-pp2-shared-heads": (2, 1, R.SHARED_HEADS_TRITON_OPERATORS),
}


def pipeline_rank_operators(tensor_parallel: int, kv_heads: int) -> dict[int, dict[int, float]]:
    """This rank's operators per micro-batch of a training step (2 micro-batches, LIMe on the
    Triton path) on TP = ``tensor_parallel`` x PP = 2 ranks, per model depth and block size
    (``PIPELINE_DEPTHS``; ``test_lime_tensor_parallel.trainer_step_operators``)."""
    from lime_megatron.testing.distributed import Layout, initialize_layout
    from tests.parallel.test_lime_tensor_parallel import small_config, trainer_step_operators

    layout = Layout(tp=tensor_parallel, pp=2)
    initialize_layout(layout)
    counted: dict[int, dict[int, float]] = {}
    for layers, blocks in PIPELINE_DEPTHS.items():
        counted[layers] = {}
        for block in blocks:
            settings = dict(lime_routing_kernel="triton", lime_routing_block=block)
            config = small_config(layout, kv_heads, num_layers=layers, **settings)
            counted[layers][block] = sum(trainer_step_operators(config, 2).values())
    return counted


def model_errors(counted: dict, first: bool, counts: R.HostOperators) -> dict[tuple[int, int], float]:
    """Per (depth, block): what blocking adds on a rank (``counted``: the first stage's or the
    second's, which receives one block of rows) less what ``host_operators`` adds for its chunk."""
    errors = {}
    for layers, by_block in counted.items():
        chunk, received = (range(layers // 2), 0) if first else (range(layers // 2, layers), 1)
        for block, count in by_block.items():
            modelled = R.host_operators(chunk, block, received, counts) - R.host_operators(chunk, 1, received, counts)
            errors[layers, block] = count - by_block[1] - modelled
    return errors


@pytest.mark.parametrize(
    "name", [pytest.param(name, marks=[pytest.mark.slow] if name != "pp2" else []) for name in PIPELINE_PATHS]
)
def test_host_operators_model_blocking_on_pipeline_ranks(name):
    """What blocking adds on each stage of TP x PP = 2 (the Triton path; the second stage receives
    one block of rows), 8 and 12 layers a stage, is what ``host_operators`` adds for its chunk with
    the path's counts: exactly with every kv head on one rank, the received-block terms included;
    with kv heads shared by ranks exactly on the first stage and within 3 operators on the second
    (``SHARED_HEADS_TRITON_OPERATORS``).  At B = 1 the second stage's count grows per layer by
    ``per_received_block_per_layer`` more than the first's."""
    from lime_megatron.testing.distributed import run_distributed

    tensor_parallel, kv_heads, counts = PIPELINE_PATHS[name]
    counted = run_distributed(pipeline_rank_operators, 2 * tensor_parallel, tensor_parallel, kv_heads, nccl_rules=True)
    first, second = counted[0], counted[tensor_parallel]
    first_errors = model_errors(first, True, counts)
    assert all(abs(error) < 0.01 for error in first_errors.values()), first_errors
    second_errors = model_errors(second, False, counts)
    tolerance = 3 if kv_heads < tensor_parallel else 0.01
    assert all(abs(error) <= tolerance for error in second_errors.values()), second_errors
    shallow, deep = PIPELINE_DEPTHS
    grown = (second[deep][1] - first[deep][1]) - (second[shallow][1] - first[shallow][1])
    assert grown == pytest.approx((deep - shallow) // 2 * counts.per_received_block_per_layer, abs=0.01)
