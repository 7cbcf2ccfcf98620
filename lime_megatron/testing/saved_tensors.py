"""Measuring what autograd saves for backward: the bytes the activation formulas
(``activations``) are checked against in tests and ``bench/bench_lime_overhead.py``."""

from __future__ import annotations

import torch


class SavedTensorBytes:
    """Bytes autograd saves for backward: unique storages, parameters excluded.

    Use ``with SavedTensorBytes(model) as saved: loss = model(...)``; read ``saved.bytes``.
    """

    def __init__(self, model: torch.nn.Module):
        self._parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self._storages: dict[int, int] = {}

    @property
    def bytes(self) -> int:
        """Total bytes of the distinct storages seen."""
        return sum(self._storages.values())

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self._parameters:
            self._storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    def __enter__(self) -> SavedTensorBytes:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
