"""The test suite's own machinery: the fault proxy's target, and the session-end leftover check."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import asyncpg
import pytest

from faultproxy import FaultProxy, dsn_via, pg_endpoint

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    ("dsn", "endpoint"),
    [
        ("postgresql://u:pw@db.example:6543/x", ("db.example", 6543)),
        ("postgresql://u@127.0.0.1/x", ("127.0.0.1", 5432)),
        ("postgres://u@[::1]:5433/x", ("::1", 5433)),
        ("postgresql://postgres:@/postgres?host=/tmp/pg%20dir", ("/tmp/pg dir", 5432)),
        ("postgresql://u@/x?host=/run/pg&port=6000", ("/run/pg", 6000)),
        ("postgresql://u@%2Frun%2Fpg:6001/x", ("/run/pg", 6001)),
    ],
)
def test_the_proxy_targets_the_server_the_dsn_names(dsn: str, endpoint: tuple[str, int]) -> None:
    assert pg_endpoint(dsn) == endpoint
    proxy = FaultProxy.for_dsn(dsn)
    assert (proxy.upstream_host, proxy.upstream_port) == endpoint


@pytest.mark.parametrize(
    "dsn",
    [
        "postgresql://u@/x",  # libpq would guess: a default socket, then localhost:5432
        "postgresql:///x",
        "postgresql://u@h1,h2/x",
        "postgresql://u@/x?host=/a&host=/b",
        "mysql://u@h/x",
    ],
)
def test_the_proxy_never_guesses_a_server(dsn: str) -> None:
    with pytest.raises(ValueError, match=r"server|host|postgresql"):
        pg_endpoint(dsn)


def test_a_dsn_through_the_proxy_keeps_everything_but_the_address() -> None:
    via = dsn_via("postgresql://u:p%40ss@/db?host=/run/pg&port=6000&sslmode=disable", 7777)
    assert via == "postgresql://u:p%40ss@127.0.0.1:7777/db?sslmode=disable"
    assert dsn_via("postgresql://u@h:1/db", 2) == "postgresql://u@127.0.0.1:2/db"


_LEAKING_TESTS = """
import asyncio

import asyncpg


def test_leaves_a_schema_and_a_role(pg_dsn, pg_name):
    async def leak():
        conn = await asyncpg.connect(pg_dsn)
        try:
            await conn.execute(f'CREATE SCHEMA "{pg_name("leak")}"')
            await conn.execute(f'CREATE ROLE "{pg_name("leakrole")}"')
        finally:
            await conn.close()

    asyncio.run(leak())


def test_cleans_up(pg_schema):
    pass
"""


@pytest.mark.postgres
@pytest.mark.timeout(180)
async def test_a_session_that_leaves_a_schema_or_a_role_fails(pg_dsn: str, tmp_path: Path) -> None:
    (tmp_path / "test_leaking.py").write_text(textwrap.dedent(_LEAKING_TESTS))
    # An inner pytest session on this session's server (as a shared server: it finds its
    # own leftovers by its tag), with the root conftest loaded as a plugin.
    command = [
        sys.executable, "-m", "pytest", "-c", str(ROOT / "pyproject.toml"), "-p", "conftest",
        "-p", "no:cacheprovider", "-q", str(tmp_path / "test_leaking.py"),
    ]  # fmt: skip
    env = {**os.environ, "STEEPLE_TEST_DSN": pg_dsn}
    done = await asyncio.to_thread(
        subprocess.run, command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=150
    )
    out = done.stdout + done.stderr
    assert "2 passed" in out, out
    assert done.returncode == 1, out
    assert "leftovers on the test server" in out
    schemas = re.findall(r"schema '(leak_[0-9a-f]{8}_[0-9a-f]{8})'", out)
    roles = re.findall(r"role '(leakrole_[0-9a-f]{8}_[0-9a-f]{8})'", out)
    assert len(schemas) == len(roles) == 1, out
    assert re.search(r"schema 't_", out) is None  # pg_schema dropped its own
    # Reported, then dropped: the server is clean again.
    conn = await asyncpg.connect(pg_dsn)
    try:
        assert (
            await conn.fetchval("SELECT count(*) FROM pg_namespace WHERE nspname = $1", schemas[0])
            == 0
        )
        assert (
            await conn.fetchval("SELECT count(*) FROM pg_roles WHERE rolname = $1", roles[0]) == 0
        )
    finally:
        await conn.close()


@pytest.mark.postgres
async def test_temp_schemas_postgresql_keeps_are_not_leftovers(pg_dsn: str) -> None:
    # A TEMP table makes PostgreSQL create pg_temp_N / pg_toast_temp_N, which it keeps for
    # the backend slot after the session ends: the private server's inventory must not count
    # them, or a suite that uses TEMP tables fails on a machine with no PostgreSQL.
    import importlib.util

    spec = importlib.util.spec_from_file_location("root_conftest", ROOT / "conftest.py")
    assert spec is not None
    assert spec.loader is not None
    root_conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(root_conftest)
    conn = await asyncpg.connect(pg_dsn)
    try:
        await conn.execute("CREATE TEMP TABLE steeple_probe (x int)")
        temp_schema = await conn.fetchval(
            "SELECT nspname FROM pg_namespace WHERE oid = pg_my_temp_schema()"
        )
        assert re.fullmatch(r"pg_temp_[0-9]+", temp_schema)
        found = await asyncio.to_thread(root_conftest._server_objects, pg_dsn)
        assert temp_schema not in found["schema"]
        assert not any(name.startswith("pg_toast_temp_") for name in found["schema"])
        assert "public" in found["schema"]  # the inventory still lists real schemas
    finally:
        await conn.close()
