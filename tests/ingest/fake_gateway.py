"""An in-memory :class:`ingest.gateway.Gateway`: a log per request, deterministic replies, full recording.

Generation: chunk ``i`` is ``" t{i}"`` with token id ``i``, up to ``min(tokens, max_tokens)`` chunks
(``finish_reason`` "length" when max_tokens cut it, else "stop"), as chunks on the log for a streamed
request and as the terminal event's ``text`` alone for one not streamed, as a worker sends them. Embeddings: input ``k`` becomes
``[len(ids), sum(ids) % 97, k]``. ``hold_after=n`` stops each producer after ``n`` chunks until
``release`` is set or the request is cancelled; ``hold_embeddings`` so holds an embeddings request before its
end (a long batch). Replies are read from the log like Kafka would serve them:
a submit stream and any number of resumes read the same records.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from ingest.errors import GatewayUnavailable
from ingest.gateway import IdempotencyRecord, ReplyItem, RequestEvent
from ingest.reply_stream import WHOLE, After, filled_in
from schemas.coordination import QuotaSync
from schemas.deployments import Deployment
from schemas.events import (
    CancelRequested,
    EmbeddingRequested,
    ErrorInfo,
    FinishReason,
    Float32Vectors,
    GenerationRequested,
    ReplyTo,
    RequestFinished,
    Status,
    Timings,
    TokenChunk,
    Usage,
    utc_now,
)


@dataclass(eq=False)
class _Log:
    event: RequestEvent
    items: list[ReplyItem] = field(default_factory=list)
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)

    async def append(self, item: ReplyItem) -> None:
        async with self.changed:
            self.items.append(item)
            self.changed.notify_all()


class FakeStream:
    def __init__(self, gateway: FakeGateway, log: _Log, after: After) -> None:
        self._gateway = gateway
        self._log = log
        self._after = after
        self._chars = 0
        """Characters of text before the next chunk (each chunk sent says where its text starts, as
        ``ReplyStream``'s do)."""
        self._index = 0
        self._ended = False
        self._end: RequestFinished | None = None
        """The terminal event, after the chunk that fills in its text (as ``ReplyStream._fill`` does)."""
        self.closed = False

    def __aiter__(self) -> FakeStream:
        return self

    async def __anext__(self) -> ReplyItem:
        if self._ended or self.closed:
            raise StopAsyncIteration
        if self._end is not None:
            self._ended = True
            return self._end
        log = self._log
        while True:
            async with log.changed:
                await log.changed.wait_for(lambda: len(log.items) > self._index)
            item = log.items[self._index]
            self._index += 1
            if not isinstance(item, TokenChunk):
                break
            item = msgspec.structs.replace(item, chars=self._chars)
            self._chars += len(item.text)
            had = self._after.seq >= 0 and item.seq <= self._after.seq
            if not (had or item.offset + len(item.token_ids) <= self._after.tokens):
                break
        self._gateway.pulled[item.request_id] += 1
        if isinstance(item, RequestFinished):
            filler = self._filler(item)
            if filler is not None:
                self._end = item
                return filler
            self._ended = True
        return item

    def _filler(self, end: RequestFinished) -> TokenChunk | None:
        """The text of a streamed request the chunks did not bring, as ``ReplyStream._fill`` gives it."""
        if not end.stream or self._after.seq >= 0:
            return None
        return filled_in(end, After(self._after.tokens, max(self._after.chars, self._chars)), self._index)

    async def aclose(self) -> None:
        self.closed = True


class FakeGateway:
    def __init__(
        self, *, edge_id: str = "edge-test", tokens: int = 5, quota_bus: list[FakeGateway] | None = None
    ) -> None:
        """Gateways made with the same ``quota_bus`` list see each other's quota snapshots (2 edges)."""
        self._edge_id = edge_id
        self._quota_bus = quota_bus if quota_bus is not None else []
        self._quota_bus.append(self)
        self._followers: list[Callable[[QuotaSync, float], None]] = []
        self.quota_published: list[QuotaSync] = []
        self.tokens = tokens
        self.is_ready = True
        self.exhausted: set[str] = set()
        self.submitted: list[RequestEvent] = []
        self.deployments: dict[str, Deployment] = {}
        self.mirrored: list[RequestEvent] = []
        self.cancels: list[CancelRequested] = []
        self.resumes: list[tuple[str, str, After]] = []
        self.streams: list[FakeStream] = []
        self.pulled: Counter[str] = Counter()
        self.idempotency: dict[tuple[str, str], IdempotencyRecord] = {}
        self.hold_after: int | None = None
        self.release = asyncio.Event()
        self.hold_embeddings = False
        self.fail_submit = False
        self.fail_with: ErrorInfo | None = None
        self.text_size = 0
        """Extra characters of padding per chunk (to test backpressure with big frames)."""
        self.race_record: IdempotencyRecord | None = None
        """When set, remember_idempotent answers this record, as if another request won the race."""
        self._logs: dict[str, _Log] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._finish_listeners: dict[str, Callable[[RequestFinished], None]] = {}
        self.failure: BaseException | None = None
        self._watchers: list[Callable[[BaseException], object]] = []

    # --- the Gateway protocol ---------------------------------------------------------------------------

    @property
    def edge_id(self) -> str:
        return self._edge_id

    @property
    def reply_to(self) -> ReplyTo:
        return ReplyTo(topic="sluice.replies", partition=3, edge_id=self._edge_id)

    def ready(self) -> bool:
        return self.is_ready

    def budget_exhausted(self, tenant: str) -> bool:
        return tenant in self.exhausted

    def deployment(self, model: str) -> Deployment | None:
        return self.deployments.get(model)

    async def mirror(self, event: RequestEvent) -> None:
        self.mirrored.append(event)

    async def submit(self, event: RequestEvent) -> FakeStream:
        if self.fail_submit:
            raise GatewayUnavailable("fake broker is down")
        self.submitted.append(event)
        log = self._logs[event.request_id] = _Log(event=event)
        task = asyncio.create_task(self._produce(log))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return self._stream(log, WHOLE)

    async def resume(self, tenant: str, request_id: str, after: After) -> FakeStream | None:
        self.resumes.append((tenant, request_id, after))
        log = self._logs.get(request_id)
        if log is None or log.event.tenant != tenant:
            return None
        return self._stream(log, after)

    def when_finished(self, request_id: str, listener: Callable[[RequestFinished], None]) -> None:
        self._finish_listeners[request_id] = listener

    async def cancel(self, event: CancelRequested) -> None:
        self.cancels.append(event)
        log = self._logs.get(event.request_id)
        if log is not None:
            log.cancelled.set()

    async def lookup_idempotent(self, tenant: str, key: str) -> IdempotencyRecord | None:
        return self.idempotency.get((tenant, key))

    async def remember_idempotent(
        self, tenant: str, key: str, record: IdempotencyRecord
    ) -> IdempotencyRecord:
        if self.race_record is not None:
            record = self.race_record
        return self.idempotency.setdefault((tenant, key), record)

    async def forget_idempotent(self, tenant: str, key: str, record: IdempotencyRecord) -> None:
        if self.idempotency.get((tenant, key)) == record:
            del self.idempotency[(tenant, key)]

    async def publish_quota(self, sync: QuotaSync) -> None:
        self.quota_published.append(sync)
        for gateway in self._quota_bus:
            for apply in gateway._followers:
                apply(sync, 0.0)

    def follow_quota(self, apply: Callable[[QuotaSync, float], None]) -> None:
        self._followers.append(apply)

    def watch(self, watcher: Callable[[BaseException], object]) -> None:
        if self.failure is not None:
            watcher(self.failure)
        else:
            self._watchers.append(watcher)

    # --- helpers for tests ------------------------------------------------------------------------------

    def fail(self, exc: BaseException) -> None:
        """What a dying producer or listener thread of the real gateway does: record the first failure and
        tell the watchers."""
        if self.failure is None:
            self.failure = exc
            for watcher in self._watchers:
                watcher(exc)

    def _stream(self, log: _Log, after: After) -> FakeStream:
        stream = FakeStream(self, log, after)
        self.streams.append(stream)
        return stream

    def log(self, request_id: str) -> list[ReplyItem]:
        return list(self._logs[request_id].items)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _produce(self, log: _Log) -> None:
        event = log.event
        if isinstance(event, EmbeddingRequested):
            vectors = [
                [float(len(ids)), float(sum(ids) % 97), float(k)] for k, ids in enumerate(event.inputs)
            ]
            prompt_tokens = sum(len(ids) for ids in event.inputs)
            usage = Usage(prompt_tokens=prompt_tokens, completion_tokens=0, total_tokens=prompt_tokens)
            packed = Float32Vectors.pack(vectors, 3)
            if self.hold_embeddings:
                await _first(self.release, log.cancelled)
            if log.cancelled.is_set():
                await self._end(log, _finished(event, "cancelled", "cancelled", usage))
                return
            await self._end(log, _finished(event, "completed", "stop", usage, embeddings=packed))
            return
        if not isinstance(event, GenerationRequested):
            raise TypeError(event)
        count = min(self.tokens, event.sampling.max_tokens)
        reason: FinishReason = "length" if count == event.sampling.max_tokens else "stop"
        done = 0
        texts: list[str] = []
        for i in range(count):
            if self.hold_after is not None and i >= self.hold_after:
                await _first(self.release, log.cancelled)
            if log.cancelled.is_set():
                break
            chunk = TokenChunk(
                tenant=event.tenant,
                model=event.model,
                request_id=event.request_id,
                source="fake",
                seq=i,
                offset=i,
                token_ids=[i],
                text=f" t{i}" + "x" * self.text_size,
                finish_reason=reason if i == count - 1 else None,
            )
            if event.stream:  # as a worker does: a request not streamed gets its text in the terminal event
                await log.append(chunk)
            texts.append(chunk.text)
            done += 1
        prompt = len(event.input_ids)
        usage = Usage(prompt_tokens=prompt, completion_tokens=done, total_tokens=prompt + done)
        text = "".join(texts)
        if log.cancelled.is_set():
            final = _finished(event, "cancelled", "cancelled", usage, text=text or None)
        elif self.fail_with is not None:
            final = _finished(event, "failed", "error", usage, error=self.fail_with, text=text or None)
        else:
            final = _finished(event, "completed", reason, usage, text=text)
        await self._end(log, final)

    async def _end(self, log: _Log, final: RequestFinished) -> None:
        """The terminal event on the log, and to its listener (as a ``KafkaGateway`` reads it)."""
        await log.append(final)
        listener = self._finish_listeners.pop(final.request_id, None)
        if listener is not None:
            listener(final)


def _finished(
    event: RequestEvent,
    status: Status,
    reason: FinishReason,
    usage: Usage,
    *,
    embeddings: Float32Vectors | None = None,
    error: ErrorInfo | None = None,
    text: str | None = None,
) -> RequestFinished:
    return RequestFinished(
        tenant=event.tenant,
        model=event.model,
        request_id=event.request_id,
        source="fake",
        status=status,
        finish_reason=reason,
        usage=usage,
        embeddings_f32=embeddings,
        text=text,
        error=error,
        worker_id="fake-worker",
        stream=isinstance(event, GenerationRequested) and event.stream,
        timings=Timings(accepted=event.time, started=utc_now(), finished=utc_now()),
        kind="embedding" if isinstance(event, EmbeddingRequested) else "chat" if event.chat else "completion",
    )


async def _first(*events: asyncio.Event) -> None:
    waiters = [asyncio.create_task(e.wait()) for e in events]
    try:
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()
        await asyncio.gather(*waiters, return_exceptions=True)
