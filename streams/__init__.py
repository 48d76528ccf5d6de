"""The streams worker: the event log into the warehouse, the audit chain, budgets, burn rates, drift and
the rollout controller."""

from __future__ import annotations


class StreamsError(Exception):
    """Root of every error raised by ``streams`` (bad price or budget files, a failed replay, ...)."""
