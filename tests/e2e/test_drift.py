"""Issue 9 done-when on the real platform: the edge, real workers (demo-gpt, with MiniLM embedding sampled
prompts) and a real ``sluice streams`` process with short drift windows. Three windows of traffic: a
reference mix, the same mix again, then a shifted mix (German, longer prompts, another topic). The verdicts
must be reference, no_drift, drift (for the right features), on the drift topic, in the warehouse, in
``sluice drift status``, in ``sluice drift report --html`` and on the dashboard in Chromium; a replay
rebuilds ``drift_reports`` and ``drift_features`` identically; no prompt reaches the warehouse."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from gpu_workers.service import WorkerService
from gpu_workers.settings import WorkerSettings
from ingest.auth import DEMO_KEY
from schemas.events import DriftReport
from schemas.settings import PlatformSettings
from tests.e2e.conftest import GPT, Platform, TopicLog, running_workers
from tests.e2e.test_streams import ROOT, Streams, _sluice, _wait_rows, running_streams

pytestmark = pytest.mark.integration
AUTH = {"Authorization": f"Bearer {DEMO_KEY}"}
WINDOW_S = 20.0
"""Room for a window's requests to end inside it on a busy box: with 10 s, CI (two test workers on 2 cores)
once saw the shifted mix's longer German prompts run past the boundary, 27 of 48 in the window (too few to
judge); alone it passed with 10 s."""
PER_WINDOW = 48
SECRET = "Flussufer"  # in the shifted prompts: must never reach the warehouse

ENGLISH = [
    "Tell me about the river and the weather today.",
    "What is the best way to cook rice for dinner?",
    "How do I plant tomatoes in the garden in spring?",
    "Write a short note to thank a friend for the book.",
    "What are the rules of chess for the knight?",
    "Explain how the moon changes its shape in the sky.",
]
GERMAN = [
    "Bitte erkläre mir ausführlich, wie die Einkommensteuer in Deutschland berechnet wird und welche "
    "Freibeträge es für Familien mit Kindern gibt, und was ist mit dem {secret}?",
    "Ich möchte wissen, wie die Zinsen für einen Immobilienkredit bei der Bank festgelegt werden und was "
    "eine Tilgung ist, die nicht zu hoch ist, und wie hoch ist das Risiko am {secret}?",
    "Wie funktioniert die Umsatzsteuer für kleine Unternehmen, und wann muss ich die Voranmeldung beim "
    "Finanzamt abgeben, wenn ich im Jahr nicht viel verdiene und am {secret} wohne?",
]


@pytest.fixture(scope="module")
def workers(e2e_settings: PlatformSettings, prepared_models: None) -> Iterator[list[WorkerService]]:
    """demo-gpt and MiniLM, every prompt embedded for drift (1 in 1, no time budget), so the MMD test has
    samples."""
    with running_workers(
        e2e_settings,
        lambda model: WorkerSettings(
            worker_id=f"drift-{model}", worker_flush_tokens=4, drift_sample=1, drift_embed_budget=1.0
        ),
    ) as started:
        yield started


@pytest.fixture(scope="module")
def streams(e2e_settings: PlatformSettings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Streams]:
    with running_streams(
        e2e_settings,
        tmp_path_factory.mktemp("drift") / "data",
        SLUICE_DRIFT_WINDOW_S=str(WINDOW_S),
        # a window is judged this long after its end: a row the sink has not stored by then is not counted.
        # With 3 s, CI (two test workers on 2 cores) once counted 32 of the shifted window's 48 requests
        # (alone, 48): room for a loaded box's sink
        SLUICE_DRIFT_LATENESS_S="12",
        SLUICE_DRIFT_INTERVAL_S="0.5",
        SLUICE_DRIFT_MIN_SAMPLES="30",
        SLUICE_DRIFT_MAX_TENANTS="0",
    ) as running:
        yield running


@pytest.fixture(scope="module")
async def drift_log(e2e_settings: PlatformSettings, platform: Platform) -> AsyncIterator[TopicLog]:
    log = TopicLog(e2e_settings.kafka, platform.names.drift)
    log._thread.start()
    yield log
    log._thread.stop()


async def _complete(session: aiohttp.ClientSession, url: str, prompt: str) -> str:
    body = {"model": GPT, "messages": [{"role": "user", "content": prompt}], "max_tokens": 6}
    async with session.post(f"{url}/chat/completions", headers=AUTH, json=body) as response:
        assert response.status == 200, await response.text()
        return response.headers["x-request-id"]


async def _window_of_traffic(
    session: aiohttp.ClientSession, url: str, prompts: list[str], seed: int
) -> tuple[datetime, float]:
    """Wait for the next window boundary, then send PER_WINDOW requests inside that window: its start, and
    how long after it the last one was answered."""
    now = time.time()
    start = now - now % WINDOW_S + WINDOW_S
    await asyncio.sleep(start - now + 0.3)
    rng = random.Random(seed)
    chosen = [
        rng.choice(prompts).format(secret=SECRET) + f" ({rng.randrange(1000)})" for _ in range(PER_WINDOW)
    ]
    gate = asyncio.Semaphore(8)

    async def one(prompt: str) -> str:
        async with gate:
            return await _complete(session, url, prompt)

    await asyncio.gather(*(one(p) for p in chosen))
    return datetime.fromtimestamp(start, UTC), time.time() - start


def _reports(log: TopicLog) -> list[DriftReport]:
    return [e for e in log.all() if isinstance(e, DriftReport) and e.model == GPT and e.tenant == "*"]


async def _rows_per_window(streams: Streams) -> dict[datetime, int]:
    """demo-gpt's ``drift_features`` rows per window, once every request the test sent is stored (or a
    minute passed)."""
    sql = (
        f"SELECT intDiv(toUnixTimestamp64Milli(finished), {int(WINDOW_S * 1000)}) AS window, count() AS n "
        f"FROM drift_features FINAL WHERE model = '{GPT}' GROUP BY window ORDER BY window"
    )
    deadline = time.monotonic() + 60
    while True:
        rows = await streams.sql(sql)
        if sum(r["n"] for r in rows) >= 3 * PER_WINDOW or time.monotonic() > deadline:
            return {datetime.fromtimestamp(r["window"] * WINDOW_S, UTC): int(r["n"]) for r in rows}
        await asyncio.sleep(0.3)


@pytest.mark.timeout(
    300
)  # three 20 s windows, the monitor, a replay: ~135 s alone, more on a busy 2-core box
async def test_drift_flips_on_a_shifted_mix_and_not_on_the_same_mix(
    platform: Platform, workers: list[WorkerService], streams: Streams, drift_log: TopicLog
) -> None:
    url = platform.base_url
    await streams.ready()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        sent = [
            await _window_of_traffic(session, url, ENGLISH, seed=1),
            await _window_of_traffic(session, url, ENGLISH, seed=2),
            await _window_of_traffic(session, url, GERMAN, seed=3),
        ]
    starts = [start for start, _took in sent]

    def judged() -> list[DriftReport]:
        by_start = {r.window_start: r for r in _reports(drift_log)}
        return [by_start[start] for start in starts if start in by_start]

    await drift_log.wait(lambda: len(judged()) == 3, within=60)
    reports = judged()
    assert [r.effective_verdict for r in reports] == ["reference", "no_drift", "drift"], [
        (r.effective_verdict, r.requests, r.quality) for r in reports
    ]
    reference, same, shifted = reports
    # Each report counted its window's every request: CI (2026-12-01, a loaded box) judged the shifted
    # window on 32 of its 48 twice, though they were answered in its first seconds; their results copies
    # waited for drift embeddings on a thread that got no core (gpu_workers/features.py).
    counts = [r.requests for r in reports]
    if counts != [PER_WINDOW] * 3:
        stored = await _rows_per_window(streams)
        pytest.fail(f"reports counted {counts}; the warehouse now holds {stored}; the answers took {sent}")
    assert same.reference_start == shifted.reference_start == reference.window_start
    assert not [f.name for f in same.features if f.drifted], "the same mix must not alarm"
    drifted = {f.name for f in shifted.features if f.drifted}
    assert {"prompt_language", "prompt_chars", "prompt_tokens", "embedding"} <= drifted, shifted.features
    assert shifted.quality == []
    assert same.quality == []

    # the warehouse holds the same reports (one row per event; inserted once the event is durable)
    await _wait_rows(streams, "drift_reports", len(reports))
    rows = await streams.sql(
        "SELECT report_id, verdict, feature_names, feature_drifted FROM drift_reports FINAL "
        f"WHERE model = '{GPT}' AND scope = '*' ORDER BY window_start"
    )
    ids = {r.id for r in reports}
    assert [(r["report_id"], r["verdict"]) for r in rows if r["report_id"] in ids] == [
        (r.id, r.effective_verdict) for r in reports
    ]

    # the CLI: status and the evidently HTML of the latest window
    status = _sluice(streams.env, "drift", "status", "--model", GPT)
    assert status.returncode == 0, status.stdout + status.stderr
    rows_out = [line for line in status.stdout.splitlines() if GPT in line]
    assert len(rows_out) == 1, status.stdout
    assert "│ drift " in rows_out[0], rows_out[0]
    assert "prompt_language" in status.stdout  # the features cell wraps onto the next lines of the table
    html = Path(streams.env["SLUICE_DATA_DIR"]).parent / "drift.html"
    made = _sluice(streams.env, "drift", "report", GPT, "--html", str(html))
    assert made.returncode == 0, made.stdout + made.stderr
    assert f": drift ({shifted.requests} requests" in made.stdout, made.stdout
    assert "<html" in html.read_text()[:2000].lower()

    # the dashboard in a real browser shows the verdict and the drifted features
    from tests.streams.browser import render

    shot = ROOT / "test-artifacts" / "dashboard-drift-e2e.png"
    rendered = await render(
        f"{streams.url}/dashboard",
        shot,
        wait_for_js="document.getElementById('drift-body').textContent.includes('prompt_language')",
        evaluate={
            "verdicts": "[...document.querySelectorAll('#drift-body td')].map(td => td.textContent.trim())"
        },
    )
    assert rendered.console_errors == []
    cells = rendered.values["verdicts"]
    assert "drift" in cells, cells  # the status cell says exactly "drift" (not "no_drift")
    assert GPT in cells

    # no prompt text anywhere in the warehouse
    leaks = await streams.sql(
        f"SELECT (SELECT count() FROM events_raw WHERE position(payload, '{SECRET}') > 0) AS raw, "
        f"(SELECT count() FROM drift_features WHERE position(toString(tuple(*)), '{SECRET}') > 0) AS features"
    )
    assert leaks == [{"raw": 0, "features": 0}]

    # a replay into an empty warehouse rebuilds the drift tables identically
    replay_env = {
        **streams.env,
        "SLUICE_DATA_DIR": str(Path(streams.env["SLUICE_DATA_DIR"]).parent / "replay"),
    }
    replayed = _sluice(replay_env, "replay")
    assert replayed.returncode == 0, replayed.stdout + replayed.stderr
    for table in ("drift_reports FINAL", "drift_features FINAL", "events_raw FINAL"):
        sql = f"SELECT count() AS n, sum(cityHash64(*)) AS h FROM (SELECT * FROM {table})"
        live: Any = (await streams.sql(sql))[0]
        again = _sluice(replay_env, "sql", sql, "-f", "json")
        assert again.returncode == 0, again.stderr
        assert json.loads(again.stdout) == [live], f"{table} differs after replay"
        assert live["n"] > 0
