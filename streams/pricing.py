"""Prices: the price file the streams worker reads, and the price history on the log.

The table itself (exact integer prices, the batch discount) is a contract, :mod:`schemas.prices`, since it
travels on the control topic: the streams worker publishes its file's table there (``PricesChanged``, key
``prices:<version>``) when the log does not hold that version yet, and every request is priced by the
table in force when it was accepted (:class:`PriceHistory`), live and in ``sluice replay`` alike. Before
(2026-12-01), a rebuild priced every request with whatever file it ran with.
"""

from __future__ import annotations

import bisect
import logging
import tomllib
from collections.abc import Iterable, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

import msgspec

from schemas.events import Event, PricesChanged
from schemas.prices import MAX_MICROS, ModelPrice, PriceTable
from streams import StreamsError

__all__ = [
    "MAX_MICROS",
    "ModelPrice",
    "PriceHistory",
    "PriceTable",
    "Prices",
    "PricingError",
    "load_prices",
]

log = logging.getLogger(__name__)


class PricingError(StreamsError, ValueError):
    """The price table cannot be read, or contradicts the one the log holds under its version."""


class Prices(Protocol):
    """What prices a request: one table, or a history of them."""

    def at(self, when: datetime) -> PriceTable: ...


def load_prices(path: str | Path | None) -> PriceTable:
    if path is None:
        return PriceTable()
    try:
        raw = tomllib.loads(Path(path).read_text(encoding="utf-8"))  # TOML is UTF-8, whatever the locale
        if unknown := _unknown_keys(raw):  # a typo would price at the defaults
            raise PricingError(f"price table {path}: unknown field(s) {', '.join(unknown)}")
        return msgspec.convert(raw, PriceTable)
    except FileNotFoundError:
        raise PricingError(f"price table {path} does not exist") from None
    except (tomllib.TOMLDecodeError, msgspec.ValidationError, UnicodeDecodeError) as exc:
        raise PricingError(f"price table {path}: {exc}") from exc


def _unknown_keys(raw: Mapping[str, Any]) -> list[str]:
    """Keys of a price file that name no field (as ``$.path``); what is not a table is left to msgspec."""
    table = {f.encode_name for f in msgspec.structs.fields(PriceTable)}
    price = {f.encode_name for f in msgspec.structs.fields(ModelPrice)}
    unknown = [f"$.{key}" for key in raw if key not in table]
    parts = [("default", raw.get("default"))]
    models = raw.get("models")
    if isinstance(models, Mapping):
        parts += [(f"models.{name}", value) for name, value in models.items()]
    for where, part in parts:
        if isinstance(part, Mapping):
            unknown += [f"$.{where}.{key}" for key in part if key not in price]
    return unknown


class PriceHistory:
    """The tables published on the log, each in force from its ``effective`` time until the next one's.
    A request accepted before the first is priced by the first (the log's history starts there); with none
    published, by ``fallback``. A version is published once: a later event reusing it with another table
    is ignored (logged), so every reader agrees on what a version means."""

    def __init__(self, fallback: PriceTable, events: Iterable[Event] = ()) -> None:
        self._fallback = fallback
        self._times: list[datetime] = []
        self._tables: list[PriceTable] = []
        self._versions: dict[str, PriceTable] = {}
        self.observe(events)

    def observe(self, events: Iterable[Event]) -> None:
        """Take the ``PricesChanged`` among ``events`` (others are skipped)."""
        for event in events:
            if isinstance(event, PricesChanged):
                self.add(event)

    def add(self, event: PricesChanged) -> None:
        table = event.prices
        known = self._versions.get(table.version)
        if known is not None:
            if known != table:
                log.warning(
                    "prices: %s was published again with other prices (event %s); the first holds",
                    table.version,
                    event.id,
                )
            return
        self._versions[table.version] = table
        at = bisect.bisect_right(self._times, event.effective)
        self._times.insert(at, event.effective)
        self._tables.insert(at, table)

    def latest(self) -> tuple[datetime, PriceTable] | None:
        """The table in force last, and from when (None: none published)."""
        return (self._times[-1], self._tables[-1]) if self._tables else None

    def tables(self) -> list[tuple[datetime, PriceTable]]:
        """Each published table with the moment it came into force, oldest first."""
        return list(zip(self._times, self._tables, strict=True))

    def published(self, version: str) -> PriceTable | None:
        """The table the log holds under ``version``, if any."""
        return self._versions.get(version)

    def at(self, when: datetime) -> PriceTable:
        if not self._tables:
            return self._fallback
        return self._tables[max(0, bisect.bisect_right(self._times, when) - 1)]
