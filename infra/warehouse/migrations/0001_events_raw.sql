-- Every event from the log, as consumed: the base that per-request facts, SLIs, cost and audit derive from.
-- Unqualified names: the tables land in the client's database (chDB's default, or the one in the URL).
-- A redelivered event (same tenant, type, time, event_id) collapses to one row on merge; read with FINAL
-- where exact counts matter before parts merge.
CREATE TABLE IF NOT EXISTS events_raw
(
    event_id    String,
    type        LowCardinality(String),
    time        DateTime64(3, 'UTC'),
    tenant      LowCardinality(String),
    model       LowCardinality(String),
    request_id  String,
    source      LowCardinality(String),
    payload     String,
    topic       LowCardinality(String),
    `partition` UInt32,
    `offset`    UInt64
)
ENGINE = ReplacingMergeTree
PARTITION BY toYYYYMM(time)
ORDER BY (tenant, type, time, event_id);
