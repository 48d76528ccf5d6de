"""librdkafka waking an event loop itself: a byte on a pipe whenever a consumer's queue gets work.

A consumer polled on a thread of its own wakes three threads for each record that arrives on an idle
edge: librdkafka's broker thread reads the fetch response and signals the polling thread, which hands the
batch to the event loop, which wakes to act on it. librdkafka can instead write to a file descriptor
whenever its consumer queue goes from empty to non-empty (``rd_kafka_queue_io_event_enable``); the loop
watches that descriptor with the sockets it already watches, and reads the queue without waiting
(``consume(n, 0)``): one wake-up. In ``kafka_floor``'s echo around MiniLM's forward (2026-11-29, 4
alternating rounds of 190 lone round trips) the hop back took 1.47-1.69 ms this way against 1.65-1.85
through a polling thread and the loop (docs/perf).

confluent-kafka does not expose that call, so it is made here through ``ctypes`` on the librdkafka that
confluent-kafka loaded, with the client's handle read from its Python object (``Handle.rk``, the first
field after the object header since confluent-kafka 0.9). That is checked before anything is enabled:
only confluent-kafka 2.x on CPython, and the handle must be a consumer that names the ``client.id`` this
process gave it. Wherever a check fails the caller gets None and polls on a thread as before.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import sys
from pathlib import Path

import confluent_kafka
from confluent_kafka import Consumer

log = logging.getLogger(__name__)

_CONSUMER = 1
"""``rd_kafka_type()`` of a consumer (``RD_KAFKA_CONSUMER``)."""
_HANDLE_OFFSET = ctypes.sizeof(ctypes.c_ssize_t) + ctypes.sizeof(ctypes.c_void_p)
"""Where ``rd_kafka_t *rk`` sits in confluent-kafka's ``Handle``: right after ``PyObject_HEAD``."""


def _library() -> ctypes.CDLL | None:
    """The librdkafka confluent-kafka's extension is linked against (its wheel bundles one), or None."""
    package = Path(confluent_kafka.__file__).parent
    bundled = sorted((package.parent / "confluent_kafka.libs").glob("librdkafka*.so*"))
    try:
        lib = ctypes.CDLL(str(bundled[0]) if bundled else "librdkafka.so.1")
    except OSError:
        return None
    lib.rd_kafka_name.restype = ctypes.c_char_p
    lib.rd_kafka_name.argtypes = [ctypes.c_void_p]
    lib.rd_kafka_type.restype = ctypes.c_int
    lib.rd_kafka_type.argtypes = [ctypes.c_void_p]
    lib.rd_kafka_queue_get_consumer.restype = ctypes.c_void_p
    lib.rd_kafka_queue_get_consumer.argtypes = [ctypes.c_void_p]
    lib.rd_kafka_queue_io_event_enable.restype = None
    lib.rd_kafka_queue_io_event_enable.argtypes = [
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_size_t,
    ]
    lib.rd_kafka_queue_destroy.restype = None
    lib.rd_kafka_queue_destroy.argtypes = [ctypes.c_void_p]
    return lib


def _supported() -> bool:
    return (
        sys.platform == "linux"
        and platform.python_implementation() == "CPython"
        and confluent_kafka.version()[0].split(".")[0] == "2"
    )


_LIB = _library() if _supported() else None


class QueueWakeup:
    """The read end of a pipe librdkafka writes a byte to whenever the consumer's queue goes from empty to
    non-empty (records, but also statistics and errors: everything ``consume`` serves). Whoever wakes must
    read the queue until it is empty, or it is never written to again. :meth:`close` before the consumer's
    ``close()`` (librdkafka requires the queue's reference gone first)."""

    def __init__(self, lib: ctypes.CDLL, queue: int) -> None:
        self._lib = lib
        self._queue: int | None = queue
        self.fd, self._write = os.pipe()
        os.set_blocking(self.fd, False)
        os.set_blocking(self._write, False)  # a full pipe already says "wake up": librdkafka drops the byte
        lib.rd_kafka_queue_io_event_enable(queue, self._write, b"1", 1)

    def drain(self) -> None:
        """Read what the pipe holds (one byte per wake-up)."""
        try:
            while os.read(self.fd, 4096):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        queue, self._queue = self._queue, None
        if queue is None:
            return
        self._lib.rd_kafka_queue_io_event_enable(queue, -1, None, 0)
        self._lib.rd_kafka_queue_destroy(queue)
        os.close(self.fd)
        os.close(self._write)


def queue_wakeup(consumer: Consumer, client_id: str) -> QueueWakeup | None:
    """A :class:`QueueWakeup` on ``consumer``'s queue, or None where it cannot be set up here (another
    platform or confluent-kafka, no librdkafka found, a handle that is not this consumer's)."""
    if _LIB is None:
        return None
    handle = ctypes.c_void_p.from_address(id(consumer) + _HANDLE_OFFSET).value
    if not handle:
        return None
    name = (_LIB.rd_kafka_name(handle) or b"").decode(errors="replace")
    if _LIB.rd_kafka_type(handle) != _CONSUMER or not name.startswith(f"{client_id}#consumer-"):
        log.warning(
            "cannot reach librdkafka's queue of consumer %s (got %r): it is polled on a thread",
            client_id,
            name,
        )
        return None
    queue = _LIB.rd_kafka_queue_get_consumer(handle)
    if not queue:
        return None
    return QueueWakeup(_LIB, queue)
