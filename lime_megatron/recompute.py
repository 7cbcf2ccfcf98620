"""Saved-tensor recompute: drop chosen tensors from autograd's saved tensors and rebuild them
when backward first needs them.

LIMe's attention saves its (routed, rotated) keys and values for backward; with
``recompute_in_backward`` those are matched by storage and replaced by a recipe that rebuilds
them from the layer-integrated memory (``lime_megatron.attention``).  Every other saved tensor
passes to the saved-tensor hooks active around the block (offloading, memory accounting).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

import torch


class Rebuilt:
    """A tensor dropped from autograd's saved tensors, rebuilt once when backward first needs it."""

    def __init__(self, build: Callable[[], torch.Tensor]):
        self._build = build
        self._value: torch.Tensor | None = None

    def value(self) -> torch.Tensor:
        """The rebuilt tensor (built on the first call, without autograd)."""
        if self._value is None:
            with torch.no_grad():
                self._value = self._build()
        return self._value


class _SavedView:
    """What autograd keeps instead of a view of a rebuilt tensor: how to take the view again."""

    def __init__(self, source: Rebuilt, tensor: torch.Tensor):
        self.source = source
        self.geometry = (tensor.size(), tensor.stride(), tensor.storage_offset())

    def unpack(self) -> torch.Tensor:
        return self.source.value().as_strided(*self.geometry)


def _outer_saved_tensor_hooks():
    """The saved-tensor hooks active around ours (e.g. activation offloading or memory
    accounting), so that tensors we do not rebuild still go through them."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False)


@contextmanager
def recompute_in_backward(rebuilds: dict[torch.Tensor, Rebuilt]) -> Iterator[None]:
    """Within the block, tensors saved for backward that are views of a key of ``rebuilds`` are
    not kept: backward rebuilds them through the paired ``Rebuilt`` instead.

    Each rebuild must produce a tensor with the same layout as its key.  All other saved tensors
    pass to the enclosing saved-tensor hooks, if any.
    """
    by_storage = {tensor.untyped_storage().data_ptr(): rebuilt for tensor, rebuilt in rebuilds.items()}
    outer = _outer_saved_tensor_hooks()

    def pack(tensor: torch.Tensor):
        source = by_storage.get(tensor.untyped_storage().data_ptr())
        if source is not None:
            return _SavedView(source, tensor)
        return outer[0](tensor) if outer else tensor

    def unpack(packed):
        if isinstance(packed, _SavedView):
            return packed.unpack()
        return outer[1](packed) if outer else packed

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield
