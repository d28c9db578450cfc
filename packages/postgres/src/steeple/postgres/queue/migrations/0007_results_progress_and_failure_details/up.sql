-- steeple work queue, schema version 7: a handler's result and progress on the task, and the
-- exception type and traceback of each failed attempt. Forward-only: no down migration.
-- __SCHEMA__ is replaced by the quoted target schema name by install() (or by hand: see
-- "Applying the SQL by hand" in the Scheduler Design page).
--
-- Every column is nullable without a default, and every CHECK is NOT VALID (existing rows
-- are NULL): catalogue-only changes, no rewrite and no scan under the table's lock. New and
-- updated rows are checked. The library enforces tighter bounds before it writes, with a
-- typed error; these checks are the last line, set well above the library's bounds (jsonb's
-- text form spaces out what the library measured compactly), so a value the library let
-- through never fails a batch of completions here.

-- The JSON value the handler returned (NULL: it returned None, or has not succeeded), and
-- the latest progress it reported ({"fraction": 0..1, "message": text|absent}).
ALTER TABLE __SCHEMA__.tasks
    ADD COLUMN result jsonb,
    ADD COLUMN progress jsonb,
    ADD CONSTRAINT tasks_result_check CHECK (
        result IS NULL OR octet_length(result::text) <= 262144
    ) NOT VALID,
    ADD CONSTRAINT tasks_progress_check CHECK (
        progress IS NULL
        OR (jsonb_typeof(progress) = 'object' AND octet_length(progress::text) <= 8192)
    ) NOT VALID;

-- A failed attempt's exception type (module-qualified outside builtins) and its traceback
-- (the library bounds it to 16 KiB of UTF-8, keeping its start and its end). `error` keeps the
-- "Type: message" summary it always had.
ALTER TABLE __SCHEMA__.attempts
    ADD COLUMN error_type text,
    ADD COLUMN traceback text,
    ADD CONSTRAINT attempts_error_type_check CHECK (
        error_type IS NULL OR length(error_type) <= 1000
    ) NOT VALID,
    ADD CONSTRAINT attempts_traceback_check CHECK (
        traceback IS NULL OR octet_length(traceback) <= 65536
    ) NOT VALID;

-- Every migration records its own version, so a schema built by applying these files in
-- order is one the library accepts; install() records it too (a no-op here).
INSERT INTO __SCHEMA__.schema_migrations (version, name)
VALUES (7, '0007_results_progress_and_failure_details')
ON CONFLICT (version) DO NOTHING;
