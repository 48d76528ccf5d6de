"""Between a validated request and its reply stream: idempotency, submit or resume, deadlines and cancels."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from ingest.admission import Flight
from ingest.errors import (
    DeadlineExceeded,
    GatewayUnavailable,
    IdempotencyInProgress,
    IdempotencyKeyCancelled,
    IdempotencyKeyFailed,
    IdempotencyKeyReused,
    IngestError,
    InvalidRequest,
    NotFound,
    ShuttingDown,
    StreamEnded,
    from_finished,
)
from ingest.gateway import Gateway, IdempotencyRecord, ReplyItem, ReplyStream, RequestEvent
from ingest.prepare import Prepared
from ingest.reply_stream import WHOLE, After
from monitoring import metrics
from schemas.events import CancelRequested, RequestFinished

log = logging.getLogger(__name__)

CancelReason = Literal["client_disconnect", "client_cancel", "shutdown"]
MAX_IDEMPOTENCY_KEY = 255
SAME_DEADLINE_S = 0.001
"""A reader's deadline this close to its request's own is the request's (the seconds left to it, computed a
moment before the guard starts, land on it only up to rounding)."""


@dataclass(frozen=True)
class Opened:
    request_id: str
    stream: ReplyStream
    owner: bool
    """False when the stream replays a request submitted earlier (idempotent retry)."""
    replay: bool = False
    """An idempotent retry's replay (:func:`replayed` is applied last, over the settling)."""


MAX_SESSION_ID = 255


def check_header(value: str | None, header: str, most: int) -> str | None:
    """A client's key in a header (``Idempotency-Key``, ``X-Session-Id``): 1 to ``most`` printable
    characters, else a 400. A byte that is not UTF-8 arrives as a lone surrogate, which is not printable (an
    audit: ``X-Session-Id: \xff`` during a rollout was a 500 where the key is hashed)."""
    if value is not None and not (0 < len(value) <= most and value.isprintable()):
        raise InvalidRequest(f"{header} must be 1 to {most} printable characters.", param=header)
    return value


def check_idempotency_key(key: str | None) -> str | None:
    return check_header(key, "Idempotency-Key", MAX_IDEMPOTENCY_KEY)


def shutting_down() -> ShuttingDown:
    return ShuttingDown("The server is shutting down and cancelled this request; send it again.")


class Watched:
    """A reply stream whose every item is shown to ``see`` on its way to the reader (which may raise)."""

    def __init__(self, stream: ReplyStream, see: Callable[[ReplyItem], None]) -> None:
        self._stream = stream
        self._items = aiter(stream)
        self._see = see

    def __aiter__(self) -> Watched:
        return self

    async def __anext__(self) -> ReplyItem:
        item = await anext(self._items)
        self._see(item)
        return item

    async def aclose(self) -> None:
        await self._stream.aclose()


def tenant_checked(
    stream: ReplyStream, tenant: str, model: str | None = None, kind: str | None = None
) -> Watched:
    """A resumed stream that ends with ``stream_not_found`` at the first reply of another tenant: the gateway
    already checks, and this edge checks again (one tenant must never read another's stream). With ``model``
    and ``kind`` (a resume through an endpoint, whose body names them), also at a reply of another model or
    a terminal event of another kind of request: a chat body resuming an embedding's stream must not get it
    rendered as an empty chat completion."""

    def check(item: ReplyItem) -> None:
        if (
            item.tenant != tenant
            or (model is not None and item.model != model)
            or (kind is not None and isinstance(item, RequestFinished) and item.kind not in ("", kind))
        ):
            raise NotFound(f"No stream {item.request_id!r} to resume.", code="stream_not_found")

    return Watched(stream, check)


def replayed(stream: ReplyStream, *, resumed: bool = False) -> Watched:
    """An idempotent retry's replay of the key's request (``resumed``: a client's resume of a stream): a
    ``cancelled`` end, or a failure worth retrying, is that key's (that stream's) final outcome, a 409 that
    says what to do, not the retriable 503 a client would retry into the same replay for the key's lifetime
    (for ever: an audit of resumes)."""

    def check(item: ReplyItem) -> None:
        if not isinstance(item, RequestFinished):
            return
        error = from_finished(item)
        cancelled = item.status == "cancelled"
        if not cancelled and (error is None or not error.retriable):
            return  # an end a replay may give again
        if resumed:
            how = "was cancelled before it finished" if cancelled else f"failed ({error})"
            raise StreamEnded(
                f"The request of this stream ({item.request_id}) {how}; a resume replays that end. Send the "
                "request again, without Last-Event-ID.",
                code="stream_cancelled" if cancelled else "stream_failed",
            )
        if cancelled:
            raise IdempotencyKeyCancelled(
                f"The request this Idempotency-Key names ({item.request_id}) was cancelled before it finished "
                "(its client left, or it was cancelled); a retry with this key replays that outcome. Send the "
                "request again with a new key.",
                param="Idempotency-Key",
            )
        assert error is not None  # not cancelled, so a failure worth retrying
        raise IdempotencyKeyFailed(
            f"The request this Idempotency-Key names ({item.request_id}) failed for a reason worth "
            f"retrying ({error.code}: {error}); a retry with this key "
            "replays that outcome. Send the request again with a new key.",
            param="Idempotency-Key",
        )

    return Watched(stream, check)


def settling(stream: ReplyStream, settle: Callable[[RequestFinished], None]) -> Watched:
    """Tells ``settle`` the terminal event as it passes: the tenant's token reservation becomes what the
    request really used."""

    def see(item: ReplyItem) -> None:
        if isinstance(item, RequestFinished):
            settle(item)

    return Watched(stream, see)


class Refund(Protocol):
    """Takes back what a flight reserved (:meth:`ingest.admission.Admission.refund`)."""

    def __call__(self, flight: Flight, *, request: bool) -> None: ...


def _not_past(ends: float) -> None:
    """Raise :class:`DeadlineExceeded` once the loop time ``ends`` has passed."""
    if asyncio.get_running_loop().time() >= ends:
        raise _missed_deadline()


def _missed_deadline() -> DeadlineExceeded:
    return DeadlineExceeded("The request could not be placed on the log before its deadline.")


class Dispatcher:
    def __init__(
        self,
        gateway: Gateway,
        *,
        source: str,
        disconnect_grace_s: float = 0.0,
        settle: Callable[[Flight, RequestFinished], None] | None = None,
        refund: Refund | None = None,
    ) -> None:
        self._settle = settle
        self._refund = refund
        self._gateway = gateway
        self._source = source
        self._grace = disconnect_grace_s
        self._tasks: set[asyncio.Future[Any]] = set()
        self._delayed: dict[str, tuple[asyncio.Task[None], Flight]] = {}
        """Per request id, the cancel delayed by the disconnect grace and the flight that left it."""
        self._flush = asyncio.Event()

    async def open(self, prepared: Prepared, idempotency_key: str | None, flight: Flight) -> Opened:
        """Submit the request, or, for a key seen before with the same body, replay that request's replies.

        A client that leaves while this waits (on the log's acknowledgement) gets its request cancelled.

        The request's deadline starts here (:attr:`Flight.ends_at`, which :meth:`guard` keeps): the wait for
        the log is part of it. A review: it started once the log had the request, so while the broker was
        away (stopped, restarting) a request asking 3 s waited on librdkafka's 30 s delivery timeout and was
        answered after 25-30 s, its place in flight held all along. Past it, the client gets a 504 at once,
        and the submission runs to its end in the background (:meth:`_finish_late`): the record may still
        reach the log, or fail to, and whichever it does must be followed up (a review of the first cut,
        which cancelled the wait: a delivery that failed later was heard by nobody, so the key's claim was
        never withdrawn, every retry with it failing for 24 h, and the tenant stayed charged)."""
        loop = asyncio.get_running_loop()
        ends = loop.time() + prepared.timeout_s
        flight.ends_at = ends
        submission = asyncio.ensure_future(self._open(prepared, idempotency_key, ends))
        try:
            async with asyncio.timeout_at(ends):
                opened = await asyncio.shield(submission)
        except TimeoutError:
            if not submission.done():
                submission.add_done_callback(functools.partial(self._finish_late, flight))
                self._tasks.add(submission)
                submission.add_done_callback(self._tasks.discard)
                raise _missed_deadline() from None
            opened = submission.result()  # done just as the deadline passed: the guard ends it at once
        except asyncio.CancelledError:  # the client left: the wait for the log is cut, as before the deadline
            if submission.done() and not submission.cancelled() and submission.exception() is None:
                self._close_later(submission.result().stream)  # it ended as this wait was cancelled
            else:
                submission.cancel()
            self.cancel(flight, "client_disconnect")
            raise
        except IngestError:  # never on the log (refused, its key in use or reused): it used nothing
            if self._refund is not None:
                self._refund(flight, request=True)
            raise
        if not opened.owner and self._refund is not None:  # a replay: nothing generated for it here
            self._refund(flight, request=False)
        flight.request_id, flight.owner = opened.request_id, opened.owner
        flight.shape = dataclasses.replace(prepared.shape, request_id=opened.request_id)
        stream = opened.stream
        if self._settle is not None and opened.owner:
            settle = self._settle
            stream = settling(stream, lambda f: settle(flight, f))
        # the replay's check over the settling: a final 409 still settles a taken-back request's reservation
        if opened.replay:
            stream = replayed(stream)
        return dataclasses.replace(opened, stream=stream)

    def _finish_late(self, flight: Flight, submission: asyncio.Future[Opened]) -> None:
        """A submission that ended after its request's deadline (its client had its 504): on the log as this
        edge's request, it is cancelled (its worker finds it expired anyway) and settled by its terminal
        event; a replay of another request, or never on the log (a failed delivery: its key's claim was
        withdrawn by :meth:`_submit_or_replay`), it gives back what it reserved."""
        if submission.cancelled():
            return
        failed = submission.exception()
        if failed is not None:
            if not isinstance(failed, IngestError):
                log.error("submitting request %s failed", flight.request_id, exc_info=failed)
            if self._refund is not None:
                self._refund(flight, request=True)
            return
        opened = submission.result()
        flight.request_id, flight.owner = opened.request_id, opened.owner
        if opened.owner:
            self.cancel(flight, "client_cancel", why="deadline")
        elif self._refund is not None:
            self._refund(flight, request=False)
        self._close_later(opened.stream)

    def _close_later(self, stream: ReplyStream) -> None:
        """Close the reply stream of a request nobody reads (in the background)."""
        task = asyncio.ensure_future(stream.aclose())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _open(self, prepared: Prepared, idempotency_key: str | None, ends: float) -> Opened:
        opened = await self._submit_or_replay(prepared, idempotency_key, ends)
        if opened.owner and prepared.shadow is not None:
            task = asyncio.create_task(self._mirror(prepared.shadow))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return opened

    async def _mirror(self, shadow: RequestEvent) -> None:
        """The shadow copy, after its request is on the log; its failure never reaches the client."""
        try:
            await self._gateway.mirror(shadow)
        except Exception:
            log.exception("could not publish the shadow copy of %s", shadow.shadow_of)

    async def _submit_or_replay(self, prepared: Prepared, idempotency_key: str | None, ends: float) -> Opened:
        """``ends``: the request's deadline (loop time); a request not yet published when it passes (a key's
        lookup or claim was slow) is not published at all: its client has had its 504 (a review: it went
        on to the log and was cancelled there, its tenant charged until its terminal event)."""
        event = prepared.event
        if idempotency_key is None:
            _not_past(ends)
            return Opened(event.request_id, await self._gateway.submit(event), owner=True)
        mine = IdempotencyRecord(request_id=event.request_id, body_hash=prepared.body_hash)
        record = await self._gateway.lookup_idempotent(event.tenant, idempotency_key)
        if record is None:
            record = await self._gateway.remember_idempotent(event.tenant, idempotency_key, mine)
        if record.body_hash != prepared.body_hash:
            raise IdempotencyKeyReused(
                "This Idempotency-Key was used with a different request body.", param="Idempotency-Key"
            )
        if record.request_id == event.request_id:
            try:
                _not_past(ends)
                return Opened(event.request_id, await self._gateway.submit(event), owner=True)
            except (GatewayUnavailable, DeadlineExceeded):  # never published: the key must not point at a
                # request that is not
                await self._gateway.forget_idempotent(event.tenant, idempotency_key, mine)
                raise
        stream = await self._gateway.resume(event.tenant, record.request_id, WHOLE)
        if stream is None:
            raise IdempotencyInProgress(
                "A request with this Idempotency-Key is not readable yet; retry shortly.",
                param="Idempotency-Key",
            )
        # a retry after this edge's client left, within the grace, takes the request back as a resume does
        # (its body is the request's: the same model)
        owner = self._reclaim(record.request_id) is not None
        return Opened(record.request_id, tenant_checked(stream, event.tenant), owner=owner, replay=True)

    async def resume(
        self,
        flight: Flight,
        after: After,
        expect: Prepared | None = None,
        encoding_format: str | None = None,
    ) -> ReplyStream:
        """The replies after ``after`` of the request ``flight`` reads (its tenant's, by its request id).
        A request that came back within the disconnect grace is taken back, its delayed cancel dropped:
        the flight goes on as the one that left it (:meth:`Flight.take_back`; it owns the request and
        cancels it on leaving). ``expect``: the body of an endpoint's resume, whose model and kind the
        stream must be of. ``encoding_format``: how the reader wants an embeddings result's vectors; unset,
        as the request asked where it is taken back, else ``float``."""
        tenant, request_id = flight.tenant, flight.request_id
        found = await self._gateway.resume(tenant, request_id, after)
        if found is None:
            raise NotFound(f"No stream {request_id!r} to resume.", code="stream_not_found")
        model, kind = (expect.event.model, expect.shape.kind) if expect is not None else (None, None)
        left = self._reclaim(request_id)
        if left is not None:
            flight.take_back(left)
        if encoding_format is not None:
            flight.render_vectors_as(encoding_format)
        return replayed(tenant_checked(found, tenant, model, kind), resumed=True)

    def _reclaim(self, request_id: str) -> Flight | None:
        """Drop the request's delayed disconnect cancel, if one is pending here, and give back the flight
        that left it (the caller owns the request again, and cancels it when it leaves)."""
        delayed = self._delayed.pop(request_id, None)
        if delayed is None:
            return None
        task, left = delayed
        task.cancel()
        return left

    @contextlib.asynccontextmanager
    async def guard(self, flight: Flight, stream: ReplyStream, timeout_s: float) -> AsyncIterator[None]:
        """Bound the wait by the deadline, cancel an owned request when the client leaves or the deadline
        passes, end it with :class:`ShuttingDown` when the edge stops (:meth:`Flight.stop`), and always close
        the stream. The deadline of a submitter is its request's own (:attr:`Flight.ends_at`); a resume's
        is its reader's, and never later than the request's when it took the request back."""
        ends = asyncio.get_running_loop().time() + timeout_s
        if not flight.resumed:
            if flight.ends_at is None:
                flight.ends_at = ends
            ends = flight.ends_at  # set as it was submitted (:meth:`open`): the wait for the log counts
        elif flight.ends_at is not None and ends > flight.ends_at - SAME_DEADLINE_S:
            ends = flight.ends_at  # a resume that took its request back: it reads to that one at most
        try:
            async with asyncio.timeout_at(ends) as deadline:
                if flight.stopping:
                    raise shutting_down()
                flight.deadline = deadline
                yield
        except TimeoutError:
            if flight.stopping:
                raise shutting_down() from None
            if ends == flight.ends_at:  # the request's own deadline
                self.cancel(flight, "client_cancel", why="deadline")
            else:  # the reader's deadline, not the request's: the reader left, as on a disconnect (an
                # audit: a request taken back within the grace was cancelled at once by its resume's
                # shorter deadline)
                self.cancel(flight, "client_disconnect")
            raise DeadlineExceeded("The request did not finish before its deadline.") from None
        except (asyncio.CancelledError, ConnectionResetError):
            self.cancel(flight, "client_disconnect")
            raise
        except NotFound:
            # A resume of another model's or kind's stream (its body's) took the request back before its
            # replies said so: it is left as it was found, its client gone (an audit: its delayed cancel
            # was dropped for good, the request ran to its end unread, and its place was free).
            if flight.resumed:
                self.cancel(flight, "client_disconnect")
            raise
        finally:
            flight.deadline = None
            await stream.aclose()

    def cancel(self, flight: Flight, reason: CancelReason, *, why: str | None = None) -> None:
        """Publish a cancel for the flight's request (once, in the background), if this edge owns it.
        ``why`` refines the reason for the metric (``deadline``: the schema has no such reason yet)."""
        if not flight.owner or flight.cancel_sent:
            return
        flight.cancel_sent = True
        if not flight.model:  # a bug: no worker takes it (each acts on its own model's cancels alone)
            log.error("the cancel of request %s names no model: no worker will act on it", flight.request_id)
        metrics.CANCELS.labels(flight.model, why or reason).inc()
        if self._settle is not None:
            # Its stream is closed, or will be, before its end: the reservation (prompt + max_tokens) is
            # settled to what it used when its terminal event reaches this edge. It was kept for the whole
            # quota window (a review; the tenant was charged what it never used).
            settle = self._settle
            self._gateway.when_finished(flight.request_id, lambda finished: settle(flight, finished))
        event = CancelRequested(
            tenant=flight.tenant,
            model=flight.model,
            request_id=flight.request_id,
            source=self._source,
            reason=reason,
        )
        delay = self._grace if reason == "client_disconnect" else 0.0
        task = asyncio.create_task(self._send(event, delay))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        if delay:
            delayed = self._delayed[flight.request_id] = (task, flight)
            flight.held_until = task  # its place in flight is kept until the cancel is sent or taken back

            def sent(_: object) -> None:
                if self._delayed.get(flight.request_id) is delayed:  # not a later flight's, taking it back
                    del self._delayed[flight.request_id]

            task.add_done_callback(sent)

    async def _send(self, event: CancelRequested, delay: float) -> None:
        if delay:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await self._flush.wait()
        try:
            await self._gateway.cancel(event)
        except Exception:
            log.exception("could not publish cancel for request %s", event.request_id)

    async def drain(self) -> None:
        """Send delayed cancels now and wait for every cancel in flight (on shutdown)."""
        self._flush.set()
        while self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
