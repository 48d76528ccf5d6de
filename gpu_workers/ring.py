"""The generation engine's KV cache on a GPU: a fixed ring of columns, so that a decode step has one shape
per batch height and runs as a CUDA graph.

The engine's default cache (``engine._growing_layer_class``) grows a column every step and drops leading
columns no row attends to: every decode has a new shape, so it cannot be captured, and a tiny model's
decode forward on a GPU is host-bound (demo-gpt at 256 rows on an H100: ~2.3 ms a step, nearly all of it
Python and kernel launches). Here every row's keys and values live in ``columns`` ring columns, per layer:

- decode step ``t`` writes column ``t mod columns`` for every row, and every row attends to it (a free row,
  whose output is ignored, attends to its own new columns only, as in the growing cache);
- a joiner's prompt fills the ``n`` columns written last, in its own row: the same columns as its
  neighbours' last ``n`` tokens, whatever ring position that is;
- a row attends to the columns its 2D mask marks. Which column holds which token does not matter to the
  model: positions travel as ``position_ids``, and attention is over a masked set. A sequence holds at most
  ``max_context <= columns`` tokens, so it never wraps onto its own oldest column.

The decode reads only static tensors (the ids, positions and the column to write are copied into one
``feed`` tensor per step), so each batch height (:data:`gpu_workers.graphs.GRAPH_ROWS`) is captured once
and replayed: one launch a step instead of a few hundred. The forward is the model's own (a 4D additive
mask and a cache whose layers write in place), so any transformers decoder that takes ``position_ids`` and
a ``Cache`` runs here. The price is attention over every column at every step, which a GPU does not
notice at these sizes; on a CPU the growing cache stays the default.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from gpu_workers import GpuWorkerError
from gpu_workers.graphs import capture, captured_or_eager
from gpu_workers.padding import decode_bias

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)

RING_MEMORY_SHARE = 0.5
"""A ring may take at most this share of the device memory free when it is made: past it the engine keeps
the growing cache (a long context times many rows of a big model is gigabytes, which the batches' own
activations and the CUDA graphs also need)."""


class RingTooLarge(GpuWorkerError):
    """The ring would take more of the device's memory than :data:`RING_MEMORY_SHARE` of what is free."""


class RingCache:
    """Keys and values of up to ``rows`` sequences in ``columns`` ring columns, each row's attention mask,
    and the decode forward over them (a CUDA graph per batch height with ``graphs``). Used from the
    engine's thread only."""

    def __init__(
        self,
        model: PreTrainedModel,
        rows: int,
        columns: int,
        *,
        graphs: bool,
        head: Callable[[torch.Tensor], torch.Tensor],
    ) -> None:
        import torch

        self._model = model
        self._head = head
        """What the decode computes from its logits besides them (the sampler's per-row statistics): part
        of the graph, so a step is one launch and one copy back."""
        self.device: torch.device = next(model.parameters()).device
        self.rows = rows
        self.columns = columns
        with torch.inference_mode():
            probe = model(
                input_ids=torch.zeros((1, 1), dtype=torch.long, device=self.device), use_cache=True
            ).past_key_values
        shapes = [(layer.keys.shape, layer.keys.dtype) for layer in probe.layers]
        need = sum(2 * rows * s[1] * columns * s[3] * dt.itemsize for s, dt in shapes)
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            if need > RING_MEMORY_SHARE * free:
                raise RingTooLarge(
                    f"a KV ring of {rows} rows x {columns} columns needs {need / 2**20:,.0f} MiB;"
                    f" {free / 2**20:,.0f} MiB of the device is free"
                )
        self.keys = [
            torch.zeros((rows, s[1], columns, s[3]), dtype=dt, device=self.device) for s, dt in shapes
        ]
        self.values = [torch.zeros_like(k) for k in self.keys]
        self._dtype = shapes[0][1]
        self.mask = torch.zeros((rows, columns), dtype=torch.bool, device=self.device)
        """Which columns each row attends to (the decode adds the column it writes, for every row)."""
        self.feed = torch.zeros(2 * rows + 1, dtype=torch.long, device=self.device)
        """The static input of a decode: ``[ids (rows), positions (rows), column]``."""
        self._host = torch.zeros(2 * rows + 1, dtype=torch.long, pin_memory=self.device.type == "cuda")
        self._host_view: np.ndarray[Any, np.dtype[np.int64]] = self._host.numpy()
        self.column = 0
        """The column the next decode writes."""
        self._graphs: dict[int, tuple[Any, tuple[torch.Tensor, torch.Tensor]]] | None = (
            {} if graphs and self.device.type == "cuda" else None
        )
        self._pool: Any = None
        self._caches: dict[int, Any] = {}

    @property
    def graphs(self) -> int:
        """CUDA graphs captured so far (0 where the decode runs eagerly)."""
        return len(self._graphs or ())

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    # ---------------------------------------------------------------------------------------- row surgery

    def place(
        self, placed: list[tuple[int, int, int]], layers: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> None:
        """Joiners' prompts into rows, all in one pass: for each ``(row, joiner, n)``, the joiner's keys and
        values (its index in each layer's ``[joiners, heads, length, dim]``, the prompt right-aligned) go
        into the ``n`` columns written last of ``row``, which attends to those alone. A handful of device
        operations whatever the number of joiners (one index copy in, one gather and one scatter per
        tensor): placing joiners one by one cost a few launches each, on a GPU ~15 ms for 256."""
        import torch

        rows, joiners, lengths = (np.array(column, dtype=np.int64) for column in zip(*placed, strict=True))
        width = layers[0][0].shape[2]
        offsets = np.concatenate([np.arange(-n, 0) for n in lengths.tolist()])  # -n .. -1, per joiner
        index = np.stack(
            [
                np.repeat(rows, lengths),
                np.repeat(joiners, lengths),
                width + offsets,  # the joiner's own columns
                (self.column + offsets) % self.columns,  # the ring's columns written last
            ]
        )
        row, joiner, source, column = torch.from_numpy(index).to(self.device)  # one copy
        for buf_k, buf_v, (k, v) in zip(self.keys, self.values, layers, strict=True):
            buf_k[row, :, column] = k[joiner, :, source]
            buf_v[row, :, column] = v[joiner, :, source]
        self.mask[row] = False
        self.mask[row, column] = True

    def free(self, row: int, *, scrub: bool = False) -> None:
        """The row's sequence is gone: from now on it attends only to its own new columns. ``scrub``: its
        keys and values are zeroed too (they hold NaN or inf, which masked columns still pass on)."""
        self.mask[row] = False
        if scrub:
            for buf in (*self.keys, *self.values):
                buf[row].zero_()

    def clear(self) -> None:
        """Every row free, its keys and values zeroed (after a failed step, whose state is not trusted)."""
        for buf in (*self.keys, *self.values, self.mask):
            buf.zero_()

    def gather(self, keep: list[int], height: int) -> None:
        """Rows ``keep`` move to the top, in order; the rows after them, up to ``height``, are free."""
        import torch

        k = len(keep)
        if keep != list(range(k)):
            index = torch.tensor(keep, dtype=torch.long, device=self.device)
            for buf in (*self.keys, *self.values, self.mask):
                buf[:k] = buf.index_select(0, index)
        self.mask[k:height] = False

    # --------------------------------------------------------------------------------------------- decode

    def decode(self, ids: list[int], positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step for the first ``len(ids)`` rows (each fed its last token at its absolute
        position): their logits, ``[rows, vocab]``, and ``head`` of them. Writes the current column and
        moves to the next."""
        height = len(ids)
        host = self._host_view
        host[:height] = ids
        host[self.rows : self.rows + height] = positions
        host[-1] = self.column
        self.feed.copy_(self._host, non_blocking=True)  # the host buffer is rewritten after the step syncs
        logits = self._run(height)
        self.column = (self.column + 1) % self.columns
        return logits

    def capture_all(self, heights: list[int]) -> int:
        """Capture the decode for each of ``heights`` now (before serving: a capture synchronises the
        device and runs the forward three times). Returns how many graphs exist."""
        for height in heights:
            if self._graphs is None:
                break
            self._graph_for(height)
        return self.graphs

    def _run(self, height: int) -> tuple[torch.Tensor, torch.Tensor]:
        graph = self._graph_for(height)
        if graph is None:
            return self._forward(height)
        graph[0].replay()
        return graph[1]

    def _graph_for(self, height: int) -> tuple[Any, tuple[torch.Tensor, torch.Tensor]] | None:
        import torch

        if self._graphs is None:
            return None
        graph = self._graphs.get(height)
        if graph is None:
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            pool = self._pool
            graph = captured_or_eager(
                lambda: capture(functools.partial(self._forward, height), self.device, pool),
                "the decode runs eagerly",
            )
            if graph is None:
                self._graphs = None
                return None
            self._graphs[height] = graph
            log.info("captured the decode for %d rows as a CUDA graph", height)
        return graph

    def _forward(self, height: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The decode forward over the static tensors, and ``head`` of its logits (what a graph captures)."""
        rows = self.rows
        column = self.feed[-1:]
        mask = self.mask[:height]
        mask.index_fill_(1, column, True)  # every row attends to the token it writes now
        out = self._model(
            input_ids=self.feed[:height].view(height, 1),
            attention_mask=decode_bias(mask, self._dtype),
            position_ids=self.feed[rows : rows + height].view(height, 1),
            past_key_values=self._cache_for(height),
            use_cache=True,
        )
        logits: torch.Tensor = out.logits[:, -1, :]
        return logits, self._head(logits)

    def _cache_for(self, height: int) -> Any:
        """A transformers ``DynamicCache`` whose layers are views of the first ``height`` rows and write
        the current column in place (a device index, so a graph replays it for any column)."""
        cache = self._caches.get(height)
        if cache is None:
            from transformers import DynamicCache

            layer = _ring_layer_class()
            column = self.feed[-1:]
            cache = DynamicCache()
            cache.layers = [
                layer(k[:height], v[:height], column) for k, v in zip(self.keys, self.values, strict=True)
            ]
            self._caches[height] = cache
        return cache


@functools.cache
def _ring_layer_class() -> type:
    """transformers' ``DynamicLayer`` over ring columns: ``update`` writes the new token's keys and values
    into the column ``column`` (a one-element device tensor) holds, and returns every column."""
    from transformers.cache_utils import DynamicLayer

    class RingLayer(DynamicLayer):  # type: ignore[no-untyped-call]
        def __init__(self, keys: torch.Tensor, values: torch.Tensor, column: torch.Tensor) -> None:
            super().__init__()  # type: ignore[no-untyped-call]
            self.dtype, self.device, self.is_initialized = keys.dtype, keys.device, True
            self.keys, self.values, self.column = keys, values, column
            self.ring = keys, values  # the views, typed (transformers types ``keys`` as optional)

        def update(
            self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
        ) -> tuple[torch.Tensor, torch.Tensor]:
            keys, values = self.ring
            keys.index_copy_(2, self.column, key_states)
            values.index_copy_(2, self.column, value_states)
            return keys, values

    return RingLayer
