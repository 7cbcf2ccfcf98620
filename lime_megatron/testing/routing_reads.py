"""What LIMe's routing products do, measured through the library's product observer.

``routing_reads()`` installs an observer (``models.lime.routing_products.set_product_observer``)
for the duration of a ``with`` block and counts, by product kind, the bytes of the N-wide
operands the products read (buffer rows, gradient rows, partial sums; the dynamic router's
per-token reads included), the matrix products' FLOPs and their wall seconds.  Tests check the
bytes against ``planning.routing_bytes.routing_bytes_per_step``; ``bench/bench_lime_overhead.py``
reports the rate the products run at.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import torch

from lime_megatron.kernels.operands import Halves
from lime_megatron.models.lime.routing_products import set_product_observer

Result = TypeVar("Result")


class RoutingReads:
    """What the routing products did while counting was on: bytes of the N-wide operands they read
    by product kind (``by_kind``), and for the matrix products their FLOPs (``flops_by_kind``) and
    wall seconds (``seconds_by_kind``; on a GPU the device is synchronised around each product
    while counting, so these are its kernel times plus one launch)."""

    def __init__(self):
        self.by_kind: dict[str, int] = {}
        self.flops_by_kind: dict[str, int] = {}
        self.seconds_by_kind: dict[str, float] = {}

    @property
    def total(self) -> int:
        return sum(self.by_kind.values())

    def add(self, kind: str, wide: torch.Tensor | Halves) -> None:
        read = wide.bytes if isinstance(wide, Halves) else wide.numel() * wide.element_size()
        self.by_kind[kind] = self.by_kind.get(kind, 0) + read

    def add_product(self, kind: str, flops: int, seconds: float) -> None:
        self.flops_by_kind[kind] = self.flops_by_kind.get(kind, 0) + flops
        self.seconds_by_kind[kind] = self.seconds_by_kind.get(kind, 0.0) + seconds


_OPEN: list[RoutingReads] = []
"""The counters of the ``routing_reads`` blocks open now (nested blocks all count)."""


def synchronize_device_of(tensor: torch.Tensor | Halves) -> None:
    """Wait for the kernels queued on ``tensor``'s GPU (nothing on CPU), so wall time covers them."""
    tensor = tensor.keys if isinstance(tensor, Halves) else tensor
    if tensor.is_cuda:
        torch.cuda.synchronize(tensor.device)


def _count(kind: str, wide: torch.Tensor | Halves, flops: int | None, run: Callable[[], Result]) -> Result:
    """The product observer: ``wide``'s read counted as ``kind``; for a matrix product (``flops``
    given) its FLOPs and its wall time too."""
    for counter in _OPEN:
        counter.add(kind, wide)
    if flops is None:
        return run()
    synchronize_device_of(wide)
    start = time.perf_counter()
    result = run()
    synchronize_device_of(wide)
    for counter in _OPEN:
        counter.add_product(kind, flops, time.perf_counter() - start)
    return result


@contextmanager
def routing_reads() -> Iterator[RoutingReads]:
    """Count the bytes, FLOPs and seconds of the routing products inside the ``with`` block."""
    counter = RoutingReads()
    if not _OPEN:
        set_product_observer(_count)
    _OPEN.append(counter)
    try:
        yield counter
    finally:
        _OPEN.remove(counter)
        if not _OPEN:
            set_product_observer(None)
