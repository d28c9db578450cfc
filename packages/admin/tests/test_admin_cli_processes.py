"""Issue 14 as real processes: a terminal that answers, ports, signals, warnings, imports."""

from __future__ import annotations

import asyncio
import json
import os
import pty
import re
import secrets
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import asyncpg
import pytest

pytestmark = pytest.mark.usefixtures("clean_env")

STEEPLE = [sys.executable, "-c", "from steeple.admin.cli import main; main()"]
TOKEN = "process-" + secrets.token_urlsafe(32)
URL = re.compile(r"steeple admin: (http://\S+)")


def env_of(seeded: Any | None = None, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEEPLE_")}
    if seeded is not None:
        env.update(seeded.env())
    env.update({"COLUMNS": "120", "PYTHONUNBUFFERED": "1"}, **extra)
    return env


def run(args: list[str], env: dict[str, str], cwd: Path, timeout: float = 60) -> Any:
    return subprocess.run(
        [*STEEPLE, *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


# --- what --help loads ------------------------------------------------------------------------

HEAVY = (
    "asyncpg",
    "psycopg",
    "starlette",
    "uvicorn",
    "rich",
    "cryptography",
    "pgserver",
    "matplotlib",
    "asyncio",
    "steeple.postgres",
    "steeple.keyring",
    "steeple.brokers",
    "steeple.testing",
    "steeple.engine",
)
"""What the command's --help must not import (drivers, servers, tables, key material)."""
HELP_PROBE = """
import sys
from steeple.admin.cli import app
from typer.main import get_command

HEAVY = {heavy!r}

def heavy():
    return sorted(m for m in sys.modules if m.startswith(HEAVY))

imported = heavy()
root = get_command(app)
paths = [[]]
for name in root.list_commands(None):
    paths.append([name])
    command = root.get_command(None, name)
    if hasattr(command, "list_commands"):
        paths += [[name, sub] for sub in command.list_commands(None)]
for path in paths:
    app([*path, "--help"], prog_name="steeple", standalone_mode=False)
print("PATHS", len(paths))
print("IMPORT", imported)
print("HELP", heavy())
"""


def test_help_imports_no_driver_server_or_table_library(tmp_path: Path) -> None:
    """Issue 14: --help in well under 0.3 s; the import graph is what keeps it there."""
    result = subprocess.run(
        [sys.executable, "-c", HELP_PROBE.format(heavy=HEAVY)],
        env=env_of(),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    lines = dict(line.split(" ", 1) for line in result.stdout.splitlines() if " " in line)
    assert int(lines["PATHS"]) >= 30  # every command and subcommand's --help ran
    assert lines["IMPORT"] == "[]", lines["IMPORT"]
    assert lines["HELP"] == "[]", lines["HELP"]


def test_help_renders_flags_without_metavars_or_backticks(tmp_path: Path) -> None:
    for args in (["schedules", "--help"], ["admin", "serve", "--help"], ["purge", "--help"]):
        result = run(args, env_of(), tmp_path)
        assert result.returncode == 0, result.stderr
        assert "<bool>" not in result.stdout, args
        assert "`" not in result.stdout, args
    purge = run(["purge", "--help"], env_of(), tmp_path).stdout
    assert "--dry-run" in purge
    assert "Rows per page" not in purge  # --limit is the most records one run removes
    assert "most records this run removes" in " ".join(purge.split())


# --- a terminal that answers ------------------------------------------------------------------


def _on_a_terminal(
    args: list[str], env: dict[str, str], cwd: Path, answer: bytes
) -> tuple[int, str]:
    """Run ``steeple ARGS`` on a pseudo-terminal; answer its question; return (code, output)."""
    leader, follower = pty.openpty()
    proc = subprocess.Popen(
        [*STEEPLE, *args], env=env, cwd=cwd, stdin=follower, stdout=follower, stderr=follower
    )
    os.close(follower)
    seen = b""
    answered = False
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([leader], [], [], 0.5)
            if ready:
                try:
                    chunk = os.read(leader, 4096)
                except OSError:  # the process closed the terminal: it ended
                    break
                if not chunk:
                    break
                seen += chunk
                if not answered and b"[y/N]" in seen:
                    os.write(leader, answer)
                    answered = True
            elif proc.poll() is not None:
                break
        code = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(leader)
    return code, seen.decode(errors="replace")


@pytest.mark.postgres
def test_destructive_commands_ask_on_a_terminal(seeded: Any, tmp_path: Path) -> None:
    env = env_of(seeded)
    code, text = _on_a_terminal(["cancel", "minutely"], env, tmp_path, b"n\n")
    assert code == 1, text
    assert "Cancel the recurring definition 'minutely' for good?" in text
    assert "not confirmed: nothing was done" in text
    listed = json.loads(run(["schedules", "--json"], env, tmp_path).stdout)["items"]
    assert {s["name"]: s["state"] for s in listed}["minutely"] == "active"
    code, text = _on_a_terminal(["cancel", "minutely"], env, tmp_path, b"y\n")
    assert code == 0, text
    assert "cancelled definition 'minutely'" in text
    code, text = _on_a_terminal(["purge", "--older-than", "0s"], env, tmp_path, b"yes\n")
    assert code == 0, text
    assert "Remove up to 100 terminal occurrences" in text
    assert "purged" in text
    # without a terminal and without --yes: refused at once, exit 2
    piped = run(["jobs", "delete", "nightly"], env, tmp_path)
    assert piped.returncode == 2
    assert "pass --yes" in piped.stderr


# --- ports and signals -------------------------------------------------------------------------


@pytest.mark.postgres
def test_a_busy_port_is_refused_before_any_url_is_printed(seeded: Any, tmp_path: Path) -> None:
    env = env_of(seeded, STEEPLE_ADMIN_TOKEN=TOKEN)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        served = run(["admin", "serve", "--port", port], env, tmp_path)
        demo = run(
            ["demo", "--serve", "--port", port, "--duration", "1", "--data-dir", "d"],
            env,
            tmp_path,
        )
    for result in (served, demo):
        assert result.returncode == 4, result.stdout + result.stderr
        lines = result.stderr.strip().splitlines()
        assert lines[0] == f"steeple: error: cannot listen on 127.0.0.1:{port}: the port is in use"
        assert "--port" in lines[1]
        assert "http://" not in result.stdout + result.stderr
        assert "Errno" not in result.stderr
    assert "starting" not in demo.stdout  # refused before the demo ran
    bad_host = run(["admin", "serve", "--host", "192.0.2.1", "--port", "0"], env, tmp_path)
    assert bad_host.returncode == 3, bad_host.stderr


async def _serve_until_url(
    args: list[str], env: dict[str, str], cwd: Path, stream: str = "stderr"
) -> tuple[asyncio.subprocess.Process, str, list[str]]:
    """Start a serving command; return it, its URL and the lines before it."""
    proc = await asyncio.create_subprocess_exec(
        *STEEPLE,
        *args,
        env=env,
        cwd=cwd,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    pipe = proc.stderr if stream == "stderr" else proc.stdout
    assert pipe is not None
    lines: list[str] = []
    async with asyncio.timeout(120):
        while True:
            raw = await pipe.readline()
            if not raw:
                out, err = await proc.communicate()
                pytest.fail(f"exited {proc.returncode} before serving: {lines} {out!r} {err!r}")
            line = raw.decode(errors="replace").rstrip()
            lines.append(line)
            found = URL.search(line)
            if found:
                return proc, found.group(1), lines


async def _interrupt(proc: asyncio.subprocess.Process) -> tuple[int, str]:
    proc.send_signal(signal.SIGINT)
    async with asyncio.timeout(30):
        out, err = await proc.communicate()
    assert proc.returncode is not None
    return proc.returncode, (out + err).decode(errors="replace")


@pytest.mark.postgres
@pytest.mark.parametrize("why", ["no keys", "not initialized", "--queue-only"])
async def test_admin_serve_for_queue_only_users(
    seeded: Any, tmp_path: Path, pg_name: Callable[[str], str], why: str
) -> None:
    """No keys, no recurring namespace: the app serves the work queue's tasks alone."""
    import httpx

    env = env_of(seeded, STEEPLE_ADMIN_TOKEN=TOKEN)
    args = ["admin", "serve", "--port", "0"]
    if why == "no keys":
        del env["STEEPLE_KEYS"]
    elif why == "not initialized":
        env["STEEPLE_NAMESPACE"] = "never-initialized"
    else:
        args.append("--queue-only")
    proc, url, before = await _serve_until_url(args, env, tmp_path)
    try:
        base, _, namespace = url.partition("/ui/")
        bearer = {"authorization": f"Bearer {TOKEN}"}
        async with httpx.AsyncClient(base_url=base, timeout=10) as http:
            tasks = await http.get(f"/api/{namespace}/tasks", headers=bearer)
            schedules = await http.get(f"/api/{namespace}/schedules", headers=bearer)
            overview = await http.get(f"/ui/{namespace}", headers=bearer)
            page = await http.get(f"/ui/{namespace}/tasks", headers=bearer)
    finally:
        code, text = await _interrupt(proc)
    assert code == 0, text  # Ctrl-C stops a server: exit 0
    assert "queue-only mode" in "\n".join(before)
    if why != "--queue-only":
        assert "recurring publications not served" in "\n".join(before)
    assert tasks.status_code == 200, tasks.text
    assert [t["task_id"] for t in tasks.json()["items"]] == list(seeded.task_ids)
    assert schedules.status_code == 404
    assert overview.status_code == 200
    assert "queue-only mode" in overview.text
    assert "Recurring publications" not in overview.text
    assert page.status_code == 200
    assert page.text.count('class="row task"') == len(seeded.task_ids)


# --- warnings where they apply ------------------------------------------------------------


@pytest.mark.postgres
def test_the_superuser_warning_only_where_a_runtime_role_is_expected(
    pg_schema: tuple[str, str], tmp_path: Path
) -> None:
    dsn, schema = pg_schema
    # (the queue in the same schema: the test's fixture drops it)
    env = env_of(STEEPLE_DATABASE_URL=dsn, STEEPLE_SCHEMA=schema, STEEPLE_QUEUE_SCHEMA=schema)
    keys = tmp_path / "keys"
    assert run(["keys", "generate", "--out", str(keys)], env, tmp_path).returncode == 0
    env["STEEPLE_KEYS_FILE"] = str(keys)
    initialized = run(["initialize"], env, tmp_path)
    assert initialized.returncode == 0, initialized.stderr
    assert "superuser" not in initialized.stderr  # the deployment role may well be one
    migrated = run(["migrate"], env, tmp_path)
    assert "superuser" not in migrated.stderr
    listed = run(["schedules"], env, tmp_path)
    assert listed.returncode == 0, listed.stderr
    assert "steeple: warning: steeple recurring store: runtime role" in listed.stderr
    assert "is a superuser" in listed.stderr


# --- the demo keeps its dashboard up -------------------------------------------------------


@pytest.mark.postgres
async def test_demo_serve_keeps_the_dashboard_up_until_ctrl_c(
    pg_dsn: str, tmp_path: Path, pg_name: Callable[[str], str], drop_queue_schema: list[str]
) -> None:
    import httpx

    schema = pg_name("demo")
    drop_queue_schema.extend([schema, f"{schema}_queue"])
    args = ["demo", "--serve", "--port", "0", "--duration", "2", "--dsn", pg_dsn]
    args += ["--schema", schema, "--data-dir", str(tmp_path / "demo")]
    env = env_of(STEEPLE_ADMIN_TOKEN=TOKEN)
    proc, url, before = await _serve_until_url(args, env, tmp_path, stream="stdout")
    try:
        bearer = {"authorization": f"Bearer {TOKEN}"}
        async with httpx.AsyncClient(timeout=10) as http:
            page = await http.get(url, headers=bearer)
            tasks = await http.get(url.replace("/ui/demo", "/api/demo/tasks"), headers=bearer)
            anonymous = await http.get(url)
        # the database is still up while it serves
        conn = await asyncpg.connect(pg_dsn)
        try:
            definitions = await conn.fetchval(
                f'SELECT count(*) FROM "{schema}".recurring_definitions'
            )
        finally:
            await conn.close()
    finally:
        code, text = await _interrupt(proc)
    assert code == 0, text
    assert "summary:" in "\n".join(before)  # the demo ran first
    assert "dashboard sign-in: any user name, password STEEPLE_ADMIN_TOKEN" in before
    assert page.status_code == 200, page.text
    assert "heartbeat" in page.text
    assert tasks.status_code == 200
    assert tasks.json()["items"]
    assert anonymous.status_code == 401
    assert definitions == 3
    assert "steeple demo: dashboard stopped" in text
    assert TOKEN not in "\n".join(before) + text
    # the settings file the demo wrote opens its namespace from any command
    config = tmp_path / "demo" / "steeple.toml"
    listed = run(
        ["schedules", "--config", str(config), "--dsn", pg_dsn, "--json"], env_of(), tmp_path
    )
    assert listed.returncode == 0, listed.stderr
    names = {s["name"] for s in json.loads(listed.stdout)["items"]}
    assert names == {"heartbeat", "digest", "cache-refresh"}
