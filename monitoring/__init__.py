"""Observability shared by every service: tracing, metrics, the ops server, SLO rules, logs."""


class MonitoringError(Exception):
    """Root of the errors this package raises."""
