"""Kafka security end to end: a local broker with SASL_PLAINTEXT, SSL (client certificates required) and
SASL_SSL listeners, a private CA made here, and the platform's own clients configured only from
``SLUICE_KAFKA_*`` settings: topics, a durable publish and a consumer thread (the streams sink is one)
all get through; a wrong password, a missing client certificate or an unknown CA do not."""

from __future__ import annotations

import asyncio
import ipaddress
import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from confluent_kafka import Message, TopicPartition
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import NameOID

from bus.consumer import ConsumerThread, consumer_config
from bus.producer import EventProducer
from infra.kafka.broker import LocalKafka, broker_answers, free_port
from infra.topics import TopicSpec, apply_topics, make_admin
from schemas.examples import example_events
from schemas.settings import KafkaConnection, PlatformSettings, load_settings

pytestmark = pytest.mark.integration

USER, PASSWORD = "sluice", "sluice-test-secret"
JAAS = (
    "org.apache.kafka.common.security.plain.PlainLoginModule required "
    f'username="{USER}" password="{PASSWORD}" user_{USER}="{PASSWORD}";'
)


class Pki:
    """A CA, a broker certificate for 127.0.0.1 and a client certificate, as PEM files in ``directory``."""

    def __init__(self, directory: Path) -> None:
        self.ca_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        self.ca = self._cert("sluice test CA", self.ca_key.public_key(), ca=True)
        self.ca_file = directory / "ca.pem"
        self.ca_file.write_bytes(self.ca.public_bytes(serialization.Encoding.PEM))
        self.broker_store = directory / "broker.pem"  # Kafka's PEM keystore: key, then the chain
        self.client_cert, self.client_key = directory / "client.pem", directory / "client.key"
        broker_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        broker = self._cert("127.0.0.1", broker_key.public_key(), ip="127.0.0.1")
        self.broker_store.write_bytes(_pkcs8(broker_key) + _pem(broker) + _pem(self.ca))
        client_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        self.client_cert.write_bytes(_pem(self._cert("sluice-client", client_key.public_key())))
        self.client_key.write_bytes(_pkcs8(client_key))

    def _cert(
        self, name: str, public_key: rsa.RSAPublicKey, *, ca: bool = False, ip: str | None = None
    ) -> x509.Certificate:
        now = datetime.now(UTC)
        issuer = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "sluice test CA")])
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(issuer)
            .public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - timedelta(minutes=5))
            .not_valid_after(now + timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=not ca,
                    content_commitment=False,
                    key_encipherment=not ca,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=ca,
                    crl_sign=ca,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
        )
        if not ca:
            builder = builder.add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self.ca_key.public_key()), critical=False
            )
        if ip is not None:
            san = x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(ip))])
            builder = builder.add_extension(san, critical=False)
        return builder.sign(self.ca_key, hashes.SHA256())


def _pem(cert: x509.Certificate) -> bytes:
    return bytes(cert.public_bytes(serialization.Encoding.PEM))


def _pkcs8(key: rsa.RSAPrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


class Secured:
    def __init__(self, pki: Pki, ports: dict[str, int]) -> None:
        self.pki = pki
        self.ports = ports

    def settings(self, protocol: str, **extra: str) -> PlatformSettings:
        env = {
            "SLUICE_KAFKA_BOOTSTRAP": f"127.0.0.1:{self.ports[protocol]}",
            "SLUICE_KAFKA_SECURITY_PROTOCOL": protocol,
        }
        if protocol.startswith("SASL_"):
            env |= {"SLUICE_KAFKA_SASL_USERNAME": USER, "SLUICE_KAFKA_SASL_PASSWORD": PASSWORD}
        if protocol.endswith("SSL"):
            env["SLUICE_KAFKA_SSL_CA_FILE"] = str(self.pki.ca_file)
        if protocol == "SSL":  # this listener wants a client certificate
            env |= {
                "SLUICE_KAFKA_SSL_CERT_FILE": str(self.pki.client_cert),
                "SLUICE_KAFKA_SSL_KEY_FILE": str(self.pki.client_key),
            }
        return load_settings(PlatformSettings, env | extra)


@pytest.fixture(scope="module")
def secured(
    platform_settings: PlatformSettings, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Secured]:
    if not platform_settings.local_kafka:
        pytest.skip("SLUICE_KAFKA_BOOTSTRAP points at an external cluster: no local broker to configure")
    directory = tmp_path_factory.mktemp("kafka-secured")
    pki = Pki(directory)
    port, controller = free_port(), free_port()
    ports = {name: free_port() for name in ("SASL_PLAINTEXT", "SSL", "SASL_SSL")}
    listeners = ",".join(f"{name}://127.0.0.1:{p}" for name, p in ports.items())
    broker = LocalKafka(
        data_dir=directory / "data",
        cache_dir=platform_settings.cache_dir,
        version=platform_settings.kafka_version,
        port=port,
        controller_port=controller,
        extra_properties={
            "listeners": f"PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller},{listeners}",
            "advertised.listeners": f"PLAINTEXT://127.0.0.1:{port},{listeners}",
            "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT,"
            + ",".join(f"{name}:{name}" for name in ports),
            "sasl.enabled.mechanisms": "PLAIN",
            "listener.name.sasl_plaintext.plain.sasl.jaas.config": JAAS,
            "listener.name.sasl_ssl.plain.sasl.jaas.config": JAAS,
            "ssl.keystore.type": "PEM",
            "ssl.keystore.location": str(pki.broker_store),
            "ssl.truststore.type": "PEM",
            "ssl.truststore.location": str(pki.ca_file),
            "listener.name.ssl.ssl.client.auth": "required",
        },
    )
    with broker:
        yield Secured(pki, ports)


async def _round_trip(kafka: KafkaConnection, topic: str) -> None:
    """Topics, a durable publish and a consumer thread, all over ``kafka``."""
    await asyncio.to_thread(
        apply_topics, make_admin(kafka), [TopicSpec(name=topic, partitions=1, config={}, purpose="")]
    )
    event = example_events()[0]
    with EventProducer(kafka, "secured") as producer:
        await producer.publish(topic, event)
    got = threading.Event()

    def seen(messages: list[Message]) -> None:
        got.set()

    with ConsumerThread(consumer_config(kafka, None, "secured"), seen, assign=[TopicPartition(topic, 0, 0)]):
        assert await asyncio.to_thread(got.wait, 30)


@pytest.mark.parametrize("protocol", ["SASL_PLAINTEXT", "SSL", "SASL_SSL"])
async def test_every_client_gets_through_with_the_settings(secured: Secured, protocol: str) -> None:
    await _round_trip(secured.settings(protocol).kafka, f"secured-{protocol.lower().replace('_', '-')}")


def test_wrong_credentials_are_turned_away(secured: Secured) -> None:
    assert broker_answers(secured.settings("SASL_PLAINTEXT").kafka)
    wrong = secured.settings("SASL_PLAINTEXT", SLUICE_KAFKA_SASL_PASSWORD="not-the-password")
    assert not broker_answers(wrong.kafka)
    assert not broker_answers(KafkaConnection(f"127.0.0.1:{secured.ports['SASL_PLAINTEXT']}"))
    no_client_cert = KafkaConnection(
        f"127.0.0.1:{secured.ports['SSL']}",
        {"security.protocol": "ssl", "ssl.ca.location": str(secured.pki.ca_file)},
    )
    assert not broker_answers(no_client_cert)
    unknown_ca = secured.settings("SASL_SSL").kafka.security | {"ssl.ca.location": "probe"}
    assert not broker_answers(KafkaConnection(f"127.0.0.1:{secured.ports['SASL_SSL']}", unknown_ca))
