"""Saved-tensor recompute: drop chosen tensors from autograd's saved tensors and rebuild them
when backward first needs them.

LIMe's attention saves its rotated keys and its routed values for backward; with
``lime_recompute_routed_kv`` and ``recompute_in_backward`` those are matched by storage and
replaced by a recipe that rebuilds them from the layer-integrated memory (one router product;
``lime_megatron.models.lime.attention``).  Every other saved tensor passes to the saved-tensor
hooks active around the block (offloading, memory accounting).

The drop only works when the core attention saves the tensors it was given (or views of them):
megatron's ``DotProductAttention``, TransformerEngine's cuDNN ``FusedAttention`` in bf16/fp16.
TransformerEngine's FP8 attention saves FP8 copies and its flash-attn backend saves contiguous
``bshd`` copies; then nothing is dropped and ``routed_kv_log`` warns once, naming the attention
and the bytes that stay.  ``routed_kv_log`` also counts, per layer, which routed tensors were
dropped and rebuilt (``take`` returns and resets the counts: once per step).
``drops_routed_kv`` is the same decision made ahead of a run, for the memory estimate.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

logger = logging.getLogger(__name__)


class Rebuilt:
    """A tensor dropped from autograd's saved tensors (or what several are rebuilt from), rebuilt
    once when backward first needs it."""

    def __init__(self, build: Callable[[], torch.Tensor], on_build: Callable[[], None] | None = None):
        self._build, self._on_build = build, on_build
        self._value: torch.Tensor | None = None

    def value(self) -> torch.Tensor:
        """The rebuilt tensor (built on the first call, without autograd; ``on_build`` is told)."""
        if self._value is None:
            with torch.no_grad():
                self._value = self._build()
            if self._on_build is not None:
                self._on_build()
        return self._value


class _SavedView:
    """What autograd keeps instead of a view of a rebuilt tensor: how to take the view again,
    its place counted from the first element of the tensor it is a view of, ``of`` (which may
    itself lie inside a larger storage: a fused routing block's, ``fused_blocks``)."""

    def __init__(self, source: Rebuilt, tensor: torch.Tensor, of: torch.Tensor):
        self.source = source
        self.geometry = (tensor.size(), tensor.stride(), tensor.storage_offset() - of.storage_offset())

    def unpack(self) -> torch.Tensor:
        value = self.source.value()
        size, stride, offset = self.geometry
        return value.as_strided(size, stride, value.storage_offset() + offset)


def _outer_saved_tensor_hooks():
    """The saved-tensor hooks active around ours (e.g. activation offloading or memory
    accounting), so that tensors we do not rebuild still go through them."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False)


@dataclass
class Drops:
    """What one ``recompute_in_backward`` block dropped: the names of the ``watched`` tensors
    whose saved views were dropped, and of those saved in no dropped view (a copy was kept).
    When one was kept, ``explanation`` says why as far as the block can see: the layouts the
    watched tensors had (``Layout``) and those of the tensors saved instead (at least as large
    as the smallest watched one, at most ``SAVED_LAYOUTS_SHOWN``)."""

    dropped: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    kept_bytes: int = 0
    explanation: str = ""


SAVED_LAYOUTS_SHOWN = 6
"""How many distinct layouts of the tensors saved instead a ``Drops.explanation`` names."""


@dataclass(frozen=True)
class Layout:
    """A tensor's shape, dtype, strides and storage offset: what decides whether an attention
    takes it as it is or copies it; kept instead of the tensor (which it does not hold alive)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    stride: tuple[int, ...]
    offset: int

    @classmethod
    def of(cls, tensor: torch.Tensor) -> Layout:
        return cls(tuple(tensor.shape), tensor.dtype, tensor.stride(), tensor.storage_offset())

    def __str__(self) -> str:
        """``[8, 2, 4, 16] bfloat16 stride (128, 64, 16, 1) +0``."""
        return f"{list(self.shape)} {str(self.dtype).removeprefix('torch.')} stride {self.stride} +{self.offset}"


def _explain_kept(watched: dict[str, torch.Tensor], saved_instead: list[Layout]) -> str:
    """The layouts the ``watched`` tensors were given in, and the distinct ones of the tensors
    saved instead (those at least as large as the smallest watched one: candidates for the copies)."""
    candidates = list(dict.fromkeys(str(saved) for saved in saved_instead))
    given = "; ".join(f"{name} {Layout.of(tensor)}" for name, tensor in watched.items())
    shown = "; ".join(candidates[:SAVED_LAYOUTS_SHOWN]) or "none that large"
    more = f" (+{len(candidates) - SAVED_LAYOUTS_SHOWN} more)" if len(candidates) > SAVED_LAYOUTS_SHOWN else ""
    return f"given {given}; saved instead {shown}{more}"


def _address(tensor: torch.Tensor) -> tuple[int, int]:
    """(storage address, first element's address) of ``tensor``."""
    return tensor.untyped_storage().data_ptr(), tensor.data_ptr()


def _overlaps(saved: tuple[int, int], tensor: torch.Tensor) -> bool:
    """True when a saved view at address ``saved`` starts inside ``tensor``'s bytes."""
    storage, start = _address(tensor)
    return saved[0] == storage and start <= saved[1] < start + max(tensor.nbytes, 1)


@contextmanager
def recompute_in_backward(
    rebuilds: dict[torch.Tensor, Rebuilt], watched: dict[str, torch.Tensor] | None = None
) -> Iterator[Drops]:
    """Within the block, tensors saved for backward that are views of a key of ``rebuilds`` (that
    start inside its bytes) are not kept: backward rebuilds them through the paired ``Rebuilt``
    instead.

    Each rebuild must produce a tensor with the same layout as its key.  All other saved tensors
    pass to the enclosing saved-tensor hooks, if any.  Yields a ``Drops`` filled in at the end
    of the block: which of the ``watched`` tensors (name -> tensor within a rebuilt storage)
    were dropped, and which were saved only as copies.
    """
    outer = _outer_saved_tensor_hooks()
    dropped_views: list[tuple[int, int]] = []
    watched = watched or {}
    smallest = min((tensor.numel() for tensor in watched.values()), default=math.inf)
    passed_on: list[Layout] = []  # of the tensors saved as they are, those at least ``smallest``

    def pack(tensor: torch.Tensor):
        address = _address(tensor)
        for rebuilt_tensor, source in rebuilds.items():
            if _overlaps(address, rebuilt_tensor):
                dropped_views.append(address)
                return _SavedView(source, tensor, rebuilt_tensor)
        if tensor.numel() >= smallest:
            passed_on.append(Layout.of(tensor))
        return outer[0](tensor) if outer else tensor

    def unpack(packed):
        if isinstance(packed, _SavedView):
            return packed.unpack()
        return outer[1](packed) if outer else packed

    drops = Drops()
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield drops
    for name, tensor in watched.items():
        if any(_overlaps(view, tensor) for view in dropped_views):
            drops.dropped.append(name)
        else:
            drops.kept.append(name)
            drops.kept_bytes += tensor.nbytes
    if drops.kept:
        drops.explanation = _explain_kept(watched, passed_on)


@dataclass
class LayerDrops:
    """One layer's counts since the last ``RoutedKVLog.take``: routed tensors dropped from
    attention's saved tensors, kept as copies, and rebuilt in backward (by name); the first
    ``Drops.explanation`` of a forward that kept copies."""

    dropped: Counter = field(default_factory=Counter)
    kept: Counter = field(default_factory=Counter)
    rebuilt: Counter = field(default_factory=Counter)
    explanation: str = ""


class RoutedKVLog:
    """Per layer: which routed keys/values LIMe's attention dropped and rebuilt.

    The first time a core attention keeps copies instead (nothing dropped), one warning names
    the attention implementation and the bytes that stay per layer and microbatch.
    """

    def __init__(self):
        self._layers: dict[int, LayerDrops] = {}
        self.warned = False

    def _layer(self, layer: int) -> LayerDrops:
        return self._layers.setdefault(layer, LayerDrops())

    def record(self, layer: int, drops: Drops, attention: str) -> None:
        """Count one forward of ``layer`` whose core attention is ``attention`` (its name)."""
        counts = self._layer(layer)
        counts.dropped.update(drops.dropped)
        counts.kept.update(drops.kept)
        counts.explanation = counts.explanation or drops.explanation
        if drops.kept and not self.warned:
            self.warned = True
            logger.warning(
                "LIMe: the core attention %s saved its own copies of the routed %s instead of the "
                "routed tensors, so they are not dropped from autograd's saved tensors: %s bytes per "
                "layer and microbatch stay saved beside the layer-integrated memory (layer %d: %s). "
                "TransformerEngine: use the cuDNN fused attention (NVTE_FLASH_ATTN=0) without FP8 "
                "dot-product attention, or turn lime_recompute_routed_kv off (it saves nothing here).",
                attention,
                " and ".join(drops.kept),
                f"{drops.kept_bytes:,}",
                layer,
                drops.explanation,
            )

    @contextmanager
    def recording(self, layer: int, attention: str, block) -> Iterator[None]:
        """Run the ``recompute_in_backward`` context ``block`` and ``record`` its drops."""
        with block as drops:
            yield
        self.record(layer, drops, attention)

    def rebuilt(self, layer: int, name: str) -> Callable[[], None]:
        """A callback counting one rebuild of ``name`` in ``layer`` (for ``Rebuilt.on_build``)."""
        return lambda: self._layer(layer).rebuilt.update([name])

    def take(self) -> dict[int, LayerDrops]:
        """The counts per layer since the last call (one training step), then reset."""
        layers, self._layers = self._layers, {}
        return dict(sorted(layers.items()))


def describe(counts: dict[int, LayerDrops]) -> str:
    """One line of ``RoutedKVLog.take``'s counts: layers that dropped/kept, rebuilds by name."""
    dropped = sum(1 for drops in counts.values() if drops.dropped and not drops.kept)
    kept = sorted(layer for layer, drops in counts.items() if drops.kept)
    rebuilt = sum((drops.rebuilt for drops in counts.values()), Counter())
    line = (
        f"LIMe routed K/V: dropped from the saved tensors in {dropped}/{len(counts)} layers, rebuilt in backward: "
        + (", ".join(f"{count} {name}" for name, count in sorted(rebuilt.items())) or "none")
    )
    return line + (f"; copies kept in layers {kept}" if kept else "")


routed_kv_log = RoutedKVLog()
"""The process's log of LIMe's routed-K/V drops (every ``LimeSelfAttention`` records here)."""


def te_flash_attention(config) -> bool:
    """Whether ``config`` asks TransformerEngine for its flash-attn backend, which saves
    contiguous ``bshd`` copies of q, k, v and of its output instead of the tensors given."""
    return getattr(config.attention_backend, "name", config.attention_backend) == "flash"


def attention_saves_given_kv(config, transformer_impl: str) -> bool:
    """Whether the core attention under ``config`` saves the keys/values it is given (or views of
    them), so that LIMe can drop them from its saved tensors: megatron's local attention only
    without GQA (it repeats keys/values to the query heads and saves those copies);
    TransformerEngine's cuDNN fused attention in bf16/fp16 (``auto`` is taken as fused,
    TransformerEngine's choice on Hopper), not its FP8 dot-product attention (FP8 copies) nor its
    flash backend (``bshd`` copies).  A selectively recomputed (checkpointed) core attention saves
    the tensors given, whatever the attention."""
    if config.recompute_granularity == "selective" and "core_attn" in (config.recompute_modules or ["core_attn"]):
        return True
    if transformer_impl == "local":
        return config.num_attention_heads == config.kv_heads
    return not (config.fp8 and config.fp8_dot_product_attention) and not te_flash_attention(config)


def drops_routed_kv(config, transformer_impl: str) -> bool:
    """Whether LIMe's attention drops the routed keys/values and the rotated keys from its saved
    tensors (and rebuilds them by a router product) under ``config``: ``lime_recompute_routed_kv``
    and ``attention_saves_given_kv``.  The decision the memory estimate and the routing-bytes plan
    use."""
    return config.lime and config.lime_recompute_routed_kv and attention_saves_given_kv(config, transformer_impl)
