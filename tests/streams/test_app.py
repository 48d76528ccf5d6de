"""The streams app without a broker: its consumer group and topics, the batch hand-over (offsets are
committed only after the batch is written), and the timers."""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest
from clickhouse_connect.driver.client import Client
from confluent_kafka import Message

from bus.consumer import ConsumerThread
from bus.producer import EventProducer
from schemas.settings import KafkaConnection, PlatformSettings
from streams.app import StreamsApp, consumed, every
from streams.pricing import PriceTable
from streams.settings import StreamsSettings
from streams.sink import Consumed


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


def make_app(tmp_path: Path) -> StreamsApp:
    return StreamsApp(
        PlatformSettings(kafka_bootstrap="127.0.0.1:1", topic_prefix="p", data_dir=str(tmp_path)),
        StreamsSettings(),
        cast(Client, None),  # never used unless the app runs
        PriceTable(),
        EventProducer(KafkaConnection("127.0.0.1:1"), "test"),
        request_topics=["p.requests.demo-gpt"],
    )


def test_the_sink_reads_what_the_warehouse_keeps_as_the_streams_group(tmp_path: Path) -> None:
    app = make_app(tmp_path)
    assert app.group == "p-streams"  # the group the Faust app of earlier versions committed under
    assert app.topics == ["p.requests.demo-gpt", "p.results", "p.cancels", "p.control", "p.usage"]
    assert not app.assigned


class Sink:
    def __init__(self) -> None:
        self.commits: list[dict[tuple[str, int], int]] = []

    def commit(self, offsets: dict[tuple[str, int], int]) -> None:
        self.commits.append(offsets)


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
    app = make_app(tmp_path)
    sink = Sink()
    app._loop, app._sink = loop, cast(ConsumerThread, sink)
    written: list[list[Consumed]] = []

    async def write(records: list[Consumed]) -> Any:
        assert sink.commits == []  # nothing committed while the batch is being written
        await asyncio.sleep(0)
        written.append(records)

    app.write = write  # type: ignore[method-assign]
    app._consume(messages(("r", 0, 3), ("r", 1, 0)))
    assert [len(batch) for batch in written] == [2]
    assert sink.commits == [{("r", 0): 4, ("r", 1): 1}]

    async def broken(records: list[Consumed]) -> Any:
        raise RuntimeError("the warehouse is gone")

    app.write = broken  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="the warehouse is gone"):
        app._consume(messages(("r", 0, 4)))  # the consumer thread dies of it: the app fails
    assert sink.commits == [{("r", 0): 4, ("r", 1): 1}]  # and the failed batch is not committed


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
