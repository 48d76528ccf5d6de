"""``sluice rollout evaluate``: a candidate version on logged production requests, before live traffic.

The requests come from the model's request topic (``--from-log 1h``: those accepted in the last hour; the
events hold the tokenised prompts, so no content store is needed); ``--limit N`` keeps the N oldest of them
over all partitions. Shadow copies, lines of async batches and requests of other models are skipped: a
shadow copy repeats a logged request, and one batch can log tens of thousands of lines of one tenant, which
would crowd the interactive requests out of the oldest N. Both the stable and the candidate versions run them offline in this process
(``gpu_workers.evaluate``), and the rollout gates compare the two runs as the controller would compare
live traffic, plus how often the candidate's output equals the stable version's.
"""

from __future__ import annotations

import heapq
import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta

from confluent_kafka import Consumer, TopicPartition

from bus.consumer import consumer_config
from bus.positions import read_to_end, watermarks
from gpu_workers.settings import WorkerSettings
from schemas.codec import DecodeError, decode
from schemas.events import (
    EmbeddingRequested,
    GateResult,
    GenerationRequested,
    RequestFinished,
    RolloutGates,
    utc_now,
)
from schemas.manifest import models_root
from schemas.settings import PlatformSettings
from schemas.topics import TopicNames
from sluice.rollout import RolloutError, current_version, deployment_of, registered

Logged = GenerationRequested | EmbeddingRequested
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhd])$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
MAX_WINDOW = timedelta(days=3650)
"""The longest ``--from-log`` window: a request topic keeps days of log, and a start a few thousand
years back is past what ``datetime`` holds."""


def parse_duration(text: str) -> timedelta:
    """``90s``, ``30m``, ``1h``, ``2d``."""
    match = _DURATION.match(text.strip())
    if match is None:
        raise RolloutError(f"--from-log {text!r}: expected a duration such as 30m, 1h or 2d")
    seconds = float(match.group(1)) * _UNITS[match.group(2)]
    if seconds > MAX_WINDOW.total_seconds():  # an audit: 1000000000d was an OverflowError's traceback
        raise RolloutError(f"--from-log {text!r}: at most {MAX_WINDOW.days} days (the log keeps less)")
    return timedelta(seconds=seconds)


def logged_requests(
    platform: PlatformSettings, model: str, since: datetime, limit: int, timeout_s: float = 60.0
) -> list[Logged]:
    """The ``limit`` oldest requests for ``model`` accepted since ``since``, oldest first, over all the
    topic's partitions; no shadow copies and no batch lines (a :class:`BatchItemRequested`, not a
    :data:`Logged` event).

    The window is read to its end: the consumer hands records back partition by partition, and requests are
    keyed by tenant, so stopping at the first ``limit`` (as before a review) judged a candidate on the one or
    two tenants of the partitions read first. A heap of the ``limit`` oldest seen keeps memory bounded, and
    a partition is read only until it has given ``limit`` requests: its records come in the order they were
    accepted, so the ``limit`` oldest overall are among each partition's first ``limit`` (a review: reading
    a busy topic's whole hour failed on the read's timeout)."""
    topic = TopicNames(platform.topic_prefix).requests(model)
    consumer = Consumer(consumer_config(platform.kafka, None, "sluice-evaluate"))
    # A max-heap by time (both keys negated), so the newest of the kept requests is the one to drop; the
    # read order breaks ties in time (the first read is kept), and two events are never compared.
    oldest: list[tuple[float, int, Logged]] = []
    seen = 0
    try:
        meta = consumer.list_topics(topic, timeout=10).topics.get(topic)
        if meta is None or meta.error is not None:
            raise RolloutError(f"no request topic {topic}: is {model} served?")
        since_ms = int(since.timestamp() * 1000)
        starts = consumer.offsets_for_times([TopicPartition(topic, p, since_ms) for p in meta.partitions], 10)
        ends = {p: watermarks(consumer, topic, p)[1] for p in meta.partitions}
        given = dict.fromkeys(ends, 0)  # per partition, its requests read
        for message in read_to_end(consumer, starts, ends, timeout_s):
            part = message.partition() or 0
            if given.get(part, 0) >= limit:
                continue  # read past its end just cut (below)
            try:
                event = decode(message.value() or b"")
            except DecodeError:
                continue
            if isinstance(event, Logged) and event.model == model and event.shadow_of is None:
                given[part] = given.get(part, 0) + 1
                if given[part] >= limit:  # read_to_end reads ``ends`` as it goes: the partition is done
                    ends[part] = min(ends[part], (message.offset() or 0) + 1)
                seen += 1
                item = (-event.time.timestamp(), -seen, event)
                if len(oldest) < limit:
                    heapq.heappush(oldest, item)
                elif item > oldest[0]:  # older than the newest kept
                    heapq.heapreplace(oldest, item)
    finally:
        consumer.close()
    return [event for _, _, event in sorted(oldest, key=lambda item: (item[0], item[1]), reverse=True)]


@dataclass(frozen=True)
class Evaluation:
    model: str
    stable: str
    candidate: str
    requests: int
    gates: list[GateResult]
    same_output: float
    """Share of requests whose output (text, or vectors to 4 decimals) is the same on both versions."""
    seconds: dict[str, float]

    @property
    def passed(self) -> bool:
        """Every gate passed or does not apply to the model (an embedding has no inter-token gap)."""
        from streams.rollout import passes

        return all(passes(g) for g in self.gates)


def evaluate(
    platform: PlatformSettings,
    model: str,
    version: str,
    *,
    window: timedelta,
    limit: int,
    gates: RolloutGates,
    worker: WorkerSettings,
    progress: Callable[[str, int, int], None] | None = None,
) -> Evaluation:
    """Run the logged requests on the stable version and on ``version``; judge the candidate."""
    from gpu_workers.evaluate import run_offline
    from schemas.settings import load_settings
    from streams.pricing import load_prices
    from streams.rollout import judge, stats_of
    from streams.settings import StreamsSettings

    candidate_dir = registered(platform, model, version)
    deployment = deployment_of(platform, model)
    stable = (
        deployment.stable
        if deployment is not None and deployment.stable
        else current_version(platform, model)
    )
    if stable == version:
        raise RolloutError(f"{version} is the stable version of {model}: nothing to compare it with")
    requests = logged_requests(platform, model, utc_now() - window, limit)
    if not requests:
        raise RolloutError(
            f"no logged requests for {model} in the last {window}: send traffic or widen --from-log"
        )
    prices = load_prices(load_settings(StreamsSettings).streams_prices_file)
    runs = {}
    for name, directory in (
        ("stable", models_root(platform.cache_dir) / model / stable),
        ("candidate", candidate_dir),
    ):
        done = [0]

        def step(n: int, name: str = name, done: list[int] = done) -> None:
            done[0] += n
            if progress is not None:
                progress(name, done[0], len(requests))

        runs[name] = run_offline(directory, requests, worker, progress=step)
    base, cand = runs["stable"].results, runs["candidate"].results
    same = sum(_output(a) == _output(b) for a, b in zip(base, cand, strict=True)) / len(requests)
    return Evaluation(
        model=model,
        stable=stable,
        candidate=version,
        requests=len(requests),
        gates=judge(gates, stats_of(cand, prices), stats_of(base, prices)),
        same_output=same,
        seconds={name: run.seconds for name, run in runs.items()},
    )


def _output(result: RequestFinished) -> object:
    if result.status != "completed":
        return None
    vectors = result.vectors()
    if vectors is not None:
        return [[round(x, 4) for x in vector] for vector in vectors]
    return result.text
