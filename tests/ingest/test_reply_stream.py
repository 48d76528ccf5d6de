"""``ingest/reply_stream.py``: a request's replies delivered exactly once when a worker died mid-stream and
another re-ran the request, chunked differently."""

from __future__ import annotations

from typing import Any

import msgspec

from ingest.prepare import Shape
from ingest.render import SseEncoder
from ingest.reply_stream import WHOLE, After, Reply, ReplyStream, cursor
from schemas.events import RequestFinished, TokenChunk, Usage
from tests.ingest.conftest import parse_sse

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
    stream = ReplyStream(_Source(), RID, "m", WHOLE, 64)
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


def test_a_resume_after_any_chunk_of_a_re_run_stream_gets_exactly_the_rest() -> None:
    """Found by an audit (a worker killed mid-stream under ``sluice up``): the SSE id was the chunk's
    ``seq``, which the re-run numbered from 0 again (ids ``:9, :10, :11, :12, :11, :12, :13``), and a
    resume after ``:12`` skipped 40 characters or repeated " keeper moves in the", depending on which
    ``:12`` the client had. The id is now where the stream stands after the chunk: unique, increasing,
    and a resume after any of them gets the rest exactly, whichever run its chunks come from."""
    first = [
        chunk(0, 0, [1], "The", 0),
        chunk(1, 1, [2, 3], " ", 3),  # "lo" held back
        chunk(2, 3, [4], "lock", 4),
    ]  # the worker died here
    rerun = [
        chunk(0, 0, [1, 2], "The ", 0),
        chunk(1, 2, [3, 4, 5], "lock kee", 4),
        chunk(2, 5, [6], "per", 12),
        chunk(3, 6, [7], " moves", 15),
    ]
    log: list[Reply] = [*first, *rerun, FINISHED]
    stream = ReplyStream(_Source(), RID, "m", WHOLE, 64)
    sent = [r for reply in log for r in stream._accept(reply) if isinstance(r, TokenChunk)]
    ids = [cursor(c) for c in sent]
    assert ids == ["1.3", "3.4", "4.8", "5.12", "6.15", "7.21"]
    whole = "".join(c.text for c in sent)
    assert whole == "The lock keeper moves"
    for n, at in enumerate(ids):
        after = After.parse(at)
        assert after is not None
        resumed = ReplyStream(_Source(), RID, "m", after, 64)
        rest = [r for reply in log for r in resumed._accept(reply) if isinstance(r, TokenChunk)]
        had = "".join(c.text for c in sent[: n + 1])
        assert had + "".join(c.text for c in rest) == whole, at
        tokens = [t for c in sent[: n + 1] for t in c.token_ids] + [t for c in rest for t in c.token_ids]
        assert tokens == [1, 2, 3, 4, 5, 6, 7], at
        assert [cursor(c) for c in rest] == ids[n + 1 :], "the same ids on every resume"


def test_after_reads_a_position_or_an_older_edges_seq() -> None:
    assert After.parse("12.40") == After(12, 40)
    assert After.parse("7") == After(seq=7)
    assert After.parse("-1") == WHOLE
    assert not WHOLE.resumed
    assert After(0, 0, 3).resumed
    assert After(1, 1).resumed
    for bad in ("", "1.", ".2", "1.2.3", "-2", "x", "1e3", "1234567890.1"):
        assert After.parse(bad) is None, bad


def test_a_chunk_behind_the_delivered_tokens_says_where_the_stream_stands() -> None:
    """Found by a review: a re-run's token-less tail chunk (an early end) behind the tokens delivered went
    out with its own offset, so its cursor went backwards and a resume after it sent a token again."""
    log: list[Reply] = [
        chunk(0, 0, [1, 2, 3], "ab", 0),  # the first run: "c" of token 3 held back; then it died
        chunk(0, 0, [1, 2], "ab", 0),  # the re-run, ending early
        chunk(1, 2, [], "c", 2),
        FINISHED,
    ]
    stream = ReplyStream(_Source(), RID, "m", WHOLE, 64)
    sent = [r for reply in log for r in stream._accept(reply) if isinstance(r, TokenChunk)]
    assert [cursor(c) for c in sent] == ["3.2", "3.3"]
    resumed = ReplyStream(_Source(), RID, "m", After(3, 3), 64)
    assert [r for reply in log for r in resumed._accept(reply) if isinstance(r, TokenChunk)] == []


def _finished(text: str, tokens: int, status: str = "completed", *, stream: bool = True) -> RequestFinished:
    return RequestFinished(
        tenant="acme", model="m", request_id=RID, source="w", status=status, finish_reason="length",  # type: ignore[arg-type]
        usage=Usage(prompt_tokens=1, completion_tokens=tokens, total_tokens=tokens + 1), text=text,
        stream=stream,
    )  # fmt: skip


def test_a_chunk_missing_on_the_log_is_not_a_hole_in_the_clients_text() -> None:
    """Found by CI (the scale-out run: kills of an edge, a worker and a broker under load): a resumed
    stream's text lacked its first word, which the request's terminal event had. A chunk whose text starts
    past what was delivered was passed on as if it followed; now it waits for the missing text: a chunk
    that brings it (re-sent late, or a re-run's), else the terminal event's text at the end."""
    first, second, third = (
        chunk(0, 0, [1], "If", 0),
        chunk(1, 1, [2, 3], " the value", 2),
        chunk(2, 3, [4], ",", 12),
    )
    done = _finished("If the value,", 4)
    # the first chunk never reached the log: the rest waits, and the end brings the missing text
    stream = ReplyStream(_Source(), RID, "m", WHOLE, 64)
    sent = [r for reply in (second, third, done) for r in stream._accept(reply)]
    chunks = [r for r in sent if isinstance(r, TokenChunk)]
    assert "".join(c.text for c in chunks) == "If the value,"
    assert sent[-1] is done
    assert [cursor(c) for c in chunks] == ["4.13"]  # one chunk, standing after every token
    # a resume after it gets nothing again, before the end
    resumed = ReplyStream(_Source(), RID, "m", After.parse("4.13") or WHOLE, 64)
    again = [r for reply in (first, second, third, done) for r in resumed._accept(reply)]
    assert again == [done]

    # the missing chunk comes late (re-sent): what waited behind it follows it, in order, at once
    stream = ReplyStream(_Source(), RID, "m", WHOLE, 64)
    assert stream._accept(third) == []
    assert stream._accept(second) == []
    late = stream._accept(first)
    assert [c.text for c in late if isinstance(c, TokenChunk)] == ["If", " the value", ","]
    assert [cursor(c) for c in late if isinstance(c, TokenChunk)] == ["1.2", "3.12", "4.13"]
    assert stream._accept(done) == [done]  # nothing left to fill

    # the last chunk missing: the end brings its text
    stream = ReplyStream(_Source(), RID, "m", WHOLE, 64)
    sent = [r for reply in (first, second, done) for r in stream._accept(reply)]
    assert "".join(r.text for r in sent if isinstance(r, TokenChunk)) == "If the value,"


def test_only_a_completed_request_has_its_missing_text_filled_in() -> None:
    """A failed end is an error for the client, not more text; a resume by an older edge's ``seq`` does not
    say how much text the client has, so nothing is filled in for it."""
    second = chunk(1, 1, [2, 3], " the value", 2)
    failed = _finished("If the value", 3, status="failed")
    stream = ReplyStream(_Source(), RID, "m", WHOLE, 64)
    assert [r for reply in (second, failed) for r in stream._accept(reply)] == [failed]
    done = _finished("If the value, said", 5)
    older = ReplyStream(_Source(), RID, "m", After(seq=5), 64)
    assert [r for reply in (second, done) for r in older._accept(reply)] == [done]


def test_a_stream_resumed_from_a_request_that_was_not_streamed_gets_its_text() -> None:
    """A request not streamed has no chunks on the log, only its terminal event's text: the stream hands
    that event on alone (the native ``done`` frame carries the text), and a resume of it as an SSE stream
    (``Last-Event-ID: <id>:0.0``, or past part of the text) renders the text as a chunk before the end (a
    review: it ended "completed" with no text)."""
    done = _finished(" t0 t1 t2", 3, stream=False)
    assert ReplyStream(_Source(), RID, "m", WHOLE, 64)._accept(done) == [done]
    shape = Shape(kind="completion", model="m", request_id=RID, fingerprint="")
    for after, text in ((WHOLE, " t0 t1 t2"), (After(1, 3), " t1 t2"), (After(3, 9), None)):
        events = parse_sse(SseEncoder(shape, after).item(done).decode())
        chunks = [msgspec.json.decode(data) for _, data in events if data != "[DONE]"]
        assert [c["choices"][0]["text"] for c in chunks] == ([text] if text else []) + [""]
        if text:
            assert events[0][0] == f"{RID}:3.9"  # a resume after it gets nothing again
