"""When to publish a streamed completion's tokens: coalesce them into chunks.

Per request, tokens are buffered and flushed as one chunk when ``max_tokens`` have accumulated, when
``max_delay_s`` has passed since the first unflushed token, or when the request finishes. Fewer, larger
chunks cost Kafka and the edge less; the delay bounds what the client waits for a token.

A pure, synchronous object: the worker passes the monotonic ``now`` in, calls ``due(now)`` once per decode
step (or when ``next_deadline()`` comes), and publishes each ``Flush`` as a ``TokenChunk``. Per request,
``seq`` counts 0, 1, 2, … and ``offset`` is the number of tokens flushed before, so chunks are contiguous:
no token is lost or duplicated.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True, kw_only=True)
class Flush:
    request_id: str
    seq: int
    """Chunk number within the request, from 0."""
    offset: int
    """Index of this chunk's first token within the completion."""
    token_ids: tuple[int, ...]
    text: str


@dataclass(frozen=True, slots=True, kw_only=True)
class FlushPolicy:
    max_tokens: int = 16
    max_delay_s: float = 0.05
    first_token_alone: bool = False
    """Publish a request's first token as a chunk of its own at once: time to first token is what a
    streaming user feels most; coalescing starts from the second token."""

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.max_delay_s < 0:
            raise ValueError(f"max_delay_s must be >= 0, got {self.max_delay_s}")


@dataclass(slots=True)
class _Stream:
    seq: int = 0
    offset: int = 0
    due_at: float = 0.0  # first buffered token's time + max_delay_s (only while tokens are buffered)
    token_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)


class ChunkCoalescer:
    def __init__(self, policy: FlushPolicy) -> None:
        self.policy = policy
        self._streams: dict[str, _Stream] = {}

    def __len__(self) -> int:
        """Requests being tracked (with or without buffered tokens)."""
        return len(self._streams)

    def buffered(self, request_id: str) -> int:
        stream = self._streams.get(request_id)
        return 0 if stream is None else len(stream.token_ids)

    def push(self, request_id: str, token_id: int, text: str, now: float) -> Flush | None:
        """Buffer one generated token; return a chunk if this token completes one."""
        stream = self._streams.get(request_id)
        if stream is None:
            stream = self._streams[request_id] = _Stream()
        tokens = stream.token_ids
        first = False
        if not tokens:
            stream.due_at = now + self.policy.max_delay_s
            first = stream.seq == 0 and stream.offset == 0
        tokens.append(token_id)
        if text:  # a runner that decodes a chunk's text when it is flushed passes none
            stream.text.append(text)
        if (
            len(tokens) >= self.policy.max_tokens
            or now >= stream.due_at
            or (first and self.policy.first_token_alone)
        ):
            return self._flush(request_id, stream)
        return None

    def due(self, now: float) -> list[Flush]:
        """Chunks whose first token has waited ``max_delay_s``."""
        return [
            self._flush(rid, stream)
            for rid, stream in self._streams.items()
            if stream.token_ids and now >= stream.due_at
        ]

    def next_deadline(self) -> float | None:
        """The earliest ``now`` at which ``due`` returns something (None: nothing buffered)."""
        return min((stream.due_at for stream in self._streams.values() if stream.token_ids), default=None)

    def finish(self, request_id: str, now: float) -> Flush | None:
        """Flush what remains of a finished request and forget it (None: nothing was buffered)."""
        del now  # part of the uniform signature; a finish flushes regardless of time
        stream = self._streams.pop(request_id, None)
        if stream is None or not stream.token_ids:
            return None
        return self._flush(request_id, stream)

    def drop(self, request_id: str) -> int:
        """Forget a request without flushing (cancelled); returns how many buffered tokens were dropped."""
        stream = self._streams.pop(request_id, None)
        return 0 if stream is None else len(stream.token_ids)

    @staticmethod
    def _flush(request_id: str, stream: _Stream) -> Flush:
        chunk = Flush(
            request_id=request_id,
            seq=stream.seq,
            offset=stream.offset,
            token_ids=tuple(stream.token_ids),
            text="".join(stream.text),
        )
        stream.seq += 1
        stream.offset += len(stream.token_ids)
        stream.token_ids.clear()
        stream.text.clear()
        return chunk
