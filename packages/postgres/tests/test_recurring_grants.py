"""Runtime grants with hostile schema and role names: granted literally or refused, nothing else.

Issue 10, item 1: ``grants.sql`` used to be filled by two ``str.replace`` calls, so a schema
named ``rtv{role}`` took the quoted role inside its own quotes and a role such as
``' TO public; DROP TABLE rtv.victim; COMMIT; --'`` ran as SQL. These tests run on a private
cluster (names like ``rtv`` and roles are cluster-wide; nothing else may share them) and
compare a snapshot of every schema, relation, role, membership and privilege before and
after each grant: only the grantee's privileges on the store's schema and tables may change.
"""

from __future__ import annotations

import re
import sys
from datetime import UTC, datetime
from importlib import resources
from typing import Any

import asyncpg
import pytest

from steeple.core import RecurringConfig, RecurringConfigurationError
from steeple.keyring import Keyring, StorageKey
from steeple.postgres import PostgresRecurringStore, grant_runtime_role
from steeple.postgres.recurring import RUNTIME_PRIVILEGES, TABLES
from steeple.testing import FakeClock

pytestmark = [pytest.mark.postgres]

START = datetime(2031, 3, 4, 5, 6, 7, tzinfo=UTC)
KEYRING = Keyring(StorageKey("k1", b"\x07" * 32))
CONFIG = RecurringConfig("tenant-a", 10, 100)
# The issue's exploit (its Python literals' values): the old code ran
#   GRANT USAGE ON SCHEMA "rtv" TO public; DROP TABLE rtv.victim; COMMIT; --"" TO ...
EXPLOIT_SCHEMA = "rtv{role}"
EXPLOIT_ROLE = " TO public; DROP TABLE rtv.victim; COMMIT; --"
# schema.sql held the placeholder in a comment: a newline in the name ended the comment.
EXPLOIT_INIT_SCHEMA = "x\n; DROP TABLE rtv.victim; --"

# Names that PostgreSQL can hold exactly: each must be granted literally.
LITERAL_NAMES = [
    "a'b",
    'a"b',
    '"',
    "'",
    '""',
    "x; DROP TABLE rtv.victim; --",
    "rtv{role}",
    "{schema}",
    "{role}",
    "Mixed Case",
    " leading space",
    "tab\there",
    "new\nline",
    EXPLOIT_INIT_SCHEMA,
    "' TO public; DROP TABLE rtv.victim; COMMIT; --'",
    "back\\slash",
    '$1 %s U&"x"',
    "schéma-ünï",
    "😀",
    "r" * 63,
    "é" * 31 + "x",  # 63 bytes in UTF-8
    "PUBLIC",  # quoted, this is a role named PUBLIC, not the PUBLIC pseudo-role
    EXPLOIT_ROLE,
]
# Names that cannot be used exactly: each must be refused with a typed error.
REFUSED_NAMES = ["", "a\x00b", "\x00", "r" * 64, "é" * 32, "a\udc80b", "\udcff", "x" * 10_000]
REFUSED_ROLES = [*REFUSED_NAMES, "public", "none", "pg_monitor", "pg_read_all_data"]


async def snapshot(conn: asyncpg.Connection) -> dict[tuple[str, ...], tuple[Any, ...]]:
    """Every schema, relation, role, membership and ACL of the database and cluster."""
    state: dict[tuple[str, ...], tuple[Any, ...]] = {}
    for r in await conn.fetch(
        "SELECT nspname, nspowner::regrole::text AS owner, nspacl::text AS acl FROM pg_namespace"
    ):
        state[("schema", r["nspname"])] = (r["owner"], r["acl"])
    for r in await conn.fetch(
        "SELECT n.nspname, c.relname, c.relkind::text, c.relowner::regrole::text AS owner,"
        " c.relacl::text AS acl FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
    ):
        state[("relation", r["nspname"], r["relname"])] = (r["relkind"], r["owner"], r["acl"])
    for r in await conn.fetch(
        "SELECT rolname, rolsuper, rolcreaterole, rolcreatedb, rolcanlogin, rolinherit,"
        " rolbypassrls FROM pg_roles"
    ):
        state[("role", r["rolname"])] = tuple(r.values())[1:]
    for r in await conn.fetch(
        "SELECT roleid::regrole::text AS role, member::regrole::text AS member FROM pg_auth_members"
    ):
        state[("member", r["role"], r["member"])] = ()
    for r in await conn.fetch("SELECT datname, datacl::text AS acl FROM pg_database"):
        state[("database", r["datname"])] = (r["acl"],)
    for r in await conn.fetch(
        "SELECT defaclrole::regrole::text AS role, defaclnamespace, defaclobjtype::text,"
        " defaclacl::text AS acl FROM pg_default_acl"
    ):
        state[("default_acl", r["role"], str(r["defaclnamespace"]), r["defaclobjtype"])] = (
            r["acl"],
        )
    return state


def changed(
    before: dict[tuple[str, ...], tuple[Any, ...]], after: dict[tuple[str, ...], tuple[Any, ...]]
) -> set[tuple[str, ...]]:
    return {k for k in before.keys() | after.keys() if before.get(k) != after.get(k)}


def grant_changes(schema: str) -> set[tuple[str, ...]]:
    """The only snapshot entries a grant may change: the schema's and tables' ACLs."""
    return {("schema", schema)} | {("relation", schema, table) for table in TABLES}


def quote_ident(name: str) -> str:
    # The test's own quoting (independent of the implementation under test).
    return '"' + name.replace('"', '""') + '"'


def runtime_grant_statements(role: str, schema: str = "steeple") -> list[str]:
    from steeple.postgres import runtime_grant_statements as build

    return build(role, schema)


async def create_role(conn: asyncpg.Connection, role: str) -> None:
    await conn.execute(f"CREATE ROLE {quote_ident(role)} NOLOGIN")


async def drop_roles(conn: asyncpg.Connection, roles: list[str]) -> None:
    for role in roles:
        if await conn.fetchval("SELECT 1 FROM pg_roles WHERE rolname = $1", role):
            await conn.execute(f"DROP OWNED BY {quote_ident(role)}")
            await conn.execute(f"DROP ROLE {quote_ident(role)}")


async def initialized(dsn: str, schema: str) -> None:
    store = await PostgresRecurringStore.initialize(
        dsn, CONFIG, KEYRING, FakeClock(START), schema=schema
    )
    await store.close()


async def assert_granted_exactly(conn: asyncpg.Connection, role: str, schema: str) -> None:
    """The role holds USAGE (not CREATE) and exactly the runtime privileges, nobody else."""
    role_oid = await conn.fetchval("SELECT oid FROM pg_roles WHERE rolname = $1", role)
    schema_oid = await conn.fetchval("SELECT oid FROM pg_namespace WHERE nspname = $1", schema)
    assert role_oid is not None
    assert schema_oid is not None
    assert await conn.fetchval(
        "SELECT has_schema_privilege($1::oid, $2::oid, 'USAGE')", role_oid, schema_oid
    )
    assert not await conn.fetchval(
        "SELECT has_schema_privilege($1::oid, $2::oid, 'CREATE')", role_oid, schema_oid
    )
    for table in TABLES:
        table_oid = await conn.fetchval(
            "SELECT c.oid FROM pg_class c WHERE c.relnamespace = $1 AND c.relname = $2",
            schema_oid,
            table,
        )
        held = {
            privilege
            for privilege in ("SELECT", "INSERT", "UPDATE", "DELETE", "TRUNCATE", "REFERENCES")
            if await conn.fetchval(
                "SELECT has_table_privilege($1::oid, $2::oid, $3)", role_oid, table_oid, privilege
            )
        }
        assert held == set(RUNTIME_PRIVILEGES[table]), (table, held)
        # nothing was granted to PUBLIC (grantee 0)
        assert not await conn.fetchval(
            "SELECT EXISTS (SELECT 1 FROM pg_class c, aclexplode(c.relacl) a"
            " WHERE c.oid = $1 AND a.grantee = 0)",
            table_oid,
        )


def test_schema_placeholder_only_where_an_identifier_goes() -> None:
    """schema.sql is filled by one substitution of a quoted name: never in a comment."""
    text = resources.files("steeple.postgres.recurring").joinpath("schema.sql").read_text()
    for line in text.splitlines():
        code, _, comment = line.partition("--")
        assert "{schema}" not in comment, line
        assert "$$" not in code, line  # no dollar-quoted body to land in
        for at in [m.start() for m in re.finditer(r"\{schema\}", code)]:
            assert code[:at].count("'") % 2 == 0, line  # not inside a string literal
    # the store's statements: filled the same way, executed with bind parameters
    from steeple.postgres.recurring._sql import _TEMPLATES

    for name, template in _TEMPLATES.items():
        assert "--" not in template, name
        for at in [m.start() for m in re.finditer(r"\{schema\}", template)]:
            assert template[:at].count("'") % 2 == 0, name


def test_statements_are_built_from_the_privilege_pairs_and_match_grants_sql() -> None:
    statements = runtime_grant_statements("rt", "s")
    assert statements[0] == 'GRANT USAGE ON SCHEMA "s" TO "rt"'
    pairs = [
        (privilege, table)
        for table, privileges in RUNTIME_PRIVILEGES.items()
        for privilege in privileges
    ]
    assert statements[1:] == [
        f'GRANT {privilege} ON TABLE "s"."{table}" TO "rt"' for privilege, table in pairs
    ]
    # The shipped reference file for DBAs grants exactly the same pairs.
    text = resources.files("steeple.postgres.recurring").joinpath("grants.sql").read_text()
    shipped: list[tuple[str, str]] = []
    for line in text.splitlines():
        match = re.fullmatch(r"GRANT (.+) ON \{schema\}\.(\w+) TO \{role\};", line)
        if match:
            shipped += [(p.strip(), match.group(2)) for p in match.group(1).split(",")]
    assert sorted(shipped) == sorted(pairs)
    assert "GRANT USAGE ON SCHEMA {schema} TO {role};" in text
    # A name is one quoted identifier however hostile: never text substituted into text.
    hostile = runtime_grant_statements(EXPLOIT_ROLE, EXPLOIT_SCHEMA)
    assert hostile[0] == f'GRANT USAGE ON SCHEMA "rtv{{role}}" TO "{EXPLOIT_ROLE}"'


@pytest.mark.parametrize("name", REFUSED_ROLES, ids=repr)
def test_unusable_role_names_are_refused_before_any_sql(name: str) -> None:
    with pytest.raises(RecurringConfigurationError) as caught:
        runtime_grant_statements(name, "steeple")
    assert len(str(caught.value)) < 400
    assert "\x00" not in str(caught.value)


@pytest.mark.parametrize("name", REFUSED_NAMES, ids=repr)
def test_unusable_schema_names_are_refused_before_any_sql(name: str) -> None:
    with pytest.raises(RecurringConfigurationError):
        runtime_grant_statements("rt", name)


async def test_the_issue_exploit_grants_literally_and_drops_nothing(private_pg: Any) -> None:
    dsn = private_pg.get_uri()
    conn = await asyncpg.connect(dsn)
    roles = [EXPLOIT_ROLE]
    try:
        await conn.execute("CREATE SCHEMA rtv; CREATE TABLE rtv.victim (id int)")
        await conn.execute("INSERT INTO rtv.victim VALUES (1)")
        await create_role(conn, EXPLOIT_ROLE)
        before = await snapshot(conn)
        # initialize itself: the schema name lands in schema.sql once, never in a comment
        await initialized(dsn, EXPLOIT_INIT_SCHEMA)
        created = changed(before, await snapshot(conn))
        assert {k[:2] for k in created} == {
            ("schema", EXPLOIT_INIT_SCHEMA),
            ("relation", EXPLOIT_INIT_SCHEMA),
            ("relation", "pg_toast"),
        }
        assert all(k not in before for k in created)
        await initialized(dsn, EXPLOIT_SCHEMA)
        before = await snapshot(conn)
        await grant_runtime_role(conn, EXPLOIT_ROLE, EXPLOIT_SCHEMA)
        after = await snapshot(conn)
        assert await conn.fetchval("SELECT count(*) FROM rtv.victim") == 1
        assert changed(before, after) <= grant_changes(EXPLOIT_SCHEMA)
        assert before[("schema", "rtv")] == after[("schema", "rtv")]  # PUBLIC got nothing
        await assert_granted_exactly(conn, EXPLOIT_ROLE, EXPLOIT_SCHEMA)
        # idempotent: granting again changes nothing at all
        await grant_runtime_role(conn, EXPLOIT_ROLE, EXPLOIT_SCHEMA)
        assert changed(after, await snapshot(conn)) == set()
    finally:
        await drop_roles(conn, roles)
        await conn.close()


async def test_hostile_names_are_granted_literally_or_refused(private_pg: Any) -> None:
    dsn = private_pg.get_uri()
    conn = await asyncpg.connect(dsn)
    roles: list[str] = []
    try:
        await conn.execute("CREATE SCHEMA rtv; CREATE TABLE rtv.victim (id int)")
        # The role and the schema carry the same hostile name (and one cross pair), so each
        # name is tried in both places.
        pairs = [(name, name) for name in LITERAL_NAMES] + [(EXPLOIT_ROLE, EXPLOIT_SCHEMA)]
        for role, _ in pairs:
            if role not in roles:
                await create_role(conn, role)
                roles.append(role)
        for schema in dict.fromkeys(schema for _, schema in pairs):
            await initialized(dsn, schema)
        schemas = list(dict.fromkeys(schema for _, schema in pairs))
        granted: dict[str, set[str]] = {}
        for role, schema in pairs:
            before = await snapshot(conn)
            await grant_runtime_role(conn, role, schema)
            after = await snapshot(conn)
            assert changed(before, after) <= grant_changes(schema), (role, schema)
            await assert_granted_exactly(conn, role, schema)
            granted.setdefault(role, set()).add(schema)
            # the role reaches exactly the schemas it was granted, however alike the names
            usable = {
                other
                for other in schemas
                if await conn.fetchval(
                    "SELECT has_schema_privilege((SELECT oid FROM pg_roles WHERE rolname = $1),"
                    " (SELECT oid FROM pg_namespace WHERE nspname = $2), 'USAGE')",
                    role,
                    other,
                )
            }
            assert usable == granted[role], role
        assert await conn.fetchval("SELECT to_regclass('rtv.victim') IS NOT NULL")

        # refused: typed errors, and nothing in the database changed
        before = await snapshot(conn)
        for name in REFUSED_ROLES:
            with pytest.raises(RecurringConfigurationError):
                await grant_runtime_role(conn, name, "rtv{role}")
        for name in REFUSED_NAMES:
            with pytest.raises(RecurringConfigurationError):
                await grant_runtime_role(conn, "a'b", name)
        # a role that does not exist and a schema without the store: typed, nothing granted
        with pytest.raises(RecurringConfigurationError, match="does not exist"):
            await grant_runtime_role(conn, "no such role", "rtv{role}")
        with pytest.raises(RecurringConfigurationError, match="initialize"):
            await grant_runtime_role(conn, "a'b", "rtv")
        with pytest.raises(RecurringConfigurationError, match="initialize"):
            await grant_runtime_role(conn, "a'b", "no such schema")
        assert changed(before, await snapshot(conn)) == set()
        assert not conn.is_in_transaction()
    finally:
        await drop_roles(conn, roles)
        await conn.close()


async def test_a_failing_grant_changes_nothing(private_pg: Any) -> None:
    """All grants or none: a role that may not grant (not the owner) leaves no partial ACL."""
    dsn = private_pg.get_uri()
    conn = await asyncpg.connect(dsn)
    roles = ["grant target", "not the owner"]
    try:
        await initialized(dsn, "s'1")
        await create_role(conn, roles[0])
        await conn.execute(f"CREATE ROLE {quote_ident(roles[1])} LOGIN")
        # the non-owner may grant USAGE on the schema (it holds it WITH GRANT OPTION) but
        # not the table privileges: the first statement succeeds, a later one fails
        await conn.execute(
            f"GRANT USAGE ON SCHEMA {quote_ident('s' + chr(39) + '1')} TO "
            f"{quote_ident(roles[1])} WITH GRANT OPTION"
        )
        before = await snapshot(conn)
        other = await asyncpg.connect(dsn, user=roles[1])
        try:
            with pytest.raises(asyncpg.PostgresError):
                await grant_runtime_role(other, roles[0], "s'1")
            assert not other.is_in_transaction()
        finally:
            await other.close()
        assert changed(before, await snapshot(conn)) == set()
    finally:
        await drop_roles(conn, roles)
        await conn.close()


async def test_the_cli_grants_the_exploit_literally(private_pg: Any, tmp_path: Any) -> None:
    """``steeple initialize --grant-to``, in-process and as a real process."""
    import asyncio
    import base64
    import os

    from typer.testing import CliRunner

    from steeple.admin.cli import app

    dsn = private_pg.get_uri()
    conn = await asyncpg.connect(dsn)
    roles = [EXPLOIT_ROLE, "a'b"]
    keys = "k1:" + base64.b64encode(b"\x07" * 32).decode()
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("STEEPLE_")},
        "STEEPLE_KEYS": keys,
    }
    try:
        await conn.execute("CREATE SCHEMA rtv; CREATE TABLE rtv.victim (id int)")
        for role in roles:
            await create_role(conn, role)
        before = await snapshot(conn)
        args = ["initialize", "--dsn", dsn, "--schema", EXPLOIT_SCHEMA, "--grant-to", EXPLOIT_ROLE]
        result = await asyncio.to_thread(
            CliRunner().invoke, app, args, env=env, catch_exceptions=False
        )
        assert result.exit_code == 0, result.output
        after = await snapshot(conn)
        # initialize created the schema and its relations; the only other change is the grant
        created = {k for k in changed(before, after) if k not in before}
        # the schema, its tables, indexes and sequences, and their TOAST tables
        assert {
            k
            for k in created
            if k[:2] not in {("relation", EXPLOIT_SCHEMA), ("relation", "pg_toast")}
        } == {("schema", EXPLOIT_SCHEMA)}, created
        assert changed(before, after) - created == set()
        await assert_granted_exactly(conn, EXPLOIT_ROLE, EXPLOIT_SCHEMA)
        assert await conn.fetchval("SELECT count(*) FROM rtv.victim") == 0  # still there

        # as a real process: another hostile role on the same schema
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            "from steeple.admin.cli import main; main()",
            "initialize",
            "--dsn",
            dsn,
            "--schema",
            EXPLOIT_SCHEMA,
            "--grant-to",
            "a'b",
            env=env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await process.communicate()
        assert process.returncode == 0, err.decode()
        assert 'to role "a\'b"' in out.decode()
        await assert_granted_exactly(conn, "a'b", EXPLOIT_SCHEMA)
        before = await snapshot(conn)
        # refused names: configuration exit (3), one line plus what to do, nothing changed
        for bad in ["a\x00b", "r" * 64, "public", "pg_monitor", "no such role", "é" * 32]:
            refused = await asyncio.to_thread(
                CliRunner().invoke,
                app,
                [*args[:-1], bad],
                env=env,
                catch_exceptions=False,
            )
            assert refused.exit_code == 3, (bad, refused.output)
            assert refused.stderr.startswith("steeple: error:")
            assert "Traceback" not in refused.output
        surrogate = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            "from steeple.admin.cli import main; main()",
            *[os.fsencode(a) for a in args[:-1]],
            b"role\xff",  # undecodable argv byte: a lone surrogate in Python
            env=env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        _, err = await surrogate.communicate()
        assert surrogate.returncode == 3, err.decode(errors="replace")
        assert b"Traceback" not in err
        assert changed(before, await snapshot(conn)) == set()
    finally:
        await drop_roles(conn, roles)
        await conn.close()
