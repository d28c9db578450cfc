-- steeple work queue, schema version 10: room on every page of the busy tables for the new
-- versions of the rows updated there, and vacuum that keeps up with a queue's churn.
-- Forward-only: there is no down migration.
-- __SCHEMA__ is replaced by the quoted target schema name by install() (or by hand: see
-- "Applying the SQL by hand" in the Scheduler Design page).
--
-- Every task row is updated two to four times in its life (claim, lease renewals, progress,
-- outcome) and then deleted by pruning. An update writes a new version of the row; when the
-- old version's page has room, the new one goes on the same page, and when no indexed
-- column changed (progress, a rate-limited queue's window of starts) it is a heap-only
-- tuple (HOT) that adds no index entry at all and is cleaned by any later reader of the
-- page, without waiting for VACUUM. The claim and the outcome change `state`, which the
-- partial indexes test, so they cannot be HOT; they still stay on their page when it has
-- room, which keeps the table's pages and the claim index's heap visits few.
--
-- A fill factor only applies to pages written from now on: existing pages fill as before
-- until their rows are pruned. Setting storage parameters takes a SHARE UPDATE EXCLUSIVE
-- lock: it never blocks reads or writes of the table (only another ALTER or a VACUUM).
--
-- Vacuum: the default scale factor (20% of the table) lets a table of a million finished
-- tasks collect 200,000 dead rows before it is vacuumed; a queue's table churns all the
-- time, so it is vacuumed after 2% (plus 1,000 rows) changes instead, and analyzed after 5%,
-- which also keeps the planner's picture of the pending work current. Operators may change
-- these with ALTER TABLE ... SET (...) or RESET (...); later migrations never touch them.
ALTER TABLE __SCHEMA__.tasks SET (
    fillfactor = 80,
    autovacuum_vacuum_scale_factor = 0.02,
    autovacuum_vacuum_threshold = 1000,
    autovacuum_vacuum_insert_scale_factor = 0.05,
    autovacuum_analyze_scale_factor = 0.05
);
ALTER TABLE __SCHEMA__.attempts SET (
    autovacuum_vacuum_scale_factor = 0.02,
    autovacuum_vacuum_threshold = 1000
);
-- A limited queue's or task name's row is rewritten by every claim of it (its window of
-- recent starts is not indexed, so those updates can be HOT when the page has room).
ALTER TABLE __SCHEMA__.settings SET (fillfactor = 50);

-- Every migration records its own version, so a schema built by applying these files in
-- order is one the library accepts; install() records it too (a no-op here).
INSERT INTO __SCHEMA__.schema_migrations (version, name)
VALUES (10, '0010_room_for_updates_and_eager_vacuum')
ON CONFLICT (version) DO NOTHING;
