"""A served model id no request topic could be named for is a settings error in every command."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

import sluice.cli
from sluice.cli import app


@pytest.mark.parametrize("command", [["settings"], ["topics", "list"], ["topics", "apply"]])
def test_every_command_refuses_a_model_id_in_one_line(
    tmp_path: Path, command: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before, `sluice settings` accepted `SLUICE_MODELS='demo gpt'` and `sluice topics` failed with a
    traceback (and `sluice up` too, after it started Kafka): found by a review."""
    monkeypatch.setattr(sluice.cli, "_settings", None)  # read once per process: another test read them
    env = {"SLUICE_MODELS": "demo gpt", "SLUICE_DATA_DIR": str(tmp_path), "COLUMNS": "300"}
    result = CliRunner().invoke(app, command, env=env)
    assert result.exit_code == 2, result.output
    assert result.output.splitlines() == [
        "settings error: PlatformSettings: SLUICE_MODELS: model id 'demo gpt' may contain only letters, "
        "digits, '.', '_' and '-'"
    ]
