"""``sluice audit``'s command line on an embedded warehouse of its own (the checks themselves:
tests/streams/test_audit.py and test_audit_anchor.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from schemas.settings import PlatformSettings
from sluice import cli as sluice_cli
from sluice.cli import app
from tests.streams.test_audit import insert_chains


@pytest.fixture
def settings(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> PlatformSettings:
    settings = PlatformSettings(data_dir=str(tmp_path / "data"))
    monkeypatch.setattr(sluice_cli, "_settings", settings)
    return settings


@pytest.mark.integration
def test_verify_of_a_tenant_without_a_chain_does_not_say_verified(settings: PlatformSettings) -> None:
    """A review: ``sluice audit verify --tenant acmee`` (a typo of acme) printed "audit log verified: 0
    entries in 0 tenant chains" and exited 0, so a script checking one tenant's chain was told it holds."""
    insert_chains(settings, {"acme": 4})
    typo = CliRunner().invoke(app, ["audit", "verify", "--warehouse-only", "--tenant", "acmee"])
    assert typo.exit_code == 1, typo.output
    assert "verified:" not in typo.stdout
    assert "no audit chain for tenant 'acmee' in the warehouse: nothing verified" in typo.stderr
    known = CliRunner().invoke(app, ["audit", "verify", "--warehouse-only", "--tenant", "acme"])
    assert known.exit_code == 0, known.output
    assert "audit log verified: 4 entries in 1 tenant chains" in known.stdout
