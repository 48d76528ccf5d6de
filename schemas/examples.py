"""One fully populated, deterministic instance of every event type.

Used by tests across the repository (codec round trips, pinned golden bytes, Kafka round trips). Every
optional field is set, so a change to any field shows up in the pinned bytes.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import TypedDict

from schemas.events import (
    AuditEntry,
    BatchCounts,
    BatchItemRequested,
    BatchLineError,
    BatchRef,
    BatchStateChanged,
    BudgetStateChanged,
    BurnRateCrossed,
    CancelRequested,
    DeadLetter,
    DeploymentChanged,
    DriftFeatures,
    DriftRebaselined,
    DriftReport,
    EmbeddingRequested,
    ErrorInfo,
    Event,
    FeatureDrift,
    Float32Vectors,
    GateResult,
    GenerationRequested,
    PricesChanged,
    ReplyTo,
    RequestFinished,
    RolloutGates,
    SamplingParams,
    Timings,
    TokenChunk,
    Usage,
    UsageRecorded,
    WorkerReady,
    WorkersScaled,
)
from schemas.ids import uuid7_from_parts
from schemas.prices import ModelPrice, PriceTable

T0 = datetime(2026, 11, 22, 9, 30, 0, 125000, tzinfo=UTC)
TENANT = "acme"
MODEL = "demo-gpt"
REQUEST_ID = "req-0001"
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
TRACESTATE = "sluice=edge-1"


def _at(ms: int) -> datetime:
    return T0 + timedelta(milliseconds=ms)


def _id(ms: int) -> str:
    return uuid7_from_parts(int(_at(ms).timestamp() * 1000), 0x2A5 << 62 | ms)


class _Envelope(TypedDict):
    id: str
    time: datetime
    tenant: str
    model: str
    request_id: str
    source: str
    traceparent: str
    tracestate: str


class _Request(TypedDict):
    model_version: str
    deadline: datetime
    reply: ReplyTo
    idempotency_key: str
    priority: int
    shadow_of: str


def _env(ms: int, source: str, request_id: str = REQUEST_ID) -> _Envelope:
    """Envelope fields of the example made ``ms`` after :data:`T0`."""
    return _Envelope(
        id=_id(ms),
        time=_at(ms),
        tenant=TENANT,
        model=MODEL,
        request_id=request_id,
        source=source,
        traceparent=TRACEPARENT,
        tracestate=TRACESTATE,
    )


def example_events() -> list[Event]:
    """Fresh instances on every call (the lists inside are not shared between calls)."""
    reply = ReplyTo(topic="sluice.replies", partition=3, edge_id="edge-1")
    sampling = SamplingParams(max_tokens=32, temperature=0.7, top_p=0.9, top_k=40, stop=("\n\n",), seed=7)
    request = _Request(
        model_version="demo-gpt@3",
        deadline=_at(30_000),
        reply=reply,
        idempotency_key="idem-42",
        priority=1,
        shadow_of="0190a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a50",
    )
    return [
        GenerationRequested(
            **_env(0, "ingest/edge-1"),
            **request,
            input_ids=[15496, 11, 995],
            prompt="Hello, world",
            sampling=sampling,
            stream=True,
            chat=True,
        ),
        EmbeddingRequested(
            **_env(1, "ingest/edge-1", "req-0002"),
            **request,
            inputs=[[101, 2023, 102], [101, 102]],
            texts=["this", ""],
            normalize=True,
        ),
        BatchItemRequested(
            **_env(2, "ingest/batch", "batch-7:item-0"),
            **request,
            batch_id="batch-7",
            custom_id="item-0",
            index=0,
            total=2,
            endpoint="/v1/completions",
            input_ids=[464, 3290],
            sampling=sampling,
            attempt=1,
            prompt="The river",
            chat=False,
            inputs=[[464, 3290]],  # an embeddings line's field, set so that every field is pinned
            texts=["The river"],
            normalize=False,
        ),
        CancelRequested(**_env(3, "ingest/edge-1"), reason="client_disconnect"),
        TokenChunk(
            **_env(4, "gpu/worker-0"),
            seq=1,
            offset=4,
            token_ids=[262, 995],
            text=" the world",
            finish_reason="stop",
            chars=5,
        ),
        RequestFinished(
            **_env(5, "gpu/worker-0"),
            status="failed",
            finish_reason="error",
            usage=Usage(prompt_tokens=3, completion_tokens=6, total_tokens=9),
            text="partial",
            embeddings_f32=Float32Vectors.pack([[0.25, -0.5], [1.0, 0.0]], 2),
            error=ErrorInfo(code="worker_oom", message="out of memory", retriable=True),
            timings=Timings(accepted=_at(-40), started=_at(-30), first_token=_at(-20), finished=_at(5)),
            worker_id="worker-0",
            model_version="3f2a9c",
            kind="chat",
            stream=True,
            edge_id="edge-1",
            idempotency_key="order-7",
            shadow_of="0190a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a50",
            batch=BatchRef(batch_id="batch-7", custom_id="item-0", index=0, attempt=1),
            max_inter_token_s=0.0125,
            features=DriftFeatures(
                prompt_chars=24,
                prompt_script="latin",
                prompt_language="en",
                prompt_non_ascii=0.0,
                output_chars=7,
                output_script="latin",
                empty_output=False,
                refusal=False,
                mean_logprob=-2.5,
                mean_entropy=3.25,
                embedding=[0.5, -0.25, 0.125],
            ),
        ),
        UsageRecorded(
            **_env(6, "streams/ledger"),
            prompt_tokens=3,
            completion_tokens=6,
            worker_seconds=0.125,
            cost_micros=1234,
            price_version="p-2026-11",
            cost_nanos=1_234_567,
            model_version="3f2a9c01d4e5",
            status="completed",
            batch_id="batch_0001",
        ),
        AuditEntry(
            **_env(7, "streams/audit"),
            actor="user:alice",
            action="chat.completions.create",
            resource="model:demo-gpt",
            decision="allow",
            details={"ip": "127.0.0.1", "api_key": "key-3"},
            prev_hash="0" * 64,
            entry_hash="f" * 64,
            seq=0,
            model_version="3f2a9c",
        ),
        DeploymentChanged(
            **_env(8, "streams/rollout", ""),
            version="demo-gpt@4",
            action="promote",
            traffic={"demo-gpt@3": 0.75, "demo-gpt@4": 0.25},
            reason="canary healthy for 30m",
            stable="demo-gpt@3",
            candidate="demo-gpt@4",
            phase="canary",
            steps=[0.05, 0.25, 0.5, 1.0],
            step=1,
            step_started=T0,
            shadow=0.2,
            gates=RolloutGates(min_requests=100),
            evidence=[
                GateResult(
                    gate="error_ratio",
                    state="pass",
                    candidate=0.01,
                    baseline=0.012,
                    limit=0.062,
                    candidate_n=120,
                    baseline_n=2280,
                )
            ],
            actor="controller",
            rollout_id="0190a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a5b",
        ),
        BudgetStateChanged(
            **_env(9, "streams/ledger", ""),
            limit_micros=5_000_000,
            spent_micros=5_000_100,
            exhausted=True,
        ),
        BurnRateCrossed(
            **_env(10, "streams/slo", ""),
            slo="ttft-p99",
            window="1h",
            burn_rate=14.5,
            threshold=14.4,
            firing=True,
        ),
        DriftReport(
            **_env(11, "drift/checker", ""),
            window_start=_at(-3_600_000),
            window_end=_at(0),
            drifted=True,
            share_drifted=0.5,
            feature_scores={"prompt_tokens": 0.01, "completion_tokens": 0.4},
            method="ks",
            model_version="3f2a9c",
            verdict="drift",
            reference_start=_at(-7_200_000),
            reference_end=_at(-3_600_000),
            requests=812,
            n_reference=500,
            n_current=500,
            alpha=0.01,
            features=[
                FeatureDrift(
                    name="prompt_tokens",
                    kind="numerical",
                    method="ks",
                    statistic=0.0001,
                    threshold=0.001,
                    p_value=0.0001,
                    drifted=True,
                    null_share=0.0,
                    reference_null_share=0.0,
                ),
                FeatureDrift(
                    name="embedding",
                    kind="embedding",
                    method="mmd",
                    statistic=0.004,
                    threshold=0.015,
                    drifted=False,
                    null_share=0.95,
                    reference_null_share=0.95,
                ),
            ],
            quality=["prompt_language: 40% missing (reference 0%)"],
        ),
        DeadLetter(
            **_env(12, "gpu/worker-0"),
            source_topic="sluice.requests.demo-gpt",
            partition=2,
            offset=981,
            reason="invalid event: missing required field `input_ids`",
            payload_b64="eyJ0eXBlIjoiZ2VuZXJhdGlvbl9yZXF1ZXN0ZWQifQ==",
            headers={"ce_type": "dev.sluicegate.x.v1"},
        ),
        BatchStateChanged(
            **_env(13, "ingest/edge-1", ""),
            batch_id="batch_0190a1b2c3d47e5f8a9b0c1d2e3f4a5b",
            status="failed",
            endpoint="/v1/chat/completions",
            completion_window="24h",
            input_file_id="file-0190a1b2c3d47e5f8a9b0c1d2e3f4a5c",
            edge_id="edge-1",
            seq=3,
            counts=BatchCounts(total=2, completed=1, failed=1),
            output_file_id="file-0190a1b2c3d47e5f8a9b0c1d2e3f4a5d",
            error_file_id="file-0190a1b2c3d47e5f8a9b0c1d2e3f4a5e",
            created_at=_at(-60_000),
            expires_at=_at(86_340_000),
            in_progress_at=_at(-59_000),
            finalizing_at=_at(-1_000),
            completed_at=_at(0),
            failed_at=_at(1),
            expired_at=_at(2),
            cancelling_at=_at(3),
            cancelled_at=_at(4),
            errors=[BatchLineError(code="duplicate_custom_id", message="custom_id 'a' repeats", line=2)],
            metadata={"job": "nightly-eval"},
            output_expires_after_s=7 * 86400,
        ),
        WorkersScaled(
            **_env(14, "sluice/autoscaler", ""),
            version="530b56af490a",
            replicas=3,
            previous=1,
            reason="lag 140 over 1 worker x 50",
            lag=140,
            target_lag=50,
            bounds=(1, 4),
            actor="autoscaler",
        ),
        WorkerReady(
            **_env(15, "gpu_workers/demo-gpt-0", ""),
            version="530b56af490a",
            worker="demo-gpt-0",
            deployment=_id(8),
        ),
        DriftRebaselined(
            **_env(16, "sluice/cli", ""),
            version="530b56af490a",
            reason="a new tenant onboarded: French prompts are expected from now on",
            actor="operator",
        ),
        PricesChanged(
            **(_env(17, "streams", "") | {"tenant": "", "model": ""}),
            prices=PriceTable(
                version="2026-12",
                batch_discount_percent=50,
                default=ModelPrice(prompt=100, completion=400),
                models={"demo-gpt": ModelPrice(prompt=150, completion=600, worker_second=2)},
            ),
            effective=_at(17),
            actor="streams",
        ),
    ]
