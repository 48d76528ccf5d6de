"""The events the platform carries on Kafka: frozen, typed, one tagged union.

Every event subclasses :class:`Envelope` (id, type tag, time, tenant, model, request id, source, trace
context). ``id`` and ``time`` default to a fresh UUIDv7 and the current UTC time, so a producer passes only
what it knows. The ``type`` tag is written by msgspec from each class's ``tag``; ``schema_version`` is a class
constant carried in the CloudEvents ``ce_type`` header (see :mod:`schemas.codec`).

Times are aware UTC datetimes, checked on construction and on decode. Constraints in ``msgspec.Meta`` are
enforced when decoding (and exported into the JSON Schemas); constructors trust their callers.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from typing import Annotated, ClassVar, Literal, TypeAlias, TypedDict

import msgspec

from schemas.ids import UUID7_PATTERN, uuid7
from schemas.prices import PriceTable

UtcDatetime = Annotated[datetime, msgspec.Meta(tz=True)]
"""Decoding rejects naive times; ``__post_init__`` rejects offsets other than UTC."""
EventId = Annotated[str, msgspec.Meta(pattern=UUID7_PATTERN)]
NonNegative = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
"""Up to an Int64's largest: the warehouse keeps such counts in ``Int64``/``UInt64`` columns, where a
larger one wrapped silently (a batch line's index 2**64 + 1 was stored as line 1). A record with one is
dead-lettered."""
UInt32 = Annotated[int, msgspec.Meta(ge=0, le=2**32 - 1)]
"""A count the warehouse keeps in a ``UInt32`` column (retry attempts, characters, sample sizes)."""
Name = Annotated[str, msgspec.Meta(max_length=256)]
"""A tenant, model, request id or producer. Each is copied into its record's key or CloudEvents headers,
which count against the record limit beside the value (``schemas.codec.RECORD_HEADROOM_BYTES``): a
340 KB tenant made a terminal event no broker takes, and the worker producing it died (a fuzz audit).
Far longer than any the platform makes: a tenant name is at most 64 characters, an id 36."""
Share = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
"""A share of traffic: a candidate's share of 1e308 decoded, and every routing of its model raised on
``round(inf)``, a 500 for each of its requests on every edge, for as long as the compacted control topic
kept the record (a review). A record with another is dead-lettered."""
CustomId = Annotated[str, msgspec.Meta(max_length=512)]
"""A batch line's ``custom_id``: the edge takes 1 to 512 characters (``ingest.batch_lines.MAX_CUSTOM_ID``)."""
TraceHeader = Annotated[str, msgspec.Meta(max_length=1024)]
"""W3C trace context, headers too: a ``traceparent`` is 55 characters, a ``tracestate`` should stay
under 512."""
Endpoint = Literal["/v1/chat/completions", "/v1/completions", "/v1/embeddings"]
FinishReason = Literal["stop", "length", "cancelled", "deadline", "error"]
Status = Literal["completed", "failed", "cancelled", "expired"]


def utc_now() -> datetime:
    return datetime.now(UTC)


def _require_utc(name: str, value: datetime | None) -> None:
    if value is not None and value.tzinfo is not UTC and value.utcoffset() != UTC.utcoffset(None):
        raise ValueError(f"{name} must be an aware UTC datetime, got {value.isoformat()}")


class FrozenStruct(msgspec.Struct, frozen=True, kw_only=True):
    """Base of events and their nested parts.

    Unknown fields are ignored on decode, so a consumer keeps working while producers add optional fields.
    Subclasses repeat ``frozen=True, kw_only=True``: msgspec inherits them, but mypy only sees them there.
    """


class Envelope(FrozenStruct, frozen=True, kw_only=True, tag_field="type"):
    """The fields every event shares."""

    schema_version: ClassVar[int] = 1

    id: EventId = msgspec.field(default_factory=uuid7)
    time: UtcDatetime = msgspec.field(default_factory=utc_now)
    tenant: Name
    model: Name
    request_id: Name = ""
    """Empty for events that belong to no request (control state, drift reports)."""
    source: Name
    """The producer, e.g. ``ingest/edge-1``."""
    traceparent: TraceHeader | None = None
    tracestate: TraceHeader | None = None

    def __post_init__(self) -> None:
        _require_utc("time", self.time)


# --- requests ---------------------------------------------------------------------------------------------


MAX_STOPS = 4
"""The most stop strings a request may give (OpenAI's)."""
MAX_STOP_CHARS = 256
"""A stop string longer than this is refused: it rides in every request event and terminal event."""
StopString = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_STOP_CHARS)]
"""A stop string: an empty one would stop every completion before its first character."""


class SamplingParams(FrozenStruct, frozen=True, kw_only=True):
    max_tokens: Annotated[int, msgspec.Meta(ge=1)] = 16
    temperature: Annotated[float, msgspec.Meta(ge=0.0)] = 1.0
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 1.0
    top_k: NonNegative = 0
    """0 disables top-k."""
    stop: Annotated[tuple[StopString, ...], msgspec.Meta(max_length=MAX_STOPS)] = ()
    """Bounded as the edge bounds them: the worker looks for each at every token on the model's thread, and
    800,000 of them in one record slowed every request of a worker to 1 s a token (a review). A record
    with more is dead-lettered."""
    seed: Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)] | None = None
    """An int64, as the edge takes it (``torch.Generator.manual_seed`` takes no more than a uint64, and
    msgspec bounds no wider than an int64): a record with another fails to decode and is dead-lettered."""
    ignore_eos: bool = False
    """Keep generating past the end-of-sequence token until ``max_tokens``."""


class ReplyTo(FrozenStruct, frozen=True, kw_only=True):
    """Where the edge holding the client listens for this request's chunks and terminal event."""

    topic: Name
    partition: NonNegative
    edge_id: Name


class RequestCommon(Envelope, frozen=True, kw_only=True):
    """What every request kind carries (not an event by itself)."""

    model_version: Name
    deadline: UtcDatetime | None = None
    """Work not finished by then is dropped and the request ends ``expired``."""
    reply: ReplyTo | None = None
    """None: no edge waits; the terminal event goes to the results topic only."""
    idempotency_key: Name | None = None
    priority: int = 0
    shadow_of: Name | None = None
    """Set on a shadow copy: the id of the request it mirrors. A shadow request runs on a candidate version
    at the lowest priority, has no ``reply`` (no client ever sees it) and is never billed."""

    def __post_init__(self) -> None:
        super().__post_init__()
        _require_utc("deadline", self.deadline)


class GenerationRequested(RequestCommon, frozen=True, kw_only=True, tag="generation_requested"):
    input_ids: list[int]
    """Tokenised at the edge."""
    prompt: str | None = None
    sampling: SamplingParams = msgspec.field(default_factory=SamplingParams)
    stream: bool = False
    chat: bool = False


class EmbeddingRequested(RequestCommon, frozen=True, kw_only=True, tag="embedding_requested"):
    inputs: list[list[int]]
    """One list of token ids per input."""
    texts: list[str] | None = None
    normalize: bool = True


class BatchRef(FrozenStruct, frozen=True, kw_only=True):
    """Which line of which batch a request or result is (``attempt`` counts retries from 0)."""

    batch_id: Name
    custom_id: CustomId
    index: NonNegative
    attempt: UInt32 = 0


BATCH_KEY_SPREAD = 8
"""A batch's items are keyed by batch id and ``index % BATCH_KEY_SPREAD``: one batch's lines stay on a few
partitions (their order is the output file's, not the log's), and several workers share a big batch."""


class BatchItemRequested(RequestCommon, frozen=True, kw_only=True, tag="batch_item_requested"):
    """One line of an async batch (the OpenAI Batch API), published by the edge that owns the batch.

    It carries what a :class:`GenerationRequested` or :class:`EmbeddingRequested` of the same body would
    (tokenised at the edge); workers run it as that request (:meth:`as_request`) in their batch lane, after
    interactive work, and its terminal event names the line (``RequestFinished.batch``). ``request_id`` is
    derived from the batch id, index and attempt, so a re-publication after an edge restart is the same
    request and runs once."""

    batch_id: Name
    custom_id: CustomId
    index: NonNegative
    total: Annotated[int, msgspec.Meta(ge=1)]
    endpoint: Endpoint
    input_ids: list[int]
    """The prompt's token ids (generation); empty for ``/v1/embeddings`` items."""
    sampling: SamplingParams | None = None
    """None for ``/v1/embeddings`` items."""
    attempt: UInt32 = 0
    """0 for the first run; a retry of a retriable failure is a new request with ``attempt + 1``."""
    prompt: str | None = None
    chat: bool = False
    inputs: list[list[int]] | None = None
    """One list of token ids per input (``/v1/embeddings`` items)."""
    texts: list[str] | None = None
    normalize: bool = True

    @property
    def ref(self) -> BatchRef:
        return BatchRef(
            batch_id=self.batch_id, custom_id=self.custom_id, index=self.index, attempt=self.attempt
        )

    def as_request(self) -> GenerationRequested | EmbeddingRequested:
        """The request this line is, as a worker runs it (same ids, deadline, priority and trace)."""
        common = _request_common(self)
        if self.endpoint == "/v1/embeddings":
            return EmbeddingRequested(
                **common, inputs=list(self.inputs or []), texts=self.texts, normalize=self.normalize
            )
        return GenerationRequested(
            **common,
            input_ids=self.input_ids,
            prompt=self.prompt,
            sampling=self.sampling or SamplingParams(),
            chat=self.chat,
        )

    @classmethod
    def of(
        cls,
        request: GenerationRequested | EmbeddingRequested,
        ref: BatchRef,
        *,
        total: int,
        endpoint: Endpoint,
    ) -> BatchItemRequested:
        """The batch line that runs as ``request`` (its reply, shadow and stream settings are dropped:
        nobody waits on a batch line but the batch)."""
        common = _request_common(request, reply=False)
        line: dict[str, object] = {
            "batch_id": ref.batch_id,
            "custom_id": ref.custom_id,
            "index": ref.index,
            "attempt": ref.attempt,
            "total": total,
            "endpoint": endpoint,
        }
        if isinstance(request, EmbeddingRequested):
            return cls(
                **common,
                **line,  # type: ignore[arg-type]
                input_ids=[],
                inputs=request.inputs,
                texts=request.texts,
                normalize=request.normalize,
            )
        return cls(
            **common,
            **line,  # type: ignore[arg-type]
            input_ids=request.input_ids,
            prompt=request.prompt,
            sampling=request.sampling,
            chat=request.chat,
        )


class _RequestFields(TypedDict):
    id: str
    time: datetime
    tenant: str
    model: str
    request_id: str
    source: str
    traceparent: str | None
    tracestate: str | None
    model_version: str
    deadline: datetime | None
    reply: ReplyTo | None
    idempotency_key: str | None
    priority: int


def _request_common(request: RequestCommon, *, reply: bool = True) -> _RequestFields:
    """The fields every request kind shares, to build one kind from another."""
    return _RequestFields(
        id=request.id,
        time=request.time,
        tenant=request.tenant,
        model=request.model,
        request_id=request.request_id,
        source=request.source,
        traceparent=request.traceparent,
        tracestate=request.tracestate,
        model_version=request.model_version,
        deadline=request.deadline,
        reply=request.reply if reply else None,
        idempotency_key=request.idempotency_key,
        priority=request.priority,
    )


class CancelRequested(Envelope, frozen=True, kw_only=True, tag="cancel_requested"):
    reason: Literal["client_disconnect", "client_cancel", "shutdown"]


# --- results ----------------------------------------------------------------------------------------------


class TokenChunk(Envelope, frozen=True, kw_only=True, tag="token_chunk"):
    seq: NonNegative
    """Chunk index within the request, from 0."""
    offset: NonNegative
    """Index of this chunk's first token within the completion."""
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None = None
    """Set only on a request's last chunk (the terminal event follows it)."""
    chars: NonNegative | None = None
    """Characters of the streamed text before this chunk's ``text``. A chunk's text need not be its tokens'
    (a streamed request holds back what may begin a stop string, or an unfinished character): a re-run's
    chunks are matched to what was delivered by it. None from a worker before it existed (then by tokens)."""


TokenCount = UInt32
"""Tokens of one request: the warehouse's ``UInt32`` columns hold them (a larger count would wrap there, and
its cost with it), so a record over it fails to decode and is dead-lettered."""


class Usage(FrozenStruct, frozen=True, kw_only=True):
    prompt_tokens: TokenCount
    completion_tokens: TokenCount
    total_tokens: TokenCount


class ErrorInfo(FrozenStruct, frozen=True, kw_only=True):
    code: Name
    message: str
    retriable: bool = False


CLIENT_ERROR_CODES: frozenset[str] = frozenset({"context_length_exceeded"})
"""The codes of a ``failed`` terminal event that are the client's error, not the service's: a request the
edge could not check fully (a worker serving less context than the manifest the edge checked the prompt
against). The edge answers them 4xx (``ingest.errors.from_finished``), and no availability SLI counts them:
the edge's metrics count them as refusals (``sluice_rejections_total``), and the warehouse's SLIs, burn
rates and rollout gates leave them out of both good and valid requests (``streams.queries``; the views of
migration 0007). A code added here needs a new migration of those views."""


class Timings(FrozenStruct, frozen=True, kw_only=True):
    accepted: UtcDatetime | None = None
    started: UtcDatetime | None = None
    first_token: UtcDatetime | None = None
    finished: UtcDatetime | None = None

    def __post_init__(self) -> None:
        for name in self.__struct_fields__:
            _require_utc(name, getattr(self, name))


FLOAT32_MAX = 3.4028234663852886e38
Float32 = Annotated[float, msgspec.Meta(ge=-FLOAT32_MAX, le=FLOAT32_MAX)]
"""A float the warehouse keeps as Float32: 1e300 decoded and was stored as inf (a review)."""

EMBEDDING_MAX_DIM = 4096
"""The most components a drift embedding (``DriftFeatures.embedding``) may have: MiniLM's is 384, and the
largest common sentence embedders' 4096. A review: without a bound, one 8 MiB terminal event carried 4M
components, and the drift monitor loads a window's embedding reservoir (up to 2,000 of them) as Python
lists: a few such rows took hundreds of MiB in the process that is also the sink and the audit chain. A
worker leaves out a longer embedding (:meth:`gpu_workers.features.FeatureProbe.features`); an event that
carries one anyway is refused at decoding (dead-lettered)."""


class DriftFeatures(FrozenStruct, frozen=True, kw_only=True):
    """What drift detection sees of one request: numbers and labels derived from the prompt and the output,
    never their text (see :mod:`schemas.features`). ``None`` means "not measured" (e.g. no prompt text
    because the client sent token ids, or an engine without log-probabilities); a rising share of ``None``
    is itself a data-quality signal."""

    prompt_chars: UInt32 | None = None
    prompt_script: str | None = None
    """Dominant writing system of the prompt's letters: latin, cyrillic, greek, arabic, hebrew, cjk, other;
    ``none`` for a prompt with no letters (:data:`schemas.features.NO_LETTERS`)."""
    prompt_language: str | None = None
    """A stop-word guess (en, de, fr, es, it, pt, nl) for latin-script text, else the script, or ``other``."""
    prompt_non_ascii: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] | None = None
    """Share of the prompt's letters outside ASCII."""
    output_chars: UInt32 | None = None
    output_script: str | None = None
    empty_output: bool | None = None
    refusal: bool | None = None
    mean_logprob: Annotated[float, msgspec.Meta(le=0.0)] | None = None
    """Mean log-probability of the generated tokens under the model (generation engines that expose it): at
    most 0. A positive value (a producer's bug) made its window a ``data_quality`` verdict, which outranks
    ``drift``; it is refused at decoding instead."""
    mean_entropy: Annotated[float, msgspec.Meta(ge=0.0)] | None = None
    """Mean entropy (nats) of the next-token distributions the generated tokens were drawn from."""
    embedding: Annotated[list[Float32], msgspec.Meta(max_length=EMBEDDING_MAX_DIM)] | None = None
    """A MiniLM sentence embedding of the prompt, for 1 in ``SLUICE_DRIFT_SAMPLE`` requests (at most
    :data:`EMBEDDING_MAX_DIM` components)."""


FLOAT32_BYTES = 4
_ALL_ONES_HIGH = bytes(1 if b & 0x7F == 0x7F else 0 for b in range(256))
_TOP_BIT = bytes(b >> 7 for b in range(256))


def _non_finite(data: bytes) -> bool:
    """Whether little-endian float32 ``data`` holds a NaN or an infinity: a value whose 8 exponent bits are
    all ones (the high byte's low 7 bits and the next byte's top bit). In C over the bytes: ~1.5 ms for
    2,048 vectors of 384 (no value as large as 2**127), where converting each to a float took 30."""
    high = data[3::FLOAT32_BYTES]
    if 0x7F not in high and 0xFF not in high:
        return False
    next_top = data[2::FLOAT32_BYTES].translate(_TOP_BIT)
    return bool(int.from_bytes(high.translate(_ALL_ONES_HIGH), "little") & int.from_bytes(next_top, "little"))


class Float32Vectors(FrozenStruct, frozen=True, kw_only=True):
    """Equal-length vectors packed as little-endian float32, row-major: ``len(data) // (4 * dim)`` rows.

    JSON carries ``data`` as base64 (msgspec encodes ``bytes`` so): 5.3 characters per float where a JSON
    number takes ~20, and a row is OpenAI's ``encoding_format="base64"`` embedding once base64-encoded
    alone. Pure Python (``array``), so the schemas need no numpy."""

    dim: Annotated[int, msgspec.Meta(ge=1)]
    data: bytes

    def __post_init__(self) -> None:
        if len(self.data) % (FLOAT32_BYTES * self.dim):
            raise ValueError(f"{len(self.data)} bytes are not whole rows of {self.dim} float32")
        if _non_finite(self.data):
            # A client must never get null for a number (JSON has no NaN): the worker checks its own
            # vectors, and a record from another producer with NaN or inf is dead-lettered (a review).
            raise ValueError("the vectors hold a NaN or an infinity")

    @classmethod
    def pack(cls, vectors: Iterable[Sequence[float]], dim: int) -> Float32Vectors:
        """Vectors of ``dim`` floats each, rounded to float32 (exact for values that are float32)."""
        values = array("f")
        for vector in vectors:
            if len(vector) != dim:
                raise ValueError(f"a vector of {len(vector)} floats among vectors of {dim}")
            values.extend(vector)
        if sys.byteorder != "little":
            values.byteswap()
        return cls(dim=dim, data=values.tobytes())

    def __len__(self) -> int:
        return len(self.data) // (FLOAT32_BYTES * self.dim)

    def rows(self) -> list[bytes]:
        """Each vector's little-endian float32 bytes (no conversion to floats)."""
        step = FLOAT32_BYTES * self.dim
        return [self.data[start : start + step] for start in range(0, len(self.data), step)]

    def tolist(self) -> list[list[float]]:
        values = array("f", self.data)
        if sys.byteorder != "little":
            values.byteswap()
        flat = values.tolist()
        return [flat[start : start + self.dim] for start in range(0, len(flat), self.dim)]


class RequestFinished(Envelope, frozen=True, kw_only=True, tag="request_finished"):
    """The one terminal event of every accepted request.

    An embedding result's vectors are in ``embeddings_f32`` (or, in events written before it existed,
    ``embeddings``): read them with :meth:`vectors` or :meth:`packed_vectors`, never a field directly."""

    status: Status
    finish_reason: FinishReason | None
    usage: Usage
    text: str | None = None
    embeddings: list[list[Float32]] | None = None
    """Vectors as JSON numbers, as workers wrote them before ``embeddings_f32`` (~4x larger): rows of one
    length, not empty (an empty or ragged row was a 500 for the client; a review)."""
    embeddings_f32: Float32Vectors | None = None
    """The vectors, packed: what workers write."""
    error: ErrorInfo | None = None
    timings: Timings = msgspec.field(default_factory=Timings)
    worker_id: Name = ""
    """Empty when no worker touched the request (e.g. expired at the edge)."""
    # What the request said, copied by the worker, so this one event is the request's whole fact row.
    # Bounded like the ids it copies: each is also a detail of the request's audit entry, and a foreign
    # producer's 7 MB ``worker_id`` made an entry no broker takes, which stopped the sink (a review).
    model_version: Name = ""
    kind: Literal["chat", "completion", "embedding", ""] = ""
    stream: bool = False
    edge_id: Name = ""
    """The edge that held the client (``reply.edge_id``); empty when nobody waited."""
    idempotency_key: Name | None = None
    max_inter_token_s: Annotated[float, msgspec.Meta(ge=0.0)] | None = None
    """Longest gap between two generated tokens (generation with 2+ tokens)."""
    features: DriftFeatures | None = None
    """Drift features of the request, set by the worker (absent in events from before drift detection)."""
    shadow_of: Name | None = None
    """Copied from a shadow request: the id of the request it mirrored (not billed, never answered)."""
    batch: BatchRef | None = None
    """Copied from a batch line (:class:`BatchItemRequested`): which batch and line this result answers."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.embeddings:
            dim = len(self.embeddings[0])
            if not dim or any(len(row) != dim for row in self.embeddings):
                raise ValueError("embeddings must be rows of one length, none empty")

    def failed_by_client(self) -> bool:
        """Whether the request failed with a client's error (:data:`CLIENT_ERROR_CODES`): a 4xx, in no
        availability SLI."""
        return self.status == "failed" and self.error is not None and self.error.code in CLIENT_ERROR_CODES

    def packed_vectors(self) -> Float32Vectors | None:
        """The result's vectors packed, whichever form the event carries (None: the result has none)."""
        if self.embeddings_f32 is not None or self.embeddings is None:
            return self.embeddings_f32
        return Float32Vectors.pack(self.embeddings, len(self.embeddings[0]) if self.embeddings else 1)

    def vectors(self) -> list[list[float]] | None:
        """The result's vectors as floats, whichever form the event carries (None: the result has none)."""
        if self.embeddings_f32 is not None:
            return self.embeddings_f32.tolist()
        return self.embeddings


class UsageRecorded(Envelope, frozen=True, kw_only=True, tag="usage_recorded"):
    """What one request is billed: the cost ledger's entry, on the ``usage`` topic for billing systems.

    The streams worker writes one per terminal result that is not a shadow copy (those are never billed),
    priced as its ``request_facts`` row is (a failure is billed nothing, a batch line at the batch price).
    Its id is derived from tenant and request id: a copy written again after a crash has the same id."""

    prompt_tokens: NonNegative
    completion_tokens: NonNegative
    worker_seconds: Annotated[float, msgspec.Meta(ge=0.0)]
    cost_micros: NonNegative
    """Integer micro-USD, rounded down (``cost_nanos`` is exact)."""
    price_version: str
    cost_nanos: NonNegative | None = None
    """Integer nano-USD, exact: ``request_facts.cost_nanos``, what the ledger's views sum. ``None`` in a
    record written before this field."""
    model_version: Name = ""
    status: Status | None = None
    """The request's terminal status (a failed one costs 0; its tokens are still counted)."""
    batch_id: Name | None = None
    """The batch a line belongs to (billed at the batch price), ``None`` for an interactive request."""


# --- batches ----------------------------------------------------------------------------------------------


BatchStatus = Literal[
    "validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling", "cancelled"
]
"""The OpenAI Batch API's statuses. Terminal: ``failed`` (validation), ``completed``, ``expired``,
``cancelled``."""
BATCH_TERMINAL: frozenset[str] = frozenset({"failed", "completed", "expired", "cancelled"})


class BatchCounts(FrozenStruct, frozen=True, kw_only=True):
    total: NonNegative = 0
    completed: NonNegative = 0
    failed: NonNegative = 0


class BatchLineError(FrozenStruct, frozen=True, kw_only=True):
    """Why a batch's input file was refused (one per bad line, up to a limit), as OpenAI's ``errors``."""

    code: str
    message: str
    line: Annotated[int, msgspec.Meta(ge=1)] | None = None
    param: str | None = None


class BatchStateChanged(Envelope, frozen=True, kw_only=True, tag="batch_state_changed"):
    """The whole state of one batch after a change (status, progress), keyed ``batch:<id>`` on the
    ``batches`` topic: the latest one is what the batch is. ``seq`` grows with every change of the batch, so
    the warehouse keeps the latest row and a re-published state replaces itself. ``model`` is the model its
    lines name (empty while validating)."""

    batch_id: str
    status: BatchStatus
    endpoint: Endpoint
    completion_window: str
    input_file_id: str
    edge_id: str
    """The edge that runs the batch (it publishes its lines and collects their results)."""
    seq: NonNegative = 0
    counts: BatchCounts = msgspec.field(default_factory=BatchCounts)
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: UtcDatetime
    expires_at: UtcDatetime
    in_progress_at: UtcDatetime | None = None
    finalizing_at: UtcDatetime | None = None
    completed_at: UtcDatetime | None = None
    failed_at: UtcDatetime | None = None
    expired_at: UtcDatetime | None = None
    cancelling_at: UtcDatetime | None = None
    cancelled_at: UtcDatetime | None = None
    errors: list[BatchLineError] = msgspec.field(default_factory=list)
    metadata: dict[str, str] = msgspec.field(default_factory=dict)
    output_expires_after_s: Annotated[int, msgspec.Meta(ge=3600, le=30 * 86400)] | None = None
    """Seconds after their creation the batch's output and error files expire (the create request's
    ``output_expires_after``); None: the files' default lifetime."""

    @property
    def terminal(self) -> bool:
        return self.status in BATCH_TERMINAL


# --- audit, control, drift, dead letters -----------------------------------------------------------------


class AuditEntry(Envelope, frozen=True, kw_only=True, tag="audit_entry"):
    """One link of a tenant's tamper-evident audit chain: ``entry_hash`` covers every other field and
    ``prev_hash`` is the tenant's previous entry's hash (64 zeros for the first, ``seq`` 0)."""

    actor: str
    action: str
    resource: str
    decision: str
    details: dict[str, str] = msgspec.field(default_factory=dict)
    prev_hash: str
    entry_hash: str
    seq: NonNegative = 0
    """Position in the tenant's chain, from 0."""
    model_version: str = ""


RolloutPhase = Literal["stable", "warming", "canary", "promoted", "rolled_back"]
"""``warming``: a rollout has started and the candidate's workers are loading; it has no traffic until one
of them says it is ready (``WorkerReady``), then the rollout moves to ``canary`` at its first step."""
GateState = Literal["pass", "fail", "insufficient_data", "not_applicable"]
"""``pass`` and ``fail``: the candidate is within the gate's limit or not (one ``fail`` rolls back).
``insufficient_data``: too few requests on either side (``min_requests``), or a metric one side has and the
other has not yet; it blocks the step without failing it. ``not_applicable``: a latency gate whose metric
neither version has at all although both have ``min_requests`` (an embeddings model has no inter-token
gap): the metric does not exist for this model, so the gate counts as passed (added after the first
rollouts: older readers of a ``DeploymentChanged`` whose evidence has it reject the event)."""


MAX_GATE_REQUESTS = 1_000_000
MAX_GATE_RATIO = 1000.0
MAX_GATE_SECONDS = 7 * 86_400.0
"""A rollout's gates are bounded, and so finite: an unbounded ``inf`` is written ``null`` in JSON, and a
decision carrying one was published (the CLI said "rollout started") but no consumer could decode it (an
audit)."""


class RolloutGates(FrozenStruct, frozen=True, kw_only=True):
    """What a candidate must show at each step, compared with the stable version over the same window."""

    min_requests: Annotated[int, msgspec.Meta(ge=1, le=MAX_GATE_REQUESTS)] = 50
    """Terminal requests per version in the step before any gate decides (``insufficient_data`` before)."""
    max_error_delta: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.05
    """The candidate's error ratio may exceed the stable version's by at most this."""
    max_ttft_p99_ratio: Annotated[float, msgspec.Meta(ge=1.0, le=MAX_GATE_RATIO)] = 1.5
    max_itl_p99_ratio: Annotated[float, msgspec.Meta(ge=1.0, le=MAX_GATE_RATIO)] = 1.5
    latency_slack_ms: Annotated[float, msgspec.Meta(ge=0.0, le=MAX_GATE_SECONDS * 1000)] = 25.0
    """Added to the latency limits, so a few ms of noise on a fast baseline is not a failure."""
    max_cost_ratio: Annotated[float, msgspec.Meta(ge=1.0, le=MAX_GATE_RATIO)] = 1.25
    """Cost per 1k tokens, candidate / stable."""
    drift: bool = True
    """The candidate's answers to its shadow copies differing from the stable version's answers to the
    originals (an embeddings model's vectors: ``min_cosine``) fails the gate (``streams.rollout_drift``; not
    applicable without shadow copies)."""
    burn: bool = True
    """A firing fast-burn ``BurnRateCrossed`` for the candidate fails the gate."""
    min_cosine: Annotated[float, msgspec.Meta(ge=-1.0, le=1.0)] = 0.99
    """An embeddings model's drift gate: the cosine between the candidate's vector and the stable version's
    for the same input (a shadow pair) that at least 95 % of the pairs reach."""
    step_min_s: Annotated[float, msgspec.Meta(ge=0.0, le=MAX_GATE_SECONDS)] = 0.0
    """Seconds each step lasts at least, however many requests it saw."""
    ready_timeout_s: Annotated[float, msgspec.Meta(gt=0.0, le=MAX_GATE_SECONDS)] = 600.0
    """Seconds a warming candidate may take to have a ready worker before the rollout is rolled back."""
    step_max_s: Annotated[float, msgspec.Meta(ge=0.0, le=MAX_GATE_SECONDS)] = 0.0
    """Seconds a step may wait for its gates' data (0: as long as it takes): a step still inconclusive
    then (a gate at ``insufficient_data``: too little traffic, shadow copies expiring on a saturated box) is
    rolled back, not left stalled for good. Added after the first rollouts: older readers ignore it."""


class GateResult(FrozenStruct, frozen=True, kw_only=True):
    """One gate's evidence at a decision: both sides' values, the limit, and the sample sizes."""

    gate: str
    """``error_ratio``, ``ttft_p99_ms``, ``itl_p99_ms``, ``cost_per_1k_tokens``, ``drift``, ``burn`` or
    ``serving``."""
    state: GateState
    candidate: float | None = None
    baseline: float | None = None
    limit: float | None = None
    candidate_n: NonNegative = 0
    baseline_n: NonNegative = 0
    detail: str = ""


class DeploymentChanged(Envelope, frozen=True, kw_only=True, tag="deployment_changed"):
    """The whole deployment of one model (key ``deployment:<model>`` on the compacted control topic): the
    latest one is the only truth of what serves. Edges route by ``traffic``, workers of every version in
    it run, and the rollout controller moves ``step`` and decides promotion or rollback."""

    version: str
    """The version this change is about (the candidate, or the version deployed)."""
    action: Literal["deploy", "promote", "rollback", "retire"]
    traffic: dict[Name, Share]
    """Model version -> share of traffic."""
    reason: str
    stable: str = ""
    """The version that takes what the candidate does not, and runs requests left by a version that
    stopped serving."""
    candidate: str | None = None
    """The version under rollout; None when none is."""
    phase: RolloutPhase = "stable"
    steps: list[Share] = msgspec.field(default_factory=list)
    """The candidate's share at each step, ending at 1.0."""
    step: Annotated[int, msgspec.Meta(ge=0, le=2**16 - 1)] = 0
    """An index into ``steps`` (the warehouse's ``UInt16``)."""
    step_started: UtcDatetime | None = None
    """When the current step began: gates compare requests accepted since then."""
    shadow: Share = 0.0
    """Share of the stable version's requests mirrored to the candidate (never answered, not billed)."""
    gates: RolloutGates | None = None
    evidence: list[GateResult] = msgspec.field(default_factory=list)
    """The gate values behind this decision."""
    actor: str = ""
    """``operator`` (the CLI) or ``controller`` (streams)."""
    rollout_id: str = ""

    def __post_init__(self) -> None:
        super().__post_init__()
        _require_utc("step_started", self.step_started)


class BudgetStateChanged(Envelope, frozen=True, kw_only=True, tag="budget_state_changed"):
    limit_micros: NonNegative
    spent_micros: NonNegative
    exhausted: bool


class BurnRateCrossed(Envelope, frozen=True, kw_only=True, tag="burn_rate_crossed"):
    slo: str
    window: str
    burn_rate: float
    threshold: float
    firing: bool


class WorkersScaled(Envelope, frozen=True, kw_only=True, tag="workers_scaled"):
    """An autoscaler's decision on how many workers serve one model version (key ``scale:<model>`` on the
    compacted control topic: the latest is the fleet's target). Published when the target changes, with
    the signals behind it; the streams worker writes it to the audit chain ``admin:scale:<model>``."""

    version: str
    replicas: NonNegative
    """Workers wanted from now on."""
    previous: NonNegative
    """Workers wanted before this decision."""
    reason: str
    """Why, in words (e.g. ``lag 412 over 2 workers x 50``)."""
    lag: NonNegative = 0
    """Requests waiting on the model's request topic for its worker group when it decided."""
    target_lag: NonNegative = 0
    """Waiting requests one worker is sized for."""
    bounds: tuple[NonNegative, NonNegative] = (0, 0)
    """(min, max) workers the autoscaler may choose between."""
    actor: str = ""


class DriftRebaselined(Envelope, frozen=True, kw_only=True, tag="drift_rebaselined"):
    """An operator accepted a shift in one model version's traffic as its new normal (``sluice drift
    rebaseline``; key ``rebaseline:<model>:<version>`` on the compacted control topic: the latest is what
    holds). The drift monitor drops every reference of that version (all tenants and each tenant's) taken
    before ``time``; the first window after becomes the reference. Audited in ``admin:<key>``."""

    version: str
    reason: str
    """Why, in the operator's words (e.g. ``new tenant onboarded: French prompts are expected``)."""
    actor: str = ""


class PricesChanged(Envelope, frozen=True, kw_only=True, tag="prices_changed"):
    """A price table in force from ``effective`` on (key ``prices:<version>`` on the compacted control
    topic: every version ever published stays, so the log holds the whole price history). A request is
    priced by the table in force when it was accepted, live and in ``sluice replay`` alike. The streams
    worker publishes its price file's table when the log does not hold that version yet; a version is
    never changed once published. Audited in ``admin:<key>``."""

    prices: PriceTable
    effective: UtcDatetime
    """Requests accepted from this moment on are priced by ``prices`` (until a later table's)."""
    actor: str = ""

    def __post_init__(self) -> None:
        super().__post_init__()
        _require_utc("effective", self.effective)


class WorkerReady(Envelope, frozen=True, kw_only=True, tag="worker_ready"):
    """A worker of one model version has loaded its model and owns request partitions: it can serve now
    (key ``ready:<model>:<version>`` on the compacted control topic). A worker says so when it first
    becomes ready, and again for every rollout that starts warming its version, so the rollout controller
    gives a candidate traffic only once something can serve it."""

    version: str
    worker: str
    """The worker's id (``SLUICE_WORKER_ID``)."""
    deployment: str = ""
    """The id of the model's latest ``DeploymentChanged`` this worker had read ("" before any)."""
    error: str = ""
    """Not ready, ever: why this worker could not load the version (its files are missing, cut short or
    not a model this platform serves), said before it exits. A rollout warming the version is rolled back
    at once with it, where it waited for its ready timeout while the worker restarted and failed again
    (an operator audit)."""


DriftVerdict = Literal["reference", "no_drift", "drift", "insufficient_data", "data_quality"]
"""``reference``: this window became the baseline later windows are compared with; ``insufficient_data``:
too few requests in either window to decide (never an alarm); ``data_quality``: features went missing or
out of range (the feature pipeline, not the traffic, changed)."""


class FeatureDrift(FrozenStruct, frozen=True, kw_only=True):
    """One feature's test in a drift report."""

    name: str
    kind: Literal["numerical", "categorical", "embedding"]
    method: str
    """The statistical test, e.g. ``ks``, ``chisquare``, ``z``, ``mmd``."""
    statistic: float
    """What the test compares with ``threshold``: a p-value for p-value tests (drift when below), a
    distance for distance tests (drift when above)."""
    threshold: float
    p_value: float | None = None
    drifted: bool
    null_share: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.0
    """Share of the current window's requests where the feature was not measured."""
    reference_null_share: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.0


class DriftReport(Envelope, frozen=True, kw_only=True, tag="drift_report"):
    """A drift verdict for one window of one model version, for all tenants (``tenant`` is ``*``) or one.

    The first six fields are v1's; the rest were added with defaults, so v1 readers still decode it."""

    window_start: UtcDatetime
    window_end: UtcDatetime
    drifted: bool
    share_drifted: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
    feature_scores: dict[str, float]
    method: str
    model_version: str = ""
    verdict: DriftVerdict | None = None
    """None in v1 events: read :attr:`effective_verdict`."""
    reference_start: UtcDatetime | None = None
    reference_end: UtcDatetime | None = None
    requests: NonNegative = 0
    """Terminal events in the current window (before sampling)."""
    n_reference: UInt32 = 0
    n_current: UInt32 = 0
    """Rows each window's sample held (bounded by the reservoir size)."""
    alpha: float | None = None
    """Family-wise false-alarm rate per window; each of the m features is tested at alpha / m."""
    features: list[FeatureDrift] = msgspec.field(default_factory=list)
    quality: list[str] = msgspec.field(default_factory=list)
    """Data-quality findings, e.g. ``embedding: not sampled (0 of 412 requests; reference 5.1%)``."""

    def __post_init__(self) -> None:
        super().__post_init__()
        _require_utc("window_start", self.window_start)
        _require_utc("window_end", self.window_end)
        _require_utc("reference_start", self.reference_start)
        _require_utc("reference_end", self.reference_end)

    @property
    def effective_verdict(self) -> DriftVerdict:
        if self.verdict is not None:
            return self.verdict
        return "drift" if self.drifted else "no_drift"


class DeadLetter(Envelope, frozen=True, kw_only=True, tag="dead_letter"):
    """A record a consumer could not handle, kept whole (value in base64) for inspection or replay."""

    source_topic: str
    partition: NonNegative
    offset: NonNegative
    reason: str
    payload_b64: str
    headers: dict[str, str] = msgspec.field(default_factory=dict)


Event: TypeAlias = (
    GenerationRequested
    | EmbeddingRequested
    | BatchItemRequested
    | CancelRequested
    | TokenChunk
    | RequestFinished
    | UsageRecorded
    | AuditEntry
    | DeploymentChanged
    | BudgetStateChanged
    | BurnRateCrossed
    | DriftReport
    | DeadLetter
    | BatchStateChanged
    | WorkersScaled
    | WorkerReady
    | DriftRebaselined
    | PricesChanged
)

EVENT_TYPES: tuple[type[Envelope], ...] = (
    GenerationRequested,
    EmbeddingRequested,
    BatchItemRequested,
    CancelRequested,
    TokenChunk,
    RequestFinished,
    UsageRecorded,
    AuditEntry,
    DeploymentChanged,
    BudgetStateChanged,
    BurnRateCrossed,
    DriftReport,
    DeadLetter,
    BatchStateChanged,
    WorkersScaled,
    WorkerReady,
    DriftRebaselined,
    PricesChanged,
)

REQUEST_TYPES: tuple[type[RequestCommon], ...] = (GenerationRequested, EmbeddingRequested, BatchItemRequested)


def event_type_name(cls: type[Envelope]) -> str:
    """The ``type`` tag of an event class (``"token_chunk"`` for :class:`TokenChunk`)."""
    tag = cls.__struct_config__.tag
    if not isinstance(tag, str) or cls not in EVENT_TYPES:
        raise TypeError(f"{cls.__name__} is not an event type")
    return tag
