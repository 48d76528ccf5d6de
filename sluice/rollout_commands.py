"""``sluice rollout ...``: the operator's commands (start, evaluate, promote, abort, status).

What each does lives in :mod:`sluice.rollout` (plans, gates) and :mod:`streams.rollout` (the controller's
rules); this module is only the command line, and imports them when a command runs, so ``sluice --help``
stays quick.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table

from schemas.events import MAX_GATE_RATIO, MAX_GATE_REQUESTS, MAX_GATE_SECONDS
from sluice.groups import command_group

if TYPE_CHECKING:
    from collections.abc import Callable

    from schemas.events import DeploymentChanged, RolloutGates

rollout_app = command_group(
    help="Roll a model version out step by step (canary, shadow), with gates that promote or roll back "
    "by themselves. Every command publishes a DeploymentChanged on the control topic."
)


# The gates' limits, shared by `rollout start` (live traffic) and `rollout evaluate` (logged requests).
MaxErrorDelta = Annotated[
    float, typer.Option("--max-error-delta", min=0, max=1, help="allowed error-ratio excess over stable")
]
MaxTtftRatio = Annotated[
    float, typer.Option("--max-ttft-ratio", min=1, max=MAX_GATE_RATIO, help="TTFT p99 limit, x stable's")
]
MaxItlRatio = Annotated[
    float, typer.Option("--max-itl-ratio", min=1, max=MAX_GATE_RATIO, help="ITL p99 limit, x stable's")
]
MaxCostRatio = Annotated[
    float,
    typer.Option("--max-cost-ratio", min=1, max=MAX_GATE_RATIO, help="cost per 1k tokens limit, x stable's"),
]


def _gates(
    min_requests: int,
    max_error_delta: float,
    max_ttft_ratio: float,
    max_itl_ratio: float,
    max_cost_ratio: float,
    **more: Any,
) -> RolloutGates:
    """The gates, from the limits both ``start`` and ``evaluate`` take and ``more`` of their fields."""
    from schemas.events import RolloutGates

    return RolloutGates(
        min_requests=min_requests,
        max_error_delta=max_error_delta,
        max_ttft_p99_ratio=max_ttft_ratio,
        max_itl_p99_ratio=max_itl_ratio,
        max_cost_ratio=max_cost_ratio,
        **more,
    )


def _rollout_call(action: Callable[[], DeploymentChanged]) -> None:
    """Plan a decision, publish it, say what changed; operator errors are one red line."""
    from bus.errors import BusError
    from sluice.cli import console, out, settings
    from sluice.rollout import RolloutError, deployment_of, publish

    platform = settings()
    try:
        decision = action()
        publish(platform, decision)
        # Another decision may have landed after the one this was derived from (two operators, or the
        # controller): the log's order is what serves. An audit: an abort and a promote raced, both said
        # done, and the abort, behind the promote on the log, served.
        latest = deployment_of(platform, decision.model)
    except RolloutError as exc:
        console.print(f"[red]error:[/] {exc}")
        raise typer.Exit(2) from None
    except BusError as exc:
        console.print(
            f"[red]error:[/] cannot reach Kafka at {platform.bootstrap}: {exc} (is `sluice up` running?)"
        )
        raise typer.Exit(1) from None
    traffic = ", ".join(f"{v} {share:.0%}" for v, share in decision.traffic.items())
    by_controller = (
        latest is not None and latest.actor == "controller" and latest.rollout_id == decision.rollout_id
    )
    carried = by_controller and (
        # the controller took the rollout this started on (its first step, often within a second), or
        # published this decision again, its own step having landed after it (a review: "superseded", exit
        # 1, for the very decision that serves)
        decision.phase == "warming" or (latest is not None and _same_routing(latest, decision))
    )
    if latest is not None and latest.id != decision.id and not carried:
        console.print(
            f"[yellow]superseded:[/] {decision.model}'s {decision.action} -> {decision.phase} was written, but "
            f"a later decision is behind it on the control topic and serves: {latest.action} -> "
            f"{latest.phase} by {latest.actor or 'an operator'} ({latest.reason}). See `sluice rollout status`."
        )
        raise typer.Exit(1)
    out.print(f"[bold]{decision.model}[/]: {decision.action} -> {decision.phase}; traffic {traffic}")
    out.print(f"  {decision.reason}")
    if carried and latest is not None and latest.id != decision.id:
        out.print(f"  since then, by the controller: {latest.action} -> {latest.phase} ({latest.reason})")


@rollout_app.command("start")
def rollout_start(
    model: Annotated[str, typer.Argument(help="the model id, e.g. demo-gpt")],
    version: Annotated[str, typer.Option("--version", help="the candidate version (`sluice models list`)")],
    canary: Annotated[
        float,
        typer.Option(
            "--canary", min=0, max=99.99, help="% of traffic on the candidate at step 1 (0: shadow only)"
        ),
    ] = 5.0,
    steps: Annotated[
        str, typer.Option("--steps", help="later steps in %, comma-separated; 100 (promotion) is added")
    ] = "25,50,100",
    shadow: Annotated[
        float, typer.Option("--shadow", min=0, max=100, help="% of the stable version's requests mirrored")
    ] = 0.0,
    min_requests: Annotated[
        int,
        typer.Option(
            "--min-requests",
            min=1,
            max=MAX_GATE_REQUESTS,
            help="requests per version per step before gates decide (the drift gate reads at most 1,000 "
            "shadow pairs, and needs no more)",
        ),
    ] = 50,
    max_error_delta: MaxErrorDelta = 0.05,
    max_ttft_ratio: MaxTtftRatio = 1.5,
    max_itl_ratio: MaxItlRatio = 1.5,
    max_cost_ratio: MaxCostRatio = 1.25,
    step_min_s: Annotated[
        float,
        typer.Option("--step-min-s", min=0, max=MAX_GATE_SECONDS, help="seconds each step lasts at least"),
    ] = 60.0,
    step_max_s: Annotated[
        float,
        typer.Option(
            "--step-max-s",
            min=0,
            max=MAX_GATE_SECONDS,
            help="seconds a step may wait for its gates' data; still inconclusive then, it is rolled back "
            "(0: as long as it takes)",
        ),
    ] = 0.0,
    drift_gate: Annotated[
        bool,
        typer.Option(
            "--drift-gate/--no-drift-gate",
            help="fail when the candidate answers its shadow copies unlike the stable version (needs --shadow)",
        ),
    ] = True,
    min_cosine: Annotated[
        float,
        typer.Option(
            "--min-cosine",
            min=-1,
            max=1,
            help="embeddings models' drift gate: the cosine to the stable version's vector for the same input "
            "that 95 % of the shadow pairs must reach",
        ),
    ] = 0.99,
    burn_gate: Annotated[
        bool, typer.Option("--burn-gate/--no-burn-gate", help="fail on the model's fast burn")
    ] = True,
    ready_timeout_s: Annotated[
        float,
        typer.Option(
            "--ready-timeout-s",
            min=1,
            max=MAX_GATE_SECONDS,
            help="seconds the candidate's workers may take to load; then rolled back",
        ),
    ] = 600.0,
) -> None:
    """Start rolling VERSION out: once a worker of VERSION is ready, --canary % of traffic (sticky per tenant
    and X-Session-Id / user), then each step of --steps once its gates pass; any failed gate rolls back by
    itself."""
    from sluice.cli import settings
    from sluice.rollout import parse_steps, plan_start

    gates = _gates(
        min_requests,
        max_error_delta,
        max_ttft_ratio,
        max_itl_ratio,
        max_cost_ratio,
        drift=drift_gate,
        min_cosine=min_cosine,
        burn=burn_gate,
        step_min_s=step_min_s,
        step_max_s=step_max_s,
        ready_timeout_s=ready_timeout_s,
    )

    def plan() -> DeploymentChanged:
        return plan_start(
            settings(), model, version, steps=parse_steps(canary, steps), shadow=shadow / 100, gates=gates
        )

    _rollout_call(plan)
    if drift_gate:
        from sluice.cli import out

        out.print(
            "  drift gate: at each step, once the other gates pass, the candidate's answers to its shadow copies "
            f"are compared with the stable version's answers to the originals ({min(min_requests, 1000)} pairs "
            "needed; "
            f"an embeddings model's vectors: 95 % of the pairs at cosine >= {min_cosine:g}, 1 in "
            "SLUICE_DRIFT_SAMPLE pairs carries them)"
            if shadow
            else "  [yellow]drift gate: not applicable without --shadow[/] (it compares the candidate's answers to "
            "shadow copies with the stable version's answers to the same requests)"
        )


@rollout_app.command("evaluate")
def rollout_evaluate(
    model: Annotated[str, typer.Argument(help="the model id")],
    version: Annotated[str, typer.Option("--version", help="the candidate version (`sluice models list`)")],
    from_log: Annotated[
        str, typer.Option("--from-log", help="logged requests accepted within this long: 30m, 1h, 2d")
    ] = "1h",
    limit: Annotated[
        int,
        typer.Option(
            "--limit",
            min=1,
            help="the oldest this many requests of the window, over all partitions (shadow copies and batch "
            "lines are skipped)",
        ),
    ] = 500,
    min_requests: Annotated[
        int,
        typer.Option(
            "--min-requests", min=1, max=MAX_GATE_REQUESTS, help="fewer logged requests: insufficient_data"
        ),
    ] = 20,
    max_error_delta: MaxErrorDelta = 0.05,
    max_ttft_ratio: MaxTtftRatio = 1.5,
    max_itl_ratio: MaxItlRatio = 1.5,
    max_cost_ratio: MaxCostRatio = 1.25,
    json_out: Annotated[Path | None, typer.Option("--json", help="also write the evaluation here")] = None,
) -> None:
    """Before any live traffic: run the requests logged for MODEL through the stable version and VERSION in
    this process, and judge VERSION with the rollout gates (error ratio, TTFT and ITL p99, cost per 1k
    tokens) plus how often both answer the same. Exit 0 when every gate passes or does not apply to the model
    (an embeddings model has no inter-token gap, and its TTFT gate judges end-to-end latency), 1 when one
    does not."""
    import msgspec
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    from bus.errors import BusError
    from gpu_workers.settings import WorkerSettings
    from schemas.settings import load_settings
    from sluice.cli import _cell, console, out, settings
    from sluice.evaluate import evaluate, parse_duration
    from sluice.rollout import GATE_STYLES, RolloutError

    gates = _gates(
        min_requests, max_error_delta, max_ttft_ratio, max_itl_ratio, max_cost_ratio, drift=False, burn=False
    )
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn())
    with Progress(*columns, console=console, transient=True) as bar:
        tasks: dict[str, Any] = {}

        def progress(name: str, done: int, total: int) -> None:
            if name not in tasks:
                tasks[name] = bar.add_task(f"{name} version", total=total)
            bar.update(tasks[name], completed=done)

        try:
            result = evaluate(
                settings(),
                model,
                version,
                window=parse_duration(from_log),
                limit=limit,
                gates=gates,
                worker=load_settings(WorkerSettings),
                progress=progress,
            )
        except RolloutError as exc:
            console.print(f"[red]error:[/] {exc}")
            raise typer.Exit(2) from None
        except BusError as exc:
            console.print(f"[red]error:[/] cannot read the log: {exc} (is `sluice up` running?)")
            raise typer.Exit(1) from None
    title = (
        f"{model}: {result.candidate} vs stable {result.stable} on {result.requests} logged requests "
        f"(stable {result.seconds['stable']:.1f}s, candidate {result.seconds['candidate']:.1f}s)"
    )
    table = Table("gate", "state", "candidate", "stable", "limit", "detail", title=title)
    # A review: with too few logged requests every gate read insufficient_data with an empty detail, and
    # the summary said only "not every gate passed"; each such gate now says why.
    too_few = (
        f"{result.requests} logged requests < --min-requests {min_requests}"
        if result.requests < min_requests
        else ""
    )
    for g in result.gates:
        table.add_row(
            g.gate,
            g.state,
            _cell(g.candidate),
            _cell(g.baseline),
            _cell(g.limit),
            g.detail or (too_few if g.state == "insufficient_data" else ""),
            style=GATE_STYLES.get(g.state, ""),
        )
    out.print(table)
    out.print(f"same output as the stable version: {result.same_output:.1%}")
    if json_out is not None:
        json_out.write_bytes(msgspec.json.format(msgspec.json.encode(result), indent=2) + b"\n")
    skipped = [g.gate for g in result.gates if g.state == "not_applicable"]
    if result.passed:
        out.print(
            "[green]every gate passed[/]" + (f" ({', '.join(skipped)}: not applicable)" if skipped else "")
        )
        # a review: a model whose answers matched the stable version's 1.4% of the time passed here, and
        # the drift gate rolled it back live; the summary says what this could not judge
        out.print(
            f"[dim]errors, latency and cost only: the drift and burn-rate gates judge live traffic (answers "
            f"differed from the stable version's on {1 - result.same_output:.1%} of these requests; "
            f"`sluice rollout start {model} --version {result.candidate} --shadow 100 --canary 0` lets "
            "them judge before any client sees it)[/]"
        )
    elif too_few:
        out.print(
            f"[red]not every gate passed:[/] {too_few} (widen --from-log, send traffic, or lower "
            "--min-requests)"
        )
    else:
        out.print("[red]not every gate passed[/]")
    raise typer.Exit(0 if result.passed else 1)


@rollout_app.command("promote")
def rollout_promote(
    model: Annotated[str, typer.Argument(help="the model id")],
    to_end: Annotated[bool, typer.Option("--all", help="straight to 100% instead of the next step")] = False,
    force: Annotated[
        bool,
        typer.Option(
            "--force",
            help="with --all while warming up: promote though no worker of the candidate has said it is ready",
        ),
    ] = False,
) -> None:
    """Move the rollout to its next step now (or to 100% with --all), whatever the gates say. --all while
    the rollout warms up is refused (exit 2) until a worker of the candidate has said it is ready, unless
    --force: promotion stops the stable version's workers at once."""
    from sluice.cli import settings
    from sluice.rollout import plan_promote

    _rollout_call(lambda: plan_promote(settings(), model, to_end=to_end, force=force))


@rollout_app.command("abort")
def rollout_abort(
    model: Annotated[str, typer.Argument(help="the model id")],
    reason: Annotated[str, typer.Option("--reason", help="recorded in the decision and the audit log")] = "",
) -> None:
    """Roll back now: all traffic to the stable version; requests routed to the candidate that have not
    run yet run on the stable version."""
    from sluice.cli import settings
    from sluice.rollout import plan_abort

    _rollout_call(lambda: plan_abort(settings(), model, reason or "no reason given"))


@rollout_app.command("status")
def rollout_status(
    model: Annotated[str | None, typer.Argument(help="only this model")] = None,
) -> None:
    """Each model's deployment (phase, traffic, step) and, during a rollout, its gates right now."""
    from bus.control import latest_deployments
    from bus.errors import BusError
    from infra.warehouse import WarehouseError
    from schemas.events import RolloutGates, utc_now
    from schemas.topics import TopicNames
    from sluice.cli import console, out, settings
    from sluice.rollout import CLIENT_ID, GATE_STYLES, PHASE_COLOURS, live_gates
    from streams.rollout import step_age

    platform = settings()
    try:
        latest = latest_deployments(platform.kafka, TopicNames(platform.topic_prefix).control, CLIENT_ID)
    except BusError as exc:
        console.print(f"[red]error:[/] cannot read the control topic: {exc} (is `sluice up` running?)")
        raise typer.Exit(1) from None
    shown = [d for m, d in sorted(latest.items()) if model is None or m == model]
    if not shown and model is not None and (why := platform.unserved(model)):
        # neither served here nor deployed on the cluster (the CLI's SLUICE_MODELS may not be the cluster's)
        console.print(f"[red]error:[/] {why}")
        raise typer.Exit(2)
    if not shown:
        out.print("no rollouts yet" + (f" for {model}" if model else "") + " (`sluice rollout start --help`)")
        return
    table = Table("model", "phase", "stable", "candidate", "traffic", "step", "shadow", "since", "reason")
    for d in shown:
        # the stable version first; a promoted candidate is the stable version now, not a candidate
        ordered = sorted(d.traffic.items(), key=lambda item: (item[0] != d.stable, item[0]))
        traffic = ", ".join(f"{v} {s:.0%}" for v, s in ordered)
        # warming: no step has begun (it read "1/3", as if the first step's traffic were going: a review)
        step = "" if not d.steps else "-" if d.phase == "warming" else f"{d.step + 1}/{len(d.steps)}"
        colour = PHASE_COLOURS.get(d.phase, "")
        table.add_row(
            d.model,
            d.phase,
            d.stable,
            d.candidate if d.candidate and d.candidate != d.stable else "-",
            traffic,
            step,
            f"{d.shadow:.0%}",
            d.time.isoformat(timespec="seconds"),
            d.reason,
            style=colour,
        )
    out.print(table)
    for d in shown:
        if d.phase == "warming":
            waited = step_age(d, utc_now())
            limit = (d.gates or RolloutGates()).ready_timeout_s
            out.print(
                f"{d.model}: waiting for a worker of {d.candidate} to be ready ({waited:.0f}s of {limit:g}s; "
                "no traffic until then, rolled back after)"
            )
        deadline = (d.gates or RolloutGates()).step_max_s
        if d.phase == "canary" and deadline > 0:
            waited = max(0.0, step_age(d, utc_now()))
            out.print(
                f"{d.model}: step {d.step + 1} has run {waited:.0f}s of its {deadline:g}s deadline "
                "(still inconclusive then: rolled back)"
            )
        gates = d.evidence
        title = f"{d.model}: gates of the last decision"
        if d.phase == "canary":
            try:
                gates, title = live_gates(platform, d), f"{d.model}: gates of step {d.step + 1} now"
            except WarehouseError as exc:
                console.print(f"[yellow]gates unavailable:[/] {exc}")
        if not gates:
            continue
        gate_table = Table(
            "gate", "state", "candidate", "stable", "limit", "n (cand/stable)", "detail", title=title
        )
        for g in gates:
            gate_table.add_row(
                g.gate,
                g.state,
                _gate_value(g.candidate),
                _gate_value(g.baseline),
                _gate_value(g.limit),
                f"{g.candidate_n}/{g.baseline_n}",
                g.detail,
                style=GATE_STYLES.get(g.state, ""),
            )
        out.print(gate_table)


def _gate_value(value: float | None) -> str:
    """A gate's number as a person reads it: six significant digits, ``-`` for none."""
    return "-" if value is None else f"{value:.6g}"


def _same_routing(a: DeploymentChanged, b: DeploymentChanged) -> bool:
    return (a.phase, a.stable, a.traffic, a.shadow) == (b.phase, b.stable, b.traffic, b.shadow)
