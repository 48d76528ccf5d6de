"""The bookkeeping harness (``test_bookkeeping.py``) with versions: rollouts, rollbacks and promotions reach the worker
through its inbox (``_Deploy``), records are routed to either version (and shadow copies to the candidate),
and the other version's worker is modelled: it ends what is routed to it while its version serves, finishes
what it started when its version stops (before the grace), and, once stable, adopts or drops what the
retiring worker gives back (never what that worker runs or publishes)."""

from __future__ import annotations

import os
import time
from typing import Any

import pytest

from gpu_workers.runtime import Arrival
from gpu_workers.service import _Deploy
from schemas.codec import decode
from schemas.deployments import Deployment
from schemas.events import GenerationRequested, ReplyTo, RequestFinished, TokenChunk
from schemas.ids import uuid7
from tests.gpu_workers.test_bookkeeping import TOPIC, Harness, assert_quiet, quiesce, step

DRAIN_S = 5.0
"""The revoke's drain limit here: a revoke that waits for a record held for another version (which never
ends while held) runs to it. Long enough that a stall of a loaded box (CI) never does (0.25 s once did)."""
D0 = Deployment("m", "v")
D1 = Deployment("m", "v", "c", share=0.5, shadow=0.5)
DP = Deployment("m", "c")
NEXT = {D0: [D1], D1: [D0, DP], DP: [D0]}


class HV(Harness):
    def __init__(self, seed: int, own: str) -> None:
        super().__init__(seed)
        self.service.version = own
        self.service._adopt_grace_s = 0.0
        self.service.REVOKE_DRAIN_S = DRAIN_S
        self.service._deployment = D0
        self.own, self.peer = own, ("c" if own == "v" else "v")
        self.deployment = D0  # what the peer knows (at once)
        self.routed: dict[str, str] = {}  # request id -> version routed to
        self.stalls: list[str] = []

    def serving(self, version: str) -> bool:
        return version in self.deployment.serving

    def consume(self, part: int, fresh: bool) -> None:
        offset = self.model.next_offset[part]
        if (part, offset) not in self.model.records:
            if not fresh:
                return
            request_id = uuid7()
            self.model.records[(part, offset)] = request_id
            serving = sorted(self.deployment.serving)
            self.routed[request_id] = self.rng.choice(serving)
            shadow = (
                self.deployment.candidate is not None
                and self.deployment.shadow > 0
                and self.rng.random() < 0.3
            )
            if shadow:
                self.routed[request_id] = self.deployment.candidate  # type: ignore[assignment]
                self.shadows.add(request_id)
        request_id = self.model.records[(part, offset)]
        event = GenerationRequested(
            tenant="t", model="m", request_id=request_id, source="edge",
            model_version=self.routed[request_id], input_ids=[1],
            shadow_of="x" if request_id in self.shadows else None,
        )  # fmt: skip
        self.service._inbox.put_nowait(
            Arrival(event, (TOPIC, part), offset, generation=self.service._ledger.generation)
        )
        self.model.next_offset[part] = offset + 1

    shadows: set[str]

    def busy_here(self, request_id: str) -> bool:
        return (
            request_id in self.runner.running
            or request_id in self.runner.waiting
            or request_id in self.service._publishing
            or any(isinstance(a, Arrival) and a.event.request_id == request_id for a in self.service._again)
            or request_id in self.service._live
        )

    def peer_end(self, request_id: str) -> None:
        self.model.durable[request_id] += 1
        assert self.model.durable[request_id] == 1, f"{request_id} ended twice (by the peer)"
        self.service._finished_elsewhere.put(request_id)

    def peer_candidates(self) -> list[str]:
        """What the peer may end now: routed to its version while it serves; or, when the own version no
        longer serves (the peer is stable) and this worker has learned it, what this worker does not run."""
        out = []
        own_retired = not self.serving(self.own) and self.service._deployment == self.deployment
        for request_id, version in self.routed.items():
            if self.model.durable[request_id]:
                continue
            if not any(r == request_id for r in self.model.records.values()):
                continue
            if (version == self.peer and self.serving(self.peer) and not self.busy_here(request_id)) or (
                version == self.own and own_retired and not self.busy_here(request_id)
            ):
                out.append(request_id)
        return sorted(out)

    def deploy(self) -> None:
        new = self.rng.choice(NEXT[self.deployment])
        peer_was = self.serving(self.peer)
        self.deployment = new
        if peer_was and not self.serving(self.peer):
            # the peer finishes (some of) what it had started before this worker's grace runs out
            for request_id in self.peer_candidates_raw():
                if self.rng.random() < 0.5:
                    self.peer_end(request_id)
        self.service._inbox.put_nowait(_Deploy(new, uuid7()))

    def peer_candidates_raw(self) -> list[str]:
        return sorted(
            r for r, v in self.routed.items()
            if v == self.peer and not self.model.durable[r] and not self.busy_here(r)
            and any(x == r for x in self.model.records.values())
        )  # fmt: skip

    def revoke(self, part: int) -> None:
        ledger = self.service._ledger
        hand_over, gave_up = ledger.hand_over, []

        def told(*args: Any, **kwargs: Any) -> tuple[int, dict[tuple[str, int], int]]:
            began = time.monotonic()
            busy, points = hand_over(*args, **kwargs)
            gave_up.append(busy > 0 or time.monotonic() - began >= DRAIN_S)
            return busy, points

        ledger.hand_over = told  # type: ignore[method-assign]
        try:
            super().revoke(part)
        finally:
            del ledger.hand_over
        if any(gave_up):
            self.stalls.append(f"revoke of {part} ran to its drain limit")


@pytest.mark.parametrize("own", ["v", "c"])
@pytest.mark.parametrize("seed", range(int(os.environ.get("SLUICE_TEST_SEEDS", "100"))))
def test_versions(seed: int, own: str) -> None:
    h = HV(seed, own)
    h.shadows = set()
    rng = h.rng
    for _ in range(400):
        action = rng.choices(
            ["consume", "drain", "start", "finish", "deliver", "commit", "revoke", "assign", "cancel", "lose",
             "deploy", "peer", "refuse", "steal", "dup"],
            weights=[20, 15, 10, 10, 15, 8, 2, 3, 2, 2, 3, 6, 1, 1, 5],
        )[0]  # fmt: skip
        if step(h, action):
            continue
        if action == "deploy":
            h.deploy()
        elif action == "peer":
            candidates = h.peer_candidates()
            if candidates:
                h.peer_end(rng.choice(candidates))
                h.model_thread_step()  # its tail (before this worker could finish it: see busy_here)
        elif action == "steal":
            candidates = sorted(r for r in h.service._live if h.model.durable[r] == 0)
            if candidates:
                h.peer_end(rng.choice(candidates))
                h.model_thread_step()
        elif action == "dup" and h.model.assigned:
            pool = sorted(set(h.service._live) | set(h.service._publishing) | set(h.service._held))
            if pool:
                request_id = rng.choice(pool)
                homes = [
                    p for (p, _), r in h.model.records.items() if r == request_id and p in h.model.assigned
                ]
                if homes:
                    part = rng.choice(homes)
                    offset = h.model.next_offset[part]
                    if (part, offset) not in h.model.records:
                        h.model.records[(part, offset)] = request_id
                        h.consume(part, fresh=False)

    # Quiesce: the peer ends what is its own, this worker everything else.
    def peer_round() -> None:
        h.service._next_sweep = 0.0
        h.model_thread_step()
        for request_id in h.peer_candidates():
            h.peer_end(request_id)
        h.service._next_sweep = 0.0

    quiesce(h, rounds=60, each=peer_round)
    assert_quiet(h)
    assert not h.stalls, h.stalls


@pytest.mark.parametrize("streamed", [False, True], ids=["held", "streamed"])
def test_what_still_runs_half_the_grace_after_a_rollback_is_cut(streamed: bool) -> None:
    """The candidate's worker, rolled back while a request of it runs: the request may still end here for
    half the adopt grace, then it is cut, so that it cannot end here and on the stable version both (a
    generation longer than the grace, or one finishing in a retiring worker's 20 s drain, used to run on
    here after the adoption, and the two runs ending within the results tail's lag ended it twice). Cut
    without a terminal event and held for the stable version to run again; or, where part of its answer
    was already streamed (the stable version's run would go on from another model's text), ended here
    ``failed`` with ``version_retired``, retriable."""
    h = HV(0, "c")
    h.service._adopt_grace_s = 10.0
    h.service.COMMIT_INTERVAL_S = 0.0
    h.deployment = D1
    h.service._inbox.put_nowait(_Deploy(D1, uuid7()))
    h.model_thread_step()
    request_id = uuid7()
    h.model.records[(0, 0)] = request_id
    event = GenerationRequested(
        tenant="t", model="m", request_id=request_id, source="edge", model_version="c", input_ids=[1],
        stream=streamed, reply=ReplyTo(topic="p.replies", partition=0, edge_id="e") if streamed else None,
    )  # fmt: skip
    arrival = Arrival(event, (TOPIC, 0), 0, generation=h.service._ledger.generation)
    h.service._inbox.put_nowait(arrival)
    h.model.next_offset[0] = 1
    h.model_thread_step()
    h.runner.start(request_id)
    if streamed:
        chunk = TokenChunk(
            tenant="t", model="m", request_id=request_id, source="w", seq=0, offset=0, token_ids=[7], text="x"
        )
        h.service._publish_chunk(arrival, chunk)
    h.deployment = D0  # rolled back
    h.service._inbox.put_nowait(_Deploy(D0, uuid7()))
    h.model_thread_step()
    h.model_thread_step()
    assert request_id in h.runner.running, "within half the grace it may still finish here"
    assert h.service._left_serving.get("c") is not None
    h.service._left_serving["c"] -= 5.0  # half the grace has passed
    h.model_thread_step()
    assert request_id not in h.runner.running, "still running past half the grace: it could end twice"
    if streamed:
        assert h.service.held == 0
        (index,) = [
            i for i, (topic, _, _) in enumerate(h.producer.pending) if topic == h.service._names.results
        ]
        _, value, _ = h.producer.pending[index]
        ended = decode(value)
        assert isinstance(ended, RequestFinished)
        assert ended.status == "failed"
        assert ended.error is not None
        assert (ended.error.code, ended.error.retriable) == ("version_retired", True)
        assert (ended.usage.prompt_tokens, ended.usage.completion_tokens) == (1, 1), (
            "what it streamed is counted"
        )
        assert ended.timings.accepted == event.time
        assert ended.timings.first_token is not None, "the client had a first token (an audit: none)"
        while h.producer.pending:
            h.deliver(0, ok=True)
    else:
        assert h.service.held == 1
        assert not h.producer.pending, "cut without a terminal event"
        h.service._commit()
        assert h.model.committed[0] == 0
        h.peer_end(request_id)  # the stable version adopted it and ended it
        h.model_thread_step()
    h.service._commit()
    assert h.service.held == 0
    assert h.model.committed[0] == 1
    assert h.model.durable[request_id] == 1
    assert not h.service._observer._stays, "nothing left of it in the worker's per-request bookkeeping"


def test_an_adopt_grace_under_its_least_is_refused_at_start() -> None:
    """Half the grace is the margin for the two versions' workers seeing the change at different times: a
    grace of 0 let the retiring version finish a request the stable version had adopted (it ended on both)."""
    from gpu_workers.settings import ADOPT_GRACE_MIN_S, WorkerSettings
    from schemas.settings import SettingsError, load_settings

    for grace in ("0", "0.5"):
        with pytest.raises(SettingsError, match="worker_adopt_grace_s"):
            load_settings(WorkerSettings, {"SLUICE_WORKER_ADOPT_GRACE_S": grace})
    least = load_settings(WorkerSettings, {"SLUICE_WORKER_ADOPT_GRACE_S": str(ADOPT_GRACE_MIN_S)})
    assert least.worker_adopt_grace_s == ADOPT_GRACE_MIN_S == 1.0
