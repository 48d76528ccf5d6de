"""The one component lifecycle: a start that fails part-way stops what it started, the first failure is
recorded once and told to every watcher (also to one that comes late), and one broken watcher does not
keep the others from hearing."""

from __future__ import annotations

import threading

import pytest

from schemas.lifecycle import AsyncComponent, Component


class Pieces(Component):
    def __init__(self, *, fail_at: int | None = None) -> None:
        super().__init__()
        self.fail_at = fail_at
        self.started: list[int] = []
        self.stops = 0

    def _start(self) -> None:
        for piece in range(3):
            if piece == self.fail_at:
                raise OSError(f"piece {piece} would not start")
            self.started.append(piece)

    def stop(self) -> None:
        self.stops += 1
        self.started.clear()


def test_a_start_that_fails_part_way_stops_what_it_started() -> None:
    component = Pieces(fail_at=2)
    with pytest.raises(OSError, match="piece 2"):
        component.start()
    assert component.started == []
    assert component.stops == 1


def test_the_context_manager_starts_and_stops() -> None:
    with Pieces() as component:
        assert component.started == [0, 1, 2]
    assert component.stops == 1


def test_the_first_failure_wins_and_every_watcher_hears_it_once() -> None:
    component = Pieces()
    heard: list[BaseException] = []

    def broken(exc: BaseException) -> None:
        raise RuntimeError("a watcher with a bug")

    component.watch(broken)
    component.watch(heard.append)
    first, second = OSError("first"), OSError("second")
    assert component.fail(first)
    assert not component.fail(second)
    assert component.failure is first
    assert heard == [first]  # the broken watcher before it did not keep it from hearing
    late: list[BaseException] = []
    component.watch(late.append)
    assert late == [first]  # a watcher that comes after the failure is told at once


def test_failures_from_many_threads_record_exactly_one() -> None:
    component = Pieces()
    heard: list[BaseException] = []
    component.watch(heard.append)
    errors = [RuntimeError(str(i)) for i in range(16)]
    threads = [threading.Thread(target=component.fail, args=(e,)) for e in errors]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(heard) == 1
    assert component.failure is heard[0]


class AsyncPieces(AsyncComponent):
    def __init__(self, *, fail: bool) -> None:
        super().__init__()
        self.should_fail = fail
        self.running = False

    async def _start(self) -> None:
        self.running = True
        if self.should_fail:
            raise OSError("would not start")

    async def stop(self) -> None:
        self.running = False


async def test_the_async_form_stops_after_a_failed_start_and_is_a_context_manager() -> None:
    failing = AsyncPieces(fail=True)
    with pytest.raises(OSError):
        await failing.start()
    assert not failing.running
    async with AsyncPieces(fail=False) as component:
        assert component.running
    assert not component.running
