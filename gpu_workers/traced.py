"""A model's forward as a traced, frozen TorchScript graph for the CPU: the ops run without Python between
them. A small model's forward on a CPU is mostly that Python (transformers' modules, mask preparation,
attention dispatch): MiniLM's batch of one sentence took 9.1 ms traced against 11.0 eagerly on one core,
demo-gpt's prefill of a 10-token prompt 0.46 against 0.96 ms (docs/perf).

A trace records the ops one input ran, Python conditions included, so a graph is only used once it gave
the eager forward's answer on inputs of other shapes too (and padding), within a tolerance; otherwise the
model runs eagerly, logged."""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


def trace_checked(
    what: str,
    module: torch.nn.Module,
    probe: tuple[torch.Tensor, ...],
    distance: Callable[[Any], float],
    atol: float,
) -> Any:
    """``module`` traced on ``probe`` and frozen, or None where the tracer cannot follow it or the graph is
    more than ``atol`` from the eager forward by ``distance`` (the graph -> the worst difference over the
    caller's check inputs); ``what`` names the forward in the log. Call under ``inference_mode``."""
    began = time.perf_counter()
    try:
        with warnings.catch_warnings():
            # torch.jit is deprecated in favour of torch.compile (a ~35 s compile per process here,
            # docs/perf); the tracer warns of every Python condition it records, checked below instead
            warnings.simplefilter("ignore")
            import torch

            graph = torch.jit.freeze(
                torch.jit.trace(module.eval(), probe, check_trace=False).eval()  # type: ignore[no-untyped-call]
            )
    except Exception as exc:  # an architecture the tracer cannot follow
        log.warning("%s could not be traced (%s): it runs eagerly", what, _first_line(exc))
        return None
    try:
        worst = distance(graph)
    except Exception as exc:  # the graph (or the eager forward) refused one of the check's inputs
        log.warning("%s traced failed its check (%s): it runs eagerly", what, _first_line(exc))
        return None
    if not worst <= atol:  # NaN too
        log.warning("%s traced is %.2g away from its eager one: it runs eagerly", what, worst)
        return None
    log.info("traced %s for the CPU in %.1f s", what, time.perf_counter() - began)
    return graph


def _first_line(exc: Exception) -> str:
    """An exception's first line: a TorchScript error carries the graph's whole traceback after it."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
