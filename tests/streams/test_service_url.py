"""The streams worker's own URL (the dashboard's, which ``sluice up`` prints)."""

from __future__ import annotations

import types

import pytest

from streams.service import StreamsService
from streams.settings import StreamsSettings


@pytest.mark.parametrize(("host", "shown"), [("::1", "[::1]"), ("127.0.0.1", "127.0.0.1")])
def test_the_streams_url_brackets_an_ipv6_host(host: str, shown: str) -> None:
    """A review found ``http://::1:8090`` for a streams worker on the IPv6 loopback: no client reaches it."""
    # Only what ``url`` reads: a built service holds a Kafka producer, and a started one a warehouse.
    service = StreamsService.__new__(StreamsService)
    service.settings = StreamsSettings(streams_host=host)
    service._runner = types.SimpleNamespace(addresses=[(host, 8090, 0, 0)])  # type: ignore[assignment]
    assert service.url == f"http://{shown}:8090"
