"""Run one model's worker: load the model in its own thread, serve its request topic until stopped."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bus.placement import (
    available_cpus,
    format_cpus,
    native_cores,
    parse_cpus,
    pin_process,
    place_native_threads,
)
from gpu_workers import StartCancelled
from gpu_workers.batching import BatcherConfig
from gpu_workers.features import FeatureProbe
from gpu_workers.flush import FlushPolicy
from gpu_workers.runtime import Runner
from gpu_workers.scheduler import SchedulerConfig
from gpu_workers.service import WorkerService
from gpu_workers.settings import WorkerSettings
from monitoring import metrics
from monitoring.ops import OpsServer
from monitoring.runtime import tune_gc
from schemas.manifest import ManifestError, ModelManifest, current_model_dir, models_root, read_manifest
from schemas.settings import PlatformSettings
from schemas.topics import TopicNames

if TYPE_CHECKING:
    from gpu_workers.engine import GenerationEngine
    from gpu_workers.generation import GenerationRunner

log = logging.getLogger(__name__)


def generation_runner(
    engine: GenerationEngine,
    tokenizer: Any,
    manifest: ModelManifest,
    worker: WorkerSettings,
    source: str,
    worker_id: str,
) -> GenerationRunner:
    """The generation runner around ``engine`` as a worker sets it up: the scheduler's limits and tenant
    weights, the flush policy, the tokenizer's detokeniser."""
    from gpu_workers.detok import detokenizer_for
    from gpu_workers.generation import GenerationRunner

    return GenerationRunner(
        engine,
        detokenizer_for(tokenizer),
        manifest,
        source=source,
        worker_id=worker_id,
        scheduler=SchedulerConfig(
            max_running=worker.worker_max_running,
            max_batch_tokens=worker.worker_max_batch_tokens,
            max_waiting=worker.worker_max_waiting,
            weights=worker.tenant_weights(),
        ),
        flush=FlushPolicy(
            max_tokens=worker.worker_flush_tokens,
            max_delay_s=worker.worker_flush_ms / 1000,
            first_token_alone=worker.worker_flush_first_token,
        ),
    )


def runner_factory(
    model_dir: Path, worker: WorkerSettings, source: str, worker_id: str
) -> Callable[[], Runner]:
    """Build the runner inside the model thread (the model loads, warms up and runs in that thread)."""

    def build() -> Runner:
        runner = build_runner()
        faulty = (
            worker.fault_fail_ratio > 0
            or worker.fault_delay_ms > 0
            or worker.fault_max_tokens > 0
            or worker.fault_vector_noise > 0
        )
        version = read_manifest(model_dir).version
        if not faulty or (worker.fault_versions and version not in worker.fault_versions):
            return runner
        from gpu_workers.faults import FaultyRunner
        from gpu_workers.runtime import Origin

        log.warning(
            "worker %s: FAULT INJECTION on version %s (fail %.0f%%, +%d ms per step, answers cut at %s tokens, "
            "vector noise %g)",
            worker_id,
            version,
            100 * worker.fault_fail_ratio,
            worker.fault_delay_ms,
            worker.fault_max_tokens or "no",
            worker.fault_vector_noise,
        )
        return FaultyRunner(
            runner,
            Origin(source, worker_id),
            fail_ratio=worker.fault_fail_ratio,
            delay_s=worker.fault_delay_ms / 1000,
            max_tokens=worker.fault_max_tokens,
            vector_noise=worker.fault_vector_noise,
        )

    def build_runner() -> Runner:
        from gpu_workers.models import (
            QUIET_SPIN_COUNT,
            QuietTeam,
            configure_openmp,
            configure_torch_threads,
            default_torch_threads,
            load_torch,
            report_loaded,
        )

        manifest = read_manifest(model_dir)
        narrow = worker.worker_torch_threads or (
            len(available_cpus()) if worker.worker_cpus else default_torch_threads()
        )
        wide = quiet_threads(worker, manifest.task)
        if wide <= narrow:
            wide = 0  # no wider than the worker's own team: no quiet team
        # before torch loads: OpenMP reads its policy, and counts its cores, once
        configure_openmp(worker.worker_omp_wait_policy, QUIET_SPIN_COUNT if wide else None)
        load_torch((native_cores() or ()) if wide else ())
        narrow = configure_torch_threads(narrow)
        if manifest.task == "generation":
            from gpu_workers.engine import GenerationEngine
            from gpu_workers.models import load_generation_model

            loaded = load_generation_model(model_dir, worker.worker_device, worker.worker_dtype)
            report_loaded(loaded, manifest.model_id, worker_id)
            engine = GenerationEngine(
                loaded.model,
                max_batch_size=worker.worker_max_running,
                max_context=manifest.max_context,
                cuda_graphs=worker.worker_cuda_graphs,
                traced=worker.worker_generation_traced,
            )
            began = time.perf_counter()
            if graphs := engine.warm_up():  # in this thread, the model's
                log.info(
                    "%s: %d CUDA graphs of the decode captured in %.1f s",
                    manifest.model_id,
                    graphs,
                    time.perf_counter() - began,
                )
            return generation_runner(engine, loaded.tokenizer, loaded.manifest, worker, source, worker_id)
        from gpu_workers.embedding import EmbeddingEngine
        from gpu_workers.embedding_runner import EmbeddingRunner
        from gpu_workers.models import load_embedding_model

        loaded = load_embedding_model(model_dir, worker.worker_device, worker.worker_dtype)
        report_loaded(loaded, manifest.model_id, worker_id)
        embedder = EmbeddingEngine(
            loaded.model,
            max_length=manifest.max_context,
            cuda_graphs=worker.worker_cuda_graphs,
            traced=worker.worker_embed_traced,
        )
        began = time.perf_counter()
        graphs = embedder.warm_up(worker.worker_embed_max_batch)  # in this thread, the model's
        if graphs:
            log.info(
                "%s: %d CUDA graphs captured in %.1f s",
                manifest.model_id,
                graphs,
                time.perf_counter() - began,
            )
        team = None
        if wide and embedder.device.type == "cpu":
            team = QuietTeam(narrow, wide, worker.worker_quiet_batch, native_cores() or ())
            team.start(lambda: embedder.embed([[0] * 8]))  # id 0: in every vocabulary
            log.info(
                "%s: on a quiet box a batch of at most %d runs on %d torch threads (%d otherwise; "
                "SLUICE_WORKER_QUIET_THREADS=1 turns it off)",
                manifest.model_id,
                team.max_batch,
                team.wide,
                team.narrow,
            )
        return EmbeddingRunner(
            embedder,
            manifest,
            source=source,
            worker_id=worker_id,
            batching=BatcherConfig(
                max_batch_size=worker.worker_embed_max_batch,
                max_wait_s=worker.worker_embed_max_wait_ms / 1000,
                max_batch_tokens=embed_batch_tokens(worker, embedder.device.type),
                max_queued=worker.worker_embed_max_queued,
            ),
            team=team,
        )

    return build


EMBED_BATCH_TOKENS_CPU, EMBED_BATCH_TOKENS_GPU = 2_048, 16_384
"""``SLUICE_WORKER_EMBED_MAX_BATCH_TOKENS`` unset: on a CPU, on any other device."""


def embed_batch_tokens(worker: WorkerSettings, device_type: str) -> int:
    """The padded tokens an embedding batch may hold: the setting, else the device's default."""
    if worker.worker_embed_max_batch_tokens is not None:
        return worker.worker_embed_max_batch_tokens
    return EMBED_BATCH_TOKENS_CPU if device_type == "cpu" else EMBED_BATCH_TOKENS_GPU


def quiet_threads(worker: WorkerSettings, task: str) -> int:
    """How many torch threads a quiet batch gets (``SLUICE_WORKER_QUIET_THREADS``); 0: no quiet team.
    Unset, an embedding worker placed on its own cores gets every core it was started with."""
    if task != "embedding":
        return 0
    if worker.worker_quiet_threads is not None:
        return worker.worker_quiet_threads
    spare = native_cores()
    return len(available_cpus() | spare) if spare else 0


def probe_factory(
    platform: PlatformSettings, worker: WorkerSettings, model_id: str
) -> Callable[[], FeatureProbe]:
    """The drift feature probe, built in the model thread after the runner (a generation worker loads
    MiniLM there to embed sampled prompts, on the CPU: its :class:`DriftEmbedder` runs it on a thread of its
    own at idle priority, where a GPU's graphs captured on the model thread must not meet it; an
    embeddings worker uses its own vectors)."""

    def build() -> FeatureProbe:
        embedder_id = worker.drift_embedding_model
        if worker.drift_sample == 0:
            return FeatureProbe(0)
        if read_manifest(current_model_dir(platform.cache_dir, model_id)).task != "generation":
            # An embeddings model (MiniLM or any other): its own first vector, free, is what its drift
            # windows compare and what its rollout's drift gate compares with the stable version's.
            return FeatureProbe(worker.drift_sample, own_vectors=True)
        if not embedder_id:
            return FeatureProbe(worker.drift_sample)
        embedder_dir = current_model_dir(platform.cache_dir, embedder_id)
        try:
            task = read_manifest(embedder_dir).task
        except ManifestError as exc:
            log.warning("no prompt embeddings for drift: %s (run `sluice models prepare`)", exc)
            return FeatureProbe(worker.drift_sample)
        if task != "embedding":
            log.warning("no prompt embeddings for drift: %s is not an embedding model", embedder_id)
            return FeatureProbe(worker.drift_sample)
        from gpu_workers.features import DriftEmbedder, minilm_embedder

        try:
            embed = minilm_embedder(embedder_dir, "cpu", traced=worker.worker_embed_traced)
        except Exception:  # optional: a worker serves without prompt embeddings rather than not at all
            log.exception("no prompt embeddings for drift: loading %s failed", embedder_id)
            return FeatureProbe(worker.drift_sample)
        embedder = DriftEmbedder(
            embed,
            budget=worker.drift_embed_budget,
            on_skip=metrics.WORKER_DRIFT_SKIPPED.labels(model_id).inc,
            on_embedded=metrics.WORKER_DRIFT_EMBEDDED.labels(model_id).inc,
            cores=available_cpus() | (native_cores() or frozenset()),
            name=f"drift-embedder-{model_id}",
        )
        return FeatureProbe(worker.drift_sample, embedder)

    return build


def make_worker(platform: PlatformSettings, worker: WorkerSettings, model_id: str) -> WorkerService:
    worker_id = worker.worker_id or f"{model_id}-{os.getpid()}"
    model_dir = model_dir_of(platform, model_id, worker.worker_version)
    manifest = read_manifest(model_dir)  # fail fast, before Kafka, if the model was never prepared
    return WorkerService(
        model_id=model_id,
        worker_id=worker_id,
        kafka=platform.kafka,
        names=TopicNames(platform.topic_prefix),
        runner_factory=runner_factory(model_dir, worker, f"gpu_workers/{worker_id}", worker_id),
        consumer_overrides={"session.timeout.ms": worker.worker_session_timeout_ms},
        probe_factory=probe_factory(platform, worker, model_id),
        version=manifest.version,
        adopt_grace_s=worker.worker_adopt_grace_s,
        standby=worker.worker_standby,
        ready_max_lag=worker.worker_ready_max_lag,
    )


def model_dir_of(platform: PlatformSettings, model_id: str, version: str | None) -> Path:
    """The prepared directory of ``model_id`` at ``version`` (``current`` when None)."""
    if not version:
        return current_model_dir(platform.cache_dir, model_id)
    path = models_root(platform.cache_dir) / model_id / version
    if not path.is_dir():
        raise ManifestError(f"{model_id} has no version {version} (see `sluice models list`)")
    return path


def place_worker(cpus: str) -> None:
    """``SLUICE_WORKER_CPUS``: this process's threads onto ``cpus``, its Kafka clients' native threads onto
    the cores it was started with minus those (none left: the same cores). Empty: nothing moves. Call it
    first in a worker process: the threads started later inherit it (``sluice worker`` does)."""
    if not cpus:
        return
    model = parse_cpus(cpus)
    started_on = available_cpus()
    pin_process(model)
    rest = started_on - model
    place_native_threads(rest or None)
    log.info(
        "worker on cores %s, Kafka's native threads on %s",
        format_cpus(model),
        format_cpus(rest) if rest else "the same",
    )


def run_worker(
    platform: PlatformSettings,
    worker: WorkerSettings,
    model_id: str,
    stop: threading.Event,
    join: threading.Event | None = None,
) -> None:
    """Serve until ``stop`` is set (SIGTERM/SIGINT in ``sluice worker``). The ops endpoints answer from
    the start: ``/healthz`` while the model loads, ``/readyz`` once it serves."""
    service = make_worker(platform, worker, model_id)
    ops = OpsServer(
        worker.worker_ops_host,
        worker.worker_ops_port,
        service.readiness,
        service=f"worker/{service.worker_id}",
        token=platform.ops_token,
    )
    with ops:
        log.info("worker %s: metrics and health on %s", service.worker_id, ops.url)
        service.watch(lambda _: stop.set())  # the first failure of any of its threads ends the wait
        service.start_cancelled = stop  # a stop signal while the model loads ends the start at once
        try:
            service.start()  # returns once the model is loaded
        except StartCancelled:
            log.info("worker %s: stopped while loading its model", service.worker_id)
            return
        tune_gc()  # the model and what start-up built: out of the collector's sight (monitoring.runtime)
        try:
            if service.standby and join is not None:
                log.info("worker %s warm for %s: joins its group on SIGUSR1", service.worker_id, model_id)
                while not stop.is_set() and not join.wait(0.1):
                    pass
                if not stop.is_set():
                    service.join()
            if not service.standby:  # a standby stopped before it joined has served nothing
                log.info("worker %s serving %s", service.worker_id, model_id)
            stop.wait()
            if service.failure is not None:
                raise service.failure
            began = time.monotonic()
            drained = service.drain(worker.worker_drain_s)
            log.info(
                "worker %s: %s in %.1fs",
                service.worker_id,
                "drained" if drained else "not drained (what runs is re-run elsewhere)",
                time.monotonic() - began,
            )
        finally:
            service.stop()
