"""Installing and checking the queue schema against a real PostgreSQL."""

from __future__ import annotations

import asyncio
import shutil
from importlib import resources
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from queue_support import wait_until
from steeple.postgres.queue import (
    LIBRARY_SCHEMA_VERSION,
    QueueConfigurationError,
    Scheduler,
    SchemaVersionMismatchError,
    Task,
    _schema,
    check_schema,
    enqueue,
    install,
    run_state,
    schema_version,
)


async def test_install_is_idempotent_and_records_the_version(pg_schema: tuple[str, str]) -> None:
    dsn, schema = pg_schema
    conn = await asyncpg.connect(dsn)
    try:
        assert await schema_version(conn, schema) == 0
        assert await install(conn, schema=schema) == LIBRARY_SCHEMA_VERSION
        assert await install(conn, schema=schema) == LIBRARY_SCHEMA_VERSION
        await check_schema(conn, schema)
        rows = await conn.fetch(
            f'SELECT version, name FROM "{schema}".schema_migrations ORDER BY version'
        )
        assert [(r["version"], r["name"]) for r in rows] == [
            (1, "0001_create_queue_tables"),
            (2, "0002_due_work_survives_clock_steps"),
            (5, "0005_job_time_zones_and_trace_context"),
            (6, "0006_named_queues_and_limits"),
            (7, "0007_results_progress_and_failure_details"),
            (8, "0008_claim_reads_tasks_by_index"),
            (9, "0009_claim_in_one_statement"),
            (10, "0010_vacuum_and_bounded_counts"),
            (11, "0011_claim_limits_written_once"),
            (12, "0012_workflows"),
            (13, "0013_claim_walks_from_a_position"),
            (14, "0014_per_key_limits"),
            (15, "0015_workflow_limit_keys"),
            (16, "0016_complete_and_claim"),
            (17, "0017_limited_claim_planned_lean"),
            (18, "0018_claim_keeps_its_plans"),
            (19, "0019_pending_tasks_listed_by_id"),
        ]
        # The claim of workers of versions 6 to 12, and the one with positions.
        assert (
            await conn.fetchval(
                "SELECT count(*) FROM pg_proc WHERE pronamespace = $1::regnamespace"
                " AND proname = 'claim'",
                f'"{schema}"',
            )
            == 2
        )
        tables = {
            r["tablename"]
            for r in await conn.fetch(
                "SELECT tablename FROM pg_tables WHERE schemaname = $1", schema
            )
        }
        assert {"tasks", "jobs", "attempts", "schema_migrations", "settings"} <= tables
        indexes = {
            r["indexname"]: r["indexdef"]
            for r in await conn.fetch(
                "SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = $1", schema
            )
        }
        assert "WHERE (state = 'pending'" in indexes["tasks_claim_idx"]
        assert "(queue, priority DESC, run_at, id)" in indexes["tasks_claim_idx"]
        assert "WHERE (state = 'running'" in indexes["tasks_running_idx"]
        assert "WHERE (state = 'running'" in indexes["tasks_lease_idx"]
        assert "succeeded" in indexes["tasks_terminal_idx"]
        assert "UNIQUE" in indexes["tasks_dedup_idx"]
        # bigint ids everywhere
        types = await conn.fetch(
            "SELECT table_name, data_type FROM information_schema.columns "
            "WHERE table_schema = $1 AND column_name IN ('id', 'task_id', 'job_id')",
            schema,
        )
        assert types
        assert all(r["data_type"] == "bigint" for r in types)
        # tables are logged (durable): relpersistence 'p'
        persistence = await conn.fetch(
            "SELECT c.relpersistence::text FROM pg_class c "
            "JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname = $1 AND c.relkind = 'r'",
            schema,
        )
        assert {r[0] for r in persistence} == {"p"}
    finally:
        await conn.close()


async def test_concurrent_installs_apply_once(pg_schema: tuple[str, str]) -> None:
    dsn, schema = pg_schema
    conns = [await asyncpg.connect(dsn) for _ in range(6)]
    try:
        results = await asyncio.gather(*(install(c, schema=schema) for c in conns))
        assert results == [LIBRARY_SCHEMA_VERSION] * 6
        count = await conns[0].fetchval(f'SELECT count(*) FROM "{schema}".schema_migrations')
        # One row per migration (versions may have gaps while branches land in any order).
        assert count == len(_schema._MIGRATIONS)
    finally:
        for c in conns:
            await c.close()


async def test_install_creates_a_missing_schema(pg_dsn: str) -> None:
    conn = await asyncpg.connect(pg_dsn)
    schema = "t_queue_fresh_schema_install"
    try:
        await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        await install(conn, schema=schema)
        await check_schema(conn, schema)
    finally:
        await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        await conn.close()


async def test_mismatched_versions_raise_typed_errors(pg_schema: tuple[str, str]) -> None:
    dsn, schema = pg_schema
    conn = await asyncpg.connect(dsn)
    try:
        with pytest.raises(SchemaVersionMismatchError) as missing:
            await check_schema(conn, schema)
        assert missing.value.database_version == 0
        assert "not installed" in str(missing.value)

        await install(conn, schema=schema)
        await conn.execute(
            f'INSERT INTO "{schema}".schema_migrations (version, name) VALUES (99, $1)', "future"
        )
        with pytest.raises(SchemaVersionMismatchError) as newer:
            await check_schema(conn, schema)
        assert newer.value.database_version == 99
        assert newer.value.library_version == LIBRARY_SCHEMA_VERSION
        assert "newer" in str(newer.value)
        # install refuses to touch a newer schema
        with pytest.raises(SchemaVersionMismatchError):
            await install(conn, schema=schema)

        await conn.execute(f'DELETE FROM "{schema}".schema_migrations')
        with pytest.raises(SchemaVersionMismatchError):
            await check_schema(conn, schema)
    finally:
        await conn.close()


async def test_an_older_database_is_reported_and_install_migrates_it_forward(
    pg_schema: tuple[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    dsn, schema = pg_schema
    conn = await asyncpg.connect(dsn)
    try:
        await install(conn, schema=schema)
        # A library one version ahead, shipping one more (forward-only) migration.
        current = LIBRARY_SCHEMA_VERSION
        ahead = current + 1
        migrations = (*_schema._MIGRATIONS, (ahead, "9999_test_only"))
        monkeypatch.setattr(_schema, "_MIGRATIONS", migrations)
        monkeypatch.setattr(_schema, "LIBRARY_SCHEMA_VERSION", ahead)
        monkeypatch.setattr(
            _schema,
            "_migration_sql",
            lambda name, quoted: f"CREATE TABLE {quoted}.added_by_v2 (x int)",
        )
        with pytest.raises(SchemaVersionMismatchError, match="older") as err:
            await _schema.check_schema(conn, schema)
        assert (err.value.database_version, err.value.library_version) == (current, ahead)
        assert await _schema.install(conn, schema=schema) == ahead
        await _schema.check_schema(conn, schema)
        assert await conn.fetchval("SELECT to_regclass($1) IS NOT NULL", f'"{schema}".added_by_v2')
        versions = await conn.fetch(
            f'SELECT version FROM "{schema}".schema_migrations ORDER BY version'
        )
        assert [r[0] for r in versions] == [version for version, _ in migrations]
    finally:
        await conn.close()


async def test_an_index_built_concurrently_before_the_upgrade_to_19_is_kept(
    pg_schema: tuple[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An operator builds the pending tasks' index CONCURRENTLY before upgrading a large
    table (writes go on meanwhile); the migration then keeps it instead of failing."""
    dsn, schema = pg_schema
    conn = await asyncpg.connect(dsn)
    try:
        with monkeypatch.context() as patched:
            older = tuple(m for m in _schema._MIGRATIONS if m[0] <= 18)
            patched.setattr(_schema, "_MIGRATIONS", older)
            patched.setattr(_schema, "LIBRARY_SCHEMA_VERSION", 18)
            assert await install(conn, schema=schema) == 18
        assert await schema_version(conn, schema) == 18
        await conn.execute(
            f'CREATE INDEX CONCURRENTLY tasks_pending_id_idx ON "{schema}".tasks (id) '
            "WHERE state = 'pending'"
        )
        assert await install(conn, schema=schema) == LIBRARY_SCHEMA_VERSION
        valid = await conn.fetch(
            "SELECT i.indisvalid FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
            "JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname = $1 AND c.relname = 'tasks_pending_id_idx'",
            schema,
        )
        assert [r[0] for r in valid] == [True]
    finally:
        await conn.close()


async def test_scheduler_refuses_an_uninstalled_schema(pg_schema: tuple[str, str]) -> None:
    dsn, schema = pg_schema
    worker = Scheduler(dsn, worker_id="w", schema=schema)

    async def handler(ctx: object, args: object) -> None:
        return None

    worker.register(Task("x"), handler)
    with pytest.raises(SchemaVersionMismatchError):
        await worker.run_until_shutdown(asyncio.Event())
    assert worker.health().value == "stopped"


@pytest.mark.parametrize("bad", ["", "Upper", "has space", 'quo"te', "x" * 64, "1abc"])
async def test_invalid_schema_names_are_refused(pg_dsn: str, bad: str) -> None:
    conn = await asyncpg.connect(pg_dsn)
    try:
        with pytest.raises(QueueConfigurationError):
            await install(conn, schema=bad)
    finally:
        await conn.close()


async def test_the_shipped_sql_applied_by_hand_with_psql_is_a_schema_a_worker_runs_on(
    pg_schema: tuple[str, str], tmp_path: Path
) -> None:
    # A host that ships the queue's SQL in its own migration tool: every up.sql, in order,
    # __SCHEMA__ replaced by the quoted schema name, each run by psql in one transaction.
    dsn, schema = pg_schema
    psql = shutil.which("psql")
    assert psql is not None, "psql (postgresql-client) is needed to apply the SQL by hand"
    root = resources.files("steeple.postgres.queue") / "migrations"
    names = sorted(entry.name for entry in root.iterdir() if entry.is_dir())
    assert names == [name for _, name in _schema._MIGRATIONS]
    for name in names:
        script = tmp_path / f"{name}.sql"
        script.write_text((root / name / "up.sql").read_text().replace("__SCHEMA__", f'"{schema}"'))
        process = await asyncio.create_subprocess_exec(
            psql,
            "-X",
            "-q",
            "-v",
            "ON_ERROR_STOP=1",
            "--single-transaction",
            "-d",
            dsn,
            "-f",
            str(script),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        _, err = await process.communicate()
        assert process.returncode == 0, (name, err.decode())
    conn = await asyncpg.connect(dsn)
    try:
        assert await schema_version(conn, schema) == LIBRARY_SCHEMA_VERSION
        await check_schema(conn, schema)
        # The library's own runner accepts the hand-built schema as current (a no-op).
        assert await install(conn, schema=schema) == LIBRARY_SCHEMA_VERSION
        task: Task[Any] = Task("by_hand")
        handle = await enqueue(conn, task, {"n": 20}, schema=schema)
        worker = Scheduler(
            dsn, worker_id="w", schema=schema, poll_interval=0.1, maintenance_interval=0.1
        )

        async def handler(ctx: object, args: Any) -> int:
            return int(args["n"]) + 1

        worker.register(task, handler)
        stop = asyncio.Event()
        running = asyncio.create_task(worker.run_until_shutdown(stop))
        try:

            async def succeeded() -> bool:
                if running.done():
                    running.result()  # a refusal of the schema surfaces here
                state = await run_state(conn, handle.id, schema=schema)
                return state.state.value == "succeeded"

            await wait_until(succeeded)
        finally:
            stop.set()
            await asyncio.wait_for(running, 30)
        assert (await run_state(conn, handle.id, schema=schema)).result == 21
    finally:
        await conn.close()
