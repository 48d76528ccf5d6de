"""Control decisions from the warehouse: tenant budgets and SLO burn rates, published on ``control``.

Every few seconds the streams worker reads today's spend per tenant and each model's error ratios over
the burn-rate windows, and :class:`Controller` turns them into events *when a state changes*:

- ``BudgetStateChanged`` (key ``budget:<tenant>``) when a tenant's spend today reaches its daily limit, or
  falls back under it (a new day, a raised limit). The edge refuses that tenant's new work with 402
  ``budget_exceeded`` while the latest state says exhausted.
- ``BurnRateCrossed`` (key ``burn:<model>:<slo>``) when a model's availability error budget burns faster
  than one of the SLO configuration's page pairs allows (by default the SRE workbook's fast pair, 1h and
  5m above 14.4, and slow pair, 6h and 30m above 6), and when it stops. These are the pairs and
  thresholds Prometheus pages on (``sluice slo rules`` with the same file), including a threshold lowered
  to ``0.9 / budget`` where a low target puts the pair's own out of reach (``monitoring.slo.burn_threshold``).
  The ratios are not quite Prometheus' though: they count the requests the warehouse holds, and a request
  the edge shed (overload, shutdown) never reaches it, so a shedding overload pages without announcing a
  burn here (``docs/slo.md``, Known limits). The rollout work acts on these.

The control topic is compacted, so its latest event per key is the state; a restarted controller reads
the budget states back from it (:meth:`Controller.seed`) and may announce a burn-rate state again, which
consumers treat as idempotent.
"""

from __future__ import annotations

import logging
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import msgspec

from monitoring.slo import SloConfig, burn_alerts, burn_threshold, windows
from schemas.events import BudgetStateChanged, BurnRateCrossed, Event
from streams import StreamsError
from streams.queries import SLI_BAD, SLI_GOOD

SOURCE = "streams/control"
log = logging.getLogger(__name__)
NANOS_PER_MICRO = 1000


class BudgetError(StreamsError, ValueError):
    """The budgets file cannot be read."""


MAX_DAILY_USD = 9e12
"""The largest limit a ``BudgetStateChanged`` can carry (``limit_micros`` is an int64). An audit: ``inf``
(meant as "no limit") raised out of every control run and stopped the streams worker, and ``1e13``
announced a state no edge could decode, so a tenant cut off stayed refused after its limit was raised. A
tenant with no limit is one the file does not name."""


class Budgets(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Daily spend limits per tenant in USD (TOML: ``[daily_usd]`` then ``acme = 25.0``)."""

    daily_usd: dict[str, Annotated[float, msgspec.Meta(ge=0.0, le=MAX_DAILY_USD)]] = msgspec.field(
        default_factory=dict
    )

    def limit_micros(self, tenant: str) -> int | None:
        limit = self.daily_usd.get(tenant)
        return None if limit is None else round(limit * 1_000_000)


def load_budgets(path: str | Path | None) -> Budgets:
    if path is None:
        return Budgets()
    try:
        return msgspec.convert(tomllib.loads(Path(path).read_text(encoding="utf-8")), Budgets)
    except FileNotFoundError:
        raise BudgetError(f"budgets file {path} does not exist") from None
    except (tomllib.TOMLDecodeError, OSError, UnicodeDecodeError) as exc:
        raise BudgetError(f"budgets file {path}: {exc}") from exc
    except msgspec.ValidationError as exc:
        hint = " (a tenant without a limit is one the file does not name)" if "<=" in str(exc) else ""
        raise BudgetError(f"budgets file {path}: {exc}{hint}") from exc


@dataclass(frozen=True)
class WindowCounts:
    bad: int
    total: int

    @property
    def ratio(self) -> float:
        return self.bad / self.total if self.total else 0.0


class Controller:
    """Remembers the last announced state per key and emits events only on a change."""

    def __init__(self, budgets: Budgets, slo: SloConfig) -> None:
        self._budgets = budgets
        self._slo = slo
        self._exhausted: dict[str, bool] = {}
        self._firing: dict[tuple[str, str], bool] = {}
        self._pairs = burn_alerts(slo, "page")
        # The windows (minutes) burn() needs counts over: those of the page pairs, shortest first.
        self.windows = windows(slo, "page")
        shortest = min((a.long_minutes for a in self._pairs), default=0)
        self.fast_windows = frozenset(
            f"{a.long}/{a.short}" for a in self._pairs if a.long_minutes == shortest
        )
        """The fast burn's pairs (the page pairs with the shortest long window: 1h/5m by default), which the
        rollout's burn gate acts on."""
        for lowered in slo.lowered_thresholds():
            if lowered.slo == "availability" and lowered.alert in self._pairs:
                # a low target: the pair's own threshold is out of reach, and it announces above a lower one
                log.warning("BurnRateCrossed: %s", lowered.text)

    def seed(
        self, exhausted: Mapping[str, bool], firing: Mapping[tuple[str, str], bool] | None = None
    ) -> None:
        """The states last announced (read back from the control topic at start): budgets, so a tenant that
        was cut off and has since left the budgets file, or got a higher limit, is announced again; burn
        alerts by (model, window pair), so a burn that stopped while this process was down is announced as
        resolved, not left firing on the topic until the model crosses again."""
        self._exhausted.update(exhausted)
        self._firing.update(firing or {})

    def budgets(self, spent_nanos: Mapping[str, int]) -> list[Event]:
        """``spent_nanos``: today's spend per tenant. A state is announced when it differs from the last
        announced one (an unknown state counts as "not exhausted")."""
        events: list[Event] = []
        for tenant in sorted(set(self._budgets.daily_usd) | set(self._exhausted)):
            limit = self._budgets.limit_micros(tenant)
            spent = spent_nanos.get(tenant, 0) // NANOS_PER_MICRO
            exhausted = limit is not None and spent >= limit
            if self._exhausted.get(tenant, False) == exhausted:
                continue
            self._exhausted[tenant] = exhausted
            events.append(
                BudgetStateChanged(
                    tenant=tenant,
                    model="",
                    source=SOURCE,
                    limit_micros=limit or 0,
                    spent_micros=spent,
                    exhausted=exhausted,
                )
            )
        return events

    def unannounced(self, event: Event) -> None:
        """``event`` could not be published: forget the state it announced, so the next evaluation
        announces the state current then."""
        if isinstance(event, BudgetStateChanged):
            self._exhausted[event.tenant] = not event.exhausted
        elif isinstance(event, BurnRateCrossed):
            self._firing[(event.model, event.window)] = not event.firing

    def burn(self, counts: Mapping[tuple[str, int], WindowCounts]) -> list[Event]:
        """``counts[(model, minutes)]``: availability errors and eligible requests in that window, for each
        of :attr:`windows`."""
        events: list[Event] = []
        empty = WindowCounts(0, 0)
        # the models with requests in a window, and those last announced firing: one that has had none
        # since (after a restart, say) is announced resolved, not left firing on the topic (an audit)
        announced = {model for (model, _), fires in self._firing.items() if fires}
        current = {f"{alert.long}/{alert.short}" for alert in self._pairs}
        for model in sorted({model for model, _ in counts} | announced):
            tier = self._slo.tier_of(model)
            budget = 1.0 - tier.availability
            for alert in self._pairs:
                # as Prometheus' rule: lowered where the budget caps the burn rate under the pair's
                threshold = burn_threshold(alert, tier.window_days, budget)
                long_rate = counts.get((model, alert.long_minutes), empty).ratio / budget
                short_rate = counts.get((model, alert.short_minutes), empty).ratio / budget
                firing = long_rate > threshold and short_rate > threshold
                key = (model, f"{alert.long}/{alert.short}")
                if self._firing.get(key, False) == firing:
                    continue
                self._firing[key] = firing
                events.append(
                    _crossing(model, key[1], round(min(long_rate, short_rate), 3), threshold, firing)
                )
            # a pair the SLO file no longer has is evaluated no more: one it left firing is resolved, not
            # left firing on the compacted topic for good (a review)
            for (of, window), fires in list(self._firing.items()):
                if of == model and fires and window not in current:
                    self._firing[(of, window)] = False
                    events.append(_crossing(model, window, 0.0, 0.0, False))
        return events


def _crossing(model: str, window: str, burn_rate: float, threshold: float, firing: bool) -> BurnRateCrossed:
    return BurnRateCrossed(
        tenant="",
        model=model,
        source=SOURCE,
        slo="availability",
        window=window,
        burn_rate=burn_rate,
        threshold=threshold,
        firing=firing,
    )


SPEND_TODAY = (
    "SELECT tenant, sum(cost_nanos) AS spent FROM spend_day WHERE day = toDate(now(), 'UTC') GROUP BY tenant"
)


def burn_sql(minutes: int) -> str:
    """Availability errors and eligible requests per model over the last ``minutes``: the requests clients
    sent and waited for (no shadow copies, no lines of async batches: ``docs/streams.md``, Async batches),
    counted as every warehouse SLI counts them (:data:`streams.queries.SLI_BAD`: a client's error, such as
    a prompt too long for the worker, is in neither count)."""
    return (
        f"SELECT model, {int(minutes)} AS minutes, countIf({SLI_BAD}) AS bad, "  # noqa: S608
        f"countIf({SLI_GOOD} OR {SLI_BAD}) AS total FROM request_facts FINAL "
        f"WHERE finished >= now64(3) - INTERVAL {int(minutes)} MINUTE AND finished <= now64(3) "
        "AND shadow_of = '' AND batch_id = '' "
        "GROUP BY model"
    )
