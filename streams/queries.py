"""SQL over the warehouse's facts and views: the analysts' saved queries and the dashboard's series.

Every statement is a plain read (``SELECT``) that runs the same on chDB and on a ClickHouse server, so
``sluice sql --saved NAME`` can send it through the owner's read-only query server. Statements that depend
on the SLO targets (error budget, burn rate) are generated from a :class:`monitoring.slo.SloConfig`: each
model's tier gives its availability target, budget and window, as a ``multiIf`` over the tiers' models.

Percentiles over time come from ``request_facts`` rather than from ``sli_minute``: the view holds one
percentile per minute *and tenant and version*, and percentiles cannot be merged, so a per-model
percentile has to be computed from the rows themselves. Counts and spend sum, so they come from the views.

Drift reports (``drift_reports``, from migration 0003) hold one row per window of a model version and scope
(``*`` for all tenants, else a tenant), with the per-feature results as parallel arrays. The table is a
ReplacingMergeTree, so a window published twice counts once: every drift statement reads it with FINAL.

Lines of async batches (``request_facts.batch_id``, from migration 0005) wait in the batch lane by design:
every latency and availability statement leaves them out, as the SLI views do; spend keeps them (billed at
the batch discount). ``batches`` holds each batch's latest state (highest ``seq``; read with FINAL).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from monitoring.slo import DEFAULT_CONFIG, SloConfig, Tier
from schemas.events import CLIENT_ERROR_CODES

__all__ = [
    "BATCH_PANEL_ROWS",
    "DEFAULT_MINUTES",
    "DRIFT_HISTORY_WINDOWS",
    "DRIFT_MODEL_VERSIONS",
    "DRIFT_TABLE",
    "FAILED_BY_CLIENT",
    "FAILED_BY_SERVICE",
    "MAX_MINUTES",
    "SAVED",
    "SLI_BAD",
    "SLI_GOOD",
    "DashboardSql",
    "SavedQuery",
    "dashboard_sql",
    "saved_queries",
    "sql_string",
]

MAX_MINUTES = 1440
"""The dashboard's longest window (a day): its queries read minute rows, so this bounds their cost."""
DEFAULT_MINUTES = 60
DRIFT_TABLE = "drift_reports"
DRIFT_MODEL_VERSIONS = 50
"""The most model versions the dashboard's drift panel shows (the first by model and version)."""
DRIFT_HISTORY_WINDOWS = 50
"""The most windows per model version in the drift panel's history strip (the latest ones)."""

BATCH_PANEL_ROWS = 50
"""The most batches the dashboard's batch panel shows: the active ones first, then the newest."""


@dataclass(frozen=True)
class SavedQuery:
    description: str
    sql: str


def sql_string(value: str) -> str:
    """A ClickHouse single-quoted string literal."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


_CLIENT_CODES = ", ".join(sql_string(code) for code in sorted(CLIENT_ERROR_CODES))
FAILED_BY_CLIENT = f"(status = 'failed' AND error_code IN ({_CLIENT_CODES}))"
"""A request that failed with a client's error (``schemas.events.CLIENT_ERROR_CODES``: the edge answered it
4xx): in no availability SLI, neither good nor valid."""
FAILED_BY_SERVICE = f"(status = 'failed' AND error_code NOT IN ({_CLIENT_CODES}))"
"""A request that failed through the service's fault: every failure but a client's error."""
SLI_GOOD = "status = 'completed'"
SLI_BAD = f"(status = 'expired' OR {FAILED_BY_SERVICE})"
"""The availability SLI's bad requests, as in monitoring.slo: what the service failed, and what passed its
deadline. Cancelled requests are the client's choice and client errors the client's fault: neither good nor
bad. (Shed requests never reach the facts: the edge refuses them before accepting, so only the Prometheus
rules count them.) The SLI views (``sli_minute``, ``errors_minute``, migration 0007) spell the same out."""


def _num(value: float) -> str:
    """A float literal without representation noise (``1 - 0.995`` is ``0.005``, not ``0.00500…44``)."""
    return f"{value:.10g}"


def _by_tier(config: SloConfig, value: Callable[[Tier], str]) -> str:
    """An expression of ``model`` giving ``value(tier)`` for the tier each model belongs to."""
    default = config.tier(config.default_tier)
    branches = [
        f"model IN ({', '.join(sql_string(m) for m in tier.models)}), {value(tier)}"
        for tier in config.tiers
        if tier.models and tier.name != config.default_tier
    ]
    if not branches:
        return value(default)
    return f"multiIf({', '.join(branches)}, {value(default)})"


def _availability_budget(tier: Tier) -> str:
    return _num(1 - tier.availability)


def _error_budget_left(config: SloConfig) -> str:
    """Per model and objective (availability, and time to first token where the tier has one), over the
    tier's budget window: the error ratio, the budget (``1 - target``), the share of it consumed (``error
    ratio / budget``) and the share left (``1 - consumed``; negative once overspent).

    The inter-token-latency objective counts tokens, which the facts do not hold one by one (only a mean
    and a maximum per request); its budget is in Prometheus (``sluice slo rules``).
    """
    tier = _by_tier(config, lambda t: sql_string(t.name))
    window = _by_tier(config, lambda t: str(t.window_days))
    # and not after now: a worker whose clock ran ahead had its requests counted until that time came (a
    # review; the dashboard and the burn gate were bounded before)
    in_window = f"finished >= now64(3) - toIntervalDay({window}) AND finished <= now64(3)"
    availability = f"""SELECT model, {tier} AS tier, 'availability' AS slo,
        {_by_tier(config, lambda t: _num(t.availability))} AS target,
        {_by_tier(config, _availability_budget)} AS budget, {window} AS window_days,
        toUInt8({SLI_BAD}) AS bad
    FROM request_facts FINAL
    WHERE ({SLI_GOOD} OR {SLI_BAD}) AND {in_window} AND shadow_of = '' AND batch_id = ''"""  # noqa: S608 (from the config)
    selects = [availability]
    # The tiers that can hold a model: the default one, and every other tier that lists models.
    used = [t for t in config.tiers if t.name == config.default_tier or t.models]
    if any(t.ttft is not None for t in used):
        # A tier without a TTFT objective gets NULL target and threshold, and its models no TTFT rows.
        def ttft(field: Callable[[Tier], str]) -> str:
            return _by_tier(config, lambda t: field(t) if t.ttft is not None else "NULL")

        target = ttft(lambda t: _num(t.ttft.target if t.ttft else 0))
        budget = ttft(lambda t: _num(1 - t.ttft.target if t.ttft else 0))
        threshold_ms = ttft(lambda t: _num(t.ttft.threshold_seconds * 1000 if t.ttft else 0))
        selects.append(
            f"""SELECT model, {tier} AS tier, 'ttft' AS slo, assumeNotNull({target}) AS target,
        assumeNotNull({budget}) AS budget, {window} AS window_days,
        toUInt8(assumeNotNull(ttft_ms) > assumeNotNull({threshold_ms})) AS bad
    FROM request_facts FINAL
    WHERE stream AND ttft_ms IS NOT NULL AND ({threshold_ms}) IS NOT NULL AND {in_window}
        AND shadow_of = '' AND batch_id = ''"""  # noqa: S608
        )
    union = "\n    UNION ALL\n    ".join(selects)
    return f"""SELECT
    model,
    tier,
    slo,
    target,
    window_days,
    count() AS events,
    sum(bad) AS bad_events,
    bad_events / events AS error_ratio,
    any(budget) AS error_budget,
    error_ratio / error_budget AS budget_consumed,
    1 - budget_consumed AS budget_left
FROM
(
    {union}
)
GROUP BY model, tier, slo, target, window_days
ORDER BY model, slo"""  # noqa: S608


_TOP_TENANTS = """SELECT
    tenant,
    sum(requests) AS requests,
    sum(prompt_tokens) AS prompt_tokens,
    sum(completion_tokens) AS completion_tokens,
    sum(cost_nanos) AS cost_nanos,
    cost_nanos / 1e9 AS spend_usd
FROM spend_day
WHERE day > toDate(now(), 'UTC') - 30 AND day <= toDate(now(), 'UTC')
GROUP BY tenant
ORDER BY cost_nanos DESC, tenant
LIMIT 20"""

_P99_TTFT = """SELECT
    model,
    model_version,
    count() AS requests,
    countIf(stream) AS streamed,
    quantileExact(0.5)(assumeNotNull(ttft_ms)) AS ttft_p50_ms,
    quantileExact(0.95)(assumeNotNull(ttft_ms)) AS ttft_p95_ms,
    quantileExact(0.99)(assumeNotNull(ttft_ms)) AS ttft_p99_ms,
    min(finished) AS first_seen,
    max(finished) AS last_seen
FROM request_facts FINAL
WHERE ttft_ms IS NOT NULL AND finished >= now64(3) - INTERVAL 1 DAY AND finished <= now64(3)
    AND shadow_of = '' AND batch_id = ''
GROUP BY model, model_version
ORDER BY model, ttft_p99_ms DESC, model_version"""

_ERRORS_BY_REASON = """SELECT
    model,
    reason,
    sum(requests) AS requests,
    uniqExact(tenant) AS tenants,
    max(minute) AS last_seen
FROM errors_minute
WHERE minute >= now() - INTERVAL 1 DAY AND minute <= now()
GROUP BY model, reason
ORDER BY requests DESC, model, reason"""

_SLIS_LAST_HOUR = """SELECT
    model,
    sum(requests) AS requests,
    sum(completed) AS completed,
    sum(errors) AS errors,
    sum(cancelled) AS cancelled,
    if(completed + errors = 0, 1.0, completed / (completed + errors)) AS availability,
    sum(completion_tokens) / 3600 AS tokens_per_s
FROM sli_minute
WHERE minute >= now() - INTERVAL 1 HOUR AND minute <= now()
GROUP BY model
ORDER BY model"""


# Drift reports (``drift_reports``, one row per DriftReport event; ReplacingMergeTree, so read with FINAL).
# The per-feature results are parallel arrays: a feature drifted where ``feature_drifted`` is true.
_DRIFTED_FEATURES = "arrayFilter((name, drifted) -> drifted, feature_names, feature_drifted)"
_DRIFT_SECOND = "'%Y-%m-%d %H:%i:%S'"

# The latest window per key (the newest window end; a tie goes to the later start), then formatted outside
# the subquery so that the formatted columns can keep the table's names.
_DRIFT_STATUS = f"""SELECT
    model,
    model_version,
    scope,
    formatDateTime(window_end, {_DRIFT_SECOND}) AS window_end,
    verdict,
    share_drifted,
    requests,
    arrayStringConcat({_DRIFTED_FEATURES}, ', ') AS drifted_features,
    arrayStringConcat(quality, '\\n') AS quality
FROM
(
    SELECT *
    FROM {DRIFT_TABLE} FINAL
    ORDER BY model, model_version, scope, window_end DESC, window_start DESC
    LIMIT 1 BY model, model_version, scope
)
ORDER BY model, model_version, scope != '*', scope"""  # noqa: S608 (a constant table name)

_DRIFT_HISTORY = f"""SELECT
    formatDateTime(window_start, {_DRIFT_SECOND}) AS window_start,
    formatDateTime(window_end, {_DRIFT_SECOND}) AS window_end,
    model,
    model_version,
    verdict,
    share_drifted,
    requests,
    n_reference,
    n_current,
    arrayStringConcat({_DRIFTED_FEATURES}, ', ') AS drifted_features,
    arrayStringConcat(quality, '\\n') AS quality
FROM
(
    SELECT *, window_end AS ended
    FROM {DRIFT_TABLE} FINAL
    WHERE scope = '*' AND window_end >= now64(3) - INTERVAL 1 DAY
)
ORDER BY ended DESC, model, model_version"""  # noqa: S608


_ROLLOUTS = """SELECT
    model,
    phase,
    stable,
    candidate,
    traffic,
    step + 1 AS step,
    length(JSONExtractArrayRaw(steps)) AS steps,
    action,
    actor,
    reason,
    time
FROM deployments FINAL
ORDER BY model, log_offset DESC, time DESC, event_id DESC
LIMIT 1 BY model"""

_ROLLOUT_TIMELINE = """SELECT
    time,
    model,
    action,
    phase,
    actor,
    traffic,
    step + 1 AS step,
    reason,
    evidence
FROM deployments FINAL
WHERE time >= now64(3) - INTERVAL 7 DAY
ORDER BY model, log_offset, time, event_id"""


# Async batches: each batch's latest state, with what its lines cost so far (the facts of every attempt of
# every line that has finished, at the batch price). The facts are read for the batches shown only (the
# same subquery twice: ClickHouse would inline a WITH anyway, and every statement here starts with SELECT).
_BATCH_ACTIVE = "status IN ('validating', 'in_progress', 'finalizing', 'cancelling')"
_BATCH_SECOND = "'%Y-%m-%d %H:%i:%S'"


def _batches_sql(where: str, limit: int | None) -> str:
    """The batches ``where`` selects (active ones first, then newest first), each with its progress, the
    time it ended (empty while it runs), and its lines' cost so far from ``request_facts``."""
    shown = f"""SELECT *
    FROM batches FINAL
    WHERE {where}
    ORDER BY {_BATCH_ACTIVE} DESC, created_at DESC, batch_id{f" LIMIT {int(limit)}" if limit else ""}"""  # noqa: S608
    return f"""SELECT
    batch_id,
    tenant,
    model,
    status,
    endpoint,
    total,
    completed,
    failed,
    if(total = 0, 0, (completed + failed) / total) AS progress,
    formatDateTime(created_at, {_BATCH_SECOND}) AS created,
    ifNull(formatDateTime(coalesce(completed_at, failed_at, expired_at, cancelled_at), {_BATCH_SECOND}), '')
        AS ended,
    formatDateTime(expires_at, {_BATCH_SECOND}) AS expires,
    error_count,
    output_file_id,
    error_file_id,
    lines_finished,
    cost_nanos,
    cost_nanos / 1e9 AS spend_usd
FROM
(
    {shown}
) AS shown
LEFT JOIN
(
    SELECT tenant, batch_id, uniqExact(batch_index) AS lines_finished, sum(cost_nanos) AS cost_nanos
    FROM request_facts FINAL
    WHERE batch_id IN (SELECT batch_id FROM ({shown})) AND shadow_of = ''
    GROUP BY tenant, batch_id
) AS spent USING (tenant, batch_id)
ORDER BY {_BATCH_ACTIVE} DESC, shown.created_at DESC, batch_id"""  # noqa: S608 (constants and an integer)


_BATCHES = _batches_sql(f"{_BATCH_ACTIVE} OR created_at >= now64(3) - INTERVAL 7 DAY", None)

_PRICES = """SELECT
    decision AS version,
    parseDateTime64BestEffort(JSONExtractString(details, 'effective'), 3, 'UTC') AS effective,
    time AS published,
    actor AS published_by,
    JSONExtractString(details, 'prices') AS prices
FROM audit_log FINAL
WHERE tenant LIKE 'admin:prices:%'
ORDER BY effective"""

_BATCH_SPEND = """SELECT
    toDate(finished) AS day,
    tenant,
    uniqExact(batch_id) AS batches,
    uniqExact(batch_id, batch_index) AS lines,
    count() AS attempts,
    sum(prompt_tokens) AS prompt_tokens,
    sum(completion_tokens) AS completion_tokens,
    sum(cost_nanos) AS cost_nanos,
    cost_nanos / 1e9 AS spend_usd
FROM request_facts FINAL
WHERE batch_id != '' AND shadow_of = ''
    AND toDate(finished) > toDate(now(), 'UTC') - 30 AND toDate(finished) <= toDate(now(), 'UTC')
GROUP BY day, tenant
ORDER BY day DESC, cost_nanos DESC, tenant"""


def saved_queries(config: SloConfig = DEFAULT_CONFIG) -> dict[str, SavedQuery]:
    """The analysts' saved queries, by name; ``error-budget-left`` uses ``config``'s targets."""
    return {
        "top-tenants-by-spend": SavedQuery(
            "Tenants by spend over the last 30 days (UTC days), highest first: requests, tokens, exact "
            "cost in nano-USD and USD.",
            _TOP_TENANTS,
        ),
        "p99-ttft-by-model-version": SavedQuery(
            "Time to first token (ms) per model version over the last 24 hours: p50, p95, p99 of every "
            "request that produced a first token.",
            _P99_TTFT,
        ),
        "error-budget-left": SavedQuery(
            "Per model and objective (availability; TTFT of streamed requests), over the model's tier's "
            "window: error ratio, budget (1 - target), share consumed (error ratio / budget) and share "
            "left (1 - consumed, negative once overspent).",
            _error_budget_left(config),
        ),
        "errors-by-reason": SavedQuery(
            "Availability errors (expired, and failed but for a client's error) over the last 24 hours per "
            "model and reason (the worker's error code, else the status).",
            _ERRORS_BY_REASON,
        ),
        "slis-last-hour": SavedQuery(
            "Per model over the last hour: requests, completed, errors, cancelled, availability and "
            "generated tokens per second.",
            _SLIS_LAST_HOUR,
        ),
        "drift-status": SavedQuery(
            "The latest drift verdict per model, version and scope (* = all tenants, first; then each "
            "tenant): its window's end, verdict (reference, no_drift, drift, insufficient_data, "
            "data_quality), share of features drifted, requests in the window, the drifted features "
            "(comma-separated) and the data-quality findings (one per line).",
            _DRIFT_STATUS,
        ),
        "rollouts": SavedQuery(
            "Each model's latest deployment: phase (stable, warming, canary, promoted, rolled_back), stable and "
            "candidate versions, traffic shares (JSON), step (1-based) of how many, the last action, who "
            "took it (operator or controller), why, and when.",
            _ROLLOUTS,
        ),
        "rollout-timeline": SavedQuery(
            "Every deployment change of the last 7 days per model, oldest first: action, phase, actor, "
            "traffic shares, step, reason and the gate evidence (JSON: gate, state, candidate, baseline, "
            "limit, sample sizes).",
            _ROLLOUT_TIMELINE,
        ),
        "drift-history": SavedQuery(
            "All-tenant drift reports of the last 24 hours, newest window first: window, verdict, share "
            "of features drifted, requests, sample sizes (reference, current), drifted features and "
            "data-quality findings.",
            _DRIFT_HISTORY,
        ),
        "batches": SavedQuery(
            "Async batches still running, and those created in the last 7 days, running first then newest "
            "first: tenant, model, status, endpoint, lines total / completed / failed, progress (share "
            "done), created, ended and expiry times (UTC), input-file errors, output and error file ids, "
            "lines finished and their cost so far (nano-USD and USD, at the batch price).",
            _BATCHES,
        ),
        "batch-spend": SavedQuery(
            "Spend on async batch lines per UTC day and tenant over the last 30 days, newest day first: "
            "batches, lines, tokens and exact cost (at the batch price) in nano-USD and USD.",
            _BATCH_SPEND,
        ),
        "prices": SavedQuery(
            "Every price table published on the log, in the order they came into force: version, "
            "from when (UTC), when and by whom it was published, and the table (JSON: micro-USD per 1k "
            "prompt and completion tokens and per worker-second, per model and the default; the batch "
            "discount). A request is priced by the table in force when it was accepted.",
            _PRICES,
        ),
    }


SAVED: dict[str, SavedQuery] = saved_queries()
"""The saved queries with the built-in SLO targets (``saved_queries(config)`` for another config)."""


# ---------------------------------------------------------------- the dashboard


@dataclass(frozen=True)
class DashboardSql:
    """The dashboard's statements for one window of ``minutes`` whole minutes (the current one included);
    the drift statements show the latest reports whatever the window (a drift window is often longer).

    Minutes come back as ``'YYYY-MM-DD HH:MM:SS'`` strings in UTC, which Plotly reads as dates as they are.
    """

    latency: str
    """Per minute and model: requests and exact TTFT p50/p95/p99 and ITL p50/p99 (ms). The ITL percentiles
    are of each request's mean gap (``itl_mean_ms``), not of every token's as the ITL SLO's: a request with
    one long stall among many fast tokens shows as fast."""
    traffic: str
    """Per minute and model: requests, outcomes, tokens/s, error rate and availability burn rate."""
    spend: str
    """Per tenant over the window, highest spend first (at most 25 tenants); every row also carries the
    window's total spend (``total_nanos``) and number of tenants."""
    drift_exists: str
    """One row, ``present``: whether the drift table is there yet (run the two below only when it is)."""
    drift_status: str
    """The latest all-tenant drift report per model and version (at most 50 of them, by model and version):
    window, verdict, share drifted, requests, sample sizes, drifted features and quality findings."""
    drift_history: str
    """The last :data:`DRIFT_HISTORY_WINDOWS` all-tenant reports per model and version, oldest first:
    window, verdict, share drifted and how many features drifted of how many tested."""
    rollouts_exist: str
    """One row, ``present``: whether the deployments table is there yet."""
    rollouts: str
    """The last :data:`ROLLOUT_HISTORY` deployment changes per model, newest first, with their evidence."""
    batches_exist: str
    """One row, ``present``: whether the batches table is there yet (and ``request_facts.batch_id``)."""
    batches: str
    """The batch panel: every running batch and those created in the last day, at most
    :data:`BATCH_PANEL_ROWS`, with progress and their lines' cost so far."""


ROLLOUT_HISTORY = 20
_ROLLOUTS_EXIST = """SELECT
    (SELECT count() > 0 FROM system.tables WHERE database = currentDatabase() AND name = 'deployments')
        AS present,
    (SELECT count() > 0 FROM system.columns
        WHERE database = currentDatabase() AND table = 'deployments' AND name = 'log_offset') AS positioned"""
# Like drift, the rollout timeline does not follow the dashboard's window: a rollout lasts hours.
_DASHBOARD_ROLLOUTS = """SELECT
    formatDateTime(time, '%Y-%m-%d %H:%i:%S') AS time,
    model,
    action,
    phase,
    actor,
    stable,
    candidate,
    traffic,
    step + 1 AS step,
    length(JSONExtractArrayRaw(steps)) AS steps,
    reason,
    evidence
FROM deployments FINAL
ORDER BY model, {order} DESC, event_id DESC
LIMIT {limit} BY model"""
"""``order``: the control topic's offset, then the decider's time (``log_offset`` is from migration 0006)."""

_BATCHES_EXIST = (
    "SELECT count() > 0 AS present FROM system.tables WHERE database = currentDatabase() AND name = 'batches'"
)
# Like drift and rollouts, the batch panel does not follow the dashboard's window: a batch runs for hours.
_DASHBOARD_BATCHES = _batches_sql(
    f"{_BATCH_ACTIVE} OR created_at >= now64(3) - INTERVAL 1 DAY", BATCH_PANEL_ROWS
)

_DRIFT_EXISTS = (
    "SELECT count() > 0 AS present FROM system.tables "  # noqa: S608 (a constant table name)
    f"WHERE database = currentDatabase() AND name = {sql_string(DRIFT_TABLE)}"
)


# The drift panel does not follow the dashboard's window: a drift window is typically an hour or more, so
# it shows each model version's latest verdict and its last windows, whenever they were.
_DASHBOARD_DRIFT_STATUS = f"""SELECT
    model,
    model_version,
    formatDateTime(window_start, {_DRIFT_SECOND}) AS window_start,
    formatDateTime(window_end, {_DRIFT_SECOND}) AS window_end,
    verdict,
    share_drifted,
    requests,
    n_reference,
    n_current,
    {_DRIFTED_FEATURES} AS drifted_features,
    quality
FROM
(
    SELECT *
    FROM {DRIFT_TABLE} FINAL
    WHERE scope = '*'
    ORDER BY model, model_version, window_end DESC, window_start DESC
    LIMIT 1 BY model, model_version
)
ORDER BY model, model_version
LIMIT {DRIFT_MODEL_VERSIONS}"""  # noqa: S608 (constants)

_DASHBOARD_DRIFT_HISTORY = f"""SELECT
    model,
    model_version,
    formatDateTime(window_start, {_DRIFT_SECOND}) AS window_start,
    formatDateTime(window_end, {_DRIFT_SECOND}) AS window_end,
    verdict,
    share_drifted,
    arrayCount(feature_drifted) AS features_drifted,
    length(feature_names) AS features_tested
FROM
(
    SELECT *, window_end AS ended
    FROM {DRIFT_TABLE} FINAL
    WHERE scope = '*'
    ORDER BY model, model_version, window_end DESC, window_start DESC
    LIMIT {DRIFT_HISTORY_WINDOWS} BY model, model_version
)
ORDER BY model, model_version, ended
LIMIT {DRIFT_MODEL_VERSIONS * DRIFT_HISTORY_WINDOWS}"""  # noqa: S608


def dashboard_sql(
    minutes: int,
    config: SloConfig = DEFAULT_CONFIG,
    *,
    shadows: bool = True,
    batch_lines: bool = True,
    positioned: bool = True,
) -> DashboardSql:
    """``shadows``: the warehouse has rollout shadow rows to leave out (``request_facts.shadow_of``, from
    migration 0004); ``batch_lines``: it has batch lines to leave out of the latencies
    (``request_facts.batch_id``, from migration 0005); ``positioned``: its deployments say where they are
    on the control topic (``log_offset``, from 0006); False for a warehouse migrated by older code."""
    if not 1 <= minutes <= MAX_MINUTES:
        raise ValueError(f"minutes must be between 1 and {MAX_MINUTES}, got {minutes}")
    since = f"toStartOfMinute(now()) - toIntervalMinute({int(minutes) - 1})"
    # and no later than this minute: a worker whose clock ran a day ahead had its requests in every
    # window's tiles until that day came, while the charts (clipped to the window) left them out (a review)
    until = "toStartOfMinute(now()) + toIntervalMinute(1)"
    minute = "formatDateTime(toStartOfMinute(finished), '%Y-%m-%d %H:%i:%S')"
    budget = _by_tier(config, _availability_budget)
    interactive = (" AND shadow_of = ''" if shadows else "") + (" AND batch_id = ''" if batch_lines else "")
    return DashboardSql(
        latency=f"""SELECT
    {minute} AS t,
    model,
    count() AS requests,
    quantileExactIf(0.5)(ttft_ms, ttft_ms IS NOT NULL) AS ttft_p50_ms,
    quantileExactIf(0.95)(ttft_ms, ttft_ms IS NOT NULL) AS ttft_p95_ms,
    quantileExactIf(0.99)(ttft_ms, ttft_ms IS NOT NULL) AS ttft_p99_ms,
    quantileExactIf(0.5)(itl_mean_ms, itl_mean_ms IS NOT NULL) AS itl_p50_ms,
    quantileExactIf(0.99)(itl_mean_ms, itl_mean_ms IS NOT NULL) AS itl_p99_ms
FROM request_facts FINAL
WHERE finished >= {since} AND finished < {until}{interactive}
GROUP BY t, model
ORDER BY model, t""",  # noqa: S608 (an int and expressions built from the config)
        traffic=f"""SELECT
    formatDateTime(minute, '%Y-%m-%d %H:%i:%S') AS t,
    model,
    sum(requests) AS requests,
    sum(completed) AS completed,
    sum(errors) AS errors,
    sum(cancelled) AS cancelled,
    sum(completion_tokens) AS completion_tokens,
    completion_tokens / 60 AS tokens_per_s,
    if(completed + errors = 0, 0, errors / (completed + errors)) AS error_rate,
    error_rate / {budget} AS burn_rate
FROM sli_minute
WHERE minute >= {since} AND minute < {until}
GROUP BY t, model
ORDER BY model, t""",  # noqa: S608
        spend=f"""SELECT
    tenant,
    requests,
    completion_tokens,
    cost_nanos,
    sum(cost_nanos) OVER () AS total_nanos,
    count() OVER () AS tenants
FROM
(
    SELECT tenant, sum(requests) AS requests, sum(completion_tokens) AS completion_tokens,
        sum(cost_nanos) AS cost_nanos
    FROM spend_minute
    WHERE minute >= {since} AND minute < {until}
    GROUP BY tenant
)
ORDER BY cost_nanos DESC, tenant
LIMIT 25""",  # noqa: S608
        drift_exists=_DRIFT_EXISTS,
        drift_status=_DASHBOARD_DRIFT_STATUS,
        drift_history=_DASHBOARD_DRIFT_HISTORY,
        rollouts_exist=_ROLLOUTS_EXIST,
        rollouts=_DASHBOARD_ROLLOUTS.format(
            order="log_offset DESC, deployments.time" if positioned else "deployments.time",
            limit=ROLLOUT_HISTORY,
        ),
        batches_exist=_BATCHES_EXIST,
        batches=_DASHBOARD_BATCHES,
    )
