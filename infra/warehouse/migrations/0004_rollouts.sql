-- Rollouts (issue 10). Everything here is rebuilt from the log by `sluice replay`.

-- Shadow copies (a candidate version's run of a mirrored request: never answered, never billed) keep their
-- own fact rows, marked with the id of the request they mirrored, so the rollout gates can compare them.
-- Every client-facing view (SLIs, errors, the ledger) leaves them out.
ALTER TABLE request_facts ADD COLUMN IF NOT EXISTS shadow_of String DEFAULT '';

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
WHERE shadow_of = ''
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
WHERE status IN ('failed', 'expired') AND shadow_of = ''
GROUP BY minute, tenant, model, model_version, reason;

CREATE OR REPLACE VIEW spend_minute AS
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
WHERE shadow_of = ''
GROUP BY minute, tenant, model, model_version;

CREATE OR REPLACE VIEW spend_day AS
SELECT
    toDate(finished) AS day,
    tenant,
    count() AS requests,
    sum(prompt_tokens) AS prompt_tokens,
    sum(completion_tokens) AS completion_tokens,
    sum(cost_nanos) AS cost_nanos
FROM request_facts FINAL
WHERE shadow_of = ''
GROUP BY day, tenant;

-- One row per DeploymentChanged (the control topic): what served, each decision of a rollout and its
-- evidence (the gate values, as JSON). A redelivered event collapses on its id.
CREATE TABLE IF NOT EXISTS deployments
(
    event_id     String,
    time         DateTime64(3, 'UTC'),
    model        LowCardinality(String),
    version      String,
    action       LowCardinality(String),
    phase        LowCardinality(String),
    stable       String,
    candidate    String,
    traffic      String,
    steps        String,
    step         UInt16,
    step_started Nullable(DateTime64(3, 'UTC')),
    shadow       Float64,
    reason       String,
    evidence     String,
    actor        LowCardinality(String),
    rollout_id   String,
    source       LowCardinality(String)
)
ENGINE = ReplacingMergeTree
ORDER BY (model, time, event_id);
