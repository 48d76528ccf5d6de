from __future__ import annotations

import random

import pytest

from gpu_workers.batching import BatcherConfig, DynamicBatcher, EmbedItem


def item(rid: str, n_tokens: int = 10, *, deadline: float | None = None, payload: int = 0) -> EmbedItem[int]:
    return EmbedItem(request_id=rid, n_tokens=n_tokens, arrival=0.0, payload=payload, deadline=deadline)


def batcher(
    max_batch_size: int = 4,
    max_wait_s: float = 0.01,
    max_batch_tokens: int = 10_000,
    max_queued: int = 100,
    buckets: tuple[int, ...] = (16, 32, 64, 128, 256, 512),
) -> DynamicBatcher[int]:
    return DynamicBatcher(
        BatcherConfig(
            max_batch_size=max_batch_size,
            max_wait_s=max_wait_s,
            max_batch_tokens=max_batch_tokens,
            max_queued=max_queued,
            buckets=buckets,
        )
    )


def rids(batch: list[EmbedItem[int]] | None) -> list[str]:
    assert batch is not None
    return [it.request_id for it in batch]


@pytest.mark.parametrize(
    ("n_tokens", "bucket"),
    [(0, 0), (1, 0), (16, 0), (17, 1), (64, 2), (65, 3), (512, 5), (513, 6), (9999, 6)],
)
def test_bucket_is_first_boundary_at_least_the_length(n_tokens: int, bucket: int) -> None:
    assert batcher().bucket_of(n_tokens) == bucket


def test_waits_for_max_wait_then_cuts_a_partial_batch() -> None:
    b = batcher(max_wait_s=0.01)
    assert b.time_until_ready(0.0) is None
    assert b.add(item("a"), 1.0)
    assert b.add(item("b"), 1.004)
    assert b.next_batch(1.005) is None
    assert b.time_until_ready(1.005) == pytest.approx(0.005)
    assert rids(b.next_batch(1.01)) == ["a", "b"]
    assert len(b) == 0
    assert b.next_batch(2.0) is None


def test_a_full_bucket_is_ready_at_once() -> None:
    b = batcher(max_batch_size=3)
    for rid in "abcd":
        b.add(item(rid), 0.0)
    assert b.time_until_ready(0.0) == 0.0
    assert rids(b.next_batch(0.0)) == ["a", "b", "c"]
    assert b.next_batch(0.0) is None  # "d" waits for its own max_wait
    assert rids(b.next_batch(0.01)) == ["d"]


def test_token_budget_counts_padding_and_makes_the_bucket_full() -> None:
    b = batcher(max_batch_size=10, max_batch_tokens=250)
    b.add(item("a", 40), 0.0)
    b.add(item("b", 60), 0.0)
    b.add(item("c", 50), 0.0)
    assert b.next_batch(0.0) is None  # 3 * 60 = 180; a fourth of up to 62 tokens could still join
    b.add(item("d", 64), 0.0)  # 4 * 64 = 256 does not fit: the batch is full
    assert rids(b.next_batch(0.0)) == ["a", "b", "c"]
    b.add(item("e", 40), 0.0)
    b.add(item("f", 40), 0.0)
    b.add(item("g", 40), 0.0)  # 64 + 40 + 40 + 40 padded to 64: 4 * 64 = 256 > 250, no fourth fits
    assert rids(b.next_batch(0.0)) == ["d", "e", "f"]


def test_an_item_over_the_budget_runs_alone() -> None:
    b = batcher(max_batch_tokens=100)
    b.add(item("huge", 500), 0.0)
    b.add(item("next", 300), 0.0)
    assert rids(b.next_batch(0.0)) == ["huge"]
    assert rids(b.next_batch(0.0)) == ["next"]


def test_lengths_are_batched_apart_and_the_oldest_ready_bucket_goes_first() -> None:
    b = batcher(max_batch_size=8)
    b.add(item("long-1", 200), 0.0)
    b.add(item("short-1", 5), 0.001)
    b.add(item("long-2", 180), 0.002)
    b.add(item("short-2", 12), 0.003)
    assert rids(b.next_batch(0.02)) == ["long-1", "long-2"]
    assert rids(b.next_batch(0.02)) == ["short-1", "short-2"]


def test_a_request_with_nothing_run_yet_goes_before_the_rest_of_a_large_one() -> None:
    """Found by an audit (2026-12-01): a one-word embedding of one tenant waited 29.6 s while another
    tenant's 100 inputs of ~500 tokens ran, batch after batch, because the oldest item always went first.
    Once one batch of the large request has run, a request with none run goes next; then the large one
    again, oldest first."""
    b = batcher(max_batch_size=8, max_wait_s=0.0)
    b.add_all([item("large", 500, payload=i) for i in range(24)], 0.0)
    b.add(item("small", 2), 0.5)
    assert rids(b.next_batch(1.0)) == ["large"] * 8  # the oldest, nothing of either run yet
    assert rids(b.next_batch(1.0)) == ["small"]
    assert rids(b.next_batch(1.0)) == ["large"] * 8
    b.add(item("later", 3), 1.5)
    b.add(item("second-large", 500), 1.5)
    assert rids(b.next_batch(2.0)) == ["later"]  # none run, and the oldest of those with none run
    assert rids(b.next_batch(2.0)) == ["large"] * 8  # in its bucket, oldest first: before second-large
    assert rids(b.next_batch(2.0)) == ["second-large"]
    assert b.next_batch(2.0) is None
    assert (b._waiting, b._served) == ({}, {})


def test_expired_items_are_set_aside_never_batched() -> None:
    b = batcher(max_batch_size=2)
    b.add(item("dead", deadline=1.0), 0.0)
    b.add(item("live", deadline=5.0), 0.0)
    b.add(item("none"), 0.0)
    assert b.time_until_ready(0.5) == 0.0  # full already
    assert rids(b.next_batch(1.0)) == ["live", "none"]  # a deadline equal to now has passed
    assert b.time_until_ready(1.0) == 0.0  # the set-aside item waits for take_expired
    assert rids(b.take_expired(1.0)) == ["dead"]
    assert b.take_expired(1.0) == []
    assert b.time_until_ready(1.0) is None


def test_time_until_ready_wakes_for_a_deadline_before_max_wait() -> None:
    b = batcher(max_wait_s=1.0)
    b.add(item("a", deadline=0.25), 0.0)
    assert b.time_until_ready(0.0) == pytest.approx(0.25)
    assert rids(b.take_expired(0.25)) == ["a"]


def test_add_refuses_when_max_queued_items_wait() -> None:
    b = batcher(max_queued=2, max_batch_size=1)
    assert b.add(item("a"), 0.0)
    assert b.add(item("b"), 0.0)
    assert not b.add(item("c"), 0.0)
    b.next_batch(0.0)
    assert b.add(item("c"), 0.0)
    with pytest.raises(ValueError, match="n_tokens"):
        b.add(item("bad", -1), 0.0)


def test_cancel_removes_every_item_of_a_request_including_set_aside_ones() -> None:
    b = batcher(max_wait_s=10.0)
    b.add(item("x", 10, payload=0), 0.0)
    b.add(item("y", 10), 0.0)
    b.add(item("x", 300, payload=1), 0.0)
    b.add(item("x", 10, payload=2, deadline=0.5), 0.0)
    assert b.next_batch(0.6) is None  # sets the expired "x"/2 aside
    assert sorted(it.payload for it in b.cancel("x")) == [0, 1, 2]
    assert b.cancel("x") == []
    assert b.take_expired(0.6) == []
    assert rids(b.next_batch(10.0)) == ["y"]
    assert len(b) == 0


def test_drain_returns_queued_and_set_aside_items() -> None:
    b = batcher(max_wait_s=10.0)
    b.add(item("a", deadline=1.0), 0.0)
    b.add(item("b", 100), 0.0)
    assert b.next_batch(1.0) is None
    assert sorted(rids(b.drain())) == ["a", "b"]
    assert len(b) == 0
    assert b.time_until_ready(5.0) is None
    assert b.take_expired(5.0) == []


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_batch_size": 0}, "max_batch_size"),
        ({"max_batch_tokens": 0}, "max_batch_tokens"),
        ({"max_queued": 0}, "max_queued"),
        ({"max_wait_s": -1.0}, "max_wait_s"),
        ({"buckets": ()}, "buckets"),
        ({"buckets": (32, 16)}, "increasing"),
        ({"buckets": (0, 16)}, "positive"),
    ],
)
def test_config_validates(kwargs: dict[str, object], match: str) -> None:
    base: dict[str, object] = {"max_batch_size": 1, "max_wait_s": 0.0, "max_batch_tokens": 1}
    with pytest.raises(ValueError, match=match):
        BatcherConfig(**(base | kwargs))  # type: ignore[arg-type]


@pytest.mark.parametrize("seed", range(30))
def test_random_traffic_keeps_invariants(seed: int) -> None:
    rng = random.Random(seed)
    config = BatcherConfig(
        max_batch_size=rng.randint(1, 8),
        max_wait_s=rng.choice((0.0, 0.002, 0.01)),
        max_batch_tokens=rng.randint(64, 2048),
        buckets=(16, 32, 64, 128),
        max_queued=rng.randint(1, 30),
    )
    b: DynamicBatcher[int] = DynamicBatcher(config)
    now = 0.0
    enqueued: dict[int, float] = {}  # payload (unique per item) → add time
    accepted: dict[int, EmbedItem[int]] = {}
    seen: dict[int, str] = {}
    last_in_bucket: dict[int, int] = {}

    def out(items: list[EmbedItem[int]], how: str) -> None:
        for it in items:
            assert it.payload not in seen, "an item came out twice"
            seen[it.payload] = how

    for n in range(500):
        wait = b.time_until_ready(now)
        # the caller sleeps until the batcher is ready or the next item arrives, whichever is first
        gap = rng.expovariate(1000.0)
        if wait is not None and wait <= gap:
            now += wait
            expired = b.take_expired(now)
            for it in expired:
                assert it.deadline is not None
                assert now >= it.deadline
            out(expired, "expired")
            batch = b.next_batch(now)
            if batch is not None:
                out(batch, "batched")
                assert 1 <= len(batch) <= config.max_batch_size
                widest = max(it.n_tokens for it in batch)
                assert len(batch) == 1 or len(batch) * widest <= config.max_batch_tokens
                assert len({b.bucket_of(it.n_tokens) for it in batch}) == 1
                for it in batch:
                    assert it.deadline is None or now < it.deadline
                    # the caller woke exactly when told: nothing waited past max_wait_s
                    assert now - enqueued[it.payload] <= config.max_wait_s + 1e-9
                    bucket = b.bucket_of(it.n_tokens)
                    assert it.payload > last_in_bucket.get(bucket, -1), "FIFO within a bucket"
                    last_in_bucket[bucket] = it.payload
        else:
            now += gap
            if rng.random() < 0.1 and accepted:
                out(b.cancel(accepted[rng.choice(sorted(accepted))].request_id), "cancelled")
            new = EmbedItem(
                request_id=f"r{rng.randint(0, n)}",
                n_tokens=rng.randint(1, 200),
                arrival=now,
                payload=n,
                deadline=now + rng.uniform(0, 0.02) if rng.random() < 0.3 else None,
            )
            if b.add(new, now):
                accepted[n] = new
                enqueued[n] = now
            else:
                assert len(b) == config.max_queued
        assert len(b) <= config.max_queued
        queued = {entry.item.request_id for _, entry in b._live.values()}
        assert set(b._waiting) == queued, "counts only of requests queued"
        assert set(b._served) <= queued
        held: list[dict[str, int]] = [{} for _ in b._held]
        for index, entry in b._live.values():
            held[index][entry.item.request_id] = held[index].get(entry.item.request_id, 0) + 1
        assert b._held == held, "each bucket's requests are those of its items"
    out(b.drain(), "drained")
    assert set(seen) == set(accepted)
    assert (b._waiting, b._served) == ({}, {})


def test_deadline_bookkeeping_stays_bounded_and_correct_as_items_leave() -> None:
    b = batcher(max_batch_size=100, max_queued=200, max_wait_s=1000.0)
    for i in range(100):
        b.add(item(f"r{i}", deadline=100.0 + i, payload=i), 0.0)
    b.add(item("last", deadline=50.0, payload=100), 0.0)
    assert len(rids(b.next_batch(0.0))) == 100
    assert len(b._deadlines) <= 2 * len(b) + 64
    assert b.time_until_ready(0.0) == pytest.approx(50.0)
    assert [it.payload for it in b.take_expired(50.0)] == [100]


def test_a_requests_items_are_queued_whole_while_the_queue_is_under_its_limit() -> None:
    b = batcher(max_queued=5)
    assert b.add_all([item("a") for _ in range(3)], now=0.0)
    assert b.add_all([item("big") for _ in range(5)], now=0.0), "under the limit: whole, whatever its size"
    assert len(b) == 8
    assert b.full()
    assert not b.add_all([item("late")], now=0.0)
    assert not b.add(item("late"), now=0.0)
    checked = batcher()
    with pytest.raises(ValueError, match="n_tokens"):
        checked.add_all([item("x"), item("x", n_tokens=-1)], now=0.0)
    assert len(checked) == 0, "none of a request with a bad item was queued"


@pytest.mark.parametrize(
    ("setting", "device", "budget"),
    [(None, "cpu", 2_048), (None, "cuda", 16_384), (8_192, "cpu", 8_192), (1_000, "cuda", 1_000)],
)
def test_an_embedding_batch_s_token_budget_follows_the_device_unless_set(
    setting: int | None, device: str, budget: int
) -> None:
    """On a CPU a batch of 32 MiniLM inputs of 512 tokens ran 7.8 s (every other request waited it out),
    and long inputs gain nothing from batching there; short inputs still batch 64 at a time."""
    from gpu_workers.main import embed_batch_tokens
    from gpu_workers.settings import WorkerSettings

    assert embed_batch_tokens(WorkerSettings(worker_embed_max_batch_tokens=setting), device) == budget
    b = batcher(
        max_batch_size=64, max_wait_s=0.0, max_batch_tokens=embed_batch_tokens(WorkerSettings(), "cpu")
    )
    b.add_all([item("short", 32, payload=i) for i in range(64)], 0.0)
    assert len(rids(b.next_batch(0.0))) == 64
    b.add_all([item("long", 512, payload=i) for i in range(8)], 0.0)
    assert len(rids(b.next_batch(0.0))) == 4


def test_a_fresh_request_behind_part_of_a_large_one_in_its_bucket_is_not_held_by_other_buckets() -> None:
    """Found by a review (2026-12-03): a bucket was ranked by its first item's request only, so a one-input
    request queued behind the rest of a partly-run large one in the same length bucket waited (with it)
    while another bucket had a request with none run ready at every batch: 199 batches and counting.
    Now the bucket ranks by the least-served request it holds: the rest of the large one runs (oldest
    first within a bucket) and then the small one, before the steady one-input traffic elsewhere."""
    b = batcher(max_batch_size=8, max_wait_s=0.0)
    b.add_all([item("large", 300, payload=i) for i in range(24)], 0.0)  # bucket 512
    assert rids(b.next_batch(0.0)) == ["large"] * 8  # one batch of it has run
    b.add(item("small", 300), 0.1)  # same bucket, nothing run: behind the rest of "large"
    served: list[list[str]] = []
    for tick in range(1, 7):  # one short one-input request per batch, in another bucket
        now = 0.1 + tick * 0.01
        b.add(item(f"other-{tick}", 8), now)
        served.append(rids(b.next_batch(now)))
    assert served[:3] == [["large"] * 8, ["large"] * 8, ["small"]]
    assert served[3:] == [["other-1", "other-2", "other-3", "other-4"], ["other-5"], ["other-6"]]
    assert (b._waiting, b._served, b._held) == ({}, {}, [{} for _ in b._held])


def test_the_rest_of_a_large_request_runs_under_a_steady_load_of_fresh_ones_in_another_bucket() -> None:
    """Least attained service alone held a partly-run request for as long as another bucket had a request
    with none run ready at every batch (the same review); a ready bucket is passed over at most
    ``max_overtaken`` batches in a row."""
    b = DynamicBatcher[int](BatcherConfig(max_batch_size=8, max_wait_s=0.0, max_batch_tokens=10_000))
    assert b.config.max_overtaken == 4
    b.add_all([item("large", 300, payload=i) for i in range(24)], 0.0)
    assert rids(b.next_batch(0.0)) == ["large"] * 8
    served: list[list[str]] = []
    for tick in range(1, 16):
        now = tick * 0.01
        b.add(item(f"other-{tick}", 8), now)
        served.append(rids(b.next_batch(now)))
    larges = [n for n, batch in enumerate(served) if batch == ["large"] * 8]
    assert larges == [4, 9], served  # passed over 4 batches in a row, then it goes first
    assert served[5] == ["other-5", "other-6"]  # what waited while it ran goes next, batched together
    with pytest.raises(ValueError, match="max_overtaken"):
        BatcherConfig(max_batch_size=1, max_wait_s=0.0, max_batch_tokens=1, max_overtaken=0)
