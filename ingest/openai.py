"""OpenAI-compatible request bodies (strict msgspec structs) and response/chunk builders in OpenAI's shapes.

Requests: unknown fields, wrong types and out-of-range values are 400s naming the ``param``. Parameters we
accept for compatibility but do not implement must keep their no-op value (``n=1``, penalties 0, …).
Extension fields: ``top_k`` and ``timeout`` (seconds; see ``X-Request-Timeout``).
"""

from __future__ import annotations

import base64
import re
from collections.abc import Iterator
from typing import Annotated, Any, Literal, TypeVar

import msgspec

from ingest.errors import InvalidRequest
from schemas.codec import UNREADABLE_JSON, unreadable_json
from schemas.events import FLOAT32_BYTES, MAX_STOPS, FinishReason, Float32Vectors, StopString, Usage

T = TypeVar("T")

MaxTokens = Annotated[int, msgspec.Meta(ge=1, le=1_000_000)]
Temperature = Annotated[float, msgspec.Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, msgspec.Meta(gt=0.0, le=1.0)]
Penalty = Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)]
Seed = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]
MIN_TIMEOUT_S = 0.001
"""The shortest deadline a request may ask for: one that has passed before its event is written was
published, answered 504 and cancelled (an audit)."""
Timeout = Annotated[float, msgspec.Meta(ge=MIN_TIMEOUT_S, le=86_400.0)]
StopWords = Annotated[list[StopString], msgspec.Meta(max_length=MAX_STOPS)]
# Token-or-text inputs: str | list[str] | list[int] | list[list[int]]; mixing is rejected after decoding.
PromptInput = str | list[str | int | list[int]]


class _Strict(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    pass


class StreamOptions(_Strict, kw_only=True, forbid_unknown_fields=True, frozen=True):
    include_usage: bool = False


class ResponseFormat(msgspec.Struct, kw_only=True, frozen=True):
    """OpenAI's ``response_format``: only ``{"type": "text"}`` (its default) is served; the rest of a
    structured-output format is not read, since asking for one is refused."""

    type: str


class TextPart(_Strict, kw_only=True, forbid_unknown_fields=True, frozen=True):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict, kw_only=True, forbid_unknown_fields=True, frozen=True):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | Annotated[list[TextPart], msgspec.Meta(min_length=1)]
    """Text, or its parts: at least one (OpenAI refuses an empty list; it was published as an empty turn),
    joined by a newline as vLLM joins them (they were glued together: ``Hello`` ``world`` read ``Helloworld``)."""
    name: str | None = None
    refusal: str | None = None
    """What an answer gives back (``"refusal": null``): the SDK's ``messages.append(choice.message)`` sends
    it with the next turn, which was a 400 (a review). A refusal the model wrote is not part of the prompt."""

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)


class _GenerationBody(_Strict, kw_only=True, forbid_unknown_fields=True, frozen=True):
    model: str
    max_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)] | None = None
    n: Annotated[int, msgspec.Meta(ge=1, le=128)] | None = None
    stream: bool | None = None
    """``null`` is ``false``, as OpenAI documents it ("boolean or null"): read it through :attr:`streams`."""
    stream_options: StreamOptions | None = None
    stop: StopString | StopWords | None = None
    seed: Seed | None = None
    ignore_eos: bool = False
    """vLLM's extension: keep generating past the end-of-sequence token (benchmarks, load tests)."""
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    user: str | None = None
    timeout: Timeout | None = None
    logit_bias: dict[str, Annotated[float, msgspec.Meta(ge=-100.0, le=100.0)]] | None = None
    """Accepted empty or ``null`` (what the SDK sends for a wrapper's ``logit_bias=None``; a review found
    it a 400 on every call); a bias is refused."""

    def check_unsupported(self) -> None:
        if self.n not in (None, 1):
            raise InvalidRequest("Only n=1 is supported.", param="n", code="unsupported_parameter")
        if self.logit_bias:
            raise InvalidRequest(
                "logit_bias is not supported.", param="logit_bias", code="unsupported_parameter"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0.0):
                raise InvalidRequest(f"{name} is not supported.", param=name, code="unsupported_parameter")
        if self.stream_options is not None and not self.streams:
            raise InvalidRequest(
                "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
                param="stream_options",
            )

    @property
    def stop_words(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def streams(self) -> bool:
        return bool(self.stream)


class ChatCompletionRequest(_GenerationBody, kw_only=True, forbid_unknown_fields=True, frozen=True):
    messages: Annotated[list[ChatMessage], msgspec.Meta(min_length=1)]
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, msgspec.Meta(ge=0, le=20)] | None = None
    response_format: ResponseFormat | None = None
    store: bool | None = None
    """Whether OpenAI keeps the completion for its own tools: nothing to do here (every request is on the
    log and in the audit trail either way)."""
    metadata: (
        Annotated[dict[str, Annotated[str, msgspec.Meta(max_length=512)]], msgspec.Meta(max_length=16)] | None
    ) = None
    """Tags OpenAI stores with a completion (``store``): accepted and not kept."""
    service_tier: Literal["auto", "default"] | None = None
    """The tiers that change nothing here; ``flex`` or ``priority`` (other prices and latencies) are 400s."""

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.logprobs:
            raise InvalidRequest(
                "logprobs are not supported.", param="logprobs", code="unsupported_parameter"
            )
        if self.top_logprobs:
            raise InvalidRequest(
                "top_logprobs is not supported.", param="top_logprobs", code="unsupported_parameter"
            )
        if self.response_format is not None and self.response_format.type != "text":
            raise InvalidRequest(
                f"response_format {self.response_format.type!r} is not supported; only 'text' is.",
                param="response_format",
                code="unsupported_parameter",
            )


class CompletionRequest(_GenerationBody, kw_only=True, forbid_unknown_fields=True, frozen=True):
    prompt: PromptInput
    echo: bool | None = None
    best_of: Annotated[int, msgspec.Meta(ge=1)] | None = None
    logprobs: Annotated[int, msgspec.Meta(ge=0, le=5)] | None = None
    suffix: str | None = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        for name, off in (("echo", False), ("best_of", 1), ("logprobs", None), ("suffix", None)):
            value = getattr(self, name)
            if value is not None and value != off:  # null is the default, as OpenAI documents it
                raise InvalidRequest(f"{name} is not supported.", param=name, code="unsupported_parameter")


class EmbeddingRequest(_Strict, kw_only=True, forbid_unknown_fields=True, frozen=True):
    model: str
    input: PromptInput
    encoding_format: Literal["float", "base64"] | None = None
    """None (an explicit null, as LiteLLM sends one when its caller set none): ``"float"``, as OpenAI."""
    dimensions: Annotated[int, msgspec.Meta(ge=1)] | None = None
    user: str | None = None
    timeout: Timeout | None = None


_AT = re.compile(r"^(?P<what>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.DOTALL)
_FIELD = re.compile(r"(?:missing required|contains unknown) field `(?P<field>[^`]+)`")


def error_param(message: str) -> str | None:
    """The field a msgspec validation message names (``seed``, ``messages[0].role``), if any."""
    match = _AT.match(message)
    path = (match.group("path") if match else "") or ""
    field = _FIELD.search(message)
    if field:
        path = f"{path}.{field.group('field')}"
    return path.lstrip(".") or None


def decode_body(raw: bytes, cls: type[T]) -> T:
    """The request body as ``cls``, or :class:`InvalidRequest` (malformed JSON, or the failing ``param``)."""
    try:
        return msgspec.json.decode(raw, type=cls)
    except msgspec.ValidationError as exc:
        raise InvalidRequest(
            f"Invalid request body: {exc}", param=error_param(str(exc)), code="invalid_value"
        ) from exc
    except UNREADABLE_JSON as exc:
        raise InvalidRequest(
            f"We could not parse the JSON body of your request: {unreadable_json(exc, raw)}",
            code="invalid_json",
        ) from exc


# --- responses --------------------------------------------------------------------------------------------

Body = dict[str, Any]


def finish_reason(reason: FinishReason | None) -> Literal["stop", "length"]:
    return "length" if reason == "length" else "stop"


def usage_body(usage: Usage) -> Body:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
    }


def chat_completion(
    request_id: str,
    model: str,
    created: int,
    fingerprint: str,
    text: str,
    reason: FinishReason | None,
    usage: Usage,
) -> Body:
    return {
        "id": f"chatcmpl-{request_id}",
        "object": "chat.completion",
        "created": created,
        "model": model,
        "system_fingerprint": fingerprint,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text, "refusal": None},
                "logprobs": None,
                "finish_reason": finish_reason(reason),
            }
        ],
        "usage": usage_body(usage),
    }


def chat_chunk(
    request_id: str,
    model: str,
    created: int,
    fingerprint: str,
    *,
    delta: Body | None,
    reason: FinishReason | None = None,
    with_usage: bool = False,
    usage: Usage | None = None,
) -> Body:
    """One ``chat.completion.chunk``; ``delta=None`` with ``usage`` is the final usage-only chunk."""
    choices: list[Body] = []
    if delta is not None:
        choices.append(
            {
                "index": 0,
                "delta": delta,
                "logprobs": None,
                "finish_reason": finish_reason(reason) if reason is not None else None,
            }
        )
    body: Body = {
        "id": f"chatcmpl-{request_id}",
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "system_fingerprint": fingerprint,
        "choices": choices,
    }
    if with_usage:
        body["usage"] = usage_body(usage) if usage is not None else None
    return body


def completion(
    request_id: str,
    model: str,
    created: int,
    fingerprint: str,
    text: str,
    reason: FinishReason | None,
    usage: Usage,
) -> Body:
    return {
        "id": f"cmpl-{request_id}",
        "object": "text_completion",
        "created": created,
        "model": model,
        "system_fingerprint": fingerprint,
        "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish_reason(reason)}],
        "usage": usage_body(usage),
    }


def completion_chunk(
    request_id: str,
    model: str,
    created: int,
    fingerprint: str,
    *,
    text: str | None,
    reason: FinishReason | None = None,
    with_usage: bool = False,
    usage: Usage | None = None,
) -> Body:
    """One streamed ``text_completion``; ``text=None`` with ``usage`` is the final usage-only chunk."""
    choices: list[Body] = []
    if text is not None:
        choices.append(
            {
                "text": text,
                "index": 0,
                "logprobs": None,
                "finish_reason": finish_reason(reason) if reason is not None else None,
            }
        )
    body: Body = {
        "id": f"cmpl-{request_id}",
        "object": "text_completion",
        "created": created,
        "model": model,
        "system_fingerprint": fingerprint,
        "choices": choices,
    }
    if with_usage:
        body["usage"] = usage_body(usage) if usage is not None else None
    return body


def embeddings(
    model: str, vectors: Float32Vectors, prompt_tokens: int, encoding_format: str, first_index: int = 0
) -> Body:
    """``base64`` passes each vector's float32 bytes through as they came in the event; ``float`` lists
    the floats. The vectors are numbered from ``first_index``."""
    rendered: list[str] | list[list[float]] = (
        [base64.b64encode(row).decode() for row in vectors.rows()]
        if encoding_format == "base64"
        else vectors.tolist()
    )
    return {
        "object": "list",
        "data": [
            {"object": "embedding", "index": index, "embedding": vector}
            for index, vector in enumerate(rendered, first_index)
        ],
        "model": model,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }


EMBEDDINGS_PER_PART = 128
"""Vectors rendered at a time by :func:`embeddings_json` (~7 ms as floats of 384 on the development box)."""


def embeddings_json(
    model: str, vectors: Float32Vectors, prompt_tokens: int, encoding_format: str
) -> Iterator[bytes]:
    """:func:`embeddings`' JSON, byte for byte, in parts of :data:`EMBEDDINGS_PER_PART` vectors: 2,048
    vectors as floats are ~15 MB of JSON and took ~100 ms to render in one go, every other request on the
    edge's loop waiting (an audit); its caller lets the loop run between parts."""
    nothing = Float32Vectors(dim=vectors.dim, data=b"")
    head, tail = msgspec.json.encode(embeddings(model, nothing, prompt_tokens, encoding_format)).split(
        b'"data":[]', 1
    )
    yield head + b'"data":['
    step = FLOAT32_BYTES * vectors.dim * EMBEDDINGS_PER_PART
    for first, start in enumerate(range(0, len(vectors.data), step)):
        part = Float32Vectors(dim=vectors.dim, data=vectors.data[start : start + step])
        items = embeddings(model, part, prompt_tokens, encoding_format, first * EMBEDDINGS_PER_PART)["data"]
        yield (b"," if first else b"") + msgspec.json.encode(items)[1:-1]
    yield b"]" + tail


def model_object(model_id: str, created: int) -> Body:
    return {"id": model_id, "object": "model", "created": created, "owned_by": "sluicegate"}


def model_list(models: list[tuple[str, int]]) -> Body:
    return {"object": "list", "data": [model_object(model_id, created) for model_id, created in models]}
