"""Garbage-collection tuning of the long-lived processes (edge, workers, streams)."""

from __future__ import annotations

import gc
import subprocess
import sys
from collections.abc import Iterator

import pytest

from monitoring.runtime import GC_GEN0_THRESHOLD, tune_gc


@pytest.fixture
def restored_gc() -> Iterator[None]:
    threshold = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*threshold)


@pytest.mark.usefixtures("restored_gc")
def test_tuning_freezes_what_exists_and_collects_the_young_generation_less_often() -> None:
    gc.set_threshold(700, 10, 10)
    before = gc.get_freeze_count()
    tune_gc()
    assert gc.get_freeze_count() > before  # what start-up built is out of the collector's sight
    assert gc.get_threshold() == (GC_GEN0_THRESHOLD, 10, 10)
    gc.set_threshold(GC_GEN0_THRESHOLD * 2, 10, 10)
    tune_gc()
    assert gc.get_threshold()[0] == GC_GEN0_THRESHOLD * 2  # a larger threshold already set is kept


def test_the_heap_is_unfrozen_at_exit_so_the_last_collection_frees_it() -> None:
    # atexit runs its handlers last-registered first: this one runs after tune_gc's, and sees the heap.
    script = (
        "import atexit, gc\n"
        "from monitoring.runtime import tune_gc\n"
        "atexit.register(lambda: print('frozen at exit:', gc.get_freeze_count()))\n"
        "tune_gc()\n"
        "tune_gc()\n"
        "assert gc.get_freeze_count() > 0\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.strip() == "frozen at exit: 0", done.stdout + done.stderr
