"""Garbage-collection tuning of the long-lived processes (edge, workers, streams)."""

from __future__ import annotations

import gc
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
