-- steeple work queue, schema version 18: the claim keeps its plans.
-- Forward-only: there is no down migration. __SCHEMA__ is replaced by the quoted target
-- schema name by install() (or by hand: see "Applying the SQL by hand" in the Scheduler
-- Design page).
--
-- The claim planned each of its statements at every call (plan_cache_mode was
-- force_custom_plan) so the planner would see the actual limit and task names. Since
-- version 8 its planner settings (no sequential scan, no sort, no bitmap scan) leave each
-- statement one way to run, through the index that serves it, whatever the values: a
-- custom plan bought nothing, and planning was most of the claim's server time (on an idle
-- queue about three quarters of it, on a limited queue half of it). Now each session
-- plans the claim's statements once and keeps the plans (force_generic_plan), as
-- claim_key_room's statements did since version 14. The walks called from the claim
-- (claim_pick, the inlined claim_walk) run under the same setting. Nothing else changes:
-- same rules, locks, results and signatures, so running workers of versions 14 to 17 call
-- the claim as before.
ALTER FUNCTION __SCHEMA__.claim(
    text[], integer[], text[], text, double precision, integer[], timestamptz[], bigint[]
) SET plan_cache_mode = force_generic_plan;

-- Every migration records its own version, so a schema built by applying these files in
-- order is one the library accepts; install() records it too (a no-op here).
INSERT INTO __SCHEMA__.schema_migrations (version, name)
VALUES (18, '0018_claim_keeps_its_plans')
ON CONFLICT (version) DO NOTHING;
