from __future__ import annotations

import pytest

from schemas.settings import PlatformSettings
from schemas.topics import TopicNames


def test_names_under_the_prefix() -> None:
    topics = TopicNames("sluice")
    assert topics.requests("demo-gpt") == "sluice.requests.demo-gpt"
    assert topics.requests("all-MiniLM_L6.v2") == "sluice.requests.all-MiniLM_L6.v2"
    assert topics.replies == "sluice.replies"
    assert topics.results == "sluice.results"
    assert topics.cancels == "sluice.cancels"
    assert topics.control == "sluice.control"
    assert topics.usage == "sluice.usage"
    assert topics.audit == "sluice.audit"
    assert topics.drift == "sluice.drift"
    assert topics.deadletter == "sluice.deadletter"


def test_shared_topics_are_distinct_and_prefixed() -> None:
    shared = TopicNames("dev-1").shared()
    assert len(shared) == len(set(shared)) == 11
    assert all(name.startswith("dev-1.") for name in shared)


def test_default_prefix_from_settings_is_valid() -> None:
    assert TopicNames(PlatformSettings().topic_prefix).results == "sluice.results"


@pytest.mark.parametrize("model", ["", "demo gpt", "demo/gpt", "démo", "a:b", "x*"])
def test_requests_rejects_bad_model_ids(model: str) -> None:
    with pytest.raises(ValueError, match="model id"):
        TopicNames("sluice").requests(model)


@pytest.mark.parametrize("prefix", ["", "a b", "a/b"])
def test_rejects_bad_prefixes(prefix: str) -> None:
    with pytest.raises(ValueError, match="topic prefix"):
        TopicNames(prefix)


def test_rejects_names_longer_than_kafka_allows() -> None:
    with pytest.raises(ValueError, match="249"):
        TopicNames("sluice").requests("m" * 240)


def test_topic_names_are_frozen_values() -> None:
    topics = TopicNames("sluice")
    assert topics == TopicNames("sluice")
    with pytest.raises(AttributeError):
        topics.prefix = "other"  # type: ignore[misc]
