"""The drift monitor on real embedded ClickHouse: rows from terminal events, windows, reference, verdicts,
restart from the log, bounded state; plus the pure window arithmetic."""

from __future__ import annotations

import contextlib
import random
import tracemalloc
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import msgspec
import pytest

from infra.warehouse import migrate, open_warehouse
from infra.warehouse.client import Client
from monitoring import metrics
from schemas.codec import decode, encode
from schemas.events import (
    DriftFeatures,
    DriftRebaselined,
    DriftReport,
    Float32Vectors,
    RequestFinished,
    Timings,
    Usage,
)
from schemas.ids import uuid7_from_parts
from schemas.settings import PlatformSettings
from streams.drift import (
    ALL,
    FEATURE_COLUMNS,
    REPORT_COLUMNS,
    Baseline,
    DriftKey,
    DriftMonitor,
    StoredReport,
    Window,
    due_windows,
    feature_row,
    findings,
    latest_report_sql,
    report_row,
)
from streams.pricing import PriceTable
from streams.settings import StreamsSettings
from streams.sink import Batch, Consumed, Rows, insert, query_rows

WINDOW_S = 60
T0 = datetime(2026, 11, 23, 10, 0, tzinfo=UTC)  # a window boundary
MODEL, VERSION = "demo-gpt", "v1"


def finished_event(
    n: int, at: datetime, *, language: str = "en", chars: int = 40, tenant: str = "acme", seed: int = 0,
    embed: list[float] | None = None, features: bool = True,
) -> RequestFinished:  # fmt: skip
    rng = random.Random(seed * 1_000_003 + n)
    tokens = max(1, int(chars / 4 + rng.gauss(0, 2)))
    request_id = uuid7_from_parts(int(at.timestamp() * 1000) - 50, seed << 40 | n)
    return RequestFinished(
        tenant=tenant,
        model=MODEL,
        request_id=request_id,
        source="gpu_workers/test",
        status="completed",
        finish_reason="length",
        usage=Usage(prompt_tokens=tokens, completion_tokens=8, total_tokens=tokens + 8),
        timings=Timings(finished=at),
        model_version=VERSION,
        kind="completion",
        features=DriftFeatures(
            prompt_chars=max(1, int(chars + rng.gauss(0, 4))),
            prompt_script="latin",
            prompt_language=language,
            prompt_non_ascii=0.0 if language == "en" else 0.02,
            output_chars=30 + rng.randrange(10),
            output_script="latin",
            empty_output=False,
            refusal=False,
            mean_logprob=-2.0 + rng.gauss(0, 0.2),
            mean_entropy=3.0 + rng.gauss(0, 0.2),
            embedding=embed,
        )
        if features
        else None,
    )


def unit(centre: list[float], rng: random.Random, noise: float = 0.15) -> list[float]:
    v = [c + rng.gauss(0, noise) for c in centre]
    norm = sum(x * x for x in v) ** 0.5
    return [x / norm for x in v]


def window_events(
    start: datetime, n: int, *, seed: int, shifted: bool = False, **kw: Any
) -> list[RequestFinished]:
    rng = random.Random(seed)
    dim = 16
    centre = [1.0] + [0.0] * (dim - 1) if not shifted else [0.0, 1.0] + [0.0] * (dim - 2)
    events = []
    for i in range(n):
        at = start + timedelta(seconds=1 + (WINDOW_S - 2) * i / n)
        language = (
            ("de" if rng.random() < 0.8 else "en") if shifted else ("en" if rng.random() < 0.9 else "fr")
        )
        events.append(
            finished_event(
                i,
                at,
                language=language,
                chars=160 if shifted else 40,
                seed=seed,
                embed=unit(centre, rng) if i % 2 == 0 else None,
                **kw,
            )
        )
    return events


def rows_of(events: list[RequestFinished]) -> Batch:
    return Rows(PriceTable()).batch(Consumed("results", 0, i, encode(e)) for i, e in enumerate(events))


@contextlib.contextmanager
def warehouse(tmp_path: Path) -> Iterator[Client]:
    with contextlib.closing(open_warehouse(PlatformSettings(data_dir=str(tmp_path / "data")))) as client:
        migrate(client)
        yield client


def settings(**changes: Any) -> StreamsSettings:
    base = StreamsSettings(
        drift_window_s=WINDOW_S, drift_lateness_s=5, drift_min_samples=40, drift_max_tenants=2
    )
    return msgspec.structs.replace(base, **changes)


class Published:
    """The monitor's effect: the report made durable (here: kept) and its row inserted."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.reports: list[DriftReport] = []

    async def __call__(self, report: DriftReport) -> None:
        decoded = decode(encode(report))  # what a replay would read from the topic
        assert decoded == report
        self.reports.append(report)
        insert(self.client, Batch(reports=[report_row(report)]))


def monitor(client: Client, published: Published, **changes: Any) -> DriftMonitor:
    async def query(sql: str) -> list[dict[str, Any]]:
        return query_rows(client, sql)

    return DriftMonitor(settings(**changes), query, published)


def verdicts(reports: list[DriftReport], scope: str = ALL) -> list[str]:
    return [r.effective_verdict for r in reports if r.tenant == scope]


# ------------------------------------------------------------------------------------------------ pure


def test_due_windows_waits_for_lateness_and_skips_what_was_reported() -> None:
    w = 60_000
    available = [("m", "v", 0), ("m", "v", w), ("m", "v", 2 * w), ("n", "v", w)]
    due = due_windows(available, {("m", "v"): w}, now_ms=2 * w + 5_000, window_ms=w, lateness_ms=5_000)
    assert due == [("m", "v", Window(w, 2 * w)), ("n", "v", Window(w, 2 * w))]
    first = due_windows(available, {}, now_ms=w + 5_000, window_ms=w, lateness_ms=5_000)
    assert first == [("m", "v", Window(0, w))]
    assert due_windows(available, {}, now_ms=w + 4_999, window_ms=w, lateness_ms=5_000) == []


def test_due_windows_after_a_shorter_window_skip_what_the_longer_one_reported() -> None:
    """A restart with SLUICE_DRIFT_WINDOW_S shortened (300 s to 60 s): the 60 s windows inside the
    reported [0, 300 s) were judged again, against a reference that contained them (no_drift by
    construction). The state is the end of the last window reported, so they are skipped."""
    w = 60_000
    available = [("m", "v", i * w) for i in range(7)]
    due = due_windows(available, {("m", "v"): 5 * w}, now_ms=7 * w + 5_000, window_ms=w, lateness_ms=5_000)
    assert due == [("m", "v", Window(5 * w, 6 * w)), ("m", "v", Window(6 * w, 7 * w))]


def test_due_windows_after_a_longer_window_cut_the_first_at_the_last_report() -> None:
    """Lengthened (60 s to 300 s) after [180 s, 240 s) was reported: the 300 s window [0, 300 s) that
    straddles the report is cut to [240 s, 300 s), so nothing is judged twice and nothing is skipped;
    the windows after it are whole and aligned to the epoch."""
    w = 300_000
    available = [("m", "v", 0), ("m", "v", w)]
    due = due_windows(available, {("m", "v"): 240_000}, now_ms=2 * w + 5_000, window_ms=w, lateness_ms=5_000)
    assert due == [("m", "v", Window(240_000, w)), ("m", "v", Window(w, 2 * w))]
    # a length that does not divide the old one (300 s to 120 s after [0, 300 s)): [240, 360) is cut
    w = 120_000
    available = [("m", "v", i * w) for i in range(4)]
    due = due_windows(available, {("m", "v"): 300_000}, now_ms=4 * w + 5_000, window_ms=w, lateness_ms=5_000)
    assert due == [("m", "v", Window(300_000, 3 * w)), ("m", "v", Window(3 * w, 4 * w))]


def test_drift_key_quotes_hostile_names() -> None:
    where = DriftKey("m'; DROP TABLE x --", "v", "t\\'").where(Window(0, 1000))
    assert "'m\\'; DROP TABLE x --'" in where
    assert "tenant = 't\\\\\\''" in where


# ------------------------------------------------------------------------------------------------ chDB


@pytest.mark.integration
async def test_reference_then_no_drift_then_drift_then_a_restart_resumes(tmp_path: Path) -> None:
    with warehouse(tmp_path) as client:
        w1, w2, w3 = T0, T0 + timedelta(seconds=WINDOW_S), T0 + timedelta(seconds=2 * WINDOW_S)
        events = window_events(w1, 120, seed=1) + window_events(w2, 120, seed=2)
        insert(client, rows_of(events))
        published = Published(client)
        first = monitor(client, published)
        done = await first.run_once(w3 + timedelta(seconds=6))
        assert verdicts(done) == ["reference", "no_drift"]
        no_drift = [r for r in done if r.tenant == ALL][1]
        assert no_drift.reference_start == w1
        assert no_drift.window_start == w2
        assert no_drift.requests == 120
        assert no_drift.n_current == 120
        assert no_drift.n_reference == 120
        assert not any(f.drifted for f in no_drift.features), no_drift.features
        assert {f.name for f in no_drift.features} >= {"prompt_language", "prompt_chars", "embedding"}
        # the busiest tenant gets its own reports (here the only one)
        assert verdicts(done, "acme") == ["reference", "no_drift"]

        # nothing more is due until the next window closes
        assert await first.run_once(w3 + timedelta(seconds=7)) == []

        insert(client, rows_of(window_events(w3, 120, seed=3, shifted=True)))
        # a restarted monitor reads where it stood from drift_reports: no window is judged twice
        second = monitor(client, published)
        done = await second.run_once(w3 + timedelta(seconds=WINDOW_S + 6))
        assert verdicts(done) == ["drift"]
        shifted = next(r for r in done if r.tenant == ALL)
        drifted = {f.name for f in shifted.features if f.drifted}
        assert {"prompt_language", "prompt_chars", "embedding"} <= drifted, shifted.features
        assert shifted.reference_start == w1, "the reference stays the first window"
        assert shifted.drifted
        assert 0 < shifted.share_drifted <= 1

        # the warehouse row reads back as the report (what `sluice drift report` shows)
        stored = StoredReport.of(query_rows(client, latest_report_sql(MODEL, None, ALL, None))[0])
        assert stored.verdict == "drift"
        assert stored.window == Window(
            int(w3.timestamp() * 1000), int(w3.timestamp() * 1000) + WINDOW_S * 1000
        )
        assert {f.name for f in stored.features if f.drifted} == drifted


@pytest.mark.integration
async def test_a_restart_with_another_window_length_judges_no_reported_traffic_again(tmp_path: Path) -> None:
    """Shortened (300 s to 60 s), the monitor judged the 60 s windows inside the reported 300 s one
    again, each against a reference that contained it; lengthened back, the next window starts where
    the last report ended."""
    with warehouse(tmp_path) as client:
        events = []
        for i in range(7):  # seven minutes of traffic, 60 a minute
            events += window_events(T0 + timedelta(seconds=60 * i), 60, seed=i)
        insert(client, rows_of(events))
        published = Published(client)
        done = await monitor(client, published, drift_window_s=300).run_once(T0 + timedelta(seconds=306))
        assert [(r.window_start, r.effective_verdict) for r in done if r.tenant == ALL] == [(T0, "reference")]

        shorter = monitor(client, published, drift_window_s=60)
        assert await shorter.run_once(T0 + timedelta(seconds=306)) == []
        done = await shorter.run_once(T0 + timedelta(seconds=366))
        judged = [(r.window_start, r.window_end, r.effective_verdict) for r in done if r.tenant == ALL]
        assert judged == [(T0 + timedelta(seconds=300), T0 + timedelta(seconds=360), "no_drift")]

        longer = monitor(client, published, drift_window_s=300)
        done = await longer.run_once(T0 + timedelta(seconds=606))
        cut = [(r.window_start, r.window_end) for r in done if r.tenant == ALL]
        assert cut == [(T0 + timedelta(seconds=360), T0 + timedelta(seconds=600))]


@pytest.mark.integration
async def test_a_version_promoted_by_a_rollout_takes_its_reference_from_its_whole_traffic(
    tmp_path: Path,
) -> None:
    """Found by an audit: a candidate's reference was its first window, during its canary (the tenants
    routed to it); after its promotion the whole traffic read as drift against it in every window, for
    good. A reference taken before the promotion is replaced by the first window after it."""
    with warehouse(tmp_path) as client:
        w1, w2, w3 = T0, T0 + timedelta(seconds=WINDOW_S), T0 + timedelta(seconds=2 * WINDOW_S)
        canary, whole = window_events(w1, 120, seed=1), window_events(w2, 120, seed=2, shifted=True)
        insert(client, rows_of(canary + whole + window_events(w3, 120, seed=3, shifted=True)))
        published = Published(client)

        async def query(sql: str) -> list[dict[str, Any]]:
            return query_rows(client, sql)

        promoted_at = w1 + timedelta(seconds=WINDOW_S - 1)  # promoted at the end of its canary window
        promoted = DriftMonitor(
            settings(),
            query,
            published,
            baseline=lambda model, version: Baseline.promoted(version, promoted_at),
        )
        done = await promoted.run_once(w2 + timedelta(seconds=WINDOW_S + 6))
        assert verdicts(done) == ["reference", "reference"]
        replaced = [r for r in done if r.tenant == ALL][1]
        assert replaced.reference_start == w2
        assert any("was taken during the rollout of v1" in note for note in replaced.quality)
        # a note, not a finding (a review: counted in the gauge, SluiceDriftFeaturePipeline fired at
        # every promotion)
        assert findings(replaced.quality) == []
        assert metrics.DRIFT_QUALITY_ISSUES.labels(MODEL, VERSION)._value.get() == 0
        done = await promoted.run_once(w3 + timedelta(seconds=WINDOW_S + 6))
        assert verdicts(done) == ["no_drift"]
        # without the promotion (another version, the same traffic), it is drift against the canary window
        again = [msgspec.structs.replace(e, model_version="v9") for e in canary + whole]
        insert(client, rows_of(again))
        other = Published(client)
        done = await DriftMonitor(
            settings(),
            query,
            other,
            baseline=lambda model, version: (
                Baseline.promoted(version, promoted_at) if version == VERSION else None
            ),
        ).run_once(w3 + timedelta(seconds=6))
        assert [r.effective_verdict for r in done if r.tenant == ALL and r.model_version == "v9"] == [
            "reference",
            "drift",
        ]


@pytest.mark.integration
async def test_a_shift_an_operator_accepts_becomes_the_reference_and_is_no_longer_drift(
    tmp_path: Path,
) -> None:
    """``sluice drift rebaseline``: a genuine shift (a new tenant's language) read as drift in every window
    for good. References dated before the rebaseline are replaced, window by window, until one that starts
    after it; then the shifted traffic is the normal it is compared with."""
    with warehouse(tmp_path) as client:
        w = [T0 + timedelta(seconds=i * WINDOW_S) for i in range(5)]
        events = window_events(w[0], 120, seed=1)
        for i in range(1, 5):
            events += window_events(w[i], 120, seed=10 + i, shifted=True)
        insert(client, rows_of(events))
        published = Published(client)
        rebaselined: list[DriftRebaselined] = []

        async def query(sql: str) -> list[dict[str, Any]]:
            return query_rows(client, sql)

        def baseline(model: str, version: str) -> Baseline | None:
            return next(
                (Baseline.rebaselined(e) for e in rebaselined if (e.model, e.version) == (model, version)),
                None,
            )

        drift = DriftMonitor(settings(), query, published, baseline=baseline)
        assert verdicts(await drift.run_once(w[1] + timedelta(seconds=WINDOW_S + 6))) == [
            "reference",
            "drift",
        ]
        at = w[2] + timedelta(seconds=WINDOW_S / 2)  # while the third window is open
        rebaselined.append(
            DriftRebaselined(
                time=at,
                tenant="",
                model=MODEL,
                source="sluice/cli",
                version=VERSION,
                reason="German is expected",
            )
        )
        done = await drift.run_once(w[4] + timedelta(seconds=WINDOW_S + 6))
        assert verdicts(done) == ["reference", "reference", "no_drift"]
        third, fourth, fifth = (r for r in done if r.tenant == ALL)
        assert any(
            "predates the rebaseline of v1" in note and "German is expected" in note for note in third.quality
        )
        assert fourth.reference_start == w[3], "the first window that starts after the rebaseline"
        assert fifth.reference_start == w[3]
        # another version, the same traffic, no rebaseline: still drift
        insert(client, rows_of([msgspec.structs.replace(e, model_version="v9") for e in events]))
        done = await DriftMonitor(settings(), query, Published(client), baseline=baseline).run_once(
            w[4] + timedelta(seconds=WINDOW_S + 6)
        )
        assert [r.effective_verdict for r in done if r.tenant == ALL and r.model_version == "v9"] == [
            "reference",
            *["drift"] * 4,
        ]


@pytest.mark.integration
async def test_too_few_samples_is_insufficient_data_never_an_alarm(tmp_path: Path) -> None:
    with warehouse(tmp_path) as client:
        insert(client, rows_of(window_events(T0, 10, seed=4, shifted=True)))
        published = Published(client)
        done = await monitor(client, published).run_once(T0 + timedelta(seconds=WINDOW_S + 6))
        assert verdicts(done) == ["insufficient_data"]
        assert done[0].drifted is False
        assert done[0].reference_start is None
        assert verdicts(done, "acme") == [], "a tenant below the minimum gets no report of its own"


@pytest.mark.integration
async def test_a_feature_pipeline_that_stops_is_a_data_quality_verdict(tmp_path: Path) -> None:
    with warehouse(tmp_path) as client:
        w2 = T0 + timedelta(seconds=WINDOW_S)
        broken = [
            msgspec.structs.replace(e, features=None) if i % 2 else e
            for i, e in enumerate(window_events(w2, 120, seed=6))
        ]
        insert(client, rows_of(window_events(T0, 120, seed=5) + broken))
        published = Published(client)
        done = await monitor(client, published).run_once(w2 + timedelta(seconds=WINDOW_S + 6))
        assert verdicts(done) == ["reference", "data_quality"]
        broken_report = [r for r in done if r.tenant == ALL][1]
        assert any("prompt_language" in finding for finding in broken_report.quality), broken_report.quality


@pytest.mark.integration
async def test_drift_state_stays_bounded_with_100k_requests(tmp_path: Path) -> None:
    """100k terminal events in one window: the sample is the reservoir, the monitor's memory does not grow
    with the requests (it holds window bounds and at most a few reservoirs)."""
    with warehouse(tmp_path) as client:
        insert(client, rows_of(window_events(T0, 200, seed=7)))
        w2 = T0 + timedelta(seconds=WINDOW_S)
        for chunk in range(10):
            insert(client, rows_of(window_events(w2, 10_000, seed=100 + chunk)))
        count = query_rows(client, "SELECT count() AS n FROM drift_features FINAL")[0]["n"]
        assert count == 100_200
        published = Published(client)
        watched = monitor(client, published, drift_reservoir=1000, drift_max_tenants=0)
        tracemalloc.start()
        try:
            done = await watched.run_once(w2 + timedelta(seconds=WINDOW_S + 6))
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert verdicts(done) == ["reference", "no_drift"]
        assert done[1].tenant == ALL
        assert done[1].requests == 100_000
        assert done[1].n_current == 1000
        assert watched.state_size <= 4
        assert peak < 64 * 2**20, f"peak {peak / 2**20:.1f} MiB while judging 100k requests"


@pytest.mark.integration
def test_rows_hold_no_text_and_replay_rows_equal_live_rows(tmp_path: Path) -> None:
    event = msgspec.structs.replace(
        window_events(T0, 1, seed=8)[0], text="a secret completion", embeddings=[[0.5, 0.5]]
    )
    batch = rows_of([event])
    assert "a secret completion" not in repr(batch.drift) + repr(batch.raw)
    assert "0.5, 0.5" not in repr(batch.raw), "vectors stay out of events_raw"
    packed = msgspec.structs.replace(
        event, embeddings=None, embeddings_f32=Float32Vectors.pack([[0.5, 0.5]], 2)
    )
    assert "AAAAPwAAAD8=" not in repr(rows_of([packed]).raw), "packed vectors (base64) too"
    live = Batch(reports=[report_row(sample_report())])
    replayed = Rows(PriceTable(), decisions_from_topic=True).batch(
        [Consumed("drift", 0, 0, encode(sample_report()))]
    )
    assert replayed.reports == live.reports


def sample_report() -> DriftReport:
    from schemas.examples import example_events

    return next(e for e in example_events() if isinstance(e, DriftReport))


def test_an_event_dated_before_1970_versions_0_not_a_negative_number() -> None:
    """``version`` is a UInt64 column in both drift tables: a negative one fails the whole insert."""
    early = datetime(1969, 12, 31, 23, 59, 59, tzinfo=UTC)
    event = msgspec.structs.replace(window_events(T0, 1, seed=8)[0], time=early)
    assert dict(zip(FEATURE_COLUMNS, feature_row(event), strict=True))["version"] == 0
    report = msgspec.structs.replace(sample_report(), time=early)
    assert dict(zip(REPORT_COLUMNS, report_row(report), strict=True))["version"] == 0


def test_the_report_id_is_the_same_for_a_window_judged_twice() -> None:
    from streams.drift import report_id

    # Pinned: a window judged again (after a restart or a publish failure) must reuse the id of the
    # report already in the log and the warehouse, so changing these values duplicates reports.
    pinned = {
        (DriftKey(MODEL, VERSION), Window(0, 60_000)): "00000000-ea60-79ee-aa95-a8bb9b932f04",
        (DriftKey(MODEL, VERSION, "acme"), Window(0, 60_000)): "00000000-ea60-7ff7-8e9f-b8b606cc27aa",
        (DriftKey(MODEL, VERSION), Window(60_000, 120_000)): "00000001-d4c0-7e2b-8b5c-8ef9e24e370e",
    }
    assert {args: report_id(*args) for args in pinned} == pinned


class FailingOnce(Published):
    """Publishing fails for the n-th report, once (a broker blip part-way through a window)."""

    failure: type[BaseException] = RuntimeError

    def __init__(self, client: Client, fail_at: int) -> None:
        super().__init__(client)
        self.calls = 0
        self.fail_at = fail_at

    async def __call__(self, report: DriftReport) -> None:
        self.calls += 1
        if self.calls == self.fail_at:
            raise self.failure("broker went away")
        await super().__call__(report)


@pytest.mark.integration
async def test_a_publish_failure_part_way_rejudges_the_window_from_the_same_state(tmp_path: Path) -> None:
    with warehouse(tmp_path) as client:
        insert(client, rows_of(window_events(T0, 120, seed=11)))
        published = FailingOnce(client, fail_at=2)  # the tenant's report goes out, the all-tenant one fails
        watched = monitor(client, published)
        at = T0 + timedelta(seconds=WINDOW_S + 6)
        assert await watched.run_once(at) == []
        retried = await watched.run_once(at)
        assert [(r.tenant, r.effective_verdict) for r in retried] == [
            (ALL, "reference"),
            ("acme", "reference"),
        ]
        ids = [r.id for r in published.reports]
        assert ids[0] == ids[1], "the report published before the failure is published again, same id"
        stored = query_rows(client, "SELECT scope, verdict FROM drift_reports FINAL ORDER BY scope")
        assert stored == [{"scope": "*", "verdict": "reference"}, {"scope": "acme", "verdict": "reference"}]


class DiesAt(FailingOnce):
    """The process dies at the n-th report (not an error the monitor handles: it is gone)."""

    failure: type[BaseException] = SystemExit


@pytest.mark.integration
@pytest.mark.parametrize("at", [1, 2])
async def test_a_crash_between_a_windows_reports_loses_none_of_them(tmp_path: Path, at: int) -> None:
    """Found by review: the all-tenant report went out first, and a restart resumes after the last window
    it has; a crash before a tenant's report left that tenant's report of the window (a reference here,
    an alarm elsewhere) never published. It goes out last now."""
    with warehouse(tmp_path) as client:
        insert(client, rows_of(window_events(T0, 120, seed=11)))
        at_time = T0 + timedelta(seconds=WINDOW_S + 6)
        with pytest.raises(SystemExit):
            await monitor(client, DiesAt(client, at)).run_once(at_time)
        restarted = await monitor(client, Published(client)).run_once(at_time)
        assert {(r.tenant, r.effective_verdict) for r in restarted} == {
            (ALL, "reference"),
            ("acme", "reference"),
        }
        stored = query_rows(client, "SELECT scope, verdict FROM drift_reports FINAL ORDER BY scope")
        assert stored == [{"scope": "*", "verdict": "reference"}, {"scope": "acme", "verdict": "reference"}]


@pytest.mark.integration
async def test_a_window_that_keeps_failing_is_reported_and_does_not_block_the_next(tmp_path: Path) -> None:
    with warehouse(tmp_path) as client:
        w2 = T0 + timedelta(seconds=WINDOW_S)
        insert(client, rows_of(window_events(T0, 120, seed=12) + window_events(w2, 120, seed=13)))
        published = Published(client)
        watched = monitor(client, published, drift_max_tenants=0)
        real = watched._judge
        broken = Window(int(T0.timestamp() * 1000), int(w2.timestamp() * 1000))

        async def judge(key: DriftKey, window: Window) -> DriftReport:
            if window == broken:
                raise ValueError("evidently could not")
            return await real(key, window)

        watched._judge = judge  # type: ignore[method-assign]
        at = w2 + timedelta(seconds=WINDOW_S + 6)
        assert await watched.run_once(at) == []
        assert await watched.run_once(at) == [], "later windows of the model wait for the failing one"
        done = await watched.run_once(at)
        assert [r.effective_verdict for r in done] == ["data_quality", "reference"]
        assert "evidently could not" in done[0].quality[0]
        assert done[1].window_start == w2


@pytest.mark.integration
async def test_windows_wait_for_a_sink_that_is_behind(tmp_path: Path) -> None:
    with warehouse(tmp_path) as client:
        insert(client, rows_of(window_events(T0, 120, seed=14)))
        stored_until: list[int | None] = [int(T0.timestamp() * 1000) + 30_000]

        async def query(sql: str) -> list[dict[str, Any]]:
            return query_rows(client, sql)

        watched = DriftMonitor(
            settings(drift_max_tenants=0), query, Published(client), lambda: stored_until[0]
        )
        at = T0 + timedelta(seconds=WINDOW_S * 3)
        assert await watched.run_once(at) == [], "the sink has only written half the window"
        stored_until[0] = None  # caught up
        assert verdicts(await watched.run_once(at)) == ["reference"]


def test_reports_carry_only_finite_numbers() -> None:
    from schemas.events import FeatureDrift
    from streams.drift import build_report

    odd = FeatureDrift(
        name="embedding", kind="embedding", method="mmd", statistic=float("nan"), threshold=float("inf"),
        p_value=float("nan"), drifted=False,
    )  # fmt: skip
    report = build_report(
        DriftKey(MODEL, VERSION), Window(0, 60_000), Window(0, 60_000), "no_drift",
        requests=1, n_reference=1, n_current=1, alpha=0.01, method="t", features=[odd],
    )  # fmt: skip
    assert decode(encode(report)) == report, "a report must survive the log (JSON has no inf or NaN)"


@pytest.mark.integration
async def test_a_reference_whose_rows_are_gone_is_replaced_not_an_endless_insufficient_data(
    tmp_path: Path,
) -> None:
    with warehouse(tmp_path) as client:
        w2 = T0 + timedelta(seconds=WINDOW_S)
        insert(client, rows_of(window_events(T0, 120, seed=15)))
        published = Published(client)
        watched = monitor(client, published, drift_max_tenants=0)
        assert verdicts(await watched.run_once(T0 + timedelta(seconds=WINDOW_S + 6))) == ["reference"]
        client.command(
            "TRUNCATE TABLE drift_features"
        )  # retention, or a warehouse rebuilt from 7 days of log
        insert(client, rows_of(window_events(w2, 120, seed=16)))
        done = await watched.run_once(w2 + timedelta(seconds=WINDOW_S + 6))
        assert verdicts(done) == ["reference"]
        assert done[0].reference_start == w2
        assert "replaces it" in done[0].quality[0]


@pytest.mark.integration
async def test_a_reference_without_measured_features_gives_way_to_a_window_with_them(tmp_path: Path) -> None:
    """Found by an audit: a first window whose rows had no features (sampling off, an older worker)
    became the reference, and every later window was compared on token counts and status alone: a shift
    to German, refusals and Cyrillic output was ``no_drift``."""
    w2, w3 = T0 + timedelta(seconds=WINDOW_S), T0 + timedelta(seconds=2 * WINDOW_S)
    unmeasured = [msgspec.structs.replace(e, features=None) for e in window_events(T0, 120, seed=1)]
    shifted = [
        msgspec.structs.replace(
            e,
            features=msgspec.structs.replace(
                e.features, prompt_language="de", refusal=True, output_script="cyrillic"
            ),
        )
        for e in window_events(w3, 120, seed=3)
        if e.features is not None
    ]
    with warehouse(tmp_path) as client:
        insert(client, rows_of(unmeasured + window_events(w2, 120, seed=2) + shifted))
        done = await monitor(client, Published(client), drift_max_tenants=0).run_once(
            w3 + timedelta(seconds=WINDOW_S + 6)
        )
    verdicts = [(r.window_start, r.effective_verdict) for r in done]
    assert verdicts == [(T0, "reference"), (w2, "reference"), (w3, "drift")]
    assert "has 0 rows with measured features; this window replaces it" in done[1].quality[0]
    assert {"prompt_language", "output_script", "refusal"} <= {f.name for f in done[2].features if f.drifted}


def test_a_window_mixing_embedding_dimensions_keeps_its_own_and_names_the_others() -> None:
    """Found by an audit: a window whose embeddings had two dimensions kept none of them, and its report
    read "embedding: not sampled", which hid the cause."""
    from streams.drift import sample_of

    vectors = [{"embedding": [0.5] * 16}] * 5 + [{"embedding": [0.5] * 8}] * 2 + [{"embedding": [0.5] * 4}]
    sample = sample_of([], vectors, 8)
    assert sample.embeddings.shape == (5, 16)
    assert sample.quality == ("embedding: 3 of 8 vectors of dimension 4, 8 (the window's: 16)",)
    assert sample_of([], vectors[:5], 5).quality == ()
    assert sample_of([], [], 0).embeddings.shape == (0, 0)


@pytest.mark.integration
async def test_a_window_mixing_embedding_dimensions_is_a_data_quality_verdict(tmp_path: Path) -> None:
    w2 = T0 + timedelta(seconds=WINDOW_S)
    mixed = window_events(w2, 120, seed=22)
    for i in (0, 2, 4):  # three of its sixty embeddings cut to 8 dimensions
        measured = mixed[i].features
        assert measured is not None
        assert measured.embedding is not None
        features = msgspec.structs.replace(measured, embedding=measured.embedding[:8])
        mixed[i] = msgspec.structs.replace(mixed[i], features=features)
    with warehouse(tmp_path) as client:
        insert(client, rows_of(window_events(T0, 120, seed=21) + mixed))
        done = await monitor(client, Published(client), drift_max_tenants=0).run_once(
            w2 + timedelta(seconds=WINDOW_S + 6)
        )
    assert verdicts(done) == ["reference", "data_quality"]
    assert done[1].quality[0] == "embedding: 3 of 60 vectors of dimension 8 (the window's: 16)"
    assert "embedding" in {f.name for f in done[1].features}  # the rest is still tested


async def test_rows_with_hostile_embedding_dimensions_do_not_blow_the_monitors_memory(tmp_path: Path) -> None:
    """Found by a review: the embedding's dimension had no bound, and the monitor loaded a window's
    embedding reservoir as Python lists before keeping the most common dimension: eight rows of 400k
    components took 147 MiB to judge one window. The contract now refuses them, and the monitor reads
    no row longer than the bound (rows stored before it)."""
    w1, w2 = T0, T0 + timedelta(seconds=WINDOW_S)
    with warehouse(tmp_path) as client:
        events = window_events(w1, 120, seed=61)
        hostile = [
            finished_event(1000 + i, w1 + timedelta(seconds=30), seed=62, embed=[0.0] * 400_000)
            for i in range(8)
        ]
        assert rows_of(hostile).drift == [], "refused at decoding: dead-lettered by the sink"
        # rows stored before the contract bounded the dimension
        insert(client, Batch(drift=[feature_row(e) for e in hostile]))
        insert(client, rows_of(events))
        watched = monitor(client, Published(client), drift_max_tenants=0)
        await watched.prepare()
        tracemalloc.start()
        try:
            done = await watched.run_once(w2 + timedelta(seconds=6))
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert verdicts(done) == ["reference"]
        assert peak < 64 * 2**20, f"judging one window took {peak / 2**20:.0f} MiB of Python memory"


async def test_the_html_report_uses_the_alpha_and_reservoir_the_report_was_judged_with(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by a review: `sluice drift report --html` sampled and tested with the settings of the shell
    it ran in: without the streams worker's ``SLUICE_DRIFT_ALPHA`` and ``SLUICE_DRIFT_RESERVOIR`` the
    page tested other rows at another level than the verdict it claims to reproduce."""
    import drift.evaluate
    from streams.drift import recompute_html

    w1, w2, w3 = (T0 + timedelta(seconds=WINDOW_S * i) for i in range(3))
    with warehouse(tmp_path) as client:
        insert(client, rows_of(window_events(w1, 120, seed=31) + window_events(w2, 120, seed=32)))

        async def query(sql: str) -> list[dict[str, Any]]:
            return query_rows(client, sql)

        judged = monitor(
            client, Published(client), drift_max_tenants=0, drift_alpha=0.05, drift_reservoir=100
        )
        assert verdicts(await judged.run_once(w3 + timedelta(seconds=6))) == ["reference", "no_drift"]
        report = StoredReport.of(query_rows(client, latest_report_sql(MODEL, None, ALL, None))[0])
        assert (report.alpha, report.n_reference, report.n_current) == (0.05, 100, 100)
        seen: dict[str, Any] = {}

        def html_report(reference: Any, current: Any, re: Any, ce: Any, config: Any) -> str:
            seen.update(n_reference=len(reference), n_current=len(current), alpha=config.alpha)
            return "<html></html>"

        monkeypatch.setattr(drift.evaluate, "html_report", html_report)
        made = await recompute_html(query, report, StreamsSettings(), embeddings=False)  # the CLI's defaults
        assert seen == {"n_reference": 100, "n_current": 100, "alpha": 0.05}
        assert (made.n_reference, made.n_current) == (100, 100)
