-- The runtime role's exact privileges for steeple's recurring publications, for a DBA to
-- read or run by hand: {schema} stands for the quoted schema name, {role} for the quoted
-- runtime role. grant_runtime_role() and `steeple initialize --grant-to` do not read this
-- file: they build the same statements from RUNTIME_PRIVILEGES, one (privilege, table) pair
-- at a time (a test keeps the two equal).
-- The runtime role gets no CREATE on the schema, owns nothing and is not a superuser;
-- namespaces are created by `initialize`, run as the deployment role.
GRANT USAGE ON SCHEMA {schema} TO {role};
GRANT SELECT ON {schema}.recurring_schema_version TO {role};
GRANT SELECT, UPDATE ON {schema}.recurring_namespaces TO {role};
GRANT SELECT, INSERT, UPDATE ON {schema}.recurring_definitions TO {role};
GRANT SELECT, INSERT, UPDATE, DELETE ON {schema}.recurring_occurrences TO {role};
