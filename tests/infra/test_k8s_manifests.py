"""infra/k8s: valid against the Kubernetes API's JSON Schemas (kubernetes-validate, offline), KEDA objects
against a schema of the fields used, and consistent with the code: settings, ports, probes, commands,
topics and consumer groups."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import jsonschema
import kubernetes_validate
import msgspec
import pytest
import yaml

from gpu_workers.settings import WorkerSettings
from infra.topics import TopicSizing
from ingest.settings import EdgeSettings
from monitoring.access import PROBES
from monitoring.settings import ObservabilitySettings
from schemas.settings import PlatformSettings, known_variables, load_settings
from schemas.topics import TopicNames, worker_group
from sluice.services import SERVICE_SETTINGS
from streams.settings import StreamsSettings
from tests.infra.manifests import IMAGE, ROOT, UsageError, load_documents, resolve_sluice_command

K8S = ROOT / "infra" / "k8s"
# The oldest Kubernetes the manifests need (the pod-index label, 1.28, is GA in 1.32) and the newest bundled.
K8S_VERSIONS = ("1.32.0", kubernetes_validate.latest_version())
CRD_KINDS = {"ScaledObject", "TriggerAuthentication"}
SERVICE_SETTINGS_BY_COMMAND: dict[str, type[msgspec.Struct]] = {
    "edge": EdgeSettings,
    "worker": WorkerSettings,
    "streams": StreamsSettings,
}
assert set(SERVICE_SETTINGS) >= {EdgeSettings, WorkerSettings, StreamsSettings, ObservabilitySettings}
# What an operator puts in place of the committed placeholders that are invalid on purpose (config.yaml).
OPERATOR_SECRETS = {"SLUICE_OPS_TOKEN": "a-test-ops-token-of-enough-length"}
TENANT_KEY = "a-test-tenant-key"


def manifests() -> list[dict[str, Any]]:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text(encoding="utf-8"))
    return [doc for name in kustomization["resources"] for doc in load_documents(K8S / name)]


DOCS = manifests()


def of_kind(kind: str) -> list[dict[str, Any]]:
    return [d for d in DOCS if d["kind"] == kind]


def named(kind: str, name: str) -> dict[str, Any]:
    (doc,) = [d for d in of_kind(kind) if d["metadata"]["name"] == name]
    return doc


def workloads() -> Iterator[dict[str, Any]]:
    for kind in ("Deployment", "StatefulSet", "Job"):
        yield from of_kind(kind)


def sluice_containers() -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    for workload in workloads():
        spec = workload["spec"]["template"]["spec"]
        for container in [*spec.get("initContainers", []), *spec["containers"]]:
            if container["image"].startswith(IMAGE.split(":")[0]):
                yield workload, container


def container_env(container: dict[str, Any], operator: dict[str, str] = OPERATOR_SECRETS) -> dict[str, str]:
    """What the container's environment holds: ConfigMaps and Secrets it loads, then its own entries
    (a field reference becomes a sample pod name, a secret key its value in the manifests), with the
    ``operator``'s values in place of the placeholders that are invalid on purpose."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            env.update(named("ConfigMap", source["configMapRef"]["name"])["data"])
        else:
            env.update(named("Secret", source["secretRef"]["name"])["stringData"])
    for entry in container.get("env", []):
        if "value" in entry:
            env[entry["name"]] = entry["value"]
        elif "secretKeyRef" in entry["valueFrom"]:
            ref = entry["valueFrom"]["secretKeyRef"]
            env[entry["name"]] = named("Secret", ref["name"])["stringData"][ref["key"]]
        else:
            assert entry["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name", entry
            env[entry["name"]] = "sample-pod-7d9c5b-x2x4q"
    env.update({k: v for k, v in operator.items() if k in env})
    return env


def test_kustomization_lists_every_manifest() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text(encoding="utf-8"))
    on_disk = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kustomization["resources"]) == on_disk
    assert kustomization["images"] == [{"name": IMAGE.split(":")[0], "newTag": IMAGE.split(":")[1]}]


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_builtin_kinds_validate_against_the_kubernetes_schemas(version: str) -> None:
    checked = 0
    for doc in DOCS:
        if doc["kind"] in CRD_KINDS:
            continue
        kubernetes_validate.validate(doc, version, strict=True)  # strict: unknown fields are errors
        checked += 1
    assert checked >= 20


def test_the_validator_catches_mistakes() -> None:
    deployment = yaml.safe_load(yaml.safe_dump(named("Deployment", "edge")))
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["prot"] = 8080
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSIONS[0], strict=True)
    deployment = yaml.safe_load(yaml.safe_dump(named("Deployment", "edge")))
    deployment["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSIONS[0], strict=True)


# The fields of KEDA's keda.sh/v1alpha1 objects these manifests use (KEDA 2.x CRDs), closed: a typo fails.
_NAME = {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"}
_METADATA = {
    "type": "object",
    "required": ["name"],
    "properties": {"name": _NAME, "labels": {"type": "object", "additionalProperties": {"type": "string"}}},
    "additionalProperties": False,
}
SCALED_OBJECT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "keda.sh/v1alpha1"},
        "kind": {"const": "ScaledObject"},
        "metadata": _METADATA,
        "spec": {
            "type": "object",
            "required": ["scaleTargetRef", "triggers", "minReplicaCount", "maxReplicaCount"],
            "additionalProperties": False,
            "properties": {
                "scaleTargetRef": {
                    "type": "object",
                    "required": ["name"],
                    "additionalProperties": False,
                    "properties": {
                        "name": _NAME,
                        "kind": {"type": "string"},
                        "apiVersion": {"type": "string"},
                    },
                },
                "pollingInterval": {"type": "integer", "minimum": 1},
                "cooldownPeriod": {"type": "integer", "minimum": 0},
                "minReplicaCount": {"type": "integer", "minimum": 0},
                "maxReplicaCount": {"type": "integer", "minimum": 1},
                "fallback": {
                    "type": "object",
                    "required": ["failureThreshold", "replicas"],
                    "additionalProperties": False,
                    "properties": {
                        "failureThreshold": {"type": "integer", "minimum": 1},
                        "replicas": {"type": "integer", "minimum": 1},
                    },
                },
                "advanced": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "horizontalPodAutoscalerConfig": {
                            "type": "object",
                            "additionalProperties": False,
                            # behavior: checked against the Kubernetes HPA schema below
                            "properties": {"behavior": {"type": "object"}, "name": {"type": "string"}},
                        }
                    },
                },
                "triggers": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "required": ["type", "metadata"],
                        "additionalProperties": False,
                        "properties": {
                            "type": {"const": "kafka"},
                            "authenticationRef": {
                                "type": "object",
                                "required": ["name"],
                                "additionalProperties": False,
                                "properties": {"name": _NAME},
                            },
                            "metadata": {
                                "type": "object",
                                "required": ["bootstrapServers", "consumerGroup", "topic", "lagThreshold"],
                                "additionalProperties": False,
                                "properties": {
                                    "bootstrapServers": {"type": "string"},
                                    "consumerGroup": {"type": "string"},
                                    "topic": {"type": "string"},
                                    # KEDA takes trigger metadata as strings
                                    "lagThreshold": {"type": "string", "pattern": r"^[1-9][0-9]*$"},
                                    "activationLagThreshold": {"type": "string", "pattern": r"^[0-9]+$"},
                                    "offsetResetPolicy": {"enum": ["earliest", "latest"]},
                                    "allowIdleConsumers": {"enum": ["true", "false"]},
                                    "limitToPartitionsWithLag": {"const": "true"},
                                },
                            },
                        },
                    },
                },
            },
        },
    },
}
TRIGGER_AUTH_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "keda.sh/v1alpha1"},
        "kind": {"const": "TriggerAuthentication"},
        "metadata": _METADATA,
        "spec": {
            "type": "object",
            "required": ["secretTargetRef"],
            "additionalProperties": False,
            "properties": {
                "secretTargetRef": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["parameter", "name", "key"],
                        "additionalProperties": False,
                        "properties": {
                            # the Kafka scaler's authentication parameters
                            "parameter": {
                                "enum": ["sasl", "username", "password", "tls", "ca", "cert", "key"]
                            },
                            "name": _NAME,
                            "key": {"type": "string"},
                        },
                    },
                }
            },
        },
    },
}


def test_keda_objects_validate_against_their_schema() -> None:
    scaled = of_kind("ScaledObject")
    assert len(scaled) == 2
    for doc in scaled:
        jsonschema.validate(doc, SCALED_OBJECT_SCHEMA)
        behavior = doc["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
        hpa = {
            "apiVersion": "autoscaling/v2",
            "kind": "HorizontalPodAutoscaler",
            "metadata": {"name": "keda-hpa"},
            "spec": {
                "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "x"},
                "maxReplicas": 2,
                "behavior": behavior,
            },
        }
        kubernetes_validate.validate(hpa, K8S_VERSIONS[0], strict=True)
    for doc in of_kind("TriggerAuthentication"):
        jsonschema.validate(doc, TRIGGER_AUTH_SCHEMA)
    broken = yaml.safe_load(yaml.safe_dump(scaled[0]))
    broken["spec"]["triggers"][0]["metadata"]["consumergroup"] = "typo"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, SCALED_OBJECT_SCHEMA)


def test_every_sluice_variable_is_a_real_setting_and_parses() -> None:
    known = known_variables()
    checked = 0
    for workload, container in sluice_containers():
        env = container_env(container)
        sluice_vars = {k for k in env if k.startswith("SLUICE_")}
        assert sluice_vars <= set(known), (workload["metadata"]["name"], sorted(sluice_vars - set(known)))
        # every settings class this process reads loads from this environment (types, bounds, cross-checks)
        platform = load_settings(PlatformSettings, env)
        load_settings(ObservabilitySettings, env)
        command = resolve_sluice_command(container["args"]).split()[0]
        if command in SERVICE_SETTINGS_BY_COMMAND:
            load_settings(SERVICE_SETTINGS_BY_COMMAND[command], env)
        assert platform.kafka_bootstrap, "the platform must not start its own broker in a pod"
        checked += 1
    assert checked == 6
    # keys of the ConfigMap and Secrets that containers load whole are all settings
    for source in ("sluice-config",):
        assert set(named("ConfigMap", source)["data"]) <= set(known)
    assert set(named("Secret", "sluice-secrets")["stringData"]) <= set(known)


def test_an_unknown_variable_would_be_caught() -> None:
    env = container_env(named("Deployment", "edge")["spec"]["template"]["spec"]["containers"][0])
    env["SLUICE_EDGE_PROT"] = "8080"
    with pytest.raises(ValueError, match="SLUICE_EDGE_PORT"):
        load_settings(EdgeSettings, env)


def _port(container: dict[str, Any], name_or_number: str | int) -> int:
    if isinstance(name_or_number, int):
        return name_or_number
    (port,) = [p["containerPort"] for p in container["ports"] if p["name"] == name_or_number]
    return int(port)


def test_ports_and_probes_match_what_the_services_serve() -> None:
    served = {
        "edge": lambda env: load_settings(EdgeSettings, env).edge_port,
        "worker": lambda env: load_settings(WorkerSettings, env).worker_ops_port,
        "streams": lambda env: load_settings(StreamsSettings, env).streams_port,
    }
    for _workload, container in sluice_containers():
        command = resolve_sluice_command(container["args"]).split()[0]
        if command not in served:
            continue
        env = container_env(container)
        port = served[command](env)
        assert [p["containerPort"] for p in container["ports"]] == [port]
        probes = [container[k] for k in ("startupProbe", "livenessProbe", "readinessProbe") if k in container]
        assert {p["httpGet"]["path"] for p in probes} == set(PROBES)
        assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
        assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
        for probe in probes:
            assert _port(container, probe["httpGet"]["port"]) == port
        # a non-loopback bind needs the ops token (the services refuse to start otherwise)
        assert load_settings(PlatformSettings, env).ops_token


def test_services_select_pods_and_target_their_ports() -> None:
    for service in of_kind("Service"):
        selector = service["spec"]["selector"]
        matches = [
            w for w in workloads() if selector.items() <= w["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert len(matches) == 1, service["metadata"]["name"]
        containers = matches[0]["spec"]["template"]["spec"]["containers"]
        names = {p["name"] for c in containers for p in c["ports"]}
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in names, (service["metadata"]["name"], port)


def test_selectors_match_templates_and_budgets_select_pods() -> None:
    for workload in workloads():
        if workload["kind"] == "Job":
            continue
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert workload["spec"]["selector"]["matchLabels"].items() <= labels.items()
        assert labels["app.kubernetes.io/part-of"] == "sluicegate"
    for pdb in of_kind("PodDisruptionBudget"):
        wanted = pdb["spec"]["selector"]["matchLabels"].items()
        assert any(wanted <= w["spec"]["template"]["metadata"]["labels"].items() for w in workloads())


def test_commands_are_real_sluice_subcommands() -> None:
    seen = set()
    for _workload, container in sluice_containers():
        assert container["image"] == IMAGE
        assert "command" not in container, "the image's entrypoint is `sluice`"
        seen.add(resolve_sluice_command(container["args"]))
    assert seen == {"topics apply", "warehouse migrate", "edge", "worker", "streams"}
    with pytest.raises(UsageError):
        resolve_sluice_command(["worker", "--modle", "demo-gpt"])
    with pytest.raises(UsageError):
        resolve_sluice_command(["topic", "apply"])
    init = named("Job", "sluice-init")["spec"]["template"]["spec"]
    assert [c["args"] for c in init["initContainers"]] == [["topics", "apply"]]
    assert [c["args"] for c in init["containers"]] == [["warehouse", "migrate"]]


def test_kafka_cluster() -> None:
    kafka = named("StatefulSet", "kafka")
    assert kafka["spec"]["replicas"] == 3
    (container,) = kafka["spec"]["template"]["spec"]["containers"]
    image, tag = container["image"].split(":")
    assert image == "apache/kafka"
    assert tag == PlatformSettings().kafka_version
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["KAFKA_PROCESS_ROLES"] == "broker,controller"
    assert env["KAFKA_MIN_INSYNC_REPLICAS"] == "2"
    assert env["KAFKA_DEFAULT_REPLICATION_FACTOR"] == "3"
    assert env["KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR"] == "3"
    headless = named("Service", kafka["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    voters = env["KAFKA_CONTROLLER_QUORUM_VOTERS"].split(",")
    assert voters == [f"{i}@kafka-{i}.{headless['metadata']['name']}:9093" for i in range(3)]
    # Namespace-qualified names everywhere a client is sent: KEDA's scaler runs in its own namespace and
    # resolved the short ones there (an audit: worker autoscaling never ran).
    namespace = yaml.safe_load((K8S / "kustomization.yaml").read_text())["namespace"]
    bootstrap = named("ConfigMap", "sluice-config")["data"]["SLUICE_KAFKA_BOOTSTRAP"]
    host = f"{headless['metadata']['name']}.{namespace}.svc"
    assert bootstrap.split(",") == [f"kafka-{i}.{host}:9092" for i in range(3)]
    advertised = dict(item.split("://", 1) for item in env["KAFKA_ADVERTISED_LISTENERS"].split(","))
    assert advertised["CLIENT"] == f"$(POD_NAME).{headless['metadata']['name']}.$(POD_NAMESPACE).svc:9092"
    assert {
        "name": "POD_NAMESPACE",
        "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}},
    } in container["env"]
    listeners = dict(item.split(":", 1) for item in env["KAFKA_LISTENER_SECURITY_PROTOCOL_MAP"].split(","))
    platform = load_settings(
        PlatformSettings, named("ConfigMap", "sluice-config")["data"] | {"SLUICE_KAFKA_SASL_PASSWORD": "x"}
    )
    assert listeners["CLIENT"] == platform.kafka_security_protocol
    assert env["KAFKA_SASL_ENABLED_MECHANISMS"] == platform.kafka_sasl_mechanism
    assert f"user_{platform.kafka_sasl_username}=" in env["KAFKA_LISTENER_NAME_CLIENT_PLAIN_SASL_JAAS_CONFIG"]
    assert named("PodDisruptionBudget", "kafka")["spec"]["maxUnavailable"] == 1
    # Not the volume's root: an ext4 volume (EKS, GKE, AKS, ceph-block) has lost+found there, which the
    # broker takes for a partition folder it cannot read, and refuses to start (a review).
    claims = {template["metadata"]["name"] for template in kafka["spec"]["volumeClaimTemplates"]}
    roots = {m["mountPath"].rstrip("/") for m in container["volumeMounts"] if m["name"] in claims}
    for log_dir in env["KAFKA_LOG_DIRS"].split(","):
        assert log_dir.rstrip("/") not in roots, f"KAFKA_LOG_DIRS {log_dir} is a volume's root"
        assert any(log_dir.startswith(f"{root}/") for root in roots), f"{log_dir} is on no volume"


def test_autoscaled_workloads_leave_their_replica_count_to_the_autoscaler() -> None:
    """``kubectl apply`` sets every field the manifest names: a Deployment naming ``replicas`` was taken
    back to it at every apply the operations guide asks for (an upgrade, a config change), under load its
    N workers to 1 until KEDA scaled out again (a review)."""
    owned = [hpa["spec"]["scaleTargetRef"] for hpa in of_kind("HorizontalPodAutoscaler")]
    owned += [scaled["spec"]["scaleTargetRef"] for scaled in of_kind("ScaledObject")]
    assert len(owned) >= 3
    for target in owned:
        workload = named(target.get("kind", "Deployment"), target["name"])
        assert "replicas" not in workload["spec"], target["name"]


def test_worker_autoscaling_follows_the_workers_consumer_group() -> None:
    config = named("ConfigMap", "sluice-config")["data"]
    platform = load_settings(PlatformSettings, config | {"SLUICE_KAFKA_SASL_PASSWORD": "x"})
    names = TopicNames(platform.topic_prefix)
    scaled = {d["spec"]["scaleTargetRef"]["name"]: d for d in of_kind("ScaledObject")}
    models = set()
    for deployment in of_kind("Deployment"):
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        if resolve_sluice_command(container["args"]) != "worker":
            continue
        model = container["args"][container["args"].index("--model") + 1]
        models.add(model)
        env = container_env(container)
        version = load_settings(WorkerSettings, env).worker_version
        assert version is not None
        assert re.fullmatch(r"[0-9a-f]{12}", version), "a content hash (see `sluice models list`)"
        so = scaled[deployment["metadata"]["name"]]
        (trigger,) = so["spec"]["triggers"]
        meta = trigger["metadata"]
        assert meta["consumerGroup"] == worker_group(model, version)
        assert meta["topic"] == names.requests(model)
        assert meta["bootstrapServers"] == platform.kafka_bootstrap
        assert 1 <= so["spec"]["minReplicaCount"] < so["spec"]["maxReplicaCount"] <= TopicSizing().requests
        behavior = so["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
        assert behavior["scaleDown"]["stabilizationWindowSeconds"] >= 300
        assert (
            behavior["scaleUp"]["stabilizationWindowSeconds"]
            < behavior["scaleDown"]["stabilizationWindowSeconds"]
        )
        assert trigger["authenticationRef"]["name"] in {
            d["metadata"]["name"] for d in of_kind("TriggerAuthentication")
        }
    assert models == set(platform.served_models())
    # KEDA authenticates as the platform does
    auth = named("Secret", "keda-kafka-auth")["stringData"]
    assert auth["username"] == platform.kafka_sasl_username
    assert (
        auth["sasl"]
        == {"PLAIN": "plaintext", "SCRAM-SHA-256": "scram_sha256", "SCRAM-SHA-512": "scram_sha512"}[
            platform.kafka_sasl_mechanism
        ]
    )
    assert auth["tls"] == ("enable" if platform.kafka_security_protocol.endswith("SSL") else "disable")


def test_edge_autoscaling() -> None:
    hpa = named("HorizontalPodAutoscaler", "edge")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "edge"}
    assert [m["resource"]["name"] for m in hpa["spec"]["metrics"]] == ["cpu"]
    assert hpa["spec"]["maxReplicas"] <= TopicSizing().replies
    assert named("PodDisruptionBudget", "edge")["spec"]["minAvailable"] >= 1
    edge = named("Deployment", "edge")["spec"]["template"]["spec"]
    env = container_env(edge["containers"][0])
    grace = load_settings(EdgeSettings, env).edge_shutdown_grace_s
    assert grace + 5 < edge["terminationGracePeriodSeconds"], (
        "streams finish before the kubelet kills the edge"
    )
    mounted = {m["mountPath"] for m in edge["containers"][0]["volumeMounts"]}
    tenants = load_settings(EdgeSettings, env).edge_tenants_file
    assert tenants is not None
    assert tenants.rsplit("/", 1)[0] in mounted
    secret = named("Secret", edge["volumes"][0]["secret"]["secretName"])
    assert tenants.rsplit("/", 1)[1] in secret["stringData"]


def _load_tenants(text: str) -> Any:
    import tempfile
    from pathlib import Path

    from ingest.auth import TenantDirectory

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tenants.toml"
        path.write_text(text, encoding="utf-8")
        return TenantDirectory.from_file(path)


def test_tenants_file_loads_once_its_placeholder_digest_is_replaced() -> None:
    import hashlib
    import re as regex

    raw = named("Secret", "sluice-tenants")["stringData"]["tenants.toml"]
    digest = hashlib.sha256(TENANT_KEY.encode()).hexdigest()
    replaced = regex.sub(r'key_sha256 = \["[^"]*"\]', f'key_sha256 = ["{digest}"]', raw)
    assert replaced != raw
    assert _load_tenants(replaced).authenticate(f"Bearer {TENANT_KEY}").name == "acme"


def test_the_committed_placeholders_for_public_secrets_do_not_work() -> None:
    """The edge's port is public. Its tenants file held the digest of "replace-me" and the ops token a
    valid placeholder, so `kubectl apply -k` with the files unchanged served both. Now each placeholder is
    invalid: the edge (and every service, for the token) refuses to start until it is replaced."""
    from ingest.errors import CatalogueError

    raw = named("Secret", "sluice-tenants")["stringData"]["tenants.toml"]
    with pytest.raises(CatalogueError, match="key_sha256"):
        _load_tenants(raw)
    for _workload, container in sluice_containers():
        env = container_env(container, operator={})
        with pytest.raises(ValueError, match="SLUICE_OPS_TOKEN"):
            load_settings(PlatformSettings, env)


def test_grafana_gets_a_read_only_clickhouse_user() -> None:
    """Grafana (namespace monitoring, allowed to ClickHouse by a NetworkPolicy) runs any SQL its users type:
    its datasource must not log in as `sluice`, the platform's read-write user. ClickHouse gets the same
    read-only `grafana_reader` as the compose file, with its own password."""
    from tests.infra.test_compose import COMPOSE_DIR

    users = named("ConfigMap", "clickhouse-users")["data"]
    compose_file = COMPOSE_DIR / "clickhouse" / "grafana-reader.xml"
    assert users[compose_file.name] == compose_file.read_text(encoding="utf-8")
    clickhouse = named("StatefulSet", "clickhouse")["spec"]["template"]["spec"]
    (container,) = clickhouse["containers"]
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == "users"]
    assert mount["mountPath"] == f"/etc/clickhouse-server/users.d/{compose_file.name}"
    assert mount["subPath"] == compose_file.name
    (volume,) = [v for v in clickhouse["volumes"] if v["name"] == "users"]
    assert volume["configMap"]["name"] == "clickhouse-users"
    env = container_env(container)
    assert env["CLICKHOUSE_USER"] == "sluice"
    assert 'from_env="GRAFANA_CLICKHOUSE_PASSWORD"' in users[compose_file.name]
    assert env["GRAFANA_CLICKHOUSE_PASSWORD"] not in ("", env["CLICKHOUSE_PASSWORD"])


def _allows(policy: dict[str, Any], pod_labels: dict[str, str], port: int) -> list[list[dict[str, Any]]]:
    """The `from` lists of the policy's rules that open ``port`` on a pod with ``pod_labels``."""
    selector = policy["spec"]["podSelector"]
    if not selector.get("matchLabels", {}).items() <= pod_labels.items():
        return []
    for expr in selector.get("matchExpressions", []):
        assert expr["operator"] == "In"
        if pod_labels.get(expr["key"]) not in expr["values"]:
            return []
    return [
        rule.get("from", [])
        for rule in policy["spec"].get("ingress", [])
        if any(p["port"] == port for p in rule["ports"])
    ]


def _pods() -> dict[str, dict[str, str]]:
    return {w["metadata"]["name"]: w["spec"]["template"]["metadata"]["labels"] for w in workloads()}


def test_network_policies() -> None:
    policies = of_kind("NetworkPolicy")
    deny = named("NetworkPolicy", "default-deny-ingress")
    assert deny["spec"] == {"podSelector": {}, "policyTypes": ["Ingress"]}
    pods = _pods()

    def sources(workload: str, port: int) -> list[list[dict[str, Any]]]:
        return [f for p in policies for f in _allows(p, pods[workload], port)]

    # the edge: from anywhere (a rule without `from`)
    assert [] in sources("edge", 8080)
    # Kafka clients: the platform's pods and KEDA, nobody else
    (clients,) = sources("kafka", 9092)
    assert {"podSelector": {"matchLabels": {"app.kubernetes.io/part-of": "sluicegate"}}} in clients
    assert {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "keda"}}} in clients
    assert all(
        "namespaceSelector" not in s
        or s["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"] == "keda"
        for s in clients
    )
    for port in (9093, 9094):
        assert sources("kafka", port) == [
            [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "kafka"}}}]
        ]
    monitoring = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
    # ops ports: from the monitoring namespace only
    for pod, ops_port in (("worker-demo-gpt", 9400), ("worker-all-minilm-l6-v2", 9400), ("streams", 8090)):
        assert sources(pod, ops_port) == [monitoring], pod
    # every port a pod exposes is opened by some policy (else default-deny would cut it off)
    for workload in workloads():
        for container in workload["spec"]["template"]["spec"]["containers"]:
            for port in container.get("ports", []):
                assert sources(workload["metadata"]["name"], port["containerPort"]), (
                    workload["metadata"]["name"],
                    port,
                )
