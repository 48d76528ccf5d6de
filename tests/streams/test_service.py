"""The streams process's start-up helpers, without a broker."""

from __future__ import annotations

from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException

import streams.service
from infra.errors import InfraError
from schemas.settings import KafkaConnection, PlatformSettings
from streams.service import request_topics


class UnreachableAdmin:
    def list_topics(self, timeout: float) -> Any:
        raise KafkaException(
            KafkaError(KafkaError._TRANSPORT, "Failed to get metadata: Local: Broker transport failure")
        )


def test_kafka_that_does_not_answer_is_an_infra_error_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    def quiet_admin(kafka: KafkaConnection) -> UnreachableAdmin:
        return UnreachableAdmin()

    monkeypatch.setattr(streams.service, "quiet_admin", quiet_admin)
    with pytest.raises(InfraError) as caught:
        request_topics(PlatformSettings(kafka_bootstrap="127.0.0.1:1"))
    message = str(caught.value)
    assert message.startswith("cannot list the topics on Kafka at 127.0.0.1:1: Failed to get metadata")
    assert "`sluice kafka status`" in message
    assert "KafkaError{" not in message
