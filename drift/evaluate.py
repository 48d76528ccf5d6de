"""Is the current window's traffic distributed like the reference window's?

One call compares two windows of per-request drift features (see :class:`schemas.events.DriftFeatures`) and
returns a verdict with one :class:`~schemas.events.FeatureDrift` per tested feature.

Method, per window pair:

1. **Enough data.** Fewer than ``min_samples`` rows in either window gives ``insufficient_data`` and no tests.
   Each window is capped at :data:`MAX_ROWS` rows (a seeded uniform subsample), so costs stay bounded and a
   large window does not make negligible differences "significant".
2. **Data quality**, before any test: a feature whose missing share grows by more than ``null_tolerance``,
   values outside :data:`RANGES` (or not finite) in the current window, embeddings that stopped being
   sampled. Any finding makes the verdict ``data_quality``: the feature pipeline changed, not the traffic.
3. **Tabular tests** through evidently's ``ValueDrift`` (the per-column metric ``DataDriftPreset`` is made
   of): two-sample Kolmogorov-Smirnov for numerical features, and for categorical ones a chi-square test of
   homogeneity on the 2 x k table of counts, registered with evidently as ``chi2_homogeneity``. Evidently's
   own ``chisquare`` is a goodness-of-fit test that takes the reference proportions as exact; with two
   samples of equal size it roughly doubles the statistic and raised false alarms ~100-fold at our
   thresholds. Categories too rare for the chi-square approximation (expected count below 5) are pooled,
   so a handful of requests in a new language is not drift. A feature is tested only when both windows
   hold at least ``min_samples`` measured values; bools are categories (``true``/``false``).
4. **Embedding test**: both windows' (seeded, at most :data:`MAX_EMBEDDING_ROWS`) MiniLM vectors are
   projected together on ``embedding_components`` principal components, then compared with the unbiased
   squared maximum mean discrepancy (MMD^2) under a Gaussian kernel whose bandwidth is the median pairwise
   distance of the pooled rows. Its null distribution comes from label permutations (the kernel, the PCA
   and the bandwidth do not depend on the labels, so the test is exact); the threshold is the permutation
   quantile at 1 - alpha/m, and the p-value is reported too. Evidently's ``EmbeddingsDrift`` computes
   t-SNE plots on every run and its MMD bootstrap is not calibrated (5% quantile, 100 draws), so
   :func:`evaluate` runs the test directly and :func:`html_report` hands the same test to
   ``EmbeddingsDrift`` as its drift method.
5. **Multiple testing**: with m tested features, each is tested at alpha/m (Bonferroni), so a window of
   unchanged traffic raises a false alarm with probability at most ``alpha``.

Verdict precedence: ``insufficient_data`` > ``data_quality`` > ``drift`` > ``no_drift``. The same inputs give
the same :class:`Evaluation` (every random choice is seeded with ``config.seed``).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
import pandas as pd
from scipy.spatial.distance import pdist, squareform
from scipy.stats import chi2_contingency
from sklearn.decomposition import PCA

from schemas.events import DriftVerdict, FeatureDrift

with warnings.catch_warnings():
    # evidently 0.7.23 touches numpy.core and litestar's deprecated DI helpers at import, and some of its
    # modules hold invalid escape sequences (a DeprecationWarning on 3.11, a SyntaxWarning later).
    warnings.simplefilter("ignore", DeprecationWarning)
    warnings.simplefilter("ignore", SyntaxWarning)
    import evidently
    from evidently import DataDefinition, Dataset, Report
    from evidently.core.report import Snapshot
    from evidently.core.serialization import SnapshotModel
    from evidently.legacy.calculations.stattests.registry import StatTest, register_stattest
    from evidently.legacy.core import ColumnType
    from evidently.legacy.metrics.data_drift.embedding_drift_methods import DriftMethod
    from evidently.metrics import EmbeddingsDrift, ValueDrift
    from evidently.presets import DataDriftPreset

NUMERICAL: tuple[str, ...] = (
    "prompt_tokens", "completion_tokens", "prompt_chars", "prompt_non_ascii", "output_chars", "mean_logprob",
    "mean_entropy",
)  # fmt: skip
CATEGORICAL: tuple[str, ...] = (
    "prompt_script", "prompt_language", "output_script", "finish_reason", "status", "empty_output", "refusal",
)  # fmt: skip
RANGES: dict[str, tuple[float, float]] = {
    "prompt_tokens": (0.0, math.inf),
    "completion_tokens": (0.0, math.inf),
    "prompt_chars": (0.0, math.inf),
    "prompt_non_ascii": (0.0, 1.0),
    "output_chars": (0.0, math.inf),
    "mean_logprob": (-math.inf, 0.0),
    "mean_entropy": (0.0, math.inf),
}
"""Valid values of the numerical features (bounds included); values must also be finite and at most
:data:`MAGNITUDE` across."""
MAGNITUDE = 1e12
"""Larger is no measurement of these features (an overflow, or hostile). It is a data-quality finding
and left out of the tests: evidently's histograms raised on a few values near 1e308 (their span
overflows), which failed the window, and a reference holding them every later window of its model."""
EMBEDDING = "embedding"

MAX_ROWS = 1000
"""Rows per window the tabular tests see (evidently's KS / chi-square regime)."""
MAX_EMBEDDING_ROWS = 300
"""Embedding rows per window the MMD test sees: its kernel matrix is (2 x this)^2."""
MIN_EXPECTED = 5.0
"""Smallest expected count per cell of the chi-square test; rarer categories are pooled."""
EXPECTED_EMBEDDINGS = 5.0
"""Embeddings the reference's sampling rate must predict for the current window before none is a finding."""
PERMUTATION_BATCH = 500

KS = "ks"
CHI2 = "chi2_homogeneity"
MMD = "mmd"

Kind = Literal["numerical", "categorical"]
FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True)
class DriftConfig:
    alpha: float = 0.01
    """Family-wise false-alarm rate per window (Bonferroni: each of m tested features at alpha / m)."""
    min_samples: int = 50
    """Fewer rows in either window: ``insufficient_data``, no tests; also the measured values a feature
    needs in both windows to be tested."""
    embedding_min_samples: int = 20
    """Fewer embedding rows in either window: the embedding is not tested (not an alarm)."""
    embedding_components: int = 10
    """Principal components the embeddings are projected on before the MMD test."""
    null_tolerance: float = 0.2
    """A feature whose missing share grows by more than this is a data-quality finding."""
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0.0 < self.alpha < 1.0:
            raise ValueError(f"alpha must be in (0, 1), got {self.alpha}")
        if self.min_samples < 2 or self.embedding_min_samples < 2:
            raise ValueError("min_samples and embedding_min_samples must be at least 2")
        if self.embedding_components < 1:
            raise ValueError(f"embedding_components must be at least 1, got {self.embedding_components}")
        if not 0.0 <= self.null_tolerance <= 1.0:
            raise ValueError(f"null_tolerance must be in [0, 1], got {self.null_tolerance}")


@dataclass(frozen=True)
class Evaluation:
    verdict: DriftVerdict
    """``no_drift``, ``drift``, ``insufficient_data`` or ``data_quality`` (``reference`` is the caller's)."""
    features: list[FeatureDrift]
    """One per tested feature: :data:`NUMERICAL`, then :data:`CATEGORICAL`, then ``embedding``."""
    share_drifted: float
    drifted: bool
    """Any feature drifted (also when the verdict is ``data_quality``)."""
    quality: list[str]
    method: str


# ------------------------------------------------------------------------------------------ tabular data


def _column(frame: pd.DataFrame, name: str) -> pd.Series:
    if name in frame.columns:
        return frame[name]
    return pd.Series(np.nan, index=frame.index, dtype=float)


def _label(value: object) -> str | None:
    if value is None or (isinstance(value, float) and math.isnan(value)) or value is pd.NA:
        return None
    if isinstance(value, bool | np.bool_):
        return "true" if value else "false"
    return str(value)


def _prepare(frame: pd.DataFrame) -> pd.DataFrame:
    """The features as evidently takes them: floats (NaN: not measured) and labels (None: not measured)."""
    numerical = {
        name: pd.to_numeric(_column(frame, name), errors="coerce").astype(float) for name in NUMERICAL
    }
    categorical = {
        name: _column(frame, name).astype(object).map(_label).astype(object) for name in CATEGORICAL
    }
    return pd.DataFrame({**numerical, **categorical}, index=frame.index)


def _capped(frame: pd.DataFrame, rows: int, seed: int) -> pd.DataFrame:
    if len(frame) <= rows:
        return frame
    keep = np.sort(np.random.default_rng(seed).choice(len(frame), size=rows, replace=False))
    return frame.iloc[keep]


def _measured(series: pd.Series) -> int:
    if pd.api.types.is_float_dtype(series):
        return int(np.isfinite(series.to_numpy()).sum())
    return int(series.notna().sum())


def _testable(reference: pd.DataFrame, current: pd.DataFrame, min_samples: int) -> list[str]:
    return [
        name
        for name in (*NUMERICAL, *CATEGORICAL)
        if min(_measured(reference[name]), _measured(current[name])) >= min_samples
    ]


PER_ANSWER: frozenset[str] = frozenset(
    {"output_chars", "output_script", "empty_output", "refusal", "mean_logprob", "mean_entropy"}
)
"""Features of a request's answer: a worker measures them on completed requests only, so their share not
measured is taken over those. An audit: over every request, a model failing 30 % of its requests (or all
of them, an outage) had these "30 % missing", a ``data_quality`` verdict ("the feature pipeline changed")
that outranks ``drift``: the failures reported as a broken pipeline, not as the drift they are."""


def _null_shares(frame: pd.DataFrame) -> dict[str, float]:
    # no status measured (the rollout gate's frames: completed pairs only): every answer counts; filtered
    # by a status of None, none did, and a candidate with no log-probabilities passed the gate (a review)
    measured = "status" in frame.columns and bool(frame["status"].notna().any())
    completed = frame["status"] == "completed" if measured else None
    shares: dict[str, float] = {}
    for name in frame.columns:
        column = frame[name]
        if name in PER_ANSWER and completed is not None:
            column = column[completed]
        shares[name] = float(column.isna().mean()) if len(column) else 0.0
    return shares


# --------------------------------------------------------------------------------------------- quality


def _percent(share: float) -> str:
    return f"{share:.0%}"


def _bound(value: float) -> str:
    return f"{value:g}"


def _range_text(low: float, high: float) -> str:
    left = "(" if math.isinf(low) else "["
    right = ")" if math.isinf(high) else "]"
    return f"{left}{_bound(low)}, {_bound(high)}{right}"


def _missing_findings(reference: dict[str, float], current: dict[str, float], tolerance: float) -> list[str]:
    return [
        f"{name}: {_percent(share)} missing (reference {_percent(reference[name])})"
        for name, share in current.items()
        if share - reference[name] > tolerance
    ]


def _within(values: npt.NDArray[Any], low: float, high: float) -> npt.NDArray[np.bool_]:
    """Finite and within ``[low, high]``."""
    with np.errstate(invalid="ignore"):
        within: npt.NDArray[np.bool_] = np.isfinite(values) & (values >= low) & (values <= high)
    return within


def _valid(values: npt.NDArray[Any], low: float, high: float) -> npt.NDArray[np.bool_]:
    """Within ``[low, high]`` and at most :data:`MAGNITUDE` across."""
    with np.errstate(invalid="ignore"):
        valid: npt.NDArray[np.bool_] = _within(values, low, high) & (np.abs(values) <= MAGNITUDE)
    return valid


def _range_findings(current: pd.DataFrame) -> list[str]:
    findings = []
    for name, (low, high) in RANGES.items():
        values = current[name].dropna().to_numpy(dtype=np.float64)
        within = _within(values, low, high)
        with np.errstate(invalid="ignore"):
            huge = within & (np.abs(values) > MAGNITUDE)  # in range, but no measurement
        if bad := int((~within).sum()):
            findings.append(f"{name}: {bad} of {len(values)} values out of range {_range_text(low, high)}")
        if many := int(huge.sum()):
            findings.append(f"{name}: {many} of {len(values)} values beyond {MAGNITUDE:g} across")
    return findings


def _in_range(frame: pd.DataFrame) -> pd.DataFrame:
    """``frame`` with every numerical value out of its range (:data:`RANGES`, :data:`MAGNITUDE`) missing:
    what the tests see."""
    out = frame.copy()
    for name, (low, high) in RANGES.items():
        values = out[name].to_numpy(dtype=np.float64, na_value=np.nan)
        out[name] = np.where(_valid(values, low, high), values, np.nan)
    return out


def _embedding_findings(
    reference: FloatArray, current: FloatArray, n_reference: int, n_current: int, level: float
) -> list[str]:
    """ "Not sampled" only when none in the window is unlikely at ``level`` (1 in 20 sampling leaves a
    100-request window without an embedding 0.6 % of the time: that is chance, not a broken sampler)."""
    rate = min(1.0, len(reference) / n_reference) if n_reference else 0.0
    by_chance = (1.0 - rate) ** n_current
    if len(current) == 0 and rate * n_current >= EXPECTED_EMBEDDINGS and by_chance < level:
        return [f"{EMBEDDING}: not sampled (0 of {n_current} requests; reference {rate:.1%})"]
    if len(reference) and len(current) and reference.shape[1] != current.shape[1]:
        return [f"{EMBEDDING}: dimension {current.shape[1]} (reference {reference.shape[1]})"]
    return []


def _unusable_findings(given: npt.NDArray[Any], finite: FloatArray) -> list[str]:
    """Vectors left out of the test for a value that is not finite (a NaN, or past float32's range once
    stored): with all of them left out the window read "not sampled" (an audit). This finding stands for
    the window's embeddings; the others (not sampled, another dimension) are about the vectors kept."""
    if dropped := len(given) - len(finite):
        return [f"{EMBEDDING}: {dropped} of {len(given)} vectors with values that are not finite"]
    return []


# ------------------------------------------------------------------------------------- categorical test


def _pool_rare(table: FloatArray) -> FloatArray:
    """Pool the categories (columns of a 2 x k table) whose smaller expected count is below MIN_EXPECTED;
    drop the pool if it is still that rare, unless a window would be left without counts."""
    rows = table.sum(axis=1)
    scale = rows.min() / rows.sum()
    rare = table.sum(axis=0) * scale < MIN_EXPECTED
    common = table[:, ~rare]
    pool = table[:, rare].sum(axis=1, keepdims=True)
    if pool.sum() * scale >= MIN_EXPECTED or (common.sum(axis=1) == 0).any():
        return np.hstack([common, pool])
    return common


def _chi2_homogeneity(
    reference: pd.Series, current: pd.Series, feature_type: object, threshold: float
) -> tuple[float, bool]:
    """Chi-square test that both windows draw from one categorical distribution (evidently's signature)."""
    counts = pd.concat([reference.value_counts(), current.value_counts()], axis=1).fillna(0)
    table = _pool_rare(counts.to_numpy(dtype=float).T)
    table = table[:, table.sum(axis=0) > 0]
    if table.shape[1] < 2:
        return 1.0, False
    p_value = float(chi2_contingency(table, correction=False).pvalue)
    return p_value, p_value < threshold


register_stattest(
    StatTest(
        name=CHI2,
        display_name="chi-square homogeneity p_value",
        allowed_feature_types=[ColumnType.Categorical],
    ),
    default_impl=_chi2_homogeneity,
)


# ------------------------------------------------------------------------------------------ evidently


@contextmanager
def _quiet() -> Iterator[None]:
    """Warnings evidently's drift code raises on valid input, silenced around its calls only: scipy's KS
    test notes when its exact p-value does not converge and it uses the asymptotic one."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "ks_2samp: Exact calculation unsuccessful", RuntimeWarning)
        yield


def _method(name: str) -> str:
    return KS if name in NUMERICAL else CHI2


def _kind(name: str) -> Kind:
    return "numerical" if name in NUMERICAL else "categorical"


def _datasets(reference: pd.DataFrame, current: pd.DataFrame, columns: list[str]) -> tuple[Any, Any]:
    definition = DataDefinition(
        numerical_columns=[c for c in columns if c in NUMERICAL],
        categorical_columns=[c for c in columns if c in CATEGORICAL],
    )
    return (
        Dataset.from_pandas(reference[columns], data_definition=definition),
        Dataset.from_pandas(current[columns], data_definition=definition),
    )


def _p_values(snapshot: Any) -> dict[str, float]:
    return {
        metric["config"]["column"]: float(metric["value"])
        for metric in snapshot.dict()["metrics"]
        if metric["config"].get("type") == "evidently:metric_v2:ValueDrift"
    }


def _tabular_p_values(
    reference: pd.DataFrame, current: pd.DataFrame, columns: list[str], level: float
) -> dict[str, float]:
    if not columns:
        return {}
    report = Report([ValueDrift(column=c, method=_method(c), threshold=level) for c in columns])
    with _quiet():
        return _p_values(report.run(*reversed(_datasets(reference, current, columns))))


# ---------------------------------------------------------------------------------------- embedding test


@dataclass(frozen=True)
class _MMDResult:
    statistic: float
    """Unbiased MMD^2 (slightly negative when the windows match)."""
    threshold: float
    """The permutation quantile at 1 - level: drift when the statistic is above it."""
    p_value: float
    permutations: int

    @property
    def drifted(self) -> bool:
        return self.statistic > self.threshold


def _embedding_rows(embeddings: npt.NDArray[Any]) -> FloatArray:
    array = np.asarray(embeddings, dtype=np.float64)
    if array.ndim != 2:
        raise ValueError(f"embeddings must be a 2-d array [rows, dim], got shape {array.shape}")
    return array[np.isfinite(array).all(axis=1)]


NO_SPREAD = 1e-6
"""A pool of embeddings whose every coordinate varies by no more than this share of its largest value has
no spread (float32's precision is ~1e-7): its rows are one vector, and there is nothing to reduce."""


def _reduced(
    reference: FloatArray, current: FloatArray, config: DriftConfig
) -> tuple[FloatArray, FloatArray]:
    """Seeded subsamples of both windows projected on the principal components of their union."""
    rng = np.random.default_rng(config.seed)
    x, y = (
        rows[np.sort(rng.choice(len(rows), size=min(len(rows), MAX_EMBEDDING_ROWS), replace=False))]
        for rows in (reference, current)
    )
    pooled = np.vstack([x, y])
    magnitude = float(np.abs(pooled).max(initial=0.0)) or 1.0
    if float(np.ptp(pooled, axis=0).max(initial=0.0)) <= NO_SPREAD * magnitude:
        # Every row the same (a model that embeds everything alike, a cache): PCA of a pool with no spread
        # left ~1e-29 of rounding noise that differed between the windows, which the kernel's median
        # scale (~1e-61) made structure, and identical windows read as drift, p ~ 1e-4 (mutation testing)
        return np.zeros((len(x), 1)), np.zeros((len(y), 1))
    components = min(config.embedding_components, *pooled.shape)
    pca = PCA(n_components=components, svd_solver="full", random_state=config.seed)
    with np.errstate(divide="ignore", invalid="ignore"):  # all rows equal: zero variance ratios
        projected = pca.fit_transform(pooled)
    return projected[: len(x)], projected[len(x) :]


def _kernel(pooled: FloatArray) -> FloatArray:
    """Gaussian kernel with the median heuristic (the mean if most rows coincide)."""
    squared = pdist(pooled, "sqeuclidean")
    scale = float(np.median(squared)) or float(squared.mean()) or 1.0
    return np.asarray(np.exp(-squareform(squared) / scale), dtype=np.float64)


def _mmd2u(kernel: FloatArray, inside: FloatArray) -> FloatArray:
    """Unbiased MMD^2 for each column of ``inside`` (1 where a row belongs to the first sample)."""
    m = float(inside[:, 0].sum())
    n = len(inside) - m
    diagonal = np.diag(kernel)
    within_x = (inside * (kernel @ inside)).sum(axis=0)
    across = inside.T @ kernel.sum(axis=1) - within_x
    within_y = kernel.sum() - within_x - 2 * across
    xx = within_x - inside.T @ diagonal
    yy = within_y - (1 - inside).T @ diagonal
    return np.asarray(xx / (m * (m - 1)) + yy / (n * (n - 1)) - 2 * across / (m * n), dtype=np.float64)


def _permutations(level: float) -> int:
    """Enough permutations that about five of them lie beyond the 1 - level quantile."""
    return min(max(math.ceil(5 / level), 1000), 50_000)


def _mmd_test(x: FloatArray, y: FloatArray, level: float, seed: int) -> _MMDResult:
    """Permutation test of equal distributions of the rows of ``x`` and ``y`` at ``level``."""
    kernel = _kernel(np.vstack([x, y]))
    labels = np.r_[np.ones(len(x)), np.zeros(len(y))]
    statistic = float(_mmd2u(kernel, labels[:, None])[0])
    count = _permutations(level)
    rng = np.random.default_rng(seed)
    batches = [min(PERMUTATION_BATCH, count - start) for start in range(0, count, PERMUTATION_BATCH)]
    null = np.concatenate(
        [_mmd2u(kernel, rng.permuted(np.tile(labels, (size, 1)), axis=1).T) for size in batches]
    )
    allowed = math.ceil(level * (count + 1) - 1) - 1  # permutations >= statistic that still give p < level
    threshold = float(np.sort(null)[::-1][allowed]) if allowed >= 0 else math.inf
    p_value = (1 + int((null >= statistic).sum())) / (count + 1)
    return _MMDResult(statistic, threshold, p_value, count)


class _PermutationMMD(DriftMethod):  # type: ignore[misc]  # evidently is untyped
    """:func:`_mmd_test` as an evidently embeddings drift method (on already reduced embeddings)."""

    class Config:
        type_alias = "sluicegate:drift_method:PermutationMMD"

    level: float
    seed: int

    def __call__(self, current_emb: pd.DataFrame, reference_emb: pd.DataFrame) -> tuple[float, bool, str]:
        result = _mmd_test(reference_emb.to_numpy(), current_emb.to_numpy(), self.level, self.seed)
        method = f"{MMD} (permutation p={result.p_value:.2g}, threshold {result.threshold:.3g})"
        return result.statistic, result.drifted, method


# ------------------------------------------------------------------------------------------------ plan


@dataclass(frozen=True)
class _Plan:
    """What both windows allow: the prepared samples, the findings, and the tests to run at which level."""

    reference: pd.DataFrame
    current: pd.DataFrame
    reference_nulls: dict[str, float]
    current_nulls: dict[str, float]
    columns: list[str]
    embeddings: tuple[FloatArray, FloatArray] | None
    quality: list[str]
    alpha: float

    @property
    def tests(self) -> int:
        return len(self.columns) + (self.embeddings is not None)

    @property
    def level(self) -> float:
        return self.alpha / max(self.tests, 1)


def _embeddings_testable(reference: FloatArray, current: FloatArray, config: DriftConfig) -> bool:
    return (
        min(len(reference), len(current)) >= config.embedding_min_samples
        and reference.shape[1] == current.shape[1] > 0
    )


def _plan(
    reference: pd.DataFrame,
    current: pd.DataFrame,
    reference_embeddings: npt.NDArray[np.float32],
    current_embeddings: npt.NDArray[np.float32],
    config: DriftConfig,
) -> _Plan:
    ref, cur = _prepare(reference), _prepare(current)
    ref_nulls, cur_nulls = _null_shares(ref), _null_shares(cur)
    ref_emb, cur_emb = _embedding_rows(reference_embeddings), _embedding_rows(current_embeddings)
    quality = [
        *_missing_findings(ref_nulls, cur_nulls, config.null_tolerance),
        *_range_findings(cur),
        *(
            _unusable_findings(current_embeddings, cur_emb)
            or _embedding_findings(
                ref_emb, cur_emb, len(ref), len(cur), config.alpha / (len(NUMERICAL) + len(CATEGORICAL) + 1)
            )
        ),
    ]
    ref_sample, cur_sample = (_in_range(_capped(frame, MAX_ROWS, config.seed)) for frame in (ref, cur))
    return _Plan(
        reference=ref_sample,
        current=cur_sample,
        reference_nulls=ref_nulls,
        current_nulls=cur_nulls,
        columns=_testable(ref_sample, cur_sample, config.min_samples),
        embeddings=_reduced(ref_emb, cur_emb, config)
        if _embeddings_testable(ref_emb, cur_emb, config)
        else None,
        quality=quality,
        alpha=config.alpha,
    )


def _insufficient(n_reference: int, n_current: int, config: DriftConfig) -> Evaluation | None:
    if min(n_reference, n_current) >= config.min_samples:
        return None
    method = (
        f"insufficient data: {n_reference} reference / {n_current} current rows (min {config.min_samples})"
    )
    return Evaluation("insufficient_data", [], 0.0, False, [], method)


# ----------------------------------------------------------------------------------------- evaluation


def _tabular_features(plan: _Plan, p_values: dict[str, float]) -> list[FeatureDrift]:
    return [
        FeatureDrift(
            name=name,
            kind=_kind(name),
            method=_method(name),
            statistic=p_values[name],
            threshold=plan.level,
            p_value=p_values[name],
            drifted=p_values[name] < plan.level,
            null_share=plan.current_nulls[name],
            reference_null_share=plan.reference_nulls[name],
        )
        for name in plan.columns
    ]


def _embedding_feature(result: _MMDResult) -> FeatureDrift:
    return FeatureDrift(
        name=EMBEDDING,
        kind="embedding",
        method=MMD,
        statistic=result.statistic,
        threshold=result.threshold,
        p_value=result.p_value,
        drifted=result.drifted,
    )


def _method_text(plan: _Plan, config: DriftConfig, permutations: int) -> str:
    parts = [f"evidently {evidently.__version__} ValueDrift ({KS}/{CHI2})"]
    if plan.embeddings is not None:
        components = plan.embeddings[0].shape[1]
        parts.append(f"{MMD} permutation test (PCA {components}, {permutations} permutations)")
    return f"{' + '.join(parts)}; Bonferroni alpha={config.alpha:g} over {plan.tests} tests"


def _verdict(quality: list[str], drifted: bool) -> DriftVerdict:
    if quality:
        return "data_quality"
    return "drift" if drifted else "no_drift"


def evaluate(
    reference: pd.DataFrame,
    current: pd.DataFrame,
    reference_embeddings: npt.NDArray[np.float32],
    current_embeddings: npt.NDArray[np.float32],
    config: DriftConfig = DriftConfig(),
) -> Evaluation:
    """The verdict on ``current`` against ``reference`` (one row per request, embeddings ``[n, dim]``)."""
    insufficient = _insufficient(len(reference), len(current), config)
    if insufficient is not None:
        return insufficient
    plan = _plan(reference, current, reference_embeddings, current_embeddings, config)
    features = _tabular_features(
        plan, _tabular_p_values(plan.reference, plan.current, plan.columns, plan.level)
    )
    permutations = 0
    if plan.embeddings is not None:
        result = _mmd_test(*plan.embeddings, plan.level, config.seed)
        features.append(_embedding_feature(result))
        permutations = result.permutations
    drifted = sum(feature.drifted for feature in features)
    return Evaluation(
        verdict=_verdict(plan.quality, drifted > 0),
        features=features,
        share_drifted=drifted / len(features) if features else 0.0,
        drifted=drifted > 0,
        quality=plan.quality,
        method=_method_text(plan, config, permutations),
    )


# -------------------------------------------------------------------------------------------------- html


def _tabular_snapshot(plan: _Plan) -> Any:
    preset = DataDriftPreset(
        columns=plan.columns,
        drift_share=0.5 / len(plan.columns),  # one drifted column is dataset drift, as in evaluate()
        per_column_method={name: _method(name) for name in plan.columns},
        threshold=plan.level,
    )
    return Report([preset]).run(*reversed(_datasets(plan.reference, plan.current, plan.columns)))


def _embedding_snapshot(reference: FloatArray, current: FloatArray, level: float, seed: int) -> Any:
    names = [f"pc{i}" for i in range(reference.shape[1])]
    definition = DataDefinition(embeddings={EMBEDDING: names})
    metric = EmbeddingsDrift(embeddings_name=EMBEDDING, drift_method=_PermutationMMD(level=level, seed=seed))
    return Report([metric]).run(
        Dataset.from_pandas(pd.DataFrame(current, columns=names), data_definition=definition),
        Dataset.from_pandas(pd.DataFrame(reference, columns=names), data_definition=definition),
    )


def _snapshots(plan: _Plan, seed: int) -> list[Any]:
    snapshots = [_tabular_snapshot(plan)] if plan.columns else []
    if plan.embeddings is not None and _spread(*plan.embeddings):
        snapshots.append(_embedding_snapshot(*plan.embeddings, plan.level, seed))
    return snapshots


def _spread(reference: FloatArray, current: FloatArray) -> bool:
    """Whether the projected windows are points a t-SNE can place: evidently's plot of identical vectors
    (all zero, say) killed the process (SIGSEGV in scikit-learn), and so did vectors near float32's
    largest. The page then has no embeddings plot; the report's test is unchanged."""
    both = np.concatenate([reference, current])
    if both.size == 0 or not np.isfinite(both).all() or float(np.abs(both).max()) > MAGNITUDE:
        return False
    return float(np.ptp(both, axis=0).max()) > 1e-9


def _merged_html(snapshots: list[Any]) -> str:
    """One HTML page with the widgets of several snapshots (evidently's own page template)."""
    models = [snapshot.to_snapshot_model() for snapshot in snapshots]
    merged = SnapshotModel(
        report=models[0].report,
        name="sluicegate drift",
        timestamp=models[0].timestamp,
        metadata={},
        tags=[],
        metric_results={key: value for model in models for key, value in model.metric_results.items()},
        top_level_metrics=[metric for model in models for metric in model.top_level_metrics],
        widgets=[widget for model in models for widget in model.widgets],
        tests_widgets=[widget for model in models for widget in model.tests_widgets],
    )
    return str(Snapshot.load_model(merged).get_html_str(as_iframe=False))


def html_report(
    reference: pd.DataFrame,
    current: pd.DataFrame,
    reference_embeddings: npt.NDArray[np.float32],
    current_embeddings: npt.NDArray[np.float32],
    config: DriftConfig = DriftConfig(),
) -> str:
    """Evidently's HTML page for the same tests and thresholds as :func:`evaluate`, for humans: the
    ``DataDriftPreset`` table and, when the embeddings are tested, ``EmbeddingsDrift``'s plot (a t-SNE of
    up to 2 x :data:`MAX_EMBEDDING_ROWS` points: seconds of CPU)."""
    sufficient = _insufficient(len(reference), len(current), config) is None
    plan = _plan(reference, current, reference_embeddings, current_embeddings, config) if sufficient else None
    with _quiet():
        snapshots = _snapshots(plan, config.seed) if plan is not None else []
        return _merged_html(snapshots or [Report([]).run(pd.DataFrame({"rows": [len(current)]}))])
