"""Typed settings read once from the environment (prefix ``SLUICE_``).

Every service declares one frozen :class:`msgspec.Struct` of its settings and reads it with
:func:`load_settings` at start-up; nothing else in the code base reads the environment. A variable with the
``SLUICE_`` prefix that no service knows is rejected with the closest known name, so a typo never silently
falls back to a default.
"""

from __future__ import annotations

import difflib
import ipaddress
import math
import os
import re
import types
from collections.abc import Mapping
from typing import Annotated, Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

import msgspec

from schemas.manifest import MODEL_TASKS, ModelTask
from schemas.topics import TopicNames

PREFIX = "SLUICE_"

S = TypeVar("S", bound=msgspec.Struct)

# Settings classes register here (at import of their module) so that an unknown variable can be told
# apart from one that belongs to another service.
_REGISTRY: dict[str, type[msgspec.Struct]] = {}


class SettingsError(ValueError):
    """A ``SLUICE_*`` variable is unknown or its value does not parse."""


MODEL_PATH_SYNTAX = "id=/path or id:task=/path (task: generation or embedding)"


def model_path_entry(entry: str) -> tuple[str, str, ModelTask | None]:
    """One ``SLUICE_MODEL_PATHS`` entry as (model id, path, task or None); ``ValueError`` naming the syntax if
    it is not one.

    The task goes on the id (``st:embedding=/models/st``), not after the path: a model id names a Kafka topic
    and so never holds a colon, while a path may (``/data/run:3/model:embedding`` stays a path)."""
    named, sep, path = entry.partition("=")
    model_id, colon, task = named.strip().partition(":")
    if not sep or not model_id.strip() or not path.strip():
        raise ValueError(f"SLUICE_MODEL_PATHS: entry {entry!r}: expected {MODEL_PATH_SYNTAX}")
    named_task = MODEL_TASKS.get(task.strip())
    if colon and named_task is None:
        raise ValueError(
            f"SLUICE_MODEL_PATHS: entry {entry!r}: task {task.strip()!r} is not one of {', '.join(MODEL_TASKS)}"
        )
    return model_id.strip(), path.strip(), named_task


def register(cls: type[S]) -> type[S]:
    """Class decorator: make the settings class's variables known to every service."""
    _REGISTRY[cls.__name__] = cls
    return cls


def env_name(field: str) -> str:
    return PREFIX + field.upper()


def known_variables() -> dict[str, str]:
    """``SLUICE_*`` name -> owning settings class, over every registered class."""
    return {env_name(name): cls.__name__ for cls in _REGISTRY.values() for name in cls.__struct_fields__}


def _parse(raw: str, annotation: Any, name: str) -> Any:
    origin = get_origin(annotation)
    if origin in (Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        if raw == "" and type(None) in get_args(annotation):
            return None
        return _parse(raw, args[0], name)
    if origin is Literal:
        choices = get_args(annotation)
        if raw not in choices:
            raise SettingsError(f"{name}={raw!r}: expected one of {', '.join(map(str, choices))}")
        return raw
    if origin is tuple:
        (item, *_rest) = get_args(annotation)
        return tuple(_parse(part.strip(), item, name) for part in raw.split(",") if part.strip())
    if annotation is bool:
        lowered = raw.strip().lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise SettingsError(f"{name}={raw!r}: expected true/false")
    if annotation in (int, float):
        try:
            value = annotation(raw)
        except ValueError:
            raise SettingsError(f"{name}={raw!r}: expected {annotation.__name__}") from None
        if annotation is float and not math.isfinite(value):  # none means "no limit" by inf (it overflowed)
            raise SettingsError(f"{name}={raw!r}: expected a finite number")
        return value
    return raw


def load_settings(cls: type[S], env: Mapping[str, str] | None = None) -> S:
    """Read ``cls`` from ``env`` (default ``os.environ``); validate types and reject unknown variables."""
    env = os.environ if env is None else env
    register(cls)
    known = known_variables()
    unknown = sorted(k for k in env if k.startswith(PREFIX) and k not in known)
    if unknown:
        messages = []
        for key in unknown:
            close = difflib.get_close_matches(key, list(known), n=1)
            messages.append(f"{key} (did you mean {close[0]}?)" if close else key)
        raise SettingsError("unknown settings: " + ", ".join(messages))
    hints = get_type_hints(cls)
    values = {
        field: _parse(env[env_name(field)], hints[field], env_name(field))
        for field in cls.__struct_fields__
        if env_name(field) in env
    }
    try:
        return msgspec.convert(values, cls, strict=False)
    except msgspec.ValidationError as exc:
        field = re.search(r"at `\$\.(\w+)", str(exc))  # name the variable, not the struct's field
        named = f" {env_name(field.group(1))}" if field is not None else ""
        raise SettingsError(f"{cls.__name__}{named}: {exc}") from None


def describe(cls: type[msgspec.Struct]) -> list[tuple[str, str, str]]:
    """(variable, type, default) rows for ``--help`` and the docs."""
    hints = get_type_hints(cls)
    rows = []
    for info in msgspec.structs.fields(cls):
        if info.default is not msgspec.NODEFAULT:
            default = repr(info.default)
        elif info.default_factory is not msgspec.NODEFAULT:
            default = repr(info.default_factory())
        else:
            default = "required"
        rows.append((env_name(info.name), _type_name(hints[info.name]), default))
    return rows


def _type_name(annotation: Any) -> str:
    if isinstance(annotation, type):
        return annotation.__name__
    return str(annotation).replace("typing.", "")


def _default_home() -> str:
    return os.path.join(os.path.expanduser("~"), ".local", "share", "sluicegate")


def _default_cache() -> str:
    return os.path.join(os.path.expanduser("~"), ".cache", "sluicegate")


Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]

SECRET_FIELDS = frozenset({"ops_token", "kafka_sasl_password"})
"""Fields whose values are never shown (``sluice settings``, ``repr``) and are scrubbed from logs."""
REDACTED = "[REDACTED]"


def redacted(field: str, value: object) -> object:
    """A settings field's value fit to show: a secret as ``[REDACTED]``, a URL without its password."""
    if value is not None and field in SECRET_FIELDS:
        return REDACTED
    if isinstance(value, str) and "@" in value and "://" in value:
        return url_without_password(value)
    return value


def url_password_span(url: str) -> tuple[int, int] | None:
    """Where the password of ``url``'s user-info is in the string as written (``//user:password@``): from
    the first ``:`` after ``//`` to the last ``@``. Read from the raw string, not parsed: an unencoded
    ``#``, ``/`` or ``?`` in a password cuts a URL parser's host part short, and it printed the password
    whole (a review; ``[`` made the parser raise). A path holding ``@`` after a port may be taken for
    one: more is hidden, never less."""
    start = url.find("//")
    if start < 0:
        return None
    start += 2
    at = url.rfind("@", start)
    colon = url.find(":", start, at) if at >= 0 else -1
    return None if colon < 0 else (colon + 1, at)


def url_without_password(url: str) -> str:
    """``url`` fit to print: its password (:func:`url_password_span`) as ``[REDACTED]``."""
    span = url_password_span(url)
    return url if span is None else f"{url[: span[0]]}{REDACTED}{url[span[1] :]}"


def display(field: str, value: object) -> str:
    """``repr`` of a settings field's value, redacted (``sluice settings``)."""
    return repr(redacted(field, value))


def bare_host(host: str) -> str:
    """``host`` without IPv6 brackets, lower-cased: ``[::1]`` -> ``::1``, ``LocalHost`` -> ``localhost``."""
    host = host.strip().lower()
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback addresses (``127.0.0.0/8``, ``::1``). Any other name is taken
    as reachable from elsewhere (it is not resolved), and so is a wildcard (``0.0.0.0``, ``::``, empty)."""
    host = bare_host(host)
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_wildcard(host: str) -> bool:
    """True when binding ``host`` listens on every address (``0.0.0.0``, ``::``, or empty)."""
    host = bare_host(host)
    if host == "":
        return True
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False


SecurityProtocol = Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"]
SaslMechanism = Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"]


class KafkaConnection(msgspec.Struct, frozen=True):
    """Where the cluster is and how to reach it: the bootstrap servers and librdkafka's security keys.

    Every Kafka client of the platform is configured from :meth:`client_config` (``bus.producer_config``,
    ``bus.consumer_config``, ``infra.topics.make_admin``; the streams sink is a ``bus.ConsumerThread``), so
    no client can reach the cluster with less than the settings ask.
    """

    bootstrap: str
    security: dict[str, str] = {}
    """librdkafka keys (``security.protocol``, ``sasl.*``, ``ssl.*``); empty: PLAINTEXT."""

    def client_config(self, **overrides: Any) -> dict[str, Any]:
        """The base of every librdkafka client configuration: bootstrap, security, then ``overrides``."""
        return {"bootstrap.servers": self.bootstrap, **self.security, **overrides}

    def _shown(self) -> dict[str, str]:
        return {k: (REDACTED if "password" in k else v) for k, v in self.security.items()}

    def __repr__(self) -> str:
        return f"KafkaConnection({self.bootstrap!r}, {self._shown()!r})"

    def __rich_repr__(self) -> list[tuple[str, Any]]:
        return [("bootstrap", self.bootstrap), ("security", self._shown())]


def local_kafka_ports(first: int, brokers: int) -> list[tuple[int, int]]:
    """(client, controller) ports of each node of a local cluster: consecutive pairs from ``first``."""
    return [(first + 2 * i, first + 2 * i + 1) for i in range(brokers)]


@register
class PlatformSettings(msgspec.Struct, frozen=True, kw_only=True):
    """What every service shares: where Kafka and the warehouse are, and how topics are named."""

    kafka_bootstrap: str | None = None
    """An existing cluster (``host:port,...``). Unset: the platform runs its own local broker."""
    kafka_port: Port = 9092
    """Client port of the local broker (its controller listens on the next port)."""
    kafka_brokers: Annotated[int, msgspec.Meta(ge=1, le=9)] = 1
    """Nodes of the local cluster (each a broker and a KRaft controller; node i on ports
    ``kafka_port`` + 2(i - 1) and the next); clients bootstrap from all of them. ``sluice kafka up --brokers``
    overrides it for that command. With 3, set ``kafka_replication_factor`` to 3 too."""
    kafka_version: str = "4.3.1"
    """Apache Kafka release the local broker is resolved at (from Maven Central)."""
    kafka_replication_factor: Annotated[int, msgspec.Meta(ge=1, le=16)] = 1
    """Replicas of every topic ``sluice topics apply`` creates (3 on a 3-broker cluster, which then also
    asks ``min.insync.replicas`` = 2 of each topic). The local single broker needs 1."""
    topic_prefix: Annotated[str, msgspec.Meta(pattern=r"^[a-zA-Z0-9_-]+$")] = "sluice"
    models: tuple[str, ...] = ("demo-gpt", "all-minilm-l6-v2")
    """Model ids served; each gets a request topic."""
    model_paths: tuple[str, ...] = ()
    """Extra local Hugging Face model directories to serve, as ``id=/path`` entries, or ``id:task=/path``
    (task ``generation`` or ``embedding``) where the directory's config does not tell (see
    :func:`model_path_entry`)."""
    data_dir: str = msgspec.field(default_factory=_default_home)
    """Kafka log dirs and the embedded warehouse live under here."""
    cache_dir: str = msgspec.field(default_factory=_default_cache)
    """Downloaded Kafka jars (and the venv, see scripts/bootstrap.sh)."""
    warehouse_url: str | None = None
    """``http(s)://host:8123`` for a ClickHouse server. Unset: embedded chDB under ``data_dir``."""
    ops_token: Annotated[str, msgspec.Meta(min_length=16, pattern=r"^[\x21-\x7e]+$")] | None = None
    """Bearer token for every service's ``/metrics`` and the streams dashboard (``/healthz`` and ``/readyz``
    stay open). Unset: those are open, and a service refuses to bind a non-loopback address."""
    kafka_security_protocol: SecurityProtocol = "PLAINTEXT"
    """How every client (librdkafka) talks to ``kafka_bootstrap``: ``SSL`` and ``SASL_SSL``
    encrypt, the ``SASL_*`` ones authenticate with the username and password below."""
    kafka_sasl_mechanism: SaslMechanism = "PLAIN"
    kafka_sasl_username: str | None = None
    kafka_sasl_password: str | None = None
    """Never shown by ``sluice settings`` and scrubbed from logs."""
    kafka_ssl_ca_file: str | None = None
    """PEM file of the CA(s) that signed the brokers' certificates. Unset: the system's CA store."""
    kafka_ssl_cert_file: str | None = None
    """PEM client certificate (mutual TLS), with ``kafka_ssl_key_file`` (an unencrypted PEM key)."""
    kafka_ssl_key_file: str | None = None

    def __post_init__(self) -> None:
        protocol = self.kafka_security_protocol
        sasl, ssl = protocol.startswith("SASL_"), protocol.endswith("SSL")
        if protocol != "PLAINTEXT" and self.kafka_bootstrap is None:
            raise ValueError(
                f"SLUICE_KAFKA_SECURITY_PROTOCOL={protocol} needs SLUICE_KAFKA_BOOTSTRAP: the local broker "
                "speaks PLAINTEXT on 127.0.0.1"
            )
        if sasl and not (self.kafka_sasl_username and self.kafka_sasl_password):
            raise ValueError(
                f"SLUICE_KAFKA_SECURITY_PROTOCOL={protocol} needs SLUICE_KAFKA_SASL_USERNAME and "
                "SLUICE_KAFKA_SASL_PASSWORD"
            )
        if not sasl and (self.kafka_sasl_username or self.kafka_sasl_password):
            raise ValueError(
                "SLUICE_KAFKA_SASL_USERNAME/PASSWORD are set but SLUICE_KAFKA_SECURITY_PROTOCOL="
                f"{protocol} does not use them (SASL_SSL or SASL_PLAINTEXT does)"
            )
        files = (self.kafka_ssl_ca_file, self.kafka_ssl_cert_file, self.kafka_ssl_key_file)
        if not ssl and any(files):
            raise ValueError(
                "SLUICE_KAFKA_SSL_* files are set but SLUICE_KAFKA_SECURITY_PROTOCOL="
                f"{protocol} does not use TLS (SSL or SASL_SSL does)"
            )
        if bool(self.kafka_ssl_cert_file) != bool(self.kafka_ssl_key_file):
            raise ValueError("SLUICE_KAFKA_SSL_CERT_FILE and SLUICE_KAFKA_SSL_KEY_FILE go together")
        if self.kafka_bootstrap is None and self.kafka_port + 2 * self.kafka_brokers - 1 > 65535:
            raise ValueError(
                f"SLUICE_KAFKA_BROKERS={self.kafka_brokers} nodes need ports {self.kafka_port} to "
                f"{self.kafka_port + 2 * self.kafka_brokers - 1}; lower SLUICE_KAFKA_PORT"
            )
        self._check_model_ids()

    def _check_model_ids(self) -> None:
        """Each served id names a request topic: one it cannot name is refused here, naming the variable,
        so every command exits 2 with one line (a review: ``SLUICE_MODELS='demo gpt'`` passed ``sluice
        settings``, then ``sluice topics`` failed with a traceback and ``sluice up`` after starting Kafka)."""
        names = TopicNames(self.topic_prefix)
        extra = tuple(model_path_entry(entry)[0] for entry in self.model_paths)  # ValueError if malformed
        for variable, ids, hint in (
            ("SLUICE_MODELS", self.models, ""),
            ("SLUICE_MODEL_PATHS", extra, f" (its entries are {MODEL_PATH_SYNTAX})"),
        ):
            for model in ids:
                try:
                    names.requests(model)
                except ValueError as exc:
                    raise ValueError(f"{variable}: {exc}{hint}") from None

    def __repr__(self) -> str:
        fields = ", ".join(f"{f}={display(f, getattr(self, f))}" for f in self.__struct_fields__)
        return f"PlatformSettings({fields})"

    def __rich_repr__(self) -> list[tuple[str, Any]]:
        return [(f, redacted(f, getattr(self, f))) for f in self.__struct_fields__]

    def kafka_security(self) -> dict[str, str]:
        """The librdkafka security keys these settings ask for (empty for PLAINTEXT): the one place they are
        made, for every client (see :class:`KafkaConnection`)."""
        protocol = self.kafka_security_protocol
        if protocol == "PLAINTEXT":
            return {}
        keys = {"security.protocol": protocol.lower()}
        if protocol.startswith("SASL_") and self.kafka_sasl_username and self.kafka_sasl_password:
            keys["sasl.mechanism"] = self.kafka_sasl_mechanism
            keys["sasl.username"] = self.kafka_sasl_username
            keys["sasl.password"] = self.kafka_sasl_password
        for key, path in (
            ("ssl.ca.location", self.kafka_ssl_ca_file),
            ("ssl.certificate.location", self.kafka_ssl_cert_file),
            ("ssl.key.location", self.kafka_ssl_key_file),
        ):
            if path:
                keys[key] = path
        return keys

    @property
    def kafka(self) -> KafkaConnection:
        """How every Kafka client of this process reaches the cluster."""
        return KafkaConnection(self.bootstrap, self.kafka_security())

    def served_models(self) -> tuple[str, ...]:
        """``models`` plus the ids named in ``model_paths``, in order, without repeats."""
        extra = (model_path_entry(entry)[0] for entry in self.model_paths)
        return tuple(dict.fromkeys((*self.models, *(e for e in extra if e))))

    def unserved(self, model: str) -> str | None:
        """Why a command naming ``model`` cannot act on it here (it is not served), or None."""
        if model in self.served_models():
            return None
        return f"{model} is not served (SLUICE_MODELS / SLUICE_MODEL_PATHS)"

    @property
    def local_kafka(self) -> bool:
        return self.kafka_bootstrap is None

    @property
    def bootstrap(self) -> str:
        local = local_kafka_ports(self.kafka_port, self.kafka_brokers)
        return self.kafka_bootstrap or ",".join(f"127.0.0.1:{port}" for port, _ in local)
