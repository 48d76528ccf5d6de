"""The port between the HTTP/WebSocket layer and the log: what the edge needs from Kafka, as a Protocol.

The edge is written and tested against this (with an in-memory fake in ``tests/ingest``); the Kafka
implementation lives beside it. Its contract:

- :meth:`Gateway.submit` returns only once the request event is durably published (``acks=all``); it raises
  :class:`ingest.errors.GatewayUnavailable` when it cannot publish. Its reply stream yields the request's
  :class:`TokenChunk` s in order, without duplicates (each says where its text starts, ``chars``), then
  exactly one :class:`RequestFinished`, and ends.
- A reply stream is pulled by the edge at the client's pace; the gateway must buffer a bounded amount per
  stream (and pause its consumer or drop-and-replay from the log beyond that), never grow without bound.
  ``aclose()`` releases the stream early (client gone); it is always called, also after the end.
- :meth:`Gateway.resume` replays a request's replies from the log after ``after`` (a position,
  :class:`ingest.reply_stream.After`; ``WHOLE``: all of them) and then follows it live. It returns None when the request is unknown **or belongs to another tenant**:
  the two must look the same to the caller.
- :meth:`Gateway.publish_quota` shares this edge's admissions with the other edges (best effort: each
  snapshot replaces the one before, so a lost one costs nothing); :meth:`Gateway.follow_quota` hands every
  other edge's snapshots, on the event loop, to the admission ledger.
- :meth:`Gateway.remember_idempotent` stores ``(tenant, key) -> record`` only if absent and returns the
  stored record (the caller's, or the one that won the race, on any edge); :meth:`Gateway.forget_idempotent`
  withdraws the caller's record when its request could not be published, so a retry can run.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Protocol, TypeAlias

import msgspec

from ingest.reply_stream import After
from schemas.coordination import QuotaSync
from schemas.deployments import Deployment
from schemas.events import (
    CancelRequested,
    EmbeddingRequested,
    GenerationRequested,
    ReplyTo,
    RequestFinished,
    TokenChunk,
)

ReplyItem: TypeAlias = TokenChunk | RequestFinished
RequestEvent: TypeAlias = GenerationRequested | EmbeddingRequested


class IdempotencyRecord(msgspec.Struct, frozen=True, kw_only=True):
    request_id: str
    body_hash: str
    """sha256 hex of the canonical JSON of endpoint and body."""


class ReplyStream(Protocol):
    """The replies of ONE request: chunks, then the terminal event, then the end."""

    def __aiter__(self) -> AsyncIterator[ReplyItem]: ...

    async def aclose(self) -> None: ...


class Gateway(Protocol):
    @property
    def edge_id(self) -> str: ...

    @property
    def reply_to(self) -> ReplyTo:
        """Where this edge's replies are routed; copied into every request event."""

    def ready(self) -> bool:
        """Connected and able to publish and receive replies (``/readyz``)."""

    def budget_exhausted(self, tenant: str) -> bool:
        """The latest budget state on the control topic says ``tenant`` may not start new work."""

    async def submit(self, event: RequestEvent) -> ReplyStream: ...

    async def resume(self, tenant: str, request_id: str, after: After) -> ReplyStream | None: ...

    def deployment(self, model: str) -> Deployment | None:
        """The model's latest deployment on the control topic (None: no rollout ever; serve ``current``)."""

    async def mirror(self, event: RequestEvent) -> None:
        """Publish a shadow copy durably; nothing listens for its replies."""

    async def cancel(self, event: CancelRequested) -> None: ...

    def when_finished(self, request_id: str, listener: Callable[[RequestFinished], None]) -> None:
        """Call ``listener`` on the event loop with the request's terminal event once this edge reads it,
        whether a stream still waits for it or not (once; forgotten unheard after a while)."""

    async def lookup_idempotent(self, tenant: str, key: str) -> IdempotencyRecord | None: ...

    async def remember_idempotent(
        self, tenant: str, key: str, record: IdempotencyRecord
    ) -> IdempotencyRecord: ...

    async def forget_idempotent(self, tenant: str, key: str, record: IdempotencyRecord) -> None: ...

    async def publish_quota(self, sync: QuotaSync) -> None: ...

    def follow_quota(self, apply: Callable[[QuotaSync, float], None]) -> None:
        """From now on, call ``apply(snapshot, age_s)`` on the event loop with the other edges' snapshots
        (a starting edge is first given those of the last window)."""

    def watch(self, watcher: Callable[[BaseException], object]) -> None:
        """Call ``watcher(exc)`` once, on any thread, when the gateway dies for good (its producer, reply
        listener or control listener thread): it then fails closed, and only a new one serves again. The
        edge fails with it, so that its process exits and ``/healthz`` answers 503 (a review: the edge
        answered 503 to every request for good, ``sluice edge`` never exited for its supervisor to restart
        it, and k8s liveness stayed green)."""
