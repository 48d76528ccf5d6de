"""Records nobody can decode: sent whole (or cut to fit) to the dead-letter topic with why, counted, and the
consumer moves on, committing such a record only once its letter is durable."""

from __future__ import annotations

import base64
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
from confluent_kafka import KafkaError, KafkaException, Message

from bus.consumer import UnreadableHeaders, record_headers
from bus.errors import BusError
from bus.producer import Delivery, EventProducer
from monitoring.metrics import DEAD_LETTERS
from schemas.codec import UNREADABLE_JSON, DecodeError, HeaderValue, decode
from schemas.events import DeadLetter, Event

log = logging.getLogger(__name__)


class Letter:
    """A dead letter sent: its :attr:`delivery`, and :meth:`again` to send it once more where Kafka did not
    take it."""

    def __init__(self, producer: EventProducer, topic: str, event: DeadLetter) -> None:
        self._producer, self._topic, self.event = producer, topic, event
        self.delivery = Delivery()
        try:
            producer.produce(topic, event, on_delivery=self.delivery.settle)
        except BusError as exc:  # refused at once (a topic librdkafka knows is missing, say): not delivered
            code = _refused_code(exc)
            if code is None or code == KafkaError._FATAL:
                raise  # the producer itself is gone (closed, or a fatal error): its owner's failure
            self.delivery.settle(exc)

    def again(self) -> Letter:
        return Letter(self._producer, self._topic, self.event)


def _refused_code(exc: BusError) -> int | None:
    """librdkafka's code for a record it refused at once (a topic it knows missing or forbidden, one whose
    leader is not known yet: a letter sent again later may land), or None where the producer itself
    refused (closed)."""
    cause = exc.__cause__
    if isinstance(cause, KafkaException) and cause.args and isinstance(cause.args[0], KafkaError):
        return int(cause.args[0].code())
    return None


@dataclass(frozen=True)
class Junk:
    """A record that does not decode, not dead-lettered yet: its reader letters it (:meth:`letter`) once it
    knows the record is still its own to handle. A worker's inbox can outlive the record's partition, whose
    next owner reads and letters it again (the letter sent on the way in went twice)."""

    where: tuple[str, int, int]
    """Its topic, partition and offset."""
    value: bytes
    why: Why
    """Not the error itself: its traceback would keep the consumer's whole batch of records alive."""
    headers: list[tuple[str, HeaderValue]]

    def letter(self, producer: EventProducer, deadletter_topic: str, source: str) -> Letter:
        """Sent whole to the dead-letter topic with the reason (counted and logged)."""
        event = dead_letter_event(source, self.where, self.value, self.why, self.headers)
        return Letter(producer, deadletter_topic, event)


@dataclass(frozen=True)
class Why:
    """Why a record did not decode: the error's message and the ``reason`` label it counts under
    (:func:`dead_letter_reason`)."""

    message: str
    label: str

    @classmethod
    def of(cls, value: bytes, exc: DecodeError) -> Why:
        return cls(str(exc), dead_letter_reason(value, exc))


def decode_or_junk(message: Message) -> Event | Junk:
    """A record's event, or the :class:`Junk` it is when it does not decode."""
    if message.value() is None:  # said as what it is (it read "Input data was truncated": an audit)
        return junk_of(message, Why("a tombstone (a record without a value)", "empty"))
    value = message.value() or b""
    try:
        header_list = record_headers(message)
    except UnreadableHeaders as exc:  # lettered without them: they cannot be read again (see there)
        return junk_of(message, Why(str(exc), "bad_headers"), [])
    try:
        return decode(value, header_list)
    except DecodeError as exc:
        return junk_of(message, Why.of(value, exc), header_list)


def junk_of(message: Message, why: Why, header_list: list[tuple[str, HeaderValue]] | None = None) -> Junk:
    """The record as :class:`Junk`, for ``why``: one that does not decode, or an event its topic must not
    carry (``misplaced``); ``header_list``: its headers, if read already (None: read here)."""
    where = (message.topic() or "", message.partition() or 0, message.offset() or 0)
    if header_list is None:
        try:
            header_list = record_headers(message)
        except UnreadableHeaders:
            header_list = []
    return Junk(where, message.value() or b"", why, header_list)


DEAD_LETTER_KEEP_BYTES = 500_000
"""The most of an undecodable record a dead letter keeps: enough to see what it was, and with its base64 and
the rest far under the record limit (every letter also becomes a warehouse row)."""
REASON_CHARS = 2000
"""The most of a decode error's message a dead letter keeps (a header check quotes the header whole)."""


def dead_letter_event(
    source: str,
    where: tuple[str, int, int],
    value: bytes,
    exc: DecodeError | Why,
    header_list: Sequence[tuple[str, str | bytes | None]] = (),
) -> DeadLetter:
    """The dead letter of an undecodable record (topic, partition, offset), counted and logged as sent: its
    sender produces it, and commits the record only once it is durable.

    The record goes whole unless its letter would pass the record limit (base64 grows it by a third): then
    the letter keeps its first :data:`DEAD_LETTER_KEEP_BYTES` and the reason says so; its headers go only
    while they encode to an eighth of that, and the reason (which may quote a header) is cut to
    :data:`REASON_CHARS`. So every letter fits one record: one over the limit failed to produce and stopped
    the worker that read the junk, on every start."""
    topic, partition, offset = where
    why = exc if isinstance(exc, Why) else Why.of(value, exc)
    reason = why.message
    if len(reason) > REASON_CHARS:
        reason = f"{reason[:REASON_CHARS]}... (the reason cut to its first {REASON_CHARS} of {len(reason)} characters)"
    kept = {k: _text(v) for k, v in header_list}
    if len(value) > DEAD_LETTER_KEEP_BYTES:
        reason += f" (payload cut to its first {DEAD_LETTER_KEEP_BYTES} of {len(value)} bytes)"
    if len(msgspec.json.encode(kept)) > DEAD_LETTER_KEEP_BYTES // 8:  # as written: an escape is 6 bytes
        reason += f" ({len(kept)} headers left out: too large)"
        kept = {}
    DEAD_LETTERS.labels(topic=topic, reason=why.label).inc()
    log.warning("dead-lettered %s[%s]@%s: %s", topic, partition, offset, reason[:REASON_CHARS])
    return DeadLetter(
        tenant="",
        model="",
        source=source,
        source_topic=topic,
        partition=partition,
        offset=offset,
        reason=reason,
        payload_b64=base64.b64encode(value[:DEAD_LETTER_KEEP_BYTES]).decode(),
        headers=kept,
    )


def dead_letter_reason(value: bytes, exc: DecodeError) -> str:
    """A closed set for the ``reason`` label: ``empty``, ``bad_json``, ``invalid_event`` (unknown type,
    missing or mistyped field), ``bad_headers`` (they disagree with the body, or a key is not UTF-8) or ``other``; and
    ``misplaced`` (a valid event its topic must not carry, :func:`junk_of`)."""
    if not value:
        return "empty"
    cause = exc.__cause__
    if isinstance(cause, msgspec.ValidationError):  # before DecodeError: it is a subclass
        return "invalid_event"
    if isinstance(cause, UNREADABLE_JSON):  # not JSON, not UTF-8, or nested too deep
        return "bad_json"
    if str(exc).startswith("header "):  # schemas.codec._check_headers raises these without a cause
        return "bad_headers"
    return "other"


def _text(value: str | bytes | None) -> str:
    if value is None:
        return ""
    return value if isinstance(value, str) else value.decode("utf-8", "replace")
