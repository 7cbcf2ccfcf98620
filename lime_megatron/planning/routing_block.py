"""The routing block size B of a model chunk: the roofline of its routing products plus the host's
time per operator, on the figures of the machine present (or named by ``--lime-machine``).

A chunk of layers ``[start, stop)`` under pipeline parallelism reads the ``start`` earlier layers'
rows too (received from earlier stages), so its block products read more than its own layer count
suggests: the cost, and B, depend on the chunk's absolute layers (``forward_products``).  LIMe's
routing in one micro-batch's forward and backward of the chunk costs the device

    kernels = 3 * sum over forward products of max(bytes / bandwidth, FLOPs / peak)

(the backward's router-weight and row gradients read the same rows as the forward products) and
the host ``operators dispatched * host seconds per operator``.  On a machine that runs kernels
while the host dispatches (a GPU) the chunk's step takes the longer of its host's and its device's
time, the baseline's work included (``baseline_work``):

    max(baseline host + LIMe host, baseline device + LIMe kernels)

so where the device sets the pace (1B layers at micro batch 4) B is the roofline's, and where the
host does (narrow layers at micro batch 1) the fewest operators win; on a machine that does one
after the other (the CPU) the two add (docs/routing.md, "How B is chosen").  The operators are as
``testing.dispatched_operators`` counted them in one forward+backward (``host_operators``): on
one stage blocking adds operators, in a later pipeline chunk it saves them (a product runs once
per received block of rows), and among B > 1 fewer blocks dispatch fewer.  ``chunk_routing_block``
is the one chooser: the trainer builds each chunk with its choice
(``training.trainer.build_model_chunks``), the dry run prints it per chunk.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from dataclasses import dataclass

import torch

from lime_megatron.choices import MACHINE_NAMES
from lime_megatron.kernels.routing_path import planned_kernel
from lime_megatron.models.config import LimeConfigError
from lime_megatron.models.lime.routing_blocks import recompute_safe_block
from lime_megatron.parallel.pipeline import chunk_layers
from lime_megatron.planning.flops import layer_flops_per_token

STEP_PRODUCTS_PER_FORWARD = 3
"""Products per forward product in a step: the forward's, the router-weight gradient's and the row
gradient's, each reading the same rows (docs/routing.md, the table of products)."""


@dataclass(frozen=True)
class HostOperators:
    """ATen operators (a Triton launch counted as one) LIMe dispatches beyond the baseline in one
    forward+backward, by where they fall (``host_operators``; docs/routing.md "Host work per
    layer"; views included)."""

    per_layer: float
    """Per layer at B = 1."""
    per_block: float
    """Per block with earlier sources at B > 1 (torch: ``MixEarlierSources``, the stacked router
    columns, the product, its gradients; Triton: ``fused_blocks``, the block's tensors and its
    two launches, less its first reader's own forward launch)."""
    per_blocked_layer: float
    """More per layer of such a block (torch: its partial sums taken and added, its weight-gradient
    pieces joined; Triton: fewer, its outputs being the block's tensors)."""
    per_received_block_per_layer: float
    """More per layer at B = 1 per block of rows a pipeline chunk received (one per earlier chunk):
    its products run once per contiguous block of its sources, and the chunk hands back its share
    of the received rows' gradient."""
    per_received_block_per_block: float
    """The same per block with earlier sources at B > 1."""
    per_received_block_per_chunk: float = 0.0
    """More once per chunk at B > 1 per block of rows received (the share of their gradient handed
    back)."""
    per_received_block_per_blocked_layer: float = 0.0
    """More per layer of a block with earlier sources at B > 1 per block of rows received."""
    per_first_block: float = 0.0
    """More once at B > 1 in the chunk holding layer 0, where a block reads earlier sources (layer
    0's block takes its later consumers' share on the general path, the identity routing not
    being fused)."""


TORCH_OPERATORS = HostOperators(39, 25, 9, 20, 12)
"""The torch path's (``--lime-routing-kernel torch``, the CPU's): counted at 16 layers, MHA, B = 1,
2, 4, 8, 16 (625, 926, 808, 722, 625 operators beyond the baseline; the model fits all five
exactly), and per micro-batch on PP = 4 ranks of 8 layers (32 layers, MHA), B = 1, 2, 4, 8 (the
model within 62 operators of every count)."""

TRITON_OPERATORS = HostOperators(
    9.375, 8, -4, 5, 2, per_received_block_per_chunk=1, per_received_block_per_blocked_layer=1, per_first_block=3
)
"""The Triton path's (a GPU's default, ``models.lime.fused_routing`` and ``fused_blocks``): counted
at 16 layers, MHA, B = 1, 2, 4, 8, 16 (150, 153, 129, 129, 150 operators beyond the baseline), and
per micro-batch on PP = 2 ranks of 8 and of 12 layers (with megatron's DDP, 2 micro-batches, the
NCCL-rules mode; 8 layers, B = 1, 2, 4, 8: the first rank's 113, 116, 108, 113, the second's 136,
113, 93, 83); the model gives every difference from B = 1 exactly.  A block costs 8 operators and
each of its layers 4 fewer than at B = 1 (its routed keys/values and their gradients are the
block's tensors): per layer, blocking costs the host as much as B = 1 at B = 2 and less from B = 3
on (a chunk's first block aside).  A received block of rows costs 5 per layer at B = 1 (the later
rank's count grows by 5 per layer more than the first's, from 8 to 12 layers a rank), 2 per block
and 1 per blocked layer at B > 1, and 1 once."""

TENSOR_PARALLEL_TRITON_OPERATORS = HostOperators(
    TRITON_OPERATORS.per_layer + 4, 6, -3, 4, 2, per_received_block_per_chunk=1, per_first_block=3
)
"""The Triton path's under tensor parallelism with every kv head on one rank (``fused_routing``,
its rank chunks): per layer the TP = 1 path's and its two collectives with the ``stack`` and
``unbind`` around them (``tests/parallel/test_lime_tensor_parallel.py`` counts them at B = 1); a
fused block 2 fewer than at TP = 1 (its sums one tensor) and each of its layers 1 more (its routed
keys/values the reduce-scatter's output): counted at TP = 2 (gloo, megatron's DDP), 16 layers,
kv 4, B = 1, 2, 4, 8, 16 (274, 277, 259, 259, 274 operators beyond the baseline), and on TP = 2 x
PP = 2 ranks of 8 and of 12 layers as ``TRITON_OPERATORS``; the model gives every difference from
B = 1 exactly.  A received block costs 4 per layer at B = 1, 2 per block at B > 1 and 1 once."""

SHARED_HEADS_TRITON_OPERATORS = HostOperators(
    39.3, 15, 9, 10, 12, per_received_block_per_chunk=-11, per_received_block_per_blocked_layer=-2
)
"""The Triton path's under tensor parallelism with kv heads shared by ranks (fewer kv heads than
ranks): the general path at every B, its products Triton launches (rows layout, ``scatter_heads``,
``gather_heads``): counted at TP = 4, kv 2, 16 layers, B = 1, 2, 4, 8, 16 (689, 920, 842, 776, 689;
per layer 25.9 more than the rank-chunk path's at B = 1, 274 at TP = 2, kv 4, in the same
harness), and on TP = 2 x PP = 2 ranks of 8 and 12 layers with kv 1 (10 more per layer on the
later rank at B = 1): the model gives every difference from B = 1 exactly but the later ranks',
which it gives within 3 operators (its received-block terms fitted to them)."""

GPU_HOST_SECONDS_PER_OPERATOR = 17e-6
"""Host seconds per operator dispatched on a GPU machine (Python, dispatch and kernel launch):
the H200 machine's host-bound baseline step (BENCHMARKS.md, "LIMe overhead over the baseline": 492 ms at 128
layers, hidden 512, micro batch 1, the GPU busy 31%) over its 128 x 226 operators.  Assumed the
same on every GPU machine (it is the host's, not the GPU's)."""

BASELINE_OPERATORS_PER_LAYER = 226
"""Operators the baseline dispatches per layer in one forward+backward (the H200's deep-narrow
profile above: its step is these operators at the host's pace)."""

ACHIEVED_MATRIX_FRACTION = 0.16
"""Fraction of the matrix peak the baseline's layers run at on a GPU: the H200's 1B MHA step at
micro batch 4 (megatron's local spec; BENCHMARKS.md): 346 ms of kernels for 56 TFLOP.  A faster
spec (TransformerEngine) makes steps more host-bound than this assumes."""

CPU_HOST_SECONDS_PER_OPERATOR = 7.5e-6
"""Host seconds per operator on the 2-core CPU VM (BENCHMARKS.md, "Host-bound steps: the
operator ratio is the time ratio")."""


@dataclass(frozen=True)
class MachineBalance:
    """A machine's figures the block size is chosen on: dense matrix peaks (FLOP/s) for 16-bit and
    for 32/64-bit operands (no TF32: torch's default for float32 products), memory bandwidth
    (bytes/s), host seconds per operator dispatched, and whether its kernels run while the host
    dispatches the next ones (``asynchronous``: a GPU; the CPU runs each operator as it comes), and
    the operators LIMe dispatches there (``operators``: the Triton path on a GPU, torch's on the
    CPU; ``chunk_routing_block`` swaps them for a run that asks for the other path)."""

    name: str
    flops_per_s: float
    fp32_flops_per_s: float
    bytes_per_s: float
    seconds_per_operator: float = GPU_HOST_SECONDS_PER_OPERATOR
    asynchronous: bool = True
    operators: HostOperators = TRITON_OPERATORS

    def peak(self, element_size: int) -> float:
        """Matrix peak (FLOP/s) for operands of ``element_size`` bytes."""
        return self.flops_per_s if element_size <= 2 else self.fp32_flops_per_s


# Dense (no sparsity) peaks and bandwidths from NVIDIA's data sheets (H100/H200 Tensor Core GPU,
# A100 Tensor Core GPU); the CPU's assumed (the shared VM's figures vary too much to measure).
CPU_2_CORE = MachineBalance(
    "2-core AVX2 CPU VM (fp32 peak 160 GFLOP/s, ~4 GB/s shared)",
    160e9,
    160e9,
    4e9,
    CPU_HOST_SECONDS_PER_OPERATOR,
    asynchronous=False,
    operators=TORCH_OPERATORS,
)
H100_SXM = MachineBalance("H100 SXM (bf16 989 TFLOP/s, fp32 67, HBM3 3.35 TB/s)", 989e12, 67e12, 3.35e12)
H100_PCIE = MachineBalance("H100 PCIe (bf16 756 TFLOP/s, fp32 51, HBM2e 2.0 TB/s)", 756e12, 51e12, 2.0e12)
H200 = MachineBalance("H200 (bf16 989 TFLOP/s, fp32 67, HBM3e 4.8 TB/s)", 989e12, 67e12, 4.8e12)
A100_80GB = MachineBalance("A100 80GB (bf16 312 TFLOP/s, fp32 19.5, HBM2e 2.04 TB/s)", 312e12, 19.5e12, 2.039e12)
A100_40GB = MachineBalance("A100 40GB (bf16 312 TFLOP/s, fp32 19.5, HBM2 1.56 TB/s)", 312e12, 19.5e12, 1.555e12)

MACHINES = dict(zip(MACHINE_NAMES, (H100_SXM, H100_PCIE, H200, A100_80GB, A100_40GB, CPU_2_CORE), strict=True))
"""Machines ``--lime-machine`` names (besides ``auto``: the device present)."""

DEVICE_NAMES = (
    (("H200",), H200),
    (("H100", "PCIE"), H100_PCIE),
    (("H100",), H100_SXM),
    (("A100", "40GB"), A100_40GB),
    (("A100",), A100_80GB),
)
"""(fragments of ``torch.cuda.get_device_name()``, all present, upper case; machine), first match."""

CAPABILITY_FALLBACK = {9: H100_SXM, 8: A100_80GB}
"""An unknown GPU's figures by compute capability major (else ``H100_SXM``), with a warning."""


def device_machine(device_name: str, capability: tuple[int, int]) -> MachineBalance:
    """The figures of the GPU named ``device_name`` (``torch.cuda.get_device_name()``) with compute
    ``capability``: the first ``DEVICE_NAMES`` entry whose fragments it contains, else (warning
    which figures it assumed) those of its compute capability's generation."""
    name = device_name.upper()
    for fragments, machine in DEVICE_NAMES:
        if all(fragment in name for fragment in fragments):
            return machine
    machine = CAPABILITY_FALLBACK.get(capability[0], H100_SXM)
    warnings.warn(
        f"routing block size: unknown GPU {device_name!r} (compute capability "
        f"{capability[0]}.{capability[1]}); assuming the figures of {machine.name}; "
        f"--lime-machine names the machine",
        stacklevel=2,
    )
    return machine


@functools.cache
def present_machine() -> MachineBalance:
    """The figures of the device this process runs on (looked up once): the current CUDA device's
    (``device_machine``), else ``CPU_2_CORE``."""
    if not torch.cuda.is_available():
        return CPU_2_CORE
    device = torch.cuda.current_device()
    return device_machine(torch.cuda.get_device_name(device), torch.cuda.get_device_capability(device))


def routing_machine(config) -> MachineBalance:
    """The machine ``config.lime_machine`` names (``MACHINES``), or for ``auto`` the one present."""
    choice = config.lime_machine
    if choice == "auto":
        return present_machine()
    if choice not in MACHINES:
        raise LimeConfigError(f"lime_machine must be auto or one of {sorted(MACHINES)}, got {choice!r}")
    return MACHINES[choice]


def path_machine(config, machine: MachineBalance) -> MachineBalance:
    """``machine`` with the operators of the path the run takes there (``kernels.routing_path``):
    a GPU's Triton path unless the run asks for torch's, the CPU's torch path unless it asks for
    Triton's; under tensor parallelism the Triton path's there (``triton_operators``)."""
    triton = planned_kernel(config, torch.device("cuda" if machine.asynchronous else "cpu")) == "triton"
    return dataclasses.replace(machine, operators=triton_operators(config) if triton else TORCH_OPERATORS)


def triton_operators(config) -> HostOperators:
    """The Triton path's operators for ``config``'s tensor parallelism: ``TRITON_OPERATORS``
    without it, ``TENSOR_PARALLEL_TRITON_OPERATORS`` with it, ``SHARED_HEADS_TRITON_OPERATORS``
    with fewer kv heads than ranks."""
    size = config.tensor_model_parallel_size
    if size == 1:
        return TRITON_OPERATORS
    return TENSOR_PARALLEL_TRITON_OPERATORS if config.kv_heads >= size else SHARED_HEADS_TRITON_OPERATORS


def blocks_of(layers: range, block: int) -> list[range]:
    """The chunk's blocks: ``block`` consecutive layers from its first (the last may be shorter)."""
    return [range(first, min(first + block, layers.stop)) for first in range(layers.start, layers.stop, block)]


def forward_products(layers: range, kv_heads: int, block: int) -> list[tuple[int, int]]:
    """``(rows read, output rows)`` of each forward product of the ``full`` routing of the chunk of
    global layers ``layers`` with blocks of ``block`` layers from its first: with ``block > 1`` per
    block one product over all the rows before it (B * kv_heads outputs; none before layer 0) and
    per layer one over its in-block rows; with ``block = 1`` per layer one product over all its
    sources.  Layer 0 runs none.  Rows in units of one layer's kv head (2 * s * b * d elements)."""
    products = []
    for consumers in blocks_of(layers, block):
        if block > 1 and consumers.start > 0:
            products.append((consumers.start * kv_heads, len(consumers) * kv_heads))
        first_source = consumers.start if block > 1 else 0
        products += [((m - first_source + 1) * kv_heads, kv_heads) for m in consumers if m > 0]
    return products


def host_operators(layers: range, block: int, received: int = 0, counts: HostOperators = TORCH_OPERATORS) -> float:
    """Operators LIMe dispatches beyond the baseline in one forward+backward of the chunk's
    ``layers`` at block size ``block``, the chunk having ``received`` blocks of earlier rows (one
    per earlier pipeline chunk), by ``counts`` (``HostOperators``): per layer, at B = 1 plus per
    received block; at B > 1 per block with earlier sources and per layer of it, each plus per
    received block, and per received block once."""
    if block == 1:
        return (counts.per_layer + counts.per_received_block_per_layer * received) * len(layers)
    blocked = [len(consumers) for consumers in blocks_of(layers, block) if consumers.start > 0]
    per_block = counts.per_block + counts.per_received_block_per_block * received
    per_chunk = counts.per_received_block_per_chunk * received
    if layers.start == 0 and blocked:
        per_chunk += counts.per_first_block
    per_blocked_layer = counts.per_blocked_layer + counts.per_received_block_per_blocked_layer * received
    blocks = per_block * len(blocked) + per_blocked_layer * sum(blocked)
    return counts.per_layer * len(layers) + per_chunk + blocks


def routing_step_seconds(
    layers: range,
    kv_heads: int,
    block: int,
    row_elements: int,
    element_size: int,
    machine: MachineBalance,
    received: int = 0,
    baseline: tuple[float, float] = (0.0, 0.0),
) -> float:
    """Seconds of one micro-batch's forward and backward of the chunk's ``layers`` at block size
    ``block`` on ``machine``: the device's ``STEP_PRODUCTS_PER_FORWARD`` times the roofline of the
    forward products (``forward_products``, rows of ``row_elements`` elements of ``element_size``
    bytes, each product max(bytes / bandwidth, FLOPs / peak), its outputs written and read once)
    and the host's seconds for ``host_operators`` (``received`` blocks of earlier rows); with the
    baseline's ``(host seconds, device seconds)`` (``baseline_work``) the longer of host and device
    on an asynchronous machine, their sum on another."""
    peak = machine.peak(element_size)
    kernels = sum(
        max(
            (rows + 2 * outputs) * row_elements * element_size / machine.bytes_per_s,
            2.0 * rows * outputs * row_elements / peak,
        )
        for rows, outputs in forward_products(layers, kv_heads, block)
    )
    host = host_operators(layers, block, received, machine.operators) * machine.seconds_per_operator
    base_host, base_device = baseline
    if machine.asynchronous:
        return max(base_host + host, base_device + STEP_PRODUCTS_PER_FORWARD * kernels)
    return base_host + base_device + STEP_PRODUCTS_PER_FORWARD * kernels + host


def baseline_work(
    config, layers: range, seq_length: int, micro_batch_size: int, machine: MachineBalance
) -> tuple[float, float]:
    """The baseline's (host seconds, device seconds) in one micro-batch's forward and backward of
    the chunk's ``layers`` on one tensor-parallel rank: ``BASELINE_OPERATORS_PER_LAYER`` per layer
    at the machine's pace, and three times the layers' forward FLOPs (``flops.layer_flops_per_token``)
    at ``ACHIEVED_MATRIX_FRACTION`` of the peak."""
    element_size = torch.empty(0, dtype=config.params_dtype).element_size()
    flops = 3 * layer_flops_per_token(config, seq_length) * seq_length * micro_batch_size * len(layers)
    device = flops / config.tensor_model_parallel_size / (machine.peak(element_size) * ACHIEVED_MATRIX_FRACTION)
    return BASELINE_OPERATORS_PER_LAYER * len(layers) * machine.seconds_per_operator, device


def block_size_limit(layers: range) -> int:
    """The largest block size considered for the chunk's ``layers``: 2 * isqrt(layers.stop), at
    most the chunk's length (at least 1)."""
    return max(1, min(len(layers), 2 * math.isqrt(layers.stop)))


def routing_block_size(
    layers: range,
    kv_heads: int,
    row_elements: int,
    element_size: int,
    machine: MachineBalance,
    received: int = 0,
    baseline: tuple[float, float] = (0.0, 0.0),
) -> int:
    """The block size of least ``routing_step_seconds`` up to ``block_size_limit``, the smallest
    whose time exceeds the best by at most 1% of what LIMe adds to the baseline's there (a larger
    block only lengthens the in-block products and the partial sums' life)."""
    times = {
        block: routing_step_seconds(layers, kv_heads, block, row_elements, element_size, machine, received, baseline)
        for block in range(1, block_size_limit(layers) + 1)
    }
    best = min(times.values())
    baseline_alone = max(baseline) if machine.asynchronous else sum(baseline)
    return min(block for block, seconds in times.items() if seconds - best <= 0.01 * (best - baseline_alone))


def chunk_routing_block(
    config, layers: range, seq_length: int, micro_batch_size: int, machine: MachineBalance | None = None
) -> int:
    """The block size the model chunk of global ``layers`` runs with: ``config.lime_routing_block``,
    else ``routing_block_size`` on ``machine`` (default ``routing_machine(config)``) for this rank's
    kv heads, rows of ``seq_length * micro_batch_size`` tokens and one received block of rows per
    earlier pipeline chunk (``parallel.pipeline.chunk_layers``), beside the baseline's work on
    those layers (``baseline_work``); kept inside recomputed chunks
    (``routing_blocks.recompute_safe_block``).  The dynamic router's per-token products are not
    blocked, and the baseline routes nothing: 1."""
    if not config.lime or config.lime_router == "dynamic":
        return 1
    block = config.lime_routing_block
    if block is None:
        kv_heads = max(1, config.kv_heads // config.tensor_model_parallel_size)
        row_elements = 2 * seq_length * micro_batch_size * config.kv_channels
        element_size = torch.empty(0, dtype=config.params_dtype).element_size()
        received = sum(1 for chunk in chunk_layers(config) if chunk and chunk.stop <= layers.start)
        machine = path_machine(config, machine or routing_machine(config))
        baseline = baseline_work(config, layers, seq_length, micro_batch_size, machine)
        block = routing_block_size(layers, kv_heads, row_elements, element_size, machine, received, baseline)
    return recompute_safe_block(config, block)
