"""The platform's Prometheus metrics: one catalogue, shared by the services, the SLO rules and the docs.

Every metric is defined here, once, in the process-wide default registry (a process that runs an edge and
workers, as the tests do, exposes all of them on each ``/metrics``). Names follow Prometheus conventions
(``sluice_`` prefix, base units in the name, ``_total`` on counters); ``docs/metrics.md`` lists them and
compares them with vLLM's ``vllm:*`` set.

Labels are bounded: ``tenant`` goes through :func:`tenant_label`, which keeps the first
``metrics_max_tenants`` tenants a process sees and folds the rest into ``"other"``; ``model`` and
``version`` come from the served catalogue; ``reason``/``outcome``/``status``/``verdict`` are closed sets.
Drift metrics are kept for the all-tenant scope only (no ``tenant`` label); their ``feature`` label is the
drift features' fixed set.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar, cast, get_args

from prometheus_client import (
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.metrics_core import Metric

from schemas.events import DriftVerdict

CONTENT_TYPE = CONTENT_TYPE_LATEST

disable_created_metrics()  # type: ignore[no-untyped-call]  # no *_created series: they double the exposition and no rule uses them

# Seconds. TTFT/queue-wait/e2e boundaries are also the thresholds an SLO may name (see monitoring.slo).
LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.75,
    1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075,
    0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
)  # fmt: skip
STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 256)
DRIFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0)

OTHER_TENANT = "other"

# Label sets, named once so the rules and the tests agree with the code.
REQUEST_LABELS = ("tenant", "model", "version")
WORKER_LABELS = ("model", "version")
DRIFT_LABELS = ("model", "version")
"""``version`` is the report's ``model_version`` (the manifest's, as in the other metrics)."""
DRIFT_VERDICTS: tuple[DriftVerdict, ...] = get_args(DriftVerdict)


class _TenantBound:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def label(self, tenant: str) -> str:
        if tenant in self._seen:
            return tenant
        with self._lock:
            if len(self._seen) < self.limit:
                self._seen.add(tenant)
                return tenant
        return OTHER_TENANT


_tenants = _TenantBound(50)


def bound_tenants(limit: int) -> None:
    """Set how many distinct tenants get their own label value in this process (settings, at start-up)."""
    _tenants.limit = limit


def tenant_label(tenant: str) -> str:
    """``tenant``, or ``"other"`` once the process has seen its limit of distinct tenants."""
    return _tenants.label(tenant)


M = TypeVar("M", bound=MetricWrapperBase)


class Children:
    """``children(metric, *labels)``: ``metric.labels(*labels)``, remembered. prometheus_client's
    ``labels()`` validates and locks at every call (~5 us); a worker's model thread called it six times per
    request and five per step (4 % of its time under load, docs/perf). Label sets are bounded (tenants go
    through :func:`tenant_label`); past ``limit`` the cache starts over. One per thread: not locked."""

    def __init__(self, limit: int = 4096) -> None:
        self._limit = limit
        self._known: dict[tuple[int, tuple[str, ...]], MetricWrapperBase] = {}

    def __call__(self, metric: M, *labels: str) -> M:
        key = (id(metric), labels)
        child = self._known.get(key)
        if child is None:
            if len(self._known) >= self._limit:
                self._known.clear()
            child = self._known[key] = metric.labels(*labels)
        return cast(M, child)


# ---------------------------------------------------------------- edge (what clients see)

REQUESTS = Counter(
    "sluice_requests",
    "Requests that ended, by outcome: completed, failed, cancelled, expired (deadline), shed (refused by "
    "the server: overload, shutdown, Kafka unavailable). Client errors (4xx) are in sluice_rejections_total.",
    (*REQUEST_LABELS, "outcome"),
)
REJECTIONS = Counter(
    "sluice_rejections",
    "Requests refused at the edge with a 4xx/5xx before or instead of running, by error code; a client's "
    "error that a worker found (a prompt too long for it, answered 400) included.",
    ("tenant", "model", "status", "reason"),
)
TTFT = Histogram(
    "sluice_time_to_first_token_seconds",
    "Streamed requests: from the request reaching the edge to its first token written to the client.",
    REQUEST_LABELS,
    buckets=LATENCY_BUCKETS,
)
ITL = Histogram(
    "sluice_inter_token_latency_seconds",
    "Streamed requests: gap between two chunks written to the client divided by the tokens in the later "
    "one, observed once per token.",
    REQUEST_LABELS,
    buckets=ITL_BUCKETS,
)
E2E = Histogram(
    "sluice_e2e_request_latency_seconds",
    "From the request reaching the edge to its terminal event (completed requests).",
    REQUEST_LABELS,
    buckets=LATENCY_BUCKETS,
)
IN_FLIGHT = Gauge(
    "sluice_edge_requests_in_flight",
    "Requests the edge is serving now (submitted or resumed streams).",
    ("model",),
)
PROMPT_TOKENS = Counter(
    "sluice_prompt_tokens",
    "Prompt tokens of requests that ended, as reported to clients (usage.prompt_tokens).",
    REQUEST_LABELS,
)
GENERATION_TOKENS = Counter(
    "sluice_generation_tokens",
    "Completion tokens of requests that ended, as reported to clients (usage.completion_tokens).",
    REQUEST_LABELS,
)
CANCELS = Counter(
    "sluice_cancels",
    "Cancels the edge published, by reason (client_disconnect, client_cancel, deadline, shutdown).",
    ("model", "reason"),
)

BATCHES = Gauge(
    "sluice_batches",
    "Async batches this edge runs now, by status (validating, in_progress, cancelling, finalizing).",
    ("status",),
)
BATCH_LINES_IN_FLIGHT = Gauge(
    "sluice_batch_lines_in_flight",
    "Batch lines this edge published that have not ended yet (at most SLUICE_EDGE_BATCH_MAX_IN_FLIGHT).",
    ("model",),
)
BATCH_LINES = Counter(
    "sluice_batch_lines",
    "Batch lines that ended, by outcome: completed, failed (for good), retried (a retriable failure; the "
    "line runs again).",
    ("model", "outcome"),
)

# ---------------------------------------------------------------- workers (what the model does)

WORKER_RUNNING = Gauge(
    "sluice_worker_running_requests", "Requests in the running batch (generation) or batch being embedded.",
    ("model",),
)  # fmt: skip
WORKER_WAITING = Gauge(
    "sluice_worker_waiting_requests",
    "Requests accepted by the worker and waiting for a batch slot.",
    ("model",),
)
TOKEN_BUDGET = Gauge(
    "sluice_worker_token_budget_usage_ratio",
    "Share of the running batch's token budget (prompt + max new tokens) in use, 0..1.",
    ("model",),
)
BATCH_SIZE = Histogram(
    "sluice_worker_batch_size",
    "Sequences per forward pass (one decode step, or one embedding batch).",
    ("model",),
    buckets=BATCH_BUCKETS,
)
STEP_SECONDS = Histogram(
    "sluice_worker_step_seconds",
    "Duration of one unit of model work (one decode step for the whole batch, one embedding batch).",
    ("model",),
    buckets=STEP_BUCKETS,
)
QUEUE_WAIT = Histogram(
    "sluice_worker_queue_wait_seconds",
    "From the worker consuming a request to the request joining a batch.",
    WORKER_LABELS,
    buckets=LATENCY_BUCKETS,
)
WORKER_TTFT = Histogram(
    "sluice_worker_time_to_first_token_seconds",
    "Generation: from the worker consuming a request to its first generated token.",
    WORKER_LABELS,
    buckets=LATENCY_BUCKETS,
)
WORKER_E2E = Histogram(
    "sluice_worker_request_seconds",
    "From the worker consuming a request to its terminal event.",
    WORKER_LABELS,
    buckets=LATENCY_BUCKETS,
)
WORKER_OUT_OF_MEMORY = Counter(
    "sluice_worker_out_of_memory",
    "Forward passes that ran out of memory (the batch ran in halves, or the step's sequences ended worker_oom).",
    ("model",),
)
WORKER_DRIFT_EMBEDDED = Counter(
    "sluice_worker_drift_embeddings",
    "Drift-sampled prompts embedded (a generation worker's drift embedder, off the model thread).",
    ("model",),
)
WORKER_DRIFT_SKIPPED = Counter(
    "sluice_worker_drift_embeddings_skipped",
    "Drift-sampled prompts left without their embedding: the embedder's budget was spent, its queue was full, "
    "or the prompt waited past its limit.",
    ("model",),
)
WORKER_QUIET_BATCHES = Counter(
    "sluice_worker_quiet_batches",
    "Embedding batches run on the worker's quiet team (small, nothing waiting: torch also on the cores the "
    "worker does not own; SLUICE_WORKER_QUIET_THREADS).",
    ("model",),
)
WORKER_BATCH_LIMIT = Gauge(
    "sluice_worker_batch_limit_ratio",
    "The batch limit now over the configured one: 1, or less for a while after running out of memory.",
    ("model",),
)
WORKER_REQUESTS = Counter(
    "sluice_worker_requests",
    "Terminal events a worker produced, by status (completed, failed, cancelled, expired).",
    (*WORKER_LABELS, "status"),
)
WORKER_PROMPT_TOKENS = Counter(
    "sluice_worker_prompt_tokens", "Prompt tokens processed (prefill), re-runs included.", REQUEST_LABELS
)
WORKER_GENERATION_TOKENS = Counter(
    "sluice_worker_generation_tokens", "Tokens generated, re-runs included.", REQUEST_LABELS
)
MODEL_MEMORY = Gauge(
    "sluice_model_memory_bytes",
    "Memory held by the loaded model: parameters and buffers (CPU), or allocated device memory (CUDA).",
    ("model", "device"),
)
MODEL_INFO = Gauge(
    "sluice_model_info", "1 for each model version a worker serves.", ("model", "version", "device", "worker")
)

# ---------------------------------------------------------------- Kafka (every service)

CONSUMER_LAG = Gauge(
    "sluice_consumer_lag",
    "Records between the partition's end and the consumer group's committed offset (before any commit: "
    "the position handed to the application), from librdkafka statistics every few seconds.",
    ("group", "topic", "partition"),
)
CONSUMER_REPLACED = Counter(
    "sluice_consumer_replaced",
    "Kafka consumers replaced because their group membership did not settle in time (a client wedged "
    "after a broker stall), by group.",
    ("group",),
)
DEAD_LETTERS = Counter(
    "sluice_dead_letters",
    "Records sent to the dead-letter topic, by source topic and reason.",
    ("topic", "reason"),
)


# ---------------------------------------------------------------- streams (the event log into the warehouse)

STREAMS_EVENTS = Counter(
    "sluice_streams_events",
    "Events the streams worker wrote to the warehouse, by topic and type.",
    ("topic", "type"),
)
STREAMS_FRESHNESS = Histogram(
    "sluice_streams_freshness_seconds",
    "From an event's time to its rows being written to the warehouse (queryable).",
    buckets=LATENCY_BUCKETS,
)
STREAMS_INSERT_SECONDS = Histogram(
    "sluice_streams_insert_seconds",
    "Duration of one warehouse write (every table of one batch).",
    buckets=STEP_BUCKETS,
)
STREAMS_BATCH_SIZE = Histogram(
    "sluice_streams_batch_size",
    "Events per warehouse write.",
    buckets=(1, 10, 50, 100, 500, 1000, 2000, 5000, 10000),
)
STREAMS_AUDIT_ENTRIES = Counter(
    "sluice_streams_audit_entries", "Entries appended to the tenants' audit chains."
)
STREAMS_AUDIT_HEALED = Counter(
    "sluice_streams_audit_healed",
    "Audit entries re-inserted into audit_log from the audit topic at start (the warehouse was behind).",
)
STREAMS_AUDIT_CONFLICTS = Gauge(
    "sluice_streams_audit_conflicts",
    "Audit chains whose warehouse rows disagree with the audit topic; their rows are withheld from audit_log.",
)

# ---------------------------------------------------------------- drift (streams; all-tenant reports only)

DRIFT_DETECTED = Gauge(
    "sluice_drift_detected",
    "1 when the latest all-tenant drift report of the model version says drift, else 0.",
    DRIFT_LABELS,
)
DRIFT_VERDICT = Gauge(
    "sluice_drift_verdict",
    "1 for the verdict of the latest all-tenant drift report of the model version, 0 for the other four "
    "(reference, no_drift, drift, insufficient_data, data_quality).",
    (*DRIFT_LABELS, "verdict"),
)
DRIFT_FEATURE_STATISTIC = Gauge(
    "sluice_drift_feature_statistic",
    "The latest all-tenant report's test statistic per feature: a p-value for p-value tests (ks, "
    "chisquare, z; drift when below the threshold), a distance for distance tests (mmd; drift when above).",
    ("model", "feature"),
)
DRIFT_FEATURE_DRIFTED = Gauge(
    "sluice_drift_feature_drifted",
    "1 when the latest all-tenant report found the feature drifted, else 0.",
    ("model", "feature"),
)
DRIFT_QUALITY_ISSUES = Gauge(
    "sluice_drift_quality_issues",
    "Data-quality findings (features missing or out of range, embeddings not sampled) in the latest "
    "all-tenant drift report of the model version.",
    DRIFT_LABELS,
)
DRIFT_LAST_REPORT = Gauge(
    "sluice_drift_last_report_timestamp_seconds",
    "Unix time of the end of the window the latest all-tenant drift report of the model covers.",
    ("model",),
)
DRIFT_REPORTS = Counter(
    "sluice_drift_reports", "All-tenant drift reports published, by verdict.", ("model", "verdict")
)
DRIFT_EVALUATION_SECONDS = Histogram(
    "sluice_drift_evaluation_seconds",
    "Duration of one drift evaluation: the statistical tests of one window and scope (every scope, tenants "
    "included), its samples already loaded.",
    buckets=DRIFT_BUCKETS,
)

# ---------------------------------------------------------------- rollouts (streams: the rollout controller)

ROLLOUT_TRAFFIC_SHARE = Gauge(
    "sluice_rollout_traffic_share",
    "Share of the model's traffic routed to the version by its latest deployment (0 to 1).",
    ("model", "version"),
)
ROLLOUT_GATE_STATE = Gauge(
    "sluice_rollout_gate_state",
    "The rollout gate's state at the controller's last evaluation: 1 on the current state (pass, fail, "
    "insufficient_data, not_applicable), 0 on the others.",
    ("model", "gate", "state"),
)
ROLLOUT_DECISIONS = Counter(
    "sluice_rollout_decisions",
    "Deployment changes seen by the rollout controller, by action (deploy, promote, rollback, retire) and "
    "actor (operator, controller).",
    ("model", "action", "actor"),
)

_drift_lock = threading.Lock()
_drift_features: dict[str, frozenset[str]] = {}


def record_drift(
    model: str,
    model_version: str,
    verdict: str,
    features: Sequence[tuple[str, float, bool]],
    quality_issues: int,
    window_end_unix: float,
    *,
    restored: bool = False,
) -> None:
    """Set the drift metrics from one all-tenant report (``features``: name, statistic, drifted);
    ``restored``: a report judged before, shown again (a new judge's start), not counted again.

    Call it in window order: the gauges show the report recorded last. A feature the model's previous
    report tested and this one does not (an ``insufficient_data`` window tests none) loses its series
    rather than keep a stale value. ``DRIFT_EVALUATION_SECONDS`` is observed by the caller."""
    if verdict not in DRIFT_VERDICTS:
        raise ValueError(f"unknown drift verdict {verdict!r} (one of {', '.join(DRIFT_VERDICTS)})")
    names = frozenset(name for name, _, _ in features)
    with _drift_lock:
        DRIFT_DETECTED.labels(model, model_version).set(1 if verdict == "drift" else 0)
        for each in DRIFT_VERDICTS:
            DRIFT_VERDICT.labels(model, model_version, each).set(1 if each == verdict else 0)
        DRIFT_QUALITY_ISSUES.labels(model, model_version).set(quality_issues)
        DRIFT_LAST_REPORT.labels(model).set(window_end_unix)
        for name, statistic, drifted in features:
            DRIFT_FEATURE_STATISTIC.labels(model, name).set(statistic)
            DRIFT_FEATURE_DRIFTED.labels(model, name).set(1 if drifted else 0)
        for gone in _drift_features.get(model, frozenset()) - names:
            DRIFT_FEATURE_STATISTIC.remove(model, gone)
            DRIFT_FEATURE_DRIFTED.remove(model, gone)
        _drift_features[model] = names
        if not restored:
            DRIFT_REPORTS.labels(model, verdict).inc()


def forget_drift() -> None:
    """Remove every series of the drift gauges (the reports counter stays: rates cope with it). For a
    streams worker that stops judging drift (its control partition revoked): the rules take the ``max``
    over workers, so a 1 it kept from its last verdict fired ``SluiceDriftDetected`` (or
    ``SluiceDriftFeaturePipeline``) for as long as it lived, whatever the new judge reported (a review)."""
    with _drift_lock:
        for gauge in (
            DRIFT_DETECTED, DRIFT_VERDICT, DRIFT_QUALITY_ISSUES, DRIFT_LAST_REPORT, DRIFT_FEATURE_STATISTIC,
            DRIFT_FEATURE_DRIFTED,
        ):  # fmt: skip
            gauge.clear()
        _drift_features.clear()


STREAMS_ONLY = frozenset(
    metric._name
    for metric in (
        STREAMS_EVENTS, STREAMS_FRESHNESS, STREAMS_INSERT_SECONDS, STREAMS_BATCH_SIZE, STREAMS_AUDIT_ENTRIES,
        STREAMS_AUDIT_HEALED, STREAMS_AUDIT_CONFLICTS, DRIFT_DETECTED, DRIFT_VERDICT, DRIFT_FEATURE_STATISTIC,
        DRIFT_FEATURE_DRIFTED, DRIFT_QUALITY_ISSUES, DRIFT_LAST_REPORT, DRIFT_REPORTS, DRIFT_EVALUATION_SECONDS,
        ROLLOUT_TRAFFIC_SHARE, ROLLOUT_GATE_STATE, ROLLOUT_DECISIONS,
    )
)  # fmt: skip
"""Families only the streams worker records. Every process registers every metric (one catalogue), and an
unlabelled one is exported at 0 where nothing records it: the edges and workers served the streams'
``sluice_streams_audit_conflicts 0`` and the like, a Grafana line per target (NaN for a ratio) and an
``absent()`` that could never fire (an audit). Their ``/metrics`` leave these out."""


class _Without:
    """A registry's metrics but the families named (what ``generate_latest`` reads: ``collect``)."""

    def __init__(self, registry: CollectorRegistry, names: frozenset[str]) -> None:
        self._registry, self._names = registry, names

    def collect(self) -> Iterator[Metric]:
        return (family for family in self._registry.collect() if family.name not in self._names)


def exposition(registry: CollectorRegistry = REGISTRY, *, streams: bool = False) -> bytes:
    """The text exposition format of the registry's metrics (what ``/metrics`` serves): the streams
    worker's (``streams``) every one, another service's all but :data:`STREAMS_ONLY`."""
    return generate_latest(registry if streams else _Without(registry, STREAMS_ONLY))


@dataclass(frozen=True)
class MetricInfo:
    name: str
    """As scraped: counters with ``_total``; histograms as their base name."""
    kind: str
    labels: tuple[str, ...]
    help: str


def catalogue() -> list[MetricInfo]:
    """Every sluice metric (for the docs and for tests of the exposition)."""
    return [_info(m) for m in _ALL]


def _info(metric: Counter | Gauge | Histogram) -> MetricInfo:
    kind = metric._type
    name = metric._name + ("_total" if kind == "counter" else "")
    return MetricInfo(name=name, kind=kind, labels=tuple(metric._labelnames), help=metric._documentation)


_ALL: tuple[Counter | Gauge | Histogram, ...] = (
    REQUESTS, REJECTIONS, TTFT, ITL, E2E, IN_FLIGHT, PROMPT_TOKENS, GENERATION_TOKENS, CANCELS,
    BATCHES, BATCH_LINES_IN_FLIGHT, BATCH_LINES,
    WORKER_RUNNING, WORKER_WAITING, TOKEN_BUDGET, BATCH_SIZE, STEP_SECONDS, QUEUE_WAIT, WORKER_TTFT,
    WORKER_E2E, WORKER_REQUESTS, WORKER_PROMPT_TOKENS, WORKER_GENERATION_TOKENS, WORKER_OUT_OF_MEMORY,
    WORKER_BATCH_LIMIT, WORKER_QUIET_BATCHES, WORKER_DRIFT_EMBEDDED, WORKER_DRIFT_SKIPPED, MODEL_MEMORY, MODEL_INFO,
    CONSUMER_LAG, CONSUMER_REPLACED, DEAD_LETTERS, STREAMS_EVENTS, STREAMS_FRESHNESS, STREAMS_INSERT_SECONDS, STREAMS_BATCH_SIZE,
    STREAMS_AUDIT_ENTRIES, STREAMS_AUDIT_HEALED, STREAMS_AUDIT_CONFLICTS, DRIFT_DETECTED, DRIFT_VERDICT, DRIFT_FEATURE_STATISTIC, DRIFT_FEATURE_DRIFTED,
    DRIFT_QUALITY_ISSUES, DRIFT_LAST_REPORT, DRIFT_REPORTS, DRIFT_EVALUATION_SECONDS, ROLLOUT_TRAFFIC_SHARE,
    ROLLOUT_GATE_STATE, ROLLOUT_DECISIONS,
)  # fmt: skip
