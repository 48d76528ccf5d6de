"""The Kafka gateway's coordination with the other edges, in process: idempotency claims and quota
snapshots, the producer and the readers stood in for, the rest the gateway's own
(``tests/ingest/test_idempotency.py`` and ``tests/e2e/test_overload.py`` run them on a broker)."""

from __future__ import annotations

import asyncio
import time

import pytest

from ingest.errors import GatewayUnavailable
from ingest.gateway import IdempotencyRecord
from ingest.kafka_gateway import KafkaGateway
from schemas.coordination import QuotaSync, decode_claim, encode_coordination
from schemas.settings import KafkaConnection
from schemas.topics import TopicNames

TENANT, KEY = "acme", "pay-42"


class Log:
    """The idempotency topic as the gateway's producer writes it: (key, value) at each offset."""

    def __init__(self) -> None:
        self.records: list[tuple[bytes, bytes | None]] = []

    async def publish_raw(self, topic: str, value: bytes | None, *, key: bytes) -> tuple[int, int]:
        self.records.append((key, value))
        return 0, len(self.records) - 1


@pytest.fixture
async def gateway() -> tuple[KafkaGateway, Log]:
    made = KafkaGateway(
        kafka=KafkaConnection(bootstrap="127.0.0.1:1"), names=TopicNames("t"), edge_id="e", reply_partition=0
    )
    made._producer.stop()
    log = Log()
    made._producer = log  # type: ignore[assignment]
    made._claims_reader = object()  # type: ignore[assignment]  # read by hand below
    made.CLAIM_WAIT_S = 0.2
    return made, log


def read(gateway: KafkaGateway, log: Log) -> None:
    """The claims reader passes every record on the log."""
    gateway._apply_claims(
        [
            (0, offset, key, None if value is None else decode_claim(value))
            for offset, (key, value) in enumerate(log.records)
        ]
    )


MINE = IdempotencyRecord(request_id="req-1", body_hash="h")


async def test_a_claim_whose_read_back_timed_out_is_withdrawn_once_read(
    gateway: tuple[KafkaGateway, Log],
) -> None:
    """Found by an audit: the claim was on the log, the read-back timed out (a 503, retry), and the claim
    held the key for 24 hours for a request never published: every retry was a 409 in progress."""
    edge, log = gateway
    with pytest.raises(GatewayUnavailable):
        await edge.remember_idempotent(TENANT, KEY, MINE)
    read(edge, log)
    await asyncio.sleep(0.05)
    assert log.records[-1][1] is None  # a tombstone: the key is free again
    read(edge, log)
    assert await edge.lookup_idempotent(TENANT, KEY) is None


async def test_a_claim_its_client_left_is_withdrawn_once_read(gateway: tuple[KafkaGateway, Log]) -> None:
    edge, log = gateway
    task = asyncio.create_task(edge.remember_idempotent(TENANT, KEY, MINE))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    read(edge, log)
    await asyncio.sleep(0.05)
    read(edge, log)
    assert await edge.lookup_idempotent(TENANT, KEY) is None


async def test_a_claim_its_client_left_while_it_was_published_is_withdrawn_once_read(
    gateway: tuple[KafkaGateway, Log],
) -> None:
    """Found by a review: only the read-back was covered; a client leaving while the claim was published
    left it to land (a cancelled await does not stop the produce) and hold the key."""
    edge, log = gateway
    landed = asyncio.Event()
    publish = log.publish_raw

    async def slow(topic: str, value: bytes | None, *, key: bytes) -> tuple[int, int]:
        await landed.wait()
        return await publish(topic, value, key=key)

    log.publish_raw = slow  # type: ignore[method-assign]
    task = asyncio.create_task(edge.remember_idempotent(TENANT, KEY, MINE))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    landed.set()  # the produce goes on and the claim lands
    await asyncio.sleep(0.01)
    assert len(log.records) == 1
    read(edge, log)
    await asyncio.sleep(0.05)
    assert log.records[-1][1] is None  # withdrawn
    read(edge, log)
    assert await edge.lookup_idempotent(TENANT, KEY) is None


async def test_an_abandoned_claim_another_request_won_is_left_alone(
    gateway: tuple[KafkaGateway, Log],
) -> None:
    edge, log = gateway
    theirs = IdempotencyRecord(request_id="req-0", body_hash="h")
    read(edge, log)
    task = asyncio.create_task(edge.remember_idempotent(TENANT, KEY, theirs))
    for _ in range(100):  # until its claim is on the log (a few loop turns)
        if log.records:
            break
        await asyncio.sleep(0)
    assert log.records, "the claim never reached the log"
    read(edge, log)
    assert await task == theirs  # the first claim of the key: it won
    with pytest.raises(GatewayUnavailable):
        await edge.remember_idempotent(TENANT, KEY, MINE)  # a later claim, its read-back timed out
    read(edge, log)
    await asyncio.sleep(0.05)
    assert all(value is not None for _, value in log.records)  # no tombstone: the winner's claim stands
    assert await edge.lookup_idempotent(TENANT, KEY) == theirs


class _Record:
    def __init__(self, value: bytes, offset: int) -> None:
        self._value, self._offset = value, offset

    def value(self) -> bytes:
        return self._value

    def offset(self) -> int:
        return self._offset


async def test_a_live_quota_snapshot_is_heard_now_whatever_its_publishers_clock(
    gateway: tuple[KafkaGateway, Log],
) -> None:
    """Found by an audit: a snapshot's age was taken from its publisher's clock, so a peer a second behind
    was not live (its requests in flight not counted, its share not taken) and one a minute behind was not
    counted at all. Only the window read back at start is dated by the snapshots' own times."""
    edge, _ = gateway
    heard: list[tuple[str, float]] = []
    edge._loop = asyncio.get_running_loop()
    edge.follow_quota(lambda sync, age: heard.append((sync.edge, age)))
    edge._quota_live_from = 10
    now_ms = int(time.time() * 1000)
    records = [
        _Record(
            encode_coordination(QuotaSync(edge="before", time_ms=now_ms - 2_000, window_s=60, usage=())), 4
        ),
        _Record(
            encode_coordination(QuotaSync(edge="ancient", time_ms=now_ms - 3_600_000, window_s=60, usage=())),
            5,
        ),
        _Record(
            encode_coordination(QuotaSync(edge="behind", time_ms=now_ms - 65_000, window_s=60, usage=())), 10
        ),
        _Record(
            encode_coordination(QuotaSync(edge="ahead", time_ms=now_ms + 5_000, window_s=60, usage=())), 11
        ),
    ]
    edge._on_quota(records)  # type: ignore[arg-type]
    await asyncio.sleep(0.01)
    ages = dict(heard)
    assert 1.5 < ages["before"] < 5
    assert ages["ancient"] == 60  # older than the window: counted as leaving it
    assert ages["behind"] == ages["ahead"] == 0.0


async def test_the_snapshots_read_back_before_the_edge_follows_them_are_handed_over_when_it_does(
    gateway: tuple[KafkaGateway, Log],
) -> None:
    """Found by a review: the gateway reads the last window of snapshots while it starts, and the edge follows
    them only once it starts itself, after the gateway. Read first (as whenever catching up on the idempotency
    topic took longer), they were dropped: a restarted edge gave every tenant a fresh minute."""
    edge, _ = gateway
    edge._loop = asyncio.get_running_loop()
    edge._quota_live_from = 10
    now_ms = int(time.time() * 1000)

    def snapshot(instance: str, age_s: float, offset: int) -> _Record:
        sync = QuotaSync(edge=instance, time_ms=now_ms - int(age_s * 1000), window_s=60, usage=())
        return _Record(encode_coordination(sync), offset)

    edge._on_quota([snapshot("previous-life", 20, 1), snapshot("dead-peer", 30, 2)])  # type: ignore[list-item]
    edge._on_quota([snapshot("previous-life", 5, 3), snapshot("live-peer", 0, 10)])  # type: ignore[list-item]
    await asyncio.sleep(0.2)  # handed to the loop, and no one follows yet
    heard: list[tuple[str, float]] = []
    edge.follow_quota(lambda sync, age: heard.append((sync.edge, age)))
    ages = dict(heard)
    assert sorted(ages) == ["dead-peer", "live-peer", "previous-life"]
    assert [name for name, _ in heard].count("previous-life") == 1  # its latest only, as the ledger keeps
    assert 5.1 < ages["previous-life"] < 8  # aged by its wait as well
    assert 30.1 < ages["dead-peer"] < 33
    assert 0.1 < ages["live-peer"] < 3
    edge._on_quota([snapshot("live-peer", 0, 11)])  # type: ignore[list-item]
    await asyncio.sleep(0.01)
    assert heard[-1] == ("live-peer", 0.0)  # from then on, straight through
