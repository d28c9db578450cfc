-- The runtime role's exact privileges for steeple's recurring publications.
-- {schema} is the quoted schema name, {role} the quoted runtime role.
-- The runtime role gets no CREATE on the schema, owns nothing and is not a superuser;
-- namespaces are created by `initialize`, run as the deployment role.
GRANT USAGE ON SCHEMA {schema} TO {role};
GRANT SELECT ON {schema}.recurring_schema_version TO {role};
GRANT SELECT, UPDATE ON {schema}.recurring_namespaces TO {role};
GRANT SELECT, INSERT, UPDATE ON {schema}.recurring_definitions TO {role};
GRANT SELECT, INSERT, UPDATE, DELETE ON {schema}.recurring_occurrences TO {role};
