"""The raw models beside one client's requests in ``online.py``: a ``raw_model.py --serve`` child sampled
between blocks of the platform's requests, and what its samples become. The box drifts by more within
minutes than the platform adds at one client, so the platform's added latency there is taken against the
model run in the same seconds, not minutes before."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import cast

from harness import reap

ROOT = Path(__file__).resolve().parent.parent


class RawReference:
    """The raw models' batch 1 alone, beside one client's requests (``raw_model.py --serve``): a child started
    before the box is split (on every core), sampled between blocks of a server's requests. The box drifts
    by more within minutes than the platform adds at one client, so the platform's added latency there is
    taken against the model run in the same seconds, not minutes before."""

    def __init__(self, narrow: int, log: Path) -> None:
        self._log = log.open("w")
        self._proc = subprocess.Popen(
            [sys.executable, str(ROOT / "benchmarks" / "raw_model.py"), "--serve", str(narrow)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
        )
        if self._readline() != "ready":
            raise RuntimeError(f"the raw reference did not start (see {log})")

    def _readline(self) -> str:
        assert self._proc.stdout is not None
        return self._proc.stdout.readline().strip()

    def sample(self, n: int) -> dict[str, list[float]]:
        """``n`` MiniLM forwards of batch 1 in a loop on every core (``wide``) and on the worker's threads
        (``narrow``), each in ms."""
        return self._ask(str(n))

    def sample_generation(self, n: int, tokens: int) -> list[float]:
        """``n`` demo-gpt ``generate`` calls of batch 1 and ``tokens`` new tokens on the worker's threads,
        each in ms."""
        return self._ask(f"gen {n} {tokens}")["narrow"]

    def generation_floor(self, seconds: float, batch: int, tokens: int, quick: bool) -> dict[str, float]:
        """demo-gpt's tokens/s at ``batch`` rows on the worker's threads, as the floor run (``--quick`` or
        not) measures it, within ``seconds``: ``{"generate": ..., "engine": ...}`` (the floor is the faster)."""
        size = "quick" if quick else "full"
        return cast(dict[str, float], self._ask(f"rate gen {seconds:g} {batch} {tokens} {size}"))

    def churn_floor(self, seconds: float, batch: int, tokens: int) -> float:
        """The engine alone at ``batch`` rows under a serving load's churn (``rate churn``) for ``seconds``,
        on the worker's threads: tokens/s."""
        return cast(dict[str, float], self._ask(f"rate churn {seconds:g} {batch} {tokens}"))["churn"]

    def embedding_floor(self, seconds: float, batch: int, quick: bool) -> float:
        """MiniLM's embeddings/s at ``batch`` on the worker's threads over the load's inputs, as the floor run
        measures it, within ``seconds``."""
        size = "quick" if quick else "full"
        return cast(dict[str, float], self._ask(f"rate emb {seconds:g} {batch} {size}"))["embed"]

    def _ask(self, request: str) -> dict[str, list[float]]:
        assert self._proc.stdin is not None
        self._proc.stdin.write(f"{request}\n")
        self._proc.stdin.flush()
        line = self._readline()
        if not line:
            raise RuntimeError("the raw reference exited")
        return cast(dict[str, list[float]], json.loads(line))

    def close(self) -> None:
        if self._proc.stdin is not None:
            self._proc.stdin.close()
        reap(self._proc)
        self._log.close()


BESIDE = "raw batch 1 beside"
"""One client's embedding: the raw forward of batch 1 in a loop on every core, p50 of the samples taken
between the platform's blocks (:class:`RawReference`)."""
BESIDE_WORKER = "raw batch 1 beside, worker's threads"
"""The same on the worker's threads."""
NAIVE_BESIDE = "naive beside"
"""The naive peer's one-client embedding, p50 of the requests made between the platform's blocks with the
raw forward (``comparison.NaivePeer``), on the same threads as :data:`BESIDE_WORKER`'s forward."""


def beside_platform(
    where: dict[str, float], quiet_batches: float, generation: dict[str, float]
) -> dict[str, tuple[float, float]]:
    """Per workload, one client's p50 on the platform and the raw model's sampled beside it, on the threads
    the platform's model had (every core where the embedding worker's quiet team ran): embeddings from the
    stamped blocks (``where``), generation from its blocks (``generation``, :func:`one_client_generation`)."""
    return {
        "embeddings": (where["total"], where[BESIDE if quiet_batches else BESIDE_WORKER]),
        "generation": (generation["platform"], generation["raw beside"]),
    }


def one_client_generation(samples: dict[str, list[float]]) -> dict[str, float]:
    """One client's completions on the platform beside the raw ``generate``: p50 ms of each, and counts."""
    return {
        "platform": statistics.median(samples["platform"]),
        "raw beside": statistics.median(samples["beside"]),
        "requests": float(len(samples["platform"])),
        "samples": float(len(samples["beside"])),
    }
