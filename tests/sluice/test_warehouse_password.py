"""The warehouse password in ``SLUICE_WAREHOUSE_URL`` stays out of stderr and the logs: a review found it
quoted whole by every error about the URL (``sluice streams``, ``sluice sql``), unknown to the log scrubber,
and not registered as a secret by the services."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

import sluice.cli as sluice_cli
import sluice.services as services
from monitoring.logs import REDACTED, scrub
from monitoring.settings import ObservabilitySettings
from schemas.settings import PlatformSettings
from sluice.cli import app


def test_a_service_registers_the_warehouse_password_as_a_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    configured: list[str] = []

    def configure_logging(settings: ObservabilitySettings, service: str) -> None:
        configured.append(service)  # this test's process keeps its own logging

    monkeypatch.setattr(services, "configure_logging", configure_logging)
    monkeypatch.delenv("SLUICE_OTLP_ENDPOINT", raising=False)
    # as written (percent-encoded) and as the client sends it: a log line may hold either
    platform = PlatformSettings(warehouse_url="https://bob:wh-pa55%2Fw0rd@ch.example:8443/db")
    assert services.observe("streams", platform) is None
    assert configured == ["streams"]
    assert (
        scrub("password wh-pa55%2Fw0rd, sent as wh-pa55/w0rd") == f"password {REDACTED}, sent as {REDACTED}"
    )


@pytest.mark.parametrize(
    "url",
    [
        "http://u:hunter2secret@localhost:abc",
        "clickhouse://u:hunter2secret@ch:9000",
        "http://u:hunter2secret@[x",
    ],
)
def test_sql_with_a_bad_warehouse_url_does_not_print_its_password(
    monkeypatch: pytest.MonkeyPatch, url: str
) -> None:
    monkeypatch.setattr(sluice_cli, "_settings", PlatformSettings(warehouse_url=url))
    result = CliRunner().invoke(app, ["sql", "SELECT 1"])
    assert result.exit_code == 1, result.output
    assert "warehouse url" in result.output
    assert "hunter2secret" not in result.output


@pytest.mark.parametrize(
    "url",
    [
        "http://sluice:s3cr#tPassw0rd@clickhouse:8123/sluice",
        "http://sluice:s3cr/tPassw0rd@clickhouse:8123",
        "http://sluice:s3cr?tPassw0rd@clickhouse:8123",
        "http://sluice:s3cr[tPassw0rd@clickhouse:8123",
    ],
)
def test_a_password_holding_what_a_url_parser_splits_at_is_never_shown(
    monkeypatch: pytest.MonkeyPatch, url: str
) -> None:
    """Found by a review: an unencoded '#', '/' or '?' in the password cut the parser's host part short, so
    ``sluice settings`` and the errors printed the password, and '[' made ``sluice settings`` raise."""
    from schemas.settings import display

    assert "tPassw0rd" not in display("warehouse_url", url)
    monkeypatch.setattr(sluice_cli, "_settings", None)  # read once per process: read them with this URL
    result = CliRunner().invoke(app, ["settings"], env={"SLUICE_WAREHOUSE_URL": url, "COLUMNS": "300"})
    assert result.exit_code == 0, result.output
    assert "sluice:[REDACTED]@clickhouse" in result.output
    assert "tPassw0rd" not in result.output
    configured: list[str] = []
    monkeypatch.setattr(services, "configure_logging", lambda settings, service: configured.append(service))
    monkeypatch.delenv("SLUICE_OTLP_ENDPOINT", raising=False)
    services.observe("streams", PlatformSettings(warehouse_url=url))
    assert "tPassw0rd" not in scrub(f"connecting with {url[url.index('s3cr') : url.index('@')]}")
