"""The key/value buffer B of one forward pass of a model chunk and its layout (paper §4, Eq. 1).

Layout.  One preallocated tensor ``buffer`` of shape ``[len(layers) * kv_heads, 2 * s * b * d]``
holds the raw keys and values of the chunk's layers: row ``(l - layers.start) * kv_heads + h`` is
head h of layer l, its columns are ``(k|v, s, b, d)``.  Layer l writes its own rows once (Eq. 1,
``store``), and the routing products read contiguous row ranges of it (``rows``), so nothing is
re-concatenated per layer (the official code's per-layer ``torch.cat`` costs O(L^2) time and
saved memory).

External rows.  Under pipeline parallelism the rows of earlier chunks' layers that this chunk's
layers read are *external* blocks ``(layers, rows [len(layers) * kv_heads, 2 * s * b * d])``:
received from other ranks or kept from this rank's earlier chunks (``receive``, called by
``lime_megatron.parallel.pipeline``).  They are never written here.  ``rows`` serves a range of
layers from one block (own or external); ``row_blocks`` cuts a range where the blocks meet.

Decoding.  With a KV cache (``lime_megatron.inference.decoding``) each forward pass is one decoding
step over the step's new tokens only: the buffer holds their raw keys/values of all layers
(``[num_layers * kv_heads, 2 * s_new * b * d]``, one token per sequence after the prompt) and is
freed with the step.
"""

from __future__ import annotations

import torch

from lime_megatron.kernels.operands import Halves


class KeyValueRows:
    """The raw keys/values of one pass: the chunk's own rows and the external blocks it reads.

    ``layers``: the chunk's own layers (global 0-based indices); ``triton``: the routing products
    over these rows run as Triton kernels (``lime_megatron.kernels``), else as torch operators;
    ``deterministic``: the kernels' router-weight gradients sum in a fixed order (megatron's
    ``deterministic_mode``), else by atomic adds (one launch, no sum after).  The own rows are allocated by the
    first ``store`` (its keys fix shape, dtype and device) as ``[len(layers) * kv_heads,
    2 * s * b * d]``; ``kv_shape`` ``(s, b, kv_heads, d)`` is the shape of one layer's keys.
    Writes go through ``writer``, an alias of ``buffer`` with its own version counter: each row
    block is written once before it is read, so views of it saved for backward stay valid (the
    backward reuses the dead rows through it for gradients, ``row_gradients.KeptGradients``).
    """

    def __init__(self, layers: range, triton: bool = False, deterministic: bool = True):
        self.layers, self.triton, self.deterministic = layers, triton, deterministic
        self.buffer: torch.Tensor | None = None
        self.writer: torch.Tensor | None = None
        self.kv_shape: tuple[int, int, int, int] | None = None
        self.external: list[tuple[range, torch.Tensor]] = []
        self.cuts: tuple[int, ...] = (layers.start,)  # where own rows and external blocks begin and end, ascending
        self._row_blocks: dict[tuple[int, int], tuple[tuple[int, int], ...]] = {}  # row_blocks, while the cuts hold

    def allocate(self, key: torch.Tensor) -> None:
        """Allocate the own rows for keys shaped like ``key`` ``[s, b, kv_heads, d]``, once per pass."""
        if self.buffer is not None:
            if tuple(key.shape) != self.kv_shape:
                raise RuntimeError(f"keys {tuple(key.shape)} do not match the memory's {self.kv_shape}")
            return
        s, b, h, d = key.shape
        if self.kv_shape not in (None, (s, b, h, d)):
            raise RuntimeError(f"keys {(s, b, h, d)} do not match the received ones {self.kv_shape}")
        self.kv_shape = (s, b, h, d)
        self.buffer = torch.empty(len(self.layers) * h, 2 * s * b * d, dtype=key.dtype, device=key.device)
        self.writer = torch.empty(0, dtype=key.dtype, device=key.device).set_(
            self.buffer.untyped_storage(), 0, self.buffer.shape, self.buffer.stride()
        )

    @property
    def kv_heads(self) -> int:
        """Key/value heads per layer held here."""
        return self.kv_shape[2]

    def rows(self, start: int, stop: int) -> torch.Tensor:
        """Rows of layers ``start..stop-1``, all in one external block or all own:
        ``[(stop - start) * kv_heads, 2 * s * b * d]``."""
        h, first = self.kv_heads, self.layers.start
        if start >= first:
            return self.buffer[(start - first) * h : (stop - first) * h]
        for layers, rows in self.external:
            if layers.start <= start and stop <= layers.stop:
                return rows[(start - layers.start) * h : (stop - layers.start) * h]
        raise IndexError(
            f"rows of layers {start}..{stop - 1} are not held by the chunk of layers "
            f"{self.layers.start}..{self.layers.stop - 1} (external: "
            f"{[layers for layers, _ in self.external]})"
        )

    def halves(self, start: int, stop: int) -> Halves:
        """``rows(start, stop)`` as the kernels address it (``kernels.operands.Halves``): no view."""
        h, first, width = self.kv_heads, self.layers.start, self.kv_shape[3]
        if start >= first:
            return Halves.of_rows(self.buffer, (start - first) * h, (stop - start) * h, width)
        for layers, rows in self.external:
            if layers.start <= start and stop <= layers.stop:
                return Halves.of_rows(rows, (start - layers.start) * h, (stop - start) * h, width)
        raise IndexError(f"rows of layers {start}..{stop - 1} are not held by the chunk of layers {self.layers}")

    def row_blocks(self, start: int, stop: int) -> tuple[tuple[int, int], ...]:
        """``(start, stop)`` split where external blocks and the own rows begin and end (asked for
        every product: kept per span until the blocks change)."""
        blocks = self._row_blocks.get((start, stop))
        if blocks is None:
            edges = [start, *(cut for cut in self.cuts if start < cut < stop), stop]
            blocks = self._row_blocks[start, stop] = tuple(zip(edges[:-1], edges[1:]))
        return blocks

    def tensors(self) -> tuple[torch.Tensor | None, ...]:
        """The tensors rows are read from and written through: ``buffer``, ``writer`` and each
        external block's rows (a launch plan's, ``kernels.launch_plans``)."""
        if not self.external:
            return self.buffer, self.writer
        return self.buffer, self.writer, *[rows for _, rows in self.external]

    def new_zero_rows(self, count: int) -> torch.Tensor:
        """``[count, 2 * s * b * d]`` zeros in the dtype and on the device of the rows held."""
        some_rows = self.buffer if self.buffer is not None else self.external[0][1]
        return some_rows.new_zeros(count, some_rows.shape[1])

    @staticmethod
    def to_rows(keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Keys and values ``[s, b, h, d]`` -> rows ``[h, 2 * s * b * d]`` (one copy)."""
        return torch.stack((keys.permute(2, 0, 1, 3), values.permute(2, 0, 1, 3)), dim=1).view(keys.shape[2], -1)

    def heads_first(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows of one layer ``[kv_heads, 2*s*b*d]`` viewed as ``[kv_heads, 2, s, b, d]``."""
        s, b, h, d = self.kv_shape
        return rows.view(h, 2, s, b, d)

    def from_rows(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[h, 2 * s * b * d]`` -> keys and values, each a contiguous ``[s, b, h, d]`` of its own."""
        heads_first = self.heads_first(rows)
        return tuple(heads_first[:, half].permute(1, 2, 0, 3).contiguous() for half in (0, 1))

    def store(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """Eq. 1: write layer ``layer``'s keys/values ``[s, b, h, d]`` into its rows; returns them."""
        self.allocate(key)
        s, b, h, d = self.kv_shape
        local = layer - self.layers.start
        slot = self.writer[local * h : (local + 1) * h].view(h, 2, s, b, d)
        torch.stack((key.permute(2, 0, 1, 3), value.permute(2, 0, 1, 3)), dim=1, out=slot)
        return self.rows(layer, layer + 1)

    def receive(self, blocks: list[tuple[range, torch.Tensor]], kv_shape: tuple[int, int, int, int]) -> None:
        """External row blocks ``(layers, rows [len(layers) * kv_heads, 2 * s * b * d])`` of
        earlier chunks' layers that this chunk's layers read, keys shaped ``kv_shape``."""
        for layers, _ in blocks:
            if layers.stop > self.layers.start:
                raise ValueError(f"external layers {layers} must come before this chunk's {self.layers}")
        self.external, self.kv_shape = blocks, kv_shape
        edges = {edge for layers, _ in blocks for edge in (layers.start, layers.stop)}
        self.cuts, self._row_blocks = tuple(sorted(edges | {self.layers.start})), {}

    def forget_external(self) -> None:
        """Drop the external blocks (their gradient was handed back: ``ConsumerGradients.external_shares``)."""
        self.external, self.cuts, self._row_blocks = [], (self.layers.start,), {}
