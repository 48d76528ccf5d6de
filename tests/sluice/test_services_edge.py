"""``sluice edge`` (``run_edge_process``) refuses what it cannot start with one line, not a traceback."""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest
from rich.console import Console

from schemas.settings import PlatformSettings
from sluice import services


def test_an_edge_with_a_tenants_file_that_does_not_load_exits_2_with_one_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A review: ``CatalogueError`` went through, so an edge child crash-looped on a traceback."""
    for name in [k for k in os.environ if k.startswith("SLUICE_") and k != "SLUICE_CACHE_DIR"]:
        monkeypatch.delenv(name)
    monkeypatch.setattr(services, "observe", lambda *_args: None)
    missing = tmp_path / "no-such-tenants.toml"
    monkeypatch.setenv("SLUICE_EDGE_TENANTS_FILE", str(missing))
    screen = io.StringIO()
    code = services.run_edge_process(PlatformSettings(), Console(file=screen, width=300))
    lines = screen.getvalue().splitlines()
    assert code == 2
    assert len(lines) == 1
    assert lines[0].startswith(f"error: SLUICE_EDGE_TENANTS_FILE: tenants file {missing}: ")
