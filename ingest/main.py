"""Run the edge: the model catalogue, the Kafka gateway and the HTTP/WebSocket server, until stopped."""

from __future__ import annotations

import asyncio
import itertools
import zlib
from pathlib import Path

from ingest.app import Edge
from ingest.auth import TenantDirectory, require_tenants_file
from ingest.batch_log import KafkaBatchLog
from ingest.batches import BatchRunner
from ingest.context import EdgeContext
from ingest.errors import CatalogueError, IngestError
from ingest.files import FileStore
from ingest.kafka_gateway import KafkaGateway
from ingest.models import ModelCatalogue, ServedModel
from ingest.settings import EdgeSettings
from monitoring.access import check_exposure
from monitoring.runtime import tune_gc
from schemas.manifest import current_model_dir, models_root
from schemas.settings import PlatformSettings, SettingsError
from schemas.topics import TopicNames


def reply_partition(edge_id: str, partitions: int) -> int:
    """The replies partition this edge owns: a stable function of its id, so a restart finds its replies."""
    return zlib.crc32(edge_id.encode()) % partitions


def more_edge_ids(first_id: str, edges: int, partitions: int) -> list[str]:
    """The ids of the edges after the first: ``<first_id>-1``, ``<first_id>-2``, …, each chosen so that
    its replies partition (:func:`reply_partition`) is no other edge's while partitions last."""
    used = {reply_partition(first_id, partitions)}
    chosen: list[str] = []
    serial = itertools.count(1)
    for _ in range(1, edges):
        for _ in range(64):
            candidate = f"{first_id}-{next(serial)}"
            if reply_partition(candidate, partitions) not in used or len(used) >= partitions:
                break
        used.add(reply_partition(candidate, partitions))
        chosen.append(candidate)
    return chosen


def check_edge_exposure(platform: PlatformSettings, settings: EdgeSettings) -> None:
    """Refuse (:class:`SettingsError`) an edge on a non-loopback address without a tenants file or without
    an ops token, and a tenants file that does not load: called first by ``sluice edge`` and ``sluice up``,
    before anything slow starts (a review: ``sluice up`` started Kafka, the streams worker and the workers,
    then ended in a traceback on a missing file; ``sluice edge`` crash-looped on one)."""
    require_tenants_file(settings)
    check_exposure(
        platform.ops_token, host=settings.edge_host, variable="SLUICE_EDGE_HOST", service="the edge"
    )
    try:
        TenantDirectory.load(settings.edge_tenants_file)
    except CatalogueError as exc:
        raise SettingsError(f"SLUICE_EDGE_TENANTS_FILE: {exc}") from exc


def build_edge(
    platform: PlatformSettings, settings: EdgeSettings, reply_partitions: int
) -> tuple[Edge, KafkaGateway]:
    catalogue = ModelCatalogue(
        [ServedModel.load(m, current_model_dir(platform.cache_dir, m)) for m in platform.served_models()],
        models_root(platform.cache_dir),
    )

    def detokenize(model: str, ids: list[int]) -> str:
        return str(catalogue.get(model).tokenizer.decode(ids, skip_special_tokens=True))

    gateway = KafkaGateway(
        kafka=platform.kafka,
        names=TopicNames(platform.topic_prefix),
        edge_id=settings.edge_id,
        reply_partition=reply_partition(settings.edge_id, reply_partitions),
        salts=settings.salts(),
        detokenize=detokenize,
        resume_window_s=settings.edge_resume_window_s,
        idempotency_per_tenant=settings.edge_idempotency_keys_per_tenant,
        replies_on_loop=settings.edge_replies_on_loop,
    )
    gateway.on_deploy = lambda model, deployment: catalogue.preload(model, deployment.serving)
    files = Path(settings.edge_files_dir) if settings.edge_files_dir else Path(platform.data_dir) / "files"
    store = FileStore(
        files,
        max_bytes=settings.edge_file_max_bytes,
        ttl_s=settings.edge_file_ttl_s,
        max_tenant_bytes=settings.edge_files_max_bytes_per_tenant,
        max_tenant_files=settings.edge_files_max_per_tenant,
    )

    def batches(ctx: EdgeContext) -> BatchRunner:
        return BatchRunner(
            log=KafkaBatchLog(platform.kafka, TopicNames(platform.topic_prefix), settings.edge_id),
            settings=settings,
            store=store,
            preparer=ctx.preparer,
            tenants=ctx.tenants,
            exhausted=ctx.gateway.budget_exhausted,
        )

    edge = Edge(settings, gateway, catalogue, ops_token=platform.ops_token, batches=batches)
    return edge, gateway


async def serve_edge(edge: Edge, gateway: KafkaGateway, stop: asyncio.Event) -> None:
    """Start the gateway then the server; on ``stop``, drain the server then the gateway. If the edge fails
    (its Kafka gateway or its batch runner died), it stops too and the failure is raised, so a supervisor
    restarts it."""
    loop = asyncio.get_running_loop()
    async with gateway:
        await edge.start()
        tune_gc()  # what start-up built: out of the collector's sight (monitoring.runtime)
        edge.watch(lambda _exc: loop.call_soon_threadsafe(stop.set))
        try:
            await stop.wait()
        finally:
            await edge.stop()
    if edge.failure is not None:
        raise EdgeFailed(f"the edge failed: {edge.failure}") from edge.failure


class EdgeFailed(IngestError):
    """A part of the edge the process cannot serve without died."""
