"""The streams process: owns the embedded warehouse, runs the sink and its timers, serves the dashboard and ops.

``start()``: open the warehouse (this process becomes its owner: other processes read it through the
query server, e.g. ``sluice sql``), apply migrations and the raw-event retention, start the sink and its timers,
then the HTTP server with ``/dashboard``, ``/metrics``, ``/healthz`` and ``/readyz``. ``stop()`` in reverse.

Everything on that server but the probes wants the ops token when ``SLUICE_OPS_TOKEN`` is set, and a ``Host``
it answers for (:mod:`monitoring.access`); without a token it refuses a non-loopback ``SLUICE_STREAMS_HOST``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web
from clickhouse_connect.driver.client import Client
from confluent_kafka import KafkaException

from bus.errors import kafka_reason
from bus.producer import EventProducer
from infra.errors import InfraError
from infra.topics import quiet_admin
from infra.warehouse import WarehouseQueryServer, migrate, open_warehouse
from monitoring import metrics
from monitoring.access import HostAllowList, OpsAccess, ops_middleware
from monitoring.ops import QuietRunner, Readiness, bound_port, http_url
from monitoring.slo import load_slo_config
from schemas.lifecycle import AsyncComponent
from schemas.settings import PlatformSettings
from schemas.topics import TopicNames
from streams.app import StreamsApp
from streams.control import Controller, load_budgets
from streams.pricing import load_prices
from streams.settings import StreamsSettings
from streams.sink import query_rows

if TYPE_CHECKING:
    from streams.dashboard import Dashboard

log = logging.getLogger(__name__)


def request_topics(platform: PlatformSettings) -> list[str]:
    """The existing request topics (every model ever served); the results topic must exist.

    Raises :class:`~infra.errors.InfraError` when Kafka does not answer."""
    names = TopicNames(platform.topic_prefix)
    try:
        topics = quiet_admin(platform.kafka).list_topics(timeout=10).topics
    except KafkaException as exc:
        reason = kafka_reason(exc)
        raise InfraError(
            f"cannot list the topics on Kafka at {platform.bootstrap}: {reason} "
            "(is it running? `sluice kafka status` says)"
        ) from exc
    results = topics.get(names.results)
    if results is None or results.error is not None:
        # one line, not a traceback, for `sluice streams` started before `sluice topics apply` (a review)
        raise InfraError(f"topic {names.results} does not exist: run `sluice topics apply`")
    return sorted(t for t in topics if t.startswith(names.requests_prefix))


def apply_retention(client: Client, days: int) -> None:
    """``events_raw`` keeps an event ``days`` days (a table TTL; derived tables keep their rows)."""
    client.command(f"ALTER TABLE events_raw MODIFY TTL toDateTime(time) + INTERVAL {int(days)} DAY")


def http_app(
    dashboard: Dashboard, readiness: Callable[[], Readiness], access: OpsAccess, hosts: HostAllowList
) -> web.Application:
    """The streams worker's HTTP routes: the dashboard and ``/metrics`` behind ``access`` and ``hosts``,
    and the open probes ``/healthz`` and ``/readyz``."""

    async def metrics_route(request: web.Request) -> web.Response:
        return web.Response(
            body=metrics.exposition(streams=True), headers={"Content-Type": metrics.CONTENT_TYPE}
        )

    async def healthz(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "service": "streams"})

    async def readyz(request: web.Request) -> web.Response:
        ready = readiness()
        return web.Response(
            body=ready.to_json(), status=200 if ready.ready else 503, content_type="application/json"
        )

    app = web.Application(middlewares=[ops_middleware(access, hosts)])
    app.router.add_get("/metrics", metrics_route)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    dashboard.add_to(app)
    return app


class StreamsService(AsyncComponent):
    """Fails (:attr:`failure`, and ``/readyz`` says so) when the streams app (its sink or a timer) or the producer dies."""

    def __init__(
        self, platform: PlatformSettings, settings: StreamsSettings, *, app_id: str | None = None
    ) -> None:
        super().__init__()
        self.platform = platform
        self.settings = settings
        self._access = OpsAccess(
            platform.ops_token,
            host=settings.streams_host,
            variable="SLUICE_STREAMS_HOST",
            service="the streams worker",
        )
        self._hosts = HostAllowList(settings.streams_allowed_hosts, settings.streams_host)
        self._app_id = app_id
        self._client: Client | None = None
        self._writer: Client | None = None
        self._query_server: WarehouseQueryServer | None = None
        self._producer = EventProducer(platform.kafka, "streams")
        self._producer.watch(self.fail)
        self.streams: StreamsApp | None = None
        self._runner: web.AppRunner | None = None
        self._reads = asyncio.Lock()

    async def _start(self) -> None:
        platform, settings = self.platform, self.settings
        self._client = await asyncio.to_thread(open_warehouse, platform)
        await asyncio.to_thread(migrate, self._client)
        await asyncio.to_thread(apply_retention, self._client, settings.streams_raw_retention_days)
        self._writer = await asyncio.to_thread(open_warehouse, platform)
        self._query_server = WarehouseQueryServer(self._client, platform)
        await self._query_server.start()
        self._producer.start()
        topics = await asyncio.to_thread(request_topics, platform)
        slo = load_slo_config(settings.slo_path)  # one config for the burn events and the dashboard
        self.streams = StreamsApp(
            platform,
            settings,
            self._writer,
            load_prices(settings.streams_prices_file),
            self._producer,
            controller=Controller(
                load_budgets(settings.streams_budgets_file),
                slo,
            ),
            request_topics=topics,
            app_id=self._app_id,
        )
        self.streams.watch(self.fail)
        await self.streams.start()
        from streams.dashboard import Dashboard

        app = http_app(Dashboard(self.query, slo=slo), self.readiness, self._access, self._hosts)
        self._runner = QuietRunner(app, access_log=None, shutdown_timeout=2.0)
        await self._runner.setup()
        await web.TCPSite(self._runner, settings.streams_host, settings.streams_port).start()
        log.info("streams: dashboard and metrics on %s", self.url)

    async def query(self, sql: str) -> list[dict[str, Any]]:
        """Run a read on the owner's client (one at a time), rows as dicts."""
        client = self._client
        if client is None:
            raise RuntimeError("the streams service is not started")
        async with self._reads:
            return await asyncio.to_thread(query_rows, client, sql)

    @property
    def port(self) -> int:
        return bound_port(self._runner, "the streams service")

    @property
    def url(self) -> str:
        return http_url(self.settings.streams_host, self.port)

    def readiness(self) -> Readiness:
        streams = self.streams
        return Readiness.of(
            warehouse=self._query_server is not None,
            kafka=streams is not None and streams.assigned,
            running=self.failure is None,
            # Shown, not gating: the worker keeps every other chain (and its own tables) going.
            audit_conflicts=len(streams.audit_conflicts) if streams is not None else 0,
        )

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self.streams is not None:
            await self.streams.stop()
            self.streams = None
        await asyncio.to_thread(self._producer.stop)
        if self._query_server is not None:
            await self._query_server.stop()
            self._query_server = None
        for client in (self._writer, self._client):
            if client is not None:
                client.close()
        self._writer = self._client = None
