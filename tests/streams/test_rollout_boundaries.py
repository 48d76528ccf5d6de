"""Boundaries of streams/rollout.py its other tests let pass: found by mutation testing, each test here fails
with a one-line change to it that the module's other tests did not notice."""

from __future__ import annotations

import msgspec
import pytest

from schemas.events import BatchRef, Usage
from streams.pricing import PriceTable
from streams.rollout import stats_of
from tests.streams.test_rollout import finished


def test_an_expired_batch_line_is_not_an_error_of_the_version_offline() -> None:
    """rollout.py:235 (``r["shadow_of"] or r["batch_id"]``): ``sluice rollout evaluate`` leaves an expired
    batch line out of n and errors, as the warehouse's stats_sql does (it waited in the batch lane)."""
    line = msgspec.structs.replace(
        finished(),
        request_id="b-1",
        status="expired",
        finish_reason=None,
        batch=BatchRef(batch_id="batch-1", custom_id="c-1", index=0),
    )
    found = stats_of([finished(), line], PriceTable())
    assert (found.n, found.errors) == (1, 0)


def test_a_failed_requests_tokens_are_not_billed_tokens_offline() -> None:
    """rollout.py:243 (``status != "failed"``): a failure is billed nothing; its tokens counted, a version
    failing more would look cheaper per token (the cost gate)."""
    failed = msgspec.structs.replace(
        finished(),
        request_id="r-2",
        status="failed",
        finish_reason=None,
        usage=Usage(prompt_tokens=100, completion_tokens=900, total_tokens=1000),
    )
    assert stats_of([finished(), failed], PriceTable()).tokens == 8


from streams.rollout import roll_back  # noqa: E402
from tests.streams.test_rollout import MODEL, Harness, canary, harness, with_members  # noqa: E402,F401


async def test_a_new_rollout_is_not_blamed_for_the_previous_ones_missing_worker(harness: Harness) -> None:  # noqa: F811
    """rollout.py:784 (``_unserved`` forgotten once a deployment is no longer a canary): a rollout aborted
    while its candidate had no worker; an hour later a new rollout's first look finds its worker not yet in
    the group: 0 s without one (insufficient data), not an hour (an immediate automatic rollback)."""
    counts: dict[str, int | None] = {"v2": 0}
    controller = with_members(harness, counts)
    first = canary(steps=[0.5])
    controller.seed([first])
    assert await controller.run_due() == []  # no worker for 0 s
    harness.later(10)
    controller.observe([roll_back(first, harness.now, "aborted", [], "operator")])
    assert await controller.run_due() == []
    harness.later(3600)
    controller.observe([canary(steps=[0.5], now=harness.now)])
    assert await controller.run_due() == []
    assert controller.last_results[MODEL][-1].state == "insufficient_data"


async def test_a_model_whose_judging_raised_is_judged_again(
    harness: Harness,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """rollout.py:872 (due again after an unexpected error): with no new outcome arriving, the timer alone
    must look again, or the step is stuck until traffic makes the model due."""
    import streams.rollout as rollout

    real = rollout.decide
    calls = []

    def flaky(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("boom")
        return real(*args, **kwargs)

    monkeypatch.setattr(rollout, "decide", flaky)
    controller = harness.controller()
    controller.seed([canary(steps=[0.5])])
    assert await controller.run_due() == []  # raised, logged
    harness.later(5)
    (promoted,) = await controller.run_due()
    assert promoted.phase == "promoted"


from tests.streams.test_rollout import by_gate, outputs  # noqa: E402


async def test_each_step_runs_its_own_drift_test(harness: Harness) -> None:  # noqa: F811
    """rollout.py:1039 (the kept verdict is the same deployment's): step 1's drift passed; at step 2 the
    candidate's answers changed: step 2's own test fails it, step 1's pass is not reused."""
    controller = harness.controller()
    controller.seed([canary()])
    (advanced,) = await controller.run_due()
    assert (advanced.phase, advanced.step) == ("canary", 1)
    assert by_gate(advanced.evidence)["drift"].state == "pass"
    harness.warehouse.outputs = [*outputs("v1"), *outputs("v2", empty=True)]
    harness.later(5)
    controller.observe([finished()])
    (decision,) = await controller.run_due()
    assert decision.action == "rollback"
    assert by_gate(decision.evidence)["drift"].state == "fail"


async def test_a_drift_test_short_of_pairs_is_run_again_as_they_arrive(harness: Harness) -> None:  # noqa: F811
    """rollout.py:1054 (only a pass or a fail is kept): 10 shadow pairs are too few (insufficient_data);
    once 100 have arrived the gate judges them and the step advances, not kept waiting for good."""
    harness.warehouse.outputs = [*outputs("v1", 10), *outputs("v2", 10)]
    controller = harness.controller()
    controller.seed([canary()])
    assert await controller.run_due() == []
    assert by_gate(controller.last_results[MODEL])["drift"].state == "insufficient_data"
    harness.warehouse.outputs = [*outputs("v1"), *outputs("v2")]
    harness.later(5)
    controller.observe([finished()])
    (advanced,) = await controller.run_due()
    assert by_gate(advanced.evidence)["drift"].state == "pass"
