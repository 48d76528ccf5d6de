"""One request's replies at the edge, in order and exactly once, from the edge's reply listener or, for a
reader that fell behind or came back, from the log (:class:`ReplyStream`); fed by
:class:`ingest.kafka_gateway.KafkaGateway`."""

from __future__ import annotations

import asyncio
import collections
import re
from collections.abc import AsyncIterator
from typing import NamedTuple, Protocol

import msgspec

from schemas.events import RequestFinished, TokenChunk

Reply = TokenChunk | RequestFinished


class After(NamedTuple):
    """Where a client's copy of a stream ends, to resume after it: the tokens and the characters of text it
    has, which every chunk the edge sends names (:func:`cursor`, the SSE id's ``<tokens>.<chars>``). A
    position, not a chunk's ``seq``: a request re-run by another worker (its first died) numbers its chunks
    from 0 again and cuts them elsewhere, so its ids repeated (``:11, :12, :11, :12, :13``) and a resume
    after ``:12`` skipped or repeated text, depending on which ``:12`` the client had (an audit). ``seq``:
    an id an older edge gave (``<request id>:<seq>``), skipped by ``seq`` as then; -1 for a position."""

    tokens: int = 0
    chars: int = 0
    seq: int = -1

    @property
    def resumed(self) -> bool:
        """Whether the client has part of the stream (not the whole of it from the start)."""
        return self != WHOLE

    @classmethod
    def parse(cls, text: str) -> After | None:
        """``<tokens>.<chars>``, or an older edge's ``<seq>`` (-1: none); None if neither."""
        match = _AFTER.fullmatch(text)
        if match is None:
            return None
        if match["seq"] is not None:
            return cls(seq=int(match["seq"]))
        return cls(int(match["tokens"]), int(match["chars"]))


WHOLE = After()
"""The whole stream, from its first chunk."""
_AFTER = re.compile(r"(?P<seq>-1|\d{1,9})|(?P<tokens>\d{1,9})\.(?P<chars>\d{1,10})")


def _chars(chunk: TokenChunk) -> int:
    return chunk.chars or 0


def cursor(chunk: TokenChunk) -> str:
    """Where the stream stands after ``chunk`` as :class:`ReplyStream` sends it (its ``chars`` always set):
    ``<tokens>.<chars>``, what a client resumes after (``After.parse``)."""
    return f"{chunk.offset + len(chunk.token_ids)}.{(chunk.chars or 0) + len(chunk.text)}"


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
    (sampling is seeded, so the re-run reproduces them): chunks are cut by token offset and text position,
    and every chunk sent says where its text starts (``chars``), so :func:`cursor` names the position after
    it whichever run it came from.

    Text is never skipped: a chunk whose text starts past what was delivered (the chunk before it is not on
    the log: its delivery failed, or the log was read from after it) is held back until the missing text
    comes (a re-sent chunk, or a re-run's), or at the end from the terminal event's text, which is the whole
    completion. Passing it on made the client's text a hole short of the request's (a CI run: a resumed
    stream without its first word).
    """

    HELD = 1024
    """Chunks held behind a hole at most; past it the terminal event's text fills in for the rest."""

    def __init__(
        self,
        gateway: ReplySource,
        request_id: str,
        model: str,
        after: After,
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
        self._skip_seq = after.seq
        self._delivered_tokens = after.tokens
        self._delivered_chars = after.chars
        self._held: list[TokenChunk] = []
        """Chunks whose text starts past what was delivered (a hole before them), until it is filled."""
        self._seq = -1
        """The highest ``seq`` delivered."""
        self._tokens: list[int] = []
        """The request's token ids from its first, as far as the chunks read have told them (delivered or
        not: a resume takes in what the client has)."""
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
            return [*self._fill(reply), reply]
        if reply.chars is not None:
            out = self._accept_chunk(reply)
            while out and self._held:  # what waited behind a hole this chunk filled
                ready = sorted((c for c in self._held if _chars(c) <= self._delivered_chars), key=_chars)
                if not ready:
                    break
                self._held = [c for c in self._held if _chars(c) > self._delivered_chars]
                out += [sent for held in ready for sent in self._accept_chunk(held)]
            return out
        end = reply.offset + len(reply.token_ids)
        self._learn(reply.offset, reply.token_ids)
        if end <= self._delivered_tokens:
            return []  # a re-run repeating tokens already delivered, or a resume's client has them
        if reply.seq <= self._skip_seq and reply.offset >= self._delivered_tokens:
            self._delivered_tokens = end  # the client already has this chunk (an older edge's resume)
            self._delivered_chars += len(reply.text)
            return []
        if reply.offset < self._delivered_tokens:
            fresh = reply.token_ids[self._delivered_tokens - reply.offset :]
            before = self._gateway.detokenize(self._model, self._tokens[: self._delivered_tokens])
            after = self._gateway.detokenize(self._model, self._tokens[:end])
            reply = msgspec.structs.replace(
                reply, offset=self._delivered_tokens, token_ids=fresh, text=after[len(before) :]
            )
        reply = msgspec.structs.replace(reply, chars=self._delivered_chars)  # where its text starts
        self._seq = max(self._seq, reply.seq)
        self._delivered_tokens = end
        self._delivered_chars += len(reply.text)  # a re-run by a worker that says ``chars`` goes on from here
        return [reply]

    def _learn(self, offset: int, token_ids: list[int]) -> None:
        """Remember the token ids a chunk tells beyond those known (to detokenise a chunk cut short)."""
        known = len(self._tokens)
        if offset <= known < offset + len(token_ids):
            self._tokens += token_ids[known - offset :]

    def _accept_chunk(self, chunk: TokenChunk) -> list[Reply]:
        """A chunk that says where its text starts (``chars``): what it adds beyond the tokens and the text
        delivered, each by its own offset. A re-run of the request (its first worker died) streams the same
        tokens and text, chunked differently: by tokens alone, a chunk whose text lagged its tokens (held
        back for a stop string's possible start, or an unfinished character) lost that text, and text
        recomputed from tokens showed what the stream holds back (an audit)."""
        assert chunk.chars is not None
        end, text_end = chunk.offset + len(chunk.token_ids), chunk.chars + len(chunk.text)
        self._learn(chunk.offset, chunk.token_ids)
        if end <= self._delivered_tokens and text_end <= self._delivered_chars:
            return []  # a re-run repeating what was delivered, or a resume's client has it
        if chunk.seq <= self._skip_seq and chunk.offset >= self._delivered_tokens:
            # the client has it (an older edge's resume, by seq)
            self._delivered_tokens, self._delivered_chars = end, text_end
            return []
        if chunk.chars > self._delivered_chars:  # the text before it is missing: wait for it
            if len(self._held) < self.HELD:
                self._held.append(chunk)
            return []
        tokens = chunk.token_ids[max(0, self._delivered_tokens - chunk.offset) :]
        text = chunk.text[max(0, self._delivered_chars - chunk.chars) :]
        if chunk.offset < self._delivered_tokens or chunk.chars < self._delivered_chars:
            # cut to what is new, and starting where the client's copy ends: a chunk with no tokens behind
            # those delivered kept its offset, and its cursor went backwards (a review)
            chunk = msgspec.structs.replace(
                chunk,
                offset=max(chunk.offset, self._delivered_tokens),
                token_ids=tokens,
                text=text,
                chars=max(chunk.chars, self._delivered_chars),
            )
        self._seq = max(self._seq, chunk.seq)
        self._delivered_tokens = max(self._delivered_tokens, end)
        self._delivered_chars = max(self._delivered_chars, text_end)
        return [chunk]

    def _fill(self, finished: RequestFinished) -> list[Reply]:
        """The text the chunks left out, from the terminal event (whose text is the whole completion): a
        chunk missing on the log, the last one included, or one held behind a hole that was never filled.
        Only for a streamed request (one not streamed has no chunks: its text is rendered from the terminal
        event, :class:`~ingest.render.SseEncoder`), and not for an older edge's resume by ``seq``, whose
        client's text position is not known."""
        self._held = []
        if not finished.stream or self._skip_seq >= 0:
            return []
        filler = filled_in(finished, After(self._delivered_tokens, self._delivered_chars), self._seq + 1)
        return [] if filler is None else [filler]


def filled_in(finished: RequestFinished, after: After, seq: int) -> TokenChunk | None:
    """The chunk of a completed request's text past ``after`` (None: nothing past it, or another end,
    which is an error the client gets instead), standing after all of its tokens: a resume after it gets
    nothing again."""
    text = finished.text
    if finished.status != "completed" or text is None or len(text) <= after.chars:
        return None
    return TokenChunk(
        tenant=finished.tenant,
        model=finished.model,
        request_id=finished.request_id,
        source=finished.source,
        seq=seq,
        offset=max(after.tokens, finished.usage.completion_tokens),
        token_ids=[],
        text=text[after.chars :],
        chars=after.chars,
    )
