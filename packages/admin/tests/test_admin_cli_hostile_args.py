"""Hostile arguments to every command: one typed line and a documented exit code, no traceback.

Issue 10, item 5 (the command line): NUL, lone surrogates (undecodable argv bytes), 10 KB
strings, integers beyond int64, negative, NaN and infinite durations, quotes and braces, and
malformed DSNs (bad ports, garbage) exit 2 (usage) or 3 (configuration) with one line that
says what to fix, or 0/1 where the value is legal and simply names nothing; never 4
("unavailable") for bad input, and never "unexpected".
"""

from __future__ import annotations

import asyncio
import os
import secrets
import sys
import uuid
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from typer.testing import CliRunner

from steeple.admin.cli import app

pytestmark = [pytest.mark.postgres, pytest.mark.usefixtures("clean_env")]

STEEPLE = [sys.executable, "-c", "from steeple.admin.cli import main; main()"]

HOSTILE: dict[str, str] = {
    "nul": "a\x00b",
    "surrogate": "a\udc80b",
    "10kb": "x" * 10_000,
    "10kb-digits": "9" * 10_000,
    "beyond-int64": "9" * 30,
    "negative": "-1",
    "nan": "nan",
    "inf": "inf",
    "negative-duration": "-5m",
    "fraction": "1.5",
    "quotes": "'\";--",
    "braces": "rtv{role}",
    "newline": "a\nb",
    "escape": "\x1b[31m",
    "empty": "",
}

# (command, option) -> the arguments before and after the hostile value
OPTIONS: list[tuple[str, list[str], list[str]]] = [
    ("schedules --after", ["schedules", "--after"], []),
    ("schedules --limit", ["schedules", "--limit"], []),
    ("schedules --namespace", ["schedules", "--namespace"], []),
    ("schedules --max-definitions", ["schedules", "--max-definitions"], []),
    ("schedules --max-occurrences", ["schedules", "--max-occurrences"], []),
    ("schedules --lease", ["schedules", "--lease"], []),
    ("schedules --delivery-window", ["schedules", "--delivery-window"], []),
    ("occurrences --after", ["occurrences", "--after"], []),
    ("tasks --after", ["tasks", "--after"], []),
    ("tasks --state", ["tasks", "--state"], []),
    ("tasks --limit", ["tasks", "--limit"], []),
    ("cancel NAME", ["cancel", "--yes"], []),
    ("cancel --task", ["cancel", "--yes", "--task"], []),
    ("retry ID", ["retry"], []),
    ("purge --older-than", ["purge", "--yes", "--older-than"], []),
    ("purge --tasks --older-than", ["purge", "--yes", "--tasks", "--older-than"], []),
    ("purge --limit", ["purge", "--yes", "--limit"], []),
    ("purge --dry-run --older-than", ["purge", "--dry-run", "--older-than"], []),
    # issue 14's commands
    ("--config", ["schedules", "--config"], []),
    (
        "schedules create --name",
        [
            "schedules",
            "create",
            "--cron",
            "* * * * *",
            "--topic",
            "t",
            "--message-type",
            "m",
            "--name",
        ],
        [],
    ),
    (
        "schedules create --cron",
        ["schedules", "create", "--name", "n", "--topic", "t", "--message-type", "m", "--cron"],
        [],
    ),
    (
        "schedules create --topic",
        [
            "schedules",
            "create",
            "--name",
            "n",
            "--cron",
            "* * * * *",
            "--message-type",
            "m",
            "--topic",
        ],
        [],
    ),
    (
        "schedules create --first-after",
        [
            "schedules",
            "create",
            "--name",
            "n",
            "--cron",
            "* * * * *",
            "--topic",
            "t",
            "--message-type",
            "m",
            "--first-after",
        ],
        [],
    ),
    (
        "schedules create --policy",
        [
            "schedules",
            "create",
            "--name",
            "n",
            "--cron",
            "* * * * *",
            "--topic",
            "t",
            "--message-type",
            "m",
            "--policy",
        ],
        [],
    ),
    (
        "schedules create --header",
        [
            "schedules",
            "create",
            "--name",
            "n",
            "--cron",
            "* * * * *",
            "--topic",
            "t",
            "--message-type",
            "m",
            "--header",
        ],
        [],
    ),
    ("schedules create --file", ["schedules", "create", "--file"], []),
    ("tasks show ID", ["tasks", "show"], []),
    ("tasks retry ID", ["tasks", "retry"], []),
    ("tasks cancel ID", ["tasks", "cancel", "--yes"], []),
    ("tasks --name", ["tasks", "--name"], []),
    ("enqueue TASK", ["enqueue"], []),
    ("enqueue --args", ["enqueue", "t", "--args"], []),
    ("enqueue --at", ["enqueue", "t", "--at"], []),
    ("enqueue --in", ["enqueue", "t", "--in"], []),
    ("enqueue --priority", ["enqueue", "t", "--priority"], []),
    ("enqueue --max-attempts", ["enqueue", "t", "--max-attempts"], []),
    ("enqueue --dedup-key", ["enqueue", "t", "--dedup-key"], []),
    ("enqueue --queue", ["enqueue", "t", "--queue"], []),
    ("queues pause NAME", ["queues", "pause", "--yes"], []),
    ("queues resume NAME", ["queues", "resume"], []),
    ("queues limit NAME", ["queues", "limit"], []),
    ("queues limit --max-running", ["queues", "limit", "q", "--max-running"], []),
    ("queues limit --rate", ["queues", "limit", "q", "--per", "1s", "--rate"], []),
    ("queues limit --per", ["queues", "limit", "q", "--rate", "5", "--per"], []),
    ("jobs --after", ["jobs", "--after"], []),
    ("jobs create NAME", ["jobs", "create", "--task", "t", "--cron", "* * * * *"], []),
    ("jobs create --cron", ["jobs", "create", "j", "--task", "t", "--cron"], []),
    (
        "jobs create --args",
        ["jobs", "create", "j", "--task", "t", "--cron", "* * * * *", "--args"],
        [],
    ),
    ("jobs ensure --task", ["jobs", "ensure", "j", "--cron", "* * * * *", "--task"], []),
    (
        "jobs create --timezone",
        ["jobs", "create", "j", "--task", "t", "--cron", "0 1 * * *", "--timezone"],
        [],
    ),
    ("jobs reschedule --timezone", ["jobs", "reschedule", "j", "0 1 * * *", "--timezone"], []),
    ("jobs pause NAME", ["jobs", "pause"], []),
    ("jobs resume NAME", ["jobs", "resume"], []),
    ("jobs reschedule CRON", ["jobs", "reschedule", "j"], []),
    ("jobs delete NAME", ["jobs", "delete", "--yes"], []),
    ("keys generate --out", ["keys", "generate", "--out"], []),
    ("keys generate --id", ["keys", "generate", "--id"], []),
    ("keys show --namespace", ["keys", "show", "--namespace"], []),
    ("keys show --keys-file", ["keys", "show", "--keys-file"], []),
    ("initialize --namespace", ["initialize", "--namespace"], []),
    ("initialize --grant-to", ["initialize", "--grant-to"], []),
    ("initialize --max-definitions", ["initialize", "--max-definitions"], []),
    ("worker --app", ["worker", "--app"], []),
    ("admin serve --port", ["admin", "serve", "--port"], []),
    ("admin serve --host", ["admin", "serve", "--port", "0", "--host"], []),
    ("demo --duration", ["demo", "--duration"], []),
    ("demo --speed", ["demo", "--speed"], []),
    ("demo --lose-ack-every", ["demo", "--lose-ack-every"], ["--duration", "0"]),
    ("demo --port", ["demo", "--serve", "--port"], ["--duration", "0"]),
    ("--dsn", ["schedules", "--dsn"], []),
]
# Options naming a schema create it when the name is legal: only refused names go there.
SCHEMA_OPTIONS: list[tuple[str, list[str]]] = [
    ("schedules --schema", ["schedules", "--schema"]),
    ("initialize --schema", ["initialize", "--schema"]),
    ("migrate --queue-schema", ["migrate", "--queue-schema"]),
    ("tasks --queue-schema", ["tasks", "--queue-schema"]),
    ("jobs --queue-schema", ["jobs", "--queue-schema"]),
    ("enqueue --queue-schema", ["enqueue", "t", "--queue-schema"]),
    ("queues --queue-schema", ["queues", "--queue-schema"]),
    ("keys show --schema", ["keys", "show", "--schema"]),
    ("demo --schema", ["demo", "--schema"]),
]
REFUSED_SCHEMAS = ["nul", "surrogate", "10kb", "empty"]
MALFORMED_DSNS = [
    "postgresql://u:pw@127.0.0.1:99999/test",
    "postgresql://u:pw@127.0.0.1:abc/test",
    "postgresql://u:pw@127.0.0.1:-1/test",
    "postgresql://u:p/w@127.0.0.1/test",
    "postgresql://u@127.0.0.1/test?port=x",
    "postgresql://u@127.0.0.1/test?sslmode=bogus",
    "postgresql://[::1/test",
    "postgresql://u@h/db?a",
    "postgresql://u@h/db%zz",
    "host=127.0.0.1 password='pw dbname=test",  # key=value with an unterminated quote
    "host=127.0.0.1 pw dbname=test",  # key=value with a word without '='
    "host=127.0.0.1 port=99999 password=pw",
    "garbage",
    "",
]


def check(result: Any, where: object) -> None:
    text = result.stdout + result.stderr
    assert "Traceback" not in text, (where, text[-1500:])
    assert "unexpected" not in text, (where, text[-1500:])
    assert result.exit_code in {0, 1, 2, 3}, (where, result.exit_code, text[-1500:])
    if result.exit_code in {1, 3}:
        lines = result.stderr.strip().splitlines()
        assert lines[0].startswith("steeple: error:"), (where, result.stderr)
        assert len(lines) <= 2, (where, result.stderr)  # the error and what to do
        assert all(len(line) <= 1100 for line in lines), where


# Hundreds of command invocations in one process (about 50 s of CPU): on a loaded 2-core
# machine it may outlast the suite's default per-test timeout.
@pytest.mark.timeout(1200)
def test_every_option_with_hostile_values(
    seeded: Any, tmp_path: Path, drop_queue_schema: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # `keys generate --out VALUE` writes a file named VALUE: keep those in the test's own dir
    monkeypatch.chdir(tmp_path)
    env = {**seeded.env(), "STEEPLE_ADMIN_TOKEN": secrets.token_urlsafe(32)}
    # an empty --queue-schema means the default, <schema>_queue, which migrate creates
    drop_queue_schema.append(f"{seeded.schema}_queue")
    runner = CliRunner()
    codes: dict[int, int] = {}
    for label, before, after in OPTIONS:
        for kind, value in HOSTILE.items():
            args = [*before, value, *after]
            if label.startswith("demo"):
                # a malformed DSN: a legal value gets as far as the configuration check
                args += ["--data-dir", str(tmp_path / "demo"), "--dsn", "postgresql://u@h:0/x"]
            result = runner.invoke(app, args, env=env, catch_exceptions=False)
            check(result, (label, kind))
            codes[result.exit_code] = codes.get(result.exit_code, 0) + 1
    for label, before in SCHEMA_OPTIONS:
        for kind in REFUSED_SCHEMAS:
            args = [*before, HOSTILE[kind]]
            if label.startswith("demo"):
                args += ["--data-dir", str(tmp_path / "demo")]
            result = runner.invoke(app, args, env=env, catch_exceptions=False)
            check(result, (label, kind))
            if kind == "empty" and "--queue-schema" in label:
                assert result.exit_code == 0, result.output  # empty: the default schema
                continue
            assert result.exit_code in {2, 3}, (label, kind, result.stderr)
    # a malformed DSN is a configuration error naming what to fix, the DSN redacted
    for dsn in MALFORMED_DSNS:
        for source in ("flag", "env"):
            args = ["schedules"] + (["--dsn", dsn] if source == "flag" else [])
            run_env = {**env, "STEEPLE_DATABASE_URL": dsn} if source == "env" else env
            if not dsn:
                # an empty --dsn means "not given": the variable decides; unset it too
                run_env = {k: v for k, v in run_env.items() if k != "STEEPLE_DATABASE_URL"}
            result = runner.invoke(app, args, env=run_env, catch_exceptions=False)
            check(result, (dsn, source))
            if dsn.endswith("sslmode=bogus"):
                assert result.exit_code == 3, result.stderr  # asyncpg refuses the option
                continue
            assert result.exit_code == 3, (dsn, source, result.stderr)
            assert "pw" not in result.stderr.replace("postgresql", "")
    assert codes.get(2, 0) > 50
    assert codes.get(3, 0) > 20


def test_hostile_values_where_they_are_legal_change_nothing_else(seeded: Any) -> None:
    """Legal but hostile names reach the store and come back as 'not found' (exit 1)."""
    env = seeded.env()
    runner = CliRunner()
    for value in ("'\";--", "rtv{role}", "x" * 200, "a\nb", "\x1b[31m", "9" * 30):
        for args in (["cancel", value], ["retry", value]):
            result = runner.invoke(app, args, env=env, catch_exceptions=False)
            check(result, args)
            assert result.exit_code in {1, 2, 3}, (args, result.stderr)
            assert "\x1b" not in result.stderr
    listed = runner.invoke(app, ["schedules", "--json"], env=env, catch_exceptions=False)
    assert listed.exit_code == 0
    assert '"minutely"' in listed.stdout  # nothing was cancelled by a hostile name


async def test_hostile_schema_names_create_exactly_that_schema(seeded: Any, pg_dsn: str) -> None:
    """Legal hostile schema names are used literally (and dropped by this test)."""
    suffix = uuid.uuid4().hex[:8]
    names = [f"rtv{{role}}_{suffix}", f"'\";--_{suffix}", f"new\nline_{suffix}"]
    env = seeded.env()
    try:
        for name in names:
            result = await asyncio.to_thread(
                CliRunner().invoke, app, ["initialize", "--schema", name], env=env
            )
            assert result.exit_code == 0, result.output
            result = await asyncio.to_thread(
                CliRunner().invoke, app, ["migrate", "--queue-schema", name], env=env
            )
            assert result.exit_code == 3, result.output  # queue schemas are [a-z0-9_] only
        conn = await asyncpg.connect(pg_dsn)
        try:
            found = {
                r["nspname"]
                for r in await conn.fetch(
                    "SELECT nspname FROM pg_namespace WHERE nspname LIKE $1", f"%{suffix}%"
                )
            }
        finally:
            await conn.close()
        assert found == set(names)
    finally:
        conn = await asyncpg.connect(pg_dsn)
        try:
            for name in names:
                quoted = '"' + name.replace('"', '""') + '"'
                await conn.execute(f"DROP SCHEMA IF EXISTS {quoted} CASCADE")
        finally:
            await conn.close()


async def test_undecodable_and_huge_arguments_as_a_real_process(
    seeded: Any, tmp_path: Path
) -> None:
    """argv bytes that are not UTF-8 (lone surrogates in Python) and 10 KB values."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEEPLE_")}
    env.update(seeded.env())
    cases: list[tuple[list[bytes], set[int]]] = [
        ([b"schedules", b"--namespace", b"ns\xff"], {3}),
        ([b"schedules", b"--schema", b"s\xff"], {3}),
        ([b"cancel", b"--yes", b"def\xfe"], {1, 2, 3}),
        ([b"enqueue", b"t\xff"], {2}),
        ([b"enqueue", b"t", b"--args", b'{"a": "\xff"}'], {0, 2}),
        ([b"jobs", b"pause", b"j\xff"], {1, 2, 3}),
        ([b"tasks", b"--state", b"\xff"], {2}),
        ([b"schedules", b"--config", b"c\xff.toml"], {3}),
        ([b"retry", b"\xff" * 10], {1, 2, 3}),
        ([b"keys", b"generate", b"--id", b"k\xff"], {2}),
        ([b"initialize", b"--grant-to", b"r\xff"], {3}),
        ([b"schedules", b"--dsn", b"postgresql://u:p\xff@127.0.0.1/test"], {3}),
        ([b"schedules", b"--dsn", b"postgresql://u:pw@127.0.0.1:99999/test"], {3}),
        ([b"purge", b"--older-than", b"nan"], {2}),
        ([b"purge", b"--older-than", b"9" * 10_000], {2}),
        ([b"cancel", b"--task", b"9" * 30], {2}),
        ([b"schedules", b"--after", b"x" * 10_000], {0, 1, 3}),
        ([b"demo", b"--duration", b"nan"], {2}),
    ]

    async def one(argv: list[bytes], codes: set[int]) -> None:
        proc = await asyncio.create_subprocess_exec(
            *[os.fsencode(a) for a in STEEPLE],
            *argv,
            env=env,
            cwd=tmp_path,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await proc.communicate()
        text = (out + err).decode(errors="replace")
        assert proc.returncode in codes, (argv[:3], proc.returncode, text[-1500:])
        assert "Traceback" not in text, (argv[:3], text)
        assert "unexpected" not in text, (argv[:3], text)

    for argv, codes in cases:
        await one(argv, codes)


# --- stored text printed by every output path ------------------------------------------------

STORED = "\x1b[31mred\x1b[0m [bold]loud[/bold] :smile: \u202eevil\u2066x\u2069 a\u2028b\x85c\x07"
"""Stored text that would steer a terminal (ESC, BEL, C1), spoof it (bidi override and
isolate, line separator) or be read as rich markup or an emoji code."""


def assert_shown_safely(text: str) -> None:
    for raw in ("\x1b", "\x07", "\x85", "\u202e", "\u2066", "\u2069", "\u2028"):
        assert raw not in text, (raw, text)
    assert "\\x1b[31mred\\x1b[0m [bold]loud[/bold] :smile: \\u202eevil\\u2066x\\u2069" in text
    assert "\U0001f604" not in text  # the emoji code is printed as written


async def test_stored_text_is_escaped_in_tables_and_lines(seeded: Any) -> None:
    """Tables (listings) and plain lines (tasks show) escape what handlers stored."""
    from steeple.postgres import queue
    from steeple.postgres.queue._sql import queue_sql

    env = {**seeded.env(), "COLUMNS": "600"}
    conn = await asyncpg.connect(seeded.dsn)
    try:
        task: queue.Task[Any] = queue.Task("stored-text")
        options = queue.EnqueueOptions(max_attempts=1)
        task_id = (await queue.enqueue(conn, task, None, options, schema=seeded.schema)).id
        sql = queue_sql(seeded.schema)
        give_up = await conn.fetchval("SELECT extract(epoch FROM clock_timestamp()) + 60")
        (row,) = await conn.fetch(sql.claim, ["stored-text"], 1, "w", give_up)
        await conn.fetch(sql.fail, task_id, row["lease_token"], STORED, "w", None, None, None)
    finally:
        await conn.close()
    listed = await asyncio.to_thread(
        CliRunner().invoke, app, ["tasks", "--state", "failed"], env=env, catch_exceptions=False
    )
    assert listed.exit_code == 0, listed.output
    assert_shown_safely(listed.stdout)
    shown = await asyncio.to_thread(
        CliRunner().invoke, app, ["tasks", "show", str(task_id)], env=env, catch_exceptions=False
    )
    assert shown.exit_code == 0, shown.output
    assert_shown_safely(shown.stdout)


def test_log_lines_of_the_command_are_escaped() -> None:
    """Library log records (a worker's failed attempts, with their traceback) are escaped
    line by line, indentation kept."""
    import logging

    from steeple.admin._cli.output import LineFormatter

    record = logging.LogRecord("steeple.postgres.queue", logging.ERROR, "x", 1, STORED, (), None)
    record.exc_text = f"Traceback (most recent call last):\n  File 'h.py'\nLookupError: {STORED}"
    text = LineFormatter("steeple: warning: %(message)s").format(record)
    lines = text.split("\n")
    assert len(lines) == 4
    assert lines[2] == "  File 'h.py'"
    for line in (lines[0], lines[3]):
        assert_shown_safely(line)


# --- names: the library's one rule, exactly as typed --------------------------------------------

LOOKALIKE_NAMES = ["mail\u200b", "\u202eliame-dnes", " mail", "mail ", "   ", "mail\u2028"]
"""Names that look like "mail" (or like none): refused before anything is stored."""


def name_commands(value: str) -> list[list[str]]:
    cron = ["--cron", "* * * * *"]
    return [
        ["enqueue", value],
        ["enqueue", "mail", "--queue", value],
        ["tasks", "--name", value],
        ["tasks", "list", "--name", value],
        ["jobs", "create", value, "--task", "mail", *cron],
        ["jobs", "create", "mail-job", "--task", value, *cron],
        ["jobs", "ensure", value, "--task", "mail", *cron],
        ["jobs", "pause", value],
        ["jobs", "resume", value],
        ["jobs", "reschedule", value, "* * * * *"],
        ["jobs", "delete", value, "--yes"],
        ["queues", "pause", value, "--yes"],
        ["queues", "resume", value],
        ["queues", "limit", value, "--max-running", "1"],
    ]


async def _stored(dsn: str, schema: str) -> tuple[Any, ...]:
    conn = await asyncpg.connect(dsn)
    try:
        row = await conn.fetchrow(
            f"""SELECT (SELECT count(*) FROM "{schema}".tasks),
                       (SELECT count(*) FROM "{schema}".jobs),
                       (SELECT count(*) FROM "{schema}".settings)"""
        )
        assert row is not None
        return tuple(row)
    finally:
        await conn.close()


@pytest.mark.parametrize("value", LOOKALIKE_NAMES)
async def test_lookalike_names_are_refused_by_every_command(seeded: Any, value: str) -> None:
    """Usage (2), one line naming the rule, nothing stored; never trimmed into "mail"."""
    env = seeded.env()
    before = await _stored(seeded.dsn, seeded.schema)
    for args in name_commands(value):
        result = await asyncio.to_thread(
            CliRunner().invoke, app, args, env=env, catch_exceptions=False
        )
        assert result.exit_code == 2, (args, result.output)
        lines = result.stderr.strip().splitlines()
        assert lines[0].startswith("steeple: error: "), (args, result.stderr)
        assert len(lines) <= 2, (args, result.stderr)
        assert any(w in lines[0] for w in ("whitespace", "blank", "invisible")), lines[0]
        for raw in ("\u200b", "\u202e", "\u2028"):
            assert raw not in result.output
    assert await _stored(seeded.dsn, seeded.schema) == before
