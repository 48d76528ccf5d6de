"""RFC 9562 UUID version 7 identifiers: 48-bit Unix milliseconds, then 74 random bits; and the sampling seed
derived from a request id.

Ids made by one process are strictly increasing (RFC 9562 section 6.2, method 2: within one millisecond the
random part grows by a random increment; on overflow the timestamp moves on by one millisecond), so they sort
by creation time and make good Kafka/warehouse keys.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import threading
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime

UUID7_PATTERN = r"^[0-9a-f]{8}-[0-9a-f]{4}-7[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$"
"""The canonical (lowercase, hyphenated) text form of a version 7 UUID."""

RAND_BITS = 74
_RAND_MAX = (1 << RAND_BITS) - 1
_MS_MAX = (1 << 48) - 1
_RAND_B_BITS = 62
_INCREMENT_BITS = 32


def uuid7_from_parts(unix_ms: int, rand: int) -> str:
    """The UUIDv7 for a timestamp and 74 random bits (``rand_a`` is the top 12, ``rand_b`` the low 62).

    Pure and deterministic: use it for fixed ids in examples and tests.
    """
    if not 0 <= unix_ms <= _MS_MAX:
        raise ValueError(f"unix_ms must fit in 48 bits, got {unix_ms}")
    if not 0 <= rand <= _RAND_MAX:
        raise ValueError(f"rand must fit in {RAND_BITS} bits, got {rand}")
    rand_a = rand >> _RAND_B_BITS
    rand_b = rand & ((1 << _RAND_B_BITS) - 1)
    value = (unix_ms << 80) | (0x7 << 76) | (rand_a << 64) | (0b10 << 62) | rand_b
    digits = f"{value:032x}"  # what str(uuid.UUID(int=value)) writes, without building the UUID
    return f"{digits[:8]}-{digits[8:12]}-{digits[12:16]}-{digits[16:20]}-{digits[20:]}"


_UUID7 = re.compile(UUID7_PATTERN)


def derived_uuid7(unix_ms: int, key: str) -> str:
    """A UUIDv7 at ``unix_ms`` whose random bits are the top 74 of SHA-256 over ``key``: the same id every
    time something is built again from the same input (a redelivered event, a replay), so a consumer
    can drop the copy by id."""
    digest = hashlib.sha256(key.encode()).digest()
    return uuid7_from_parts(unix_ms, int.from_bytes(digest[:10], "big") >> (80 - RAND_BITS))


def uuid7_unix_ms(value: str) -> int:
    """The millisecond timestamp inside a UUIDv7; ``ValueError`` if ``value`` is not one."""
    if _UUID7.fullmatch(value):  # the canonical form (every id we make): its first 12 digits
        return int(value[:8] + value[9:13], 16)
    parsed = uuid.UUID(value)
    if parsed.version != 7 or parsed.variant != uuid.RFC_4122:
        raise ValueError(f"not a version 7 UUID: {value!r}")
    return parsed.int >> 80


def uuid7_time(value: str) -> datetime:
    """The creation time inside a UUIDv7, as an aware UTC datetime (millisecond precision)."""
    return datetime.fromtimestamp(uuid7_unix_ms(value) / 1000, tz=UTC)


class Uuid7Generator:
    """Monotonic UUIDv7s from one clock (nanoseconds since the epoch) and one source of random bits.

    The module keeps one, reset in a forked child; tests build their own with a fake clock.
    """

    def __init__(
        self,
        clock: Callable[[], int] = time.time_ns,
        randbits: Callable[[int], int] = secrets.randbits,
    ) -> None:
        self._clock = clock
        self._randbits = randbits
        self.reset()

    def reset(self) -> None:
        self._lock = threading.Lock()
        self._ms = -1
        self._rand = 0

    def __call__(self) -> str:
        with self._lock:
            now = self._clock() // 1_000_000
            if now > self._ms:
                self._ms, self._rand = now, self._randbits(RAND_BITS)
            else:
                # Same millisecond, or the clock stepped back: stay on the last timestamp and grow.
                self._rand += self._randbits(_INCREMENT_BITS) + 1
                if self._rand > _RAND_MAX:
                    self._ms, self._rand = self._ms + 1, self._randbits(RAND_BITS)
            return uuid7_from_parts(self._ms, self._rand)


_GENERATOR = Uuid7Generator()
os.register_at_fork(after_in_child=_GENERATOR.reset)


def uuid7() -> str:
    """A new UUIDv7, greater than every one this process made before."""
    return _GENERATOR()


def derive_seed(request_id: str) -> int:
    """The sampling seed of a request whose client gave none: the top 63 bits of sha256(request id).

    The edge writes it on the request event and the worker falls back to it for an event without one, so a
    retried, redelivered or replayed request samples the same tokens. Logged requests carry this value:
    changing the function would change what a re-run of them produces.
    """
    return int.from_bytes(hashlib.sha256(request_id.encode()).digest()[:8], "big") >> 1
