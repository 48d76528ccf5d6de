"""The autoscaling policy (pure), the fleet's settings, and where `sluice up`'s extra edges go."""

from __future__ import annotations

import time

import msgspec
import pytest

from gpu_workers.settings import WorkerSettings
from ingest.main import reply_partition
from ingest.settings import EdgeSettings
from schemas.settings import KafkaConnection, PlatformSettings, SettingsError, load_settings
from schemas.topics import worker_group
from sluice.autoscale import FleetSettings, ScalePolicy, fleet_of
from sluice.up import extra_edges, platform_ports
from streams.settings import StreamsSettings


def _policy(**overrides: float) -> ScalePolicy:
    values = {"min_workers": 1, "max_workers": 4, "target_lag": 50, "scale_in_after_s": 30.0, **overrides}
    return ScalePolicy(**values)  # type: ignore[arg-type]


def test_out_at_once_and_straight_to_what_the_lag_needs_within_bounds() -> None:
    policy = _policy()
    assert policy.decide("m", 1, 0, now=0) is None
    assert policy.decide("m", 1, 50, now=0) is None  # exactly one worker's worth
    out = policy.decide("m", 1, 140, now=1)
    assert out is not None
    assert (out.previous, out.replicas) == (1, 3)
    assert out.reason == "lag 140 over 1 x 50"
    capped = policy.decide("m", 3, 10_000, now=2)
    assert capped is not None
    assert capped.replicas == 4  # never past max
    assert policy.decide("m", 4, 10_000, now=3) is None


def test_no_more_workers_than_the_topic_has_partitions() -> None:
    """Found by an audit: a lag of 2,000 with up to 12 workers started 12 on a 6-partition topic; six got no
    partition and held their models in memory doing nothing. The operator's own minimum still stands."""
    policy = _policy(max_workers=12)
    out = policy.decide("m", 1, 2_000, now=0, partitions=6)
    assert out is not None
    assert out.replicas == 6
    assert policy.decide("m", 6, 2_000, now=1, partitions=6) is None
    assert _policy(min_workers=8, max_workers=12).wanted(2_000, partitions=6) == 8


def test_no_more_workers_than_partitions_holding_lag() -> None:
    """Found by an audit: one tenant's load (all on one partition: requests are keyed by tenant) scaled a
    model to a second worker, which only took that partition over; the first sat idle. The cap is the
    partitions holding lag (KEDA's ``limitToPartitionsWithLag``)."""
    policy = _policy(max_workers=4, target_lag=3)
    assert policy.decide("m", 1, 11, now=0, partitions=1) is None, "one partition with lag: one worker"
    out = policy.decide("m", 1, 11, now=1, partitions=2)
    assert out is not None
    assert out.replicas == 2
    assert policy.wanted(0, partitions=0) == 1, "never under min"


@pytest.mark.integration
def test_group_lag_counts_the_partitions_holding_it(kafka: KafkaConnection, topic_prefix: str) -> None:
    from confluent_kafka import KafkaException, Producer
    from confluent_kafka.admin import NewTopic

    from infra.topics import make_admin
    from sluice.autoscale import GroupLag

    topic = f"{topic_prefix}.requests.m"
    admin = make_admin(kafka)
    admin.create_topics([NewTopic(topic, num_partitions=3)])[topic].result(10)
    producer = Producer(kafka.client_config())
    for n in range(5):
        producer.produce(topic, b"r", partition=0 if n < 4 else 2)
    assert producer.flush(10) == 0
    lag = GroupLag(kafka)
    try:
        for _ in range(40):  # a new group's coordinator may not be there yet (the fleet asks every round)
            try:
                queued = lag(topic, "m", "v1")
                break
            except KafkaException:
                time.sleep(0.25)
        assert queued == 5, "nothing committed: every record is queued"
        assert lag.lagging[topic] == 2
        # the group committed 1 on partition 0, then retention removed its first three records: one left
        from confluent_kafka import Consumer, TopicPartition

        from bus.consumer import consumer_config

        group = Consumer(consumer_config(kafka, worker_group("m", "v1"), "test-committer"))
        try:
            group.commit(offsets=[TopicPartition(topic, 0, 1)], asynchronous=False)
        finally:
            group.close()
        deleted = admin.delete_records([TopicPartition(topic, 0, 3)])
        for future in deleted.values():
            future.result(10)
        assert lag(topic, "m", "v1") == 2, "records retention removed are no lag"
        lag.keep({worker_group("m", "v1")})
        assert len(lag._consumers) == 1, "the stable version's client stays"
        lag.keep({worker_group("m", "v2")})  # v1 is no longer stable: its client goes
        assert lag._consumers == {}
    finally:
        lag.close()


def test_in_slowly_one_at_a_time_after_the_lag_stayed_low() -> None:
    policy = _policy(scale_in_after_s=30)
    assert policy.decide("m", 3, 0, now=100) is None  # the low lag starts the clock
    assert policy.decide("m", 3, 0, now=129) is None
    first = policy.decide("m", 3, 0, now=130)
    assert first is not None
    assert (first.previous, first.replicas) == (3, 2)
    assert "needed 1 for 30s" in first.reason
    assert policy.decide("m", 2, 0, now=131) is None  # the next step waits a whole period again
    second = policy.decide("m", 2, 0, now=160)
    assert second is not None
    assert second.replicas == 1
    assert policy.decide("m", 1, 0, now=1000) is None  # never under min


def test_a_burst_in_the_quiet_period_restarts_the_clock() -> None:
    policy = _policy(scale_in_after_s=30)
    assert policy.decide("m", 2, 0, now=0) is None
    assert policy.decide("m", 2, 100, now=20) is None  # needs 2 again: the clock resets
    assert policy.decide("m", 2, 0, now=40) is None
    assert policy.decide("m", 2, 0, now=69) is None
    assert policy.decide("m", 2, 0, now=70) is not None


def test_models_are_decided_apart_and_bounds_changed_since_are_applied() -> None:
    policy = _policy(scale_in_after_s=10)
    assert policy.decide("a", 2, 0, now=0) is None
    assert policy.decide("b", 2, 0, now=5) is None
    a = policy.decide("a", 2, 0, now=10)
    assert a is not None
    assert a.replicas == 1
    assert policy.decide("b", 2, 0, now=10) is None  # b's clock started later
    over = policy.decide("a", 6, 0, now=11)
    assert over is not None
    assert over.replicas == 4
    assert "bounds are 1..4" in over.reason


def test_fleet_settings_from_env_and_their_limits() -> None:
    env = {
        "SLUICE_FLEET_EDGES": "2",
        "SLUICE_FLEET_WORKERS_PER_MODEL": "2",
        "SLUICE_FLEET_AUTOSCALE": "true",
        "SLUICE_FLEET_MAX_WORKERS": "3",
        "SLUICE_FLEET_WARM_WORKERS": "1",
    }
    fleet = load_settings(FleetSettings, env)
    assert (fleet.fleet_edges, fleet.fleet_workers_per_model, fleet.fleet_max_workers) == (2, 2, 3)
    assert fleet.fleet_autoscale
    with pytest.raises(SettingsError, match="SLUICE_FLEET_MAX_WORKERS"):
        load_settings(FleetSettings, {**env, "SLUICE_FLEET_MAX_WORKERS": "1"})
    with pytest.raises(SettingsError):
        load_settings(FleetSettings, {"SLUICE_FLEET_EDGES": "0"})
    with pytest.raises(
        SettingsError, match="SLUICE_FLEET_TARGET_LAG"
    ):  # an audit: no decision could carry it
        load_settings(FleetSettings, {"SLUICE_FLEET_TARGET_LAG": str(2**63)})
    with pytest.raises(msgspec.ValidationError, match="SLUICE_FLEET_MAX_WORKERS"):  # the CLI's flags path
        msgspec.convert(
            {"fleet_autoscale": True, "fleet_workers_per_model": 3, "fleet_max_workers": 2}, FleetSettings
        )
    # an audit: standbys without autoscaling were accepted and never used
    with pytest.raises(SettingsError, match=r"SLUICE_FLEET_WARM_WORKERS .* needs SLUICE_FLEET_AUTOSCALE"):
        load_settings(FleetSettings, {**env, "SLUICE_FLEET_AUTOSCALE": "false"})
    with pytest.raises(msgspec.ValidationError, match="--autoscale"):
        msgspec.convert({"fleet_warm_workers": 1}, FleetSettings)
    # sluice up's flags over the environment, checked together (a review: the environment was judged alone)
    warm = {"SLUICE_FLEET_WARM_WORKERS": "2"}
    assert fleet_of({"fleet_autoscale": True}, warm).fleet_warm_workers == 2
    with pytest.raises(SettingsError, match="WARM_WORKERS"):
        fleet_of({}, warm)
    fewer = {
        "SLUICE_FLEET_AUTOSCALE": "true",
        "SLUICE_FLEET_WORKERS_PER_MODEL": "3",
        "SLUICE_FLEET_MAX_WORKERS": "2",
    }
    assert fleet_of({"fleet_max_workers": 4}, fewer).fleet_max_workers == 4
    assert fleet_of({"fleet_worker_cpus": "1", "fleet_edges": 2}, {}).fleet_worker_cpus == "1"


def test_extra_edges_take_the_next_ports_and_their_own_replies_partitions() -> None:
    settings = EdgeSettings(edge_port=8080, edge_id="edge-0")
    edges = extra_edges(settings, 4, 8)
    assert [port for _, port in edges] == [8081, 8082, 8083]
    ids = ["edge-0", *(edge_id for edge_id, _ in edges)]
    assert len(set(ids)) == 4
    assert len({reply_partition(i, 8) for i in ids}) == 4
    assert extra_edges(settings, 1, 8) == []
    crowded = extra_edges(settings, 4, 2)  # more edges than partitions: they share, all still start
    assert len(crowded) == 3
    with pytest.raises(SettingsError, match="fixed SLUICE_EDGE_PORT"):
        extra_edges(EdgeSettings(edge_port=0), 2, 8)


def test_extra_edges_refuse_ports_past_65535_and_ports_another_service_listens_on() -> None:
    """Before, `--port 65534 --edges 3` started an edge on 65536 that crash-looped, and an edge on the
    streams worker's port crash-looped while the streams worker answered its readiness check."""
    with pytest.raises(SettingsError, match="65534 to 65536"):
        extra_edges(EdgeSettings(edge_port=65534), 3, 8)
    taken = {8082: "the streams worker"}
    with pytest.raises(SettingsError, match=r"edge port 8082 .* is the streams worker's"):
        extra_edges(EdgeSettings(edge_port=8080), 3, 8, taken)
    assert [port for _, port in extra_edges(EdgeSettings(edge_port=8080), 2, 8, taken)] == [8081]


def test_the_platform_ports_name_the_streams_worker_the_workers_and_kafka() -> None:
    settings = PlatformSettings(kafka_port=19092, models=("demo-gpt", "all-minilm-l6-v2"))
    taken = platform_ports(settings, WorkerSettings(worker_ops_port=9400), StreamsSettings())
    assert taken[8090] == "the streams worker"
    assert (taken[9400], taken[9401]) == ("the demo-gpt worker", "the all-minilm-l6-v2 worker")
    assert taken[19092] == taken[19093] == "Kafka"
