-- steeple work queue, schema version 8: the claim function never scans the whole tasks
-- table. Forward-only: there is no down migration.
-- __SCHEMA__ is replaced by the quoted target schema name by install().
--
-- Version 6's claim locks the due ids first and then updates them by `id = ANY(ids)`.
-- With bitmap scans off (the function's SET clause, which keeps the claim an ordered walk
-- of the claim index) the planner's choices for that update are one primary-key probe per
-- id or a scan of the whole table, and below some tens of thousands of rows, or without
-- statistics, it chose the scan: every claim then read every task, finished ones and dead
-- row versions included (on a fresh 30,000-task backlog a 200-task claim took 5.5-6.2 ms of
-- server CPU instead of 4.1-4.3 ms). Every statement of the claim has an index that
-- serves it (the primary key, the claim index, the running index, the settings key), so
-- sequential scans are discouraged for the whole function; the body, signature and result
-- are unchanged, so workers of version 7 that are already running call it as before.
ALTER FUNCTION __SCHEMA__.claim(text[], integer[], text[], text, double precision)
    SET enable_seqscan = off;

-- Every migration records its own version, so a schema built by applying these files in
-- order is one the library accepts; install() records it too (a no-op here).
INSERT INTO __SCHEMA__.schema_migrations (version, name)
VALUES (8, '0008_claim_reads_tasks_by_index')
ON CONFLICT (version) DO NOTHING;
