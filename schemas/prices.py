"""The price table: what a request costs, exactly, in integer nano-USD; a contract, since it travels on the
control topic (:class:`schemas.events.PricesChanged`) so a rebuild prices each request as it was priced.

Prices are integers in micro-USD per 1,000 tokens (and per worker-second), so a request's cost
``prompt_tokens x prompt_price + completion_tokens x completion_price + worker_ms x worker_price`` is an
integer number of nano-USD: no rounding anywhere, and any sum over the ledger is exact.

Lines of an async batch (the Batch API) are billed at a discount, ``batch_discount_percent`` of the table
(50 by default, as OpenAI's): a line's cost is ``full x (100 - percent) // 100``, rounded down to the
nano-USD (in the client's favour, at most 1 nano-USD per line), so it stays an integer and sums stay exact.
The file the streams worker reads is TOML (``streams.pricing.load_prices``)::

    version = "2026-11"
    batch_discount_percent = 50
    [default]
    prompt = 100          # micro-USD per 1k prompt tokens ($0.10 per million)
    completion = 400
    [models.demo-gpt]
    prompt = 150
    completion = 600
    worker_second = 0     # micro-USD per worker-second
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

import msgspec

MAX_MICROS = 10**9
"""The highest price (1,000 USD per 1,000 tokens, or per worker second): with token counts bounded by the
events' schema, a request's cost stays within the warehouse's UInt64 (an audit: a price of 1e23 loaded,
and a cost past UInt64 was stored wrapped)."""
Micros = Annotated[int, msgspec.Meta(ge=0, le=MAX_MICROS)]
Percent = Annotated[int, msgspec.Meta(ge=0, le=100)]
Version = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
"""A table's name: the ``price_version`` of every row it priced, and its key on the control topic."""


class ModelPrice(msgspec.Struct, frozen=True, kw_only=True):
    prompt: Micros = 100
    """micro-USD per 1,000 prompt tokens"""
    completion: Micros = 400
    """micro-USD per 1,000 completion tokens"""
    worker_second: Micros = 0
    """micro-USD per second a worker held the request in a batch"""


class PriceTable(msgspec.Struct, frozen=True, kw_only=True):
    """Unknown fields are ignored when an event carrying a table is decoded (a newer writer's), and refused
    in a price file (a typo there would price at the defaults: ``streams.pricing.load_prices``)."""

    version: Version = "demo-2026-11"
    batch_discount_percent: Percent = 50
    """Taken off the price of a batch line (0: batch lines cost what requests do)."""
    default: ModelPrice = msgspec.field(default_factory=ModelPrice)
    models: dict[str, ModelPrice] = msgspec.field(
        default_factory=lambda: {"all-minilm-l6-v2": ModelPrice(prompt=20, completion=0)}
    )

    def price(self, model: str) -> ModelPrice:
        return self.models.get(model, self.default)

    def at(self, when: datetime) -> PriceTable:
        """The table in force at ``when``: this one (``streams.pricing.PriceHistory`` keeps several)."""
        return self

    def cost_nanos(
        self,
        model: str,
        prompt_tokens: int,
        completion_tokens: int,
        worker_ms: int = 0,
        *,
        batch: bool = False,
    ) -> int:
        """Exact cost in nano-USD (micro-USD per 1k tokens x tokens = nano-USD); ``batch``: the cost of a batch
        line, with :attr:`batch_discount_percent` taken off and rounded down to the nano-USD."""
        price = self.price(model)
        full = (
            prompt_tokens * price.prompt
            + completion_tokens * price.completion
            + worker_ms * price.worker_second
        )
        return full * (100 - self.batch_discount_percent) // 100 if batch else full
