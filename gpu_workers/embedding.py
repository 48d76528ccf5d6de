"""Sentence embeddings: one padded forward per batch, pooling, L2 normalisation.

The pooling is the model's (its manifest's ``pooling``, read from its sentence-transformers pipeline when
it was prepared): the mean over real tokens (all-MiniLM-L6-v2's ``1_Pooling`` config, then
``Normalize``), the first token's (``cls``) or the last real token's (``lasttoken``). Token ids come from
the edge (``tokenizer.json`` via ``tokenizers``); the engine adds nothing but padding. Like the generation
engine it is used from one dedicated thread.

A request may ask for its vectors as pooled, without the normalisation (``EmbeddingRequested.normalize``;
the edge always asks for it): a batch holding such a row runs eagerly, each row as its request asked. It
was ignored before 2026-12-03 (a review): such a request got unit vectors, not what it asked for.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import numpy.typing as npt

from gpu_workers import GpuWorkerError
from gpu_workers.graphs import GRAPH_ROWS, capture, captured_or_eager, rows_bucket
from gpu_workers.oom import out_of_memory_in
from gpu_workers.padding import pad_rows
from gpu_workers.step_graphs import position_limit
from gpu_workers.traced import trace_checked
from schemas.manifest import Pooling

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel


log = logging.getLogger(__name__)

GRAPH_COLUMNS = (8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
GRAPH_MAX_TOKENS = 4_096
"""Rows x columns of the largest CUDA graph; a bigger batch runs eagerly. Past this a batch is no longer
launch-bound and a graph's padding costs more than it saves: on an H100, 256 x 16 ran 1.5x faster as a
graph, 512 x 16 (10-id texts padded to 16) 0.8x (docs/perf)."""


def graph_shape(rows: int, longest: int) -> tuple[int, int] | None:
    """The bucket a batch of ``rows`` inputs of up to ``longest`` ids runs in as a CUDA graph, or None."""
    height = rows_bucket(rows)
    width = next((c for c in GRAPH_COLUMNS if c >= longest), None)
    if height is None or width is None or height * width > GRAPH_MAX_TOKENS:
        return None
    return height, width


@dataclass(frozen=True, slots=True)
class _Graph:
    shape: tuple[int, int]
    ids: torch.Tensor
    mask: torch.Tensor
    unit: torch.Tensor
    graph: torch.cuda.CUDAGraph


TRACE_PROBES: tuple[tuple[tuple[int, ...], ...], ...] = (
    ((1, 2, 3, 4, 5), (1, 2, 3)),
    ((1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11),),
    ((1, 2), (1, 2), (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18)),
)
"""Token-id batches (ids every vocabulary has) the CPU's traced forward is built from (the first, with
padding) and checked against the eager forward on, each of them (one shape traced, three run: a trace that
baked in a shape or the padding would differ on another)."""

TRACE_ATOL = 1e-5
"""How far a traced forward's unit vectors may be from the eager forward's on :data:`TRACE_PROBES`."""

_TRACED: weakref.WeakKeyDictionary[Any, dict[Pooling, Any]] = weakref.WeakKeyDictionary()
"""Model -> pooling -> its traced forward (or None: it could not be traced), shared by every engine over
the model."""


POOLING_ATTRIBUTE = "sluice_pooling"
"""The attribute of a loaded embedding model's config that names its manifest's pooling
(``gpu_workers.models`` sets it), so every engine over the model pools as the model was trained."""


def model_pooling(model: PreTrainedModel) -> Pooling:
    """The pooling ``model`` was loaded with (:data:`POOLING_ATTRIBUTE`), ``mean`` where none was named."""
    pooling = getattr(model.config, POOLING_ATTRIBUTE, None)
    return pooling if pooling in ("cls", "lasttoken") else "mean"


def pooling_module(
    model: PreTrainedModel, *, pooling: Pooling = "mean", normalize: bool = True
) -> torch.nn.Module:
    """``model``'s forward with ``pooling`` and (``normalize``) L2 normalisation: ``(ids, mask)`` ->
    ``[rows, dim]`` float32 unit vectors (what sentence-transformers does for a model whose pipeline is
    that pooling, then ``Normalize``), or the pooled vectors as they are. ``mask`` marks real tokens; they
    come first in a row (``pad_rows`` pads on the right), but ``lasttoken`` takes the last marked column
    wherever the padding is, as sentence-transformers does."""
    import torch

    class Pooled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = model

        def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            out = self.encoder(
                input_ids=ids, attention_mask=mask, token_type_ids=torch.zeros_like(ids), return_dict=False
            )
            hidden = out[0]
            if pooling == "cls":
                pooled = hidden[:, 0].float()
            elif pooling == "lasttoken":
                columns = torch.arange(mask.shape[1], device=mask.device)
                last = (mask * columns).argmax(dim=1)
                pooled = hidden[torch.arange(hidden.shape[0], device=hidden.device), last].float()
            else:
                weights = mask.unsqueeze(-1).to(hidden.dtype)
                summed = (hidden * weights).sum(dim=1)
                pooled = (summed / weights.sum(dim=1).clamp(min=1e-9)).float()
            return torch.nn.functional.normalize(pooled, p=2, dim=1) if normalize else pooled

    return Pooled()


def traced_forward(model: PreTrainedModel, pad_id: int, pooling: Pooling = "mean") -> Any:
    """``model``'s pooled forward as a traced, frozen TorchScript graph for the CPU, or None where it cannot
    be traced or the trace differs from the eager forward on :data:`TRACE_PROBES` (logged). Built once per
    model, under ``inference_mode``.

    The graph runs without Python between ops: MiniLM's batch of one 10-token sentence took 9.1 ms instead
    of 11.0 on one core, a batch of 4 3.8 instead of 4.3 ms an item, 8 3.1 instead of 3.4; from 32 items on
    the two are the same (the forward is its GEMMs there; docs/perf)."""
    if pooling in _TRACED.get(model, {}):
        return _TRACED[model][pooling]
    import torch

    traced: Any = None
    if model.training:
        log.warning("the embedding model is in training mode: it runs eagerly")
    else:
        eager = pooling_module(model, pooling=pooling)
        probes = [pad_rows(batch, pad_id, torch.device("cpu")) for batch in TRACE_PROBES]
        with torch.inference_mode():
            traced = trace_checked(
                "the embedding forward",
                eager,
                probes[0],
                lambda graph: max(float((graph(*p) - eager(*p)).abs().max()) for p in probes),
                TRACE_ATOL,
            )
    _TRACED.setdefault(model, {})[pooling] = traced
    return traced


class EmbeddingError(GpuWorkerError):
    """A batch the embedding engine cannot take (empty item, too long, ids outside the vocabulary)."""


class PendingVectors(Protocol):
    def result(self) -> npt.NDArray[np.float32]:
        """``[len(batch), dim]`` float32 vectors, unit ones unless a row was launched otherwise (waits for
        the device if it has not finished)."""
        ...


class _Ready:
    def __init__(self, vectors: npt.NDArray[np.float32]) -> None:
        self._vectors = vectors

    def result(self) -> npt.NDArray[np.float32]:
        return self._vectors


class _OnTheWay:
    """A batch the GPU is still computing and copying back (into pinned memory) when ``launch`` returns."""

    def __init__(self, host: torch.Tensor, copied: torch.cuda.Event) -> None:
        self._host = host
        self._copied = copied

    def result(self) -> npt.NDArray[np.float32]:
        self._copied.synchronize()  # waits without the GIL
        vectors: npt.NDArray[np.float32] = self._host.numpy()
        return vectors


class EmbeddingEngine:
    def __init__(
        self,
        model: PreTrainedModel,
        *,
        pad_token_id: int | None = None,
        max_length: int | None = None,
        cuda_graphs: bool = True,
        traced: bool = True,
        pooling: Pooling | None = None,
    ):
        """``pooling``: the model's own where None (:func:`model_pooling`). ``max_length``: at most the
        positions the model has (:func:`position_limit`: a RoBERTa-family encoder's 514 hold 512)."""
        config = model.config
        self._model = model
        self._device = next(model.parameters()).device
        config_pad = getattr(config, "pad_token_id", None)
        self._pad_id: int = pad_token_id if pad_token_id is not None else int(config_pad or 0)
        positions = position_limit(config)
        self._positions = positions
        self.max_length = min(max_length or positions, positions)
        hidden: int = config.hidden_size
        self.dim = hidden
        self._vocab_size = int(config.vocab_size)
        self._graphs: dict[tuple[int, int], _Graph] | None = {} if cuda_graphs and self.overlaps else None
        """On a GPU, one CUDA graph per batch shape bucket, captured at its first batch: the forward of a
        small encoder is launch-bound (MiniLM on an H100 took ~3 ms a batch whatever its size), a graph
        replays all its kernels in one launch. None: eager (a CPU, or turned off, or a capture failed)."""
        self._pool: Any = None
        self.pooling: Pooling = pooling or model_pooling(model)
        self._module = pooling_module(model, pooling=self.pooling)
        self._unnormalized = pooling_module(model, pooling=self.pooling, normalize=False)
        self._trace = traced and self._device.type == "cpu"
        """On a CPU, run :func:`traced_forward`'s graph (built at the first batch) where it could be built."""

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def vocab_size(self) -> int:
        """Token ids ``launch`` takes are ``0 <= id < vocab_size``."""
        return self._vocab_size

    @property
    def graphs(self) -> int:
        """CUDA graphs captured so far (0 where the forward runs eagerly)."""
        return len(self._graphs or ())

    @property
    def traced(self) -> bool:
        """Whether the forward runs as a traced graph (a CPU, once the first batch has built it)."""
        return self._trace and _TRACED.get(self._model, {}).get(self.pooling) is not None

    @property
    def overlaps(self) -> bool:
        """Whether ``launch`` returns before the device has finished (a GPU): the caller can do other work,
        such as finishing the previous batch's requests, while this one runs."""
        return self._device.type == "cuda"

    def embed(
        self, batch: Sequence[Sequence[int]], normalize: Sequence[bool] | None = None
    ) -> npt.NDArray[np.float32]:
        """``[len(batch), dim]`` float32 unit vectors, one forward pass for the whole batch (see
        :meth:`launch` for ``normalize``)."""
        return self.launch(batch, normalize).result()

    def launch(
        self, batch: Sequence[Sequence[int]], normalize: Sequence[bool] | None = None
    ) -> PendingVectors:
        """Start the forward pass over ``batch`` and the copy of its vectors back to the host. On a GPU both
        are queued on the device and this returns without waiting for them (the copy of the ids, from
        pageable memory, waits for the batch ahead on the stream, not for this one); on a CPU they have
        finished. Out of memory is raised here, when the pass allocates, never by ``result()``.

        ``normalize``: per row, whether its vector is L2-normalised (None: every row's is). A batch with a
        row that is not runs eagerly (no graph, no trace; such rows are rare, and each graph or trace
        would double for them)."""
        import torch

        if not batch:
            return _Ready(np.zeros((0, self.dim), dtype=np.float32))
        for item in batch:
            if not item:
                raise EmbeddingError("cannot embed an empty token sequence")
            if len(item) > self.max_length:
                raise EmbeddingError(f"{len(item)} tokens exceed the model's {self.max_length}")
            if min(item) < 0 or max(item) >= self._vocab_size:
                raise EmbeddingError(f"token ids outside the vocabulary of {self._vocab_size}")
        if normalize is not None and len(normalize) != len(batch):
            raise EmbeddingError(f"{len(normalize)} normalize flags for a batch of {len(batch)}")
        with torch.inference_mode():
            if normalize is None or all(normalize):
                vectors = self._unit(batch)
            else:
                vectors = self._as_asked(batch, normalize)
        if not self.overlaps:
            return _Ready(vectors.cpu().numpy())
        host = vectors.to("cpu", non_blocking=True)  # into pinned memory, after the pass on the same stream
        copied = torch.cuda.Event()  # type: ignore[no-untyped-call]
        copied.record(torch.cuda.current_stream(self._device))
        return _OnTheWay(host, copied)

    def _unit(self, batch: Sequence[Sequence[int]]) -> torch.Tensor:
        """``batch``'s unit vectors on the device: a CUDA graph's where there is one (call under
        ``inference_mode``)."""
        import torch

        graph = self._graph_for(len(batch), max(len(item) for item in batch))
        if graph is None:
            return self._pooled(*pad_rows(batch, self._pad_id, self._device))
        ids, mask = pad_rows(batch, self._pad_id, torch.device("cpu"), shape=graph.shape)
        graph.ids.copy_(ids)
        graph.mask.copy_(mask)
        graph.graph.replay()
        return graph.unit[: len(batch)]

    def _as_asked(self, batch: Sequence[Sequence[int]], normalize: Sequence[bool]) -> torch.Tensor:
        """``batch``'s pooled vectors on the device, those of the rows ``normalize`` names L2-normalised as
        :meth:`_unit` would give them (eagerly; call under ``inference_mode``)."""
        import torch

        pooled: torch.Tensor = self._unnormalized(*pad_rows(batch, self._pad_id, self._device))
        rows = torch.tensor(list(normalize), device=self._device).unsqueeze(1)
        return torch.where(rows, torch.nn.functional.normalize(pooled, p=2, dim=1), pooled)

    def _pooled(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The model's pooling, then L2 normalisation (call under ``inference_mode``): through the
        traced graph where there is one, else eagerly."""
        if self._trace:
            graph = traced_forward(self._model, self._pad_id, self.pooling)
            if graph is not None:
                unit: torch.Tensor = graph(ids, mask)
                return unit
        out: torch.Tensor = self._module(ids, mask)
        return out

    def _graph_for(self, rows: int, longest: int) -> _Graph | None:
        if self._graphs is None:
            return None
        shape = graph_shape(rows, longest)
        if shape is None or shape[1] > self._positions:  # padding past the model's positions: eager
            return None
        graph = self._graphs.get(shape)
        if graph is None:
            # out of memory is raised: the runner splits the batch, as for an eager pass
            graph = captured_or_eager(lambda: self._capture(*shape), "embeddings run eagerly")
            if graph is None:
                self._graphs = None
                return None
            self._graphs[shape] = graph
            log.info("captured the embedding forward for %d x %d as a CUDA graph", *shape)
        return graph

    def warm_up(self, max_rows: int, max_columns: int = 32) -> int:
        """Capture, before serving, the graphs of the batches a worker sees most (up to ``max_rows`` rows
        of up to ``max_columns`` ids), so that their first batches do not wait for a capture (it
        synchronises the device, collects garbage and runs the forward three times); other shapes are
        still captured at first use. Returns how many graphs exist. Running out of memory stops the
        warm-up, not the worker. On a CPU (no graphs) one small forward warms the kernels."""
        if self._graphs is None:
            self.embed([[self._pad_id, self._pad_id]])
            return 0
        top = next((r for r in GRAPH_ROWS if r >= max_rows), GRAPH_ROWS[-1])  # where a full batch runs
        for rows in (r for r in GRAPH_ROWS if r <= top):
            for columns in (c for c in GRAPH_COLUMNS if c <= max_columns):
                if graph_shape(rows, columns) != (rows, columns) or columns > self._positions:
                    continue
                try:
                    self.embed([[self._pad_id] * columns] * rows)
                except Exception as exc:
                    if out_of_memory_in(exc) is None:
                        raise
                    log.warning(
                        "warming up CUDA graphs: out of memory at %d x %d; the rest at first use",
                        rows,
                        columns,
                    )
                    return self.graphs
        return self.graphs

    def _capture(self, rows: int, columns: int) -> _Graph:
        """The forward for ``rows`` x ``columns`` ids, captured as a CUDA graph over static inputs (warmed up
        on a side stream first, as PyTorch's capture requires). Every graph shares one memory pool: they
        never run at once, and a result is copied out before the next replay on the same stream."""
        import torch

        ids = torch.full((rows, columns), self._pad_id, dtype=torch.long, device=self._device)
        mask = torch.zeros((rows, columns), dtype=torch.long, device=self._device)
        mask[:, 0] = 1
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph, unit = capture(lambda: self._pooled(ids, mask), self._device, self._pool)
        return _Graph((rows, columns), ids, mask, unit, graph)
