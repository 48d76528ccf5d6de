"""One lifecycle for every long-lived component.

A component has ``start()`` / ``stop()`` and is a context manager; a start that fails part-way stops what it
had started before the error propagates; and a component records its **first failure** once and tells every
watcher (:meth:`watch`) — an owner fails what waits on it, a supervisor stops or restarts, readiness turns
false — so nothing hangs silently on a dead thread.

:class:`Component` is the synchronous form (thread-backed pieces: Kafka consumers and producers, the local
broker, the ops server, the worker); :class:`AsyncComponent` the asyncio form (the edge, its Kafka gateway,
the streams service, the warehouse query server). Subclasses call ``super().__init__()``, implement ``_start`` and ``stop``; ``stop``
must be safe to call after a partial or failed start, and more than once.
"""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from types import TracebackType
from typing import Self

log = logging.getLogger(__name__)

Watcher = Callable[[BaseException], object]


class _Failure:
    """The first failure of a component and who to tell; thread-safe (threads fail, loops read)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._failure: BaseException | None = None
        self._watchers: list[Watcher] = []

    @property
    def failure(self) -> BaseException | None:
        return self._failure

    def fail(self, exc: BaseException, name: str) -> bool:
        """Record ``exc`` if it is the first failure and tell every watcher; False if one was recorded."""
        with self._lock:
            if self._failure is not None:
                return False
            self._failure = exc
            watchers = list(self._watchers)
        for watcher in watchers:
            _tell(watcher, exc, name)
        return True

    def watch(self, watcher: Watcher, name: str) -> None:
        with self._lock:
            failed = self._failure
            if failed is None:
                self._watchers.append(watcher)
        if failed is not None:
            _tell(watcher, failed, name)


def _tell(watcher: Watcher, exc: BaseException, name: str) -> None:
    try:
        watcher(exc)
    except Exception:  # one broken watcher must not keep the others from hearing
        log.exception("%s: a failure watcher raised", name)


class _Watched:
    def __init__(self) -> None:
        self._lifecycle = _Failure()

    @property
    def failure(self) -> BaseException | None:
        """The first error this component died of, or None."""
        return self._lifecycle.failure

    def fail(self, exc: BaseException) -> bool:
        """Record the component's first failure and tell its watchers (any thread)."""
        return self._lifecycle.fail(exc, type(self).__name__)

    def watch(self, watcher: Watcher) -> None:
        """Call ``watcher(exc)`` once, on the first failure (at once if it already failed). Watchers run on
        the failing thread: they must be quick and thread-safe (set an event, put on a queue)."""
        self._lifecycle.watch(watcher, type(self).__name__)


class Component(_Watched, ABC):
    """A synchronous long-lived component."""

    def start(self) -> None:
        try:
            self._start()
        except BaseException:
            self._stop_quietly()
            raise

    @abstractmethod
    def _start(self) -> None:
        """Start every piece; raise to have :meth:`stop` undo what had started."""

    @abstractmethod
    def stop(self) -> None:
        """Stop every piece that runs; safe after a partial start and more than once."""

    def _undo_start(self) -> None:
        """Undo a failed start: stop every piece (``stop`` is safe after a partial start). A component that
        may find pieces running that another process started (a local Kafka node) stops only its own."""
        self.stop()

    def _stop_quietly(self) -> None:
        try:
            self._undo_start()
        except Exception:
            log.warning("%s: stop after a failed start raised", type(self).__name__, exc_info=True)

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


class AsyncComponent(_Watched, ABC):
    """An asyncio long-lived component."""

    async def start(self) -> None:
        try:
            await self._start()
        except BaseException:
            try:
                await self.stop()
            except Exception:
                log.warning("%s: stop after a failed start raised", type(self).__name__, exc_info=True)
            raise

    @abstractmethod
    async def _start(self) -> None:
        """Start every piece; raise to have :meth:`stop` undo what had started."""

    @abstractmethod
    async def stop(self) -> None:
        """Stop every piece that runs; safe after a partial start and more than once."""

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()
