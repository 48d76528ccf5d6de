-- Where each deployment change is on the control topic (one partition): the log's order is what serves.
-- The deciders' clocks need not agree with it: an operator's promote and another's abort racing were
-- written promote first, abort second, and the abort served, while ordering by time showed the promote
-- (an audit). -1: a row stored before this column (ordered by its time, as then, and before every row
-- that has a position).
ALTER TABLE deployments ADD COLUMN IF NOT EXISTS log_offset Int64 DEFAULT -1;
