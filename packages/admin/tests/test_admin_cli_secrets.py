"""No output, error or log line of the ``steeple`` command carries a DSN password or key material.

Issue 10, item 2. A password is planted in every DSN form libpq accepts (URL userinfo, raw
or percent-encoded with ``@``, the ``password`` parameter in any case, ``key=value``
strings) and given through ``--dsn`` and ``STEEPLE_DATABASE_URL``; the seeded namespace's
storage key is planted in ``STEEPLE_KEYS`` (and malformed copies of it). Every command of
``steeple --help`` then runs its success paths and its failure paths (unreachable server,
missing database, malformed DSNs, bad keys, bad arguments), in-process and as real
processes; stdout, stderr and log records must hold neither the password (nor either half
of one cut at a raw ``@`` or ``/``) nor any 16-character piece of the key's base64.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import secrets
import signal
import socket
import sys
import textwrap
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

import asyncpg
import pytest
from typer.testing import CliRunner

from steeple.admin.cli import app

pytestmark = [pytest.mark.postgres, pytest.mark.usefixtures("clean_env")]

STEEPLE = [sys.executable, "-c", "from steeple.admin.cli import main; main()"]
PASSWORD = f"Pw{secrets.token_hex(8)}"
AT_HEAD, AT_TAIL = f"Ah{secrets.token_hex(5)}", f"At{secrets.token_hex(5)}"  # "head@tail"
SLASH_HEAD, SLASH_TAIL = f"Sh{secrets.token_hex(5)}", f"St{secrets.token_hex(5)}"  # "head/tail"
PLANTED = (PASSWORD, AT_HEAD, AT_TAIL, SLASH_HEAD, SLASH_TAIL)
TOKEN = "admin-token-" + secrets.token_urlsafe(32)
APP_MODULE = f"secretapp_{uuid.uuid4().hex[:8]}"
WORKER_APP = """
import os
import signal

from steeple.admin import WorkerApp
from steeple.postgres.queue import Task


async def send_report(ctx, args):
    # Stop once real work ran: the worker's SIGTERM handler drains and exits 0.
    os.kill(os.getpid(), signal.SIGTERM)


def make():
    return WorkerApp(tasks=[(Task("send-report"), send_report)], drain_timeout=5)
"""


def assert_clean(text: str, key_b64: str, where: object) -> None:
    """Neither a planted password (or half of one) nor 16 characters of the key."""
    for planted in PLANTED:
        assert planted not in text, (where, planted, text[-2000:])
    for start in range(len(key_b64) - 15):
        assert key_b64[start : start + 16] not in text, (where, text[-2000:])


def with_password(base: str, form: str) -> str:
    """``base`` (the test server's URL) with the password planted in ``form``."""
    parts = urlsplit(base)
    user = parts.username or "postgres"
    hostport = parts.netloc.rpartition("@")[2]
    query = parts.query
    if form == "userinfo":
        netloc = f"{user}:{PASSWORD}@{hostport}"
    elif form == "userinfo-at":
        netloc = f"{user}:{quote(AT_HEAD + '@' + AT_TAIL, safe='')}@{hostport}"
    else:
        netloc = f"{user}@{hostport}"
        key = {"query": "password", "query-case": "PassWord", "query-encoded": "pass%77ord"}[form]
        query = f"{query}&{key}={PASSWORD}" if query else f"{key}={PASSWORD}"
    return urlunsplit(parts._replace(netloc=netloc, query=query))


def failing_dsns(base: str) -> dict[str, str]:
    """DSNs that cannot work, each holding planted secrets: name -> DSN."""
    parts = urlsplit(with_password(base, "userinfo"))
    return {
        "unreachable": f"postgresql://postgres:{PASSWORD}@127.0.0.1:1/test?password={PASSWORD}",
        "no-database": urlunsplit(parts._replace(path=f"/steeple_none_{uuid.uuid4().hex[:8]}")),
        "port-99999": f"postgresql://postgres:{PASSWORD}@127.0.0.1:99999/test",
        "port-abc": f"postgresql://postgres:{PASSWORD}@127.0.0.1:abc/test",
        "raw-slash": f"postgresql://postgres:{SLASH_HEAD}/{SLASH_TAIL}@127.0.0.1:5432/test",
        "raw-at": f"postgresql://postgres:{AT_HEAD}@{AT_TAIL}@127.0.0.1:5432/test",
        "raw-question": f"postgresql://postgres:{AT_HEAD}?{AT_TAIL}@127.0.0.1:5432/test",
        "key-value": f"host=127.0.0.1 port=5432 user=postgres password='{PASSWORD} \\'x' dbname=t",
        "garbage": f"{PASSWORD} {AT_HEAD}@{AT_TAIL}",
        "param-case": with_password(base, "query-case"),  # a server setting PostgreSQL refuses
    }


def dsn_commands(schema: str, demo_dir: Path, port: int) -> dict[str, list[str]]:
    """Every command that takes a DSN, aimed at the seeded namespace (name -> arguments)."""
    place = ["--schema", schema, "--namespace", "ops", "--queue-schema", schema]
    return {
        "initialize": ["initialize", *place[:4]],
        "migrate": ["migrate", "--queue-schema", schema],
        "schedules": ["schedules", *place[:4]],
        "occurrences": ["occurrences", *place[:4], "--json"],
        "tasks": ["tasks", "--queue-schema", schema, "--json"],
        "cancel": ["cancel", "minutely", "--yes", *place],
        "cancel-task": ["cancel", "--task", "1", "--yes", *place],
        "retry": ["retry", "0" * 32, *place[:4]],
        "purge": ["purge", "--yes", *place],
        "purge-tasks": ["purge", "--tasks", "--yes", *place],
        "purge-dry-run": ["purge", "--dry-run", *place],
        "keys-show": ["keys", "show", *place[:4]],
        # issue 14's commands
        "schedules-create": [
            "schedules",
            "create",
            *place[:4],
            "--name",
            "created-by-cli",
            "--cron",
            "*/5 * * * *",
            "--topic",
            "ops.events",
            "--message-type",
            "Tick",
            "--first-after",
            "2026-01-01T00:00Z",
        ],
        "tasks-show": ["tasks", "show", "1", "--queue-schema", schema],
        "tasks-retry": ["tasks", "retry", "1", "--queue-schema", schema],
        "tasks-cancel": ["tasks", "cancel", "1", "--yes", "--queue-schema", schema],
        "enqueue": ["enqueue", "send-report", "--args", '{"n": 9}', "--queue-schema", schema],
        "jobs": ["jobs", "--queue-schema", schema, "--json"],
        "jobs-ensure": [
            "jobs",
            "ensure",
            "nightly",
            "--task",
            "send-report",
            "--cron",
            "0 2 * * *",
            "--queue-schema",
            schema,
        ],
        "jobs-pause": ["jobs", "pause", "nightly", "--queue-schema", schema],
        "jobs-create": [
            "jobs",
            "create",
            "weekly",
            "--task",
            "send-report",
            "--cron",
            "0 3 * * 1",
            "--args",
            '{"n": 1}',
            "--queue-schema",
            schema,
        ],
        "jobs-resume": ["jobs", "resume", "nightly", "--queue-schema", schema],
        "jobs-reschedule": ["jobs", "reschedule", "nightly", "0 5 * * *", "--queue-schema", schema],
        "jobs-delete": ["jobs", "delete", "nightly", "--yes", "--queue-schema", schema],
        "queues": ["queues", "--queue-schema", schema, "--json"],
        "queues-pause": ["queues", "pause", "mail", "--yes", "--queue-schema", schema],
        "queues-limit": [
            "queues",
            "limit",
            "mail",
            "--max-running",
            "3",
            "--queue-schema",
            schema,
        ],
        "queues-resume": ["queues", "resume", "mail", "--queue-schema", schema],
        "enqueue-queue": ["enqueue", "send-report", "--queue", "mail", "--queue-schema", schema],
        "admin-serve-queue-only": [
            "admin",
            "serve",
            "--queue-only",
            "--port",
            str(port),
            "--queue-schema",
            schema,
        ],
        "worker": ["worker", "--app", f"{APP_MODULE}:make", *place],
        "admin-serve": ["admin", "serve", *place, "--port", str(port)],
        "demo": [
            "demo",
            "--schema",
            f"{schema}_demo",
            "--duration",
            "1",
            "--data-dir",
            str(demo_dir),
        ],
    }


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def invoke(args: list[str], env: dict[str, str]) -> Any:
    return CliRunner().invoke(app, args, env=env, catch_exceptions=False)


def output_of(result: Any) -> str:
    return str(result.stdout) + str(result.stderr)


def assert_one_line_error(result: Any, where: object) -> None:
    """A failure is one error line plus an optional 'what to do' line, no traceback."""
    text = output_of(result)
    assert "Traceback" not in text, (where, text)
    errors = [line for line in result.stderr.splitlines() if line.startswith("steeple: error:")]
    assert len(errors) == 1, (where, result.stderr)


@pytest.fixture
def worker_app(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / f"{APP_MODULE}.py").write_text(textwrap.dedent(WORKER_APP))
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


@pytest.fixture
def drop_after(pg_dsn: str) -> Iterator[list[str]]:
    """Schemas (the demo's) and roles a test names here are dropped after it, even on failure."""
    names: list[str] = []
    yield names

    async def drop() -> None:
        conn = await asyncpg.connect(pg_dsn)
        try:
            for name in names:
                if name.startswith("role:"):
                    role = '"' + name[5:].replace('"', '""') + '"'
                    if await conn.fetchval("SELECT 1 FROM pg_roles WHERE rolname = $1", name[5:]):
                        await conn.execute(f"DROP OWNED BY {role}; DROP ROLE {role}")
                else:
                    await conn.execute(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')
        finally:
            await conn.close()

    asyncio.run(drop())


def test_every_command_path_in_process(
    seeded: Any,
    pg_dsn: str,
    tmp_path: Path,
    worker_app: Path,
    drop_after: list[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """All commands, success and failure, in this process (main thread: signals work)."""
    caplog.set_level(logging.DEBUG)
    key_b64 = seeded.keys.partition(":")[2]
    schema = seeded.schema
    drop_after.extend([f"{schema}_demo", f"{schema}_demo_queue"])
    base_env = {**seeded.env(), "STEEPLE_ADMIN_TOKEN": TOKEN}
    del base_env["STEEPLE_DATABASE_URL"]
    port = free_port()
    commands = dsn_commands(schema, tmp_path / "demo", port)
    forms = ["userinfo", "userinfo-at", "query", "query-encoded"]
    seen: list[str] = []

    def run(args: list[str], dsn: str | None, source: str, where: object) -> Any:
        env = dict(base_env)
        if dsn is not None and source == "env":
            env["STEEPLE_DATABASE_URL"] = dsn
        elif dsn is not None:
            args = [*args, "--dsn", dsn]
        result = invoke(args, env)
        text = output_of(result)
        assert_clean(text, key_b64, where)
        assert "Traceback" not in text, (where, text)
        seen.append(text)
        return result

    # --- failure paths: every DSN-taking command x every failing DSN, both sources -------
    for i, (name, args) in enumerate(commands.items()):
        for j, (kind, dsn) in enumerate(failing_dsns(pg_dsn).items()):
            source = "env" if (i + j) % 2 else "flag"
            result = run(args, dsn, source, (name, kind, source))
            assert result.exit_code in {1, 3, 4}, (name, kind, source, output_of(result))
            assert_one_line_error(result, (name, kind))
            if kind in {"port-99999", "port-abc", "raw-slash", "raw-at", "key-value", "garbage"}:
                assert result.exit_code == 3, (name, kind, result.stderr)  # configuration
            if kind == "no-database":
                # issue 14: a DSN naming no database is configuration, in the server's words
                assert result.exit_code == 3, (name, kind, result.stderr)
                assert "does not exist" in result.stderr, (name, result.stderr)
            if kind == "unreachable":
                assert result.exit_code == 4, (name, kind, result.stderr)  # unavailable

    # --- success paths, password in each URL form, from the flag and the environment -----
    def ok(args: list[str], n: int) -> Any:
        form = forms[n % len(forms)]
        source = "env" if n % 2 else "flag"
        result = run(args, with_password(pg_dsn, form), source, (args[0], form, source))
        assert result.exit_code == 0, (args, form, source, output_of(result))
        return result

    initialized = ok(commands["initialize"], 0)
    assert "***" in initialized.stdout or "@" not in initialized.stdout
    role = f"rt_{uuid.uuid4().hex[:10]}"
    drop_after.append(f"role:{role}")
    conn_env = {"dsn": pg_dsn}

    async def create_role() -> None:
        conn = await asyncpg.connect(conn_env["dsn"])
        try:
            await conn.execute(f'CREATE ROLE "{role}" NOLOGIN')
        finally:
            await conn.close()

    asyncio.run(create_role())
    ok([*commands["initialize"], "--grant-to", role], 1)
    for n, name in enumerate(
        [
            "migrate",
            "schedules",
            "occurrences",
            "tasks",
            "keys-show",
            "purge",
            "purge-tasks",
            "purge-dry-run",
            "schedules-create",
            "tasks-show",
            "enqueue",
            "jobs-ensure",
            "jobs",
            "jobs-pause",
            "jobs-create",
            "jobs-resume",
            "jobs-reschedule",
            "jobs-delete",
        ]
    ):
        ok(commands[name], n)
    ok(["schedules", "--schema", schema, "--namespace", "ops", "--json"], 3)
    ok(["cancel", "--task", str(seeded.task_ids[0]), *commands["cancel"][2:]], 2)
    ok(["tasks", "cancel", str(seeded.task_ids[1]), "--yes", "--queue-schema", schema], 3)
    ok(["retry", seeded.dead_id, *commands["retry"][2:]], 1)
    ok(commands["cancel"], 3)
    ok(["keys", "generate"], 1)  # takes no DSN: the environment holds one anyway
    ok(["keys", "generate", "--out", str(tmp_path / "new.key")], 1)
    ok(["keys", "show"], 0)
    ok(commands["demo"], 1)
    # refused operations (exit 1) on a working connection
    for n, args in enumerate(
        [
            commands["retry"],
            ["cancel", "--task", "987654321", *commands["cancel"][2:]],
            commands["tasks-retry"],  # task 1 is not failed: only failed tasks are retried
            ["jobs", "pause", "no-such-job", "--queue-schema", schema],
        ]
    ):
        result = run(args, with_password(pg_dsn, forms[n]), "flag", ("refused", args[0]))
        assert result.exit_code == 1, output_of(result)

    # the worker runs a seeded task, whose handler sends SIGTERM: a graceful stop, exit 0
    worker = ok(commands["worker"], 2)
    assert "stopping gracefully" in worker.stderr

    # admin serve answers requests (opening the store and the queue), then SIGINT
    def client() -> None:
        import httpx

        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=5) as http:
            for _ in range(300):
                try:
                    http.get("/ui/ops")
                    break
                except httpx.TransportError:
                    threading.Event().wait(0.1)  # poll until the server listens
            else:
                return  # never listened: the command failed on its own
            headers = {"authorization": f"Bearer {TOKEN}"}
            for path in ("/api/ops/schedules", "/api/ops/tasks"):
                responses.append(http.get(path, headers=headers))
        os.kill(os.getpid(), signal.SIGINT)  # uvicorn's handler: a graceful stop

    responses: list[Any] = []
    helper = threading.Thread(target=client)
    helper.start()
    served = run(commands["admin-serve"], with_password(pg_dsn, "query"), "env", "admin serve")
    helper.join()
    assert [r.status_code for r in responses] == [200, 200], [r.text for r in responses]
    for response in responses:
        assert_clean(response.text, key_b64, "admin response")
    assert served.exit_code in {0, 130}, output_of(served)

    # --- bad arguments with a planted DSN: usage errors, nothing echoed ---------------------
    for n, args in enumerate(
        [
            ["schedules", "--limit", "0"],
            ["purge", "--older-than", "nan"],
            ["cancel"],
            ["cancel", "--task", "-5"],
            ["schedules", "--frobnicate"],
            ["admin", "serve", "--port", "99999"],
            ["tasks", "--state", "bogus"],
            ["purge"],  # destructive, no terminal to ask on, no --yes
            ["jobs", "delete", "nightly"],
            ["enqueue", "t", "--args", "{not json"],
        ]
    ):
        result = run(args, with_password(pg_dsn, forms[n % len(forms)]), "flag", args)
        assert result.exit_code == 2, (args, output_of(result))

    # --- the library's log records (caplog) ------------------------------------------------
    for record in caplog.records:
        assert_clean(record.getMessage(), key_b64, ("log", record.name))
        if record.exc_info:
            assert_clean(logging.Formatter().formatException(record.exc_info), key_b64, "log")
    assert caplog.records  # the superuser warning at least: logging was captured
    assert len(seen) > 150


@pytest.mark.parametrize(
    "lines",
    [
        "{b64}:k1",  # written the wrong way round
        "k1:{b64}:extra",
        "k1:{b64}x",
        "k1:{b64}==",
        "{b64}",
        "k1 :{b64}",
        "k1:{b64},{b64}:k2",
        "k1:{b64},k1:{b64}",
        "{b64}{b64}:k1",
        "k1:{b64_10}",
        "\x1b[31mk1:{b64}",  # a control sequence in the id
    ],
)
def test_malformed_key_lines_never_echo_key_material(
    seeded: Any, tmp_path: Path, lines: str
) -> None:
    key_b64 = seeded.keys.partition(":")[2]
    text = lines.replace("{b64_10}", key_b64[:10]).replace("{b64}", key_b64)
    env = {**seeded.env(), "STEEPLE_KEYS": text}
    for args in (["keys", "show"], ["schedules"], ["keys", "show", "--json"]):
        result = invoke(args, env)
        assert result.exit_code == 3, (args, output_of(result))
        assert_clean(output_of(result), key_b64, (lines, args))
        assert_one_line_error(result, lines)
    keys_file = tmp_path / "keys"
    keys_file.write_text(text.replace(",", "\n"))
    keys_file.chmod(0o600)
    env.pop("STEEPLE_KEYS")
    result = invoke(["keys", "show", "--keys-file", str(keys_file)], env)
    assert result.exit_code == 3, output_of(result)
    assert_clean(output_of(result), key_b64, ("file", lines))


def test_unreadable_key_files_never_echo_key_material(seeded: Any, tmp_path: Path) -> None:
    key_b64 = seeded.keys.partition(":")[2]
    raw = base64.b64decode(key_b64)
    cases = {
        "binary": b"k1:" + raw,
        "raw-only": raw,
        "latin1": b"k1:" + key_b64.encode() + b"\xff",
        "open-to-others": seeded.keys.encode(),
    }
    env = seeded.env()
    env.pop("STEEPLE_KEYS")
    for name, content in cases.items():
        path = tmp_path / name
        path.write_bytes(content)
        path.chmod(0o644 if name == "open-to-others" else 0o600)
        result = invoke(["schedules", "--keys-file", str(path)], env)
        assert result.exit_code == 3, (name, output_of(result))
        text = output_of(result)
        assert_clean(text, key_b64, name)
        assert raw.decode("latin-1")[:4] not in text or name == "open-to-others"
    wrong = invoke(
        ["schedules"], {**env, "STEEPLE_KEYS": "k1:" + base64.b64encode(b"\x01" * 32).decode()}
    )
    assert wrong.exit_code == 3
    assert_clean(output_of(wrong), key_b64, "wrong key")


async def _process(
    args: list[str], env: dict[str, str], cwd: Path, stop_when: str | None = None
) -> tuple[int, str]:
    """Run ``steeple ARGS`` as a real process; with ``stop_when``, SIGINT once it printed it."""
    proc = await asyncio.create_subprocess_exec(
        *STEEPLE,
        *args,
        env=env,
        cwd=cwd,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        async with asyncio.timeout(120):
            if stop_when is None:
                out, err = await proc.communicate()
            else:
                assert proc.stderr is not None
                seen = b""
                while stop_when.encode() not in seen:
                    line = await proc.stderr.readline()
                    assert line, seen.decode(errors="replace")
                    seen += line
                proc.send_signal(signal.SIGINT)
                out, err = await proc.communicate()
                err = seen + err
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode is not None
    return proc.returncode, out.decode(errors="replace") + err.decode(errors="replace")


async def test_every_command_as_a_real_process(
    seeded: Any, pg_dsn: str, tmp_path: Path, worker_app: Path, drop_after: list[str]
) -> None:
    """Each command once succeeding and once failing, as a subprocess with logging on."""
    key_b64 = seeded.keys.partition(":")[2]
    schema = seeded.schema
    drop_after.extend([f"{schema}_demo", f"{schema}_demo_queue"])
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEEPLE_")}
    env.update({**seeded.env(), "STEEPLE_ADMIN_TOKEN": TOKEN, "COLUMNS": "120"})
    port = free_port()
    commands = dsn_commands(schema, tmp_path / "demo", port)
    failing = list(failing_dsns(pg_dsn).items())
    forms = ["userinfo", "userinfo-at", "query", "query-encoded"]
    jobs: list[tuple[object, list[str], dict[str, str], set[int], str | None]] = []
    for n, (name, args) in enumerate(commands.items()):
        kind, bad = failing[n % len(failing)]
        source_env = {**env, "STEEPLE_DATABASE_URL": bad} if n % 2 else env
        bad_args = args if n % 2 else [*args, "--dsn", bad]
        jobs.append(((name, kind), bad_args, source_env, {1, 3, 4}, None))
        if name in {
            "cancel",
            "cancel-task",
            "retry",
            "worker",
            "admin-serve",
            "tasks-retry",
            "tasks-cancel",
            "tasks-show",
            "jobs-pause",
            "jobs-resume",
            "jobs-reschedule",
            "jobs-delete",
            "admin-serve-queue-only",
        }:
            continue  # run below with what they need
        good = with_password(pg_dsn, forms[n % len(forms)])
        good_env = {**env, "STEEPLE_DATABASE_URL": good} if n % 2 == 0 else env
        good_args = [*args, "--dsn", good] if n % 2 else args
        jobs.append(((name, "ok"), good_args, good_env, {0}, None))
    good = with_password(pg_dsn, "userinfo-at")
    place = commands["cancel"][3:]
    jobs += [
        (("retry", "ok"), ["retry", seeded.dead_id, *place[:4], "--dsn", good], env, {0}, None),
        (
            ("cancel-task", "ok"),
            ["cancel", "--task", str(seeded.task_ids[1]), "--yes", *place, "--dsn", good],
            env,
            {0},
            None,
        ),
        (("keys-generate", "ok"), ["keys", "generate"], env, {0}, None),
        (("help", "ok"), ["--help"], env, {0}, None),
    ]
    semaphore = asyncio.Semaphore(3)

    async def one(job: tuple[object, list[str], dict[str, str], set[int], str | None]) -> None:
        where, args, job_env, codes, stop_when = job
        async with semaphore:
            code, text = await _process(args, job_env, worker_app, stop_when)
        assert code in codes, (where, code, text[-3000:])
        assert "Traceback" not in text, (where, text)
        assert_clean(text, key_b64, where)

    await asyncio.gather(*(one(job) for job in jobs))
    # long-running commands, one at a time: the worker stops itself (SIGTERM after a task),
    # admin serve is stopped with SIGINT once it listens
    code, text = await _process(
        [*commands["worker"], "--dsn", with_password(pg_dsn, "query")], env, worker_app
    )
    assert code == 0, text
    assert_clean(text, key_b64, "worker")
    code, text = await _process(
        commands["admin-serve"],
        {**env, "STEEPLE_DATABASE_URL": with_password(pg_dsn, "userinfo-at")},
        worker_app,
        stop_when="steeple admin: http://",
    )
    assert code == 0, text  # issue 14: Ctrl-C is how a server is stopped: exit 0
    assert_clean(text, key_b64, "admin serve")
    code, text = await _process(
        [
            "cancel",
            "five-minutely",
            "--yes",
            *place,
            "--dsn",
            with_password(pg_dsn, "query-encoded"),
        ],
        env,
        worker_app,
    )
    assert code == 0, text
    assert_clean(text, key_b64, "cancel")


def _prepend(path: Path, line: str) -> None:
    path.write_text(line + path.read_text())


async def _noop(ctx: Any, args: Any) -> None:
    del ctx, args


async def _run_scheduler(scheduler_class: Any, task_class: Any, dsn: str) -> None:
    scheduler = scheduler_class(dsn, worker_id="w", query_timeout=5)
    scheduler.register(task_class("t"), _noop)
    await scheduler.run_until_shutdown(asyncio.Event())


async def test_store_connect_failures_log_no_secrets(
    pg_dsn: str, private_pg: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """The library itself: typed errors, reprs, causes and log records hold no secret."""
    import traceback
    from datetime import UTC, datetime

    from steeple.core import RecurringConfig, RecurringError
    from steeple.keyring import Keyring, StorageKey
    from steeple.postgres import PostgresRecurringStore
    from steeple.postgres.queue import Scheduler, Task
    from steeple.postgres.queue.errors import QueueError
    from steeple.testing import FakeClock

    caplog.set_level(logging.DEBUG)
    key = StorageKey.generate("k1")
    key_b64 = key.to_base64()
    keyring = Keyring(key)
    config = RecurringConfig("ops", 10, 100)
    clock = FakeClock(datetime(2031, 1, 1, tzinfo=UTC))

    # A private cluster with password authentication for one role: a wrong password.
    conn = await asyncpg.connect(private_pg.get_uri())
    try:
        await conn.execute("CREATE ROLE pw_user LOGIN PASSWORD 'right-password'")
        hba = Path(await conn.fetchval("SHOW hba_file"))
        await asyncio.to_thread(_prepend, hba, "local all pw_user scram-sha-256\n")
        await conn.execute("SELECT pg_reload_conf()")
    finally:
        await conn.close()
    private = urlsplit(private_pg.get_uri())
    wrong_password = urlunsplit(private._replace(netloc=f"pw_user:{PASSWORD}@"))
    dsns = {**failing_dsns(pg_dsn), "wrong-password": wrong_password}
    del dsns["key-value"], dsns["garbage"]  # not URLs: covered by the CLI
    for kind, dsn in dsns.items():
        for opener in (PostgresRecurringStore.connect, PostgresRecurringStore.initialize):
            with pytest.raises(RecurringError) as caught:
                await opener(dsn, config, keyring, clock, schema="steeple_absent")
            text = "".join(traceback.format_exception(caught.value)) + repr(caught.value)
            assert_clean(text, key_b64, (kind, opener.__name__))
            if kind == "wrong-password":  # the server really checked a password
                assert "InvalidPasswordError" in text, text
        with pytest.raises(QueueError) as failed:
            await _run_scheduler(Scheduler, Task, dsn)
        text = "".join(traceback.format_exception(failed.value))
        assert_clean(text, key_b64, (kind, "scheduler"))
    for record in caplog.records:
        assert_clean(record.getMessage(), key_b64, ("log", record.name))


def test_reprs_of_command_values_hide_the_password(pg_dsn: str) -> None:
    from steeple.admin._backend import Target
    from steeple.admin._cli.options import Where
    from steeple.admin.settings import NamespaceSettings, SettingsFile

    dsn = with_password(pg_dsn, "userinfo-at")
    for value in (
        Target(dsn, "s", NamespaceSettings("ops")),
        Where(dsn, None, "s", "ops"),
        Where(with_password(pg_dsn, "query"), None, "s", "ops"),
        Where(None, None, "s", "ops"),
        SettingsFile(dsn=dsn),
    ):
        assert_clean(repr(value), "", value.__class__)
        assert "***" in repr(value) or "None" in repr(value)


def test_json_listing_never_shows_the_dsn(seeded: Any, pg_dsn: str) -> None:
    """A success's stdout is data, not configuration."""
    result = invoke(
        ["occurrences", "--json", "--dsn", with_password(pg_dsn, "userinfo")],
        {k: v for k, v in seeded.env().items() if k != "STEEPLE_DATABASE_URL"},
    )
    assert result.exit_code == 0, output_of(result)
    assert json.loads(result.stdout)["items"]
    assert_clean(output_of(result), seeded.keys.partition(":")[2], "json")
