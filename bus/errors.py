"""The one exception root of ``bus``."""

from __future__ import annotations


class BusError(RuntimeError):
    """Talking to Kafka failed. ``retriable`` says whether the same call may succeed later."""

    def __init__(self, message: str, *, retriable: bool = False) -> None:
        super().__init__(message)
        self.retriable = retriable
