"""Drift detection in the streams worker: windows of per-request features in, ``DriftReport`` events out.

Where the state lives. Every terminal event becomes a ``drift_features`` row (:func:`feature_row`), so
the windows are in the warehouse, durable and rebuilt by a replay; the monitor keeps only which window it
reported last and each key's reference bounds, O(model versions x tenants), never O(requests).

Windows are tumbling, ``SLUICE_DRIFT_WINDOW_S`` long, aligned to the epoch and cut on the request's
``finished`` time. A window is evaluated once it closed ``SLUICE_DRIFT_LATENESS_S`` ago. Its sample is a
bounded reservoir: the ``SLUICE_DRIFT_RESERVOIR`` rows with the smallest ``cityHash64(request_id)`` (a
uniform sample, the same whatever order the rows arrived in, so ``sluice drift report`` recomputes
exactly the sample the verdict came from); embeddings have their own, smaller reservoir. A restart
resumes at the end of the last window reported (:func:`due_windows`), so a changed window length judges
no reported traffic again: the first window after the change may be cut short to start there.

Per (model, version) the all-tenant scope ``*`` is evaluated every window; each of the
``SLUICE_DRIFT_MAX_TENANTS`` busiest tenants with at least ``SLUICE_DRIFT_MIN_SAMPLES`` requests in the
window gets its own report too. A key's first window with enough samples becomes its **reference**
(verdict ``reference``); later windows are compared with it (:func:`drift.evaluate.evaluate`). Too few
samples is ``insufficient_data``, never an alarm. A reference dated before a version's **baseline** moved
(:class:`Baseline`: a rollout promoted the version to all of its model's traffic, or an operator accepted
a shift with ``sluice drift rebaseline``, a ``DriftRebaselined`` on the control topic) is replaced the same
way, by the next window judged, until one that starts after the move.

Each verdict is published on the ``drift`` topic (durable first), then inserted into ``drift_reports``
(and ``events_raw``) by the same row function :mod:`streams.sink` uses when ``sluice replay`` reads the
topic, so a replay rebuilds the table identically. A report's event id and time derive from its key and
window, so one published twice (a restart between publish and insert) collapses to one row.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import time
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, NamedTuple

import msgspec

from monitoring import metrics
from schemas.events import (
    EMBEDDING_MAX_DIM,
    DriftRebaselined,
    DriftReport,
    DriftVerdict,
    FeatureDrift,
    RequestFinished,
)
from schemas.ids import uuid7_from_parts
from streams.facts import accepted_at
from streams.queries import sql_string
from streams.settings import DRIFT_EMBEDDING_MIN_SAMPLES, StreamsSettings

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt
    import pandas as pd

    from drift.evaluate import DriftConfig

log = logging.getLogger(__name__)

SOURCE = "streams/drift"
ALL = "*"
"""The scope of a report over every tenant."""

FEATURE_COLUMNS = (
    "request_id", "tenant", "model", "model_version", "kind", "status", "finish_reason", "accepted",
    "finished", "has_features", "prompt_tokens", "completion_tokens", "prompt_chars", "prompt_script",
    "prompt_language", "prompt_non_ascii", "output_chars", "output_script", "empty_output", "refusal",
    "mean_logprob", "mean_entropy", "embedding", "version",
)  # fmt: skip
SAMPLE_COLUMNS = (
    "prompt_tokens", "completion_tokens", "prompt_chars", "prompt_non_ascii", "output_chars", "mean_logprob",
    "mean_entropy", "prompt_script", "prompt_language", "output_script", "finish_reason", "status",
    "empty_output", "refusal",
)  # fmt: skip
"""What a window's sample holds: the evaluator's numerical and categorical features."""
REPORT_COLUMNS = (
    "report_id", "time", "model", "model_version", "scope", "window_start", "window_end", "reference_start",
    "reference_end", "verdict", "drifted", "share_drifted", "requests", "n_reference", "n_current", "alpha",
    "method", "feature_names", "feature_kinds", "feature_methods", "feature_statistics",
    "feature_thresholds", "feature_p_values", "feature_drifted", "feature_null_share", "quality", "source",
    "version",
)  # fmt: skip


# ------------------------------------------------------------------------------------------------ rows


def feature_row(event: RequestFinished) -> list[Any]:
    """The ``drift_features`` row of a terminal event, in :data:`FEATURE_COLUMNS` order (no text)."""
    f = event.features
    return [
        event.request_id,
        event.tenant,
        event.model,
        event.model_version,
        event.kind,
        event.status,
        event.finish_reason or "",
        accepted_at(event),
        event.timings.finished or event.time,
        f is not None,
        event.usage.prompt_tokens,
        event.usage.completion_tokens,
        f.prompt_chars if f else None,
        f.prompt_script if f else None,
        f.prompt_language if f else None,
        f.prompt_non_ascii if f else None,
        f.output_chars if f else None,
        f.output_script if f else None,
        f.empty_output if f else None,
        f.refusal if f else None,
        f.mean_logprob if f else None,
        f.mean_entropy if f else None,
        list(f.embedding) if f is not None and f.embedding else [],
        max(0, int(event.time.timestamp() * 1000)),  # a UInt64 column: an event before 1970 versions 0
    ]


def report_row(event: DriftReport) -> list[Any]:
    """The ``drift_reports`` row of a report, in :data:`REPORT_COLUMNS` order."""
    features = event.features
    return [
        event.id,
        event.time,
        event.model,
        event.model_version,
        event.tenant,
        event.window_start,
        event.window_end,
        event.reference_start,
        event.reference_end,
        event.effective_verdict,
        event.drifted,
        event.share_drifted,
        event.requests,
        event.n_reference,
        event.n_current,
        event.alpha,
        event.method,
        [f.name for f in features],
        [f.kind for f in features],
        [f.method for f in features],
        [f.statistic for f in features],
        [f.threshold for f in features],
        [f.p_value for f in features],
        [f.drifted for f in features],
        [f.null_share for f in features],
        list(event.quality),
        event.source,
        max(0, int(event.time.timestamp() * 1000)),  # a UInt64 column: an event before 1970 versions 0
    ]


# ------------------------------------------------------------------------------------------------ windows


@dataclass(frozen=True, order=True)
class Window:
    start_ms: int
    end_ms: int

    @property
    def start(self) -> datetime:
        return datetime.fromtimestamp(self.start_ms / 1000, UTC)

    @property
    def end(self) -> datetime:
        return datetime.fromtimestamp(self.end_ms / 1000, UTC)


@dataclass(frozen=True, order=True)
class DriftKey:
    model: str
    model_version: str
    scope: str = ALL

    def where(self, window: Window) -> str:
        """The SQL condition selecting this key's rows in ``window``."""
        scope = "" if self.scope == ALL else f" AND tenant = {sql_string(self.scope)}"
        return (
            f"model = {sql_string(self.model)} AND model_version = {sql_string(self.model_version)}{scope}"
            f" AND finished >= fromUnixTimestamp64Milli({window.start_ms}, 'UTC')"
            f" AND finished < fromUnixTimestamp64Milli({window.end_ms}, 'UTC')"
        )


def windows_sql(window_ms: int, since_ms: int, until_ms: int) -> str:
    """Per (model, version): the windows in [since, until) that hold rows, with their request counts."""
    return f"""SELECT model, model_version,
    intDiv(toUnixTimestamp64Milli(finished), {window_ms}) * {window_ms} AS start_ms,
    count() AS requests
FROM drift_features FINAL
WHERE finished >= fromUnixTimestamp64Milli({since_ms}, 'UTC')
    AND finished < fromUnixTimestamp64Milli({until_ms}, 'UTC')
GROUP BY model, model_version, start_ms
ORDER BY start_ms, model, model_version"""  # noqa: S608 (integers and quoted literals only)


def tenants_sql(key: DriftKey, window: Window, min_samples: int, limit: int) -> str:
    """The busiest tenants of a window with at least ``min_samples`` requests, at most ``limit``."""
    return f"""SELECT tenant, count() AS requests FROM drift_features FINAL
WHERE {key.where(window)}
GROUP BY tenant HAVING requests >= {int(min_samples)}
ORDER BY requests DESC, tenant LIMIT {int(limit)}"""  # noqa: S608


def sample_sql(key: DriftKey, window: Window, rows: int) -> str:
    """A window's reservoir: the ``rows`` rows with the smallest hash of their request id."""
    columns = ", ".join(SAMPLE_COLUMNS)
    return f"""SELECT {columns} FROM drift_features FINAL
WHERE {key.where(window)}
ORDER BY cityHash64(request_id), request_id LIMIT {int(rows)}"""  # noqa: S608


def embeddings_sql(key: DriftKey, window: Window, rows: int) -> str:
    """A window's embedding reservoir (only the requests that carry one, of at most
    :data:`~schemas.events.EMBEDDING_MAX_DIM` components: rows stored before the contract bounded them may
    hold millions, which the reservoir loaded as Python lists)."""
    return f"""SELECT embedding FROM drift_features FINAL
WHERE {key.where(window)} AND length(embedding) BETWEEN 1 AND {EMBEDDING_MAX_DIM}
ORDER BY cityHash64(request_id), request_id LIMIT {int(rows)}"""  # noqa: S608


def count_sql(key: DriftKey, window: Window) -> str:
    return f"SELECT count() AS requests FROM drift_features FINAL WHERE {key.where(window)}"  # noqa: S608


LAST_REPORTS = """SELECT model, model_version, scope,
    max(window_end) AS last_end,
    argMax(reference_start, window_end) AS reference_start,
    argMax(reference_end, window_end) AS reference_end
FROM drift_reports FINAL
GROUP BY model, model_version, scope"""
"""Where each key stands: the end of the last window it reported and its reference (loaded once at start).
The end, not the start: after ``SLUICE_DRIFT_WINDOW_S`` changed, the start of the last window says
nothing about how far it reached."""


def latest_reports_sql(since_ms: int) -> str:
    """Each (model, version)'s latest all-tenant report of a window ending since ``since_ms``: what the drift
    gauges show (:meth:`DriftMonitor.run_once` restores them from it when it loads its state). Older ones
    are not shown again: a version retired long ago would fire its last alert anew at every start."""
    return f"""SELECT * FROM drift_reports FINAL
WHERE scope = '*' AND window_end >= fromUnixTimestamp64Milli({int(since_ms)}, 'UTC')
ORDER BY window_end DESC
LIMIT 1 BY model, model_version"""  # noqa: S608


def due_windows(
    available: Sequence[tuple[str, str, int]],
    reported: dict[tuple[str, str], int],
    *,
    now_ms: int,
    window_ms: int,
    lateness_ms: int,
) -> list[tuple[str, str, Window]]:
    """The windows to evaluate, oldest first: closed ``lateness`` ago, after the last one reported.

    ``available``: (model, version, window start ms) of windows holding rows; ``reported``: per (model,
    version), the end of the last window reported. No window overlaps one already reported, whatever
    window length that one had: a window ending there or before is skipped, and the one that straddles
    it (after ``SLUICE_DRIFT_WINDOW_S`` was lengthened, or changed to a length that does not divide the
    old one) is cut to start there. That first window is shorter than the others, so the traffic since
    the last report is judged once, neither twice nor never; the next ones are aligned to the epoch."""
    due = []
    for model, version, start in sorted(set(available), key=lambda a: (a[2], a[0], a[1])):
        window = Window(start, start + window_ms)
        last_end = reported.get((model, version))
        if last_end is not None:
            if window.end_ms <= last_end:
                continue
            window = Window(max(window.start_ms, last_end), window.end_ms)
        if window.end_ms + lateness_ms > now_ms:
            continue
        due.append((model, version, window))
    return due


# ------------------------------------------------------------------------------------------------ samples

Rows = list[dict[str, Any]]
Query = Callable[[str], Awaitable[Rows]]


@dataclass(frozen=True)
class Sample:
    """One window's reservoir and how many requests the window held."""

    frame: pd.DataFrame
    embeddings: npt.NDArray[np.float32]
    requests: int
    quality: tuple[str, ...] = ()
    """What the sample itself shows wrong (embeddings of another dimension than the window's)."""

    def __len__(self) -> int:
        return len(self.frame)


def sample_of(rows: Rows, embedding_rows: Rows, requests: int) -> Sample:
    """A window's sample. Its embeddings are those of the window's most common dimension: a window that
    mixed dimensions had none and was reported "not sampled" (an audit); the others are a finding."""
    import numpy as np
    import pandas as pd

    frame = pd.DataFrame(rows, columns=list(SAMPLE_COLUMNS))
    vectors = [row["embedding"] for row in embedding_rows]
    dims = Counter(len(v) for v in vectors)
    dim = max(dims, key=lambda d: (dims[d], d), default=0)
    kept = [v for v in vectors if len(v) == dim]
    embeddings = np.asarray(kept, dtype=np.float32) if kept else np.zeros((0, dim), dtype=np.float32)
    quality: tuple[str, ...] = ()
    if odd := len(vectors) - len(kept):
        others = ", ".join(str(d) for d in sorted(dims) if d != dim)
        quality = (f"embedding: {odd} of {len(vectors)} vectors of dimension {others} (the window's: {dim})",)
    return Sample(frame, embeddings, requests, quality)


async def load_sample(query: Query, key: DriftKey, window: Window, reservoir: int, embeddings: int) -> Sample:
    rows = await query(sample_sql(key, window, reservoir))
    vectors = await query(embeddings_sql(key, window, embeddings))
    requests = (
        len(rows) if len(rows) < reservoir else int((await query(count_sql(key, window)))[0]["requests"])
    )
    return sample_of(rows, vectors, requests)


# ------------------------------------------------------------------------------------------------ reports


def report_id(key: DriftKey, window: Window) -> str:
    """The report event's id: the same for every evaluation of one key's window."""
    digest = hashlib.blake2b(
        json.dumps([key.model, key.model_version, key.scope, window.start_ms]).encode(), digest_size=10
    ).digest()
    return uuid7_from_parts(window.end_ms, int.from_bytes(digest, "big") >> 6)


def build_report(
    key: DriftKey,
    window: Window,
    reference: Window | None,
    verdict: DriftVerdict,
    *,
    requests: int,
    n_reference: int,
    n_current: int,
    alpha: float,
    method: str,
    features: Sequence[FeatureDrift] = (),
    quality: Sequence[str] = (),
) -> DriftReport:
    tested = [finite(f) for f in features]
    drifted = [f for f in tested if f.drifted]
    return DriftReport(
        id=report_id(key, window),
        time=window.end,
        tenant=key.scope,
        model=key.model,
        source=SOURCE,
        window_start=window.start,
        window_end=window.end,
        drifted=verdict == "drift",
        share_drifted=len(drifted) / len(tested) if tested else 0.0,
        feature_scores={f.name: f.statistic for f in tested},
        method=method,
        model_version=key.model_version,
        verdict=verdict,
        reference_start=reference.start if reference is not None else None,
        reference_end=reference.end if reference is not None else None,
        requests=requests,
        n_reference=n_reference,
        n_current=n_current,
        alpha=alpha,
        features=list(tested),
        quality=list(quality),
    )


_FLOAT_MAX = 1.7976931348623157e308


def _clamp(value: float) -> float:
    """JSON has no infinities or NaN (msgspec writes them as null, which a replay cannot read back)."""
    if math.isnan(value):
        return 0.0
    return max(-_FLOAT_MAX, min(_FLOAT_MAX, value))


def finite(feature: FeatureDrift) -> FeatureDrift:
    """The feature's numbers as finite floats, so the report survives the log and a replay."""
    p_value = feature.p_value
    return msgspec.structs.replace(
        feature,
        statistic=_clamp(feature.statistic),
        threshold=_clamp(feature.threshold),
        p_value=None if p_value is None or math.isnan(p_value) else _clamp(p_value),
    )


def drift_config(settings: StreamsSettings) -> DriftConfig:
    from drift.evaluate import DriftConfig

    return DriftConfig(
        alpha=settings.drift_alpha,
        min_samples=settings.drift_min_samples,
        embedding_min_samples=DRIFT_EMBEDDING_MIN_SAMPLES,
        null_tolerance=settings.drift_null_tolerance,
    )


REFERENCE_NOTE = "reference window "
"""How a report's ``quality`` line that says why its reference was replaced begins (a promotion, a
rebaseline, a reference gone): a note, not a finding (:func:`findings`)."""


def _show(
    key: DriftKey,
    verdict: str,
    features: Sequence[FeatureDrift],
    quality: Sequence[str],
    window: Window,
    *,
    restored: bool = False,
) -> None:
    """An all-tenant report on the drift gauges (:func:`monitoring.metrics.record_drift`)."""
    metrics.record_drift(
        key.model,
        key.model_version,
        verdict,
        [(f.name, f.statistic, f.drifted) for f in features],
        len(findings(quality)),
        window.end_ms / 1000,
        restored=restored,
    )


def findings(quality: Sequence[str]) -> list[str]:
    """A report's data-quality findings, its notes left out. A review: every promotion and rebaseline
    counted its note in ``sluice_drift_quality_issues``, and SluiceDriftFeaturePipeline fired on a healthy
    new version."""
    return [line for line in quality if not line.startswith(REFERENCE_NOTE)]


def judge(
    key: DriftKey,
    window: Window,
    reference: tuple[Window, Sample] | None,
    current: Sample,
    config: DriftConfig,
    notes: Sequence[str] = (),
) -> DriftReport:
    """The verdict on ``current`` against ``reference`` (blocking: evidently runs here). A reference whose
    rows are gone (retention, a rebuilt warehouse) is replaced by this window, and the report says so
    (``notes``: why a reference was dropped before, said the same way)."""
    notes = list(notes)
    if reference is not None and len(reference[1]) < config.min_samples:
        gone = reference[0]
        notes.append(
            f"{REFERENCE_NOTE}{gone.start:%Y-%m-%d %H:%M:%S} - {gone.end:%H:%M:%S} holds {len(reference[1])} "
            "rows now; this window replaces it"
        )
        reference = None
    elif reference is not None and _measured(reference[1]) < config.min_samples <= _measured(current):
        # A window without the workers' features (sampling off, or an older worker) compared every later
        # one on token counts and status alone: a shift to German, refusals and Cyrillic output was
        # ``no_drift`` (an audit). The first window that has them replaces it.
        gone = reference[0]
        notes.append(
            f"{REFERENCE_NOTE}{gone.start:%Y-%m-%d %H:%M:%S} - {gone.end:%H:%M:%S} has "
            f"{_measured(reference[1])} rows with measured features; this window replaces it"
        )
        reference = None
    if reference is None:
        verdict: DriftVerdict = "reference" if len(current) >= config.min_samples else "insufficient_data"
        return build_report(
            key, window, window if verdict == "reference" else None, verdict,
            requests=current.requests, n_reference=len(current) if verdict == "reference" else 0,
            n_current=len(current), alpha=config.alpha, method="baseline", quality=[*notes, *current.quality],
        )  # fmt: skip
    from drift.evaluate import evaluate

    ref_window, ref = reference
    result = evaluate(ref.frame, current.frame, ref.embeddings, current.embeddings, config)
    quality = [*current.quality, *result.quality]
    return build_report(
        key, window, ref_window, "data_quality" if quality else result.verdict,
        requests=current.requests, n_reference=len(ref), n_current=len(current), alpha=config.alpha,
        method=result.method, features=result.features, quality=quality,
    )  # fmt: skip


def _measured(sample: Sample) -> int:
    """Rows of ``sample`` with the workers' measured features (all of them come together; ``prompt_chars``
    is in every set)."""
    return int(sample.frame["prompt_chars"].notna().sum())


Publish = Callable[[DriftReport], Awaitable[None]]
"""Make a report durable on the drift topic, then store its row (the monitor's only effect)."""


class Baseline(NamedTuple):
    """Since when a model version's drift references must date, and why (the end of a sentence that
    begins "reference window A - B")."""

    since: datetime
    why: str

    @classmethod
    def promoted(cls, version: str, at: datetime) -> Baseline:
        """A version a rollout promoted: its reference was taken while it served the rollout's share of the
        traffic (the tenants and sessions routed to it, the shadow copies), and every window of the whole
        traffic after its promotion read as drift against it, for good (an audit)."""
        return cls(at, f"was taken during the rollout of {version}, promoted at {at:%Y-%m-%d %H:%M:%S}")

    @classmethod
    def rebaselined(cls, event: DriftRebaselined) -> Baseline:
        """A version whose shift an operator accepted (``sluice drift rebaseline``)."""
        who = event.actor or event.source or "an operator"
        return cls(
            event.time,
            f"predates the rebaseline of {event.version} at {event.time:%Y-%m-%d %H:%M:%S} by {who}: "
            f"{event.reason}",
        )

    @staticmethod
    def latest(*baselines: Baseline | None) -> Baseline | None:
        """The most recent of ``baselines`` (None when there is none)."""
        return max((b for b in baselines if b is not None), key=lambda b: b.since, default=None)


Watermark = Callable[[], int | None]
"""How far the sink has stored the log: None when it has caught up (the wall clock rules), else the
latest ``finished`` time (ms) it has written, so no window is judged before its rows are in."""


class Superseded(Exception):
    """The monitor may no longer publish what it judged: it stopped being the judge (``may_judge``), or
    its state was dropped (:meth:`DriftMonitor.forget`) while it judged."""


class DriftMonitor:
    """Evaluate due windows and publish their reports; ``await run_once(now)`` from a timer.

    Its state: per (model, version) the last window reported; per key its reference window; a small LRU
    of reference samples. Loaded from ``drift_reports`` on the first run, so a restart resumes where the
    log says it stopped; :meth:`forget` drops it, so the next run loads it again (a streams worker given
    the control partition back: another judged meanwhile). A window's reports (all tenants, then each busy tenant) are all judged before any
    is published, and the state moves only once all are durable: a failure part-way re-judges the window
    from the same state, with the same report ids. A window that keeps failing is reported as
    ``data_quality`` with the error after :attr:`MAX_FAILURES` tries, so it cannot block later windows."""

    REFERENCE_CACHE = 32
    MAX_FAILURES = 3

    def __init__(
        self,
        settings: StreamsSettings,
        query: Query,
        publish: Publish,
        watermark: Watermark | None = None,
        baseline: Callable[[str, str], Baseline | None] = lambda model, version: None,
        may_judge: Callable[[], bool] = lambda: True,
    ) -> None:
        """``baseline(model, version)``: since when that version's references must date, if something
        moved its baseline (a rollout promoted it to all of the model's traffic, an operator rebaselined
        it): a reference taken before is replaced by the first window after. ``may_judge()``: whether this
        monitor is the judge now, asked again before each window's reports are published (a run over a
        backlog takes minutes, and the judging may move to another worker meanwhile)."""
        self._baseline = baseline
        self._may_judge = may_judge
        self._settings = settings
        self._query = query
        self._publish = publish
        self._watermark = watermark or (lambda: None)
        self._window_ms = int(settings.drift_window_s * 1000)
        self._lateness_ms = int(settings.drift_lateness_s * 1000)
        self._reported: dict[tuple[str, str], int] | None = None
        self._references: dict[DriftKey, Window] = {}
        self._samples: OrderedDict[tuple[DriftKey, Window], Sample] = OrderedDict()
        self._failures: dict[tuple[DriftKey, Window], int] = {}
        self._scan_from = 0
        """Windows starting before this were all considered already: the scan need not read them."""
        self._config: DriftConfig | None = None
        self._epoch = 0
        """How many times the state was dropped (:meth:`forget`): a run begun before must not move it."""

    def forget(self) -> None:
        """Drop what the monitor knows of reported windows and references; the next run loads it again from
        ``drift_reports``. A review: a streams worker given the control partition back judged again, from
        its old state, the windows another worker had reported meanwhile (the same report ids published
        twice, its verdict replacing the other's row, a promotion's reference undone)."""
        self._epoch += 1
        self._reported = None
        self._references.clear()
        self._samples.clear()
        self._failures.clear()
        self._scan_from = 0

    def _current(self, epoch: int) -> bool:
        """Whether a run begun at ``epoch`` may still publish and move the state."""
        return self._epoch == epoch and self._may_judge()

    @property
    def state_size(self) -> int:
        """Entries held in memory (bounded by model versions x tenants, never by requests)."""
        return len(self._reported or {}) + len(self._references) + len(self._samples) + len(self._failures)

    async def _load(self) -> tuple[dict[tuple[str, str], int], dict[DriftKey, Window]]:
        """Per (model, version) the end of the last window reported, and each key's reference."""
        reported: dict[tuple[str, str], int] = {}
        references: dict[DriftKey, Window] = {}
        for row in await self._query(LAST_REPORTS):
            key = DriftKey(row["model"], row["model_version"], row["scope"])
            if key.scope == ALL:
                reported[(key.model, key.model_version)] = _ms(row["last_end"])
            if row["reference_start"] is not None and row["reference_end"] is not None:
                references[key] = Window(_ms(row["reference_start"]), _ms(row["reference_end"]))
        return reported, references

    async def _restore_gauges(self, epoch: int, now: datetime) -> None:
        """Show each version's latest stored all-tenant verdict on the drift gauges, as the judge that made
        it did. A review: a hand-over of the control partition cleared them (the last judge's series go with
        it) and the new judge exported nothing until it judged a window of its own, ~11 minutes by default
        and never for an idle model, so a firing ``SluiceDriftDetected`` resolved and fired again."""
        now_ms = int(now.timestamp() * 1000)
        rows = await self._query(
            latest_reports_sql(now_ms - self._window_ms * self._settings.drift_lookback_windows)
        )
        if not self._current(epoch):
            return
        for row in sorted(rows, key=lambda row: _ms(row["window_end"])):
            stored = StoredReport.of(row)
            _show(stored.key, stored.verdict, stored.features, stored.quality, stored.window, restored=True)

    async def prepare(self) -> None:
        """Load the drift engine (importing evidently and scipy takes seconds of CPU) now: the streams
        worker calls this before its sink starts, so the import does not stall the sink mid-stream."""
        if self._config is None:
            self._config = await asyncio.to_thread(drift_config, self._settings)

    async def run_once(self, now: datetime | None = None) -> list[DriftReport]:
        """Evaluate every due window (oldest first) and publish its reports; return them. A run stops, with
        what it published so far, once this monitor is no longer the judge (:class:`Superseded`)."""
        epoch = self._epoch
        reported = self._reported
        if reported is None:
            reported, references = await self._load()
            if self._epoch != epoch:
                return []  # dropped while loading: the next run loads it again
            self._reported = reported
            self._references.update(references)
            await self._restore_gauges(epoch, now or datetime.now(UTC))
        await self.prepare()
        now_ms = int((now or datetime.now(UTC)).timestamp() * 1000)
        stored = self._watermark()
        if stored is not None:
            now_ms = min(now_ms, stored)  # the sink is behind: judge only what it has written
        lookback = now_ms - self._window_ms * self._settings.drift_lookback_windows
        since = max(self._scan_from, lookback)
        available = [
            (r["model"], r["model_version"], int(r["start_ms"]))
            for r in await self._query(windows_sql(self._window_ms, since, now_ms))
        ]
        reports: list[DriftReport] = []
        blocked: dict[tuple[str, str], int] = {}
        for model, version, window in due_windows(
            available, reported, now_ms=now_ms, window_ms=self._window_ms, lateness_ms=self._lateness_ms
        ):
            if (model, version) in blocked:
                continue  # windows are judged in order: a later one waits for the failed one
            try:
                done = await self._attempt(DriftKey(model, version), window, epoch)
            except Superseded:
                log.info("drift: no longer the judge; stopped before %s %s at %s", model, version,
                         window.start.isoformat())  # fmt: skip
                return reports
            if done is None:
                blocked[(model, version)] = window.start_ms
                continue
            reports += done
            reported[(model, version)] = window.end_ms
        self._scan_from = min([now_ms - 2 * self._window_ms - self._lateness_ms, *blocked.values()])
        return reports

    async def _attempt(self, key: DriftKey, window: Window, epoch: int) -> list[DriftReport] | None:
        """The window's reports, or None after a failure that is to be retried next run."""
        try:
            reports = await self._window(key, window, epoch)
        except Superseded:
            raise
        except Exception as exc:
            tries = self._failures.get((key, window), 0) + 1
            self._failures[(key, window)] = tries
            log.exception("drift: judging %s %s at %s failed (try %d)", key.model, key.model_version,
                          window.start.isoformat(), tries)  # fmt: skip
            if tries < self.MAX_FAILURES:
                return None
            report = build_report(
                key, window, self._references.get(key), "data_quality",
                requests=0, n_reference=0, n_current=0, alpha=self._settings.drift_alpha, method="failed",
                quality=[f"evaluation failed {tries} times: {type(exc).__name__}: {exc}"[:500]],
            )  # fmt: skip
            if not self._current(epoch):
                raise Superseded from exc
            try:
                await self._publish(report)
            except Exception:
                log.exception("drift: could not publish the failure report either; retrying next run")
                return None
            reports = [report]
        self._failures.pop((key, window), None)
        return reports

    async def _window(self, key: DriftKey, window: Window, epoch: int) -> list[DriftReport]:
        settings = self._settings
        keys = [key] + [
            DriftKey(key.model, key.model_version, str(row["tenant"]))
            for row in await self._query(
                tenants_sql(key, window, settings.drift_min_samples, settings.drift_max_tenants)
            )
        ]
        judged = [(scoped, await self._judge(scoped, window)) for scoped in keys]
        # Judging a window takes seconds, a backlog's run minutes: the judging may have moved to another
        # worker meanwhile (which reports this window itself), or come back with the state dropped.
        if not self._current(epoch):
            raise Superseded
        # The all-tenant report last: a restart resumes after the window of the last one durable, so a
        # crash between reports must leave that window to judge again (the same ids: a tenant's report
        # already published is published again, not a second time in the warehouse).
        for _, report in sorted(judged, key=lambda pair: pair[0].scope == ALL):
            await self._publish(report)
        if not self._current(epoch):
            raise Superseded  # published, but neither this state nor the gauges are this worker's now
        for scoped, report in judged:
            if report.effective_verdict == "reference":
                self._references[scoped] = window
            if scoped.scope == ALL:
                _show(scoped, report.effective_verdict, report.features, report.quality, window)
            log.info(
                "drift %s %s %s [%s, %s): %s",
                key.model, key.model_version, scoped.scope, window.start.isoformat(), window.end.isoformat(),
                report.effective_verdict,
            )  # fmt: skip
        return [report for _, report in judged]

    async def _judge(self, key: DriftKey, window: Window) -> DriftReport:
        config = self._config
        if config is None:
            raise RuntimeError("drift monitor not loaded")
        current = await self._sample(key, window, cache=False)
        reference_window = self._references.get(key)
        notes: list[str] = []
        baseline = self._baseline(key.model, key.model_version)
        if reference_window is not None and baseline is not None and reference_window.start < baseline.since:
            notes.append(
                f"{REFERENCE_NOTE}{reference_window.start:%Y-%m-%d %H:%M:%S} - {reference_window.end:%H:%M:%S} "
                f"{baseline.why}; this window replaces it"
            )
            reference_window = None
        reference = (
            (reference_window, await self._sample(key, reference_window, cache=True))
            if reference_window is not None and reference_window != window
            else None
        )
        began = time.perf_counter()
        report = await asyncio.to_thread(judge, key, window, reference, current, config, notes)
        metrics.DRIFT_EVALUATION_SECONDS.observe(time.perf_counter() - began)
        return report

    async def _sample(self, key: DriftKey, window: Window, *, cache: bool) -> Sample:
        cached = self._samples.get((key, window))
        if cached is not None:
            self._samples.move_to_end((key, window))
            return cached
        settings = self._settings
        sample = await load_sample(
            self._query, key, window, settings.drift_reservoir, settings.drift_embedding_reservoir
        )
        if cache:
            self._samples[(key, window)] = sample
            while len(self._samples) > self.REFERENCE_CACHE:
                self._samples.popitem(last=False)
        return sample


def _ms(value: Any) -> int:
    """Milliseconds since the epoch of a warehouse DateTime64 (aware datetime, or an ISO string)."""
    if isinstance(value, datetime):
        moment = value if value.tzinfo is not None else value.replace(tzinfo=UTC)
    else:
        moment = datetime.fromisoformat(str(value))
        moment = moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)
    return round(moment.timestamp() * 1000)


# ------------------------------------------------------------------------------------------------ CLI side


def latest_report_sql(model: str, version: str | None, scope: str, window_start: datetime | None) -> str:
    """The newest report of a key (or the one of a given window), every column; without ``version``, of
    the version that served the most requests in that window (during a rollout, the stable one: it was the
    alphabetically first)."""
    where = [f"model = {sql_string(model)}", f"scope = {sql_string(scope)}"]
    if version is not None:
        where.append(f"model_version = {sql_string(version)}")
    if window_start is not None:
        where.append(
            f"window_start = fromUnixTimestamp64Milli({round(window_start.timestamp() * 1000)}, 'UTC')"
        )
    return (
        f"SELECT {', '.join(REPORT_COLUMNS)} FROM drift_reports FINAL WHERE {' AND '.join(where)} "  # noqa: S608
        "ORDER BY window_start DESC, requests DESC, model_version LIMIT 1"
    )


def versions_sql(model: str) -> str:
    """The versions of ``model`` with drift reports (column ``model_version``)."""
    return f"SELECT DISTINCT model_version FROM drift_reports WHERE model = {sql_string(model)} ORDER BY 1"  # noqa: S608


@dataclass(frozen=True)
class StoredReport:
    """A ``drift_reports`` row, typed (as the CLI reads it back)."""

    key: DriftKey
    window: Window
    reference: Window | None
    verdict: str
    requests: int
    n_reference: int
    n_current: int
    alpha: float | None
    features: list[FeatureDrift]
    quality: list[str]

    @classmethod
    def of(cls, row: dict[str, Any]) -> StoredReport:
        names = list(row["feature_names"])
        features = [
            FeatureDrift(
                name=str(name),
                kind=row["feature_kinds"][i],
                method=str(row["feature_methods"][i]),
                statistic=float(row["feature_statistics"][i]),
                threshold=float(row["feature_thresholds"][i]),
                p_value=None if row["feature_p_values"][i] is None else float(row["feature_p_values"][i]),
                drifted=bool(row["feature_drifted"][i]),
                null_share=float(row["feature_null_share"][i]),
            )
            for i, name in enumerate(names)
        ]
        has_reference = row["reference_start"] is not None and row["reference_end"] is not None
        return cls(
            key=DriftKey(str(row["model"]), str(row["model_version"]), str(row["scope"])),
            window=Window(_ms(row["window_start"]), _ms(row["window_end"])),
            reference=Window(_ms(row["reference_start"]), _ms(row["reference_end"]))
            if has_reference
            else None,
            verdict=str(row["verdict"]),
            requests=int(row["requests"]),
            n_reference=int(row["n_reference"]),
            n_current=int(row["n_current"]),
            alpha=None if row["alpha"] is None else float(row["alpha"]),
            features=features,
            quality=[str(q) for q in row["quality"]],
        )


@dataclass(frozen=True)
class Recomputed:
    """A stored report's windows sampled again from the warehouse, and evidently's HTML for them."""

    html: str
    n_reference: int
    n_current: int


async def recompute_html(
    query: Query, report: StoredReport, settings: StreamsSettings, *, embeddings: bool = True
) -> Recomputed:
    """Evidently's HTML report for the windows a stored report was judged on: the same reservoirs (samples
    are chosen by a hash of the request id, not by arrival order, so the report's ``n_reference`` and
    ``n_current`` rows with the smallest hashes are the ones it saw) tested at the report's ``alpha``. A
    review: the page used the reservoir size and alpha of the shell that ran ``sluice drift report``, so it
    could disagree with the verdict. ``settings`` give what the report does not record: the minimum
    samples, the null tolerance and the embedding reservoir."""
    from drift.evaluate import html_report

    if report.reference is None:
        raise ValueError("this report has no reference window (too few samples when it was judged)")
    size = settings.drift_embedding_reservoir if embeddings else 1
    n_reference = report.n_reference or settings.drift_reservoir  # 0: a failed evaluation sampled nothing
    n_current = report.n_current or settings.drift_reservoir
    reference = await load_sample(query, report.key, report.reference, n_reference, size)
    current = await load_sample(query, report.key, report.window, n_current, size)
    config = drift_config(settings)
    if report.alpha is not None:
        config = replace(config, alpha=report.alpha)
    html = await asyncio.to_thread(
        html_report,
        reference.frame,
        current.frame,
        reference.embeddings if embeddings else reference.embeddings[:0],
        current.embeddings if embeddings else current.embeddings[:0],
        config,
    )
    return Recomputed(html, len(reference), len(current))
