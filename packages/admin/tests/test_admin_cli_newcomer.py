"""The command as a newcomer meets it: help, units, hints, tables at 80 columns, plurals.

Also the embedded default: a command run while a server is already running on the data
directory connects to it instead of starting (and stopping) its own.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from typer.testing import CliRunner

from steeple.admin.cli import app
from steeple.admin.settings import CliError, ExitCode, parse_duration

pytestmark = pytest.mark.usefixtures("clean_env")

HEAVY = (
    "asyncpg",
    "psycopg",
    "rich",
    "starlette",
    "uvicorn",
    "matplotlib",
    "hypothesis",
    "cryptography",
    "croniter",
    "pgserver",
    "steeple.testing",
    "steeple.postgres",
    "steeple.keyring",
    "steeple.engine",
    "steeple.core.calendar",
)
"""What ``steeple --help`` must not import: drivers, servers, tables, plots, the core's bulk."""


def invoke(args: list[str], env: dict[str, str] | None = None, cwd: Path | None = None) -> Any:
    here = Path.cwd()
    if cwd is not None:
        os.chdir(cwd)
    try:
        return CliRunner().invoke(app, args, env=env, catch_exceptions=False)
    finally:
        os.chdir(here)


async def ainvoke(args: list[str], env: dict[str, str] | None = None) -> Any:
    return await asyncio.to_thread(invoke, args, env)


def _imported_by(args: list[str]) -> list[str]:
    """Run the command with ``args`` in a fresh interpreter; list the heavy modules it loaded."""
    probe = (
        "import json, sys\n"
        "from steeple.admin.cli import app\n"
        "try:\n"
        f"    app({args!r}, prog_name='steeple')\n"
        "except SystemExit:\n"
        "    pass\n"
        f"print(json.dumps(sorted(m for m in {list(HEAVY)!r} if m in sys.modules)))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True
    )
    return list(json.loads(done.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize("args", [["--help"], ["tasks", "--help"], ["tasks", "show", "--help"]])
def test_help_imports_no_driver_server_table_or_plot(args: list[str]) -> None:
    assert _imported_by(args) == []


def test_each_commands_help_lists_the_place_options_under_one_heading() -> None:
    shown = invoke(["tasks", "show", "--help"])
    assert shown.exit_code == 0
    text = shown.stdout
    own, _, place = text.partition("\nWhere (")
    assert place, text
    assert "--json" in own
    for option in ("--dsn", "--config", "--schema", "--queue-schema"):
        assert option not in own, option
        assert option in place, option
    assert "every command" in place.splitlines()[0]
    assert "--dsn" in invoke(["schedules", "--help"]).stdout.partition("\nWhere (")[2]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("10s", timedelta(seconds=10)),
        ("5m", timedelta(minutes=5)),
        ("2h", timedelta(hours=2)),
        ("1d", timedelta(days=1)),
        ("1h30m", timedelta(minutes=90)),
    ],
)
def test_durations_take_a_unit(text: str, expected: timedelta) -> None:
    assert parse_duration(text, what="--in") == expected


def test_a_duration_without_a_unit_is_refused_not_taken_as_seconds() -> None:
    with pytest.raises(CliError) as caught:
        parse_duration("10", what="--in")
    assert caught.value.code == ExitCode.USAGE
    assert "no unit" in str(caught.value)
    assert caught.value.hint is not None
    assert "10s" in caught.value.hint
    # The command refuses it before connecting anywhere (no database is given here).
    result = invoke(["enqueue", "send-welcome", "--in", "10"])
    assert result.exit_code == ExitCode.USAGE, result.output
    assert "--in '10' has no unit" in result.stderr
    assert "10s for seconds" in result.stderr
    for option in (["queues", "limit", "q", "--rate", "5", "--per", "60"],):
        refused = invoke(option)
        assert refused.exit_code == ExitCode.USAGE, refused.output
        assert "no unit" in refused.stderr


def test_no_database_hint_names_the_embedded_setting(tmp_path: Path) -> None:
    result = invoke(["tasks"], cwd=tmp_path)
    assert result.exit_code == ExitCode.CONFIG, result.output
    assert "no database given" in result.stderr
    assert 'embedded = "DIR"' in result.stderr


# --- on a real PostgreSQL ----------------------------------------------------------------------


async def _failed_task(dsn: str, schema: str, name: str, error: str) -> int:
    """Enqueue a task and fail it for good with ``error``, as a worker would record it."""
    from steeple.postgres import queue
    from steeple.postgres.queue._sql import queue_sql

    conn = await asyncpg.connect(dsn)
    try:
        task: queue.Task[Any] = queue.Task(name)
        options = queue.EnqueueOptions(max_attempts=1)
        task_id = (await queue.enqueue(conn, task, {}, options, schema=schema)).id
        sql = queue_sql(schema)
        give_up = await conn.fetchval("SELECT extract(epoch FROM clock_timestamp()) + 60")
        (row,) = await conn.fetch(sql.claim, [name], 1, "w", give_up)
        await conn.fetch(sql.fail, task_id, row["lease_token"], error, "w", None, None, None)
        return int(task_id)
    finally:
        await conn.close()


@pytest.mark.postgres
async def test_the_task_table_at_80_columns_keeps_names_and_one_line_per_row(
    seeded: Any,
) -> None:
    env = {**seeded.env(), "COLUMNS": "80"}
    error = "SMTPRecipientsRefused: " + "the mail server refused every recipient " * 6
    failed = await _failed_task(seeded.dsn, seeded.schema, "send-welcome-email", error)
    table = await ainvoke(["tasks"], env)
    assert table.exit_code == 0, table.output
    lines = table.stdout.splitlines()
    assert all(len(line) <= 80 for line in lines), lines
    rule = next((i for i, line in enumerate(lines) if line.startswith("──")), None)
    assert rule is not None, table.stdout
    rows = [line for line in lines[rule + 1 :] if line.strip()]
    # One line per task: the three seeded ones and the failed one.
    assert len(rows) == len(seeded.task_ids) + 1, table.stdout
    row = next(line for line in rows if line.startswith(f"{failed} "))
    assert "send-welcome-email" in row  # the name is never cut
    assert "SMTP" in row  # the error is, with an ellipsis
    assert row.rstrip().endswith("…")
    assert all("send-report" in line for line in rows if line is not row)


@pytest.mark.postgres
async def test_counts_and_states_read_as_sentences(seeded: Any) -> None:
    env = seeded.env()
    failed = await _failed_task(seeded.dsn, seeded.schema, "flaky", "boom")
    one = await ainvoke(["purge", "--tasks", "--older-than", "0s", "--dry-run"], env)
    assert one.exit_code == 0, one.output
    assert "dry run: 1 terminal task finished" in one.stdout
    retried = await ainvoke(["tasks", "retry", str(failed)], env)
    assert retried.exit_code == 0, retried.output
    again = await ainvoke(["tasks", "retry", str(failed)], env)
    assert again.exit_code == ExitCode.FAILED
    assert f"task {failed} is still pending; only failed tasks" in again.stderr


# --- the embedded default ----------------------------------------------------------------------


def test_a_stale_pid_file_is_no_running_server(tmp_path: Path) -> None:
    from steeple.admin.embedded import running_server

    pgdata = tmp_path / "pgdata"
    pgdata.mkdir()
    assert running_server(pgdata) is None  # no file
    lines = ["999999999", str(pgdata), "0", "5432", str(pgdata), "", "0 0", "ready"]
    (pgdata / "postmaster.pid").write_text("\n".join(lines) + "\n")
    assert running_server(pgdata) is None  # no such process
    lines[0] = str(os.getpid())  # alive, but no postgres and no socket
    (pgdata / "postmaster.pid").write_text("\n".join(lines) + "\n")
    assert running_server(pgdata) is None
    (pgdata / "postmaster.pid").write_text("garbage")
    assert running_server(pgdata) is None


def _steeple(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEEPLE_")}
    probe = (
        "import sys\n"
        "from steeple.admin.cli import main\n"
        f"sys.argv = ['steeple', *{args!r}]\n"
        "try:\n"
        "    main()\n"
        "finally:\n"
        "    sys.stderr.write('pgserver imported: %s\\n' % ('pgserver' in sys.modules))\n"
    )
    return subprocess.run(
        [sys.executable, "-c", probe], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.slow
def test_commands_on_a_running_embedded_server_connect_to_it(tmp_path: Path) -> None:
    pytest.importorskip("pgserver")
    from steeple.admin.embedded import EmbeddedPostgres

    (tmp_path / "steeple.toml").write_text('embedded = "pg"\n')
    (tmp_path / "steeple.toml").chmod(0o600)
    server = EmbeddedPostgres(tmp_path / "pg")
    server.start()
    try:
        pid_file = tmp_path / "pg" / "pgdata" / "postmaster.pid"
        postmaster = pid_file.read_text().splitlines()[0]
        for args in (["migrate"], ["tasks", "--json"], ["tasks", "--json"]):
            done = _steeple(args, tmp_path)
            assert done.returncode == 0, done.stdout + done.stderr
            # Connected to the running server: no second postmaster, nothing stopped, and
            # not even pgserver (whose start-up checks cost more than the command) loaded.
            assert "pgserver imported: False" in done.stderr
            assert pid_file.read_text().splitlines()[0] == postmaster
        assert json.loads(done.stdout)["items"] == []
    finally:
        server.stop()
    assert not pid_file.exists()
