"""``ingest/reply_stream.py``: a request's replies delivered exactly once when a worker died mid-stream and
another re-ran the request, chunked differently."""

from __future__ import annotations

from typing import Any

from ingest.reply_stream import Reply, ReplyStream
from schemas.events import RequestFinished, TokenChunk, Usage

RID = "0190a6e4-0000-7000-8000-000000000000"


class _Source:
    def read_log(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("not read from the log here")

    def detokenize(self, model: str, token_ids: list[int]) -> str:
        return "".join(f"<{t}>" for t in token_ids)  # what a chunk's tokens decode to, unlike its text

    def forget(self, request_id: str, stream: ReplyStream) -> None:
        pass


def chunk(seq: int, offset: int, tokens: list[int], text: str, chars: int | None) -> TokenChunk:
    return TokenChunk(
        tenant="acme", model="m", request_id=RID, source="w", seq=seq, offset=offset, token_ids=tokens,
        text=text, chars=chars,
    )  # fmt: skip


def delivered(replies: list[Reply]) -> tuple[str, list[int]]:
    stream = ReplyStream(_Source(), RID, "m", None, 64)
    out = [r for reply in replies for r in stream._accept(reply)]
    chunks = [r for r in out if isinstance(r, TokenChunk)]
    return "".join(c.text for c in chunks), [t for c in chunks for t in c.token_ids]


FINISHED = RequestFinished(
    tenant="acme", model="m", request_id=RID, source="w", status="completed", finish_reason="stop",
    usage=Usage(prompt_tokens=1, completion_tokens=5, total_tokens=6),
)  # fmt: skip


def test_a_re_run_chunked_otherwise_adds_exactly_what_was_not_delivered() -> None:
    """Found by an audit: a re-run's chunks were cut by tokens alone and their text recomputed from the
    tokens: a chunk whose text lagged its tokens (held back as the possible start of a stop string) was
    dropped with its text, and recomputed text showed what the stream holds back. By each offset now."""
    first = [
        chunk(0, 0, [1], "The", 0),
        chunk(1, 1, [2, 3], " ", 3),  # "lo" of tokens 2-3 held back: "lock" may be a stop string's start
    ]  # the worker died here
    rerun = [
        chunk(0, 0, [1, 2], "The ", 0),
        chunk(1, 2, [3], "", 4),
        chunk(2, 3, [4], "lock", 4),  # its tokens end past those delivered; its text starts where it stopped
        chunk(3, 4, [5], " keeper", 8),
    ]
    text, tokens = delivered([*first, *rerun, FINISHED])
    assert (text, tokens) == ("The lock keeper", [1, 2, 3, 4, 5])
    lagging = [chunk(0, 0, [1, 2, 3], "The ", 0)]  # all three tokens, "lo" held back
    text, tokens = delivered(
        [*lagging, chunk(0, 0, [1, 2], "The lo", 0), chunk(1, 2, [3], "ck", 6), FINISHED]
    )
    assert (text, tokens) == ("The lock", [1, 2, 3])  # "lo" came with no new token; not lost


def test_a_re_run_by_a_newer_worker_goes_on_from_an_older_ones_chunks() -> None:
    """Found by a review: chunks without ``chars`` (a worker from before it, in a rolling upgrade) counted no
    text delivered, so a newer worker's re-run repeated the whole prefix ("The loThe lock keeper")."""
    older = chunk(0, 0, [1, 2], "The lo", None)
    rerun = [chunk(0, 0, [1, 2, 3], "The lock", 0), chunk(1, 3, [4], " keeper", 8)]
    text, tokens = delivered([older, *rerun, FINISHED])
    assert (text, tokens) == ("The lock keeper", [1, 2, 3, 4])


def test_chunks_of_a_worker_that_says_no_text_offset_are_cut_by_tokens() -> None:
    text, tokens = delivered([chunk(0, 0, [1, 2], "ab", None), chunk(0, 0, [1, 2, 3], "abc", None), FINISHED])
    assert tokens == [1, 2, 3]
    assert text == "ab<3>"  # the fresh token's text, decoded at the edge
