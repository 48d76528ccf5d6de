"""What ``sluice up`` refuses before it starts anything (Kafka, the streams worker, the workers)."""

from __future__ import annotations

from pathlib import Path

import pytest

from schemas.settings import PlatformSettings
from tests.sluice.test_up_checks import _run, started  # noqa: F401  (a fixture)


@pytest.mark.parametrize("content", [None, "[tenants.acme\n", '[tenants.acme]\nkey_sha256 = "not a list"\n'])
def test_a_tenants_file_that_does_not_load_is_refused_before_anything_starts(
    started: list[str],  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    content: str | None,
) -> None:
    """A review: Kafka, the streams worker, ``models prepare`` and the workers all started, then the edge
    ended it with a 40-line traceback on a missing file."""
    tenants = tmp_path / "tenants.toml"
    if content is not None:
        tenants.write_text(content)
    monkeypatch.setenv("SLUICE_EDGE_TENANTS_FILE", str(tenants))
    code, lines = _run(PlatformSettings(data_dir=str(tmp_path / "data")))
    assert code == 2
    assert len(lines) == 1
    assert lines[0].startswith(f"settings error: SLUICE_EDGE_TENANTS_FILE: tenants file {tenants}: ")
    assert started == []
