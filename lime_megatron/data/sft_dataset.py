"""Supervised fine-tuning data: prompt/response pairs in a megatron indexed dataset, the loss on
the response only.

Storage. ``tools/preprocess_data.py --prompt-key P --json-keys R`` writes each record as one
document of two sequences, the prompt's tokens and the response's tokens followed by the
end-of-document token (prompt and response tokenized separately, as generation sees the prompt).

Samples. One example per sample, as Megatron-LM's SFT dataset does: the ``seq_length + 1`` tokens

    [eod] prompt response eod  pad ... pad

(the leading end-of-document token is what generation conditions on, ``inference.generation``),
cut into ``tokens = x[:-1]`` and ``labels = x[1:]``. ``loss_mask[i]`` is 1 exactly where
``labels[i]`` is a response token (its closing end-of-document token included), so the loss of a
batch is the mean over response tokens of ``-log p(response token | everything before it)``.
Padding is the end-of-document token, masked. An example longer than the sequence is an error
(nothing is cut silently).

Epochs. Sample ``i`` is example ``order_e[i mod n]`` of epoch ``e = i // n`` (``n`` examples in
the split), ``order_e`` a permutation drawn from ``(seed, e)``: every epoch shows every example
once, and the order depends only on the seed, so resuming needs only the consumed samples.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig
from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.datasets.megatron_dataset import MegatronDataset
from megatron.core.datasets.utils import Split

SEQUENCES_PER_EXAMPLE = 2
"""Prompt and response: the sequences of one document written by ``--prompt-key``."""


@functools.lru_cache(maxsize=2)
def epoch_order(seed: int, epoch: int, examples: int) -> np.ndarray:
    """The permutation of ``examples`` that epoch ``epoch`` shows them in."""
    return np.random.default_rng((seed, epoch)).permutation(examples)


class SFTDataError(ValueError):
    """An indexed dataset that is not prompt/response data, or an example that does not fit."""


class SFTDataset(MegatronDataset):
    """Prompt/response examples of an indexed dataset as megatron samples (``tokens``,
    ``labels``, ``loss_mask``, ``position_ids``, each ``[seq_length]``), built by megatron's
    ``BlendedMegatronDatasetBuilder`` like ``GPTDataset`` (blends, splits by document)."""

    def __init__(
        self,
        dataset: IndexedDataset,
        dataset_path: str | None,
        indices: np.ndarray,
        num_samples: int | None,
        index_split: Split,
        config: GPTDatasetConfig,
    ) -> None:
        super().__init__(dataset, dataset_path, indices, num_samples, index_split, config)
        if len(indices) == 0:
            raise SFTDataError(f"{dataset_path}: the {index_split.name} split has no examples")
        self.eod = config.tokenizer.eod
        self.first_sequence = self._first_sequences(dataset, dataset_path, indices)
        self._check_lengths(dataset, dataset_path, config.sequence_length)
        self.num_samples = num_samples if num_samples is not None else len(indices)

    @staticmethod
    def numel_low_level_dataset(low_level_dataset: IndexedDataset) -> int:
        """Documents (examples), the unit the splits divide."""
        return len(low_level_dataset.document_indices) - 1

    @staticmethod
    def build_low_level_dataset(dataset_path: str, config: GPTDatasetConfig) -> IndexedDataset:
        return IndexedDataset(dataset_path, multimodal=False, mmap=config.mmap_bin_files)

    @property
    def examples_per_epoch(self) -> int:
        return len(self.indices)

    def epoch_of(self, sample: int) -> float:
        """Epochs completed once samples ``[0, sample)`` are consumed."""
        return sample / self.examples_per_epoch

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, sample: int) -> dict[str, torch.Tensor]:
        prompt, response = self.example(self.example_of(sample))
        return self.sample_of(prompt, response)

    def example_of(self, sample: int) -> int:
        """Position in ``indices`` of the example that sample ``sample`` shows."""
        epoch, position = divmod(sample, self.examples_per_epoch)
        return int(epoch_order(self.config.random_seed, epoch, self.examples_per_epoch)[position])

    def example(self, position: int) -> tuple[np.ndarray, np.ndarray]:
        """Prompt and response tokens of the example at ``position`` of ``indices``."""
        first = self.first_sequence[position]
        return self.dataset.get(first), self.dataset.get(first + 1)

    def sample_of(self, prompt: np.ndarray, response: np.ndarray) -> dict[str, torch.Tensor]:
        """The padded sample of one example (module docstring)."""
        length = self.config.sequence_length
        tokens = np.full(length + 1, self.eod, dtype=np.int64)
        used = 1 + len(prompt) + len(response)
        tokens[1:used] = np.concatenate([prompt, response])
        loss_mask = np.zeros(length, dtype=np.float32)
        loss_mask[len(prompt) : used - 1] = 1.0  # labels[i] = tokens[i + 1]: the response's tokens
        return {
            "tokens": torch.from_numpy(tokens[:-1].copy()),
            "labels": torch.from_numpy(tokens[1:].copy()),
            "loss_mask": torch.from_numpy(loss_mask),
            "position_ids": torch.arange(length),
        }

    @staticmethod
    def _first_sequences(dataset: IndexedDataset, path: str | None, indices: np.ndarray) -> np.ndarray:
        """Index of each example's prompt sequence; an error unless every document of the split
        has exactly a prompt and a response."""
        bounds = dataset.document_indices
        counts = bounds[indices + 1] - bounds[indices]
        wrong = np.flatnonzero(counts != SEQUENCES_PER_EXAMPLE)
        if len(wrong):
            raise SFTDataError(
                f"{path}: document {int(indices[wrong[0]])} has {int(counts[wrong[0]])} sequences, "
                f"not a prompt and a response ({len(wrong)} such documents): write SFT data with "
                "tools/preprocess_data.py --prompt-key KEY --json-keys RESPONSE_KEY"
            )
        return bounds[indices].astype(np.int64)

    def _check_lengths(self, dataset: IndexedDataset, path: str | None, seq_length: int) -> None:
        """Every example, with its leading end-of-document token, fits ``seq_length + 1`` tokens."""
        lengths = dataset.sequence_lengths
        sizes = 1 + lengths[self.first_sequence] + lengths[self.first_sequence + 1]
        longest = int(np.argmax(sizes))
        if sizes[longest] > seq_length + 1:
            raise SFTDataError(
                f"{path}: example {int(self.indices[longest])} has {int(sizes[longest]) - 1} tokens, "
                f"more than --seq-length {seq_length} allows with its leading end-of-document token "
                f"({int(np.sum(sizes > seq_length + 1))} examples do not fit): raise --seq-length "
                "or leave the long examples out"
            )
