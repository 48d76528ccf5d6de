from __future__ import annotations

from types import SimpleNamespace

import pytest
from confluent_kafka import KafkaError, KafkaException, TopicCollection
from confluent_kafka.admin import AdminClient, ConfigResource

from infra.errors import InfraError
from infra.topics import (
    TopicSizing,
    TopicSpec,
    TopicSpecError,
    apply_topics,
    describe_topics,
    make_admin,
    platform_topics,
    topics_of,
    under_replicated,
)
from schemas.codec import MAX_RECORD_BYTES, TOPIC_MAX_MESSAGE_BYTES
from schemas.settings import KafkaConnection, PlatformSettings
from schemas.topics import TopicNames


def test_catalogue_covers_every_platform_topic() -> None:
    names = TopicNames("sg")
    specs = platform_topics(names, ["demo-gpt", "all-minilm-l6-v2"])
    by_name = {s.name: s for s in specs}
    assert set(by_name) == {
        "sg.requests.demo-gpt",
        "sg.requests.all-minilm-l6-v2",
        "sg.replies",
        "sg.results",
        "sg.cancels",
        "sg.control",
        "sg.usage",
        "sg.audit",
        "sg.drift",
        "sg.deadletter",
        "sg.quota",
        "sg.idempotency",
        "sg.batches",
    }
    assert by_name["sg.control"].config["cleanup.policy"] == "compact"
    assert by_name["sg.batches"].config["cleanup.policy"] == "compact"  # latest state per batch
    assert by_name["sg.idempotency"].config["cleanup.policy"] == "compact,delete"  # 24 h of claims
    assert all(
        s.config["cleanup.policy"] == "delete"
        for n, s in by_name.items()
        if n not in ("sg.control", "sg.idempotency", "sg.batches")
    )
    assert all(int(s.config["retention.ms"]) > 0 for s in specs if "retention.ms" in s.config)


def test_sizing_sets_partitions() -> None:
    specs = platform_topics(TopicNames("sg"), ["m"], TopicSizing(requests=3, replies=5))
    parts = {s.name: s.partitions for s in specs}
    assert parts["sg.requests.m"] == 3
    assert parts["sg.replies"] == 5


def test_replication_comes_from_the_settings_with_min_insync_one_less() -> None:
    single = topics_of(PlatformSettings(topic_prefix="sg", models=("m",)))
    assert {s.replication for s in single} == {1}
    assert all("min.insync.replicas" not in s.config for s in single)  # one broker: nothing to wait for
    three = topics_of(PlatformSettings(topic_prefix="sg", models=("m",), kafka_replication_factor=3))
    assert [s.name for s in three] == [s.name for s in single]
    assert {s.replication for s in three} == {3}
    assert {s.config["min.insync.replicas"] for s in three} == {"2"}  # acks=all survives one broker
    assert all(s.config.items() >= t.config.items() for s, t in zip(three, single, strict=True))


def test_every_topic_takes_a_record_as_large_as_a_producer_writes() -> None:
    """The broker's default (1 MB) held a terminal event of 480 MiniLM vectors; every topic now takes what
    the platform's producers write (``message.max.bytes``) with room for the record batch's framing."""
    specs = platform_topics(TopicNames("sg"), ["m"], TopicSizing(replication=3))
    assert {s.config["max.message.bytes"] for s in specs} == {str(TOPIC_MAX_MESSAGE_BYTES)}
    assert 0 < TOPIC_MAX_MESSAGE_BYTES - MAX_RECORD_BYTES <= 64 * 1024
    assert TOPIC_MAX_MESSAGE_BYTES <= 8 * 1024 * 1024, "managed clusters (Confluent Cloud) allow no more"


@pytest.mark.integration
def test_a_record_at_the_producers_limit_is_written_and_read_back(
    kafka: KafkaConnection, topic_prefix: str
) -> None:
    """A record as large as the producer takes is accepted by a platform topic on the real broker (whose own
    default is 1 MB) and read back by the platform's consumer settings (whose fetch size is 1 MB)."""
    from confluent_kafka import Consumer, Producer, TopicPartition

    from bus.consumer import consumer_config
    from bus.producer import producer_config
    from schemas.codec import RECORD_HEADROOM_BYTES

    admin = _admin(kafka)
    (spec,) = [s for s in platform_topics(TopicNames(topic_prefix), []) if s.name.endswith(".results")]
    apply_topics(admin, [spec])
    value = bytes(range(256)) * ((MAX_RECORD_BYTES - RECORD_HEADROOM_BYTES) // 256)
    producer = Producer(producer_config(kafka, "big-record"))
    errors: list[object] = []
    producer.produce(spec.name, value, key=b"k", partition=0, on_delivery=lambda err, _m: errors.append(err))
    assert producer.flush(30) == 0
    assert errors == [None]
    over = Producer(producer_config(kafka, "over", **{"message.max.bytes": TOPIC_MAX_MESSAGE_BYTES * 2}))
    over.produce(
        spec.name,
        b"x" * (TOPIC_MAX_MESSAGE_BYTES + 1),
        partition=0,
        on_delivery=lambda err, _m: errors.append(err),
    )
    assert over.flush(30) == 0
    assert errors[1] is not None, "the topic's own limit holds: a larger record is refused by the broker"
    consumer = Consumer(consumer_config(kafka, None, f"{topic_prefix}-big"))
    try:
        consumer.assign([TopicPartition(spec.name, 0, 0)])
        message = None
        for _ in range(40):
            message = consumer.poll(0.5)
            if message is not None and message.error() is None:
                break
        assert message is not None
        assert message.error() is None
        assert message.value() == value
    finally:
        consumer.close()


@pytest.mark.integration
def test_a_replication_factor_above_the_brokers_is_refused_with_the_reason(
    kafka: KafkaConnection, topic_prefix: str
) -> None:
    (spec,) = [
        s
        for s in platform_topics(TopicNames(topic_prefix), [], TopicSizing(replication=3))
        if "drift" in s.name
    ]
    with pytest.raises(InfraError, match=r"creating .*drift failed.*[Rr]eplication"):
        apply_topics(make_admin(kafka), [spec])


def _admin(kafka: KafkaConnection) -> AdminClient:
    return make_admin(kafka)


@pytest.mark.integration
def test_apply_is_idempotent_and_reports_changes(kafka: KafkaConnection, topic_prefix: str) -> None:
    admin = _admin(kafka)
    specs = platform_topics(
        TopicNames(topic_prefix), ["demo-gpt"], TopicSizing(requests=2, replies=2, events=2)
    )
    first = apply_topics(admin, specs)
    assert [c.action for c in first] == ["created"] * len(specs)
    second = apply_topics(admin, specs)
    assert [c.action for c in second] == ["unchanged"] * len(specs)
    topics = admin.list_topics(timeout=10).topics
    for spec in specs:
        assert len(topics[spec.name].partitions) == spec.partitions


@pytest.mark.integration
def test_apply_grows_partitions_and_fixes_config(kafka: KafkaConnection, topic_prefix: str) -> None:
    admin = _admin(kafka)
    name = f"{topic_prefix}.grow"
    small = TopicSpec(name=name, partitions=1, config={"retention.ms": "1000"}, purpose="test")
    apply_topics(admin, [small])
    bigger = TopicSpec(name=name, partitions=3, config={"retention.ms": "2000"}, purpose="test")
    (change,) = apply_topics(admin, [bigger])
    assert change.action == "partitions increased"
    assert "partitions 1 -> 3" in change.detail
    assert "retention.ms: 1000 -> 2000" in change.detail
    resource = ConfigResource(ConfigResource.Type.TOPIC, name)
    config = admin.describe_configs([resource])[resource].result()
    assert config["retention.ms"].value == "2000"
    assert len(admin.list_topics(timeout=10).topics[name].partitions) == 3
    (again,) = apply_topics(admin, [bigger])
    assert again.action == "unchanged"


@pytest.mark.integration
def test_fewer_partitions_than_exist_is_a_clear_error(kafka: KafkaConnection, topic_prefix: str) -> None:
    admin = _admin(kafka)
    name = f"{topic_prefix}.shrink"
    apply_topics(admin, [TopicSpec(name=name, partitions=4, config={}, purpose="test")])
    with pytest.raises(TopicSpecError, match="has 4 partitions but the spec asks for 2"):
        apply_topics(admin, [TopicSpec(name=name, partitions=2, config={}, purpose="test")])


@pytest.mark.integration
def test_a_replication_factor_above_the_topics_is_refused_before_anything_changes(
    kafka: KafkaConnection, topic_prefix: str
) -> None:
    """Found by a review: apply with a raised SLUICE_KAFKA_REPLICATION_FACTOR set ``min.insync.replicas``
    for it on topics still at one replica (every acks=all produce then refused) and said they matched. A
    new topic the cluster cannot replicate so widely is a clear spec error, not "is Kafka running?"."""
    admin = _admin(kafka)
    name = f"{topic_prefix}.replicated"
    apply_topics(admin, [TopicSpec(name=name, partitions=2, config={}, purpose="test")])
    insync = {"min.insync.replicas": "2"}
    wider = TopicSpec(name=name, partitions=2, config=insync, purpose="test", replication=3)
    with pytest.raises(TopicSpecError, match="has 1 replica\\(s\\) but the spec asks for 3"):
        apply_topics(admin, [wider])
    resource = ConfigResource(ConfigResource.Type.TOPIC, name)
    assert admin.describe_configs([resource])[resource].result()["min.insync.replicas"].value == "1"
    fresh = TopicSpec(name=f"{topic_prefix}.fresh", partitions=1, config={}, purpose="test", replication=3)
    with pytest.raises(TopicSpecError, match="fewer brokers"):
        apply_topics(admin, [fresh])


class _Answer:
    def __init__(self, value: object) -> None:
        self._value = value

    def result(self) -> object:
        if isinstance(self._value, BaseException):
            raise self._value
        return self._value


class _LaggingAdmin:
    """Answers DescribeTopics as a broker that learns of a new topic after ``unknown_for`` requests."""

    def __init__(self, unknown_for: int, error: int = KafkaError.UNKNOWN_TOPIC_OR_PART) -> None:
        self.calls, self._unknown_for, self._error = 0, unknown_for, error

    def describe_topics(self, topics: TopicCollection, request_timeout: float) -> dict[str, _Answer]:
        self.calls += 1
        partitions = [SimpleNamespace(id=0, isr=[1, 2], replicas=[1, 2, 3])]
        answer: object = SimpleNamespace(partitions=partitions)
        if self.calls <= self._unknown_for:
            answer = KafkaException(KafkaError(self._error))
        return {name: _Answer(answer) for name in topics.topic_names}


def test_under_replicated_asks_again_while_a_new_topic_is_unknown_where_it_asks() -> None:
    """``apply_topics`` waits until one broker lists a new topic; another may learn of it a moment later."""
    admin = _LaggingAdmin(unknown_for=2)
    assert under_replicated(admin, ["t"], timeout=5) == [("t", 0)]  # type: ignore[arg-type]
    assert admin.calls == 3
    with pytest.raises(InfraError, match="describing t failed"):  # past the timeout it is an error
        under_replicated(_LaggingAdmin(unknown_for=10**6), ["t"], timeout=0.3)  # type: ignore[arg-type]
    other = _LaggingAdmin(unknown_for=1, error=KafkaError.TOPIC_AUTHORIZATION_FAILED)
    with pytest.raises(InfraError, match="describing t failed"):  # any other error at once
        under_replicated(other, ["t"], timeout=5)  # type: ignore[arg-type]
    assert other.calls == 1


def test_a_cluster_that_does_not_answer_is_an_infra_error_naming_it() -> None:
    """`sluice topics list` / `apply` against no Kafka printed a KafkaException traceback."""
    admin = make_admin(KafkaConnection(bootstrap="127.0.0.1:1"))
    with pytest.raises(InfraError, match="listing the topics failed"):
        describe_topics(admin, "sluice", timeout=0.5)
    with pytest.raises(InfraError, match="listing the topics failed"):
        apply_topics(admin, platform_topics(TopicNames("sluice"), ["demo-gpt"]), timeout=0.5)
