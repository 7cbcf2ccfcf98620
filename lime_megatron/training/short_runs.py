"""Short trainer runs compared across parallel layouts and precisions (the GPU check's training
legs, ``python -m lime_megatron.gpu_check``; tested on CPU over gloo).

Each leg is a few iterations of the trainer itself (``trainer.train``, what ``pretrain_lime.py``
runs) on megatron's mock data, from the layout-invariant initialisation (``--init-seed``-style:
the same weights at every layout), so the legs differ only in what they test:

- **layouts**: tensor parallelism (``TP2`` with sequence parallelism) and pipeline parallelism
  (``PP2``: LIMe's K/V rows cross the stage boundary through its side channel) against the data-
  parallel run over the same world (``DP``: the one-device model, its gradients averaged over
  identical shares of the same global batch), in float32: the losses of every iteration agree to
  summation order;
- **mixed precision**: ``--bf16`` (megatron's ``Float16Module``, fp32 main parameters) with the
  distributed optimizer against the float32 run of the same layout: within bf16 rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

from lime_megatron.training import trainer

LAYOUT_LEGS = {
    "TP2": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "PP2": ["--pipeline-model-parallel-size", "2"],
}
"""Layout legs, as trainer flags, each compared against the data-parallel run of the same world."""
MIXED_PRECISION_LEG = ["--bf16", "--use-distributed-optimizer"]
"""The mixed-precision leg's flags, compared against the float32 run."""


@dataclass(frozen=True)
class ShortRun:
    """The model and run every leg shares: shape, batch and a few iterations on mock data."""

    num_layers: int = 4
    hidden_size: int = 256
    num_attention_heads: int = 8
    num_query_groups: int = 2
    seq_length: int = 256
    micro_batch_size: int = 2
    global_batch_size: int = 8
    vocab_size: int = 1024
    iterations: int = 4
    lr: float = 1e-3

    def flags(self, lime: bool, transformer_impl: str = "local") -> list[str]:
        """Trainer flags of this run for LIMe (``lime``) or the LLaMA baseline."""
        return [
            "--num-layers",
            str(self.num_layers),
            "--hidden-size",
            str(self.hidden_size),
            "--num-attention-heads",
            str(self.num_attention_heads),
            "--num-query-groups",
            str(self.num_query_groups),
            "--seq-length",
            str(self.seq_length),
            "--micro-batch-size",
            str(self.micro_batch_size),
            "--global-batch-size",
            str(self.global_batch_size),
            "--vocab-size",
            str(self.vocab_size),
            "--train-iters",
            str(self.iterations),
            "--lr",
            str(self.lr),
            "--mock-data",
            "--eval-iters",
            "0",
            "--log-interval",
            str(self.iterations + 1),
            "--transformer-impl",
            transformer_impl,
            "--lime" if lime else "--no-lime",
        ]


def losses(flags: list[str]) -> list[float]:
    """The training loss of every iteration of ``trainer.train(flags)``."""
    result = trainer.train(flags)
    return [result.losses[iteration] for iteration in sorted(result.losses)]


def max_relative_difference(actual: list[float], expected: list[float]) -> float:
    """``max_i |a_i - e_i| / |e_i|`` over the iterations (inf if a run has other iterations)."""
    if len(actual) != len(expected):
        return float("inf")
    return max(abs(a - e) / abs(e) for a, e in zip(actual, expected))


def layout_differences(run: ShortRun, lime: bool) -> dict[str, float]:
    """Each of ``LAYOUT_LEGS`` against the data-parallel run over the same world: the largest
    relative loss difference over the iterations (float32, the local spec).  Needs a world of 2
    (or a multiple) processes, e.g. ``torchrun --nproc-per-node 2``."""
    flags = run.flags(lime)
    reference = losses(flags)
    return {leg: max_relative_difference(losses(flags + extra), reference) for leg, extra in LAYOUT_LEGS.items()}


def mixed_precision_difference(run: ShortRun, lime: bool, transformer_impl: str = "local") -> float:
    """``MIXED_PRECISION_LEG`` against the float32 run: the largest relative loss difference."""
    flags = run.flags(lime, transformer_impl)
    return max_relative_difference(losses(flags + MIXED_PRECISION_LEG), losses(flags))
