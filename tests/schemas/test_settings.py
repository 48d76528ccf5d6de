"""Settings from the environment: what a wrong value gets is a SettingsError naming the variable (the CLI
prints it as one line), never another exception."""

from __future__ import annotations

import pytest

from gpu_workers.settings import WorkerSettings
from ingest.settings import EdgeSettings
from schemas.settings import PlatformSettings, SettingsError, load_settings
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


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        ("SLUICE_MODELS", "demo gpt", r"SLUICE_MODELS: model id 'demo gpt' may contain only letters"),
        ("SLUICE_MODELS", "a/b", r"SLUICE_MODELS: model id 'a/b' may contain only letters"),
        ("SLUICE_MODELS", "m" * 240, r"SLUICE_MODELS: topic name longer than 249 characters"),
        (
            "SLUICE_MODEL_PATHS",
            "my model=/models/x",
            r"SLUICE_MODEL_PATHS: model id 'my model' may .* \(its entries are id=/path or id:task=/path",
        ),
        ("SLUICE_MODEL_PATHS", "/models/x", r"SLUICE_MODEL_PATHS: entry '/models/x': expected id=/path"),
        (
            "SLUICE_MODEL_PATHS",
            "m:chat=/x",
            r"SLUICE_MODEL_PATHS: entry 'm:chat=/x': task 'chat' is not one of",
        ),
    ],
)
def test_a_model_id_no_topic_could_be_named_for_is_refused(variable: str, value: str, message: str) -> None:
    """Each served id names its request topic. A review found `SLUICE_MODELS='demo gpt'` accepted by
    `sluice settings`, then a traceback from `sluice topics`, and from `sluice up` after it started Kafka."""
    with pytest.raises(SettingsError, match=f"^PlatformSettings: {message}"):
        load_settings(PlatformSettings, {variable: value})
    with pytest.raises(ValueError, match=message):  # built in code, too
        PlatformSettings(**{variable.removeprefix("SLUICE_").lower(): (value,)})  # type: ignore[arg-type]
    good = load_settings(PlatformSettings, {"SLUICE_MODELS": "demo-gpt,v1.2_x", "SLUICE_MODEL_PATHS": "m=/x"})
    assert good.served_models() == ("demo-gpt", "v1.2_x", "m")


def test_an_embedding_reservoir_below_the_embedding_tests_minimum_is_refused() -> None:
    """Found by a review: SLUICE_DRIFT_EMBEDDING_RESERVOIR accepted 2-19, below the 20 embeddings the
    embedding test needs in a window, which silently turned that test off."""
    with pytest.raises(SettingsError, match="SLUICE_DRIFT_EMBEDDING_RESERVOIR=19 is below 20"):
        load_settings(StreamsSettings, {"SLUICE_DRIFT_EMBEDDING_RESERVOIR": "19"})
    assert (
        load_settings(StreamsSettings, {"SLUICE_DRIFT_EMBEDDING_RESERVOIR": "20"}).drift_embedding_reservoir
        == 20
    )


def test_a_drift_minimum_above_the_windows_sample_is_refused() -> None:
    """Found by a review: the minimum is counted on a window's sample (at most SLUICE_DRIFT_RESERVOIR rows),
    so a minimum above it judged no window ever, silently: no reference, no alarm."""
    with pytest.raises(
        SettingsError, match="SLUICE_DRIFT_MIN_SAMPLES=2000 is above SLUICE_DRIFT_RESERVOIR=1000"
    ):
        load_settings(StreamsSettings, {"SLUICE_DRIFT_MIN_SAMPLES": "2000"})
    assert load_settings(StreamsSettings, {"SLUICE_DRIFT_MIN_SAMPLES": "1000"}).drift_min_samples == 1000
