"""The ``steeple`` command against a real PostgreSQL: every command, errors and exit codes."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import stat
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from steeple.admin.cli import app
from steeple.admin.settings import ExitCode
from steeple.postgres.queue import LIBRARY_SCHEMA_VERSION

runner = CliRunner()


def invoke(args: list[str], env: dict[str, str] | None = None) -> Any:
    return runner.invoke(app, args, env=env, catch_exceptions=False)


async def ainvoke(args: list[str], env: dict[str, str] | None = None) -> Any:
    """Run the command on a worker thread: it starts its own event loop."""
    return await asyncio.to_thread(invoke, args, env)


def fresh_key(key_id: str = "k1") -> str:
    return f"{key_id}:{base64.b64encode(os.urandom(32)).decode()}"


pytestmark = pytest.mark.usefixtures("clean_env")


@pytest.mark.postgres
async def test_initialize_is_idempotent_and_checks_configuration(
    pg_schema: tuple[str, str],
) -> None:
    dsn, schema = pg_schema
    keys = fresh_key()
    env = {"STEEPLE_KEYS": keys, "STEEPLE_DATABASE_URL": dsn}
    base = ["--schema", schema, "--namespace", "billing"]
    first = await ainvoke(["initialize", *base], env)
    assert first.exit_code == 0, first.output
    assert "initialized namespace 'billing'" in first.stdout
    again = await ainvoke(["initialize", *base], env)
    assert again.exit_code == 0, again.output
    listed = await ainvoke(["schedules", *base, "--json"], env)
    assert listed.exit_code == 0, listed.output
    assert json.loads(listed.stdout) == {"items": [], "next_cursor": None}
    # the stored configuration binding must match: a different quota is a config error
    other_quota = await ainvoke(["schedules", *base, "--max-definitions", "7"], env)
    assert other_quota.exit_code == ExitCode.CONFIG
    # issue 14: the error names the values the namespace was initialized with
    assert "initialized with max_definitions=1000" in other_quota.stderr
    assert "used max_definitions=7" in other_quota.stderr
    assert "--max-definitions 1000" in other_quota.stderr
    # another key cannot open the namespace
    wrong_key = await ainvoke(["schedules", *base], {**env, "STEEPLE_KEYS": fresh_key("k9")})
    assert wrong_key.exit_code == ExitCode.CONFIG
    assert "k1" in wrong_key.stderr
    assert "max-definitions" not in wrong_key.stderr  # a key hint, not a quota hint
    assert keys.split(":")[1] not in wrong_key.output


@pytest.mark.postgres
async def test_initialize_grants_a_runtime_role(
    pg_schema: tuple[str, str], pg_name: Callable[[str], str]
) -> None:
    import asyncpg

    dsn, schema = pg_schema
    role = pg_name("rt")
    conn = await asyncpg.connect(dsn)
    await conn.execute(f'CREATE ROLE "{role}" NOLOGIN')
    try:
        env = {"STEEPLE_KEYS": fresh_key(), "STEEPLE_DATABASE_URL": dsn}
        result = await ainvoke(["initialize", "--schema", schema, "--grant-to", role], env)
        assert result.exit_code == 0, result.output
        assert f"to role '{role}'" in result.stdout
        allowed = await conn.fetchval(
            "SELECT has_table_privilege($1, $2, 'SELECT')",
            role,
            f'"{schema}".recurring_occurrences',
        )
        creates = await conn.fetchval("SELECT has_schema_privilege($1, $2, 'CREATE')", role, schema)
        missing = await ainvoke(
            ["initialize", "--schema", schema, "--grant-to", "no_such_r0le"], env
        )
    finally:
        await conn.execute(f'DROP OWNED BY "{role}"')
        await conn.execute(f'DROP ROLE "{role}"')
        await conn.close()
    assert allowed is True
    assert creates is False
    # a role that does not exist is a configuration error (issue 10: typed, not the driver's)
    assert missing.exit_code == ExitCode.CONFIG
    assert "no_such_r0le" in missing.stderr


@pytest.mark.postgres
async def test_connect_to_an_uninitialized_schema_says_to_initialize(
    pg_schema: tuple[str, str],
) -> None:
    dsn, schema = pg_schema
    result = await ainvoke(
        ["occurrences", "--dsn", dsn, "--schema", schema], {"STEEPLE_KEYS": fresh_key()}
    )
    assert result.exit_code == ExitCode.CONFIG
    assert "steeple initialize" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 2  # the error and what to do


@pytest.mark.postgres
async def test_listings_as_json_and_tables(seeded: Any) -> None:
    env = seeded.env()
    schedules = await ainvoke(["schedules", "--json"], env)
    assert schedules.exit_code == 0, schedules.output
    names = sorted(s["name"] for s in json.loads(schedules.stdout)["items"])
    assert names == ["five-minutely", "minutely"]
    first = await ainvoke(["occurrences", "--json", "--limit", "4"], env)
    page = json.loads(first.stdout)
    assert len(page["items"]) == 4
    assert page["next_cursor"]
    rest = await ainvoke(["occurrences", "--json", "--after", page["next_cursor"]], env)
    ids = [o["occurrence_id"] for o in page["items"]]
    ids += [o["occurrence_id"] for o in json.loads(rest.stdout)["items"]]
    assert sorted(ids) == sorted(seeded.occurrence_ids)
    assert "secret" not in first.stdout + rest.stdout  # never payloads
    tasks = await ainvoke(["tasks", "--json"], env)
    assert tasks.exit_code == 0, tasks.output
    # The newest first: on a busy queue the latest work is on the first page.
    newest = [t["task_id"] for t in json.loads(tasks.stdout)["items"]]
    assert newest == sorted(seeded.task_ids, reverse=True)
    first_page = await ainvoke(["tasks", "--json", "--limit", "1"], env)
    assert [t["task_id"] for t in json.loads(first_page.stdout)["items"]] == [newest[0]]
    oldest = await ainvoke(["tasks", "list", "--json", "--oldest-first"], env)
    assert [t["task_id"] for t in json.loads(oldest.stdout)["items"]] == list(seeded.task_ids)
    pending = await ainvoke(["tasks", "--json", "--state", "succeeded"], env)
    assert json.loads(pending.stdout)["items"] == []
    bad_state = await ainvoke(["tasks", "--state", "sleeping"], env)
    assert bad_state.exit_code == ExitCode.USAGE  # issue 14: usage is 2
    table = await ainvoke(["occurrences"], {**env, "COLUMNS": "200"})
    assert table.exit_code == 0
    assert "dead" in table.stdout
    assert "minutely" in table.stdout


@pytest.mark.postgres
async def test_cancel_retry_purge(seeded: Any) -> None:
    env = seeded.env()
    unconfirmed = await ainvoke(["cancel", "five-minutely"], env)
    assert unconfirmed.exit_code == ExitCode.USAGE  # no terminal to ask on, no --yes
    assert "--yes" in unconfirmed.stderr
    cancelled = await ainvoke(["cancel", "five-minutely", "--yes"], env)
    assert cancelled.exit_code == 0, cancelled.output
    assert "cancelled definition 'five-minutely'" in cancelled.stdout
    unknown = await ainvoke(["cancel", "nope", "--yes"], env)
    assert unknown.exit_code == ExitCode.FAILED
    assert "nope" in unknown.stderr
    both = await ainvoke(["cancel", "minutely", "--task", "1"], env)
    assert both.exit_code == ExitCode.USAGE
    neither = await ainvoke(["cancel"], env)
    assert neither.exit_code == ExitCode.USAGE

    retried = await ainvoke(["retry", seeded.dead_id], env)
    assert retried.exit_code == 0, retried.output
    assert "pending again" in retried.stdout
    twice = await ainvoke(["retry", seeded.dead_id], env)
    assert twice.exit_code == ExitCode.FAILED
    missing = await ainvoke(["retry", uuid.uuid4().hex], env)
    assert missing.exit_code == ExitCode.FAILED

    dry = await ainvoke(["purge", "--older-than", "0s", "--dry-run"], env)
    assert dry.exit_code == 0, dry.output
    assert f"dry run: {seeded.published} terminal occurrences" in dry.stdout
    assert (await ainvoke(["purge", "--older-than", "0s"], env)).exit_code == ExitCode.USAGE
    purged = await ainvoke(["purge", "--older-than", "0s", "--yes"], env)
    assert purged.exit_code == 0, purged.output
    assert f"purged {seeded.published} terminal occurrences" in purged.stdout
    bad_age = await ainvoke(["purge", "--older-than", "soon", "--yes"], env)
    assert bad_age.exit_code == ExitCode.USAGE

    task_id = seeded.task_ids[0]
    cancel_task = await ainvoke(["cancel", "--task", str(task_id), "--yes"], env)
    assert cancel_task.exit_code == 0, cancel_task.output
    already = await ainvoke(["tasks", "cancel", str(task_id), "--yes"], env)
    assert already.exit_code == 0  # cancelling a cancelled task is idempotent
    no_task = await ainvoke(["cancel", "--task", "987654", "--yes"], env)
    assert no_task.exit_code == ExitCode.FAILED
    pruned = await ainvoke(["purge", "--tasks", "--older-than", "0s", "--yes"], env)
    assert pruned.exit_code == 0
    assert "purged 1 terminal task older" in pruned.stdout
    states = json.loads((await ainvoke(["tasks", "--json", "--oldest-first"], env)).stdout)
    assert [t["task_id"] for t in states["items"]] == list(seeded.task_ids[1:])

    listing = await ainvoke(["schedules", "--json"], env)
    listed = {s["name"]: s["state"] for s in json.loads(listing.stdout)["items"]}
    assert listed == {"five-minutely": "cancelled", "minutely": "active"}


@pytest.mark.postgres
async def test_keys_show_counts_sealed_records_per_key_id(seeded: Any) -> None:
    env = seeded.env()
    alone = await ainvoke(["keys", "show", "--json"], env)
    assert alone.exit_code == 0, alone.output
    (k1,) = json.loads(alone.stdout)["keys"]
    assert k1["key_id"] == "k1"
    assert k1["role"] == "primary"
    # the binding, two definitions, and the occurrences that still hold content
    assert k1["records"] >= 3
    rotated = await ainvoke(
        ["keys", "show", "--json"], {**env, "STEEPLE_KEYS": f"{fresh_key('k2')},{seeded.keys}"}
    )
    keys = {k["key_id"]: k for k in json.loads(rotated.stdout)["keys"]}
    assert keys["k2"]["role"] == "primary"
    assert keys["k2"]["records"] == 0
    assert keys["k1"] == {"key_id": "k1", "role": "previous", "records": k1["records"]}
    lost = await ainvoke(
        ["keys", "show"], {**env, "STEEPLE_KEYS": fresh_key("k2"), "COLUMNS": "160"}
    )
    assert lost.exit_code == 0
    assert "NOT CONFIGURED" in lost.stdout
    empty_schema = await ainvoke(["keys", "show", "--schema", "no_such_schema_x"], env)
    assert empty_schema.exit_code == ExitCode.CONFIG


@pytest.mark.postgres
async def test_worker_on_an_unmigrated_queue_says_to_migrate(
    pg_schema: tuple[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dsn, schema = pg_schema
    (tmp_path / "unmigrated_app.py").write_text(
        "from steeple.admin import WorkerApp\n"
        "from steeple.postgres.queue import Task\n"
        "async def handle(ctx, args):\n    pass\n"
        "app = WorkerApp(tasks=[(Task('t'), handle)])\n"
    )
    monkeypatch.chdir(tmp_path)
    result = await ainvoke(
        ["worker", "--app", "unmigrated_app:app", "--dsn", dsn, "--queue-schema", schema],
        {"STEEPLE_KEYS": fresh_key()},
    )
    assert result.exit_code == ExitCode.CONFIG, result.output
    assert "steeple migrate" in result.stderr


@pytest.mark.postgres
async def test_migrate_is_idempotent(pg_schema: tuple[str, str]) -> None:
    dsn, schema = pg_schema
    for _ in range(2):
        result = await ainvoke(["migrate", "--dsn", dsn, "--queue-schema", schema])
        assert result.exit_code == 0, result.output
        version = LIBRARY_SCHEMA_VERSION
        assert f"work queue schema '{schema}' is at version {version}" in result.stdout
    tasks = await ainvoke(["tasks", "--dsn", dsn, "--queue-schema", schema, "--json"])
    assert json.loads(tasks.stdout) == {"items": [], "next_cursor": None}
    bad = await ainvoke(["migrate", "--dsn", dsn, "--queue-schema", "Not-Valid"])
    assert bad.exit_code == ExitCode.CONFIG


def test_keys_generate_and_show(tmp_path: Path) -> None:
    generated = invoke(["keys", "generate", "--id", "2026-11"])
    assert generated.exit_code == 0
    line = generated.stdout.strip()
    key_id, _, material = line.partition(":")
    assert key_id == "2026-11"
    assert len(base64.b64decode(material)) == 32
    assert "secret" in generated.stderr
    bad_id = invoke(["keys", "generate", "--id", "has space"])
    assert bad_id.exit_code == ExitCode.USAGE

    second = fresh_key("old")
    shown = invoke(["keys", "show", "--json"], {"STEEPLE_KEYS": f"{line},{second}"})
    assert shown.exit_code == 0
    shown_json = json.loads(shown.stdout)
    assert shown_json["primary"] == "2026-11"
    assert shown_json["key_ids"] == ["2026-11", "old"]
    assert [k["role"] for k in shown_json["keys"]] == ["primary", "previous"]
    assert material not in shown.output

    keys_file = tmp_path / "keys"
    keys_file.write_text(f"# rotated 2026-11\n{line}\n{second}\n")
    keys_file.chmod(0o644)
    too_open = invoke(["keys", "show", "--keys-file", str(keys_file)])
    assert too_open.exit_code == ExitCode.CONFIG
    assert "chmod 600" in too_open.stderr
    keys_file.chmod(stat.S_IRUSR | stat.S_IWUSR)
    from_file = invoke(["keys", "show", "--keys-file", str(keys_file)], {"COLUMNS": "120"})
    assert from_file.exit_code == 0
    assert "primary" in from_file.stdout
    assert "old" in from_file.stdout
    missing_file = invoke(["keys", "show", "--keys-file", str(tmp_path / "none")])
    assert missing_file.exit_code == ExitCode.CONFIG


@pytest.mark.parametrize(
    ("keys", "fragment"),
    [
        ("", "no storage keys"),
        ("nocolon", "id:base64"),
        ("k1:not-base64!!", "base64"),
        ("k1:" + base64.b64encode(b"short").decode(), "32 bytes"),
        (f"{fresh_key('a')},{fresh_key('a')}", "twice"),
    ],
)
def test_bad_keys_are_configuration_errors(keys: str, fragment: str) -> None:
    result = invoke(["keys", "show"], {"STEEPLE_KEYS": keys})
    assert result.exit_code == ExitCode.CONFIG
    assert fragment in result.stderr
    assert result.stderr.startswith("steeple: error:")


def test_usage_and_configuration_errors() -> None:
    keys = {"STEEPLE_KEYS": fresh_key()}
    no_dsn = invoke(["schedules"], keys)
    assert no_dsn.exit_code == ExitCode.CONFIG
    assert "STEEPLE_DATABASE_URL" in no_dsn.stderr
    not_pg = invoke(["schedules", "--dsn", "mysql://u:hunter2@h/db"], keys)
    assert not_pg.exit_code == ExitCode.CONFIG
    assert "hunter2" not in not_pg.stderr
    bad_limit = invoke(["schedules", "--dsn", "postgresql://x@127.0.0.1/db", "--limit", "0"])
    assert bad_limit.exit_code == ExitCode.USAGE
    unknown = invoke(["schedules", "--frobnicate"])
    assert unknown.exit_code == ExitCode.USAGE
    bad_lease = invoke(["schedules", "--dsn", "postgresql://x@127.0.0.1/db", "--lease", "1y"], keys)
    assert bad_lease.exit_code == ExitCode.USAGE
    bad_window = invoke(
        ["schedules", "--dsn", "postgresql://x@127.0.0.1/db", "--delivery-window", "30d"], keys
    )
    assert bad_window.exit_code == ExitCode.CONFIG
    assert "7 days" in bad_window.stderr
    bad_namespace = invoke(
        ["schedules", "--dsn", "postgresql://x@127.0.0.1/db", "--namespace", "Bad Name"], keys
    )
    assert bad_namespace.exit_code == ExitCode.CONFIG
    demo_duration = invoke(["demo", "--duration", "600"])
    assert demo_duration.exit_code == ExitCode.USAGE
    worker_ref = invoke(["worker", "--app", "nocolon", "--dsn", "postgresql://x@h/db"], keys)
    assert worker_ref.exit_code == ExitCode.USAGE
    worker_missing = invoke(
        ["worker", "--app", "no_such_module_x:app", "--dsn", "postgresql://x@h/db"], keys
    )
    assert worker_missing.exit_code == ExitCode.CONFIG
    serve_no_token = invoke(["admin", "serve", "--dsn", "postgresql://x@h/db"], keys)
    assert serve_no_token.exit_code == ExitCode.CONFIG
    assert "STEEPLE_ADMIN_TOKEN" in serve_no_token.stderr


def test_unreachable_database_is_exit_4() -> None:
    result = invoke(
        ["schedules", "--dsn", "postgresql://postgres@127.0.0.1:1/test"],
        {"STEEPLE_KEYS": fresh_key()},
    )
    assert result.exit_code == ExitCode.UNAVAILABLE
    assert "cannot connect to 127.0.0.1:1: connection refused" in result.stderr
    assert "PostgreSQL is running" in result.stderr


def test_an_earlier_invocations_secrets_do_not_mask_this_ones_output() -> None:
    # A password that equals the host is scrubbed from that invocation's output; a later
    # invocation in the same process (with another DSN) still names its host.
    first = invoke(
        ["schedules", "--dsn", "postgresql://u:127.0.0.1@127.0.0.1:1/test"],
        {"STEEPLE_KEYS": fresh_key()},
    )
    assert first.exit_code == ExitCode.UNAVAILABLE
    assert "127.0.0.1" not in first.stderr
    test_unreachable_database_is_exit_4()


@pytest.mark.parametrize(
    "command",
    [
        [],
        ["demo"],
        ["initialize"],
        ["migrate"],
        ["worker"],
        ["schedules"],
        ["occurrences"],
        ["tasks"],
        ["cancel"],
        ["retry"],
        ["purge"],
        ["keys"],
        ["keys", "generate"],
        ["keys", "show"],
        ["admin"],
        ["admin", "serve"],
        ["queues"],
        ["queues", "list"],
        ["queues", "pause"],
        ["queues", "resume"],
        ["queues", "limit"],
    ],
)
def test_help_everywhere(command: list[str]) -> None:
    result = invoke([*command, "--help"])
    assert result.exit_code == 0
    assert "Usage" in result.stdout
