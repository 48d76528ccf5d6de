"""What serves a model, read from its latest ``DeploymentChanged``: routing, shadowing and liveness.

One pure object everybody shares, so the edge, the workers, ``sluice up`` and the rollout controller
agree by construction:

- **Routing is sticky.** A request's key (tenant, plus its session when the client names one) hashes to
  one of ``BUCKETS`` buckets; the candidate takes buckets ``[0, share * BUCKETS)``. Shares only grow
  during a rollout, so a key on the candidate stays there from step to step, and a conversation never
  flips between versions while its step lasts.
- **Shadowing** mirrors a request routed to the stable version when a second, independent hash of its
  key falls under the shadow share.
- **Liveness.** A version serves while it has traffic, or is the stable one, or is a candidate warming
  up (its workers start and load, with no traffic yet). A request whose version no longer serves (a
  rolled-back candidate, a retired stable) is run by the stable version's workers.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from schemas.events import DeploymentChanged

BUCKETS = 10_000


def bucket(model: str, key: str, salt: str = "route") -> int:
    """The key's bucket in ``[0, BUCKETS)`` (blake2b: the same in every process and every release)."""
    # surrogatepass: a key from a header that was not UTF-8 holds lone surrogates, and must not raise here
    digest = hashlib.blake2b(
        f"{salt}\0{model}\0{key}".encode("utf-8", "surrogatepass"), digest_size=8
    ).digest()
    return int.from_bytes(digest, "big") % BUCKETS


def buckets_of(share: float) -> int:
    """The buckets a share of traffic takes: a share under half a bucket (0.005 %) takes none.

    Clamped to ``[0, 1]`` (the contract bounds it; a deployment built in code may not be decoded)."""
    if not share > 0:  # NaN too
        return 0
    return round(min(share, 1.0) * BUCKETS)


def sticky_key(tenant: str, session: str | None) -> str:
    """The routing key: the tenant, and its session (``user`` field or ``X-Session-Id``) when given."""
    return f"{tenant}\0{session}" if session else tenant


@dataclass(frozen=True)
class Deployment:
    model: str
    stable: str
    candidate: str | None = None
    share: float = 0.0
    """The candidate's share of traffic."""
    shadow: float = 0.0
    warming: bool = False
    """The candidate's workers are starting: they run, and nothing is routed or mirrored to them yet."""

    @classmethod
    def of(cls, event: DeploymentChanged) -> Deployment:
        stable = event.stable or max(event.traffic, key=lambda v: event.traffic[v], default=event.version)
        candidate = event.candidate if event.candidate and event.candidate != stable else None
        if candidate is not None and event.phase == "warming":
            return cls(event.model, stable, candidate, warming=True)
        share = event.traffic.get(candidate, 0.0) if candidate else 0.0
        return cls(event.model, stable, candidate, share, event.shadow if candidate else 0.0)

    def route(self, key: str) -> str:
        """The version serving ``key``."""
        if self.candidate is not None and bucket(self.model, key) < buckets_of(self.share):
            return self.candidate
        return self.stable

    def shadow_to(self, key: str) -> str | None:
        """The candidate, when a request of ``key`` routed to the stable version is also to be mirrored."""
        if self.candidate is None or self.shadow <= 0 or self.route(key) != self.stable:
            return None
        return self.candidate if bucket(self.model, key, "shadow") < buckets_of(self.shadow) else None

    @property
    def serving(self) -> frozenset[str]:
        """Versions whose workers run: the stable one, and the candidate while it warms up or has traffic
        or shadow."""
        live = self.warming or self.share > 0 or self.shadow > 0
        extra = {self.candidate} if self.candidate and live else set()
        return frozenset({self.stable, *extra})

    def runs(self, own: str, version: str) -> bool:
        """Whether a worker of version ``own`` runs a request routed to ``version``: its own requests, and,
        for the stable version's workers, those of a version that no longer serves."""
        if version == own:
            return True
        return own == self.stable and version not in self.serving
