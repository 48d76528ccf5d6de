"""Partition keys: a tenant's requests share one key unless the tenant is configured hot."""

from __future__ import annotations

import pytest

from ingest.kafka_gateway import KafkaGateway
from ingest.main import reply_partition
from ingest.settings import EdgeSettings
from schemas.ids import uuid7
from schemas.topics import TopicNames


def _gateway(salts: dict[str, int]) -> KafkaGateway:
    return KafkaGateway(
        bootstrap="127.0.0.1:1", names=TopicNames("t"), edge_id="e", reply_partition=0, salts=salts
    )


def test_plain_tenants_keep_one_key_and_hot_tenants_spread() -> None:
    gateway = _gateway(EdgeSettings(edge_hot_tenants=("bigco=8",)).salts())
    assert {gateway.partition_key("acme", uuid7()) for _ in range(50)} == {b"acme"}
    hot = {gateway.partition_key("bigco", uuid7()) for _ in range(400)}
    assert hot == {f"bigco#{n}".encode() for n in range(8)}
    request_id = uuid7()
    assert gateway.partition_key("bigco", request_id) == gateway.partition_key("bigco", request_id)


@pytest.mark.parametrize("entry", ["bigco", "bigco=0", "=3", "bigco=x"])
def test_bad_hot_tenant_entries_are_refused(entry: str) -> None:
    with pytest.raises(ValueError, match="tenant=N"):
        EdgeSettings(edge_hot_tenants=(entry,))


def test_an_edge_keeps_its_reply_partition_across_restarts() -> None:
    assert reply_partition("edge-7", 8) == reply_partition("edge-7", 8)
    assert 0 <= reply_partition("edge-7", 8) < 8
