"""Worker settings (``SLUICE_WORKER_*``), read once per worker process."""

from __future__ import annotations

import math
from typing import Annotated, Literal

import msgspec

from bus.placement import parse_cpus
from schemas.settings import register

Positive = Annotated[int, msgspec.Meta(ge=1)]
WeightsDtype = Literal["auto", "float32", "bfloat16", "float16"]


ADOPT_GRACE_MIN_S = 1.0
"""The least ``SLUICE_WORKER_ADOPT_GRACE_S``: half of it is the margin for a retiring version's workers seeing
their version leave serving later than the stable version's do (each reads the control topic, a fetch
waiting up to 100 ms: ``bus.consumer.BACKGROUND``)."""


@register
class WorkerSettings(msgspec.Struct, frozen=True, kw_only=True):
    worker_id: Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_.-]{1,128}$")] | None = None
    """Defaults to ``<model>-<pid>``. Letters, digits, ``_.-``, at most 128: it names the worker in every
    event it produces, whose envelope holds no longer a producer (``schemas.events.Name``)."""
    worker_device: str = "auto"
    """``auto`` (CUDA if present, else CPU), ``cpu``, ``cuda``, ``cuda:1`` …"""
    worker_dtype: WeightsDtype = "auto"
    """The dtype the model's weights are loaded in. ``auto``: the checkpoint's own (``torch_dtype`` in its
    config, e.g. bfloat16) on a GPU, where float32 took twice the memory and ran its matrix products in fp32
    (a review, 2026-12-03); float32 on a CPU, where bf16/fp16 kernels are slow or missing. ``float32``,
    ``bfloat16``, ``float16``: that dtype on any device."""
    worker_torch_threads: Annotated[int, msgspec.Meta(ge=1)] | None = None
    """torch intra-op threads; unset: half the cores this process may use, at least one (on a box shared
    with the edge, Kafka and other workers a team as wide as the box either spins against them or, with
    passive threads, wakes them at every op: on 2 cores generation ran at half speed; docs/perf). On a
    dedicated CPU box serving a large model, give it the cores it has."""
    worker_cpus: str = ""
    """Cores (``taskset -c`` syntax: ``1``, ``2-7``) this worker runs on, its model thread and all its other
    Python threads; its Kafka clients' native threads go to the cores it was started with minus these.
    Unset: wherever the OS puts it. ``sluice up`` gives its workers half the box (``SLUICE_FLEET_WORKER_CPUS``)
    and the edge, Kafka and the streams worker the other half: on 2 shared cores that made +10-20 %
    throughput (bus/placement.py, docs/perf). With it set, torch's threads default to one per core here."""
    worker_quiet_threads: Annotated[int, msgspec.Meta(ge=1)] | None = None
    """Embeddings on a CPU: torch threads for a batch of at most ``worker_quiet_batch`` items with nothing
    waiting behind it, i.e. when the box is quiet; the extra threads run on the cores the worker does not
    own (``gpu_workers.models.QuietTeam``). At one client MiniLM's forward took ~8 ms on the worker's one
    core and ~5 ms with a second thread on the idle other core; under load batches are larger and the team
    stays at ``worker_torch_threads``. Unset: with ``SLUICE_WORKER_CPUS`` set, every core the worker was
    started with; without it, off. ``1`` (or the worker's own thread count) turns it off."""
    worker_quiet_batch: Positive = 4
    """Embeddings: the largest batch that runs on the quiet team (``worker_quiet_threads``)."""
    worker_omp_wait_policy: Literal["passive", "active"] = "passive"
    """OpenMP's ``OMP_WAIT_POLICY`` for torch's threads (an ``OMP_WAIT_POLICY`` already in the environment
    wins). ``active`` threads spin between ops; on a box shared with the edge, Kafka and another worker a
    spinning team burns the cores the others need: MiniLM at 64 clients measured 78 embeddings/s with
    ``active`` and 170/s with ``passive`` (10.6 vs 3.9 ms of worker CPU per request, docs/perf/).
    ``active`` can win on a dedicated CPU box. With a quiet team (``worker_quiet_threads``) ``passive``
    becomes a short spin (``GOMP_SPINCOUNT``, ``gpu_workers.models.QUIET_SPIN_COUNT``): a passive 2-thread
    team is slower than one thread."""
    worker_max_running: Positive = 16
    """Generation: sequences decoded together at most (continuous batching)."""
    worker_max_batch_tokens: Positive = 16_384
    """Generation: KV budget, sum of prompt + max new tokens over running sequences. It bounds one sequence
    too: a request's max new tokens is lowered to what the budget leaves after its prompt (its answer ends
    with finish_reason "length" there), and a longer prompt ends ``context_length_exceeded`` (a 400). On a
    model whose context is longer than this, the worker warns at start."""
    worker_max_waiting: Positive = 1024
    """Generation: bounded waiting queue; when it is full, the tenant holding the most of it has its newest
    request refused (``queue_full``), not whoever comes next."""
    worker_tenant_weights: tuple[str, ...] = ()
    """Generation: ``tenant=w`` entries, the tenant's share of the worker's service relative to others (every
    tenant not named: 1). Under saturation a tenant of weight 2 gets twice the tokens of one of weight 1."""
    worker_flush_tokens: Positive = 8
    """Streaming: publish a chunk once this many tokens are buffered…"""
    worker_flush_ms: Annotated[float, msgspec.Meta(ge=0)] = 20.0
    """…or this long after its first buffered token."""
    worker_flush_first_token: bool = True
    """Streaming: publish each request's first token at once, in a chunk of its own (time to first token
    is what a streaming user feels most); coalescing starts from the second token."""
    worker_embed_max_batch: Positive = 64
    worker_embed_max_wait_ms: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    """Embeddings: how long a batch that is not full waits for more inputs. 0: an idle model runs what is
    there at once, and batches fill with what arrives while the previous one runs (at 64 clients the
    throughput was the same as with 4 ms; at 1 client p50 fell from 42 to 31 ms). Raise it only for
    traffic that arrives in bursts just apart."""
    worker_embed_max_batch_tokens: Positive | None = None
    """Embeddings: padded tokens a batch may hold (its inputs times the longest). Unset: 16,384 on a GPU,
    2,048 on a CPU. On a CPU a batch gains nothing from long inputs (MiniLM at 512 tokens, one thread:
    244-265 ms an input at every batch size from 1 to 32) and a batch of 32 of them ran 7.8 s, which every
    other request waited out; 2,048 still takes 64 short inputs (up to 32 tokens) at once."""
    worker_embed_max_queued: Positive = 4096
    """Embeddings: inputs waiting for a batch before requests are refused ``queue_full`` (retriable). A
    request is queued whole while fewer wait, whatever its size (so the queue holds at most this, less one,
    plus one request's inputs): a large request is refused no more often than a small one (before, one
    needing room for all its inputs starved behind a steady load of small ones). One with more inputs than
    this fails ``invalid_input``. The default is twice the most inputs an edge takes (2,048, OpenAI's
    limit)."""
    worker_cuda_graphs: bool = True
    """On a GPU, run the forwards as CUDA graphs. Embeddings: one per batch shape bucket (the common ones
    captured at start-up, others at their first batch; a capture synchronises the device and runs the
    forward three times). Generation: the decode step, one per batch height up to ``worker_max_running``,
    all captured at start-up, over the fixed KV ring (``gpu_workers.ring``). A small model's forward is
    launch-bound there: MiniLM on an H100 took ~3 ms a batch eagerly whatever its size (docs/perf). Off:
    every forward runs eagerly (generation keeps the ring)."""
    worker_embed_traced: bool = True
    """On a CPU, run the embedding forward as a traced, frozen TorchScript graph (built and checked against
    the eager forward at start-up; a model it cannot follow runs eagerly, logged): no Python between ops.
    MiniLM's one 10-token sentence took 9.1 ms instead of 11.0 on one core, the same from 32 items a batch
    on (docs/perf). Off: every forward runs eagerly."""
    worker_generation_traced: bool = True
    """On a CPU, run a generation model's prefill (a request's first token) and its decode step as traced,
    frozen TorchScript graphs (built and checked against the eager forward at start-up; a model they cannot
    follow runs eagerly, logged): no Python between ops. demo-gpt's first token after an idle moment took
    ~1.5 ms instead of ~2.5 on one core, and a decode step of one row 0.3 ms instead of 0.8 (docs/perf).
    Off: both run eagerly."""
    worker_ops_host: str = "127.0.0.1"
    worker_ops_port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 9400
    """``/metrics``, ``/healthz`` and ``/readyz`` of this worker; 0 picks a free port. ``sluice up`` gives
    its workers this port, the next one, … in the order of ``SLUICE_MODELS``."""
    worker_ready_max_lag: Annotated[int, msgspec.Meta(ge=0)] = 10_000
    """``/readyz`` fails while more requests than this wait uncommitted on this worker's partitions."""
    worker_session_timeout_ms: Annotated[int, msgspec.Meta(ge=1000)] = 10_000
    """Kafka group session timeout: how soon a dead worker's requests move to another worker."""
    worker_standby: bool = False
    """Start warm: load the model, then wait outside the group until SIGUSR1 (``sluice up``'s autoscaler
    keeps such workers to scale out without waiting for a model to load)."""
    worker_drain_s: Annotated[float, msgspec.Meta(ge=0.0)] = 20.0
    """On SIGTERM (a scale-in, a rolling restart), how long the worker keeps running what it already took,
    taking nothing new, before it leaves the group; what is still running then is re-run by another worker.
    Keep it under the supervisor's grace (``sluice up``: 30 s; Kubernetes: terminationGracePeriodSeconds)."""
    worker_version: str | None = None
    """The model version to serve (a directory under the model's cache folder); default: ``current``."""
    worker_adopt_grace_s: Annotated[float, msgspec.Meta(ge=ADOPT_GRACE_MIN_S)] = 10.0
    """How long after a version stops serving the stable version's workers wait before running the
    requests still routed to it. Its own workers may finish what they started for half of it, then cut
    what still runs (the stable version runs it again): no request ends on both. The other half is the
    margin for the two versions' workers seeing the change at different times, so it is at least
    :data:`ADOPT_GRACE_MIN_S` (a grace of 0 let a request end on both versions)."""
    fault_fail_ratio: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.0
    """Fault injection for rollout drills: this share of requests (by request-id hash) ends ``failed``."""
    fault_delay_ms: Annotated[int, msgspec.Meta(ge=0)] = 0
    """Fault injection: added to every model step (slower first token and inter-token gaps)."""
    fault_max_tokens: Annotated[int, msgspec.Meta(ge=0)] = 0
    """Fault injection: every generation stops after this many tokens (0: off), answers cut short (a drill
    for the rollout's drift gate)."""
    fault_vector_noise: Annotated[float, msgspec.Meta(ge=0.0)] = 0.0
    """Fault injection: Gaussian noise of this size is added to every component of every embedding (norm
    kept; 0: off), vectors unlike the stable version's (a drill for an embeddings rollout's drift gate;
    0.05 moves MiniLM's to a cosine of ~0.7)."""
    fault_versions: tuple[str, ...] = ()
    """Model versions the faults apply to (empty: every version this worker serves)."""
    drift_sample: Annotated[int, msgspec.Meta(ge=0)] = 20
    """1 in N requests (by a hash of the request id) carry a MiniLM embedding of the prompt for drift
    detection; 1 embeds every request, 0 none. The other drift features are on every request."""
    drift_embed_budget: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 0.02
    """Share of the time the prompt embeddings of the drift sample may take (a budget with up to
    ``DRIFT_EMBED_BURST_S`` of credit): past it a sampled request goes without its embedding, counted in
    ``sluice_worker_drift_embeddings_skipped_total``. 1: no limit. They run on the drift embedder's
    idle-priority thread while the model idles, and on the model thread itself under load
    (``gpu_workers.features.DriftEmbedder``), where a MiniLM call on a CPU costs ~10 ms with the whole
    batch waiting: at 1 in 20, demo-gpt at saturation made 10.7k tok/s with every sampled prompt embedded
    and 11.8k with none (docs/perf)."""
    drift_embedding_model: str = "all-minilm-l6-v2"
    """The prepared model a generation worker loads to embed sampled prompts; empty: no prompt embeddings
    from generation workers."""

    def tenant_weights(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for entry in self.worker_tenant_weights:
            tenant, sep, weight = entry.partition("=")
            try:
                value = float(weight)
            except ValueError:
                value = 0.0
            if not sep or not tenant.strip() or not 0 < value < math.inf:
                raise ValueError(
                    f"SLUICE_WORKER_TENANT_WEIGHTS entry {entry!r}: expected tenant=w with w a positive number"
                )
            out[tenant.strip()] = value
        return out

    def __post_init__(self) -> None:
        self.tenant_weights()  # validate early
        if self.worker_cpus:
            parse_cpus(self.worker_cpus)
