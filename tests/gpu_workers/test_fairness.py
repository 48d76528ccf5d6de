"""Fairness of the generation scheduler between tenants: VTC within a class, strict classes, weights, the
lift of a returning tenant and who a full queue refuses. Pure and fast: a fake decode loop, one output token
per running sequence per step, time counted in steps."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field

import pytest

from gpu_workers.scheduler import GenerationScheduler, Pending, SchedulerConfig, ServiceClass
from gpu_workers.settings import WorkerSettings
from schemas.settings import SettingsError, load_settings


def req(
    rid: str, tenant: str, prompt: int = 10, new: int = 10, *, priority: int = 0, shadow: bool = False
) -> Pending[None]:
    return Pending(
        request_id=rid,
        prompt_len=prompt,
        max_new_tokens=new,
        arrival=0.0,
        payload=None,
        priority=priority,
        tenant=tenant,
        shadow=shadow,
    )


@dataclass
class Loop:
    """The worker's tick without a model: admit, then one token for every running sequence."""

    scheduler: GenerationScheduler[None]
    step: int = 0
    left: dict[str, int] = field(default_factory=dict)  # running request → tokens still to produce
    submitted: dict[str, int] = field(default_factory=dict)  # request → step it was submitted
    waited: dict[str, int] = field(default_factory=dict)  # request → steps it waited for a slot
    served: Counter[str] = field(default_factory=Counter)  # tenant → input + 2 * output tokens
    tenant_of: dict[str, str] = field(default_factory=dict)
    admitted: list[str] = field(default_factory=list)
    busy_steps: int = 0  # steps with every slot in use

    def submit(self, item: Pending[None]) -> str:
        self.submitted[item.request_id] = self.step
        self.tenant_of[item.request_id] = item.tenant
        return self.scheduler.submit(item)

    def tick(self) -> None:
        for item in self.scheduler.schedule(float(self.step)).admit:
            self.left[item.request_id] = item.max_new_tokens
            self.waited[item.request_id] = self.step - self.submitted[item.request_id]
            self.served[item.tenant] += item.prompt_len
            self.admitted.append(item.request_id)
        if self.scheduler.running == self.scheduler.config.max_running:
            self.busy_steps += 1
        for rid in list(self.left):
            self.scheduler.produced(rid)
            self.served[self.tenant_of[rid]] += 2
            self.left[rid] -= 1
            if self.left[rid] == 0:
                del self.left[rid]
                self.scheduler.finish(rid)
        self.step += 1


def loop(max_running: int = 4, max_waiting: int = 256, **weights: float) -> Loop:
    config = SchedulerConfig(
        max_running=max_running, max_batch_tokens=100_000, max_waiting=max_waiting, weights=weights
    )
    return Loop(GenerationScheduler(config))


def test_a_light_tenant_is_not_stuck_behind_a_flood() -> None:
    rng = random.Random(11)
    longest = 250
    sim = loop(max_running=4)
    for i in range(50):  # tenant a floods: 50 long generations (think ignore_eos), ~10,000 steps of work
        assert sim.submit(req(f"a{i}", "a", prompt=50, new=rng.randint(150, longest))) == "queued"
    light = []
    for step in range(1200):
        if step % 5 == 1:  # tenant b: a short request every 5 steps
            light.append(f"b{step}")
            assert sim.submit(req(light[-1], "b", prompt=10, new=4)) == "queued"
        sim.tick()
    waits = {rid: sim.waited.get(rid, sim.step - sim.submitted[rid]) for rid in light}
    # Admission is not preemptive, so b may wait for a slot to free: never longer than the longest flood
    # request runs, all through the run. In a FIFO b waits for all 50 flood requests (~2,500 steps), the
    # later ones longer every time.
    assert max(waits.values()) <= longest
    assert all(rid in sim.waited for rid in light if sim.submitted[rid] < sim.step - longest)
    assert sum(waits.values()) / len(waits) < longest / 2
    assert sim.busy_steps == sim.step  # work-conserving: no slot idles while the flood waits
    assert sum(rid.startswith("a") for rid in sim.admitted) >= 12  # and the flood is served meanwhile


def test_weights_share_service_under_saturation() -> None:
    sim = loop(max_running=6, max_waiting=1000, a=2.0)
    for i in range(400):
        sim.submit(req(f"a{i}", "a", prompt=10, new=20))
        sim.submit(req(f"b{i}", "b", prompt=10, new=20))
    for _ in range(100):
        sim.tick()
    before = Counter(sim.served)
    for _ in range(1000):
        sim.tick()
    a, b = sim.served["a"] - before["a"], sim.served["b"] - before["b"]
    assert 1.9 <= a / b <= 2.1


def test_a_returning_tenant_is_lifted_to_the_active_minimum() -> None:
    sim = loop(max_running=4, max_waiting=1000)
    sim.submit(req("b-early", "b"))
    for _ in range(20):
        sim.tick()
    for i in range(200):  # b is idle while a uses every slot
        sim.submit(req(f"a{i}", "a", prompt=10, new=40))
    for _ in range(500):
        sim.tick()
    a_counter = sim.scheduler.counter("a")
    assert a_counter is not None
    assert a_counter > 3000
    for i in range(200):  # b comes back with as much work
        sim.submit(req(f"b{i}", "b", prompt=10, new=40))
    assert sim.scheduler.counter("b") == a_counter  # no credit for its idle time
    before = Counter(sim.served)
    for _ in range(400):
        sim.tick()
    a, b = sim.served["a"] - before["a"], sim.served["b"] - before["b"]
    # shared from the start: without the lift b would hold every slot for ~700 steps (a's lead / 4 slots)
    assert 0.8 <= a / b <= 1.25


def test_an_idle_tenant_keeps_what_it_owes_and_counters_stay_bounded() -> None:
    config = SchedulerConfig(max_running=2, max_batch_tokens=10_000, max_waiting=8, max_idle_tenants=16)
    s: GenerationScheduler[None] = GenerationScheduler(config)
    s.submit(req("a-long", "a", prompt=0, new=5000))
    s.schedule(0.0)
    for i in range(1000):  # a thousand tenants pass by, each served far more than the floor (a) grows
        s.submit(req(f"t{i}", f"t{i}", prompt=100, new=1))
        (admitted,) = s.schedule(float(i)).admit
        s.produced("a-long")
        s.produced(admitted.request_id)
        s.finish(admitted.request_id)
        assert s.tenants() <= 1 + config.max_idle_tenants
    remembered = s.counter("t999")
    floor = s.counter("a")
    assert remembered is not None
    assert floor is not None
    assert remembered > floor
    assert s.counter("t0") is None  # the oldest idle counters are forgotten
    s.submit(req("t999-again", "t999"))
    assert s.counter("t999") == remembered  # back with its debt, not lifted past it or reset to the floor


def test_output_tokens_are_charged_as_they_are_produced() -> None:
    config = SchedulerConfig(max_running=2, max_batch_tokens=10_000, max_waiting=8, weights={"a": 2.0})
    s: GenerationScheduler[None] = GenerationScheduler(config)
    s.submit(req("long", "a", prompt=10, new=1000))
    s.schedule(0.0)
    assert s.counter("a") == 5.0  # the prompt at admission, divided by the weight
    for _ in range(100):
        s.produced("long")
        s.produced("unknown")  # ignored: only running requests are charged
    assert s.counter("a") == 5.0 + 100 * 2 / 2.0
    s.submit(req("a2", "a"))
    s.submit(req("b1", "b"))  # lifted to a's counter, and a keeps paying while its request runs
    s.produced("long")
    assert [item.request_id for item in s.schedule(0.0).admit] == ["b1"]


def test_classes_are_strictly_ordered_and_fairness_applies_within_one() -> None:
    s: GenerationScheduler[None] = GenerationScheduler(
        SchedulerConfig(max_running=1, max_batch_tokens=10_000, max_waiting=100)
    )
    s.submit(req("hold", "x", new=1000))
    s.schedule(0.0)
    s.submit(req("shadow", "z", shadow=True, priority=1000))
    s.submit(req("batch", "y", priority=5))
    s.submit(req("x-again", "x"))
    s.submit(req("w", "w"))  # lifted to x's counter
    for _ in range(10):
        s.produced("hold")  # x keeps paying for its running request: w is now behind x
    s.finish("hold")
    order = []
    while s.waiting:
        (item,) = s.schedule(0.0).admit
        order.append(item.request_id)
        s.finish(item.request_id)
    assert order == ["w", "x-again", "batch", "shadow"]  # the batch and shadow tenants have never been served


def test_service_class_mapping() -> None:
    assert req("r", "t", priority=-1).service_class is ServiceClass.INTERACTIVE
    assert req("r", "t").service_class is ServiceClass.INTERACTIVE
    assert req("r", "t", priority=1).service_class is ServiceClass.BATCH
    assert req("r", "t", priority=1000, shadow=True).service_class is ServiceClass.SHADOW
    assert req("r", "t", shadow=True).service_class is ServiceClass.SHADOW


def test_a_full_queue_refuses_the_flooding_tenant() -> None:
    s: GenerationScheduler[None] = GenerationScheduler(
        SchedulerConfig(max_running=1, max_batch_tokens=10_000, max_waiting=10)
    )
    s.submit(req("run", "c"))
    s.schedule(0.0)  # the only slot is taken: everything below waits
    for i in range(10):
        assert s.submit(req(f"a{i}", "a")) == "queued"
    refusal = s.check(req("a10", "a"))
    assert refusal is not None
    assert refusal.code == "queue_full"
    for i in range(5):  # b is not refused: a's newest requests make room, until b holds as many as a
        assert s.check(req(f"b{i}", "b")) is None
        assert s.submit(req(f"b{i}", "b")) == "queued"
    assert s.submit(req("b5", "b")) == "rejected"
    assert s.submit(req("a10", "a")) == "rejected"
    assert s.submit(req("z0", "z", shadow=True)) == "rejected"  # a lower class never pushes out a higher one
    assert s.submit(req("a5", "a")) == "duplicate"  # shed but not yet told: still in flight
    decision = s.schedule(0.0)
    assert [item.request_id for item in decision.shed] == ["a9", "a8", "a7", "a6", "a5"]
    assert decision.admit == []
    assert s.waiting == 10


def test_a_full_queue_sheds_the_lowest_class_first() -> None:
    s: GenerationScheduler[None] = GenerationScheduler(
        SchedulerConfig(max_running=1, max_batch_tokens=10_000, max_waiting=3)
    )
    s.submit(req("run", "c"))
    s.schedule(0.0)
    s.submit(req("shadow", "a", shadow=True))
    s.submit(req("batch", "b", priority=1))
    s.submit(req("batch2", "b", priority=1))
    assert s.submit(req("i1", "a")) == "queued"  # the shadow copy goes first, though b holds more
    assert s.submit(req("i2", "a")) == "queued"  # then b's newest batch request
    assert s.cancel("batch2") == "waiting"  # shed, not yet told: it can still be cancelled
    assert [item.request_id for item in s.schedule(0.0).shed] == ["shadow"]
    assert s.withdraw("batch")
    assert [item.request_id for item in s.drain()] == ["i1", "i2"]


def test_tenant_weights_setting() -> None:
    env = {"SLUICE_WORKER_TENANT_WEIGHTS": "acme=2, bigco=0.5"}
    assert load_settings(WorkerSettings, env).tenant_weights() == {"acme": 2.0, "bigco": 0.5}
    assert load_settings(WorkerSettings, {}).tenant_weights() == {}
    for entry in ("acme", "acme=0", "=2", "acme=x", "acme=-1", "acme=nan", "acme=inf"):
        with pytest.raises(SettingsError, match="SLUICE_WORKER_TENANT_WEIGHTS"):
            load_settings(WorkerSettings, {"SLUICE_WORKER_TENANT_WEIGHTS": entry})
