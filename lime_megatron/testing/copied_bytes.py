"""Measuring the copies a step makes: the bytes copy operators write, by output shape
(``bench/bench_lime_overhead.py`` reports them; tests check which rearrangements LIMe's routing
still copies, docs/routing.md)."""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

COPY_OPERATORS = (torch.ops.aten.copy_, torch.ops.aten.clone, torch.ops.aten._to_copy, torch.ops.aten.stack)
"""What counts as a copy, in every overload: ``copy_`` (also into views), ``clone`` (``contiguous``,
copying ``reshape``), ``_to_copy`` (dtype and device changes) and ``stack`` (tensors copied side
by side, also into ``out``: the memory's keys/values to rows).  Not ``cat``, with which megatron's
RoPE assembles its arithmetic's output."""


class CopiedBytes(TorchDispatchMode):
    """Bytes written by copy operators while active, in forward and in autograd's backward.

    Use ``with CopiedBytes() as copies: ...``; read ``copies.bytes`` or ``copies.by_shape``
    (output shape -> bytes).
    """

    def __init__(self):
        super().__init__()
        self.by_shape: Counter[tuple[int, ...]] = Counter()

    @property
    def bytes(self) -> int:
        """Total bytes written by the copies seen."""
        return sum(self.by_shape.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in COPY_OPERATORS:
            self.by_shape[tuple(out.shape)] += out.numel() * out.element_size()
        return out
