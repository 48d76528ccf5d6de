"""How the streams worker wires its drift monitor (the watermark, the control partition's ownership, the
drift gauges), on real embedded ClickHouse with a fake producer and a fake consumer, and no broker."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any, cast

import pytest

from bus.consumer import ConsumerThread
from infra.warehouse.client import Client
from schemas.codec import encode
from schemas.settings import PlatformSettings
from streams.app import StreamsApp
from streams.drift import ALL
from streams.pricing import PriceTable
from streams.sink import Consumed
from tests.streams.test_app import Producer, Sink, control_log
from tests.streams.test_drift import T0, WINDOW_S, settings, warehouse, window_events


def drift_app(tmp_path: Path, client: Client, producer: Producer, **changes: Any) -> StreamsApp:
    return StreamsApp(
        PlatformSettings(kafka_bootstrap="127.0.0.1:1", topic_prefix="p", data_dir=str(tmp_path / "app")),
        settings(**changes),
        client,
        PriceTable(),
        cast(Any, producer),
        request_topics=["p.requests.demo-gpt"],
    )


async def test_a_window_is_not_judged_while_a_results_partition_still_holds_its_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by a review: after a restart with a backlog, ``results`` (keyed by tenant) is read partition
    by partition at different speeds. The watermark was the latest finish written over all partitions, so
    once zeta's partition reached the third window, the second was judged on zeta's rows alone (a
    tenant-mix "drift" for traffic that did not change), and acme's rows for it were never judged. The
    watermark is now the slowest behind partition's."""
    control_log(monkeypatch)
    w1, w2, w3, w4 = (T0 + timedelta(seconds=WINDOW_S * i) for i in range(4))
    acme = [e for w, s in ((w1, 41), (w2, 42)) for e in window_events(w, 120, seed=s, tenant="acme")]
    zeta = [
        e for w, s in ((w1, 51), (w2, 52), (w3, 53)) for e in window_events(w, 120, seed=s, tenant="zeta")
    ]
    acme_w1 = [e for e in acme if e.timings.finished is not None and e.timings.finished < w2]
    acme_w2 = acme[len(acme_w1) :]
    with warehouse(tmp_path) as client:
        app = drift_app(tmp_path, client, Producer(), drift_max_tenants=0, streams_batch_size=100)
        app._heads = {}
        app.SINK_IDLE_S = 3600  # busy with the backlog, however slow this machine is
        sink = Sink()
        app._sink = cast(ConsumerThread, sink)
        sink.owned = {("p.results", 0), ("p.results", 1), ("p.results", 2), ("p.control", 0)}
        sink.lags = {("p.results", 0): len(acme_w2), ("p.results", 1): 0, ("p.results", 2): 0}
        records = [Consumed("p.results", 0, i, encode(e)) for i, e in enumerate(acme_w1)]
        records += [Consumed("p.results", 1, i, encode(e)) for i, e in enumerate(zeta)]
        await app.write(records)  # a full batch: the sink is behind
        assert await app.take_control()
        done = await app.drift.run_once(w4 + timedelta(seconds=30))
        assert [r.window_start for r in done] == [], "judged before partition 0 delivered its rows"

        # partition 0 catches up: both windows are judged on both tenants' rows
        await app.write(
            [Consumed("p.results", 0, len(acme_w1) + i, encode(e)) for i, e in enumerate(acme_w2)]
        )
        sink.lags[("p.results", 0)] = 0
        app._last_batch_full = True  # still behind on another topic (a request topic's backlog)
        done = await app.drift.run_once(w4 + timedelta(seconds=30))
        judged = {r.window_start: r for r in done if r.tenant == ALL}
        assert (judged[w1].requests, judged[w2].requests, judged[w3].requests) == (240, 240, 120)
        assert judged[w2].effective_verdict == "no_drift"


async def test_a_results_partition_whose_lag_is_not_known_yet_holds_the_windows(tmp_path: Path) -> None:
    """librdkafka's statistics (the lag) come every few seconds: until they do, a partition the sink holds
    and has written nothing from may hold a window's rows, so no window is judged."""
    w1, w2 = T0, T0 + timedelta(seconds=WINDOW_S)
    with warehouse(tmp_path) as client:
        app = drift_app(tmp_path, client, Producer(), streams_batch_size=100)
        app._heads = {}
        app.SINK_IDLE_S = 3600
        sink = Sink()
        app._sink = cast(ConsumerThread, sink)
        sink.owned = {("p.results", 0), ("p.results", 1)}
        sink.lags = {("p.results", 1): 0}
        events = window_events(w1, 120, seed=7) + window_events(w2, 120, seed=8)
        await app.write([Consumed("p.results", 1, i, encode(e)) for i, e in enumerate(events)])
        assert app.stored_until() == 0
        sink.lags[("p.results", 0)] = 0  # empty (a partition that never held a record lags 0)
        assert app.stored_until() is None
