"""infra/compose: parsed by compose-spec (the Rust compose_spec parser: keys and types of the Compose
Specification; it bundles no JSON Schema and Docker is not installed here), then checked against the code
and against itself: references between services, settings, ports, commands, mounted files, Prometheus
targets, Grafana provisioning."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any

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
SHELL_ENV = {"SLUICE_OPS_TOKEN": "a-test-ops-token-of-enough-length"}
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
    assert warehouse.startswith(f"http://{clickhouse['jsonData']['username']}:")
    assert warehouse.endswith(f"@{clickhouse['jsonData']['host']}:{clickhouse['jsonData']['port']}/sluice")


def test_traces_go_to_the_collector() -> None:
    collector = yaml.safe_load((COMPOSE_DIR / "otel-collector.yml").read_text(encoding="utf-8"))
    endpoint = collector["receivers"]["otlp"]["protocols"]["http"]["endpoint"]
    port = endpoint.rsplit(":", 1)[1]
    for service in sluice_services().values():
        otlp = load_settings(ObservabilitySettings, env_of(service)).otlp_endpoint
        assert otlp == f"http://otel-collector:{port}/v1/traces"
    assert collector["service"]["pipelines"]["traces"]["receivers"] == ["otlp"]


def test_compose_tenants_file_loads() -> None:
    from ingest.auth import TenantDirectory

    edge = services()["edge"]
    (mount,) = [v for v in edge["volumes"] if v.startswith("./")]
    source, target, _mode = mount.split(":")
    assert target == env_of(edge)["SLUICE_EDGE_TENANTS_FILE"]
    directory = TenantDirectory.from_file(COMPOSE_DIR / source)
    assert directory.authenticate("Bearer replace-me").name == "acme"
