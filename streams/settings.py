"""The streams process's settings: ``SLUICE_STREAMS_*``, read once with :func:`schemas.settings.load_settings`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import msgspec

from schemas.settings import register

DRIFT_EMBEDDING_MIN_SAMPLES = 20
"""Fewer embeddings than this in a window (or its reference): the embedding is not tested (the drift
monitor's ``DriftConfig.embedding_min_samples``)."""


@register
class StreamsSettings(msgspec.Struct, frozen=True, kw_only=True):
    """Field ``streams_x`` is variable ``SLUICE_STREAMS_X``."""

    streams_host: str = "127.0.0.1"
    """Not a loopback address: needs ``SLUICE_OPS_TOKEN`` (the dashboard and ``/metrics`` want it), or the
    streams worker refuses to start."""
    streams_port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 8090
    """The dashboard (``/dashboard``), ``/metrics``, ``/healthz`` and ``/readyz``; 0 picks a free port."""
    streams_allowed_hosts: tuple[str, ...] = ()
    """``Host`` names the dashboard server answers (as ``SLUICE_EDGE_ALLOWED_HOSTS``); others get 421.
    Unset: ``127.0.0.1,localhost,[::1]`` and ``streams_host`` (any name when it is ``0.0.0.0`` or ``::``)."""
    streams_prices_file: str | None = None
    """TOML price table (see ``streams/pricing.py``). Unset: the built-in demo prices."""
    streams_batch_size: Annotated[int, msgspec.Meta(ge=1)] = 5000
    """Events written to the warehouse per insert at most…"""
    streams_batch_ms: Annotated[float, msgspec.Meta(gt=0.0)] = 200.0
    """…or after this long, whichever comes first (bounds freshness)."""
    streams_store_content: bool = False
    """Keep prompts, completions and embeddings in ``events_raw`` (default: redacted before storing)."""
    streams_raw_retention_days: Annotated[int, msgspec.Meta(ge=1)] = 30
    """Days ``events_raw`` keeps an event (a table TTL); facts, the ledger and the audit log are kept."""
    streams_budgets_file: str | None = None
    """TOML of daily spend limits per tenant (``[daily_usd]`` then ``acme = 25.0``); unset: no limits."""
    streams_slo_file: str | None = None
    """SLO configuration (``docs/slo.md``) the burn-rate events and the dashboard use, and the default of
    ``sluice slo rules|show --config``; unset: defaults."""
    streams_audit_anchor_timeout_s: Annotated[float, msgspec.Meta(gt=0.0)] = 600.0
    """At start the worker reads the ``audit`` topic to its end (each chain's head, and what the warehouse
    lacks); it fails if that takes longer than this."""
    streams_control_interval_s: Annotated[float, msgspec.Meta(gt=0.0)] = 5.0
    """How often budgets and burn rates are evaluated (and changes published on ``control``)."""
    drift_window_s: Annotated[float, msgspec.Meta(ge=1.0)] = 300.0
    """Drift windows: tumbling, this long, aligned to the epoch, cut on each request's finish time."""
    drift_lateness_s: Annotated[float, msgspec.Meta(ge=0.0)] = 30.0
    """A window is evaluated this long after it closes (terminal events still in flight land first)."""
    rollout_eval_interval_s: Annotated[float, msgspec.Meta(gt=0.0)] = 1.0
    """At most how often the rollout controller evaluates a canary's gates (each sink batch with its
    outcomes makes it due)."""
    drift_interval_s: Annotated[float, msgspec.Meta(gt=0.0)] = 10.0
    """How often the drift monitor looks for closed windows."""
    drift_min_samples: Annotated[int, msgspec.Meta(ge=2)] = 100
    """Fewer requests than this in a window (or its reference): ``insufficient_data``, never an alarm."""
    drift_reservoir: Annotated[int, msgspec.Meta(ge=2, le=1000)] = 1000
    """Rows sampled per window for the tabular tests (at most 1000, so KS and chi-square apply)."""
    drift_embedding_reservoir: Annotated[int, msgspec.Meta(ge=2, le=2000)] = 200
    """Prompt embeddings sampled per window for the MMD test (its cost grows with the square of this); at
    least :data:`DRIFT_EMBEDDING_MIN_SAMPLES`."""
    drift_alpha: Annotated[float, msgspec.Meta(ge=0.001, le=0.2)] = 0.01
    """False-alarm rate per window and key; each of the m features is tested at alpha / m (Bonferroni).
    At least 0.001: below that the embedding test's permutation budget cannot reach the level."""
    drift_null_tolerance: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 0.2
    """A feature missing from this much more of the window than of the reference is a data-quality finding."""
    drift_max_tenants: Annotated[int, msgspec.Meta(ge=0)] = 10
    """Tenants evaluated on their own per window (the busiest with enough samples); 0: all tenants only."""
    drift_lookback_windows: Annotated[int, msgspec.Meta(ge=1)] = 288
    """On a first start, how many past windows the monitor may still evaluate."""

    def __post_init__(self) -> None:
        if self.drift_embedding_reservoir < DRIFT_EMBEDDING_MIN_SAMPLES:  # a review: silently off
            raise ValueError(
                f"SLUICE_DRIFT_EMBEDDING_RESERVOIR={self.drift_embedding_reservoir} is below "
                f"{DRIFT_EMBEDDING_MIN_SAMPLES}, the embeddings the embedding test needs in a window: it would "
                "never run (set at least that; SLUICE_DRIFT_SAMPLE=0 turns the embeddings off)"
            )
        if self.drift_min_samples > self.drift_reservoir:  # the sample is what is counted (a review)
            raise ValueError(
                f"SLUICE_DRIFT_MIN_SAMPLES={self.drift_min_samples} is above SLUICE_DRIFT_RESERVOIR="
                f"{self.drift_reservoir}, the rows a window's sample holds: no window could ever be judged"
            )

    @property
    def slo_path(self) -> Path | None:
        """``streams_slo_file`` as a path; None when unset (or empty): the built-in SLO defaults."""
        return Path(self.streams_slo_file) if self.streams_slo_file else None
