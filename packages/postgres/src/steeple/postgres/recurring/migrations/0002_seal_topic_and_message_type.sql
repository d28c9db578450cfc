-- steeple recurring publications: schema version 1 -> 2.
-- The topic and message type were kept in plaintext columns beside the sealed definition
-- (which has always held them too). Version 2 keeps them sealed only. The schema
-- placeholder is replaced by the quoted schema name, only where an identifier goes (never
-- in a comment: a quoted name may hold a newline). Run by `initialize` (the deployment
-- role) under its advisory lock; `initialize` then rewrites the table (VACUUM FULL) so the
-- dropped values leave the data files too.
ALTER TABLE {schema}.recurring_definitions
    DROP COLUMN IF EXISTS topic,
    DROP COLUMN IF EXISTS message_type;

UPDATE {schema}.recurring_schema_version SET version = 2
WHERE component = 'recurring' AND version = 1;
