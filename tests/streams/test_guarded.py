"""A crashed timer is the app's failure (guarded), so the streams process exits and is restarted instead
of running on without its controller."""

from __future__ import annotations

import asyncio

import pytest

from schemas.lifecycle import AsyncComponent
from streams.app import guarded


class App(AsyncComponent):
    async def _start(self) -> None:
        pass

    async def stop(self) -> None:
        pass


async def test_a_guarded_agent_or_timer_that_crashes_fails_its_component() -> None:
    component = App()

    async def timer() -> None:
        raise KeyError("a controller bug")

    with pytest.raises(KeyError):
        await guarded(component.fail, timer)()
    assert isinstance(component.failure, KeyError)

    async def cancelled() -> None:
        raise asyncio.CancelledError

    other = App()
    with pytest.raises(asyncio.CancelledError):
        await guarded(other.fail, cancelled)()
    assert other.failure is None  # stopping is not failing
