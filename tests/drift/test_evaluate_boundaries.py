"""Boundaries of drift/evaluate.py its other tests let pass: found by mutation testing, each test here fails
with a one-line change to it that the module's other tests did not notice."""

from __future__ import annotations

import numpy as np

from drift.evaluate import DriftConfig, evaluate
from tests.drift.test_evaluate import _none, _window


def test_windows_of_exactly_min_samples_rows_are_tested() -> None:
    """evaluate.py:197 (``>= min_samples``): a window of exactly ``min_samples`` rows is not
    insufficient_data, so its features must be tested: not a no_drift verdict over no test at all."""
    rng = np.random.default_rng(3)
    config = DriftConfig(min_samples=50)
    result = evaluate(_window(rng, 50), _window(rng, 50, token_scale=4.0), _none(), _none(), config)
    assert result.features, "no feature tested"
    assert result.verdict == "drift"


def test_a_missing_share_grown_by_exactly_the_tolerance_is_not_a_finding() -> None:
    """evaluate.py:245 (``> tolerance``): "grows by more than" null_tolerance (0.2): 20 % missing against
    none is not a data_quality finding (which would outrank a drift verdict)."""
    rng = np.random.default_rng(5)
    reference, current = _window(rng), _window(rng)
    current.loc[current.index[:200], "mean_logprob"] = np.nan
    result = evaluate(reference, current, _none(), _none())
    assert result.quality == []
    current.loc[current.index[:201], "mean_logprob"] = np.nan
    assert evaluate(reference, current, _none(), _none()).verdict == "data_quality"


def test_identical_embeddings_in_both_windows_do_not_drift() -> None:
    """Every vector the same in both windows (a model that embeds everything alike, a cache): PCA of a pool
    with no spread left ~1e-29 of rounding noise, which the kernel's median scale (~1e-61) turned into
    structure, and the windows read as drift at p ~ 1e-4, a rollout's drift gate rolling back for nothing."""
    rng = np.random.default_rng(7)
    vector = np.ones((1, 384), dtype=np.float32) / np.sqrt(384)
    same = np.repeat(vector, 100, axis=0)
    result = evaluate(_window(rng), _window(rng), same, same.copy())
    (embedding,) = [f for f in result.features if f.name == "embedding"]
    assert not embedding.drifted
