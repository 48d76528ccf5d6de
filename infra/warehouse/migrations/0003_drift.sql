-- Drift detection (issue 9). Both tables are rebuilt from the log by `sluice replay`.

-- One row per terminal event: the request's drift features, never its text. Built from RequestFinished
-- alone (the worker attaches `features`), so a redelivered or re-run terminal event replaces its row (latest
-- `version` wins; read with FINAL). Windows are cut on `finished`; samples are the rows with the smallest
-- cityHash64(request_id), a uniform sample that does not depend on arrival order. `has_features` is false
-- for events from workers that attach none; Nullable columns are "not measured" for that request.
-- `embedding` is a MiniLM vector of the prompt for the 1 in SLUICE_DRIFT_SAMPLE requests that carry one.
CREATE TABLE IF NOT EXISTS drift_features
(
    request_id        String,
    tenant            LowCardinality(String),
    model             LowCardinality(String),
    model_version     LowCardinality(String),
    kind              LowCardinality(String),
    status            LowCardinality(String),
    finish_reason     LowCardinality(String),
    accepted          DateTime64(3, 'UTC'),
    finished          DateTime64(3, 'UTC'),
    has_features      Bool,
    prompt_tokens     UInt32,
    completion_tokens UInt32,
    prompt_chars      Nullable(UInt32),
    prompt_script     LowCardinality(Nullable(String)),
    prompt_language   LowCardinality(Nullable(String)),
    prompt_non_ascii  Nullable(Float64),
    output_chars      Nullable(UInt32),
    output_script     LowCardinality(Nullable(String)),
    empty_output      Nullable(Bool),
    refusal           Nullable(Bool),
    mean_logprob      Nullable(Float64),
    mean_entropy      Nullable(Float64),
    embedding         Array(Float32),
    version           UInt64,
    INDEX finished_minmax finished TYPE minmax GRANULARITY 1
)
ENGINE = ReplacingMergeTree(version)
PARTITION BY toYYYYMM(accepted)
ORDER BY (model, model_version, accepted, request_id);

-- One row per DriftReport event on the drift topic: the verdict of one window of one model version, for
-- all tenants (scope '*') or one tenant. The streams worker inserts the row once the event is durable;
-- `sluice replay` inserts the same rows from the topic. A report published twice for one window (a
-- restart between publish and insert) collapses on the key; the latest `version` (event time, ms) wins.
CREATE TABLE IF NOT EXISTS drift_reports
(
    report_id          String,
    time               DateTime64(3, 'UTC'),
    model              LowCardinality(String),
    model_version      LowCardinality(String),
    scope              LowCardinality(String),
    window_start       DateTime64(3, 'UTC'),
    window_end         DateTime64(3, 'UTC'),
    reference_start    Nullable(DateTime64(3, 'UTC')),
    reference_end      Nullable(DateTime64(3, 'UTC')),
    verdict            LowCardinality(String),
    drifted            Bool,
    share_drifted      Float64,
    requests           UInt64,
    n_reference        UInt32,
    n_current          UInt32,
    alpha              Nullable(Float64),
    method             String,
    feature_names      Array(String),
    feature_kinds      Array(LowCardinality(String)),
    feature_methods    Array(LowCardinality(String)),
    feature_statistics Array(Float64),
    feature_thresholds Array(Float64),
    feature_p_values   Array(Nullable(Float64)),
    feature_drifted    Array(Bool),
    feature_null_share Array(Float64),
    quality            Array(String),
    source             LowCardinality(String),
    version            UInt64
)
ENGINE = ReplacingMergeTree(version)
PARTITION BY toYYYYMM(window_start)
ORDER BY (model, model_version, scope, window_start);
