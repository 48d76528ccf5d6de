"""Garbage collection for the platform's long-lived processes (edge, workers, streams).

Each holds a large heap built at start-up (aiohttp and its routes; torch, transformers and the model;
evidently, pandas and scipy) and then allocates short-lived objects per request or per event, nearly all
freed by reference counting. At CPython's default thresholds those allocations set off a young collection
every 700 net allocations, and every so often a full one walks the whole start-up heap while holding the
GIL. Measured:

- streams sink: collections were a third of its CPU before tuning; at 50,000 a young collection still
  cost ~30 ms and ~4 µs per terminal event (15 % of preparing a batch), none at 200,000;
- embedding worker under 64 clients: a full collection every ~5 s, each 0.1-0.23 s during which the model
  thread waits for the GIL.

:func:`tune_gc`, called once start-up is done, moves everything alive into a permanent generation the
collector never walks (``gc.freeze()``) and collects the young generation every
:data:`GC_GEN0_THRESHOLD` net allocations. Cycles are still collected, only later: between collections
at most that many container objects of cyclic garbage wait (a few tens of MB). Python's own
``python_gc_*`` series on ``/metrics`` show what the collector does. At exit the heap is unfrozen again,
so the interpreter's last collection frees it (frozen, nanobind's bindings that torch loads report
hundreds of leaked objects on stderr as the process ends).
"""

from __future__ import annotations

import atexit
import gc

GC_GEN0_THRESHOLD = 200_000
"""Net allocations of container objects between young-generation collections (CPython's default: 700)."""


def tune_gc() -> None:
    """Freeze what start-up built and collect the young generation less often; call it once the process
    serves (its model loaded, its server started). A larger threshold already set is kept."""
    atexit.unregister(gc.unfreeze)
    atexit.register(gc.unfreeze)  # once, however often it is called
    gc.freeze()
    gen0, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(max(gen0, GC_GEN0_THRESHOLD), gen1, gen2)
