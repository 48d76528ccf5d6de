"""The streams app without a broker: its consumer group and topics, the batch hand-over (offsets are
committed only after the batch is written), and the timers."""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, NamedTuple, cast

import pytest
from clickhouse_connect.driver.client import Client
from confluent_kafka import Message

from bus.consumer import ConsumerThread
from bus.errors import BusError
from bus.producer import EventProducer, Position
from bus.producer import Record as Produced
from schemas.codec import decode, encode
from schemas.events import DeadLetter, Timings, UsageRecorded
from schemas.ids import uuid7
from schemas.settings import KafkaConnection, PlatformSettings
from streams.app import LATEST_ACCEPTED, Prepared, StreamsApp, consumed, every
from streams.facts import accepted_at, usage_record
from streams.pricing import PriceTable
from streams.settings import StreamsSettings
from streams.sink import Batch, Consumed
from tests.streams.test_audit import T0, finished


class Record:
    """The parts of a confluent-kafka ``Message`` the sink reads."""

    def __init__(self, topic: str, partition: int, offset: int, value: bytes | None) -> None:
        self._where = (topic, partition, offset)
        self._value = value

    def topic(self) -> str:
        return self._where[0]

    def partition(self) -> int:
        return self._where[1]

    def offset(self) -> int:
        return self._where[2]

    def value(self) -> bytes | None:
        return self._value


def messages(*where: tuple[str, int, int]) -> list[Message]:
    return cast(list[Message], [Record(t, p, o, f"{t}{p}{o}".encode()) for t, p, o in where])


def test_a_batch_commits_the_offset_after_each_partitions_last_record() -> None:
    batch = messages(("r", 0, 5), ("r", 1, 9), ("r", 0, 6), ("c", 0, 0), ("r", 0, 7))
    records, offsets = consumed(batch)
    assert records == [
        Consumed("r", 0, 5, b"r05"),
        Consumed("r", 1, 9, b"r19"),
        Consumed("r", 0, 6, b"r06"),
        Consumed("c", 0, 0, b"c00"),
        Consumed("r", 0, 7, b"r07"),
    ]
    assert offsets == {("r", 0): 8, ("r", 1): 10, ("c", 0): 1}
    tombstone, _ = consumed(cast(list[Message], [Record("r", 0, 1, None)]))
    assert tombstone == [Consumed("r", 0, 1, b"")]  # undecodable: dead-lettered by the sink


def make_app(tmp_path: Path, warehouse: Any = None, producer: Any = None) -> StreamsApp:
    """The app without a broker: the warehouse (None: never used unless the app runs) and the producer
    (a real one that reaches nothing, unless given) as the test says."""
    return StreamsApp(
        PlatformSettings(kafka_bootstrap="127.0.0.1:1", topic_prefix="p", data_dir=str(tmp_path)),
        StreamsSettings(),
        cast(Client, warehouse),
        PriceTable(),
        producer if producer is not None else EventProducer(KafkaConnection("127.0.0.1:1"), "test"),
        request_topics=["p.requests.demo-gpt"],
    )


def test_the_sink_reads_what_the_warehouse_keeps_as_the_streams_group(tmp_path: Path) -> None:
    app = make_app(tmp_path)
    assert app.group == "p-streams"  # the group the Faust app of earlier versions committed under
    assert app.topics == [
        r"^p\.requests\..+",  # every request topic, those of models added later too
        "p.results",
        "p.cancels",
        "p.control",
        "p.batches",
    ]  # not p.usage: the worker writes it (its records are derived from p.results), and reading its own
    # records back doubled the sink's load and stored each request's numbers twice
    assert not app.assigned


class Sink:
    def __init__(self) -> None:
        self.commits: list[dict[tuple[str, int], int]] = []
        self.owned: set[tuple[str, int]] = set()
        self.lags: dict[tuple[str, int], int] = {}
        """The consumer lag librdkafka's statistics gave per partition (none: not known yet)."""

    def lag(self) -> dict[tuple[str, int], int]:
        return {tp: lag for tp, lag in self.lags.items() if tp in self.owned}

    def commit(self, offsets: dict[tuple[str, int], int]) -> None:
        self.commits.append(offsets)

    def assignment(self) -> set[tuple[str, int]]:
        return set(self.owned)


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """An event loop on its own thread, as the sink's polling thread sees the app's loop."""
    running = asyncio.new_event_loop()
    thread = threading.Thread(target=running.run_forever, daemon=True)
    thread.start()
    yield running
    running.call_soon_threadsafe(running.stop)
    thread.join()
    running.close()


def test_offsets_are_committed_only_once_the_batch_is_written(
    tmp_path: Path, loop: asyncio.AbstractEventLoop
) -> None:
    """The next batch is prepared while the previous one is inserted; each batch's offsets are committed
    after its own insert, in order; a failed insert fails the app and commits nothing more."""
    app = make_app(tmp_path)
    sink = Sink()
    app._loop, app._sink = loop, cast(ConsumerThread, sink)
    steps: list[str] = []
    inserting: dict[int, asyncio.Event] = {}

    async def prepare(records: Sequence[Consumed]) -> Prepared:
        steps.append(f"prepare {records[0].offset}")
        return Prepared(Batch(raw=[[record.offset] for record in records]), [], 0)

    async def store(prepared: Prepared) -> Batch:
        first = prepared.batch.raw[0][0]
        steps.append(f"insert {first}")
        inserting[first] = asyncio.Event()
        await inserting[first].wait()
        if first == 9:
            raise RuntimeError("the warehouse is gone")
        steps.append(f"written {first}")
        return prepared.batch

    app._prepare = prepare  # type: ignore[method-assign]
    app._store = store  # type: ignore[method-assign]

    def released(first: int) -> None:
        _until(lambda: first in inserting)
        asyncio.run_coroutine_threadsafe(_set(inserting, first), loop).result()

    polling = Polling(app)  # the consumer thread: one batch after another
    polling.put(messages(("r", 0, 3), ("r", 1, 0)))
    polling.put(messages(("r", 0, 4)))
    _until(lambda: len(steps) == 3)
    assert steps == ["prepare 3", "insert 3", "prepare 4"]  # 4 is prepared while 3 is being inserted
    assert sink.commits == []  # nothing is written yet
    released(3)
    _until(lambda: len(sink.commits) == 1)
    assert sink.commits == [{("r", 0): 4, ("r", 1): 1}]
    released(4)
    _until(lambda: len(sink.commits) == 2)
    assert sink.commits[1] == {("r", 0): 5}
    assert steps == ["prepare 3", "insert 3", "prepare 4", "written 3", "insert 4", "written 4"]

    polling.put(messages(("r", 0, 9)))
    released(9)
    _until(lambda: app.failure is not None)
    assert isinstance(app.failure, RuntimeError)
    polling.put(messages(("r", 0, 10)))
    assert isinstance(polling.died(), RuntimeError)  # the consumer thread dies of it too
    assert len(sink.commits) == 2  # the failed batch is not committed, nor anything after it
    assert "prepare 10" in steps
    assert "insert 10" not in steps


def test_the_chain_heads_are_read_again_before_the_first_batch_after_gaining_results_or_control(
    tmp_path: Path, loop: asyncio.AbstractEventLoop
) -> None:
    """Another streams worker may have extended the chains of a partition while it owned it: the heads
    this worker read before are stale once it is given the partition (again)."""
    app = make_app(tmp_path)
    sink = Sink()
    app._loop, app._sink = loop, cast(ConsumerThread, sink)
    steps: list[str] = []

    async def reanchor() -> None:
        steps.append("read heads")

    async def reseed() -> None:
        steps.append("read control")

    async def prepare(records: Sequence[Consumed]) -> Prepared:
        steps.append(f"{records[0].topic}:{records[0].offset}")
        return Prepared(Batch(), [], 0)

    async def store(prepared: Prepared) -> Batch:
        return prepared.batch

    app.reanchor = reanchor  # type: ignore[method-assign]
    app.reseed = reseed  # type: ignore[method-assign]
    app._prepare = prepare  # type: ignore[method-assign]
    app._store = store  # type: ignore[method-assign]
    sink.owned = {("p.requests.demo-gpt", 0), ("p.usage", 0)}
    app._consume(messages(("p.usage", 0, 0)))  # no chain is fed from these
    sink.owned |= {("p.results", 0), ("p.control", 0)}
    app._consume(messages(("p.usage", 0, 1)))  # read before any batch once they are owned
    app._consume(messages(("p.results", 0, 0)))
    sink.owned.discard(("p.results", 0))
    app._revoked([("p.results", 0)], True)
    app._consume(messages(("p.control", 0, 0)))
    sink.owned.add(("p.results", 0))  # back, after another worker had it
    app._consume(messages(("p.results", 0, 5)))
    assert steps == [
        "p.usage:0",
        "read control",  # given the control partition: what its previous owner read is read again
        "read heads",
        "p.usage:1",
        "p.results:0",
        "p.control:0",
        "read heads",
        "p.results:5",
    ]


def test_a_revoke_waits_for_the_insert_in_flight_so_its_offsets_go_out_with_the_hand_over(
    tmp_path: Path, loop: asyncio.AbstractEventLoop
) -> None:
    app = make_app(tmp_path)
    sink = Sink()
    app._loop, app._sink = loop, cast(ConsumerThread, sink)
    release = threading.Event()

    async def prepare(records: Sequence[Consumed]) -> Prepared:
        return Prepared(Batch(), [], 0)

    async def store(prepared: Prepared) -> Batch:
        await asyncio.to_thread(release.wait)
        return prepared.batch

    app._prepare = prepare  # type: ignore[method-assign]
    app._store = store  # type: ignore[method-assign]
    app._consume(messages(("r", 0, 3)))  # prepared: its insert goes on after the hand-over to the loop
    app._revoked([("r", 0)], True)  # lost: nothing may be committed, so nothing is waited for
    assert sink.commits == []

    seen: list[list[dict[tuple[str, int], int]]] = []

    def hand_over() -> None:
        app._revoked([("r", 0)], False)
        seen.append(list(sink.commits))

    revoke = threading.Thread(target=hand_over)
    revoke.start()
    revoke.join(0.2)
    assert revoke.is_alive()  # waiting for the insert
    release.set()
    revoke.join(10)
    assert seen == [[{("r", 0): 4}]]  # queued before the revoke returned: its flush sends it


class Polling:
    """Calls the app's ``_consume`` with each batch put, in order, on one thread, until one raises."""

    def __init__(self, app: StreamsApp) -> None:
        self._app = app
        self._batches: queue.SimpleQueue[list[Message]] = queue.SimpleQueue()
        self._error: list[BaseException] = []
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def put(self, batch: list[Message]) -> None:
        self._batches.put(batch)

    def _run(self) -> None:
        while True:
            try:
                self._app._consume(self._batches.get())
            except Exception as exc:
                self._error.append(exc)
                return

    def died(self) -> BaseException:
        self._thread.join(10)
        assert self._error, "the polling thread is still running"
        return self._error[0]


async def _set(events: dict[int, asyncio.Event], key: int) -> None:
    events[key].set()


def _until(condition: Callable[[], bool], timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("the condition was never met")
        time.sleep(0.001)


def test_the_sink_refuses_a_batch_before_the_app_started(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="before the app started"):
        make_app(tmp_path)._consume(messages(("r", 0, 0)))


async def test_a_timer_runs_its_work_after_each_interval_until_cancelled() -> None:
    runs: list[float] = []
    third = asyncio.Event()

    async def work() -> None:
        runs.append(asyncio.get_running_loop().time())
        if len(runs) == 3:
            third.set()

    began = asyncio.get_running_loop().time()
    task = asyncio.create_task(every(0.01, work))
    await asyncio.wait_for(third.wait(), 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert runs[0] - began >= 0.009  # the first run waits one interval (asyncio may wake a hair early)
    assert all(later - earlier >= 0.009 for earlier, later in itertools.pairwise(runs))


async def test_stopping_an_app_that_never_started_leaves_the_working_directory_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    app = make_app(tmp_path / "data")
    await app.stop()
    await app.stop()  # safe more than once
    assert list(cwd.iterdir()) == []


class Producer:
    """Records what the app produces; every record is durable at once, but on ``refused`` topics."""

    def __init__(self, refused: Sequence[str] = ()) -> None:
        self.records: list[tuple[str, object]] = []
        self.refused = set(refused)

    def produce(self, topic: str, event: object, **kwargs: object) -> None:
        self.records.append((topic, event))

    async def publish(self, topic: str, event: object, **kwargs: object) -> Position:
        if topic in self.refused:
            raise BusError(f"delivery to {topic} failed: broker down")
        self.records.append((topic, event))
        return (0, len(self.records) - 1)

    async def publish_many(self, topic: str, records: Sequence[Produced]) -> list[Position]:
        self.records += [(topic, value) for value, _, _ in records]
        return [(0, len(self.records) - len(records) + i) for i in range(len(records))]


class Answer(NamedTuple):
    """The parts of a clickhouse-connect ``QueryResult`` the app reads."""

    column_names: tuple[str, ...]
    result_rows: list[tuple[Any, ...]]


class Warehouse:
    """Counts the rows inserted per table; answers when the latest request it holds a fact of was accepted
    (``accepted_ms``, 0: none), and no other query."""

    def __init__(self, accepted_ms: int = 0) -> None:
        self.rows: dict[str, int] = {}
        self.accepted_ms = accepted_ms

    def query(self, sql: str) -> Answer:
        if sql != LATEST_ACCEPTED:
            raise NotImplementedError(f"the test's warehouse answers no {sql!r}")
        return Answer(("accepted_ms",), [(self.accepted_ms,)])

    def raw_insert(
        self, table: str, column_names: Sequence[str], insert_block: bytes, **kwargs: object
    ) -> None:
        self.rows[table] = self.rows.get(table, 0) + len(insert_block.splitlines())


@pytest.mark.parametrize(
    "bad",
    [b"{not json", encode(finished(tenant=""))],
    ids=["undecodable", "a terminal event without a tenant"],
)
async def test_an_undecodable_record_is_dead_lettered_and_the_rest_of_its_batch_written(
    tmp_path: Path, bad: bytes
) -> None:
    """A record that decodes but no row can hold (a terminal event with an empty tenant: no audit chain is
    its) raised building its audit entry: nothing of the batch was written or committed, and the sink
    stopped at that offset on every restart."""
    producer, warehouse = Producer(), Warehouse()
    app = make_app(tmp_path, warehouse, producer)
    app._heads = {}  # anchored: no chain yet
    good = finished()
    batch = await app.write([Consumed("p.results", 0, 7, bad), Consumed("p.results", 0, 8, encode(good))])
    assert [record.offset for record, _ in batch.undecodable] == [7]
    letters = [event for topic, event in producer.records if topic == "p.deadletter"]
    assert len(letters) == 1
    assert isinstance(letters[0], DeadLetter)
    assert (letters[0].source_topic, letters[0].offset) == ("p.results", 7)
    assert [topic for topic, _ in producer.records if topic != "p.deadletter"] == ["p.usage", "p.audit"]
    assert warehouse.rows == {"events_raw": 2, "request_facts": 1, "audit_log": 1, "drift_features": 1}


async def test_each_result_is_billed_once_on_the_usage_topic_before_its_audit_entry(tmp_path: Path) -> None:
    """Found by review: the docs promised usage and cost records on ``usage`` and nothing wrote one (a
    billing consumer waited forever). A result that is not a shadow copy gets one usage record, priced as
    its fact row, published before its audit entry; a redelivered result none (its entry is stored)."""
    producer, warehouse = Producer(), Warehouse()
    app = make_app(tmp_path, warehouse, producer)
    app._heads = {}  # anchored: no chain yet
    paid = finished(request_id=uuid7(), timings=Timings(started=T0, finished=T0 + timedelta(seconds=2)))
    failed = finished(request_id=uuid7(), status="failed", finish_reason=None)
    shadow = finished(request_id=uuid7(), shadow_of=paid.request_id)
    records = [Consumed("p.results", 0, n, encode(e)) for n, e in enumerate((paid, failed, shadow))]
    await app.write(records)
    topics = [topic for topic, _ in producer.records]
    assert topics == ["p.usage", "p.usage", "p.audit", "p.audit", "p.audit"]  # the ledger's first
    bills = [cast(UsageRecorded, decode(cast(bytes, value))) for _, value in producer.records[:2]]
    assert [b.request_id for b in bills] == [paid.request_id, failed.request_id]
    bill = bills[0]
    table = app.prices.at(accepted_at(paid))
    assert bill.cost_nanos == table.cost_nanos("demo-gpt", 3, 6, 2000) > 0
    assert bill.cost_micros == bill.cost_nanos // 1000
    assert (bill.prompt_tokens, bill.completion_tokens, bill.worker_seconds) == (3, 6, 2.0)
    assert (bill.status, bill.model_version, bill.price_version) == ("completed", "3f2a9c", table.version)
    assert (bills[1].cost_nanos, bills[1].cost_micros, bills[1].status) == (0, 0, "failed")
    await app.write(records)  # delivered again: billed already
    assert [topic for topic, _ in producer.records] == topics
    assert usage_record(paid, app.prices, source="again") is not None
    assert cast(UsageRecorded, usage_record(paid, app.prices, source="again")).id == bill.id


async def test_an_operators_rebaseline_on_the_control_topic_moves_the_drift_baseline(tmp_path: Path) -> None:
    """``sluice drift rebaseline`` publishes a ``DriftRebaselined`` on the control topic; the sink follows
    it into the drift monitor's baseline (the latest of a version's holds) and chains it in the audit."""
    from datetime import UTC, datetime, timedelta

    from schemas.events import AuditEntry, DriftRebaselined
    from streams.drift import Baseline

    producer, warehouse = Producer(), Warehouse()
    app = make_app(tmp_path, warehouse, producer)
    app._heads = {}
    at = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)

    def rebaseline(minutes: int, reason: str, topic: str = "p.control") -> Consumed:
        event = DriftRebaselined(
            time=at + timedelta(minutes=minutes), tenant="", model="demo-gpt", source="sluice/cli",
            version="v1", reason=reason, actor="operator",
        )  # fmt: skip
        return Consumed(topic, 0, minutes, encode(event))

    assert app._baseline("demo-gpt", "v1") is None
    await app.write(
        [rebaseline(0, "first"), rebaseline(5, "second"), rebaseline(9, "not control", "p.usage")]
    )
    baseline = app._baseline("demo-gpt", "v1")
    assert baseline is not None
    assert baseline.since == at + timedelta(minutes=5)
    assert "by operator: second" in baseline.why
    assert app._baseline("demo-gpt", "v2") is None
    entries = [decode(cast(bytes, value)) for topic, value in producer.records if topic == "p.audit"]
    assert [(e.tenant, e.action, e.details["reason"]) for e in entries if isinstance(e, AuditEntry)] == [
        ("admin:rebaseline:demo-gpt:v1", "drift.rebaseline", "first"),
        ("admin:rebaseline:demo-gpt:v1", "drift.rebaseline", "second"),
    ], "both rebaselines read from the control topic are audited, not the stray one"
    # a promotion after the rebaseline moves the baseline again; one before it does not
    later = Baseline.promoted("v1", at + timedelta(minutes=7))
    assert Baseline.latest(baseline, later) == later
    assert Baseline.latest(Baseline.promoted("v1", at), baseline) == baseline


async def test_a_promotion_stays_the_versions_drift_baseline_through_the_next_rollout(tmp_path: Path) -> None:
    """Found by a review: the promotion was the baseline only while the model's latest deployment was the
    promotion; the next rollout started (or rolled back) before the version's first window after it was
    judged, and its references from its own canary (a share of the tenants) were kept for good."""
    from datetime import timedelta

    from streams.rollout import advance, roll_back, start_rollout
    from tests.streams.test_rollout import GATES, T0

    producer, warehouse = Producer(), Warehouse()
    app = make_app(tmp_path, warehouse, producer)
    app._heads = {}
    model = "demo-gpt"

    def rollout(stable: str, candidate: str, minutes: int) -> Any:
        return start_rollout(
            model, stable=stable, candidate=candidate, steps=[0.05, 1.0], shadow=0.0, gates=GATES,
            now=T0 + timedelta(minutes=minutes), source="sluice/cli",
        )  # fmt: skip

    v2 = rollout("v1", "v2", 0)
    canary = advance(v2, T0 + timedelta(seconds=5), "ready", [], "controller")
    promoted = advance(canary, T0 + timedelta(minutes=10), "gates passed", [], "controller")
    assert (promoted.phase, promoted.stable) == ("promoted", "v2")
    v3 = rollout("v2", "v3", 11)
    rolled_back = roll_back(v3, T0 + timedelta(minutes=12), "aborted", [], "operator")
    events = [v2, canary, promoted, v3, rolled_back]
    await app.write([Consumed("p.control", 0, i, encode(e)) for i, e in enumerate(events[:4])])
    baseline = app._baseline(model, "v2")
    assert baseline is not None
    assert baseline.since == promoted.step_started  # while v3's rollout runs
    await app.write([Consumed("p.control", 0, 4, encode(rolled_back))])
    assert app._baseline(model, "v2") == baseline  # and after it rolled back
    assert app._baseline(model, "v3") is None


async def test_a_worker_given_the_control_partition_follows_what_its_previous_owner_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by a review: in a rolling update the worker that takes the control partition over reads on from
    its previous owner's committed offset, so a rebaseline (or a deployment) that one read after this worker
    started was never this worker's. ``reseed`` reads the control topic again."""
    from datetime import UTC, datetime

    import streams.app
    from schemas.events import DriftRebaselined
    from tests.streams.test_rollout import canary

    at = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
    rebaseline = DriftRebaselined(
        time=at, tenant="", model="demo-gpt", source="sluice/cli", version="v1", reason="expected", actor="op"
    )
    deployment = canary()
    placed = [(deployment, (0, 3)), (rebaseline, (0, 7))]
    monkeypatch.setattr(streams.app, "read_placed", lambda kafka, topic, client_id: placed)
    app = make_app(tmp_path)
    assert app._baseline("demo-gpt", "v1") is None
    await app.reseed()
    baseline = app._baseline("demo-gpt", "v1")
    assert baseline is not None
    assert baseline.since == at
    assert app.rollout.deployments[deployment.model].id == deployment.id
    await app.reseed()  # again: nothing changes
    assert app._baseline("demo-gpt", "v1") == baseline


def control_log(monkeypatch: pytest.MonkeyPatch, producer: Producer | None = None) -> list[str]:
    """The control topic as a worker reads it again (``reseed``): what ``producer`` published on it so far
    (nothing without one), read at each call; the names of the readers, one a read."""
    import streams.app

    reads: list[str] = []

    def read_placed(kafka: object, topic: str, client_id: str) -> list[tuple[object, tuple[int, int]]]:
        reads.append(client_id)
        records = producer.records if producer is not None else []
        return [(event, (0, i)) for i, (where, event) in enumerate(records) if where == topic]

    monkeypatch.setattr(streams.app, "read_placed", read_placed)
    return reads


async def test_only_the_worker_reading_the_control_topic_judges_drift(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two workers' reports of one window share an id: a second judge with older promotions and rebaselines
    made one of two verdicts win at random (a review). As for rollouts, the control partition's owner
    judges, once it has read the control topic since it was given the partition."""
    reads = control_log(monkeypatch)
    app = make_app(tmp_path)
    runs: list[int] = []

    async def run_once() -> list[object]:
        runs.append(1)
        return []

    app.drift.run_once = run_once  # type: ignore[method-assign,assignment]
    sink = Sink()
    app._sink = cast(ConsumerThread, sink)
    sink.owned = {("p.results", 0)}
    await app._drift()
    assert (runs, reads) == ([], [])
    sink.owned.add(("p.control", 0))
    await app._drift()
    assert (runs, reads) == ([1], ["streams/worker-reseed"])
    await app._drift()
    assert (runs, reads) == ([1, 1], ["streams/worker-reseed"])  # read once a gain
    sink.owned.discard(("p.control", 0))
    app._revoked([("p.control", 0)], True)
    sink.owned.add(("p.control", 0))  # back, after another worker had it
    await app._drift()
    assert (runs, reads) == ([1, 1, 1], ["streams/worker-reseed"] * 2)


async def test_a_worker_given_the_control_partition_decides_rollouts_only_once_it_read_the_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by a review: the rollout controller may decide as soon as the sink holds the control partition,
    before anything made it read what its previous owner read (an operator's abort). The rollout timer
    reads the control topic first; the sink's first batch after the gain does not read it again."""
    reads = control_log(monkeypatch)
    app = make_app(tmp_path)
    asked: list[bool] = []

    async def run_due() -> list[object]:
        asked.append(app._owns_control())  # what ``may_decide`` says
        return []

    app.rollout.run_due = run_due  # type: ignore[method-assign,assignment]
    sink = Sink()
    app._sink = cast(ConsumerThread, sink)
    sink.owned = {("p.control", 0)}
    assert not app._owns_control()  # held, not yet read: ``may_decide`` refuses
    await app._rollout()
    assert (asked, reads) == ([True], ["streams/worker-reseed"])
    await app._pipelined([], lambda: None, reseed=True)  # the sink's first batch since the gain
    await app._inserted()
    assert (asked, reads) == ([True, True], ["streams/worker-reseed"])


def control_app(tmp_path: Path, producer: Producer, daily_usd: float, spent: list[float]) -> StreamsApp:
    """A worker with a budgets file of one tenant's ``daily_usd``, on a warehouse whose spend today is
    ``spent[0]`` (shared by every worker made with the same list)."""
    from monitoring.slo import DEFAULT_CONFIG
    from streams.control import Budgets, Controller

    app = make_app(tmp_path, None, producer)
    app._controller = Controller(Budgets(daily_usd={"acme": daily_usd}), DEFAULT_CONFIG)

    async def read(sql: str) -> list[dict[str, Any]]:
        return [{"tenant": "acme", "spent": int(spent[0] * 1e9)}] if "spend_day" in sql else []

    app._read = read  # type: ignore[method-assign]
    return app


async def test_only_the_worker_reading_the_control_topic_announces_budgets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by a review: every streams worker announced budget and burn states. Two in an overlap (a
    rolling update) chained one crossing twice in the audit log, and when the operator raised a limit the
    retiring replica, on the old budgets file, left "exhausted" last on the log for the rest of the day.
    Only the control partition's owner announces, and one given the partition compares with the log."""
    from schemas.events import BudgetStateChanged

    producer = Producer()
    control_log(monkeypatch, producer)
    spent = [11.0]
    old = control_app(tmp_path / "old", producer, 10.0, spent)  # the old budgets file
    new = control_app(tmp_path / "new", producer, 20.0, spent)  # the limit raised
    old_sink, new_sink = Sink(), Sink()
    old._sink, new._sink = cast(ConsumerThread, old_sink), cast(ConsumerThread, new_sink)

    def announced() -> list[tuple[str, bool]]:
        return [(e.tenant, e.exhausted) for _, e in producer.records if isinstance(e, BudgetStateChanged)]

    old_sink.owned, new_sink.owned = {("p.control", 0)}, {("p.results", 0)}
    await old._control()
    await new._control()
    assert announced() == [("acme", True)]  # by the owner, under its file
    # the rolling update: the new worker is given the control partition and reads the log again
    old_sink.owned, new_sink.owned = {("p.results", 0)}, {("p.control", 0)}
    old._revoked([("p.control", 0)], False)
    await new._control()
    assert announced() == [("acme", True), ("acme", False)]  # its limit is higher than the log's word
    spent[0] = 0.0  # a new UTC day, while the old replica still runs
    await old._control()
    await new._control()
    assert announced() == [("acme", True), ("acme", False)]


async def _handed_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, new_limit: float
) -> tuple[list[tuple[str, bool]], list[str]]:
    """Two workers started while the log was empty and acme under its limit of 10 USD (the new one's file
    says ``new_limit``); the old one, owning the control partition, announces acme's crossing, then the
    partition moves to the new one and its control timer fires twice before any record reaches its sink.
    What was announced on the log, and who read the control topic again."""
    from schemas.events import BudgetStateChanged

    producer = Producer()
    reads = control_log(monkeypatch, producer)
    spent = [11.0]
    old = control_app(tmp_path / "old", producer, 10.0, spent)
    new = control_app(tmp_path / "new", producer, new_limit, spent)
    old_sink, new_sink = Sink(), Sink()
    old._sink, new._sink = cast(ConsumerThread, old_sink), cast(ConsumerThread, new_sink)
    old_sink.owned, new_sink.owned = {("p.control", 0)}, {("p.results", 0)}
    await old._control()
    # a rolling update: the old owner's announcement was read and committed by its sink before the revoke,
    # and acme is refused (402), so no record comes to the new owner's sink (nothing calls its reseed)
    old_sink.owned, new_sink.owned = {("p.results", 0)}, {("p.control", 0)}
    old._revoked([("p.control", 0)], False)
    await new._control()
    await new._control()  # the next interval: nothing more
    announced = [(e.tenant, e.exhausted) for _, e in producer.records if isinstance(e, BudgetStateChanged)]
    return announced, reads


async def test_a_raised_limit_is_announced_by_the_new_owner_before_any_record_arrives(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by a review: the new owner compared with the states it read at its own start (the log was
    empty then) until a record reached its sink, so it announced nothing and acme stayed refused under the
    old owner's lower limit; on a quiet platform, for good."""
    announced, reads = await _handed_over(tmp_path, monkeypatch, 20.0)
    assert announced == [("acme", True), ("acme", False)]
    assert reads == ["streams/worker-reseed"] * 2  # each owner read the log once it was given it


async def test_a_crossing_is_not_announced_twice_by_the_new_owner(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by a review: with the same limit, the new owner announced acme's crossing again (a second
    ``budget.enforce`` audit entry), not having read its previous owner's."""
    announced, reads = await _handed_over(tmp_path, monkeypatch, 10.0)
    assert announced == [("acme", True)]
    assert reads == ["streams/worker-reseed"] * 2


async def test_a_finish_dated_in_the_future_holds_the_drift_watermark_at_now(tmp_path: Path) -> None:
    """Found by an audit: the watermark (the latest finish written) took a finish dated 9999 as it was,
    and drift windows stopped waiting for their rows."""
    from datetime import UTC, datetime

    from schemas.events import Timings

    producer, warehouse = Producer(), Warehouse()
    app = make_app(tmp_path, warehouse, producer)
    app._heads = {}
    future = datetime(9999, 1, 1, tzinfo=UTC)
    before = time.time()
    await app.write([Consumed("p.results", 0, 0, encode(finished(timings=Timings(finished=future))))])
    app._last_batch_full = True  # behind the log: the watermark holds windows back
    watermark = app.stored_until()
    assert watermark is not None
    assert before * 1000 - 1 <= watermark <= time.time() * 1000 + 1


async def test_a_batch_whose_dead_letter_kafka_refuses_is_not_stored(tmp_path: Path) -> None:
    """The batch counts as stored (its offsets committed) only once its dead letters are durable: one Kafka
    refuses fails the write, so the batch is read again and the junk lettered then (before, the letter was
    produced and not waited for: a crash in between lost it)."""
    producer = Producer(refused=["p.deadletter"])
    app = make_app(tmp_path, Warehouse(), producer)
    app._heads = {}
    with pytest.raises(BusError, match=r"p\.deadletter"):
        await app.write(
            [Consumed("p.results", 0, 7, b"{not json"), Consumed("p.results", 0, 8, encode(finished()))]
        )
