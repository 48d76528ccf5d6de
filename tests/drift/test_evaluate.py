"""The drift evaluator on seeded synthetic windows: calibration (false alarms), power on the shifts we care
about, data-quality findings, insufficient data, determinism, and the HTML report."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pandas as pd
import pytest

from drift.evaluate import CATEGORICAL, NUMERICAL, DriftConfig, Evaluation, evaluate, html_report

DIM = 384
Embeddings = npt.NDArray[np.float32]


def _window(
    rng: np.random.Generator,
    n: int = 1000,
    *,
    token_scale: float = 1.0,
    german: float = 0.2,
    refusals: float = 0.02,
) -> pd.DataFrame:
    """One window of requests as the warehouse returns them (bools, strings, counts, floats)."""
    prompt_tokens = np.maximum(1, rng.lognormal(4.0, 0.8, n) * token_scale).astype(int)
    return pd.DataFrame(
        {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": rng.integers(1, 256, n),
            "prompt_chars": (prompt_tokens * rng.normal(4.1, 0.3, n)).astype(int),
            "prompt_non_ascii": rng.beta(1.0, 30.0, n),
            "output_chars": rng.integers(0, 1000, n),
            "mean_logprob": -rng.gamma(2.0, 0.3, n),
            "mean_entropy": rng.gamma(2.0, 0.5, n),
            "prompt_script": ["latin"] * n,
            "prompt_language": rng.choice(["en", "de", "fr"], n, p=[0.75 - german, german, 0.25]),
            "output_script": ["latin"] * n,
            "finish_reason": rng.choice(["stop", "length"], n, p=[0.9, 0.1]),
            "status": ["completed"] * n,
            "empty_output": [False] * n,
            "refusal": list(rng.random(n) < refusals),
        }
    )


def _centre(rng: np.random.Generator) -> npt.NDArray[np.float64]:
    centre = rng.normal(size=DIM)
    return centre / np.linalg.norm(centre)


def _embeddings(rng: np.random.Generator, centre: npt.NDArray[np.float64], n: int = 200) -> Embeddings:
    """Unit vectors around ``centre`` (cosine ~0.45 to it), like sentence embeddings of one topic."""
    vectors = 0.5 * centre + rng.normal(size=(n, DIM)) / np.sqrt(DIM)
    return np.asarray(vectors / np.linalg.norm(vectors, axis=1, keepdims=True), dtype=np.float32)


def _none() -> Embeddings:
    return np.zeros((0, DIM), dtype=np.float32)


def _by_name(result: Evaluation) -> dict[str, bool]:
    return {feature.name: feature.drifted for feature in result.features}


def _drifted(result: Evaluation) -> set[str]:
    return {name for name, drifted in _by_name(result).items() if drifted}


# --- calibration and determinism ---------------------------------------------------------------------------


def test_same_distribution_rarely_raises_a_false_alarm() -> None:
    verdicts = []
    for seed in range(20):
        rng = np.random.default_rng(seed)
        centre = _centre(rng)
        result = evaluate(
            _window(rng),
            _window(rng),
            _embeddings(rng, centre),
            _embeddings(rng, centre),
            DriftConfig(seed=seed),
        )
        assert result.quality == []
        verdicts.append(result.verdict)
    assert verdicts.count("no_drift") >= 19, verdicts


def test_every_feature_is_tested_at_the_bonferroni_level() -> None:
    rng = np.random.default_rng(1)
    centre = _centre(rng)
    result = evaluate(_window(rng), _window(rng), _embeddings(rng, centre), _embeddings(rng, centre))
    names = [feature.name for feature in result.features]
    assert names == [*NUMERICAL, *CATEGORICAL, "embedding"]
    level = 0.01 / len(names)
    tabular = [feature for feature in result.features if feature.kind != "embedding"]
    assert all(feature.threshold == pytest.approx(level) for feature in tabular)
    assert all(feature.statistic == feature.p_value for feature in tabular)
    assert result.method.endswith(f"Bonferroni alpha=0.01 over {len(names)} tests")
    assert result.verdict == "no_drift"
    assert result.share_drifted == 0.0


def test_the_same_inputs_give_the_same_evaluation() -> None:
    rng = np.random.default_rng(2)
    centre = _centre(rng)
    inputs = (_window(rng, 1500), _window(rng, 1500), _embeddings(rng, centre, 400), _embeddings(rng, centre))
    assert evaluate(*inputs) == evaluate(*inputs)


# --- drift --------------------------------------------------------------------------------------------------


def test_longer_prompts_drift_prompt_length() -> None:
    rng = np.random.default_rng(3)
    result = evaluate(_window(rng), _window(rng, token_scale=1.5), _none(), _none())
    assert result.verdict == "drift"
    assert result.drifted
    assert {"prompt_tokens", "prompt_chars"} <= _drifted(result)
    assert result.share_drifted == pytest.approx(len(_drifted(result)) / len(result.features))


def test_a_shift_from_english_to_german_drifts_prompt_language() -> None:
    rng = np.random.default_rng(4)
    result = evaluate(_window(rng, german=0.1), _window(rng, german=0.4), _none(), _none())
    assert result.verdict == "drift"
    assert _drifted(result) == {"prompt_language"}


def test_more_refusals_drift_the_bool_refusal() -> None:
    rng = np.random.default_rng(5)
    result = evaluate(_window(rng), _window(rng, refusals=0.2), _none(), _none())
    (refusal,) = [feature for feature in result.features if feature.name == "refusal"]
    assert refusal.kind == "categorical"
    assert refusal.drifted


def test_embeddings_around_another_centre_drift_the_embedding_only() -> None:
    rng = np.random.default_rng(6)
    result = evaluate(
        _window(rng), _window(rng), _embeddings(rng, _centre(rng)), _embeddings(rng, _centre(rng))
    )
    assert result.verdict == "drift"
    assert _drifted(result) == {"embedding"}
    embedding = result.features[-1]
    assert embedding.kind == "embedding"
    assert embedding.method == "mmd"
    assert embedding.statistic > embedding.threshold
    assert embedding.p_value is not None
    assert embedding.p_value < 0.01 / len(result.features)


def test_embeddings_around_the_same_centre_do_not_drift() -> None:
    rng = np.random.default_rng(7)
    centre = _centre(rng)
    result = evaluate(_window(rng), _window(rng), _embeddings(rng, centre, 300), _embeddings(rng, centre, 60))
    embedding = result.features[-1]
    assert embedding.name == "embedding"
    assert not embedding.drifted
    assert embedding.statistic <= embedding.threshold


def test_too_few_embeddings_are_not_tested_and_not_an_alarm() -> None:
    rng = np.random.default_rng(8)
    centre = _centre(rng)
    result = evaluate(_window(rng), _window(rng), _embeddings(rng, centre), _embeddings(rng, centre, 10))
    assert "embedding" not in _by_name(result)
    assert result.verdict == "no_drift"


# --- insufficient data and robustness ----------------------------------------------------------------------


@pytest.mark.parametrize(("n_reference", "n_current"), [(49, 1000), (1000, 49), (0, 0)])
def test_too_few_rows_are_insufficient_data_without_tests(n_reference: int, n_current: int) -> None:
    rng = np.random.default_rng(9)
    result = evaluate(_window(rng, n_reference), _window(rng, n_current), _none(), _none())
    assert result.verdict == "insufficient_data"
    assert result.features == []
    assert not result.drifted


def test_constant_columns_do_not_drift() -> None:
    rng = np.random.default_rng(10)
    reference, current = _window(rng, refusals=0.0), _window(rng, refusals=0.0)
    current["completion_tokens"] = reference["completion_tokens"] = 16
    result = evaluate(reference, current, _none(), _none())
    assert result.verdict == "no_drift"
    constant = {"completion_tokens", "refusal", "status", "empty_output", "prompt_script"}
    assert all(not _by_name(result)[name] for name in constant)


def test_a_column_missing_in_both_windows_is_skipped() -> None:
    rng = np.random.default_rng(11)
    reference, current = _window(rng), _window(rng)
    reference["mean_logprob"] = current["mean_logprob"] = None
    reference = reference.drop(columns=["output_script"])
    current["output_script"] = None
    result = evaluate(reference, current, _none(), _none())
    assert result.verdict == "no_drift"
    assert {"mean_logprob", "output_script"}.isdisjoint(_by_name(result))


def test_unseen_categories_in_current_do_not_crash() -> None:
    rng = np.random.default_rng(12)
    reference, current = _window(rng), _window(rng)
    current.loc[:4, "prompt_language"] = "sv"
    few = evaluate(reference, current, _none(), _none())
    assert not _by_name(few)["prompt_language"]
    current.loc[:299, "prompt_language"] = "ja"
    many = evaluate(reference, current, _none(), _none())
    assert _by_name(many)["prompt_language"]


def test_more_rows_than_the_cap_are_subsampled() -> None:
    rng = np.random.default_rng(13)
    result = evaluate(_window(rng, 5000), _window(rng, 3000), _none(), _none())
    assert result.verdict == "no_drift"
    assert len(result.features) == len(NUMERICAL) + len(CATEGORICAL)


# --- data quality ------------------------------------------------------------------------------------------


def test_a_feature_that_went_missing_is_a_data_quality_finding() -> None:
    rng = np.random.default_rng(14)
    reference, current = _window(rng), _window(rng)
    current["prompt_language"] = None
    current.loc[:449, "mean_entropy"] = np.nan
    result = evaluate(reference, current, _none(), _none())
    assert result.verdict == "data_quality"
    assert result.quality == [
        "mean_entropy: 45% missing (reference 0%)",
        "prompt_language: 100% missing (reference 0%)",
    ]
    assert "prompt_language" not in _by_name(result)
    (entropy,) = [feature for feature in result.features if feature.name == "mean_entropy"]
    assert entropy.null_share == pytest.approx(0.45)
    assert entropy.reference_null_share == 0.0


@pytest.mark.parametrize("failed", [300, 1000])
def test_failures_are_drift_not_a_broken_feature_pipeline(failed: int) -> None:
    """Found by an audit: a failed request has no answer to measure, and its answer's features counted as
    missing over every request: 30 % failing (or an outage) read as a broken feature pipeline
    (``data_quality``, which outranks drift), while 15 % read as drift."""
    rng = np.random.default_rng(21)
    reference, current = _window(rng), _window(rng)
    current.loc[: failed - 1, "status"] = "failed"
    current.loc[: failed - 1, "finish_reason"] = "error"
    for name in ("output_chars", "mean_logprob", "mean_entropy"):
        current[name] = current[name].astype(float)
        current.loc[: failed - 1, name] = np.nan
    for name in ("output_script", "empty_output", "refusal"):
        current[name] = current[name].astype(object)
        current.loc[: failed - 1, name] = None
    result = evaluate(reference, current, _none(), _none())
    assert result.quality == []
    assert result.verdict == "drift"
    assert {"status", "finish_reason"} <= _drifted(result)


def test_values_out_of_range_are_a_data_quality_finding() -> None:
    rng = np.random.default_rng(15)
    reference, current = _window(rng), _window(rng)
    current.loc[:2, "prompt_non_ascii"] = 1.5
    current.loc[:0, "mean_logprob"] = 0.25
    current.loc[:0, "output_chars"] = -1
    result = evaluate(reference, current, _none(), _none())
    assert result.verdict == "data_quality"
    assert result.quality == [
        "prompt_non_ascii: 3 of 1000 values out of range [0, 1]",
        "output_chars: 1 of 1000 values out of range [0, inf)",
        "mean_logprob: 1 of 1000 values out of range (-inf, 0]",
    ]


def test_embeddings_that_stopped_being_sampled_are_a_data_quality_finding() -> None:
    rng = np.random.default_rng(16)
    result = evaluate(_window(rng), _window(rng), _embeddings(rng, _centre(rng)), _none())
    assert result.verdict == "data_quality"
    assert result.quality == ["embedding: not sampled (0 of 1000 requests; reference 20.0%)"]
    assert "embedding" not in _by_name(result)


@pytest.mark.parametrize("bad", [1.0, 0.5])
def test_embeddings_that_are_not_finite_are_named_not_called_unsampled(bad: float) -> None:
    """Found by an audit: vectors with a NaN, or past float32's range once stored (inf), were left out
    silently; all of them left out read "not sampled", which sent the operator to the sampler."""
    rng = np.random.default_rng(20)
    centre = _centre(rng)
    current = _embeddings(rng, centre).astype(np.float32)
    current[: int(len(current) * bad), 0] = np.float32(np.inf)
    current[0, 1] = np.nan
    result = evaluate(_window(rng), _window(rng), _embeddings(rng, centre), current)
    assert result.verdict == "data_quality"
    assert result.quality == [
        f"embedding: {int(len(current) * bad)} of {len(current)} vectors with values that are not finite"
    ]
    assert ("embedding" in _by_name(result)) is (bad < 1.0)  # the finite rest is still tested


def test_data_quality_takes_precedence_over_drift() -> None:
    rng = np.random.default_rng(17)
    reference, current = _window(rng), _window(rng, token_scale=2.0)
    current["refusal"] = None
    result = evaluate(reference, current, _none(), _none())
    assert result.verdict == "data_quality"
    assert result.drifted
    assert "prompt_tokens" in _drifted(result)


# --- configuration and html --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"alpha": 0.0},
        {"alpha": 1.0},
        {"min_samples": 1},
        {"embedding_components": 0},
        {"null_tolerance": 2.0},
    ],
)
def test_invalid_configs_are_rejected(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="must be"):
        DriftConfig(**kwargs)  # type: ignore[arg-type]


def test_html_report_is_evidently_html_with_the_same_embedding_test() -> None:
    rng = np.random.default_rng(18)
    centre = _centre(rng)
    html = html_report(
        _window(rng, 300),
        _window(rng, 300, token_scale=1.5),
        _embeddings(rng, centre, 30),  # few rows: the embeddings widget runs a t-SNE
        _embeddings(rng, centre, 30),
    )
    assert "<html" in html
    assert "mmd (permutation p=" in html


def test_html_report_of_too_few_rows_is_an_empty_page() -> None:
    rng = np.random.default_rng(19)
    assert "<html" in html_report(_window(rng, 10), _window(rng, 10), _none(), _none())


def test_a_small_window_without_embeddings_by_chance_is_not_a_finding() -> None:
    """At 5 % sampling, 100 requests carry no embedding 0.6 % of the time: below the false-alarm level
    that is chance, not a stopped sampler."""
    from drift.evaluate import _embedding_findings

    reference = np.zeros((5, 4), dtype=np.float64)  # 5 of 100 reference requests embedded
    nothing = np.zeros((0, 4), dtype=np.float64)
    level = 0.01 / 15
    assert _embedding_findings(reference, nothing, 100, 100, level) == []
    assert _embedding_findings(reference, nothing, 100, 1000, level) == [
        "embedding: not sampled (0 of 1000 requests; reference 5.0%)"
    ]


@pytest.mark.parametrize("where", ["current", "reference"])
def test_values_too_large_to_be_measurements_are_a_finding_not_a_crash(where: str) -> None:
    """Found by an audit: a few values near 1e308 (in range for ``mean_logprob``: any negative) made
    evidently's histograms raise; the window failed, and with such a reference every later window of
    its model. They are a data-quality finding and left out of the tests."""
    rng = np.random.default_rng(16)
    reference, current = _window(rng), _window(rng)
    hostile = current if where == "current" else reference
    hostile.loc[:5, "mean_logprob"] = -1e308
    hostile.loc[:1, "mean_entropy"] = 1.7e308
    result = evaluate(reference, current, _none(), _none())
    if where == "current":
        assert result.verdict == "data_quality"
        assert result.quality == [
            "mean_logprob: 6 of 1000 values beyond 1e+12 across",
            "mean_entropy: 2 of 1000 values beyond 1e+12 across",
        ]
    else:  # the reference's are left out of its tests
        assert result.verdict == "no_drift"
    assert all(np.isfinite(f.statistic) for f in result.features)


@pytest.mark.parametrize(
    "vectors", ["zero", "identical", "near float32's largest"], ids=["zero", "identical", "huge"]
)
def test_an_html_report_of_degenerate_embeddings_has_no_plot_and_does_not_crash(vectors: str) -> None:
    """Found by an audit: evidently's t-SNE plot of identical vectors (all zero, say), or of vectors near
    3e38, killed the process (SIGSEGV in scikit-learn): `sluice drift report --html` exited 139. Run in a
    child process, so that such a crash fails this test instead of the test run."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(
        f"""
        import numpy as np
        from drift.evaluate import DriftConfig, html_report
        from tests.drift.test_evaluate import _embeddings, _centre, _window, DIM
        rng = np.random.default_rng(17)
        kind = {vectors!r}
        if kind == "zero":
            ref = cur = np.zeros((120, DIM), dtype=np.float32)
        elif kind == "identical":
            ref = cur = np.ones((120, DIM), dtype=np.float32)
        else:
            ref, cur = _embeddings(rng, _centre(rng), 120), np.full((120, DIM), 3e38, dtype=np.float32)
        html = html_report(_window(rng, 300), _window(rng, 300), ref, cur, DriftConfig(min_samples=40))
        assert "<html" in html
        print("ok")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().endswith("ok")
