"""CUDA graphs for the engines' forwards: the row buckets they are captured for, and one capture recipe.

A small model's forward on a GPU is launch-bound: each of its few hundred kernels costs microseconds of
host time to launch and less than that on the device (MiniLM on an H100 took ~3 ms a batch whatever its
size). A graph replays all of them in one launch, over the same memory every time: its inputs and outputs
are static tensors, and a batch is copied into them.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from gpu_workers.oom import out_of_memory_in

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

T = TypeVar("T")

GRAPH_ROWS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
"""The batch heights a graph is captured for; a batch runs in the smallest that holds it, the rows beyond
it padding."""


def rows_bucket(rows: int) -> int | None:
    """The smallest of :data:`GRAPH_ROWS` that holds ``rows``, or None past the largest."""
    return next((r for r in GRAPH_ROWS if r >= rows), None)


def captured_or_eager(make: Callable[[], T], fallback: str) -> T | None:
    """``make()`` (a capture), or None where it failed for any reason but memory: logged, and the caller
    runs eagerly from then on (``fallback`` says what). Out of memory is raised as itself, also when the
    capture's teardown raised it wrapped, so the caller backs off as after an eager pass."""
    outside = sys.exc_info()[1]  # what the caller is handling, if anything: not this capture's doing
    try:
        return make()
    except Exception as exc:
        oom = out_of_memory_in(exc, outside)
        if oom is exc:
            raise
        if oom is not None:
            raise oom from exc
        log.warning("CUDA graph capture failed (%s): %s from now on", exc, fallback, exc_info=exc)
        return None


def capture(forward: Callable[[], T], device: torch.device, pool: Any) -> tuple[torch.cuda.CUDAGraph, T]:
    """``forward`` (which reads only static tensors) captured as a CUDA graph, and its output tensors:
    replaying the graph refills them. Warmed up twice on a side stream first, as PyTorch's capture
    requires. ``pool`` (``torch.cuda.graph_pool_handle()``) is shared by graphs that never run at once.
    Call under ``inference_mode`` when the graph is replayed under it."""
    import torch

    with torch.cuda.device(device):  # the pool, the side stream and the capture: the model's
        side = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):
                forward()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = forward()
    return graph, out
