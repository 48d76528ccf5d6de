"""One request's replies at the edge, in order and exactly once, from the edge's reply listener or, for a
reader that fell behind or came back, from the log (:class:`ReplyStream`); fed by
:class:`ingest.kafka_gateway.KafkaGateway`."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator
from typing import Protocol

import msgspec

from schemas.events import RequestFinished, TokenChunk

Reply = TokenChunk | RequestFinished


class ReplySource(Protocol):
    """What a stream needs of its gateway: the log from an offset, detokenising, and letting go of it."""

    def read_log(
        self, request_id: str, start: int, partition: int | None = None
    ) -> AsyncIterator[tuple[int, Reply]]: ...

    def detokenize(self, model: str, token_ids: list[int]) -> str: ...

    def forget(self, request_id: str, stream: ReplyStream) -> None: ...


class ReplyStream:
    """The replies of one request, in order, ending with its ``RequestFinished``.

    Tokens are delivered exactly once even if a worker died and another re-ran the request from the start
    (sampling is seeded, so the re-run reproduces them): chunks are cut by token offset.
    """

    def __init__(
        self,
        gateway: ReplySource,
        request_id: str,
        model: str,
        after_seq: int | None,
        buffer: int,
        *,
        tenant: str | None = None,
        from_log: int | None = None,
        partition: int | None = None,
    ) -> None:
        self._gateway = gateway
        self._partition = partition
        """The replies partition to read from the log (None: this edge's own)."""
        self.request_id = request_id
        self._model = model
        self._queue: collections.deque[tuple[int, Reply]] = collections.deque()
        self._buffer = buffer
        self._wakeup = asyncio.Event()
        self._tenant = tenant
        self._lagging_from = from_log  # set: read the log from there (after an overflow, or to resume)
        self._skip_seq = -1 if after_seq is None else after_seq
        self._delivered_tokens = 0
        self._delivered_chars = 0
        self._tokens: list[int] = []
        self._done = False
        self._error: Exception | None = None

    @property
    def finished(self) -> bool:
        return self._done

    def fail(self, error: Exception) -> None:
        """End the stream with ``error`` (raised to the reader), e.g. when the reply listener died."""
        self._error = error
        self._wakeup.set()

    async def aclose(self) -> None:
        """Release the stream (the client went away, or it ended)."""
        self._done = True
        self._gateway.forget(self.request_id, self)

    def push(self, offset: int, reply: Reply) -> None:
        """Called on the event loop by the reply listener."""
        if self._lagging_from is not None:
            return
        if len(self._queue) >= self._buffer:
            self._lagging_from = offset  # stop buffering; the reader catches up from the log
            self._wakeup.set()
            return
        self._queue.append((offset, reply))
        self._wakeup.set()

    async def __aiter__(self) -> AsyncIterator[Reply]:
        try:
            while not self._done:
                if self._error is not None:
                    raise self._error
                if not self._queue:
                    if self._lagging_from is not None:
                        async for offset, reply in self._gateway.read_log(
                            self.request_id, self._lagging_from, self._partition
                        ):
                            self._lagging_from = offset + 1
                            for out in self._accept(reply):
                                yield out
                            if self.finished:
                                return
                        continue
                    self._wakeup.clear()
                    await self._wakeup.wait()
                    continue
                _, reply = self._queue.popleft()
                for out in self._accept(reply):
                    yield out
        finally:
            self._gateway.forget(self.request_id, self)

    def _accept(self, reply: Reply) -> list[Reply]:
        if self._tenant is not None and reply.tenant != self._tenant:
            self._done = True  # not this tenant's request: end without revealing anything
            return []
        if not self._model:
            self._model = reply.model
        if isinstance(reply, RequestFinished):
            self._done = True
            return [reply]
        if reply.chars is not None:
            return self._accept_chunk(reply)
        end = reply.offset + len(reply.token_ids)
        if end <= self._delivered_tokens:
            return []  # a re-run repeating tokens already delivered
        if reply.seq <= self._skip_seq and reply.offset >= self._delivered_tokens:
            self._delivered_tokens = end  # the client already has this chunk (resume)
            self._delivered_chars += len(reply.text)
            self._tokens += reply.token_ids
            return []
        if reply.offset < self._delivered_tokens:
            fresh = reply.token_ids[self._delivered_tokens - reply.offset :]
            before = self._gateway.detokenize(self._model, self._tokens)
            after = self._gateway.detokenize(self._model, self._tokens + fresh)
            reply = TokenChunk(
                id=reply.id,
                time=reply.time,
                tenant=reply.tenant,
                model=reply.model,
                request_id=reply.request_id,
                source=reply.source,
                traceparent=reply.traceparent,
                tracestate=reply.tracestate,
                seq=reply.seq,
                offset=self._delivered_tokens,
                token_ids=fresh,
                text=after[len(before) :],
                finish_reason=reply.finish_reason,
            )
        self._delivered_tokens = reply.offset + len(reply.token_ids)
        self._delivered_chars += len(reply.text)  # a re-run by a worker that says ``chars`` goes on from here
        self._tokens += reply.token_ids
        return [reply]

    def _accept_chunk(self, chunk: TokenChunk) -> list[Reply]:
        """A chunk that says where its text starts (``chars``): what it adds beyond the tokens and the text
        delivered, each by its own offset. A re-run of the request (its first worker died) streams the same
        tokens and text, chunked differently: by tokens alone, a chunk whose text lagged its tokens (held
        back for a stop string's possible start, or an unfinished character) lost that text, and text
        recomputed from tokens showed what the stream holds back (an audit)."""
        assert chunk.chars is not None
        end, text_end = chunk.offset + len(chunk.token_ids), chunk.chars + len(chunk.text)
        if end <= self._delivered_tokens and text_end <= self._delivered_chars:
            return []  # a re-run repeating what was delivered
        if chunk.seq <= self._skip_seq and chunk.offset >= self._delivered_tokens:
            self._delivered_tokens, self._delivered_chars = end, text_end  # the client has it (a resume)
            self._tokens += chunk.token_ids
            return []
        tokens = chunk.token_ids[max(0, self._delivered_tokens - chunk.offset) :]
        text = chunk.text[max(0, self._delivered_chars - chunk.chars) :]
        if len(tokens) != len(chunk.token_ids) or len(text) != len(chunk.text):
            chunk = msgspec.structs.replace(
                chunk,
                offset=max(chunk.offset, self._delivered_tokens),
                token_ids=tokens,
                text=text,
                chars=max(chunk.chars, self._delivered_chars),
            )
        self._delivered_tokens = max(self._delivered_tokens, end)
        self._delivered_chars = max(self._delivered_chars, text_end)
        self._tokens += tokens
        return [chunk]
