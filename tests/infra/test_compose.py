"""infra/compose: parsed by compose-spec (the Rust compose_spec parser: keys and types of the Compose
Specification; it bundles no JSON Schema and Docker is not installed here), then checked against the code
and against itself: references between services, settings, ports, commands, mounted files, Prometheus
targets, Grafana provisioning."""

from __future__ import annotations

import hashlib
import json
import re
import shlex
import tempfile
import tomllib
from pathlib import Path
from typing import Any
from xml.etree import ElementTree

import msgspec
import pytest
import yaml
from compose_spec import PyCompose

from gpu_workers.settings import WorkerSettings
from infra.topics import TopicSizing
from ingest.settings import EdgeSettings
from monitoring.grafana import CLICKHOUSE_PLUGIN
from monitoring.settings import ObservabilitySettings
from schemas.settings import PlatformSettings, known_variables, load_settings
from streams.settings import StreamsSettings
from tests.infra.manifests import IMAGE, ROOT, resolve_sluice_command

COMPOSE_DIR = ROOT / "infra" / "compose"
COMPOSE = COMPOSE_DIR / "docker-compose.yml"
TENANT_KEY = "a-test-tenant-key"
# What the operator exports before `docker compose up` (the file's header): every ${VAR:?...} it names.
SHELL_ENV = {
    "SLUICE_OPS_TOKEN": "a-test-ops-token-of-enough-length",
    "GRAFANA_ADMIN_PASSWORD": "a-test-grafana-admin-password",
    "GRAFANA_CLICKHOUSE_PASSWORD": "a-test-grafana-reader-password",
    "TENANT_KEY_SHA256": hashlib.sha256(TENANT_KEY.encode()).hexdigest(),
}
_VARIABLE = re.compile(r"\$\{(\w+)(?:(:?[-?])([^}]*))?\}")


def interpolate(value: str, env: dict[str, str]) -> str:
    """Compose's ``${VAR}``, ``${VAR:-default}`` and ``${VAR:?error}`` substitution."""

    def one(match: re.Match[str]) -> str:
        name, op, arg = match.group(1), match.group(2), match.group(3) or ""
        if env.get(name):
            return env[name]
        if op and op.endswith("?"):
            raise ValueError(f"{name}: {arg}")
        return arg

    return _VARIABLE.sub(one, value)


def raw() -> dict[str, Any]:
    loaded = yaml.safe_load(COMPOSE.read_text(encoding="utf-8"))  # resolves anchors and merge keys
    assert isinstance(loaded, dict)
    return loaded


def services() -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = raw()["services"]
    return out


def env_of(service: dict[str, Any]) -> dict[str, str]:
    return {k: interpolate(str(v), SHELL_ENV) for k, v in service.get("environment", {}).items()}


def sluice_services() -> dict[str, dict[str, Any]]:
    return {name: s for name, s in services().items() if s["image"] == IMAGE}


def sluice_args(service: dict[str, Any]) -> list[list[str]]:
    """The sluice command lines a service runs (its command, or an ``sh -c`` entrypoint's ``&&`` parts)."""
    if "entrypoint" in service:
        shell, flag, script = service["entrypoint"]
        assert (shell, flag) == ("sh", "-c")
        parts = [shlex.split(part) for part in script.split("&&")]
        assert all(p[0] == "sluice" for p in parts)
        return [p[1:] for p in parts]
    return [list(service["command"])]


def test_the_compose_spec_parser_accepts_the_file() -> None:
    parsed = PyCompose.from_json(json.dumps(raw()))
    assert set(parsed.service_names()) == set(services())
    broken = raw()
    broken["services"]["edge"]["healthcheck"]["interval"] = "10 seconds"
    with pytest.raises(ValueError, match="not a valid duration unit"):
        PyCompose.from_json(json.dumps(broken))
    broken = raw()
    broken["services"]["edge"]["port"] = ["8080:8080"]
    with pytest.raises(ValueError, match="port"):
        PyCompose.from_json(json.dumps(broken))


def test_references_between_services_volumes_and_secrets() -> None:
    top = raw()
    for name, service in services().items():
        for dependency, condition in service.get("depends_on", {}).items():
            assert dependency in top["services"], (name, dependency)
            if condition["condition"] == "service_healthy":
                assert "healthcheck" in top["services"][dependency], (name, dependency)
            if condition["condition"] == "service_completed_successfully":
                assert top["services"][dependency].get("restart") in (None, "no", "on-failure")
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (COMPOSE_DIR / source).exists(), (name, source)
            else:
                assert source in top["volumes"], (name, source)
        for secret in service.get("secrets", []):
            assert secret in top["secrets"]
        for config in service.get("configs", []):
            assert config["source"] in top["configs"], (name, config)


def test_kafka_cluster() -> None:
    brokers = {n: s for n, s in services().items() if n.startswith("kafka-")}
    assert sorted(brokers) == ["kafka-0", "kafka-1", "kafka-2"]
    for name, broker in brokers.items():
        assert broker["image"] == f"apache/kafka:{PlatformSettings().kafka_version}"
        env = broker["environment"]
        assert env["KAFKA_NODE_ID"] == name.split("-")[1]
        assert env["KAFKA_ADVERTISED_LISTENERS"] == f"PLAINTEXT://{name}:9092"
        assert env["KAFKA_MIN_INSYNC_REPLICAS"] == "2"
        assert env["KAFKA_DEFAULT_REPLICATION_FACTOR"] == "3"
        assert env["KAFKA_CONTROLLER_QUORUM_VOTERS"] == ",".join(f"{i}@kafka-{i}:9093" for i in range(3))
    for service in sluice_services().values():
        assert env_of(service)["SLUICE_KAFKA_BOOTSTRAP"] == ",".join(f"{b}:9092" for b in sorted(brokers))


def test_settings_commands_and_ports() -> None:
    known = known_variables()
    ports: dict[str, tuple[str, type[msgspec.Struct]]] = {
        "edge": ("edge_port", EdgeSettings),
        "worker": ("worker_ops_port", WorkerSettings),
        "streams": ("streams_port", StreamsSettings),
    }
    commands = set()
    for name, service in sluice_services().items():
        env = env_of(service)
        assert {k for k in env if k.startswith("SLUICE_")} <= set(known), name
        platform = load_settings(PlatformSettings, env)
        load_settings(ObservabilitySettings, env)
        assert platform.ops_token, "services bind 0.0.0.0: the ops token is required"
        for args in sluice_args(service):
            command = resolve_sluice_command(args)
            commands.add(command)
            if command in ports:
                field, cls = ports[command]
                port = getattr(load_settings(cls, env), field)
                assert f"127.0.0.1:{port}/readyz" in " ".join(service["healthcheck"]["test"]), name
    assert commands == {"topics apply", "warehouse migrate", "edge", "worker", "streams"}
    with pytest.raises(ValueError, match="SLUICE_OPS_TOKEN"):
        interpolate(services()["edge"]["environment"]["SLUICE_OPS_TOKEN"], {})
    # one worker service per served model
    served = load_settings(PlatformSettings, env_of(services()["edge"])).served_models()
    workers = {
        args[2]
        for s in sluice_services().values()
        for args in sluice_args(s)
        if args[:2] == ["worker", "--model"]
    }
    assert workers == set(served)
    assert len(workers) <= TopicSizing().requests


def test_prometheus_scrapes_every_sluice_service() -> None:
    config = yaml.safe_load((COMPOSE_DIR / "prometheus.yml").read_text(encoding="utf-8"))
    targets = {t for job in config["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    expected = set()
    for name, service in sluice_services().items():
        env = env_of(service)
        for args in sluice_args(service):
            command = resolve_sluice_command(args)
            if command == "edge":
                expected.add(f"{name}:{load_settings(EdgeSettings, env).edge_port}")
            elif command == "worker":
                expected.add(f"{name}:{load_settings(WorkerSettings, env).worker_ops_port}")
            elif command == "streams":
                expected.add(f"{name}:{load_settings(StreamsSettings, env).streams_port}")
    assert targets == expected
    for job in config["scrape_configs"]:
        assert job["authorization"]["credentials_file"] == "/run/secrets/ops_token"
    assert "ops_token" in services()["prometheus"]["secrets"]
    # the rules directory is mounted where rule_files looks
    (rules,) = config["rule_files"]
    mounts = {v.split(":")[1] for v in services()["prometheus"]["volumes"]}
    assert str(Path(rules).parent) in mounts


def test_grafana_provisioning() -> None:
    grafana = services()["grafana"]
    mounts = {v.split(":")[1]: COMPOSE_DIR / v.split(":")[0] for v in grafana["volumes"]}
    providers = yaml.safe_load(
        (COMPOSE_DIR / "grafana/dashboards/dashboards.yml").read_text(encoding="utf-8")
    )
    (provider,) = providers["providers"]
    dashboards = mounts[provider["options"]["path"]]
    assert (dashboards / "sluicegate.json").resolve() == (ROOT / "infra/grafana/sluicegate.json").resolve()
    datasources = yaml.safe_load(
        (COMPOSE_DIR / "grafana/datasources/datasources.yml").read_text(encoding="utf-8")
    )["datasources"]
    assert {d["type"] for d in datasources} == {"prometheus", CLICKHOUSE_PLUGIN}
    assert CLICKHOUSE_PLUGIN in grafana["environment"]["GF_INSTALL_PLUGINS"]
    (clickhouse,) = [d for d in datasources if d["type"] == CLICKHOUSE_PLUGIN]
    warehouse = env_of(services()["streams"])["SLUICE_WAREHOUSE_URL"]
    assert warehouse.endswith(f"@{clickhouse['jsonData']['host']}:{clickhouse['jsonData']['port']}/sluice")
    assert clickhouse["jsonData"]["defaultDatabase"] == "sluice"


def test_traces_go_to_the_collector() -> None:
    collector = yaml.safe_load((COMPOSE_DIR / "otel-collector.yml").read_text(encoding="utf-8"))
    endpoint = collector["receivers"]["otlp"]["protocols"]["http"]["endpoint"]
    port = endpoint.rsplit(":", 1)[1]
    for service in sluice_services().values():
        otlp = load_settings(ObservabilitySettings, env_of(service)).otlp_endpoint
        assert otlp == f"http://otel-collector:{port}/v1/traces"
    assert collector["service"]["pipelines"]["traces"]["receivers"] == ["otlp"]


def _host_ips(service: dict[str, Any]) -> list[str]:
    """The host address each of ``service``'s published ports binds ("" for every interface)."""
    out = []
    for port in service.get("ports", []):
        if isinstance(port, dict):
            out.append(str(port.get("host_ip", "")))
        else:
            parts = str(port).split(":")
            out.append(parts[0] if len(parts) == 3 else "")
    return out


def test_prometheus_and_grafana_are_published_on_loopback_only() -> None:
    """Prometheus asks no credentials and re-serves every service's /metrics (tenant names in labels), the
    data SLUICE_OPS_TOKEN guards; Grafana runs any SQL its users type. Published on every interface, both
    were open to anyone who could reach the Docker host (published ports also get past ufw)."""
    for name in ("prometheus", "grafana"):
        ips = _host_ips(services()[name])
        assert ips, name
        assert set(ips) == {"127.0.0.1"}, f"{name} is published on {services()[name]['ports']}"
    # the edge is the product: still published on every interface, behind its tenants' keys
    assert _host_ips(services()["edge"]) == [""]


def test_grafana_requires_an_admin_password_and_reads_the_warehouse_read_only() -> None:
    """Grafana kept its default admin/admin and logged in to ClickHouse as `sluice`, the platform's
    read-write user: anyone reaching it could DROP audit_log. Now the admin password is required, and the
    datasource's user may only SELECT from database sluice (readonly=1)."""
    grafana = services()["grafana"]
    env = grafana["environment"]
    assert interpolate(env["GF_SECURITY_ADMIN_PASSWORD"], SHELL_ENV) == SHELL_ENV["GRAFANA_ADMIN_PASSWORD"]
    missing = {k: v for k, v in SHELL_ENV.items() if k != "GRAFANA_ADMIN_PASSWORD"}
    with pytest.raises(ValueError, match="GRAFANA_ADMIN_PASSWORD"):
        interpolate(env["GF_SECURITY_ADMIN_PASSWORD"], missing)
    assert env["GF_USERS_ALLOW_SIGN_UP"] == "false"
    assert env["GF_AUTH_ANONYMOUS_ENABLED"] == "false"
    # the writer's password is not Grafana's to have
    clickhouse_service = services()["clickhouse"]
    writer = clickhouse_service["environment"]["CLICKHOUSE_USER"]
    assert "CLICKHOUSE_PASSWORD" not in env

    datasources = yaml.safe_load(
        (COMPOSE_DIR / "grafana/datasources/datasources.yml").read_text(encoding="utf-8")
    )["datasources"]
    (datasource,) = [d for d in datasources if d["type"] == CLICKHOUSE_PLUGIN]
    reader = datasource["jsonData"]["username"]
    assert reader != writer, f"Grafana logs in to ClickHouse as {writer!r}, the platform's read-write user"

    # the user is defined in a users.d file the ClickHouse service mounts
    mounts = {
        v.split(":")[1]: COMPOSE_DIR / v.split(":")[0]
        for v in clickhouse_service["volumes"]
        if v.startswith("./")
    }
    (users_file,) = [src for dst, src in mounts.items() if dst.startswith("/etc/clickhouse-server/users.d/")]
    config = ElementTree.parse(users_file).getroot()
    user = config.find(f"users/{reader}")
    assert user is not None, f"{users_file.name} defines no user {reader!r}"
    profile = config.find(f"profiles/{user.findtext('profile')}")
    assert profile is not None
    assert profile.findtext("readonly") == "1"
    # the plugin sets max_execution_time on every query; readonly=1 must let it
    assert profile.find("constraints/max_execution_time/changeable_in_readonly") is not None
    assert [q.text for q in user.iterfind("grants/query")] == ["GRANT SELECT ON sluice.*"]

    # one password, from the environment, on both sides
    password = user.find("password")
    assert password is not None
    variable = password.get("from_env")
    assert variable == "GRAFANA_CLICKHOUSE_PASSWORD"
    assert datasource["secureJsonData"]["password"] == f"${variable}"
    for service in (clickhouse_service, grafana):
        assert interpolate(service["environment"][variable], SHELL_ENV) == SHELL_ENV[variable]
        with pytest.raises(ValueError, match=variable):
            interpolate(service["environment"][variable], {})


def _edge_tenants_file(env: dict[str, str]) -> str:
    """The tenants file Compose gives the edge under ``env``: a bind-mounted file or a ``configs`` entry."""
    edge = services()["edge"]
    target = interpolate(edge["environment"]["SLUICE_EDGE_TENANTS_FILE"], env)
    for volume in edge.get("volumes", []):
        source, mounted = str(volume).split(":")[:2]
        if mounted == target:
            return (COMPOSE_DIR / source).read_text(encoding="utf-8")
    for granted in edge.get("configs", []):
        if granted["target"] == target:
            config = raw()["configs"][granted["source"]]
            if "file" in config:
                return (COMPOSE_DIR / str(config["file"])).read_text(encoding="utf-8")
            return interpolate(str(config["content"]), env)
    raise AssertionError(f"nothing is mounted at SLUICE_EDGE_TENANTS_FILE={target}")


def test_the_edge_accepts_only_the_operators_tenant_key() -> None:
    """The compose edge is published on every interface, and its tenants file used to hold the digest of
    the key its own comment spelled out ("replace-me"): anyone could use it. The key now comes from
    TENANT_KEY_SHA256, which Compose requires."""
    from ingest.auth import TenantDirectory
    from ingest.errors import AuthenticationFailed

    text = _edge_tenants_file(SHELL_ENV)
    public = hashlib.sha256(b"replace-me").hexdigest()
    open_to = [n for n, t in tomllib.loads(text)["tenants"].items() if public in t["key_sha256"]]
    assert not open_to, f"tenant(s) {open_to} accept the documented key 'replace-me'"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tenants.toml"
        path.write_text(text, encoding="utf-8")
        directory = TenantDirectory.from_file(path)
    assert directory.authenticate(f"Bearer {TENANT_KEY}").name == "acme"
    with pytest.raises(AuthenticationFailed):
        directory.authenticate("Bearer replace-me")
    without = {k: v for k, v in SHELL_ENV.items() if k != "TENANT_KEY_SHA256"}
    with pytest.raises(ValueError, match="TENANT_KEY_SHA256"):
        _edge_tenants_file(without)
