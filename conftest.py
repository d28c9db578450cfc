"""Shared fixtures for steeple's integration tests.

PostgreSQL: ``STEEPLE_TEST_DSN`` names a server to use; without it a private cluster is
started with the ``pgserver`` package (listening on a free TCP port of 127.0.0.1 only), so
a fresh machine needs no server and nothing else is touched. Under CI (``CI=true``) a
missing server or broker is a failure, never a skip.

Each test that asks for ``pg_schema`` gets its own schema, dropped afterwards. Tests that
create other schemas or roles on the test server name them with ``pg_name`` (they carry
this session's tag). When the session ends, whatever a test left on the test server fails
the run (see :func:`_leftovers`): on the private cluster every schema, role or database
that was not there at the start; on a shared server every one carrying the session's tag.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import uuid
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn, TypeVar

import pytest
from hypothesis import HealthCheck, settings

if TYPE_CHECKING:
    from pgserver.postgres_server import PostgresServer

IN_CI = os.environ.get("CI", "").lower() in {"1", "true", "yes"}

# The fault proxy (tests/faultproxy.py) serves every package's tests: it is imported by its
# bare name, and test directories have no __init__.py (--import-mode=importlib).
_FAULT_TOOLS = str(Path(__file__).resolve().parent / "tests")
if _FAULT_TOOLS not in sys.path:
    sys.path.append(_FAULT_TOOLS)

# Property tests assert what holds, never how fast: on a loaded two-core machine a slow
# example or slow data generation is not a failure. Tests that set their own settings keep
# them; the rest inherit these.
settings.register_profile("steeple", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("steeple")

# Names of what tests create on the test server carry this tag, so the session-end check
# finds this session's leftovers even on a server that other test sessions share.
SESSION_TAG = uuid.uuid4().hex[:8]

_T = TypeVar("_T")


def _unavailable(what: str) -> NoReturn:
    """Fail under CI, skip elsewhere: a missing service must never pass silently in CI."""
    if IN_CI:
        pytest.fail(f"{what} is not available, and under CI=true that is a failure")
    pytest.skip(f"{what} is not available on this machine")


def _test_name(prefix: str) -> str:
    return f"{prefix}_{SESSION_TAG}_{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="session")
def pg_name() -> Callable[[str], str]:
    """Make a fresh name for a schema or role a test creates: ``<prefix>_<tag>_<random>``.

    The session-end check finds leftovers by the tag, so every schema and role a test
    creates on the test server must be named this way (or derived from such a name).
    """
    return _test_name


# --- the session's PostgreSQL server ---------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _pgserver(what: str, pgdata: Callable[[], Path]) -> PostgresServer:
    """A pgserver cluster in ``pgdata()``, deleted by its ``cleanup()``; or fail/skip."""
    with warnings.catch_warnings():
        # platformdirs warns when XDG_RUNTIME_DIR is unset; pgserver copes with it.
        warnings.simplefilter("ignore", UserWarning)
        try:
            from pgserver.postgres_server import get_server
        except ImportError:
            _unavailable(what)
        return get_server(pgdata(), cleanup_mode="delete")


def _listen_on_tcp_only(server: PostgresServer) -> str:
    """Restart a pgserver cluster on 127.0.0.1:<free port> without a Unix socket.

    pgserver starts its clusters on a Unix socket only; the fault tests relay TCP and the
    keepalive tests read TCP settings, so the session's server must speak TCP. Its handle
    then adopts the restarted postmaster, so its cleanup stops this one.
    """
    # pg_ctl is made at import time (one function per bundled binary): mypy cannot see it.
    from pgserver._commands import pg_ctl  # type: ignore[attr-defined]

    def ctl(*args: str) -> None:
        pg_ctl(list(args), pgdata=server.pgdata, user=server.system_user, timeout=60)

    ctl("-w", "-m", "fast", "stop")
    for attempt in range(5):
        port = _free_port()
        try:
            ctl("-w", "-l", str(server.log), "-o", f"-h 127.0.0.1 -p {port} -k ''", "start")
            break
        except subprocess.CalledProcessError:
            if attempt == 4:  # another process took each free port in between
                raise
    with server._lock:
        server.ensure_postgres_running()
    return f"postgresql://postgres@127.0.0.1:{port}/postgres"


def _in_thread(make: Callable[[], Awaitable[_T]]) -> _T:
    """Run a coroutine on a loop of its own thread (the test loops are not disturbed)."""

    async def main() -> _T:
        return await make()

    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, main()).result()


_SERVER_OBJECTS = {
    # pg_temp_N / pg_toast_temp_N are PostgreSQL's own: made for the first TEMP table of a
    # backend slot and kept for reuse, they are not something a test left behind.
    "schema": (
        "SELECT nspname FROM pg_namespace"
        " WHERE nspname !~ '^pg_temp_[0-9]+$' AND nspname !~ '^pg_toast_temp_[0-9]+$'"
    ),
    "role": "SELECT rolname FROM pg_roles",
    "database": "SELECT datname FROM pg_database",
}


def _server_objects(dsn: str) -> dict[str, set[str]]:
    """The schemas (of the DSN's database), roles and databases on the server now."""
    import asyncpg

    async def read() -> dict[str, set[str]]:
        conn = await asyncpg.connect(dsn, timeout=10)
        try:
            return {
                kind: {row[0] for row in await conn.fetch(query)}
                for kind, query in _SERVER_OBJECTS.items()
            }
        finally:
            await conn.close()

    return _in_thread(read)


def _drop(dsn: str, found: dict[str, list[str]]) -> None:
    """Drop leftovers (after they were reported), so a shared server is not polluted."""
    import asyncpg

    def quoted(name: str) -> str:
        return '"' + name.replace('"', '""') + '"'

    async def drop() -> None:
        conn = await asyncpg.connect(dsn, timeout=10)
        try:
            statements = [f"DROP SCHEMA IF EXISTS {quoted(n)} CASCADE" for n in found["schema"]]
            statements += [f"DROP DATABASE IF EXISTS {quoted(n)}" for n in found["database"]]
            for name in found["role"]:
                statements += [f"DROP OWNED BY {quoted(name)}", f"DROP ROLE {quoted(name)}"]
            for statement in statements:
                try:
                    await conn.execute(statement)
                except asyncpg.PostgresError as exc:
                    print(f"could not clean up: {statement}: {exc}", file=sys.stderr)
        finally:
            await conn.close()

    _in_thread(drop)


_LEFTOVERS: list[str] = []


def _leftovers(dsn: str, before: dict[str, set[str]] | None) -> None:
    """Record (and drop) what tests left on the test server; the run then fails.

    ``before`` is the private cluster's inventory at the start (everything new is a
    leftover); ``None`` means a shared server, where only names with the tag are ours.
    """
    now = _server_objects(dsn)
    found = {
        kind: sorted(
            names - before[kind] if before is not None else {n for n in names if SESSION_TAG in n}
        )
        for kind, names in now.items()
    }
    if not any(found.values()):
        return
    for kind, names in found.items():
        _LEFTOVERS.extend(f"{kind} {name!r}" for name in names)
    _drop(dsn, found)


@pytest.fixture(scope="session")
def pg_dsn() -> Iterator[str]:
    """DSN of a PostgreSQL server for the whole session (shared server or private pgserver).

    At the end, anything the tests left on it fails the run.
    """
    dsn = os.environ.get("STEEPLE_TEST_DSN")
    if dsn:
        yield dsn
        _leftovers(dsn, None)
        return
    server = _pgserver(
        "PostgreSQL (no STEEPLE_TEST_DSN and no pgserver package)",
        lambda: Path(
            os.environ.get("STEEPLE_TEST_PGDATA") or tempfile.mkdtemp(prefix="steeple-pg-")
        ),
    )
    try:
        dsn = _listen_on_tcp_only(server)
        before = _server_objects(dsn)
        yield dsn
        _leftovers(dsn, before)
    finally:
        server.cleanup()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _LEFTOVERS and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _LEFTOVERS:
        terminalreporter.section("leftovers on the test server", sep="=", red=True, bold=True)
        terminalreporter.line(
            "tests left these on the test server (dropped now; the run fails): "
            "drop what a test creates in a finally block or a fixture"
        )
        for item in _LEFTOVERS:
            terminalreporter.line(f"  {item}")


@pytest.fixture
async def pg_schema(pg_dsn: str) -> AsyncIterator[tuple[str, str]]:
    """A fresh schema name on the test server, dropped (with everything in it) afterwards."""
    import asyncpg

    schema = _test_name("t")
    try:
        conn = await asyncpg.connect(pg_dsn, timeout=10)
    except (TimeoutError, OSError, asyncpg.PostgresError) as exc:
        _unavailable(f"PostgreSQL at {pg_dsn!r} ({exc})")
    try:
        await conn.execute(f'CREATE SCHEMA "{schema}"')
    finally:
        await conn.close()
    try:
        yield pg_dsn, schema
    finally:
        conn = await asyncpg.connect(pg_dsn, timeout=10)
        try:
            await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        finally:
            await conn.close()


def _reachable(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except OSError:
        return False


def _service(env: str, default: str, host: str, port: int, what: str) -> str:
    url = os.environ.get(env, default)
    if not _reachable(host, port):
        _unavailable(f"{what} at {host}:{port}")
    return url


@pytest.fixture(scope="session")
def nats_url() -> str:
    """URL of the machine's NATS server with JetStream."""
    return _service("STEEPLE_TEST_NATS", "nats://127.0.0.1:4222", "127.0.0.1", 4222, "NATS")


@pytest.fixture(scope="session")
def redis_url() -> str:
    """URL of the machine's Redis server."""
    return _service("STEEPLE_TEST_REDIS", "redis://127.0.0.1:6379/0", "127.0.0.1", 6379, "Redis")


@pytest.fixture(scope="session")
def amqp_url() -> str:
    """URL of the machine's RabbitMQ server."""
    return _service(
        "STEEPLE_TEST_AMQP", "amqp://guest:guest@127.0.0.1:5672/", "127.0.0.1", 5672, "RabbitMQ"
    )


@pytest.fixture
def private_pg() -> Iterator[PostgresServer]:
    """A private PostgreSQL cluster (pgserver) that a test may stop, restart or kill."""
    # Not tmp_path: pytest prunes old basetemp folders, which another pytest session on the
    # same machine could do while this cluster still runs in one.
    server = _pgserver(
        "pgserver (private PostgreSQL clusters)",
        lambda: Path(tempfile.mkdtemp(prefix="steeple-private-pg-")) / "pgdata",
    )
    try:
        yield server
    finally:
        server.cleanup()
