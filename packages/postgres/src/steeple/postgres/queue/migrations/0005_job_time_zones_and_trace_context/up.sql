-- steeple work queue, schema version 5: recurring jobs in a time zone, and the trace context
-- of the enqueuer on each task. Forward-only: there is no down migration.
-- __SCHEMA__ is replaced by the quoted target schema name by install() (or by hand: see
-- "Applying the SQL by hand" in the Scheduler Design page).
--
-- Neither column rewrites its table: a constant default and a nullable column are
-- catalogue-only changes since PostgreSQL 11.

-- The IANA zone whose wall clock the job's cron expression follows (steeple.core.zoned).
-- Existing jobs keep their meaning: they were UTC. Validated by the library before it is
-- stored (a name of the tz database, at most 128 characters).
ALTER TABLE __SCHEMA__.jobs
    ADD COLUMN timezone text NOT NULL DEFAULT 'UTC'
        CONSTRAINT jobs_timezone_check CHECK (length(timezone) BETWEEN 1 AND 128);

-- The W3C trace context ({"traceparent": ..., "tracestate": ...}) of the span that enqueued
-- the task, written only while an OpenTelemetry tracer provider is configured; NULL
-- otherwise. The worker's run span continues that trace. NOT VALID: every existing row is
-- NULL, so the check needs no scan of the table under its lock; new rows are checked.
ALTER TABLE __SCHEMA__.tasks
    ADD COLUMN trace_context jsonb,
    ADD CONSTRAINT tasks_trace_context_check CHECK (
        trace_context IS NULL
        OR (jsonb_typeof(trace_context) = 'object' AND octet_length(trace_context::text) <= 4096)
    ) NOT VALID;

-- Every migration records its own version, so a schema built by applying these files in
-- order is one the library accepts; install() records it too (a no-op here).
INSERT INTO __SCHEMA__.schema_migrations (version, name)
VALUES (5, '0005_job_time_zones_and_trace_context')
ON CONFLICT (version) DO NOTHING;
