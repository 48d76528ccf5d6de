"""Kafka TLS/SASL: the settings become librdkafka's security keys in one place, every client builder
passes them on, and no code makes a Kafka client any other way."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest
from rich.pretty import pretty_repr

import bus.consumer
import bus.control
import bus.producer
import infra.topics
from bus.consumer import ConsumerThread, consumer_config
from bus.producer import EventProducer, producer_config
from infra.kafka.broker import broker_answers
from infra.topics import make_admin
from schemas.settings import KafkaConnection, PlatformSettings, SettingsError, load_settings

REPO = Path(__file__).resolve().parents[2]
SOURCE_DIRS = (
    "bus",
    "schemas",
    "ingest",
    "streams",
    "gpu_workers",
    "monitoring",
    "drift",
    "infra",
    "sluice",
    "benchmarks",
)
SASL = {
    "SLUICE_KAFKA_BOOTSTRAP": "kafka-1.example:9093,kafka-2.example:9093",
    "SLUICE_KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
    "SLUICE_KAFKA_SASL_MECHANISM": "SCRAM-SHA-512",
    "SLUICE_KAFKA_SASL_USERNAME": "sluice",
    "SLUICE_KAFKA_SASL_PASSWORD": "pa55-w0rd-of-sluice",
}
SASL_KEYS = {
    "security.protocol": "sasl_ssl",
    "sasl.mechanism": "SCRAM-SHA-512",
    "sasl.username": "sluice",
    "sasl.password": "pa55-w0rd-of-sluice",
}


@pytest.fixture
def secured() -> KafkaConnection:
    return load_settings(PlatformSettings, SASL).kafka


def includes(config: dict[str, Any], keys: dict[str, str]) -> bool:
    return all(config.get(k) == v for k, v in keys.items())


# ------------------------------------------------------------------ settings -> librdkafka keys


def test_plaintext_adds_no_keys() -> None:
    platform = load_settings(PlatformSettings, {})
    assert platform.kafka_security() == {}
    assert platform.kafka == KafkaConnection("127.0.0.1:9092")


def test_sasl_ssl_becomes_librdkafka_keys(secured: KafkaConnection) -> None:
    assert secured.bootstrap == SASL["SLUICE_KAFKA_BOOTSTRAP"]
    assert secured.security == SASL_KEYS


def test_tls_files_become_locations() -> None:
    env = {
        "SLUICE_KAFKA_BOOTSTRAP": "k:9093",
        "SLUICE_KAFKA_SECURITY_PROTOCOL": "SSL",
        "SLUICE_KAFKA_SSL_CA_FILE": "/etc/kafka/ca.pem",
        "SLUICE_KAFKA_SSL_CERT_FILE": "/etc/kafka/client.pem",
        "SLUICE_KAFKA_SSL_KEY_FILE": "/etc/kafka/client.key",
    }
    assert load_settings(PlatformSettings, env).kafka_security() == {
        "security.protocol": "ssl",
        "ssl.ca.location": "/etc/kafka/ca.pem",
        "ssl.certificate.location": "/etc/kafka/client.pem",
        "ssl.key.location": "/etc/kafka/client.key",
    }


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"SLUICE_KAFKA_SECURITY_PROTOCOL": "SSL"}, "needs SLUICE_KAFKA_BOOTSTRAP"),
        (
            {"SLUICE_KAFKA_BOOTSTRAP": "k:1", "SLUICE_KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT"},
            "needs SLUICE_KAFKA_SASL_USERNAME and SLUICE_KAFKA_SASL_PASSWORD",
        ),
        (
            {"SLUICE_KAFKA_BOOTSTRAP": "k:1", "SLUICE_KAFKA_SASL_USERNAME": "u"},
            "does not use them",
        ),
        (
            {"SLUICE_KAFKA_BOOTSTRAP": "k:1", "SLUICE_KAFKA_SSL_CA_FILE": "/ca.pem"},
            "does not use TLS",
        ),
        (
            {
                "SLUICE_KAFKA_BOOTSTRAP": "k:1",
                "SLUICE_KAFKA_SECURITY_PROTOCOL": "SSL",
                "SLUICE_KAFKA_SSL_CERT_FILE": "/c.pem",
            },
            "go together",
        ),
        ({"SLUICE_KAFKA_BOOTSTRAP": "k:1", "SLUICE_KAFKA_SECURITY_PROTOCOL": "TLS"}, "SASL_SSL"),
        ({"SLUICE_KAFKA_SASL_MECHANISM": "GSSAPI"}, "SCRAM-SHA-256"),
    ],
)
def test_inconsistent_security_settings_are_refused(env: dict[str, str], message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        load_settings(PlatformSettings, env)


def test_the_password_is_never_shown(secured: KafkaConnection) -> None:
    platform = load_settings(PlatformSettings, SASL)
    for text in (repr(platform), str(platform), repr(secured), pretty_repr(platform), pretty_repr(secured)):
        assert "pa55-w0rd-of-sluice" not in text
        assert "[REDACTED]" in text
    assert "sluice" in repr(secured)  # the rest is shown


# ------------------------------------------------------------------ every builder passes them on


class Recorder:
    """Stands in for a confluent-kafka client class: records the config, then refuses to connect."""

    def __init__(self) -> None:
        self.configs: list[dict[str, Any]] = []

    def __call__(self, config: dict[str, Any], **kwargs: Any) -> Any:
        self.configs.append({**config, **kwargs})
        raise ConnectionRefusedError("recorded")


def test_producer_and_consumer_configs_carry_the_security_keys(secured: KafkaConnection) -> None:
    assert includes(producer_config(secured, "p"), SASL_KEYS)
    assert includes(consumer_config(secured, "g", "c"), SASL_KEYS)
    assert producer_config(secured, "p")["bootstrap.servers"] == secured.bootstrap
    assert includes(secured.client_config(**{"client.id": "x"}), {**SASL_KEYS, "client.id": "x"})


def test_every_client_constructor_gets_the_security_keys(
    secured: KafkaConnection, monkeypatch: pytest.MonkeyPatch
) -> None:
    record = Recorder()
    monkeypatch.setattr(bus.producer, "Producer", record)
    monkeypatch.setattr(bus.consumer, "Consumer", record)
    monkeypatch.setattr(bus.control, "Consumer", record)
    monkeypatch.setattr(infra.topics, "AdminClient", record)
    attempts: list[Any] = [
        lambda: EventProducer(secured, "p"),
        lambda: ConsumerThread(consumer_config(secured, None, "c"), lambda _: None, subscribe=["t"]).start(),
        lambda: bus.control.latest_deployments(secured, "t.control", "c"),
        lambda: make_admin(secured),
        lambda: broker_answers(secured),
    ]
    for attempt in attempts:
        with pytest.raises(ConnectionRefusedError):
            attempt()
    assert len(record.configs) == len(attempts)
    for config in record.configs:
        assert includes(config, {"bootstrap.servers": secured.bootstrap, **SASL_KEYS}), config


def test_the_streams_app_connects_with_the_platform_credentials(tmp_path: Path) -> None:
    from typing import cast

    from infra.warehouse.client import Client
    from streams.app import StreamsApp
    from streams.pricing import PriceTable
    from streams.settings import StreamsSettings

    platform = load_settings(PlatformSettings, {**SASL, "SLUICE_DATA_DIR": str(tmp_path)})
    streams = StreamsApp(
        platform,
        StreamsSettings(),
        cast(Client, None),
        PriceTable(),
        cast(EventProducer, None),
        request_topics=["sluice.requests.demo-gpt"],
    )
    # The sink's ConsumerThread is built from consumer_config(streams._kafka, ...) (the scan below checks
    # that every ConsumerThread gets a consumer_config).
    config = consumer_config(streams._kafka, streams.group, "sink")
    assert includes(config, {"bootstrap.servers": platform.bootstrap, **SASL_KEYS}), config


# ------------------------------------------------------------------ no client made another way

CLIENT_CLASSES = {
    "Consumer",
    "Producer",
    "AdminClient",
    "AIOKafkaConsumer",
    "AIOKafkaProducer",
    "AIOKafkaClient",
    "AIOKafkaAdminClient",
}
BUILDERS = {"consumer_config", "producer_config", "client_config", "probe_config"}
ALLOWED = {
    # ConsumerThread is handed a consumer_config(...) (checked below) and adds only its statistics callback.
    ("bus/consumer.py", "Consumer"),
}


def _name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _built(call: ast.Call) -> bool:
    return bool(call.args) and isinstance(call.args[0], ast.Call) and _name(call.args[0].func) in BUILDERS


def test_no_kafka_client_is_made_without_the_builders() -> None:
    offenders: list[str] = []
    seen: set[str] = set()
    for directory in SOURCE_DIRS:
        for path in sorted((REPO / directory).rglob("*.py")):
            relative = path.relative_to(REPO).as_posix()
            for node in ast.walk(ast.parse(path.read_text(), relative)):
                if not isinstance(node, ast.Call):
                    continue
                name = _name(node.func)
                where = f"{relative}:{node.lineno}"
                if name in CLIENT_CLASSES:
                    seen.add(name)
                    if not _built(node) and (relative, name) not in ALLOWED:
                        offenders.append(f"{where}: {name}(...) without a config builder")
                elif name == "ConsumerThread" and not _built(node):
                    offenders.append(f"{where}: ConsumerThread(...) without consumer_config(...)")
    assert not offenders, "\n".join(offenders)
    assert {"Consumer", "Producer", "AdminClient"} <= seen  # the scan does find the clients
