"""Out of memory in a forward pass: recognised, the memory handed back, the requests that did not fit ended
with ``worker_oom`` (retriable), and the batch limit lowered until it fits again. Never the worker.

On a GPU a batch that does not fit raises ``torch.cuda.OutOfMemoryError`` and leaves the process usable:
the allocator frees what the failed forward held. The runners use :class:`MemoryBackoff` to halve their
limit (padded tokens per embedding batch, rows of the generation batch) at each such failure and to double
it back towards the configured one after a run of batches without one, so a transient shortage (another
process on the card, fragmentation) costs throughput for a while and a standing one settles on what fits.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

OOM_CODE = "worker_oom"
"""``ErrorInfo.code`` of a request that ended because its batch did not fit in memory (retriable)."""


def is_out_of_memory(exc: BaseException) -> bool:
    """A device or host allocation failure inside torch (CUDA's, or the CPU allocator's ``RuntimeError``)."""
    import torch

    if isinstance(exc, torch.cuda.OutOfMemoryError | MemoryError):
        return True
    message = str(exc) if isinstance(exc, RuntimeError) else ""
    return "out of memory" in message or "can't allocate memory" in message


def out_of_memory_in(exc: BaseException, outside: BaseException | None = None) -> BaseException | None:
    """``exc`` if it is running out of memory, or the one it was raised from or while handling (a CUDA
    graph capture that runs out of memory can end in another error when the capture is torn down), up to
    ``outside``: the exception being handled where the failing work began, which is no part of its failure
    (a capture begun while an earlier batch's out of memory was handled is not out of memory itself)."""
    seen: BaseException | None = exc
    while seen is not None and seen is not outside:
        if is_out_of_memory(seen):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def release_memory(device: torch.device) -> None:
    """Hand the cached blocks of a failed forward back, so the retry (and other processes) can use them."""
    import torch

    if device.type == "cuda":
        torch.cuda.empty_cache()


@dataclass
class MemoryBackoff:
    """A batch limit halved at each out-of-memory and doubled back, up to ``ceiling``, after
    ``recover_after`` batches in a row without one."""

    ceiling: int
    floor: int = 1
    recover_after: int = 1000
    limit: int = field(init=False)
    clean: int = field(init=False, default=0)
    failures: int = field(init=False, default=0)
    """Out-of-memory failures so far (``sluice_worker_out_of_memory_total``)."""

    def __post_init__(self) -> None:
        self.limit = self.ceiling

    def failed(self, at: int) -> int:
        """A batch of size ``at`` did not fit: the new limit (half of it, at least ``floor``)."""
        self.limit = max(self.floor, min(self.limit, at) // 2)
        self.clean = 0
        self.failures += 1
        return self.limit

    @property
    def ratio(self) -> float:
        """The limit now over the ceiling (``sluice_worker_batch_limit_ratio``)."""
        return self.limit / self.ceiling

    def succeeded(self) -> bool:
        """A batch fitted; True when that raised the limit (the caller applies it)."""
        if self.limit >= self.ceiling:
            return False
        self.clean += 1
        if self.clean < self.recover_after:
            return False
        self.limit, self.clean = min(self.ceiling, self.limit * 2), 0
        return True
