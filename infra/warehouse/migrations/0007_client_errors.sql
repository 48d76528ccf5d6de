-- A client's error is in no availability SLI. Everything here is rebuilt from the log by `sluice replay`.

-- A request that failed with a client's error code (schemas.events.CLIENT_ERROR_CODES: a prompt longer than
-- the worker runs, which the edge answers 400 as it answers its own check) was counted an error here, so one
-- tenant's over-long prompts spent every tenant's error budget (a review). It is now in neither `completed`
-- nor `errors` (neither good nor valid), as in streams.queries.SLI_BAD, which the burn-rate control events,
-- `error-budget-left` and the rollout's error gate use; `client_errors` counts it, and `errors_minute`,
-- the breakdown of `errors`, leaves it out. A code added to CLIENT_ERROR_CODES needs a new migration.
CREATE OR REPLACE VIEW sli_minute AS
SELECT
    toStartOfMinute(finished) AS minute,
    tenant,
    model,
    model_version,
    count() AS requests,
    countIf(status = 'completed') AS completed,
    countIf(status = 'expired' OR (status = 'failed' AND error_code NOT IN ('context_length_exceeded'))) AS errors,
    countIf(status = 'cancelled') AS cancelled,
    countIf(status = 'failed' AND error_code IN ('context_length_exceeded')) AS client_errors,
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
WHERE (status = 'expired' OR (status = 'failed' AND error_code NOT IN ('context_length_exceeded')))
    AND shadow_of = '' AND batch_id = ''
GROUP BY minute, tenant, model, model_version, reason;
