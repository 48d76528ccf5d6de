"""Incremental detokenisation: text deltas per token without re-decoding the whole completion.

The approach vLLM uses: decode a short window ``ids[prefix:]`` and emit what it adds over
``ids[prefix:read]``, holding text back while it ends in an incomplete character (U+FFFD).
"""

from __future__ import annotations

from collections.abc import Callable

Decode = Callable[[list[int]], str]


class IncrementalDetokenizer:
    def __init__(self, decode: Decode) -> None:
        self._decode = decode
        self.ids: list[int] = []
        self._prefix = 0
        self._read = 0
        self.text = ""

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (possibly empty)."""
        self.ids.append(token_id)
        before = self._decode(self.ids[self._prefix : self._read])
        after = self._decode(self.ids[self._prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            delta = after[len(before) :]
            self._prefix, self._read = self._read, len(self.ids)
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        """At the end: whatever was held back."""
        before = self._decode(self.ids[self._prefix : self._read])
        after = self._decode(self.ids[self._prefix :])
        delta = after[len(before) :] if after.startswith(before) else ""
        self._prefix = self._read = len(self.ids)
        self.text += delta
        return delta
