"""An in-memory :class:`ingest.batch_log.BatchLog`: lines are answered by a fake worker at once (or held,
or failed, as a test says), states and cancels are kept for inspection."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from bus.errors import BusError
from schemas.events import (
    BatchItemRequested,
    BatchStateChanged,
    CancelRequested,
    EmbeddingRequested,
    ErrorInfo,
    Float32Vectors,
    RequestFinished,
    Usage,
)

Responder = Callable[[BatchItemRequested], RequestFinished | None]


def complete(event: BatchItemRequested) -> RequestFinished:
    """What a worker answers a line: its text is ``line <index>``; vectors are [index, tokens, k]."""
    request = event.as_request()
    if isinstance(request, EmbeddingRequested):
        vectors = [[float(event.index), float(len(ids)), float(k)] for k, ids in enumerate(request.inputs)]
        tokens = sum(len(ids) for ids in request.inputs)
        usage = Usage(prompt_tokens=tokens, completion_tokens=0, total_tokens=tokens)
        return finished(event, "completed", usage, embeddings=Float32Vectors.pack(vectors, 3))
    prompt = len(request.input_ids)
    usage = Usage(prompt_tokens=prompt, completion_tokens=2, total_tokens=prompt + 2)
    return finished(event, "completed", usage, text=f"line {event.index}")


def failing(code: str) -> Responder:
    def respond(event: BatchItemRequested) -> RequestFinished:
        usage = Usage(prompt_tokens=0, completion_tokens=0, total_tokens=0)
        return finished(event, "failed", usage, error=ErrorInfo(code=code, message=f"fake {code}"))

    return respond


def finished(
    event: BatchItemRequested,
    status: str,
    usage: Usage,
    *,
    text: str | None = None,
    embeddings: Float32Vectors | None = None,
    error: ErrorInfo | None = None,
) -> RequestFinished:
    return RequestFinished(
        tenant=event.tenant,
        model=event.model,
        request_id=event.request_id,
        source="fake-worker",
        status=status,  # type: ignore[arg-type]
        finish_reason="stop" if status == "completed" else "error",
        usage=usage,
        text=text,
        embeddings_f32=embeddings,
        error=error,
        model_version=event.model_version,
        batch=event.ref,
    )


class FakeBatchLog:
    def __init__(self) -> None:
        self.lines: list[BatchItemRequested] = []
        self.states: list[BatchStateChanged] = []
        self.cancels: list[CancelRequested] = []
        self.respond: Responder = complete
        """Called for each published line; None holds it (answer later with :meth:`answer`)."""
        self.handled_calls = 0
        self.broken: BaseException | None = None
        """Set: ``results`` raises it (the results consumer died)."""
        self.follows: list[bool] = []
        """``from_end`` of each ``follow`` that started reading results."""
        self.unfollows = 0
        self.unfollow_takes_s = 0.0
        """How long ``unfollow`` takes (the real one stops a consumer thread): the runner goes on meanwhile."""
        self.unfollow_gate: asyncio.Event | None = None
        """Set: ``unfollow`` also waits for it, for as long as a test needs (a time would be a race with a
        loaded box's stalls)."""
        self.unfollowing = False
        self._following = False
        self._backlog = 0
        """Results queued before the last follow from committed offsets, not yet returned (``caught_up``)."""
        self._results: asyncio.Queue[RequestFinished] = asyncio.Queue()
        self._watchers: list[Callable[[BaseException], object]] = []

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        await self.unfollow()

    @property
    def following(self) -> bool:
        return self._following

    @property
    def caught_up(self) -> bool:
        return self._backlog == 0

    async def follow(self, *, from_end: bool) -> None:
        if not self._following:
            if from_end:  # what was written while it did not follow is skipped, as on Kafka
                while not self._results.empty():
                    self._results.get_nowait()
            self._backlog = self._results.qsize()
            self._following = True
            self.follows.append(from_end)

    async def unfollow(self) -> None:
        if self._following:
            self._following = False
            self._backlog = 0
            self.unfollows += 1
            self.unfollowing = True
            await asyncio.sleep(self.unfollow_takes_s)
            if self.unfollow_gate is not None:
                await self.unfollow_gate.wait()
            self.unfollowing = False

    def watch(self, watcher: Callable[[BaseException], object]) -> None:
        self._watchers.append(watcher)

    def publish_line(self, event: BatchItemRequested, on_failed: Callable[[BusError], None]) -> None:
        if not self._following:  # its result could land before anybody reads the results topic
            raise AssertionError(f"line {event.index} published while the results topic is not followed")
        self.lines.append(event)
        result = self.respond(event)
        if result is not None:
            self._results.put_nowait(result)

    def answer(self, result: RequestFinished) -> None:
        self._results.put_nowait(result)

    def cancel(self, event: CancelRequested) -> None:
        self.cancels.append(event)

    async def publish_state(self, state: BatchStateChanged) -> None:
        self.states.append(state)

    async def results(self, wait_s: float) -> list[RequestFinished]:
        if self.broken is not None:
            raise self.broken
        if not self._following:
            await asyncio.sleep(min(wait_s, 0.05))
            return []
        try:
            async with asyncio.timeout(min(wait_s, 0.05)):  # wait_for could swallow the runner's cancel
                first = await self._results.get()
        except TimeoutError:
            return []
        out = [first]
        while not self._results.empty():
            out.append(self._results.get_nowait())
        self._backlog = max(0, self._backlog - len(out))
        return out

    def handled(self) -> None:
        self.handled_calls += 1
