"""Partition keys: a tenant's requests share one key unless the tenant is configured hot; the bounded
tables a gateway keeps without a broker."""

from __future__ import annotations

import pytest

from ingest.kafka_gateway import KafkaGateway
from ingest.main import reply_partition
from ingest.settings import EdgeSettings
from schemas.ids import uuid7
from schemas.settings import KafkaConnection
from schemas.topics import TopicNames


def _gateway(salts: dict[str, int]) -> KafkaGateway:
    return KafkaGateway(
        kafka=KafkaConnection("127.0.0.1:1"),
        names=TopicNames("t"),
        edge_id="e",
        reply_partition=0,
        salts=salts,
    )


def test_plain_tenants_keep_one_key_and_hot_tenants_spread() -> None:
    gateway = _gateway(EdgeSettings(edge_hot_tenants=("bigco=8",)).salts())
    assert {gateway.partition_key("acme", uuid7()) for _ in range(50)} == {b"acme"}
    hot = {gateway.partition_key("bigco", uuid7()) for _ in range(400)}
    assert hot == {f"bigco#{n}".encode() for n in range(8)}
    # Pinned: a retried request must land on the partition its first attempt used, so changing
    # these keys reroutes requests already in flight.
    assert gateway.partition_key("bigco", "0190a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a5b") == b"bigco#5"
    assert gateway.partition_key("bigco", "0190a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a5c") == b"bigco#6"


@pytest.mark.parametrize("entry", ["bigco", "bigco=0", "=3", "bigco=x"])
def test_bad_hot_tenant_entries_are_refused(entry: str) -> None:
    with pytest.raises(ValueError, match="tenant=N"):
        EdgeSettings(edge_hot_tenants=(entry,))


def test_an_edge_keeps_its_reply_partition_across_restarts() -> None:
    # Pinned: a restarted (or upgraded) edge must find the replies written to the partition it owned,
    # so changing these values strands replies in flight.
    assert [reply_partition(f"edge-{n}", 8) for n in range(8)] == [5, 3, 1, 7, 4, 2, 0, 6]


def test_end_listeners_are_bounded_and_forgotten_unheard(monkeypatch: pytest.MonkeyPatch) -> None:
    """One listener per cancelled request (``Dispatcher.cancel``): a request whose end never comes (its
    worker gone, its end on another edge's partition) must not be kept for good."""
    from ingest import kafka_gateway

    made = _gateway({})
    now = [1000.0]
    monkeypatch.setattr("ingest.kafka_gateway.time.monotonic", lambda: now[0])
    monkeypatch.setattr(kafka_gateway, "FINISH_LISTENERS", 3)
    for i in range(5):
        made.when_finished(f"r{i}", lambda _: None)
    assert list(made._finish_listeners) == ["r2", "r3", "r4"]  # the oldest went first
    now[0] += kafka_gateway.FINISH_LISTEN_S + 1
    made.when_finished("r5", lambda _: None)
    assert list(made._finish_listeners) == ["r5"]  # the rest were forgotten unheard
