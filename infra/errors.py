"""The one exception root of ``infra``: everything it raises on purpose derives from InfraError."""


class InfraError(RuntimeError):
    """Starting, fetching or provisioning a platform piece failed; the message says what to do."""
