"""Replies -> what the client reads: OpenAI JSON bodies, SSE events, and the edge's native frames (used by
the WebSocket and ``GET /v1/streams/{id}``).

SSE events that carry a token chunk have ``id: <request_id>:<tokens>.<chars>`` (where the stream stands after
it, :func:`ingest.reply_stream.cursor`); a client that reconnects with that as ``Last-Event-ID`` gets what came
after it. The closing events (finish reason, usage, ``[DONE]``) carry no id,
so a resume after the last chunk still ends properly.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec

from ingest import openai
from ingest.errors import IngestError, error_body, from_finished
from ingest.gateway import ReplyItem, ReplyStream
from ingest.prepare import Shape
from ingest.reply_stream import WHOLE, After, cursor, filled_in
from schemas.events import Float32Vectors, RequestFinished, TokenChunk

DONE = b"data: [DONE]\n\n"


def event_id(chunk: TokenChunk) -> str:
    """The SSE id of a token chunk's event: ``<request id>:<tokens>.<chars>``, what ``Last-Event-ID`` takes."""
    return f"{chunk.request_id}:{cursor(chunk)}"


_encode = msgspec.json.encode


def sse(data: Any, event_id: str | None = None) -> bytes:
    head = f"id: {event_id}\n".encode() if event_id is not None else b""
    return head + b"data: " + _encode(data) + b"\n\n"


def sse_error(exc: IngestError) -> bytes:
    return sse(error_body(exc)) + DONE


class SseEncoder:
    """Token chunks and the terminal event of one request as OpenAI streaming chunks."""

    def __init__(self, shape: Shape, after: After = WHOLE) -> None:
        """``after``: what the client has of the stream already (a resume)."""
        self._shape = shape
        self._after = after

    def _chunk(self, text: str | None, *, delta: dict[str, Any] | None = None, **kw: Any) -> dict[str, Any]:
        s = self._shape
        common = (s.request_id, s.model, s.created, s.fingerprint)
        if s.kind == "chat":
            return openai.chat_chunk(*common, delta=delta, with_usage=s.include_usage, **kw)
        return openai.completion_chunk(*common, text=text, with_usage=s.include_usage, **kw)

    def opening(self) -> bytes:
        """The chat stream's first chunk (the assistant role), not repeated on a resume."""
        if self._shape.kind != "chat" or self._after.resumed:
            return b""
        return sse(self._chunk("", delta={"role": "assistant", "content": ""}))

    def item(self, item: ReplyItem) -> bytes:
        if isinstance(item, TokenChunk):
            body = self._chunk(item.text, delta={"content": item.text})
            return sse(body, event_id(item))
        error = from_finished(item)
        if error is not None:
            return sse_error(error)
        out = b""
        # a request that was not streamed has no chunks, its text in the terminal event alone (a stream
        # resumed from one ended "completed" with no text, a review)
        filler = None if item.stream else filled_in(item, self._after._replace(seq=-1), 0)
        if filler is not None:
            out += self.item(filler)
        out += sse(self._chunk("", delta={}, reason=item.finish_reason))
        if self._shape.include_usage:
            out += sse(self._chunk(None, delta=None, usage=item.usage))
        return out + DONE


async def collect(stream: ReplyStream) -> tuple[str, RequestFinished]:
    """The whole text and the terminal event of a stream; raises the error a failed request stands for."""
    parts: list[str] = []
    async for item in stream:
        if isinstance(item, TokenChunk):
            parts.append(item.text)
            continue
        error = from_finished(item)
        if error is not None:
            raise error
        return (item.text if item.text is not None else "".join(parts)), item
    raise IngestError("the reply stream ended without a terminal event", code="incomplete_stream")


async def final_json(shape: Shape, text: str, finished: RequestFinished) -> bytes:
    """:func:`final_body` as JSON. Many vectors render part by part, the event loop serving other requests
    between parts (``openai.embeddings_json``); a few at once, at no cost to one client's answer."""
    vectors = finished.packed_vectors() if shape.kind == "embedding" else None
    if vectors is None or len(vectors) <= openai.EMBEDDINGS_PER_PART:
        return msgspec.json.encode(final_body(shape, text, finished))
    parts = []
    for part in openai.embeddings_json(
        shape.model, vectors, finished.usage.prompt_tokens, shape.encoding_format
    ):
        parts.append(part)
        await asyncio.sleep(0)
    return b"".join(parts)


def final_body(shape: Shape, text: str, finished: RequestFinished) -> dict[str, Any]:
    """The non-streamed OpenAI response for a finished request."""
    if shape.kind == "embedding":
        vectors = finished.packed_vectors() or Float32Vectors(dim=1, data=b"")
        return openai.embeddings(shape.model, vectors, finished.usage.prompt_tokens, shape.encoding_format)
    common = (shape.request_id, shape.model, shape.created, shape.fingerprint, text, finished.finish_reason)
    if shape.kind == "chat":
        return openai.chat_completion(*common, finished.usage)
    return openai.completion(*common, finished.usage)


async def native_json(item: ReplyItem, shape: Shape | None, client_id: str | int) -> bytes:
    """:func:`native` with the client's ``id``, as JSON. A ``done`` frame's many vectors render part by
    part, as :func:`final_json`'s do: a WebSocket's whole embeddings result in one go held the edge's loop
    ~100 ms for 2,048 vectors, every other client waiting (a review)."""
    vectors = item.packed_vectors() if isinstance(item, RequestFinished) else None
    if (
        not isinstance(item, RequestFinished)
        or vectors is None
        or len(vectors) <= openai.EMBEDDINGS_PER_PART
        or from_finished(item) is not None
    ):
        return msgspec.json.encode({**native(item, shape), "id": client_id})
    bare = msgspec.structs.replace(item, embeddings=None, embeddings_f32=None)
    head = msgspec.json.encode({**native(bare, shape), "id": client_id})
    parts = [head[:-1], b',"result":']
    encoding_format = shape.encoding_format if shape is not None else "float"
    for part in openai.embeddings_json(item.model, vectors, item.usage.prompt_tokens, encoding_format):
        parts.append(part)
        await asyncio.sleep(0)
    parts.append(b"}")
    return b"".join(parts)


def native(item: ReplyItem, shape: Shape | None = None) -> dict[str, Any]:
    """The edge's own frame for a reply: ``token``, ``done`` or ``error`` (without the client's id)."""
    if isinstance(item, TokenChunk):
        return {
            "type": "token",
            "request_id": item.request_id,
            "seq": item.seq,
            "cursor": cursor(item),
            "offset": item.offset,
            "text": item.text,
            "token_ids": item.token_ids,
        }
    error = from_finished(item)
    if error is not None:
        return {"type": "error", "request_id": item.request_id, **error_body(error)}
    frame: dict[str, Any] = {
        "type": "done",
        "request_id": item.request_id,
        "status": item.status,
        "finish_reason": item.finish_reason,
        "usage": openai.usage_body(item.usage),
    }
    if item.text is not None and not item.stream:  # no token carried it (a request not streamed)
        frame["text"] = item.text
    vectors = item.packed_vectors()
    if vectors is not None:
        frame["result"] = openai.embeddings(
            item.model,
            vectors,
            item.usage.prompt_tokens,
            shape.encoding_format if shape is not None else "float",
        )
    return frame
