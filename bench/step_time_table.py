"""Simulated iteration time of the deep examples (32/64/128 layers) by pipeline layout and link.

For each deep example config (LIMe and its LLaMA baseline, shape, batch and precision as in
examples/*.yaml) at a world of ``--world-size`` GPUs, for PP 4/8 x VPP 1/2/4 with layers split
evenly, and the example's own uneven layout: the step-time model's iteration time
(``lime_megatron.planning.schedule_model``; transfers as the run does them: overlapped with compute
in the interleaved schedule, where ``overlap_p2p_comm`` is on by default, blocking in 1F1B; hops at
``pipeline.exact_stage_width``), LIMe over baseline, the bubble and the transfer left exposed,
over the NVLink-like and InfiniBand-like links. Prints a markdown table (examples/README.md).

Run:
    python bench/step_time_table.py
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tables import field, print_table
from tqdm import tqdm

from lime_megatron.planning.schedule_model import (
    DEFAULT_COMPUTE_TFLOPS,
    INFINIBAND,
    NVLINK,
    overlaps_transfers,
    pipeline_work,
    step_time,
)
from lime_megatron.training import arguments, data
from lime_megatron.training.run_config import RunConfig

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
LAYOUTS = [(pp, vpp) for pp in (4, 8) for vpp in (1, 2, 4)]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=64, help="GPUs of the run (default 64)")
    parser.add_argument("--compute-tflops", type=float, default=DEFAULT_COMPUTE_TFLOPS)
    parser.add_argument("--depths", type=int, nargs="+", default=[32, 64, 128])
    return parser.parse_args(argv)


def run_config(model: str, depth: int, world_size: int, layout: tuple[int, int] | None) -> RunConfig:
    """The run of examples/{model}_deep{depth}.yaml at ``layout`` (PP, VPP; layers split
    evenly), or at the example's own layout (None)."""
    argv = [
        "--config",
        str(EXAMPLES / f"{model}_deep{depth}.yaml"),
        "--dry-run",
        "--mock-data",
        "--dry-run-world-size",
        str(world_size),
    ]
    if layout is not None:
        pp, vpp = layout
        argv += ["--pipeline-model-parallel-size", str(pp), "--num-virtual-stages-per-pipeline-rank", str(vpp)]
    args = arguments.parse_args(argv)
    if layout is not None:
        args.decoder_first_pipeline_num_layers = args.decoder_last_pipeline_num_layers = None
    return RunConfig.from_namespace(args)


def pipeline_of(model: str, depth: int, world_size: int, layout, compute_tflops: float):
    """(config, microbatches, per-chunk work) of the example at ``layout``; only the step time
    depends on the link."""
    run = run_config(model, depth, world_size, layout)
    config = arguments.transformer_config(run)
    m = run.training.num_microbatches
    work = pipeline_work(
        config,
        vocab_size=data.tokenizer_of(run.data, run.model.vocab_size).vocab_size,
        seq_length=run.model.seq_length,
        micro_batch_size=run.training.micro_batch_size,
        num_microbatches=m,
        compute_tflops=compute_tflops,
    )
    return config, m, work


COLUMNS = [
    ("layers", field("layers")),
    ("layout", field("layout")),
    ("microbatches", field("microbatches")),
    ("transfers", field("transfers")),
    ("link", field("link")),
    ("LLaMA", field("llama", ",.0f")),
    ("LIMe", field("lime", ",.0f")),
    ("LIMe over LLaMA", lambda row: f"{row['over']:+.1f}%"),
    ("LIMe bubble", lambda row: f"{row['bubble']:.1f}%"),
    ("LIMe exposed transfer", field("exposed", ",.0f")),
]
"""The table's columns: iteration times in ms per layout and link, LIMe's bubble and exposed transfer."""


def main(argv=None) -> None:
    options = parse_args(argv)
    cases = [(depth, layout) for depth in options.depths for layout in [None, *LAYOUTS]]
    rows = []
    for depth, layout in tqdm(cases, desc="layouts"):
        config, m, lime_work = pipeline_of("lime", depth, options.world_size, layout, options.compute_tflops)
        _, _, llama_work = pipeline_of("llama", depth, options.world_size, layout, options.compute_tflops)
        pp, vpp = config.pipeline_model_parallel_size, config.virtual_pipeline_model_parallel_size or 1
        name = f"PP{pp} x VPP{vpp}" + (" (example)" if layout is None else "")
        overlapped = overlaps_transfers(config)
        for link in (NVLINK, INFINIBAND):
            (lime, exposed), (llama, _) = (step_time(work, link).as_run(overlapped) for work in (lime_work, llama_work))
            bubble = step_time(lime_work, link).bubble
            rows.append(
                dict(
                    layers=depth,
                    layout=name,
                    microbatches=m,
                    transfers="overlapped" if overlapped else "blocking",
                    link=link.name,
                    llama=1e3 * llama,
                    lime=1e3 * lime,
                    over=100 * (lime / llama - 1),
                    bubble=100 * bubble,
                    exposed=1e3 * exposed,
                )
            )
    print(
        f"world {options.world_size} GPUs, {options.compute_tflops:g} TFLOP/s per GPU; iteration times in ms, "
        "transfers as the run does them\n"
    )
    print_table(COLUMNS, rows, markdown=True)


if __name__ == "__main__":
    main()
