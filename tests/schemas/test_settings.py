"""Settings from the environment: what a wrong value gets is a SettingsError naming the variable (the CLI
prints it as one line), never another exception."""

from __future__ import annotations

import pytest

from gpu_workers.settings import WorkerSettings
from ingest.settings import EdgeSettings
from schemas.settings import SettingsError, load_settings
from streams.settings import StreamsSettings


@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "1e999"])
def test_a_float_setting_must_be_finite(value: str) -> None:
    """An infinite drift window overflowed where it was used (an audit)."""
    with pytest.raises(SettingsError, match=r"SLUICE_DRIFT_WINDOW_S=.*expected a finite number"):
        load_settings(StreamsSettings, {"SLUICE_DRIFT_WINDOW_S": value})


def test_an_int_setting_of_any_length_is_a_settings_error() -> None:
    """``math.isfinite`` of an int over 308 digits raises OverflowError (a review)."""
    with pytest.raises(SettingsError, match="SLUICE_EDGE_PORT"):
        load_settings(EdgeSettings, {"SLUICE_EDGE_PORT": "9" * 400})


def test_a_value_out_of_its_bounds_names_its_variable() -> None:
    with pytest.raises(SettingsError, match=r"EdgeSettings SLUICE_EDGE_PORT: Expected `int` <= 65535"):
        load_settings(EdgeSettings, {"SLUICE_EDGE_PORT": "70000"})


@pytest.mark.parametrize("worker_id", ["w" * 129, "a/b", "ünïcode"])
def test_a_worker_id_no_event_could_carry_is_refused(worker_id: str) -> None:
    """It names the worker in every event it produces, whose envelope holds at most 256 characters (a
    review: a 250-character id had every event of its worker dead-lettered)."""
    with pytest.raises(SettingsError, match="SLUICE_WORKER_ID"):
        load_settings(WorkerSettings, {"SLUICE_WORKER_ID": worker_id})
    assert load_settings(WorkerSettings, {"SLUICE_WORKER_ID": "demo-gpt-1.a_b"}).worker_id == "demo-gpt-1.a_b"
