from __future__ import annotations

import random

import pytest

from gpu_workers.flush import ChunkCoalescer, Flush, FlushPolicy


def coalescer(max_tokens: int = 3, max_delay_s: float = 0.05) -> ChunkCoalescer:
    return ChunkCoalescer(FlushPolicy(max_tokens=max_tokens, max_delay_s=max_delay_s))


def test_flushes_every_max_tokens_with_seq_and_offset() -> None:
    c = coalescer(max_tokens=2)
    assert c.push("r", 10, "a", 0.0) is None
    assert c.push("r", 11, "b", 0.0) == Flush(request_id="r", seq=0, offset=0, token_ids=(10, 11), text="ab")
    assert c.push("r", 12, "c", 0.0) is None
    assert c.push("r", 13, "d", 0.0) == Flush(request_id="r", seq=1, offset=2, token_ids=(12, 13), text="cd")
    assert c.buffered("r") == 0


def test_flushes_after_max_delay_since_the_first_unflushed_token() -> None:
    c = coalescer(max_tokens=100, max_delay_s=0.05)
    c.push("r", 1, "x", 1.00)
    c.push("r", 2, "y", 1.03)
    assert c.next_deadline() == pytest.approx(1.05)
    assert c.due(1.049) == []
    assert c.due(1.05) == [Flush(request_id="r", seq=0, offset=0, token_ids=(1, 2), text="xy")]
    assert c.next_deadline() is None
    c.push("r", 3, "z", 1.20)  # the clock restarts at the next token
    assert c.next_deadline() == pytest.approx(1.25)


def test_a_late_token_flushes_on_push() -> None:
    c = coalescer(max_tokens=100, max_delay_s=0.05)
    c.push("r", 1, "x", 0.0)
    assert c.push("r", 2, "y", 0.06) == Flush(request_id="r", seq=0, offset=0, token_ids=(1, 2), text="xy")


def test_zero_delay_flushes_every_token() -> None:
    c = coalescer(max_tokens=100, max_delay_s=0.0)
    assert c.push("r", 1, "x", 0.0) == Flush(request_id="r", seq=0, offset=0, token_ids=(1,), text="x")
    assert c.push("r", 2, "y", 0.0) == Flush(request_id="r", seq=1, offset=1, token_ids=(2,), text="y")


def test_finish_flushes_the_rest_and_forgets() -> None:
    c = coalescer(max_tokens=2)
    c.push("r", 1, "a", 0.0)
    c.push("r", 2, "b", 0.0)
    c.push("r", 3, "c", 0.0)
    assert c.finish("r", 0.0) == Flush(request_id="r", seq=1, offset=2, token_ids=(3,), text="c")
    assert len(c) == 0
    assert c.finish("r", 0.0) is None


def test_finish_with_nothing_buffered_returns_none() -> None:
    c = coalescer(max_tokens=1)
    c.push("r", 1, "a", 0.0)
    assert c.finish("r", 0.0) is None
    assert c.finish("never", 0.0) is None


def test_drop_forgets_without_flushing() -> None:
    c = coalescer()
    c.push("r", 1, "a", 0.0)
    c.push("s", 2, "b", 0.0)
    assert c.drop("r") == 1
    assert c.drop("r") == 0
    assert [f.request_id for f in c.due(1.0)] == ["s"]


def test_requests_are_independent() -> None:
    c = coalescer(max_tokens=2)
    c.push("a", 1, "1", 0.0)
    c.push("b", 2, "2", 0.0)
    flushed = c.push("a", 3, "3", 0.0)
    assert flushed == Flush(request_id="a", seq=0, offset=0, token_ids=(1, 3), text="13")
    assert c.buffered("b") == 1


@pytest.mark.parametrize(("max_tokens", "max_delay_s"), [(0, 0.1), (1, -0.1)])
def test_policy_validates(max_tokens: int, max_delay_s: float) -> None:
    with pytest.raises(ValueError, match="max_"):
        FlushPolicy(max_tokens=max_tokens, max_delay_s=max_delay_s)


@pytest.mark.parametrize("seed", range(40))
def test_random_interleavings_never_lose_or_duplicate_tokens(seed: int) -> None:
    rng = random.Random(seed)
    policy = FlushPolicy(max_tokens=rng.randint(1, 8), max_delay_s=rng.choice((0.0, 0.01, 0.05)))
    c = ChunkCoalescer(policy)
    now = 0.0
    generated: dict[str, list[int]] = {}
    chunks: dict[str, list[Flush]] = {}
    open_ids: list[str] = []
    dropped: set[str] = set()

    def record(flush: Flush | None) -> None:
        if flush is not None:
            assert flush.token_ids
            assert flush.text == "".join(f"<{t}>" for t in flush.token_ids)
            chunks.setdefault(flush.request_id, []).append(flush)

    for step in range(600):
        now += rng.choice((0.0, 0.001, 0.01, 0.03))
        op = rng.random()
        if op < 0.05 or not open_ids:
            rid = f"r{step}"
            open_ids.append(rid)
            generated[rid] = []
        elif op < 0.75:
            rid = rng.choice(open_ids)
            token = rng.randint(0, 50_000)
            generated[rid].append(token)
            before = c.buffered(rid)
            record(c.push(rid, token, f"<{token}>", now))
            assert c.buffered(rid) in (before + 1, 0)
            assert c.buffered(rid) < policy.max_tokens
        elif op < 0.9:
            deadline = c.next_deadline()
            flushes = c.due(now)
            assert bool(flushes) == (deadline is not None and now >= deadline)
            for flush in flushes:
                record(flush)
            after = c.next_deadline()
            assert after is None or after > now  # nothing overdue is left behind
        elif op < 0.97:
            rid = open_ids.pop(rng.randrange(len(open_ids)))
            record(c.finish(rid, now))
            assert c.buffered(rid) == 0
        else:
            rid = open_ids.pop(rng.randrange(len(open_ids)))
            c.drop(rid)
            dropped.add(rid)
    for rid in list(open_ids):
        record(c.finish(rid, now))
    assert len(c) == 0
    for rid, tokens in generated.items():
        got = chunks.get(rid, [])
        assert [f.seq for f in got] == list(range(len(got)))
        offset = 0
        for flush in got:
            assert flush.offset == offset
            offset += len(flush.token_ids)
        flat = [t for f in got for t in f.token_ids]
        if rid in dropped:
            assert flat == tokens[: len(flat)]  # a prefix: the rest was cancelled, never sent
        else:
            assert flat == tokens


def test_first_token_alone_flushes_the_first_token_at_once() -> None:
    coalescer = ChunkCoalescer(FlushPolicy(max_tokens=4, max_delay_s=1.0, first_token_alone=True))
    first = coalescer.push("r", 7, "a", now=0.0)
    assert first is not None
    assert (first.seq, first.offset, first.token_ids) == (0, 0, (7,))
    assert coalescer.push("r", 8, "b", now=0.0) is None  # coalescing from the second token on
    assert coalescer.push("r", 9, "c", now=0.0) is None
    assert coalescer.push("r", 10, "d", now=0.0) is None
    second = coalescer.push("r", 11, "e", now=0.0)
    assert second is not None
    assert (second.seq, second.offset, second.token_ids) == (1, 1, (8, 9, 10, 11))
