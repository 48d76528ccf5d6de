"""Service level objectives as configuration, and the Prometheus rules that alert on them.

An :class:`SloConfig` names model tiers (each with an availability, a time-to-first-token and an
inter-token-latency objective over an error-budget window), which models belong to which tier, and the
thresholds of the Kafka alerts. :func:`rule_groups` turns it into Prometheus rule groups:

* recording rules ``model:sluice_slo_errors:ratio_rate<window>{slo, tier, model}``: the share of bad
  events of each SLI over each window the alerts need;
* multi-window, multi-burn-rate alerts (``[[alerts.burn]]``, by default the SRE workbook's): page when the
  1h and 5m burn rates both exceed 14.4 (2% of a 30-day budget in an hour) or the 6h and 30m both exceed 6
  (5% in 6 hours); ticket when 1d and 2h exceed 3 or 3d and 6h exceed 1 (10% in a day, 10% in three
  days). The streams worker announces the page pairs as ``BurnRateCrossed`` events
  (``streams/control.py``), from the same configuration. An objective whose budget caps its burn rate
  under a pair's threshold (``1 / budget``: 10 for a 90% target) has that pair alert above
  ``0.9 / budget`` instead (:func:`burn_threshold`), so no pair exists that cannot fire;
* ``SluiceConsumerLag`` and ``SluiceDeadLetters``;
* ``SluiceWorkerOutOfMemory``: a model's forward passes ran out of device memory (requests were split or
  failed ``worker_oom``, and the batch limit is lowered for a while);
* the drift alerts ``SluiceDriftDetected``, ``SluiceDriftFeaturePipeline`` and ``SluiceDriftReportsStale``,
  for model versions that complete requests;
* ``SluiceRolloutRolledBack``: the rollout controller rolled a candidate back (a ticket: serving is safe
  again, a person should read the evidence).

``docs/slo.md`` describes the file format and the reasoning.
"""

from __future__ import annotations

import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
import yaml

from monitoring import MonitoringError
from monitoring.metrics import ITL_BUCKETS, LATENCY_BUCKETS

Severity = Literal["page", "ticket"]
SloName = Literal["availability", "ttft", "itl"]
Share = Annotated[float, msgspec.Meta(gt=0.0, lt=1.0)]
"""A target share of good events, strictly between 0 and 1."""

# The metrics the rules read (monitoring.metrics defines them; tests check the names against it).
REQUESTS_TOTAL = "sluice_requests_total"
TTFT_SECONDS = "sluice_time_to_first_token_seconds"
ITL_SECONDS = "sluice_inter_token_latency_seconds"
CONSUMER_LAG = "sluice_consumer_lag"
DEAD_LETTERS_TOTAL = "sluice_dead_letters_total"
OUT_OF_MEMORY_TOTAL = "sluice_worker_out_of_memory_total"
BATCH_LIMIT = "sluice_worker_batch_limit_ratio"
DRIFT_DETECTED = "sluice_drift_detected"
DRIFT_QUALITY_ISSUES = "sluice_drift_quality_issues"
DRIFT_LAST_REPORT = "sluice_drift_last_report_timestamp_seconds"

# Availability SLI: cancelled requests are the client's choice and count as neither good nor bad.
GOOD_OUTCOMES = ("completed",)
BAD_OUTCOMES = ("failed", "expired", "shed")

RECORD_PREFIX = "model:sluice_slo_errors:ratio_rate"

DRIFT_LOOKBACK = "1d"
"""How far back the stale-report alert looks for a model's last report: the series vanishes when the
streams worker is down, and the alert must still see it."""
MIN_TRAFFIC_WINDOW_S = 300
"""The drift alerts' "completes requests" window is never shorter (it needs a few scrapes)."""


class SloConfigError(MonitoringError, ValueError):
    """An SLO configuration that cannot be read or is not valid (the message says where and why)."""


def _check_threshold(
    slo: str, objective: LatencyObjective | None, buckets: tuple[float, ...], metric: str
) -> None:
    if objective is not None and objective.threshold_seconds not in buckets:
        allowed = ", ".join(_num(b) for b in buckets)
        raise ValueError(
            f"{slo} threshold_seconds {_num(objective.threshold_seconds)} is not a bucket boundary of "
            f"{metric}; allowed: {allowed}"
        )


class LatencyObjective(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    threshold_seconds: Annotated[float, msgspec.Meta(gt=0.0)]
    """Good: an observation at or under this; it must be a bucket boundary of the histogram."""
    target: Share
    """Share of observations that must be good, e.g. 0.95."""


class Tier(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    name: Annotated[str, msgspec.Meta(pattern=r"^[a-z][a-z0-9_-]*$")]
    availability: Share
    """Share of requests (completed + failed + expired + shed) that must complete, e.g. 0.995."""
    ttft: LatencyObjective | None = None
    """Time to first token of streamed requests (buckets ``LATENCY_BUCKETS``). None: no such SLO."""
    itl: LatencyObjective | None = None
    """Inter-token latency, per token (buckets ``ITL_BUCKETS``). None: no such SLO."""
    window_days: Annotated[int, msgspec.Meta(ge=7, le=90)] = 30
    """The error budget's window."""
    models: tuple[str, ...] = ()
    """Models in this tier. The config's ``default_tier`` also takes every model no tier lists."""

    def __post_init__(self) -> None:
        _check_threshold("ttft", self.ttft, LATENCY_BUCKETS, TTFT_SECONDS)
        _check_threshold("itl", self.itl, ITL_BUCKETS, ITL_SECONDS)
        if any(not m for m in self.models):
            raise ValueError(f"tier {self.name!r}: a model id is empty")
        if len(set(self.models)) != len(self.models):
            raise ValueError(f"tier {self.name!r} lists a model twice")

    def objectives(self) -> list[Objective]:
        """Each objective this tier has, availability first."""
        found = [Objective("availability", self.availability, None)]
        if self.ttft is not None:
            found.append(Objective("ttft", self.ttft.target, self.ttft.threshold_seconds))
        if self.itl is not None:
            found.append(Objective("itl", self.itl.target, self.itl.threshold_seconds))
        return found


@dataclass(frozen=True)
class Objective:
    slo: SloName
    target: float
    threshold_seconds: float | None
    """Latency SLOs: the bucket boundary a good observation is at or under; None for availability."""

    @property
    def budget(self) -> float:
        """The error budget: the share of events that may be bad."""
        return 1 - self.target


class ConsumerLagAlert(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    max_records: Annotated[int, msgspec.Meta(ge=1)] = 1000
    """Alert when a group's largest partition lag on a topic stays above this ..."""
    for_minutes: Annotated[int, msgspec.Meta(ge=1)] = 5
    """... for this long."""
    severity: Severity = "page"


class CounterAlert(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    window_minutes: Annotated[int, msgspec.Meta(ge=1)] = 10
    """Alert while the counter rose within this many minutes (a record dead-lettered, a forward pass out
    of memory)."""
    severity: Severity = "ticket"


class DriftAlert(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    window_s: Annotated[float, msgspec.Meta(ge=1.0)] = 300.0
    """The streams worker's drift window, ``SLUICE_DRIFT_WINDOW_S`` (rule generation may be given it)."""
    drift_windows: Annotated[int, msgspec.Meta(ge=1)] = 2
    """``SluiceDriftDetected`` fires once this many consecutive windows say drift (each window has a false
    alarm rate of ``SLUICE_DRIFT_ALPHA``; 1: on the first drift verdict, after a minute)."""
    stale_after_windows: Annotated[int, msgspec.Meta(ge=2)] = 3
    """Alert when a model that completes requests has had no drift report for this many windows (past
    the lateness and interval below)."""
    lateness_s: Annotated[float, msgspec.Meta(ge=0.0)] = 30.0
    """The streams worker's ``SLUICE_DRIFT_LATENESS_S``: a window is reported this long after it ends."""
    interval_s: Annotated[float, msgspec.Meta(gt=0.0)] = 10.0
    """The streams worker's ``SLUICE_DRIFT_INTERVAL_S``: the monitor looks for closed windows this often,
    so a report may come up to this much later still."""
    for_minutes: Annotated[int, msgspec.Meta(ge=1)] = 1
    """How long a data-quality finding holds before ``SluiceDriftFeaturePipeline`` fires."""
    severity: Severity = "ticket"

    @property
    def detected_for_s(self) -> float:
        """A verdict gauge holds one window per report: a minute past ``drift_windows - 1`` windows of
        drift means the next report said drift too."""
        return (self.drift_windows - 1) * self.window_s + 60

    @property
    def stale_windows_s(self) -> float:
        """``stale_after_windows`` windows: how recently a model must have completed requests for its
        reports to be due (a model that stopped serving stops being reported, and must not alert)."""
        return self.window_s * self.stale_after_windows

    @property
    def stale_after_s(self) -> float:
        """The age of the last report's window end past which ``SluiceDriftReportsStale`` fires. A healthy
        report is already up to a window, the lateness and an interval old when the next one comes, so
        those count on top of the windows (a review found the alert firing on a healthy monitor with
        10 s windows, when it counted windows only)."""
        return self.stale_windows_s + self.lateness_s + self.interval_s


def duration(minutes: int) -> str:
    """A PromQL duration: 5m, 30m, 1h, 6h, 1d, 3d."""
    if minutes % 1440 == 0:
        return f"{minutes // 1440}d"
    if minutes % 60 == 0:
        return f"{minutes // 60}h"
    return f"{minutes}m"


class BurnAlert(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One multi-window pair: alert while both windows burn budget faster than the threshold."""

    long_minutes: Annotated[int, msgspec.Meta(ge=2)]
    short_minutes: Annotated[int, msgspec.Meta(ge=1)]
    budget_share: Share
    """Share of the whole budget spent in ``long_minutes`` at exactly the threshold rate."""
    severity: Severity

    def __post_init__(self) -> None:
        if self.short_minutes >= self.long_minutes:
            raise ValueError(
                f"burn pair {self.long}/{self.short}: the short window must be shorter than the long one"
            )

    @property
    def alert(self) -> str:
        """The alert's name, after its long window: ``SluiceErrorBudgetBurn1h``."""
        return f"SluiceErrorBudgetBurn{self.long}"

    def threshold(self, window_days: int) -> float:
        """The burn rate that spends ``budget_share`` of a ``window_days`` budget in the long window
        (14.4, 6, 3 and 1 for 30 days)."""
        return self.budget_share * window_days * 1440 / self.long_minutes

    def budget_share_at(self, threshold: float, window_days: int) -> float:
        """The share of a ``window_days`` budget spent in the long window at a burn rate of ``threshold``
        (``budget_share`` at :meth:`threshold`; less where :func:`burn_threshold` lowered it)."""
        return threshold * self.long_minutes / (window_days * 1440)

    @property
    def long(self) -> str:
        return duration(self.long_minutes)

    @property
    def short(self) -> str:
        return duration(self.short_minutes)


PAGE_ALERTS = (
    BurnAlert(long_minutes=60, short_minutes=5, budget_share=0.02, severity="page"),
    BurnAlert(long_minutes=360, short_minutes=30, budget_share=0.05, severity="page"),
)
TICKET_ALERTS = (
    BurnAlert(long_minutes=1440, short_minutes=120, budget_share=0.10, severity="ticket"),
    BurnAlert(long_minutes=4320, short_minutes=360, budget_share=0.10, severity="ticket"),
)
"""The SRE workbook's pairs: the default of ``[[alerts.burn]]``."""

MAX_BAD_SHARE = 0.9
"""The largest share of bad events a burn-rate alert waits for. The burn rate is the error ratio over the
budget, so it cannot pass ``1 / budget``: a pair whose threshold is at or above that could never fire (the
fast pair's 14.4 for any target under about 93%; a 90% objective burns at most 10x). A review found such
a tier paging hours into a total breach, through the 6h pair only. Such a pair alerts above
``MAX_BAD_SHARE / budget`` for that objective instead (the SRE workbook: for low targets, a page's
threshold must be below ``1 / budget``), so it still fires on a near-total breach."""


def burn_threshold(alert: BurnAlert, window_days: int, budget: float) -> float:
    """The burn rate ``alert`` fires above for an objective with error budget ``budget`` over
    ``window_days``: the pair's :meth:`BurnAlert.threshold`, lowered to ``MAX_BAD_SHARE / budget`` where
    it is higher (Prometheus' rules and the streams worker's ``BurnRateCrossed`` both use this)."""
    return min(alert.threshold(window_days), MAX_BAD_SHARE / budget)


@dataclass(frozen=True)
class LoweredThreshold:
    """A burn pair whose threshold an objective's budget puts out of reach, and what it alerts above."""

    tier: str
    slo: SloName
    target: float
    alert: BurnAlert
    configured: float
    """The pair's own threshold for the tier's window (above ``MAX_BAD_SHARE / budget``)."""
    threshold: float
    """What it alerts above for this objective: ``MAX_BAD_SHARE / budget``."""

    @property
    def text(self) -> str:
        return (
            f"tier {self.tier!r} {self.slo} (target {_pct(self.target)}): {self.alert.alert} "
            f"({self.alert.long}/{self.alert.short}) alerts above {_num(self.threshold)}x, not "
            f"{_num(self.configured)}x: its burn rate cannot pass {_num(1 / (1 - self.target))}x, so the "
            f"pair fires when more than {_pct(MAX_BAD_SHARE)} of its events are bad"
        )


class AlertSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    burn: Annotated[tuple[BurnAlert, ...], msgspec.Meta(min_length=1)] = PAGE_ALERTS + TICKET_ALERTS
    """The burn-rate pairs. The page pairs are also what the streams worker announces as ``BurnRateCrossed``
    events, over the same windows (so its events and Prometheus' pages agree)."""
    tickets: bool = True
    """Also the ticket pairs (by default 1d/2h above 3, 3d/6h above 1), not only the page pairs."""
    consumer_lag: ConsumerLagAlert = ConsumerLagAlert()
    dead_letters: CounterAlert = CounterAlert()
    out_of_memory: CounterAlert = CounterAlert()
    drift: DriftAlert = DriftAlert()

    def __post_init__(self) -> None:
        longs = [a.long for a in self.burn]
        if len(set(longs)) != len(longs):
            raise ValueError(f"burn pairs share a long window (it names the alert): {', '.join(longs)}")


DEFAULT_TIERS = (
    Tier(
        name="interactive",
        availability=0.995,
        ttft=LatencyObjective(threshold_seconds=0.5, target=0.95),
        itl=LatencyObjective(threshold_seconds=0.1, target=0.95),
    ),
    Tier(
        name="batch",
        availability=0.99,
        # 95%, not 90%: a 90% objective burns at most 10x, under the fast pair's 14.4x (a review found a
        # total breach paging hours in); at 95% it pages 43 minutes into one, like interactive's latency
        ttft=LatencyObjective(threshold_seconds=5.0, target=0.95),
        itl=LatencyObjective(threshold_seconds=0.3, target=0.95),
    ),
)


class SloConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    tiers: Annotated[tuple[Tier, ...], msgspec.Meta(min_length=1)] = DEFAULT_TIERS
    default_tier: str = "interactive"
    """The tier of every model that no tier lists."""
    alerts: AlertSettings = AlertSettings()

    def __post_init__(self) -> None:
        names = [t.name for t in self.tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names repeat: {', '.join(names)}")
        if self.default_tier not in names:
            raise ValueError(f"default_tier {self.default_tier!r} is not a tier (tiers: {', '.join(names)})")
        owner: dict[str, str] = {}
        for tier in self.tiers:
            for model in tier.models:
                if model in owner:
                    raise ValueError(f"model {model!r} is in two tiers: {owner[model]!r} and {tier.name!r}")
                owner[model] = tier.name

    def tier(self, name: str) -> Tier:
        return next(t for t in self.tiers if t.name == name)

    def tier_of(self, model: str) -> Tier:
        """The tier whose objectives apply to ``model``."""
        return next((t for t in self.tiers if model in t.models), self.tier(self.default_tier))

    def lowered_thresholds(self) -> list[LoweredThreshold]:
        """Each (tier, objective, alerting pair) whose threshold :func:`burn_threshold` lowers, because
        the objective's budget caps its burn rate under the pair's own. The CLI shows them, the rules
        file's header and each such alert's description name them, and the streams worker logs them."""
        found = []
        for tier in self.tiers:
            for objective in tier.objectives():
                for alert in burn_alerts(self):
                    configured = alert.threshold(tier.window_days)
                    threshold = burn_threshold(alert, tier.window_days, objective.budget)
                    if threshold < configured:
                        found.append(
                            LoweredThreshold(
                                tier.name, objective.slo, objective.target, alert, configured, threshold
                            )
                        )
        return found


DEFAULT_CONFIG = SloConfig()


def load_slo_config(path: Path | None = None) -> SloConfig:
    """The configuration in the TOML file ``path``; the built-in defaults when ``path`` is None.

    Keys left out keep their defaults (a file with only ``[alerts.consumer_lag]`` keeps the default tiers).
    """
    if path is None:
        return DEFAULT_CONFIG
    try:
        with path.open("rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        raise SloConfigError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:  # TOML is UTF-8
        raise SloConfigError(f"{path}: not valid TOML: {exc}") from exc
    return parse_slo_config(data, source=str(path))


def parse_slo_config(data: dict[str, Any], source: str = "SLO config") -> SloConfig:
    """Validate a decoded TOML document into an :class:`SloConfig`."""
    try:
        return msgspec.convert(data, SloConfig)
    except msgspec.ValidationError as exc:
        raise SloConfigError(f"{source}: {exc}") from exc


# ---------------------------------------------------------------- burn-rate alerts


def burn_alerts(config: SloConfig, severity: Severity | None = None) -> tuple[BurnAlert, ...]:
    """The config's burn-rate pairs that alert (ticket pairs only with ``tickets``), of ``severity`` if
    given. The streams worker's ``BurnRateCrossed`` events use the page pairs."""
    return tuple(
        a
        for a in config.alerts.burn
        if (config.alerts.tickets or a.severity == "page") and severity in (None, a.severity)
    )


def windows(config: SloConfig, severity: Severity | None = None) -> list[int]:
    """Every window (minutes) some alert (of ``severity``, if given) reads an error ratio over, shortest
    first."""
    return sorted({m for a in burn_alerts(config, severity) for m in (a.long_minutes, a.short_minutes)})


def seconds_duration(seconds: float) -> str:
    """A PromQL duration for a span in seconds: 15m, 1h, 90s, 7500ms."""
    ms = round(seconds * 1000)
    if ms % 60_000 == 0:
        return duration(ms // 60_000)
    return f"{ms // 1000}s" if ms % 1000 == 0 else f"{ms}ms"


def budget_minutes(target: float, window_days: int) -> float:
    """Minutes of total failure the budget of ``target`` over ``window_days`` allows."""
    return (1 - target) * window_days * 1440


# ---------------------------------------------------------------- rules


def rule_groups(
    config: SloConfig,
    *,
    drift_window_s: float | None = None,
    drift_lateness_s: float | None = None,
    drift_interval_s: float | None = None,
) -> dict[str, Any]:
    """The Prometheus rules document (``{"groups": [...]}``) for ``config``.

    One group per tier with models (recording rules first, then the alerts that read them, so an alert
    sees this evaluation's ratios), then one group with the Kafka alerts, one with the workers', one with
    the drift alerts and one with the rollout's.
    ``drift_window_s``, ``drift_lateness_s`` and ``drift_interval_s`` (the streams worker's
    ``SLUICE_DRIFT_WINDOW_S``, ``SLUICE_DRIFT_LATENESS_S`` and ``SLUICE_DRIFT_INTERVAL_S``), when given,
    override the config's ``[alerts.drift] window_s``, ``lateness_s`` and ``interval_s``.
    """
    groups: list[dict[str, Any]] = []
    for tier in config.tiers:
        selector = _model_selector(config, tier)
        if selector is None:
            continue  # a non-default tier that lists no models has nothing to measure
        rules = [
            _recording_rule(tier, objective, minutes, selector)
            for objective in tier.objectives()
            for minutes in windows(config)
        ]
        rules += [
            _burn_alert_rule(tier, objective, alert)
            for alert in burn_alerts(config)
            for objective in tier.objectives()
        ]
        groups.append({"name": f"sluice-slo-{tier.name}", "rules": rules})
    groups.append({"name": "sluice-kafka", "rules": [_lag_rule(config), _dead_letter_rule(config)]})
    groups.append({"name": "sluice-workers", "rules": [_out_of_memory_rule(config)]})
    drift = drift_settings(config, drift_window_s, lateness_s=drift_lateness_s, interval_s=drift_interval_s)
    groups.append(
        {
            "name": "sluice-drift",
            "rules": [_drift_rule(drift), _drift_quality_rule(drift), _drift_stale_rule(drift)],
        }
    )
    groups.append({"name": "sluice-rollout", "rules": [_rollback_rule()]})
    return {"groups": groups}


ROLLOUT_DECISIONS = "sluice_rollout_decisions_total"
ROLLBACK_LOOKBACK = "30m"


def _rollback_rule() -> dict[str, Any]:
    return {
        "alert": "SluiceRolloutRolledBack",
        "expr": (
            f'sum by (model) (increase({ROLLOUT_DECISIONS}{{action="rollback", actor="controller"}}'
            f"[{ROLLBACK_LOOKBACK}])) > 0"
        ),
        "labels": {"severity": "ticket"},
        "annotations": {
            "summary": "{{ $labels.model }}: a candidate version was rolled back automatically",
            "description": (
                "The rollout controller rolled back a candidate of model {{ $labels.model }} in the last "
                f"{ROLLBACK_LOOKBACK}: a gate failed (error ratio, TTFT or ITL p99, cost, drift or fast "
                "burn), or no worker of the candidate became ready in time. All traffic is on the stable version again. `sluice rollout status "
                "{{ $labels.model }}` shows the decision and its evidence; the audit chain "
                "admin:deployment:{{ $labels.model }} has it too."
            ),
        },
    }


def render_rules(
    config: SloConfig,
    source: str = "the built-in defaults",
    *,
    drift_window_s: float | None = None,
    drift_lateness_s: float | None = None,
    drift_interval_s: float | None = None,
) -> str:
    """:func:`rule_groups` as a YAML rules file for Prometheus' ``rule_files``."""
    header = f"# Generated by `sluice slo rules` from {source}; regenerate rather than edit.\n"
    for lowered in config.lowered_thresholds():
        header += f"# Lowered: {lowered.text}.\n"
    doc = rule_groups(
        config,
        drift_window_s=drift_window_s,
        drift_lateness_s=drift_lateness_s,
        drift_interval_s=drift_interval_s,
    )
    return header + yaml.dump(doc, Dumper=_RulesDumper, sort_keys=False, width=110)


def drift_settings(
    config: SloConfig,
    window_s: float | None = None,
    *,
    lateness_s: float | None = None,
    interval_s: float | None = None,
) -> DriftAlert:
    """The config's drift alert settings, with the streams worker's drift window, lateness and interval
    (each when given) instead of the config's."""
    drift = config.alerts.drift
    if window_s is not None:
        if window_s < 1:
            raise SloConfigError(f"drift window {_num(window_s)} s: must be at least 1 s")
        drift = msgspec.structs.replace(drift, window_s=float(window_s))
    if lateness_s is not None:
        if lateness_s < 0:
            raise SloConfigError(f"drift lateness {_num(lateness_s)} s: must be at least 0 s")
        drift = msgspec.structs.replace(drift, lateness_s=float(lateness_s))
    if interval_s is not None:
        if interval_s <= 0:
            raise SloConfigError(f"drift interval {_num(interval_s)} s: must be more than 0 s")
        drift = msgspec.structs.replace(drift, interval_s=float(interval_s))
    return drift


def _model_selector(config: SloConfig, tier: Tier) -> str | None:
    """The ``model`` matcher picking the tier's models (``model="a"``, ``model=~"a|b"``); for the default
    tier, every model that no other tier lists (``model!~"x|y"``, or no matcher at all); None for a
    non-default tier without models."""
    if tier.name != config.default_tier:
        return _matcher("model", tier.models, negate=False) if tier.models else None
    others = [m for t in config.tiers if t.name != tier.name for m in t.models]
    return _matcher("model", others, negate=True) if others else ""


def _recording_rule(tier: Tier, objective: Objective, minutes: int, selector: str) -> dict[str, Any]:
    w = duration(minutes)
    if objective.threshold_seconds is None:
        bad = _selector(_matcher("outcome", BAD_OUTCOMES, negate=False), selector)
        valid = _selector(_matcher("outcome", GOOD_OUTCOMES + BAD_OUTCOMES, negate=False), selector)
        # A model without any bad outcome has no such series; `or 0 * valid` makes its ratio 0, not absent.
        expr = (
            f"(\n  sum by (model) (rate({REQUESTS_TOTAL}{bad}[{w}]))\n"
            f"  or\n  0 * sum by (model) (rate({REQUESTS_TOTAL}{valid}[{w}]))\n)\n"
            f"/\nsum by (model) (rate({REQUESTS_TOTAL}{valid}[{w}]))\n"
        )
    else:
        metric = TTFT_SECONDS if objective.slo == "ttft" else ITL_SECONDS
        count = f"{metric}_count{_selector(selector)}"
        good = f"{metric}_bucket{_selector(_le_matcher(objective.threshold_seconds), selector)}"
        expr = (
            f"(\n  sum by (model) (rate({count}[{w}]))\n  -\n  sum by (model) (rate({good}[{w}]))\n)\n"
            f"/\nsum by (model) (rate({count}[{w}]))\n"
        )
    return {"record": RECORD_PREFIX + w, "expr": expr, "labels": {"slo": objective.slo, "tier": tier.name}}


_SLO_TEXT: dict[SloName, str] = {
    "availability": "availability",
    "ttft": "time-to-first-token",
    "itl": "inter-token-latency",
}


def objective_text(tier: Tier, slo: SloName) -> str:
    """The objective in words: ``99.5% of requests complete`` …"""
    if slo == "availability":
        return f"{_pct(tier.availability)} of requests complete (not failed, expired or shed)"
    objective = tier.ttft if slo == "ttft" else tier.itl
    if objective is None:
        raise ValueError(f"tier {tier.name!r} has no {slo} objective")
    what = (
        "streamed requests get a first token" if slo == "ttft" else "streamed tokens follow the previous one"
    )
    return f"{_pct(objective.target)} of {what} within {_num(objective.threshold_seconds)} s"


def _burn_alert_rule(tier: Tier, objective: Objective, alert: BurnAlert) -> dict[str, Any]:
    slo = objective.slo
    budget = _num(objective.budget)
    rate = burn_threshold(alert, tier.window_days, objective.budget)
    threshold = _num(rate)
    lowered = ""
    if rate < alert.threshold(tier.window_days):
        lowered = (
            f" (The pair's own threshold, {_num(alert.threshold(tier.window_days))}, is out of reach or "
            f"nearly: with a budget of {budget} the burn rate cannot pass {_num(1 / objective.budget)}. "
            f"This alert fires when more than {_pct(MAX_BAD_SHARE)} of the events are bad.)"
        )
    match = f'{{slo="{slo}",tier="{tier.name}"}}'
    expr = (
        f"(\n  {RECORD_PREFIX}{alert.long}{match} / {budget} > {threshold}\n)\nand\n"
        f"(\n  {RECORD_PREFIX}{alert.short}{match} / {budget} > {threshold}\n)\n"
    )
    name = _SLO_TEXT[slo]
    return {
        "alert": alert.alert,
        "expr": expr,
        "labels": {"severity": alert.severity, "slo": slo, "tier": tier.name},
        "annotations": {
            "summary": (
                f"{{{{ $labels.model }}}}: {name} error budget burning at {{{{ $value | humanize }}}}x "
                f"over {alert.long} ({alert.severity} above {threshold}x)"
            ),
            "description": (
                f"Objective ({tier.name} tier, {tier.window_days}-day budget): {objective_text(tier, slo)}. "
                f"The burn rate (error ratio / error budget {budget}) is above {threshold} over both the "
                f"last {alert.long} and the last {alert.short}: at that rate "
                f"{_pct(alert.budget_share_at(rate, tier.window_days))} of the budget goes in {alert.long}."
                + lowered
            ),
        },
    }


def _lag_rule(config: SloConfig) -> dict[str, Any]:
    lag = config.alerts.consumer_lag
    return {
        "alert": "SluiceConsumerLag",
        "expr": f"max by (group, topic) ({CONSUMER_LAG}) > {lag.max_records}\n",
        "for": duration(lag.for_minutes),
        "labels": {"severity": lag.severity},
        "annotations": {
            "summary": (
                "Consumer group {{ $labels.group }} is {{ $value | humanize }} records behind on "
                "{{ $labels.topic }}"
            ),
            "description": (
                f"The largest partition lag of group {{{{ $labels.group }}}} on {{{{ $labels.topic }}}} has "
                f"stayed above {lag.max_records} records for {duration(lag.for_minutes)}: its consumers do "
                "not keep up, or have stopped. On a request topic, requests wait that long before a "
                "worker sees them."
            ),
        },
    }


def _counter_rule(
    alert: str, counter: str, by: str, settings: CounterAlert, summary: str, describe: Callable[[str], str]
) -> dict[str, Any]:
    """``alert`` while ``counter`` rose within ``settings.window_minutes``, per ``by``; ``describe(window)``
    is its description. ``increase()`` needs two samples of a series, and such a series is often born at
    its first event; the ``unless ... offset`` half catches a series that did not exist a window ago."""
    w = duration(settings.window_minutes)
    return {
        "alert": alert,
        "expr": (
            f"sum by ({by}) (increase({counter}[{w}])) > 0\n"
            f"or\nsum by ({by}) ({counter} unless {counter} offset {w}) > 0\n"
        ),
        "labels": {"severity": settings.severity},
        "annotations": {"summary": summary, "description": describe(w)},
    }


def _dead_letter_rule(config: SloConfig) -> dict[str, Any]:
    return _counter_rule(
        "SluiceDeadLetters",
        DEAD_LETTERS_TOTAL,
        "topic, reason",
        config.alerts.dead_letters,
        "Records from {{ $labels.topic }} dead-lettered ({{ $labels.reason }})",
        lambda w: (
            f"About {{{{ $value | humanize }}}} record(s) from {{{{ $labels.topic }}}} went to the "
            f"dead-letter topic within the last {w}, reason {{{{ $labels.reason }}}}. They were not "
            "processed; inspect the deadletter topic and replay them once fixed."
        ),
    )


def _out_of_memory_rule(config: SloConfig) -> dict[str, Any]:
    return _counter_rule(
        "SluiceWorkerOutOfMemory",
        OUT_OF_MEMORY_TOTAL,
        "model",
        config.alerts.out_of_memory,
        "{{ $labels.model }}: forward passes ran out of device memory",
        lambda w: (
            f"Workers of {{{{ $labels.model }}}} ran out of memory in about {{{{ $value | humanize }}}} "
            f"forward pass(es) within the last {w}. An embedding batch that did not fit ran in halves; "
            "an input that does not fit alone, or every sequence of a failed generation step, ended "
            "`worker_oom` (retriable: clients got 503 and should retry). The batch limit was halved and "
            f"grows back after 1,000 clean batches ({BATCH_LIMIT} shows it): throughput is lower until "
            "then. If it recurs, lower SLUICE_WORKER_EMBED_MAX_BATCH_TOKENS or SLUICE_WORKER_MAX_RUNNING, "
            "or give the model more memory."
        ),
    )


# ---------------------------------------------------------------- drift alerts


def _serving(by: str, drift: DriftAlert) -> str:
    """The model (versions) that completed requests recently: drift reports are due only for those (the
    streams worker reports a window only when it holds requests), and a retired version's last verdict
    stays in its gauges."""
    w = seconds_duration(max(drift.stale_windows_s, MIN_TRAFFIC_WINDOW_S))
    return f'sum by ({by}) (rate({REQUESTS_TOTAL}{{outcome="completed"}}[{w}])) > 0\n'


def _drift_rule(drift: DriftAlert) -> dict[str, Any]:
    return {
        "alert": "SluiceDriftDetected",
        "expr": (
            f"max by (model, version) ({DRIFT_DETECTED}) == 1\nand on (model, version)\n"
            + _serving("model, version", drift)
        ),
        "for": seconds_duration(drift.detected_for_s),
        "labels": {"severity": drift.severity},
        "annotations": {
            "summary": "{{ $labels.model }} version {{ $labels.version }}: its traffic drifted",
            "description": (
                "The latest all-tenant drift report of model {{ $labels.model }} version "
                f"{{{{ $labels.version }}}} says drift{_windows_text(drift)}: some request features (prompt "
                "length, script, language, output, log-probabilities, embeddings) are distributed "
                "differently from its reference window. `sluice drift status` shows every model's latest "
                "verdict; `sluice drift report {{ $labels.model }} --html out.html` shows which features "
                "moved and how."
            ),
        },
    }


def _drift_quality_rule(drift: DriftAlert) -> dict[str, Any]:
    return {
        "alert": "SluiceDriftFeaturePipeline",
        "expr": (
            f"max by (model, version) ({DRIFT_QUALITY_ISSUES}) > 0\nand on (model, version)\n"
            + _serving("model, version", drift)
        ),
        "for": duration(drift.for_minutes),
        "labels": {"severity": drift.severity},
        "annotations": {
            "summary": (
                "{{ $labels.model }} version {{ $labels.version }}: {{ $value }} drift data-quality "
                "finding(s)"
            ),
            "description": (
                "The latest all-tenant drift report of model {{ $labels.model }} version "
                "{{ $labels.version }} has data-quality findings: the feature pipeline broke, not the "
                "traffic (features missing or out of range, the embedding sampler stopped). "
                "`sluice drift report {{ $labels.model }} --html out.html` lists them; `sluice drift "
                "status` shows every model's latest verdict."
            ),
        },
    }


def _drift_stale_rule(drift: DriftAlert) -> dict[str, Any]:
    stale = _num(drift.stale_after_s)
    window = _num(drift.window_s)
    last = f"max_over_time({DRIFT_LAST_REPORT}[{DRIFT_LOOKBACK}])"
    return {
        "alert": "SluiceDriftReportsStale",
        "expr": f"time() - max by (model) ({last}) > {stale}\nand on (model)\n" + _serving("model", drift),
        "labels": {"severity": drift.severity},
        "annotations": {
            "summary": "No drift report for {{ $labels.model }} for {{ $value | humanizeDuration }}",
            "description": (
                "The latest drift report of {{ $labels.model }} covers a window that ended "
                f"{{{{ $value | humanizeDuration }}}} ago, more than {drift.stale_after_windows} drift "
                f"windows of {window} s and the monitor's lateness ({_num(drift.lateness_s)} s) and "
                f"interval ({_num(drift.interval_s)} s), while the model still completes requests: the "
                "streams worker's drift monitor is down or stuck (or cannot read the warehouse). Check the "
                "streams worker and its logs; `sluice drift status` shows each model's last report."
            ),
        },
    }


def _windows_text(drift: DriftAlert) -> str:
    """How many reports before the latest also said drift, in words."""
    before = drift.drift_windows - 1
    if before == 0:
        return ""
    return ", as did the one before it" if before == 1 else f", as did the {before} before it"


# ---------------------------------------------------------------- PromQL and YAML helpers

_RE2_SPECIAL = frozenset("\\.+*?()|[]{}^$")


def _regex_literal(value: str) -> str:
    return "".join("\\" + ch if ch in _RE2_SPECIAL else ch for ch in value)


def _string(value: str) -> str:
    """A PromQL double-quoted string literal."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _matcher(label: str, values: tuple[str, ...] | list[str], *, negate: bool) -> str:
    if len(values) == 1:
        return f"{label}{'!=' if negate else '='}{_string(values[0])}"
    pattern = "|".join(_regex_literal(v) for v in values)
    return f"{label}{'!~' if negate else '=~'}{_string(pattern)}"


def _le_matcher(threshold: float) -> str:
    """``le`` of one bucket boundary. prometheus_client writes 1.0 as ``1.0``, other clients and
    Prometheus versions as ``1``; both are matched so the rules do not depend on the exposition."""
    value = float(threshold)  # a Tier built in code may hold an int
    forms = [repr(value)]  # as prometheus_client writes it: 0.5, 1.0
    if value.is_integer():
        forms.append(str(int(value)))
    return _matcher("le", sorted(set(forms)), negate=False)


def _selector(*matchers: str) -> str:
    present = [m for m in matchers if m]
    return "{" + ",".join(present) + "}" if present else ""


def _num(value: float) -> str:
    """A float without representation noise: 0.005, not 0.0050000000000000044; 14.4; 1."""
    return f"{value:.10g}"


def _pct(share: float) -> str:
    return f"{_num(share * 100)}%"


class _RulesDumper(yaml.SafeDumper):
    """Multi-line strings (PromQL expressions) as literal blocks, readable in the generated file."""


def _represent_str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_RulesDumper.add_representer(str, _represent_str)
