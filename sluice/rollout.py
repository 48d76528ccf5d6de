"""``sluice rollout``: start, inspect, promote and abort rollouts, all as ``DeploymentChanged`` events.

The CLI never changes what serves by itself: it publishes a decision on the compacted control topic, and
edges, workers, ``sluice up`` and the rollout controller follow it. ``status`` recomputes the gates from
the warehouse with the controller's own functions, so what it shows is what the controller sees.
"""

from __future__ import annotations

import asyncio
from datetime import datetime
from pathlib import Path

import msgspec

from bus.control import latest_deployments, read_control
from bus.producer import EventProducer
from schemas import codec
from schemas.deployments import BUCKETS, buckets_of
from schemas.events import DeploymentChanged, Event, GateResult, RolloutGates, WorkerReady, utc_now
from schemas.manifest import ManifestError, current_model_dir, read_manifest, version_dir
from schemas.settings import PlatformSettings
from schemas.topics import TopicNames, worker_group
from streams.rollout import advance, in_progress, roll_back, serving_gate, start_rollout, step_gates

CLIENT_ID = "sluice-cli-rollout"
PHASE_COLOURS = {"rolled_back": "red", "warming": "cyan", "canary": "yellow", "promoted": "green"}
"""How the CLI and ``sluice up`` colour a deployment's phase."""
GATE_STYLES = {"fail": "red", "insufficient_data": "dim", "not_applicable": "cyan", "pass": "green"}
"""How the CLI colours a gate's state (``not_applicable``: counted as passed, but not measured)."""


class RolloutError(ValueError):
    """An operator request that cannot be carried out (the message says why and what to do)."""


def parse_steps(canary: float, steps: str) -> list[float]:
    """Shares from percentages: ``canary`` first, then the listed steps above it, ending at 100."""
    try:
        listed = [float(part) for part in steps.split(",") if part.strip()]
    except ValueError:
        raise RolloutError(
            f"--steps {steps!r}: expected comma-separated percentages, e.g. 5,25,50,100"
        ) from None
    if not 0 <= canary < 100:
        raise RolloutError(f"--canary {canary:g}: expected a percentage from 0 (shadow only) to below 100")
    if canary > 0 and not buckets_of(canary / 100):
        raise RolloutError(f"--canary {canary:g}: routes nothing (traffic is split in {BUCKETS:,} buckets); "
                           "at least 0.01, or 0 for shadow only")  # fmt: skip
    if buckets_of(canary / 100) >= BUCKETS:  # all of it: the stable version would have nothing to compare
        raise RolloutError(f"--canary {canary:g}: routes every request (traffic is split in {BUCKETS:,} "
                           "buckets); at most 99.99")  # fmt: skip
    # A step short of 100 must leave the stable version a bucket: one that rounds to all of them is no
    # promotion (it is still a canary step), and its gates would wait for stable samples that never come.
    if any(not (0 < p <= 100 and (p == 100 or 0 < buckets_of(p / 100) < BUCKETS)) for p in listed):
        raise RolloutError(f"--steps {steps!r}: every step must be at least 0.01 and at most 100 (short of "
                           f"100, at most 99.99: traffic is split in {BUCKETS:,} buckets)")  # fmt: skip
    shares = [canary, *sorted(p for p in set(listed) if p > canary)]
    if shares[-1] != 100:
        shares.append(100.0)
    return [round(p / 100, 6) for p in shares]


def current_version(platform: PlatformSettings, model: str) -> str:
    try:
        return read_manifest(current_model_dir(platform.cache_dir, model)).version
    except ManifestError as exc:
        raise RolloutError(f"{model}: {exc} (run `sluice models prepare`)") from None


def registered(platform: PlatformSettings, model: str, version: str) -> Path:
    """The directory of a registered ``version`` of ``model`` (:func:`schemas.manifest.version_dir`)."""
    try:
        return version_dir(platform.cache_dir, model, version)
    except ManifestError as exc:
        raise RolloutError(str(exc)) from None


def deployment_of(platform: PlatformSettings, model: str) -> DeploymentChanged | None:
    return latest_deployments(platform.kafka, TopicNames(platform.topic_prefix).control, CLIENT_ID).get(model)


def plan_start(
    platform: PlatformSettings,
    model: str,
    version: str,
    *,
    steps: list[float],
    shadow: float,
    gates: RolloutGates,
    now: datetime | None = None,
) -> DeploymentChanged:
    """The ``deploy`` event that starts a rollout of ``version``, after checking it can start."""
    if why := platform.unserved(model):
        raise RolloutError(why)
    if 0 < gates.step_max_s < gates.step_min_s:
        raise RolloutError(
            f"--step-max-s {gates.step_max_s:g} is shorter than --step-min-s {gates.step_min_s:g}: every step "
            "would be rolled back before it could pass (0 waits as long as it takes)"
        )
    registered(platform, model, version)
    latest = deployment_of(platform, model)
    if latest is not None and in_progress(latest):
        where = "warming up" if latest.phase == "warming" else f"step {latest.step + 1}/{len(latest.steps)}"
        raise RolloutError(
            f"a rollout of {model} {latest.candidate} is in progress ({where}): "
            "`sluice rollout promote` or `sluice rollout abort` it first"
        )
    stable = latest.stable if latest is not None and latest.stable else current_version(platform, model)
    if version == stable:
        raise RolloutError(f"{version} is already the stable version of {model}")
    if shadow > 0 and not buckets_of(shadow):
        raise RolloutError(f"--shadow {shadow * 100:g}: mirrors nothing (requests are split in {BUCKETS:,} "
                           "buckets); at least 0.01, or 0 for none")  # fmt: skip
    if not buckets_of(steps[0]) and not buckets_of(shadow):
        raise RolloutError(
            "--canary 0 without --shadow sends the candidate nothing: it could never pass a gate; "
            "give it a share (--canary 5) or shadow traffic (--shadow 20)"
        )
    return start_rollout(
        model,
        stable=stable,
        candidate=version,
        steps=steps,
        shadow=shadow,
        gates=gates,
        now=now or utc_now(),
        source="sluice/cli",
    )


def candidate_ready(platform: PlatformSettings, current: DeploymentChanged) -> WorkerReady | None:
    """The latest ``WorkerReady`` on the control topic of ``current``'s candidate naming ``current`` (the
    one the controller's :func:`streams.rollout.warm` takes; a worker says it again for every rollout that
    starts warming its version, so one naming an older deployment says nothing of a worker running now)."""
    candidate = current.candidate or current.version
    found = None
    for event in read_control(platform.kafka, TopicNames(platform.topic_prefix).control, CLIENT_ID):
        if isinstance(event, WorkerReady) and (event.deployment, event.version) == (current.id, candidate):
            found = event
    return found


def plan_promote(
    platform: PlatformSettings, model: str, *, to_end: bool, force: bool = False
) -> DeploymentChanged:
    """The operator's next step (or promotion with ``to_end``). Promotion while warming needs a worker of
    the candidate that said it is ready, unless ``force``: promoting makes the candidate the stable version,
    so ``sluice up`` stops the old stable version's workers at once, and a review saw demo-gpt served by no
    worker for 9.5 s until the candidate's first one had loaded (for good, had it been unable to load: the
    rollout no longer warming, nothing rolls it back). A ready announcement that lands just after this
    read only makes the operator wait for the first step; the controller takes it there within a fetch."""
    current = _active(platform, model)
    if to_end and current.phase == "warming" and not force:
        candidate = current.candidate or current.version
        ready = candidate_ready(platform, current)
        if ready is None or ready.error:
            why = (
                f"a worker of {candidate} cannot load it: {ready.error}"
                if ready is not None
                else f"no worker of {candidate} has said it is ready yet"
            )
            raise RolloutError(
                f"{model} is warming up and {why}; promoting to 100% now would stop the stable version's "
                f"({current.stable}) workers before any worker of {candidate} serves. Wait for the first step "
                "(`sluice rollout status`), or pass --force to promote anyway"
            )
    # --all: one decision from the step that runs (stepping through the rest named a step that never ran:
    # "promoted to 100% after step 2" from step 1; an audit)
    return advance(current, utc_now(), "promoted by the operator", [], "operator", to_end=to_end)


def plan_abort(platform: PlatformSettings, model: str, why: str) -> DeploymentChanged:
    current = _active(platform, model)
    return roll_back(current, utc_now(), f"aborted by the operator: {why}", [], "operator")


def _active(platform: PlatformSettings, model: str) -> DeploymentChanged:
    current = deployment_of(platform, model)
    if current is None or not in_progress(current):
        raise RolloutError(f"no rollout of {model} is in progress (see `sluice rollout status`)")
    return current


def publish(platform: PlatformSettings, event: Event) -> None:
    """Durable on the control topic before returning; refused when its consumers could not read it back (a
    decision with an ``inf`` gate was written with ``null`` there, said "rollout started", and every
    consumer skipped it: an audit)."""
    try:
        codec.decode(codec.encode(event))
    except codec.DecodeError as exc:
        raise RolloutError(f"this decision could not be read back by the platform: {exc}") from None

    async def send() -> None:
        producer = EventProducer(platform.kafka, "sluice/cli")
        producer.start()
        try:
            await producer.publish(TopicNames(platform.topic_prefix).control, event)
        finally:
            await asyncio.to_thread(producer.stop)

    asyncio.run(send())


def live_gates(platform: PlatformSettings, current: DeploymentChanged) -> list[GateResult]:
    """The gates of the current step as the controller computes them, from the warehouse."""
    from infra.warehouse import query_warehouse
    from schemas.settings import load_settings
    from streams.settings import StreamsSettings

    async def rows(sql: str) -> list[dict[str, object]]:
        result = await asyncio.to_thread(query_warehouse, platform, sql)
        return [dict(zip(result.columns, row, strict=True)) for row in result.rows]

    streams = load_settings(StreamsSettings)
    # The burn gate needs the model's BurnRateCrossed events, which only the controller follows: shown as
    # of the last decision's evidence (when it had one), not recomputed here.
    gates = msgspec.structs.replace(current.gates or RolloutGates(), burn=False)
    now = utc_now()
    began = min(current.step_started or current.time, now)  # a decider's clock ahead: not a step to come
    results = asyncio.run(
        step_gates(
            rows,
            msgspec.structs.replace(current, gates=gates, step_started=began),
            now,
            drift_alpha=streams.drift_alpha,
            drift_null_tolerance=streams.drift_null_tolerance,
        )
    )
    burn = [r for r in current.evidence if r.gate == "burn"] if (current.gates or RolloutGates()).burn else []
    return [*results, *burn, serving_now(platform, current)]


def serving_now(platform: PlatformSettings, current: DeploymentChanged) -> GateResult:
    """The ``serving`` gate as it stands: the candidate's workers in its group now (how long it has had
    none, which the controller's verdict depends on, only the controller knows)."""
    from bus.positions import group_members
    from infra.topics import make_admin

    candidate = current.candidate or current.version
    return serving_gate(
        group_members(make_admin(platform.kafka), worker_group(current.model, candidate)), candidate
    )
