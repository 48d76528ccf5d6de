"""Observability settings every service reads: ``SLUICE_OTLP_*``, ``SLUICE_TRACE_*``, ``SLUICE_LOG_*``,
``SLUICE_METRICS_*`` (see :func:`schemas.settings.load_settings`)."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from schemas.settings import register


@register
class ObservabilitySettings(msgspec.Struct, frozen=True, kw_only=True):
    otlp_endpoint: str | None = None
    """OTLP/HTTP traces endpoint, e.g. ``http://127.0.0.1:4318/v1/traces``. Unset: no spans are exported."""
    trace_sample_ratio: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 1.0
    """Share of new traces sampled (parent-based: a request keeps its caller's decision)."""
    log_format: Literal["json", "text"] = "json"
    """``json``: one JSON object per line (request id, tenant, trace id as fields); ``text`` for humans."""
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_content_tenants: tuple[str, ...] = ()
    """Tenants whose prompts and completions may appear in logs (debugging). Default: nobody's."""
    metrics_max_tenants: Annotated[int, msgspec.Meta(ge=1)] = 50
    """Distinct tenants that get their own ``tenant`` label value; the rest are counted as ``other``."""
