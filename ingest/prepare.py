"""From a raw request body to a validated, tokenised request event: all the edge's CPU work, done before
anything is published. Every failure is an :class:`~ingest.errors.IngestError` (4xx); nothing here talks to
the gateway. Shared by the HTTP routes and the WebSocket.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Literal

import msgspec

from ingest.auth import Tenant
from ingest.errors import CatalogueError, InvalidRequest, ModelNotFound, PayloadTooLarge, Unavailable
from ingest.models import ModelCatalogue, ServedModel
from ingest.openai import (
    MIN_TIMEOUT_S,
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    PromptInput,
    decode_body,
)
from ingest.settings import EdgeSettings
from schemas.codec import MAX_RECORD_BYTES, RECORD_HEADROOM_BYTES, encode, fits_record, headers, kafka_key
from schemas.deployments import Deployment, sticky_key
from schemas.events import (
    FLOAT32_BYTES,
    EmbeddingRequested,
    Endpoint,
    GenerationRequested,
    ReplyTo,
    SamplingParams,
    utc_now,
)
from schemas.ids import derive_seed, uuid7, uuid7_unix_ms
from schemas.manifest import ModelManifest

Kind = Literal["chat", "completion", "embedding"]
ENDPOINTS: dict[Kind, Endpoint] = {
    "chat": "/v1/chat/completions",
    "completion": "/v1/completions",
    "embedding": "/v1/embeddings",
}
MAX_EMBEDDING_INPUTS = 2048
SHADOW_PRIORITY = 1000
"""Shadow copies wait behind every other request on the candidate's workers (lower runs first)."""
RESULT_ENVELOPE_BYTES = 16_384
"""Room in a terminal event for everything but its vectors (ids, usage, timings, features)."""


def embedding_inputs_that_fit(dim: int | None) -> int:
    """How many ``dim``-dimensional vectors a terminal event can carry within one log record: packed as
    float32 (``RequestFinished.embeddings_f32``), base64 between quotes, 4 characters per 3 bytes."""
    if not dim:
        return MAX_EMBEDDING_INPUTS
    base64_chars = MAX_RECORD_BYTES - RESULT_ENVELOPE_BYTES - 2
    return max(1, base64_chars // 4 * 3 // (dim * FLOAT32_BYTES))


# Bodies bigger than this are tokenised in a worker thread, off the event loop.
_INLINE_TOKENISE_BYTES = 64 * 1024
_CHECK_RECORD_BYTES = MAX_RECORD_BYTES // 8
"""Bodies bigger than this have their request event's size checked before anything is published: the event
carries the text and its token ids (a token id is a few characters for as few as one of text), so one
under this is always far inside a record, and the check costs an encode only where it can fail."""
_INPUT_PARAM: dict[Kind, str] = {"embedding": "input", "chat": "messages", "completion": "prompt"}


@dataclass(frozen=True)
class Shape:
    """How to render a request's replies for the client."""

    kind: Kind
    model: str
    request_id: str
    fingerprint: str
    stream: bool = False
    include_usage: bool = False
    encoding_format: str = "float"

    @property
    def created(self) -> int:
        return uuid7_unix_ms(self.request_id) // 1000


@dataclass(frozen=True)
class Prepared:
    event: GenerationRequested | EmbeddingRequested
    shape: Shape
    timeout_s: float
    """Seconds from now to the event's deadline (for the edge's own wait)."""
    body_hash: str
    shadow: GenerationRequested | EmbeddingRequested | None = None
    """A copy for the candidate version, published after the request and never answered."""


def body_hash(kind: Kind, raw: bytes) -> str:
    """sha256 hex of the endpoint and the body's canonical JSON (keys sorted, no whitespace)."""
    canonical = msgspec.json.encode(
        {"endpoint": ENDPOINTS[kind], "body": msgspec.json.decode(raw)}, order="sorted"
    )
    return hashlib.sha256(canonical).hexdigest()


def parse_timeout(header: str | None) -> float | None:
    if header is None:
        return None
    try:
        value = float(header)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= MIN_TIMEOUT_S):
        raise InvalidRequest(
            f"X-Request-Timeout must be a number of seconds from {MIN_TIMEOUT_S:g}.",
            param="X-Request-Timeout",
        )
    return value


ENCODING_FORMATS = ("float", "base64")


def parse_encoding_format(value: str | None) -> str | None:
    """A resume's ``encoding_format`` query parameter (``GET /v1/streams/{id}``), as the embeddings body's."""
    if value is None or value in ENCODING_FORMATS:
        return value
    raise InvalidRequest("encoding_format must be 'float' or 'base64'.", param="encoding_format")


def _split_input(value: PromptInput, param: str) -> tuple[list[str], list[list[int]]]:
    """(texts, token lists): exactly one of them is non-empty."""
    if isinstance(value, str):
        return [value], []
    if not value:
        raise InvalidRequest(f"'{param}' must not be empty.", param=param)
    if all(isinstance(item, str) for item in value):
        return [item for item in value if isinstance(item, str)], []
    if all(isinstance(item, int) for item in value):
        return [], [[item for item in value if isinstance(item, int)]]
    if all(isinstance(item, list) for item in value):
        return [], [item for item in value if isinstance(item, list)]
    raise InvalidRequest(
        f"'{param}' must be a string, a list of strings, a list of token ids or a list of token id lists.",
        param=param,
    )


def _default_max_tokens(manifest: ModelManifest, tenant: Tenant, model_id: str, prompt_tokens: int) -> int:
    """``max_tokens`` for a request that names none (the caller bounds it by the room left in the context):
    the manifest's default, or where it has none (a linked model) the model's output limit, lowered to what
    the tenant's token limits can ever admit after the prompt, so that a request naming no ``max_tokens``
    is never refused as ``tokens_exceed_limit`` (a request reserves prompt + ``max_tokens``)."""
    if manifest.sampling.max_tokens is not None:
        return manifest.sampling.max_tokens
    tokens = manifest.max_output_tokens
    for _, limits in tenant.checks(model_id):
        if limits.tokens_per_min is not None:
            tokens = min(tokens, max(1, limits.tokens_per_min - prompt_tokens))
    return tokens


class Preparer:
    def __init__(
        self,
        catalogue: ModelCatalogue,
        settings: EdgeSettings,
        reply_to: ReplyTo,
        *,
        clock: Callable[[], datetime] = utc_now,
        deployments: Callable[[str], Deployment | None] = lambda _model: None,
    ) -> None:
        self._deployments = deployments
        self._catalogue = catalogue
        self._settings = settings
        self._reply_to = reply_to
        self._clock = clock
        self._source = f"ingest/{settings.edge_id}"

    async def prepare(
        self,
        kind: Kind,
        raw: bytes,
        *,
        tenant: Tenant,
        timeout_header: str | None = None,
        idempotency_key: str | None = None,
        session: str | None = None,
        streamed: bool = False,
    ) -> Prepared:
        if len(raw) > _INLINE_TOKENISE_BYTES:
            return await asyncio.to_thread(
                self.prepare_sync, kind, raw, tenant, timeout_header, idempotency_key, session, streamed
            )
        return self.prepare_sync(kind, raw, tenant, timeout_header, idempotency_key, session, streamed)

    def prepare_sync(
        self,
        kind: Kind,
        raw: bytes,
        tenant: Tenant,
        timeout_header: str | None,
        idempotency_key: str | None,
        session: str | None = None,
        streamed: bool = False,
    ) -> Prepared:
        """``session`` (``X-Session-Id``, else the body's ``user``) keeps a conversation on one version.
        ``streamed``: a generation is streamed whatever its body says (a WebSocket's always are: its frames
        are tokens). Audits: a WebSocket request without ``"stream": true`` was published not streamed, its
        worker sent no token and the ``done`` frame carried no text; with ``stream_options`` and no
        ``stream`` it was refused, as an HTTP body without ``stream`` is."""
        header_timeout = parse_timeout(timeout_header)
        built: tuple[GenerationRequested | EmbeddingRequested, Shape, float]
        if kind == "embedding":
            body = decode_body(raw, EmbeddingRequest)
            key = sticky_key(tenant.name, session or body.user)
            built = self._embedding(body, tenant, header_timeout, idempotency_key, key)
        else:
            generation: ChatCompletionRequest | CompletionRequest = (
                decode_body(raw, ChatCompletionRequest)
                if kind == "chat"
                else decode_body(raw, CompletionRequest)
            )
            if streamed and not generation.stream:
                generation = msgspec.structs.replace(generation, stream=True)
            key = sticky_key(tenant.name, session or generation.user)
            built = self._generation(kind, generation, tenant, header_timeout, idempotency_key, key)
        digest = body_hash(kind, raw) if idempotency_key is not None else ""
        event = built[0]
        if len(raw) > _CHECK_RECORD_BYTES:
            value = encode(event)
            if not fits_record(value, kafka_key(event), headers(event)):
                raise PayloadTooLarge(
                    f"This request is {len(value):,} bytes as an event on the log (its text and token ids), over the "
                    f"{MAX_RECORD_BYTES - RECORD_HEADROOM_BYTES:,} bytes one record holds; send fewer or shorter "
                    "inputs per request.",
                    param=_INPUT_PARAM[kind],
                )
        return Prepared(
            event=event, shape=built[1], timeout_s=built[2], body_hash=digest, shadow=self._shadow(event, key)
        )

    def _shadow(
        self, event: GenerationRequested | EmbeddingRequested, key: str
    ) -> GenerationRequested | EmbeddingRequested | None:
        """The shadow copy of ``event`` for the candidate, when this key is mirrored: its own id, no reply
        (no client sees it), the lowest priority, no idempotency key, ``shadow_of`` naming the original."""
        deployment = self._deployments(event.model)
        target = deployment.shadow_to(key) if deployment is not None else None
        if target is None:
            return None
        return msgspec.structs.replace(
            event,
            id=uuid7(),
            request_id=uuid7(),
            model_version=target,
            reply=None,
            priority=SHADOW_PRIORITY,
            idempotency_key=None,
            shadow_of=event.request_id,
        )

    def _model(self, name: str, tenant: Tenant, task: str, key: str = "") -> ServedModel:
        """The model ``name`` at the version its deployment routes ``key`` to."""
        if not tenant.may_use(name):
            raise ModelNotFound(
                f"The model '{name}' does not exist or you do not have access to it.", param="model"
            )
        model = self._catalogue.get(name)
        deployment = self._deployments(name)
        if deployment is not None:
            try:
                model = self._catalogue.version(name, deployment.route(key))
            except CatalogueError as exc:
                raise Unavailable(
                    f"The model '{name}' is being redeployed and its new version is not loaded on this edge "
                    "yet; retry shortly.",
                ) from exc
        if model.manifest.task != task:
            article = "an" if model.manifest.task[0] in "aeiou" else "a"  # "a embedding model": a review
            raise InvalidRequest(
                f"The model '{name}' is {article} {model.manifest.task} model and cannot serve this endpoint.",
                param="model",
                code="unsupported_model_task",
            )
        return model

    def timeout(self, body_timeout: float | None, header: str | None) -> float:
        """Seconds a request may take: the smaller of body and header, else the default; at most the max."""
        return self._deadline(body_timeout, parse_timeout(header))[1]

    def resume_timeout(self, asked: float | None, left: float | None) -> float:
        """Seconds a resume reads for: the smaller of what its reader asked (``X-Request-Timeout``, a
        WebSocket ``resume`` frame's ``timeout``) and what is left of its request's own deadline where this
        edge knows it (a resume that took the request back, :meth:`ingest.admission.Flight.time_left`),
        else the default; at most the max. A review: a WebSocket resume always read for the default, cut
        (and a request taken back cancelled) though the request's own deadline was far."""
        return self._deadline(asked, left)[1]

    def _deadline(self, body_timeout: float | None, header_timeout: float | None) -> tuple[datetime, float]:
        given = [t for t in (body_timeout, header_timeout) if t is not None]
        timeout = min(given) if given else self._settings.edge_default_timeout_s
        timeout = min(timeout, self._settings.edge_max_timeout_s)
        return self._clock() + timedelta(seconds=timeout), timeout

    def _generation(
        self,
        kind: Kind,
        body: ChatCompletionRequest | CompletionRequest,
        tenant: Tenant,
        header_timeout: float | None,
        idempotency_key: str | None,
        key: str = "",
    ) -> tuple[GenerationRequested, Shape, float]:
        body.check_unsupported()
        if body.ignore_eos and not tenant.allow_ignore_eos:
            raise InvalidRequest(
                f"ignore_eos is not enabled for tenant {tenant.name} (allow_ignore_eos in the tenants file).",
                param="ignore_eos",
                code="ignore_eos_not_allowed",
            )
        model = self._model(body.model, tenant, "generation", key)
        manifest = model.manifest
        if isinstance(body, ChatCompletionRequest):
            param = "messages"
            chat_text, input_ids = model.encode_chat(
                [(model.chat_role(m.role), m.text) for m in body.messages], param
            )
            prompt: str | None = chat_text
            requested = body.max_completion_tokens or body.max_tokens
        else:
            param = "prompt"
            texts, token_lists = _split_input(body.prompt, param)
            if len(texts) + len(token_lists) != 1:
                raise InvalidRequest(
                    "Only one prompt per request is supported.", param=param, code="unsupported_parameter"
                )
            if texts:
                prompt, input_ids = texts[0], model.encode(texts, param)[0]
            else:
                prompt, input_ids = None, token_lists[0]
                model.check_ids(input_ids, param)
            requested = body.max_tokens
        if not input_ids:
            raise InvalidRequest("The prompt must not be empty.", param=param)
        model.check_context(len(input_ids), param, reserve=1)
        max_tokens = min(
            requested or _default_max_tokens(manifest, tenant, model.model_id, len(input_ids)),
            manifest.max_output_tokens,
            manifest.max_context - len(input_ids),
        )
        request_id = uuid7()
        deadline, timeout = self._deadline(body.timeout, header_timeout)
        sampling = SamplingParams(
            max_tokens=max_tokens,
            temperature=body.temperature if body.temperature is not None else manifest.sampling.temperature,
            top_p=body.top_p if body.top_p is not None else manifest.sampling.top_p,
            top_k=body.top_k if body.top_k is not None else manifest.sampling.top_k,
            stop=body.stop_words,
            seed=body.seed if body.seed is not None else derive_seed(request_id),
            ignore_eos=body.ignore_eos,
        )
        event = GenerationRequested(
            tenant=tenant.name,
            model=model.model_id,
            request_id=request_id,
            source=self._source,
            model_version=manifest.version,
            deadline=deadline,
            reply=self._reply_to,
            idempotency_key=idempotency_key,
            input_ids=input_ids,
            prompt=prompt,
            sampling=sampling,
            stream=body.streams,
            chat=kind == "chat",
        )
        shape = Shape(
            kind=kind,
            model=model.model_id,
            request_id=request_id,
            fingerprint=manifest.version,
            stream=body.streams,
            include_usage=body.include_usage,
        )
        return event, shape, timeout

    def _embedding(
        self,
        body: EmbeddingRequest,
        tenant: Tenant,
        header_timeout: float | None,
        idempotency_key: str | None,
        key: str = "",
    ) -> tuple[EmbeddingRequested, Shape, float]:
        model = self._model(body.model, tenant, "embedding", key)
        if body.dimensions is not None and body.dimensions != model.manifest.embedding_dim:
            raise InvalidRequest(
                f"This model only produces {model.manifest.embedding_dim}-dimensional embeddings.",
                param="dimensions",
                code="unsupported_parameter",
            )
        texts, inputs = _split_input(body.input, "input")
        if len(texts) + len(inputs) > MAX_EMBEDDING_INPUTS:
            raise InvalidRequest(f"At most {MAX_EMBEDDING_INPUTS} inputs per request.", param="input")
        fit = embedding_inputs_that_fit(model.manifest.embedding_dim)
        if len(texts) + len(inputs) > fit:
            raise InvalidRequest(
                f"At most {fit} inputs per request for {model.model_id}: the result, {fit} vectors of "
                f"{model.manifest.embedding_dim} float32, must fit one {MAX_RECORD_BYTES:,}-byte record "
                "of the event log. Split the inputs over several requests.",
                param="input",
            )
        if any(not text for text in texts) or any(not ids for ids in inputs):
            raise InvalidRequest("Inputs must not be empty.", param="input")
        if texts:
            inputs = model.encode(texts, "input")
        for ids in inputs:
            model.check_ids(ids, "input")
            model.check_context(len(ids), "input")
        request_id = uuid7()
        deadline, timeout = self._deadline(body.timeout, header_timeout)
        event = EmbeddingRequested(
            tenant=tenant.name,
            model=model.model_id,
            request_id=request_id,
            source=self._source,
            model_version=model.manifest.version,
            deadline=deadline,
            reply=self._reply_to,
            idempotency_key=idempotency_key,
            inputs=inputs,
            texts=texts or None,
        )
        shape = Shape(
            kind="embedding",
            model=model.model_id,
            request_id=request_id,
            fingerprint=model.manifest.version,
            encoding_format=body.encoding_format or "float",
        )
        return event, shape, timeout
