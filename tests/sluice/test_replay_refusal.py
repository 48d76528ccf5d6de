"""``sluice replay`` refuses a target warehouse that is not empty before it writes anything to it.

Found by a review: the refusal came after the replay had migrated the target and applied its own shell's
raw-event retention. Aimed at the live warehouse (a forgotten ``--data-dir``, or ``SLUICE_WAREHOUSE_URL``
set), a refused replay deleted the raw events between its retention (30 days by default) and the live
worker's, which the topics (7 days) can no longer give back, and a newer release's replay left the live
warehouse migrated past the code that runs it ("migrated by newer code" at the streams worker's next start)."""

from __future__ import annotations

import shutil
from datetime import timedelta
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from infra.warehouse import migrate, open_warehouse
from infra.warehouse.errors import MigrationError
from infra.warehouse.migrate import MIGRATIONS_DIR
from schemas.codec import encode
from schemas.settings import PlatformSettings
from sluice.cli import app
from sluice.services import run_replay
from streams.pricing import PriceTable
from streams.service import apply_retention
from streams.sink import Consumed, Rows, insert
from tests.streams.test_queries import event, migrated_warehouse, now_ms, rows

SHELL = ("SLUICE_STREAMS_RAW_RETENTION_DAYS", "SLUICE_WAREHOUSE_URL", "SLUICE_STREAMS_PRICES_FILE")


def refused(live: Path) -> str:
    console = Console(record=True, width=200)
    code = run_replay(PlatformSettings(kafka_bootstrap="127.0.0.1:1", data_dir=str(live)), console, None, 5)
    text = console.export_text()
    assert code == 1, text
    return text


def test_a_refused_replay_leaves_the_retention_and_rows_of_the_warehouse_it_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    live = tmp_path / "live"
    with migrated_warehouse(live) as client:
        apply_retention(client, 90)  # the live worker runs with SLUICE_STREAMS_RAW_RETENTION_DAYS=90
        events = [event(finished=now_ms() - timedelta(days=60)), event(finished=now_ms())]
        consumed = [Consumed("p.results", 0, i, encode(e)) for i, e in enumerate(events)]
        insert(client, Rows(PriceTable()).batch(consumed))
    for name in SHELL:
        monkeypatch.delenv(name, raising=False)  # the operator's shell: the default retention, 30 days
    assert "not empty" in refused(live)
    with migrated_warehouse(live) as client:
        (left,) = rows(client, "SELECT count() AS n FROM events_raw")
        ttl = rows(client, "SELECT engine_full FROM system.tables WHERE name = 'events_raw'")[0][
            "engine_full"
        ]
    assert left["n"] == 2, f"the refused replay deleted raw events older than its own 30 days ({ttl})"
    assert "90" in ttl, ttl


def test_a_refused_replay_does_not_migrate_the_warehouse_it_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    live = tmp_path / "live"
    older = 6  # the release that runs knows the migrations up to this one
    with migrated_warehouse(live, upto=older) as client:
        consumed = [Consumed("p.results", 0, 0, encode(event(finished=now_ms())))]
        insert(client, Rows(PriceTable()).batch(consumed))
    for name in SHELL:
        monkeypatch.delenv(name, raising=False)
    refused(live)
    known = tmp_path / "known-migrations"
    known.mkdir()
    for path in MIGRATIONS_DIR.glob("*.sql"):
        if int(path.name[:4]) <= older:
            shutil.copy(path, known / path.name)
    client = open_warehouse(PlatformSettings(data_dir=str(live)))
    try:
        migrate(client, directory=known)  # the running release's streams worker starting again
    except MigrationError as exc:
        pytest.fail(f"the refused replay migrated the warehouse it refused: {exc}")
    finally:
        client.close()


def test_replay_help_names_the_configured_server_as_the_default_target() -> None:
    result = CliRunner().invoke(app, ["replay", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    assert "SLUICE_WAREHOUSE_URL" in " ".join(result.output.split())
