-- Derived state (issue 4). Everything here is rebuilt from the log by `sluice replay`.

-- One row per request once it is terminal, built from its RequestFinished event alone. A redelivered or
-- re-run terminal event replaces the row (the latest `version`, the event's time in ms, wins on merge):
-- read with FINAL. `accepted` comes from the request id (a UUIDv7), so every copy has the same sort key.
-- Costs are integers in nano-USD: tokens x (micro-USD per 1k tokens) is exact, so sums are exact.
-- No prompt or completion text is stored here.
CREATE TABLE IF NOT EXISTS request_facts
(
    request_id        String,
    tenant            LowCardinality(String),
    model             LowCardinality(String),
    model_version     LowCardinality(String),
    kind              LowCardinality(String),
    stream            Bool,
    edge_id           LowCardinality(String),
    worker_id         LowCardinality(String),
    status            LowCardinality(String),
    finish_reason     LowCardinality(String),
    error_code        LowCardinality(String),
    accepted          DateTime64(3, 'UTC'),
    started           Nullable(DateTime64(3, 'UTC')),
    first_token       Nullable(DateTime64(3, 'UTC')),
    finished          DateTime64(3, 'UTC'),
    queue_wait_ms     Nullable(Float64),
    ttft_ms           Nullable(Float64),
    itl_mean_ms       Nullable(Float64),
    itl_max_ms        Nullable(Float64),
    e2e_ms            Float64,
    prompt_tokens     UInt32,
    completion_tokens UInt32,
    worker_ms         Float64,
    cost_nanos        UInt64,
    price_version     LowCardinality(String),
    idempotency_key   String,
    trace_id          String,
    version           UInt64
)
ENGINE = ReplacingMergeTree(version)
PARTITION BY toYYYYMM(accepted)
ORDER BY (tenant, model, accepted, request_id);

-- The tamper-evident audit log: one chain per tenant (entry_hash covers the entry, prev_hash links it to
-- the tenant's previous one). Rows arrive from the audit topic; a redelivery collapses on (tenant, seq).
CREATE TABLE IF NOT EXISTS audit_log
(
    tenant        LowCardinality(String),
    seq           UInt64,
    entry_id      String,
    time          DateTime64(3, 'UTC'),
    actor         String,
    action        LowCardinality(String),
    resource      String,
    model         LowCardinality(String),
    model_version String,
    request_id    String,
    decision      LowCardinality(String),
    details       String,
    source        LowCardinality(String),
    prev_hash     String,
    entry_hash    String
)
ENGINE = ReplacingMergeTree
ORDER BY (tenant, seq);

-- SLIs per minute and tenant/model/version. Exact quantiles: a replay gives identical numbers.
CREATE VIEW IF NOT EXISTS sli_minute AS
SELECT
    toStartOfMinute(finished) AS minute,
    tenant,
    model,
    model_version,
    count() AS requests,
    countIf(status = 'completed') AS completed,
    countIf(status IN ('failed', 'expired')) AS errors,
    countIf(status = 'cancelled') AS cancelled,
    if(completed + errors = 0, 1.0, completed / (completed + errors)) AS availability,
    quantileExactIf(0.5)(ttft_ms, ttft_ms IS NOT NULL) AS ttft_p50_ms,
    quantileExactIf(0.95)(ttft_ms, ttft_ms IS NOT NULL) AS ttft_p95_ms,
    quantileExactIf(0.99)(ttft_ms, ttft_ms IS NOT NULL) AS ttft_p99_ms,
    quantileExactIf(0.5)(itl_mean_ms, itl_mean_ms IS NOT NULL) AS itl_p50_ms,
    quantileExactIf(0.95)(itl_mean_ms, itl_mean_ms IS NOT NULL) AS itl_p95_ms,
    quantileExactIf(0.99)(itl_mean_ms, itl_mean_ms IS NOT NULL) AS itl_p99_ms,
    quantileExact(0.5)(e2e_ms) AS e2e_p50_ms,
    quantileExact(0.99)(e2e_ms) AS e2e_p99_ms,
    quantileExactIf(0.5)(queue_wait_ms, queue_wait_ms IS NOT NULL) AS queue_wait_p50_ms,
    quantileExactIf(0.99)(queue_wait_ms, queue_wait_ms IS NOT NULL) AS queue_wait_p99_ms,
    if(countIf(stream) = 0, 1.0, countIf(stream AND status = 'completed') / countIf(stream)) AS stream_completion_rate,
    completion_tokens / 60 AS tokens_per_s,
    sum(prompt_tokens) AS prompt_tokens,
    sum(completion_tokens) AS completion_tokens
FROM request_facts FINAL
GROUP BY minute, tenant, model, model_version;

-- Refusals and failures per minute by reason (the worker's error code, or the terminal status).
CREATE VIEW IF NOT EXISTS errors_minute AS
SELECT
    toStartOfMinute(finished) AS minute,
    tenant,
    model,
    model_version,
    if(error_code != '', error_code, status) AS reason,
    count() AS requests
FROM request_facts FINAL
WHERE status IN ('failed', 'expired')
GROUP BY minute, tenant, model, model_version, reason;

-- The cost ledger: spend per tenant per minute and per day, exact (integer nano-USD).
CREATE VIEW IF NOT EXISTS spend_minute AS
SELECT
    toStartOfMinute(finished) AS minute,
    tenant,
    model,
    model_version,
    count() AS requests,
    sum(prompt_tokens) AS prompt_tokens,
    sum(completion_tokens) AS completion_tokens,
    sum(cost_nanos) AS cost_nanos
FROM request_facts FINAL
GROUP BY minute, tenant, model, model_version;

CREATE VIEW IF NOT EXISTS spend_day AS
SELECT
    toDate(finished) AS day,
    tenant,
    count() AS requests,
    sum(prompt_tokens) AS prompt_tokens,
    sum(completion_tokens) AS completion_tokens,
    sum(cost_nanos) AS cost_nanos
FROM request_facts FINAL
GROUP BY day, tenant;
