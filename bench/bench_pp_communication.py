"""Bytes between pipeline stages per micro-batch, LIMe over the LLaMA baseline, and CPU step time.

Bytes.  For each setting (layers x pipeline size x virtual stages x MHA/GQA) it launches one gloo
process per pipeline rank, builds LIMe and the baseline as the trainer does
(``training.build_model_chunks``), runs ``--micro-batches`` micro-batches of forward+backward
through megatron's schedule (``training.forward_backward``) and counts every tensor handed to
``torch.distributed``'s point-to-point calls (``isend``/``irecv``/``send``/``recv`` and batched
``P2POp``s): megatron's hidden states and LIMe's K/V rows on its side channel.  Per rank and
micro-batch: bytes received (forward: hidden states and rows; backward: their gradients, the
same amount), and the widest hop (hidden + rows, one direction).  The bound a rank must receive:
the rows of the earlier layers its chunks read that it does not produce
(``router.routing_sources``), plus one hidden state per hop into its chunks.  ``old padded`` is
the design this replaced, by its formula: every hop into a rank's chunks padded to the widest
boundary, ``hidden + 2 * carried * kv_heads * head_dim`` per position.

Step time (``--time``): one process per rank at PP4 x VPP2, LIMe and baseline, megatron's
``overlap_p2p_comm`` off and on; median seconds per forward+backward of ``--micro-batches``.

Run (the figures in BENCHMARKS.md):
    python bench/bench_pp_communication.py
    python bench/bench_pp_communication.py --time
    python bench/bench_pp_communication.py --planned      # the same table from pipeline.hop_elements
"""

from __future__ import annotations

import argparse
import inspect
import os
import socket
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.multiprocessing as mp
from tables import field, print_table, ratio
from tqdm import tqdm

from lime_megatron.parallel import pipeline

HIDDEN = dict(hidden_size=256, ffn_hidden_size=1024, num_attention_heads=8)  # paper §5.4 deep settings
KV_HEADS = {"mha": 8, "gqa": 2}  # GQA: kv = heads / 4


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, nargs="+", default=[32, 64, 128])
    parser.add_argument("--pipeline", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--virtual", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--attention", nargs="+", default=["mha", "gqa"], choices=sorted(KV_HEADS))
    parser.add_argument("--seq-length", type=int, default=256)
    parser.add_argument("--micro-batch-size", type=int, default=1)
    parser.add_argument("--micro-batches", type=int, default=None, help="default: the pipeline size")
    parser.add_argument("--vocab-size", type=int, default=256)
    parser.add_argument("--time", action="store_true", help="measure step time at PP4 x VPP2 instead")
    parser.add_argument(
        "--planned",
        action="store_true",
        help="no processes: the same table from pipeline.hop_elements (which "
        "tests/parallel/test_lime_pipeline.py checks against the bytes handed to isend)",
    )
    parser.add_argument("--time-layers", type=int, default=16)
    parser.add_argument("--iterations", type=int, default=5)
    args = parser.parse_args(argv)
    if not args.time and not args.planned and min(args.pipeline) < 3:
        parser.error(
            "--pipeline sizes must be >= 3 when counting: at PP=2 the previous and next rank are one "
            "peer (and megatron sends half the traffic over the world group), so forward and backward "
            "transfers cannot be told apart"
        )
    return args


# --------------------------------------------------------------------------- counting


@dataclass
class BatchedOp:
    """A ``P2POp`` as the code under count builds it (``op`` one of the counted functions)."""

    op: object
    tensor: torch.Tensor
    peer: int | None = None
    group: object = None
    tag: int = 0


class P2PCounter:
    """Wraps ``torch.distributed``'s point-to-point calls and adds each tensor's bytes by
    (phase, kind, direction): phase ``forward``/``backward``, kind ``hidden`` (megatron's stage
    tensor) or ``rows`` (LIMe's K/V rows, posted with it on the pipeline group), direction
    ``sent``/``received``.  ``hops`` adds the rows' forward bytes per receiving chunk (the hop
    ``KeptRows.attached_ops`` sizes each receive for).  Needs 3 or more
    pipeline ranks (the previous and next rank differ)."""

    NAMES = ("isend", "irecv", "send", "recv")

    def __init__(self):
        from megatron.core import parallel_state

        self.bytes = defaultdict(int)
        self.hops = defaultdict(int)
        self.row_phase: dict[int, str] = {}  # id of a row tensor about to be posted -> its phase
        self.pp_group = parallel_state.get_pipeline_model_parallel_group()
        ranks = torch.distributed.get_process_group_ranks(self.pp_group)
        rank = parallel_state.get_pipeline_model_parallel_rank()
        self.next_rank = ranks[(rank + 1) % len(ranks)]
        self._originals = {}

    def _record(self, sending: bool, tensor: torch.Tensor, peer: int, group, tag: int) -> None:
        direction = "sent" if sending else "received"
        size = tensor.numel() * tensor.element_size()
        if id(tensor) in self.row_phase:  # attached to a hidden-state operation by ``KeptRows.attached_ops``
            kind, phase = "rows", self.row_phase.pop(id(tensor))
        else:
            kind, phase = "hidden", "forward" if (peer == self.next_rank) == sending else "backward"
        self.bytes[phase, kind, direction] += size

    def _count_hops(self, attached):
        """``KeptRows.attached_ops`` adding each forward receive's bytes to its hop."""

        def counted(kept, kind, hidden):
            hop = kept.expected[kind][0][0] if kind == "recv_prev" else None  # (receiving chunk, micro-batch)
            ops, keep = attached(kept, kind, hidden)
            phase = "forward" if kind in ("send_next", "recv_prev") else "backward"
            self.row_phase.update((id(op.tensor), phase) for op in ops)
            if hop is not None:
                self.hops[hop] += sum(op.tensor.numel() * op.tensor.element_size() for op in ops)
            return ops, keep

        return counted

    def __enter__(self) -> P2PCounter:
        distributed = torch.distributed
        for name in self.NAMES:
            original = self._originals[name] = getattr(distributed, name)

            def counted(*args, _sending=name in ("isend", "send"), _original=original, **kwargs):
                bound = inspect.signature(_original).bind(*args, **kwargs).arguments
                peer = bound.get("dst" if _sending else "src")
                if peer is None:  # group_dst / group_src: a rank of ``group``
                    local = bound.get("group_dst", bound.get("group_src"))
                    peer = torch.distributed.get_global_rank(bound["group"], local)
                self._record(_sending, bound["tensor"], peer, bound.get("group"), bound.get("tag", 0))
                return _original(*args, **kwargs)

            setattr(distributed, name, counted)
        original_batch = self._originals["batch_isend_irecv"] = distributed.batch_isend_irecv
        original_op = self._originals["P2POp"] = distributed.P2POp

        def counted_batch(ops):  # ``ops`` name the counted functions: posted with the originals
            real = []
            for op in ops:
                sending = op.op in (distributed.isend, self._originals["isend"])
                self._record(sending, op.tensor, op.peer, op.group, op.tag)  # peer: a global rank
                real.append(
                    original_op(self._originals["isend" if sending else "irecv"], op.tensor, op.peer, op.group, op.tag)
                )
            return original_batch(real)

        distributed.P2POp = BatchedOp  # torch's P2POp refuses functions other than its own isend/irecv
        distributed.batch_isend_irecv = counted_batch
        self._attached = pipeline.KeptRows.attached_ops
        pipeline.KeptRows.attached_ops = self._count_hops(self._attached)
        return self

    def __exit__(self, *exc) -> None:
        for name, original in self._originals.items():
            setattr(torch.distributed, name, original)
        pipeline.KeptRows.attached_ops = self._attached


def make_config(layers: int, attention: str, pp: int, vpp: int | None, lime: bool, **options):
    from lime_megatron.models.config import lime_config

    return lime_config(
        lime=lime,
        num_layers=layers,
        num_query_groups=KV_HEADS[attention],
        **HIDDEN,
        use_cpu_initialization=True,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        pipeline_dtype=torch.float32,
        deallocate_pipeline_outputs=True,
        **options,
    )


def _batches(args, count: int) -> list[dict]:
    generator = torch.Generator().manual_seed(0)
    shape = (args.micro_batch_size, args.seq_length)
    tokens = [torch.randint(args.vocab_size, shape, generator=generator) for _ in range(count)]
    return [
        dict(tokens=t, labels=t, position_ids=torch.arange(args.seq_length).expand(shape), loss_mask=torch.ones(shape))
        for t in tokens
    ]


def _build(config, args) -> list:
    from lime_megatron.training.trainer import build_model_chunks

    return build_model_chunks(config, args.vocab_size, args.seq_length)


def count_setting(layers: int, attention: str, vpp: int | None, lime: bool, args) -> dict:
    """This rank's counted bytes per micro-batch for one forward+backward schedule call."""
    from megatron.core import parallel_state

    from lime_megatron.training.trainer import forward_backward

    pp = parallel_state.get_pipeline_model_parallel_world_size()
    config = make_config(layers, attention, pp, vpp, lime, perform_initialization=False)
    model = _build(config, args)
    per = args.micro_batches or pp
    with P2PCounter() as counter:
        forward_backward(model, _batches(args, per))
    return dict(
        bytes={key: value / per for key, value in counter.bytes.items()},
        hops={key: value / per for key, value in counter.hops.items()},
    )


def _bytes_worker(rank: int, world: int, port: int, settings: list, args, results) -> None:
    from lime_megatron.parallel.process_groups import destroy_parallel, initialize_parallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    for layers, attention, vpp in settings:
        initialize_parallel(pipeline_model_parallel_size=world, virtual_pipeline_model_parallel_size=vpp)
        for lime in (False, True):
            results[(layers, attention, world, vpp, lime, rank)] = count_setting(layers, attention, vpp, lime, args)
        destroy_parallel()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# --------------------------------------------------------------------------- bounds


def received_bound(config, rank: int, seq: int, batch: int) -> int:
    """Bytes rank ``rank`` must receive per micro-batch, forward: the rows of the layers its
    chunks read that it does not produce, plus a hidden state per hop into its chunks."""
    from lime_megatron.models.lime.router import routing_sources
    from lime_megatron.parallel.pipeline import chunk_layers

    chunks = chunk_layers(config)
    mine = range(rank, len(chunks), config.pipeline_model_parallel_size)
    produced = {layer for chunk in mine for layer in chunks[chunk]}
    read = {
        source
        for chunk in mine
        for layer in chunks[chunk]
        for source in routing_sources(layer, config.lime_router, config.lime_router_window)
    }
    hops = sum(1 for chunk in mine if chunk > 0)
    row = 2 * seq * batch * config.kv_heads * config.kv_channels
    return 4 * (len(read - produced) * row + hops * seq * batch * config.hidden_size)


def old_padded_received(config, rank: int, seq: int, batch: int) -> int:
    """Bytes rank ``rank`` received per micro-batch forward under the replaced design: each hop
    into its chunks a stage tensor as wide as the widest boundary."""
    from lime_megatron.parallel.pipeline import carried_layers, chunk_layers

    chunks = chunk_layers(config)
    widest = max(len(carried_layers(config, layers.start)) for layers in chunks)
    width = config.hidden_size + 2 * widest * config.kv_heads * config.kv_channels
    hops = sum(1 for chunk in range(rank, len(chunks), config.pipeline_model_parallel_size) if chunk > 0)
    return 4 * hops * seq * batch * width


def settings(args):
    """(layers, attention, pp, vpp or None) of every setting whose layers split evenly."""
    for pp in args.pipeline:
        for vpp in args.virtual:
            for layers in args.layers:
                if layers % (pp * vpp) == 0:
                    for attention in args.attention:
                        yield layers, attention, pp, vpp if vpp > 1 else None


def table_row(args, layers, attention, pp, vpp, received, sent, base, widest_hop, backward_equal) -> dict:
    """One table row from per-rank received/sent bytes, with the bound and the old padded design."""
    config = make_config(layers, attention, pp, vpp, True, perform_initialization=False)
    seq, batch = args.seq_length, args.micro_batch_size
    bounds = [received_bound(config, rank, seq, batch) for rank in range(pp)]
    return dict(
        layers=layers,
        attention=attention,
        pp=pp,
        vpp=vpp or 1,
        widest_hop=widest_hop,
        lime=max(received),
        sent=max(sent),
        base=base,
        bound=max(bounds),
        worst=max(got / bound for got, bound in zip(received, bounds) if bound),
        old=max(old_padded_received(config, rank, seq, batch) for rank in range(pp)),
        backward_equal=backward_equal,
    )


def _total(result: dict, phase: str, direction: str) -> float:
    return sum(result["bytes"].get((phase, kind, direction), 0) for kind in ("hidden", "rows"))


def measure_bytes(args) -> list[dict]:
    """One row per (layers, attention, pp, vpp): counted and bound bytes."""
    by_pipeline = defaultdict(list)
    for layers, attention, pp, vpp in settings(args):
        by_pipeline[pp].append((layers, attention, vpp))
    rows = []
    for pp, group in tqdm(sorted(by_pipeline.items()), desc="pipeline sizes"):
        results = mp.Manager().dict()
        mp.spawn(_bytes_worker, args=(pp, _free_port(), group, args, results), nprocs=pp)
        for layers, attention, vpp in group:
            lime = [results[(layers, attention, pp, vpp, True, rank)] for rank in range(pp)]
            base = [results[(layers, attention, pp, vpp, False, rank)] for rank in range(pp)]
            hidden_per_hop = lime[-1]["bytes"][("forward", "hidden", "received")] / (vpp or 1)
            rows.append(
                table_row(
                    args,
                    layers,
                    attention,
                    pp,
                    vpp,
                    received=[_total(r, "forward", "received") for r in lime],
                    sent=[_total(r, "forward", "sent") for r in lime],
                    base=max(_total(r, "forward", "received") for r in base),
                    widest_hop=hidden_per_hop + max(h for r in lime for h in r["hops"].values()),
                    backward_equal=all(_total(r, "backward", "received") == _total(r, "forward", "sent") for r in lime),
                )
            )
    return rows


def planned_bytes(args) -> list[dict]:
    """The table of ``measure_bytes`` from ``pipeline.hop_elements``, without processes."""
    rows = []
    seq, batch = args.seq_length, args.micro_batch_size
    for layers, attention, pp, vpp in settings(args):
        config = make_config(layers, attention, pp, vpp, True, perform_initialization=False)
        chunks = pp * (vpp or 1)
        hops = {chunk: 4 * sum(pipeline.hop_elements(config, chunk, seq, batch)) for chunk in range(1, chunks)}
        rows.append(
            table_row(
                args,
                layers,
                attention,
                pp,
                vpp,
                received=[sum(hops.get(chunk, 0) for chunk in range(rank, chunks, pp)) for rank in range(pp)],
                sent=[sum(hops.get(chunk + 1, 0) for chunk in range(rank, chunks, pp)) for rank in range(pp)],
                base=4 * seq * batch * config.hidden_size * (vpp or 1),
                widest_hop=max(hops.values()),
                backward_equal=True,
            )
        )
    return rows


MIB = 2**20

BYTES_COLUMNS = [
    ("layers", field("layers")),
    ("attn", field("attention")),
    ("PPxVPP", lambda row: f"{row['pp']}x{row['vpp']}"),
    ("widest hop", field("widest_hop", ".2f", MIB)),
    ("LIMe recv", field("lime", ".2f", MIB)),
    ("LIMe sent", field("sent", ".2f", MIB)),
    ("bound", field("bound", ".2f", MIB)),
    ("recv/bound", field("worst", ".3f")),
    ("base recv", field("base", ".2f", MIB)),
    ("LIMe/base", ratio("lime", "base", ".1f")),
    ("old padded", field("old", ".2f", MIB)),
    ("new/old", ratio("lime", "old", ".2f")),
]
"""The bytes table's columns, MiB per micro-batch and rank, forward."""


def print_bytes(rows: list[dict]) -> None:
    print("MiB per micro-batch and rank, forward (backward returns the same); recv/sent: the busiest rank")
    print_table(BYTES_COLUMNS, rows)


# --------------------------------------------------------------------------- step time


def _time_worker(rank: int, world: int, port: int, args, results) -> None:
    """The four models (overlap off/on x baseline/LIMe) timed in turn, one schedule call each per
    round, so that drifting load hits them alike; the first round is a warm-up."""
    from lime_megatron.parallel.process_groups import destroy_parallel, initialize_parallel
    from lime_megatron.training.trainer import forward_backward

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    initialize_parallel(pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=2)
    batches = _batches(args, args.micro_batches or 8)
    models = {
        (overlap, lime): _build(
            make_config(args.time_layers, "mha", 4, 2, lime, overlap_p2p_comm=overlap, batch_p2p_comm=not overlap), args
        )
        for overlap in (False, True)
        for lime in (False, True)
    }
    times = defaultdict(list)
    for _ in range(args.iterations + 1):
        for key, model in models.items():
            torch.distributed.barrier()
            start = time.perf_counter()
            forward_backward(model, batches)
            times[key].append(time.perf_counter() - start)
    if rank == 0:
        results.update({key: statistics.median(seconds[1:]) for key, seconds in times.items()})
    destroy_parallel()


def measure_time(args) -> None:
    results = mp.Manager().dict()
    mp.spawn(_time_worker, args=(4, _free_port(), args, results), nprocs=4)
    print(
        f"PP4 x VPP2, {args.time_layers} layers, hidden 256, MHA, seq {args.seq_length}, "
        f"{args.micro_batches or 8} micro-batches: median s per forward+backward of {args.iterations}"
    )
    rows = [
        dict(
            overlap=str(overlap),
            base=f"{results[(overlap, False)]:.3f}",
            lime=f"{results[(overlap, True)]:.3f}",
            ratio=f"{results[(overlap, True)] / results[(overlap, False)]:.2f}",
        )
        for overlap in (False, True)
    ]
    rows.append(
        dict(
            overlap="on / off",
            base=f"{results[(True, False)] / results[(False, False)]:.2f}",
            lime=f"{results[(True, True)] / results[(False, True)]:.2f}",
            ratio="",
        )
    )
    print_table(
        [
            ("overlap_p2p_comm", field("overlap")),
            ("baseline s", field("base")),
            ("LIMe s", field("lime")),
            ("LIMe/base", field("ratio")),
        ],
        rows,
    )


def main(argv=None):
    args = parse_args(argv)
    if args.time:
        return measure_time(args)
    rows = planned_bytes(args) if args.planned else measure_bytes(args)
    print_bytes(rows)
    worst = max(r["worst"] for r in rows if r["vpp"] > 1)
    print(
        f"\nsummary: with virtual stages every rank receives at most {worst:.3f} x its bound; backward "
        f"returns what forward sent on every rank: {all(r['backward_equal'] for r in rows)}; "
        f"128 layers MHA PP4xVPP4 new/old padded: "
        + ", ".join(
            f"{r['lime'] / r['old']:.2f}"
            for r in rows
            if (r["layers"], r["attention"], r["pp"], r["vpp"]) == (128, "mha", 4, 4)
        )
    )
    return rows


if __name__ == "__main__":
    main()
