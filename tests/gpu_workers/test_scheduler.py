from __future__ import annotations

import math
import random
from typing import Any

import pytest

from gpu_workers.scheduler import GenerationScheduler, Pending, RejectCode, SchedulerConfig, ServiceClass


def req(
    rid: str,
    prompt: int = 10,
    new: int = 10,
    *,
    deadline: float | None = None,
    priority: int = 0,
    arrival: float = 0.0,
    tenant: str = "",
    shadow: bool = False,
) -> Pending[None]:
    return Pending(
        request_id=rid,
        prompt_len=prompt,
        max_new_tokens=new,
        arrival=arrival,
        payload=None,
        deadline=deadline,
        priority=priority,
        tenant=tenant,
        shadow=shadow,
    )


def sched(
    max_running: int = 4, max_batch_tokens: int = 1000, max_waiting: int = 8, max_overtakes: int = 16
) -> GenerationScheduler[None]:
    return GenerationScheduler(
        SchedulerConfig(
            max_running=max_running,
            max_batch_tokens=max_batch_tokens,
            max_waiting=max_waiting,
            max_overtakes=max_overtakes,
        )
    )


def ids(items: list[Pending[None]]) -> list[str]:
    return [item.request_id for item in items]


def test_admits_fifo_up_to_max_running() -> None:
    s = sched(max_running=2)
    for rid in "abc":
        assert s.submit(req(rid)) == "queued"
    decision = s.schedule(0.0)
    assert ids(decision.admit) == ["a", "b"]
    assert decision.expire == []
    assert (s.running, s.waiting, s.budget_in_use) == (2, 1, 40)
    assert s.schedule(0.0).admit == []
    assert s.finish("a")
    assert ids(s.schedule(0.0).admit) == ["c"]
    assert not s.finish("a")


def test_token_budget_counts_prompt_plus_max_new_tokens() -> None:
    s = sched(max_running=10, max_batch_tokens=100)
    for rid in "abc":
        s.submit(req(rid, prompt=30, new=10))
    assert ids(s.schedule(0.0).admit) == ["a", "b"]
    assert s.budget_in_use == 80
    s.finish("b")
    assert s.budget_in_use == 40
    assert ids(s.schedule(0.0).admit) == ["c"]


def test_lower_priority_value_first_then_fifo() -> None:
    s = sched(max_running=10)
    s.submit(req("batch-1", priority=5))
    s.submit(req("online-1"))
    s.submit(req("urgent", priority=-1))
    s.submit(req("online-2"))
    s.submit(req("batch-2", priority=5))
    assert ids(s.schedule(0.0).admit) == ["urgent", "online-1", "online-2", "batch-1", "batch-2"]


@pytest.mark.parametrize(
    ("item", "code"),
    [
        (req("a"), "duplicate"),  # waiting
        (req("r"), "duplicate"),  # running
        (req("big", prompt=90, new=11), "too_large"),
        (req("neg", prompt=-1), "invalid"),
        (req("zero", new=0), "invalid"),
    ],
)
def test_check_explains_rejections(item: Pending[None], code: RejectCode) -> None:
    s = sched(max_batch_tokens=100)
    s.submit(req("r"))
    s.schedule(0.0)
    s.submit(req("a"))
    rejection = s.check(item)
    assert rejection is not None
    assert rejection.code == code
    assert rejection.message
    assert s.submit(item) == ("duplicate" if code == "duplicate" else "rejected")
    assert (s.waiting, s.running) == (1, 1)


def test_full_waiting_queue_rejects_and_exactly_fitting_item_is_accepted() -> None:
    s = sched(max_waiting=2, max_batch_tokens=100)
    assert s.submit(req("a", prompt=90, new=10)) == "queued"
    assert s.submit(req("b")) == "queued"
    rejection = s.check(req("c"))
    assert rejection is not None
    assert rejection.code == "queue_full"
    assert s.submit(req("c")) == "rejected"
    s.cancel("b")
    assert s.submit(req("c")) == "queued"


def test_cancel_from_waiting_running_or_unknown() -> None:
    s = sched(max_running=1)
    s.submit(req("run"))
    s.schedule(0.0)
    s.submit(req("wait", deadline=5.0))
    assert s.cancel("wait") == "waiting"
    assert s.cancel("run") == "running"
    assert s.cancel("run") == "unknown"
    assert (s.running, s.waiting, s.budget_in_use) == (0, 0, 0)
    decision = s.schedule(10.0)
    assert decision.admit == decision.expire == []  # a cancelled item is neither admitted nor expired


def test_withdraw_takes_only_what_waits() -> None:
    """A rebalance gives back requests that have not started; a running one stays and finishes."""
    s = sched(max_running=1)
    s.submit(req("run"))
    s.schedule(0.0)
    s.submit(req("wait", deadline=5.0))
    assert s.withdraw("run") is False
    assert s.withdraw("wait") is True
    assert s.withdraw("wait") is False
    assert s.withdraw("unknown") is False
    assert (s.running, s.waiting) == (1, 0)
    assert s.schedule(10.0).expire == []  # a withdrawn item does not expire later either


def test_expired_waiting_items_are_returned_and_never_admitted() -> None:
    s = sched()
    s.submit(req("late", deadline=1.0))
    s.submit(req("edge", deadline=2.0))
    s.submit(req("fine", deadline=3.0))
    s.submit(req("none"))
    decision = s.schedule(2.0)  # a deadline equal to now has passed
    assert ids(decision.expire) == ["late", "edge"]
    assert ids(decision.admit) == ["fine", "none"]


def test_expired_running_reports_without_freeing() -> None:
    s = sched()
    s.submit(req("a", deadline=1.0))
    s.submit(req("b", deadline=5.0))
    s.submit(req("c"))
    s.schedule(0.0)
    assert s.expired_running(0.5) == []
    assert s.expired_running(1.0) == ["a"]
    assert s.running == 3
    s.finish("a")
    assert s.expired_running(9.0) == ["b"]


def test_small_requests_overtake_a_blocked_head_at_most_max_overtakes_times() -> None:
    s = sched(max_running=100, max_batch_tokens=100, max_waiting=100, max_overtakes=3)
    s.submit(req("hold", prompt=50, new=10))
    s.schedule(0.0)
    s.submit(req("big", prompt=50, new=10))  # 60 + 60 > 100: blocked
    for i in range(5):
        s.submit(req(f"s{i}", prompt=1, new=1))
    assert ids(s.schedule(0.0).admit) == ["s0", "s1", "s2"]
    assert s.schedule(0.0).admit == []  # "big" now reserves the budget
    s.submit(req("s5", prompt=1, new=1))
    assert s.schedule(0.0).admit == []
    s.finish("hold")
    assert ids(s.schedule(0.0).admit) == ["big", "s3", "s4", "s5"]


def test_max_overtakes_zero_is_strict_order() -> None:
    s = sched(max_running=100, max_batch_tokens=100, max_overtakes=0)
    s.submit(req("hold", prompt=50, new=10))
    s.schedule(0.0)
    s.submit(req("big", prompt=50, new=10))
    s.submit(req("small", prompt=1, new=1))
    assert s.schedule(0.0).admit == []
    s.finish("hold")
    assert ids(s.schedule(0.0).admit) == ["big", "small"]


def test_drain_returns_waiting_in_order() -> None:
    s = sched(max_running=1)
    for rid, priority in (("a", 0), ("b", 1), ("c", 0)):
        s.submit(req(rid, priority=priority, deadline=9.0))
    s.schedule(0.0)
    assert ids(s.drain()) == ["c", "b"]
    assert s.waiting == 0
    assert s.schedule(10.0).expire == []
    assert s.running_ids == ["a"]


@pytest.mark.parametrize("field", ["max_running", "max_batch_tokens", "max_waiting"])
def test_config_validates(field: str) -> None:
    values: dict[str, Any] = {"max_running": 1, "max_batch_tokens": 1, "max_waiting": 1, field: 0}
    with pytest.raises(ValueError, match=field):
        SchedulerConfig(**values)
    with pytest.raises(ValueError, match="max_overtakes"):
        SchedulerConfig(max_running=1, max_batch_tokens=1, max_waiting=1, max_overtakes=-1)
    with pytest.raises(ValueError, match="max_idle_tenants"):
        SchedulerConfig(max_running=1, max_batch_tokens=1, max_waiting=1, max_idle_tenants=-1)
    with pytest.raises(ValueError, match="tenant 'a'"):
        SchedulerConfig(max_running=1, max_batch_tokens=1, max_waiting=1, weights={"a": 0.0})


@pytest.mark.parametrize("seed", range(30))
def test_random_interleavings_keep_invariants(seed: int) -> None:
    rng = random.Random(seed)
    config = SchedulerConfig(
        max_running=rng.randint(1, 6),
        max_batch_tokens=rng.randint(20, 200),
        max_waiting=rng.randint(1, 12),
        max_overtakes=rng.randint(0, 4),
    )
    s: GenerationScheduler[None] = GenerationScheduler(config)
    now = 0.0
    queued: dict[str, Pending[None]] = {}
    outcome: dict[str, str] = {}  # request id → how it left the waiting queue
    running: dict[str, Pending[None]] = {}
    unannounced = 0  # pushed out of a full queue, not yet returned in ``Decision.shed``
    for step in range(400):
        now += rng.choice((0.0, 0.01, 0.1, 0.5))
        op = rng.random()
        if op < 0.4:
            live = sorted(rid for rid in queued if outcome.get(rid, "admitted") == "admitted")
            if live and rng.random() < 0.1:  # a redelivery of a request still waiting or running
                assert s.submit(queued[rng.choice(live)]) == "duplicate"
            else:
                item = req(
                    f"r{step}",
                    prompt=rng.randint(0, config.max_batch_tokens),
                    new=rng.randint(1, 40),
                    deadline=now + rng.uniform(0, 3) if rng.random() < 0.6 else None,
                    priority=rng.randint(0, 2),
                    arrival=now,
                    tenant=rng.choice("abc"),
                    shadow=rng.random() < 0.1,
                )
                before = s.waiting
                result = s.submit(item)
                if result == "queued":
                    assert item.cost <= config.max_batch_tokens
                    queued[item.request_id] = item
                    unannounced += before + 1 - s.waiting
                else:
                    assert result == "rejected"
        elif op < 0.55 and queued:
            rid = rng.choice(sorted(queued))
            before = s.waiting
            where = s.cancel(rid)
            if rid in running:
                assert where == "running"
                del running[rid]
                outcome[rid] = "finished"
            elif rid not in outcome:
                assert where == "waiting"
                outcome[rid] = "cancelled"
                unannounced -= 1 - (before - s.waiting)  # it was shed: it will not be announced
            else:
                assert where == "unknown"
        elif op < 0.75 and running:
            for rid in running:
                s.produced(rid)
            rid = rng.choice(sorted(running))
            assert s.finish(rid)
            del running[rid]
            outcome[rid] = "finished"
        else:
            decision = s.schedule(now)
            for item in decision.shed:
                assert item.request_id not in outcome
                outcome[item.request_id] = "shed"
                unannounced -= 1
            for item in decision.expire:
                assert item.deadline is not None
                assert now >= item.deadline
                assert item.request_id not in outcome
                outcome[item.request_id] = "expired"
            for item in decision.admit:
                assert item.request_id not in outcome
                assert item.deadline is None or now < item.deadline
                outcome[item.request_id] = "admitted"
                running[item.request_id] = item
        assert s.running == len(running) <= config.max_running
        assert s.budget_in_use == sum(item.cost for item in running.values()) <= config.max_batch_tokens
        assert s.waiting == sum(1 for rid in queued if rid not in outcome) - unannounced <= config.max_waiting
        assert s.tenants() <= len(ServiceClass) * (3 + config.max_idle_tenants)
    # liveness: once running work finishes, every waiting request is admitted or expires
    for _ in range(len(queued) + 1):
        for rid in list(running):
            s.finish(rid)
            del running[rid]
        decision = s.schedule(now)
        for item in decision.admit:
            running[item.request_id] = item
            outcome[item.request_id] = "admitted"
        for item in decision.expire:
            outcome[item.request_id] = "expired"
        for item in decision.shed:
            outcome[item.request_id] = "shed"
    assert s.waiting == 0
    assert set(outcome) == set(queued)


def test_a_big_request_is_not_starved_by_a_stream_of_small_ones() -> None:
    s = sched(max_running=50, max_batch_tokens=100, max_waiting=100, max_overtakes=5)
    rng = random.Random(7)
    s.submit(req("big", prompt=80, new=20))  # needs the whole budget
    running: list[str] = []
    for step in range(200):
        s.submit(req(f"s{step}", prompt=1, new=rng.randint(1, 5)))
        s.submit(req(f"t{step}", prompt=1, new=rng.randint(1, 5)))
        admitted = ids(s.schedule(float(step)).admit)
        if "big" in admitted:
            assert step < 10
            return
        running.extend(admitted)
        for rid in running[:2]:  # small requests finish steadily
            s.finish(rid)
        del running[:2]
    pytest.fail("the big request was never admitted")


def test_deadline_bookkeeping_stays_bounded_and_correct_as_items_leave() -> None:
    s = sched(max_running=90, max_batch_tokens=10_000, max_waiting=200)
    for i in range(100):
        s.submit(req(f"r{i}", prompt=1, new=1, deadline=100.0 + i))
    assert len(s.schedule(0.0).admit) == 90
    for i in range(90, 95):
        s.cancel(f"r{i}")
    assert len(s._deadlines) <= 2 * s.waiting + 64
    assert s.schedule(50.0).expire == []
    assert ids(s.schedule(1000.0).expire) == [f"r{i}" for i in range(95, 100)]


class _Walking(GenerationScheduler[None]):
    """The scheduler without its shortcut: it walks the waiting queue whenever a slot is free."""

    def _least_cost(self) -> float:
        return -math.inf


@pytest.mark.parametrize("seed", range(30))
def test_skipping_a_walk_that_cannot_admit_changes_no_decision(seed: int) -> None:
    """``schedule`` stops when nothing waiting fits the budget left; each decision (admissions in order,
    expiries, sheds) is what walking the whole queue gives, under random submits, finishes and cancels."""
    rng = random.Random(seed)
    config = SchedulerConfig(
        max_running=rng.randint(2, 12),
        max_batch_tokens=rng.randint(40, 300),
        max_waiting=rng.randint(4, 40),
        max_overtakes=rng.randint(0, 4),
    )
    fast: GenerationScheduler[None] = GenerationScheduler(config)
    walking = _Walking(config)
    running: list[str] = []
    now = 0.0
    admitted = 0
    for step in range(500):
        now += rng.choice((0.0, 0.01, 0.2))
        op = rng.random()
        if op < 0.45:
            item = req(
                f"r{step}",
                prompt=rng.randint(0, config.max_batch_tokens // 2),
                new=rng.randint(1, config.max_batch_tokens // 2),
                deadline=now + rng.uniform(0, 2) if rng.random() < 0.3 else None,
                priority=rng.randint(0, 1),
                tenant=rng.choice("abcd"),
            )
            assert fast.submit(item) == walking.submit(item)
        elif op < 0.6 and running:
            rid = running.pop(rng.randrange(len(running)))
            assert fast.finish(rid) == walking.finish(rid)
        elif op < 0.65:
            rid = f"r{rng.randrange(step + 1)}"
            assert fast.cancel(rid) == walking.cancel(rid)
            if rid in running:
                running.remove(rid)
        else:
            ours, theirs = fast.schedule(now), walking.schedule(now)
            assert (ids(ours.admit), ids(ours.expire), ids(ours.shed)) == (
                ids(theirs.admit),
                ids(theirs.expire),
                ids(theirs.shed),
            )
            running += ids(ours.admit)
            admitted += len(ours.admit)
        assert (fast.waiting, fast.running, fast.budget_in_use) == (
            walking.waiting,
            walking.running,
            walking.budget_in_use,
        )
        assert len(fast._costs) <= 2 * fast.waiting + 65  # stale entries are compacted away
    assert admitted > 20


def test_a_full_budget_does_not_walk_the_waiting_queue() -> None:
    """With the budget taken and a long queue of requests that cannot fit, a decode step's ``schedule``
    looks at none of them (it walked all 1,000 before: ~55 us a step at 256 rows, ~0.2 us a token)."""
    looked = [0]
    s: GenerationScheduler[None] = GenerationScheduler(
        SchedulerConfig(max_running=2000, max_batch_tokens=100, max_waiting=2000)
    )
    walking = _Walking(SchedulerConfig(max_running=2000, max_batch_tokens=100, max_waiting=2000))
    for scheduler in (s, walking):
        scheduler.submit(req("head", prompt=50, new=40))
        assert ids(scheduler.schedule(0.0).admit) == ["head"]
        for i in range(1000):
            scheduler.submit(req(f"w{i}", prompt=10, new=5, tenant=f"t{i % 7}"))
    original = Pending.cost

    def counting(item: Pending[None]) -> int:
        looked[0] += 1
        return int(original.fget(item))  # type: ignore[attr-defined]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Pending, "cost", property(counting))
        assert s.schedule(1.0).admit == []
        assert looked[0] == 0
        assert walking.schedule(1.0).admit == []
        assert looked[0] >= 1000, "the walk the shortcut saves"
    s.finish("head")
    assert len(s.schedule(2.0).admit) == 6, "budget freed: the queue moves again"
