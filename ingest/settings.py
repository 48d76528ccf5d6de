"""The edge's settings: ``SLUICE_EDGE_*`` variables, read once with :func:`schemas.settings.load_settings`."""

from __future__ import annotations

from typing import Annotated

import msgspec

from schemas.settings import register

Seconds = Annotated[float, msgspec.Meta(gt=0.0)]
Count = Annotated[int, msgspec.Meta(ge=1)]


@register
class EdgeSettings(msgspec.Struct, frozen=True, kw_only=True):
    """Field ``edge_x`` is variable ``SLUICE_EDGE_X``."""

    edge_host: str = "127.0.0.1"
    """Not a loopback address: needs ``SLUICE_EDGE_TENANTS_FILE`` (the demo key is for loopback only) and
    ``SLUICE_OPS_TOKEN`` (``/metrics``), or the edge refuses to start."""
    edge_allowed_hosts: tuple[str, ...] = ()
    """``Host`` names the edge answers (ports ignored; ``*`` any, ``.example.com`` a domain and its
    subdomains); others get 421. Unset: ``127.0.0.1,localhost,[::1]`` and ``edge_host`` (any name when
    ``edge_host`` is ``0.0.0.0`` or ``::``). ``/healthz`` and ``/readyz`` answer any name."""
    edge_allowed_origins: tuple[str, ...] = ()
    """Sites whose browser pages may open the WebSocket (the host of the upgrade's ``Origin``, ports ignored;
    ``*`` any, ``.example.com`` a domain and its subdomains); others get 403. Unset: the names
    ``edge_allowed_hosts`` allows. A client that sends no ``Origin`` (not a browser) is not concerned. A
    browser applies no same-origin rule to a WebSocket and sends the edge's own ``Host``, so without this
    any page a developer visits could use a local edge with the public demo key (an audit)."""
    edge_port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 8080
    """0 picks a free port (tests)."""
    edge_id: Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_.-]{1,64}$")] = "edge-0"
    """This edge's name: events carry ``source=ingest/<edge_id>`` and replies are routed to it."""
    edge_tenants_file: str | None = None
    """JSON or TOML tenants file (see ``ingest/auth.py``). Unset: only the demo tenant, key ``sk-sluice-demo``."""
    edge_max_body_bytes: Annotated[int, msgspec.Meta(ge=1024)] = 8 << 20
    """Largest HTTP body and WebSocket message; larger bodies get 413. 8 MiB, what one request event may
    hold (``schemas.codec.MAX_RECORD_BYTES``): at 1 MiB, 2,048 embedding inputs had to average under 500
    bytes (a review). A body is read only once its key is known, within the tenant's limits."""
    edge_server_timing: bool = True
    """A non-streamed answer carries a ``Server-Timing`` header: where its time went (the edge, the queue, the
    model, the way back; ingest/README.md). Off: no header (the timings stay in the logs and traces)."""
    edge_default_timeout_s: Seconds = 60.0
    """Deadline of a request that names none (``timeout`` field or ``X-Request-Timeout`` header)."""
    edge_max_timeout_s: Seconds = 600.0
    """Longer deadlines asked for are cut to this."""
    edge_ws_max_inflight: Count = 32
    """Requests one WebSocket may have in flight; more get an error frame."""
    edge_ws_send_queue: Count = 256
    """Frames one WebSocket may have queued for sending; when full, its streams stop being read."""
    edge_ws_send_queue_bytes: Annotated[int, msgspec.Meta(ge=1024)] = 4 << 20
    """Bytes one WebSocket may have queued for sending (a single larger frame still goes alone); when
    full, its streams stop being read."""
    edge_ws_max_per_tenant: Count = 64
    """Open WebSockets one tenant may hold on this edge; one more is refused with 429."""
    edge_heartbeat_s: Seconds = 15.0
    """WebSocket ping interval; a peer that misses a pong is closed."""
    edge_idle_timeout_s: Seconds = 75.0
    """A connection with no request in progress (idle between requests, or still sending a request's
    headers) is closed after this long. aiohttp's default is an hour: 500 connections sending their headers
    a byte at a time were all kept open (an audit)."""
    edge_max_connections: Count = 4096
    """Client connections one edge holds at once (HTTP keep-alive and WebSockets alike); one more is answered
    503 ``too_many_connections`` and closed. The edge raises its own open-file limit to fit when it may."""
    edge_shutdown_grace_s: Annotated[float, msgspec.Meta(ge=0.0)] = 10.0
    """On stop, in-flight streams get this long to finish before they are cancelled (reason ``shutdown``)."""
    edge_hot_tenants: tuple[str, ...] = ()
    """``tenant=N`` entries: that tenant's requests are keyed over N salts, so they spread over N request
    partitions (and so over up to N workers) instead of one."""
    edge_replies_on_loop: bool = True
    """The edge's reply listener is woken by librdkafka on the event loop (one wake-up a reply; 0.15-0.2 ms
    less on each reply's hop here, docs/perf). Off, or where that cannot be set up: a thread polls the
    replies and hands each batch to the loop."""
    edge_resume_window_s: Annotated[float, msgspec.Meta(ge=0.0)] = 3600.0
    """Streams answered on this edge this recently can be resumed after the edge restarts (its reply
    partition is indexed at start, from the record headers); older ones are 404."""
    edge_idempotency_keys_per_tenant: Count = 10_000
    """Idempotency keys remembered per tenant (24 h, shared by every edge through the ``idempotency`` topic);
    a tenant past it forgets its own oldest keys, never another tenant's."""
    edge_quota_sync_s: Annotated[float, msgspec.Meta(ge=0.01, le=5.0)] = 0.1
    """How often this edge publishes what it admitted (``quota`` topic), so that tenants' limits hold across
    edges; between two syncs the edges together can pass a limit by at most (edges - 1) requests."""
    edge_disconnect_grace_s: Annotated[float, msgspec.Meta(ge=0.0)] = 0.0
    """Wait this long after a client disconnects before cancelling its request, so that a reconnect with
    ``Last-Event-ID`` to this edge keeps the generation. 0: cancel at once. The request keeps its place
    under the tenant's ``max_concurrency`` meanwhile; the client coming back takes it over."""

    edge_files_dir: str | None = None
    """Where uploaded files and batches' files and journals live. Unset: ``<SLUICE_DATA_DIR>/files``. Edges
    that share batches share this folder (one machine, or a shared file system)."""
    edge_file_max_bytes: Annotated[int, msgspec.Meta(ge=1024)] = 200 * 1024 * 1024
    """Largest file ``POST /v1/files`` takes (OpenAI's limit: 200 MB); larger uploads get 413."""
    edge_files_max_bytes_per_tenant: Annotated[int, msgspec.Meta(ge=0)] = 10 * 1024**3
    """What one tenant's files may hold together (its uploads and its batches' output and error files); an
    upload past it gets 413 ``storage_quota_exceeded``. Each file counts at least 4 KiB (its metadata's
    block on disk), so empty files are not free. 0: no limit."""
    edge_files_max_per_tenant: Annotated[int, msgspec.Meta(ge=0)] = 10_000
    """How many files one tenant may keep (its uploads and its batches' output and error files); an upload
    while it keeps this many gets 413 ``storage_quota_exceeded``. Each upload reads the metadata of every
    file the tenant keeps, so this also bounds what that read costs. 0: no limit."""
    edge_file_ttl_s: Annotated[int, msgspec.Meta(ge=0)] = 30 * 86_400
    """How long an uploaded file, or a batch's output or error file, is kept (OpenAI's default: 30 days;
    an upload may ask for 1 hour to 30 days with ``expires_after``). 0: until deleted."""
    edge_batch_max_lines: Count = 50_000
    """Lines one batch may hold (OpenAI's limit); a longer input file fails validation."""
    edge_batch_max_in_flight: Count = 256
    """Batch lines per model published and not yet finished, over every batch this edge runs: enough to
    keep the workers' batches full, few enough that interactive requests always find room."""
    edge_batch_max_attempts: Count = 3
    """Runs of a line that keeps failing for a retriable reason (worker overloaded, died or shut down)."""
    edge_batch_retry_backoff_s: Annotated[float, msgspec.Meta(ge=0.0)] = 1.0
    """First retry after about this long (x 0.5-1.5 jitter), doubling with each attempt, at most 60 s."""

    def salts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for entry in self.edge_hot_tenants:
            tenant, sep, count = entry.partition("=")
            if not sep or not tenant.strip() or not count.strip().isdigit() or int(count) < 1:
                raise ValueError(f"SLUICE_EDGE_HOT_TENANTS entry {entry!r}: expected tenant=N with N >= 1")
            out[tenant.strip()] = int(count)
        return out

    def __post_init__(self) -> None:
        self.salts()  # validate early
        if self.edge_default_timeout_s > self.edge_max_timeout_s:
            raise ValueError("edge_default_timeout_s must not exceed edge_max_timeout_s")
