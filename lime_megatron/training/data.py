"""Training data: megatron-core's ``BlendedMegatronDatasetBuilder`` with ``GPTDataset`` (or
``MockGPTDataset`` for ``--mock-data``, :class:`~lime_megatron.data.sft_dataset.SFTDataset` for
``--sft``), and the microbatches of each iteration.

Datasets are indexed datasets written by ``tools/preprocess_data.py`` (``docs/data.md``), given
as Megatron-LM blends: ``--data-path [w1] prefix1 [w2] prefix2 ...`` split by ``--split``, or
one blend per split (``--train-data-path``, ``--valid-data-path``, ``--test-data-path``).

Sample order is a pure function of the global sample index: iteration i of the run trains on
the training samples ``[c, c + global_batch)`` where ``c`` is the number of samples consumed
before it, and data-parallel rank r takes the r-th contiguous share of them, cut into
microbatches. Resuming only needs ``c`` (stored in checkpoints). Validation always uses the first
``--eval-iters`` global batches of the validation split, so every evaluation sees the same data.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from megatron.core import parallel_state
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset

from lime_megatron.data.sft_dataset import SFTDataError, SFTDataset
from lime_megatron.data.tokenizer import NO_PAD, build_tokenizer, padded_vocab_size, tokenizer_kwargs
from lime_megatron.parallel.compat import default_device
from lime_megatron.training.arguments import UsageError, missing_dataset, parse_blend
from lime_megatron.training.run_config import NULL_TOKENIZER, DataOptions, RunConfig, TrainingOptions

BATCH_KEYS = ("tokens", "labels", "loss_mask", "position_ids")
"""Fields of a microbatch, each ``[micro_batch_size, seq_length]``."""


class DataError(UsageError):
    """Missing or unusable training data or tokenizer."""


@dataclass
class NullTokenizer:
    """The tokenizer of ``--mock-data`` and ``--tokenizer-type NullTokenizer``: ``vocab_size`` ids
    (padded the Megatron way), the last unpadded id is the end-of-document token, no padding
    token. (Megatron-LM's NullTokenizer adds the end-of-document id after the ``--vocab-size``
    ones; here ``--vocab-size`` counts it, so the vocabulary is exactly the flag's.)"""

    unpadded_vocab_size: int
    vocab_size: int
    eod: int
    pad: int = NO_PAD
    unique_identifiers: dict = field(default_factory=dict)

    @classmethod
    def of(cls, vocab_size: int, divisible_by: int, tensor_parallel: int) -> NullTokenizer:
        padded = padded_vocab_size(vocab_size, divisible_by, tensor_parallel)
        return cls(
            vocab_size, padded, vocab_size - 1, unique_identifiers={"class": "NullTokenizer", "vocab_size": padded}
        )


def tokenizer_of(options: DataOptions, vocab_size: int | None = None):
    """The run's tokenizer: a :class:`NullTokenizer` for ``--tokenizer-type NullTokenizer
    --vocab-size N`` or ``--vocab-size N`` alone (mock data and dry runs), else the one the
    tokenizer flags describe (``lime_megatron.data.tokenizer``).

    The vocabulary is padded to a multiple of ``--make-vocab-size-divisible-by`` alone (which
    must be divisible by the TP size), not of that times the TP size as in Megatron-LM, so the
    embedding's shape, and with it every checkpoint, does not depend on the layout."""
    if vocab_size is not None or options.tokenizer_type == NULL_TOKENIZER:
        return NullTokenizer.of(vocab_size, options.make_vocab_size_divisible_by, 1)
    try:
        return build_tokenizer(**{**tokenizer_kwargs(options), "tensor_model_parallel_size": 1})
    except (OSError, ValueError, RuntimeError) as error:  # sentencepiece raises RuntimeError
        raise DataError(f"cannot build the {options.tokenizer_type} tokenizer: {error}") from None


def _blend(tokens):
    """megatron's blend tuple for a blend flag's tokens, checking that every dataset exists."""
    if tokens is None:
        return None
    prefixes, weights = parse_blend(tokens)
    for prefix in prefixes:
        problem = missing_dataset(prefix)
        if problem:
            raise DataError(problem)
    return prefixes, weights


def dataset_config(options: DataOptions, seq_length: int, seed: int, tokenizer) -> GPTDatasetConfig:
    """``GPTDatasetConfig`` of sequences of ``seq_length`` tokens (mock when no blend is given)."""
    per_split = [_blend(options.train_data_path), _blend(options.valid_data_path), _blend(options.test_data_path)]
    blend = _blend(options.data_path)
    return GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=blend,
        blend_per_split=per_split if any(per_split) else None,
        split=options.split if blend is not None else None,
        path_to_cache=options.data_cache_path,
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=options.eod_mask_loss,
        create_attention_mask=False,
    )


@dataclass
class Datasets:
    """The train, validation and test datasets (None where the split is empty)."""

    train: GPTDataset | SFTDataset
    valid: GPTDataset | SFTDataset | None
    test: GPTDataset | SFTDataset | None

    def epochs(self, consumed_samples: int) -> float | None:
        """Epochs of the training split consumed (``--sft``; None for pretraining data)."""
        if isinstance(self.train, SFTDataset):
            return self.train.epoch_of(consumed_samples)
        return None


def build_datasets(run: RunConfig, tokenizer) -> Datasets:
    """Build the splits with megatron's ``BlendedMegatronDatasetBuilder`` (every rank builds
    them; the index cache is written once). Sizes: every training sample of the run, and
    ``--eval-iters`` global batches for validation and test."""
    training = run.training
    config = dataset_config(run.data, run.model.seq_length, training.seed, tokenizer)
    eval_samples = run.logging.eval_iters * training.global_batch_size
    sizes = [training.train_iters * training.global_batch_size, eval_samples, eval_samples]
    dataset_class = SFTDataset if run.data.sft else MockGPTDataset if config.mock else GPTDataset
    try:
        train, valid, test = BlendedMegatronDatasetBuilder(dataset_class, sizes, lambda: True, config).build()
    except SFTDataError as error:
        raise DataError(f"--sft: {error}") from None
    if train is None:
        raise DataError("the training split is empty: check --split or --train-data-path")
    return Datasets(train, valid, test)


def microbatches(dataset, first_sample: int, training: TrainingOptions) -> list[dict]:
    """This data-parallel rank's microbatches of the global batch starting at sample
    ``first_sample``: ``num_microbatches`` dicts of ``BATCH_KEYS`` tensors ``[mbs, seq]``."""
    size = training.micro_batch_size
    share = training.num_microbatches * size
    start = first_sample + parallel_state.get_data_parallel_rank() * share
    device = default_device()
    batches = []
    for micro in range(training.num_microbatches):
        first = start + micro * size
        samples = [dataset[index] for index in range(first, first + size)]
        batches.append({key: torch.stack([torch.as_tensor(s[key]) for s in samples]).to(device) for key in BATCH_KEYS})
    return batches
