-- Async batches (issue 13). Everything here is rebuilt from the log by `sluice replay`.

-- A batch line's terminal event names its line (RequestFinished.batch); a request that is no batch line has
-- batch_id '' and batch_index -1 (a line's index is 0-based). Batch lines are billed at the price table's
-- batch discount, so their cost_nanos is already discounted.
ALTER TABLE request_facts ADD COLUMN IF NOT EXISTS batch_id String DEFAULT '';
ALTER TABLE request_facts ADD COLUMN IF NOT EXISTS batch_custom_id String DEFAULT '';
ALTER TABLE request_facts ADD COLUMN IF NOT EXISTS batch_index Int64 DEFAULT -1;
ALTER TABLE request_facts ADD COLUMN IF NOT EXISTS batch_attempt UInt32 DEFAULT 0;

-- Batch lines wait behind interactive traffic by design (the batch lane) and come in bulk: their latency
-- measures that queue, and their volume would drown the interactive error ratio (a 50 000-line batch makes
-- an interactive outage invisible, and its expired lines would page). So the SLI views leave them out, as
-- they leave out shadow copies; the ledger (spend_minute, spend_day) keeps them: they are billed.
CREATE OR REPLACE VIEW sli_minute AS
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
WHERE shadow_of = '' AND batch_id = ''
GROUP BY minute, tenant, model, model_version;

CREATE OR REPLACE VIEW errors_minute AS
SELECT
    toStartOfMinute(finished) AS minute,
    tenant,
    model,
    model_version,
    if(error_code != '', error_code, status) AS reason,
    count() AS requests
FROM request_facts FINAL
WHERE status IN ('failed', 'expired') AND shadow_of = '' AND batch_id = ''
GROUP BY minute, tenant, model, model_version, reason;

-- One row per batch: its latest state (BatchStateChanged on the compacted batches topic, key batch:<id>).
-- `seq` grows with every change of a batch, so the highest seq wins on merge whatever order the states were
-- inserted in (a redelivered older state does not come back): read with FINAL. Counts are lines; `errors`
-- (the input file's refused lines, as JSON) and `metadata` (the client's, as JSON with sorted keys).
CREATE TABLE IF NOT EXISTS batches
(
    tenant            LowCardinality(String),
    batch_id          String,
    seq               UInt64,
    event_id          String,
    time              DateTime64(3, 'UTC'),
    model             LowCardinality(String),
    status            LowCardinality(String),
    endpoint          LowCardinality(String),
    completion_window LowCardinality(String),
    edge_id           LowCardinality(String),
    input_file_id     String,
    output_file_id    String,
    error_file_id     String,
    total             UInt64,
    completed         UInt64,
    failed            UInt64,
    created_at        DateTime64(3, 'UTC'),
    expires_at        DateTime64(3, 'UTC'),
    in_progress_at    Nullable(DateTime64(3, 'UTC')),
    finalizing_at     Nullable(DateTime64(3, 'UTC')),
    completed_at      Nullable(DateTime64(3, 'UTC')),
    failed_at         Nullable(DateTime64(3, 'UTC')),
    expired_at        Nullable(DateTime64(3, 'UTC')),
    cancelling_at     Nullable(DateTime64(3, 'UTC')),
    cancelled_at      Nullable(DateTime64(3, 'UTC')),
    error_count       UInt32,
    errors            String,
    metadata          String,
    source            LowCardinality(String)
)
ENGINE = ReplacingMergeTree(seq)
ORDER BY (tenant, batch_id);
