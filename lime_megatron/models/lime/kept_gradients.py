"""The row gradients a chunk's backward keeps until every reader of them has run.

g_m.  Layer m's backward turns the gradient of its routed keys/values into rows g_m
``[kv_heads, 2 * s * b * d]`` (all kv heads: under tensor parallelism gathered from every rank).
Each source l of layer m takes its share W_m[:, block l]^T g_m later, when autograd reaches l's
backward (``consumer_gradients``), and a block's earlier-source weight gradient reads g_m too
(``routing_blocks.MixEarlierSources``).  Autograd runs layer l's backward only after every later
layer's (later layers depend on layer l through the residual stream), so when layer m's
backward finishes its raw rows are dead: without tensor parallelism g_m overwrites them
(``KeyValueRows.writer``) and no second buffer is allocated; under tensor parallelism, where
g_m has more rows than the rank's raw rows, it goes to a buffer of its own: as rows, or, on the
Triton path's own layout (``gather``, ``fused_routing``), as the all-gather leaves it, one chunk
``[2, s, b, local heads, d]`` per rank and layer (``kernels.operands.Halves.of_rank_chunks``).  A
layer with the identity routing (layer 0) keeps nothing: no other layer reads its g.

Also kept here until their reader runs: a blocked router's in-block weight-gradient pieces
(``memory.RouteKeysValues`` leaves them for ``MixEarlierSources``, which places them beside the
earlier columns'), and under pipeline parallelism the gradient of the own rows read by later
chunks, handed over before this chunk's layers run backward (``lime_megatron.parallel.pipeline``).
"""

from __future__ import annotations

from typing import Any

import torch

from lime_megatron.kernels.operands import Halves
from lime_megatron.models.lime.key_value_rows import KeyValueRows
from lime_megatron.models.lime.router import LimeRouter


class KeptGradients:
    """g_m of the own layers, in-block weight-gradient pieces and the downstream gradient.

    ``read_later``: the own layers that later pipeline chunks read (set by the pipeline), the
    order of the rows of ``receive_downstream``'s gradient.  ``gathered``: the tensor-parallel
    process group whose ranks' heads ``gather`` collects, g_m then kept in rank chunks (None:
    as rows).
    """

    def __init__(self, key_values: KeyValueRows, gathered: Any = None):
        self.key_values, self.gathered = key_values, gathered
        self._separate: torch.Tensor | None = None  # g_m under tensor parallelism
        self._chunks: torch.Tensor | None = None  # ``gather``'s rank chunks, and each layer's:
        self._slots: tuple[torch.Tensor, ...] = ()
        self._kept = [False] * len(key_values.layers)
        self._in_block: dict[int, list[tuple[slice, torch.Tensor]]] = {}
        self.read_later: tuple[int, ...] = ()
        self._downstream: torch.Tensor | None = None

    def tensors(self) -> tuple[torch.Tensor | None, ...]:
        """Every tensor a backward launch reads rows from or keeps g_m in (a launch plan's,
        ``kernels.launch_plans``): the rows' (``key_values.tensors()``, whose dead own rows g_m
        overwrites), g_m's own buffers and the downstream gradient's."""
        return *self.key_values.tensors(), self._separate, self._chunks, self._downstream

    def buffer(self, kv_heads: int) -> torch.Tensor:
        """Where g_l (``kv_heads`` rows) of every own layer l is kept, ``[len(layers) * kv_heads,
        2*s*b*d]``: the dead own raw rows when g_l has as many rows as they do, else a buffer."""
        rows = self.key_values
        if kv_heads == rows.kv_heads:
            return rows.writer
        if self._separate is None:
            self._separate = rows.buffer.new_empty(len(rows.layers) * kv_heads, rows.buffer.shape[1])
        return self._separate

    def gather(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> Halves:
        """g_l of own layer ``layer`` from this rank's keys' and values' gradients ``[s, b, local
        heads, d]``: one all-gather over ``gathered`` into the layer's rank chunks, kept there and
        returned as the kernels address them (all kv heads); the layer's backward marks it kept
        (``mark_kept``) once its launch has run."""
        slot = self._rank_chunks()[1][layer - self.key_values.layers.start]
        torch.distributed.all_gather_into_tensor(slot, torch.stack((keys, values)), group=self.gathered)
        return Halves.of_rank_chunks(slot, 0, self.gathered.size() * self.key_values.kv_heads)

    def _rank_chunks(self) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """``gather``'s buffer as rank chunks ``[len(layers) * ranks * 2, s, b, local heads, d]``
        and each own layer's ``[ranks * 2, s, b, local heads, d]``: views made once per pass."""
        if self._chunks is None:
            s, b, heads, d = self.key_values.kv_shape
            self._chunks = self.buffer(self.gathered.size() * heads).view(-1, s, b, heads, d)
            self._slots = self._chunks.unflatten(0, (len(self.key_values.layers), -1)).unbind(0)
        return self._chunks, self._slots

    def keep(self, router: LimeRouter, grad_rows: torch.Tensor) -> None:
        """Keep g_l ``grad_rows`` ``[kv_heads, 2*s*b*d]`` of ``router``'s layer l (nothing for the
        identity routing) and mark l's backward as run."""
        local = router.layer - self.key_values.layers.start
        if not router.identity:
            if self.gathered is not None:
                raise RuntimeError(f"layer {router.layer}'s g is kept by gather() on this memory, not as rows")
            kv_heads = grad_rows.shape[0]
            self.buffer(kv_heads)[local * kv_heads : (local + 1) * kv_heads].copy_(grad_rows)
        self.mark_kept(router.layer)

    def mark_kept(self, layer: int) -> None:
        """Mark own layer ``layer``'s g as kept (its backward ran; a kernel wrote its rows)."""
        self._kept[layer - self.key_values.layers.start] = True

    def grad_rows(self, layers: range, kv_heads: int) -> torch.Tensor:
        """The kept g_m of own layers ``layers``, stacked as rows: a view
        ``[len(layers) * kv_heads, 2*s*b*d]`` (not where ``gather`` keeps them)."""
        if self.gathered is not None:
            raise RuntimeError("the g_m kept in rank chunks are read as kernel operands (grad_halves), not as rows")
        first = self.key_values.layers.start
        return self.buffer(kv_heads)[(layers.start - first) * kv_heads : (layers.stop - first) * kv_heads]

    def grad_halves(self, layers: range, kv_heads: int) -> Halves:
        """``grad_rows(layers, kv_heads)`` (or where g of ``layers`` goes) as the kernels address it:
        no view."""
        first, width = self.key_values.layers.start, self.key_values.kv_shape[3]
        rows = (layers.start - first) * kv_heads
        if self.gathered is not None:
            return Halves.of_rank_chunks(self._rank_chunks()[0], rows, len(layers) * kv_heads)
        return Halves.of_rows(self.buffer(kv_heads), rows, len(layers) * kv_heads, width)

    def require(self, layer: int, consumers: range) -> None:
        """Fail unless every own layer of ``consumers`` kept its g_m before ``layer``'s backward."""
        first = self.key_values.layers.start
        if not all(self._kept[consumers.start - first : consumers.stop - first]):
            missing = [m for m in consumers if not self._kept[m - first]]
            raise RuntimeError(f"LIMe backward reached layer {layer} before that of its consumer layers {missing}")

    def leave_in_block(self, layer: int, pieces: list[tuple[slice, torch.Tensor]]) -> None:
        """Keep a blocked router's in-block weight-gradient pieces ``(columns, [kv_heads,
        len(columns)])`` until its block's ``MixEarlierSources`` places them."""
        self._in_block[layer] = pieces

    def take_in_block(self, layer: int) -> list[tuple[slice, torch.Tensor]]:
        """The in-block pieces of ``layer``'s router (none when its output fed no loss)."""
        return self._in_block.pop(layer, [])

    def receive_downstream(self, grad_rows: torch.Tensor) -> None:
        """Gradient of the own rows of ``read_later`` from later chunks, stacked in that order:
        the share sum_{m later} W_m[:, block l]^T g_m of each own layer l read after this chunk."""
        self._downstream = grad_rows

    def downstream_halves(self, layer: int) -> Halves | None:
        """``downstream_rows(layer)`` as the kernels address it (no view); None where no later
        chunk reads the layer."""
        if layer not in self.read_later:
            return None
        if self._downstream is None:
            raise RuntimeError(f"the gradient of layer {layer}'s keys/values from later pipeline stages is missing")
        kv_heads, width = self.key_values.kv_heads, self.key_values.kv_shape[3]
        return Halves.of_rows(self._downstream, self.read_later.index(layer) * kv_heads, kv_heads, width)

    def downstream_rows(self, layer: int) -> torch.Tensor | None:
        """The downstream gradient's rows ``[kv_heads, 2*s*b*d]`` of own layer ``layer``; None when
        no later chunk reads it."""
        if layer not in self.read_later:
            return None
        if self._downstream is None:
            raise RuntimeError(f"the gradient of layer {layer}'s keys/values from later pipeline stages is missing")
        kv_heads = self.key_values.kv_heads
        offset = self.read_later.index(layer) * kv_heads
        return self._downstream[offset : offset + kv_heads]
