"""Real processes: ``steeple demo`` (server and embedded default) and ``steeple worker``."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import secrets
import shlex
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from steeple.admin.settings import ExitCode

STEEPLE = [sys.executable, "-c", "from steeple.admin.cli import main; main()"]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEEPLE_")}
    env.update(extra)
    env["COLUMNS"] = "120"
    return env


def _summary(stdout: str) -> dict[str, int]:
    match = re.search(r"^summary: (.*)$", stdout, re.MULTILINE)
    assert match, stdout
    values = dict(item.split("=", 1) for item in match.group(1).split())
    return {k: int(v.rstrip("s").split(".")[0]) for k, v in values.items()}


async def _spawn(args: list[str], env: dict[str, str], cwd: Path) -> asyncio.subprocess.Process:
    """Start ``steeple ARGS`` with its output piped."""
    return await asyncio.create_subprocess_exec(
        *STEEPLE,
        *args,
        env=env,
        cwd=cwd,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )


async def _stop(proc: asyncio.subprocess.Process, sig: int = signal.SIGTERM) -> tuple[bytes, bytes]:
    """Send ``sig`` and collect the output of a process that must exit within 30 s."""
    proc.send_signal(sig)
    async with asyncio.timeout(30):
        return await proc.communicate()


async def _reap(proc: asyncio.subprocess.Process) -> None:
    """Kill a process a failed test left running."""
    if proc.returncode is None:
        proc.kill()
        await proc.wait()


async def _run(args: list[str], env: dict[str, str], cwd: Path, timeout: float) -> Any:
    return await asyncio.to_thread(
        subprocess.run,
        [*STEEPLE, *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.mark.postgres
async def test_demo_on_a_server(
    pg_dsn: str, tmp_path: Path, drop_queue_schema: list[str], pg_name: Callable[[str], str]
) -> None:
    schema = pg_name("demo")
    drop_queue_schema.extend([schema, f"{schema}_queue"])
    args = [
        "demo",
        "--dsn",
        pg_dsn,
        "--schema",
        schema,
        "--duration",
        "8",
        "--data-dir",
        str(tmp_path / "demo"),
    ]
    started = time.monotonic()
    first = await _run(args, _env(), tmp_path, 60)
    took = time.monotonic() - started
    assert first.returncode == 0, first.stdout + first.stderr
    assert took < 55
    counts = _summary(first.stdout)
    assert counts["deliveries"] > 0
    assert counts["tasks_done"] > 0
    # Every 7th acknowledgement is lost on purpose: the message was stored, the relay retries
    # under the same idempotency key, and the journal reports a duplicate. Consumers see each
    # occurrence once: the unacknowledged ones not yet retried are delivered all the same.
    assert counts["lost_acks"] >= 1
    assert counts["duplicates"] <= counts["lost_acks"]
    assert counts["deliveries"] == counts["relays"] + counts["lost_acks"] - counts["duplicates"]
    # 8 s at 60x is 8 minutes: the every-minute catch-up definition alone gives 5 missed
    # minutes plus one per simulated minute.
    assert counts["materialized"] >= 10
    assert counts["simulated"] >= 420
    assert "DEMO key" in first.stdout
    assert "created recurring publications" in first.stdout
    assert (tmp_path / "demo" / "demo.key").stat().st_mode & 0o077 == 0

    # the data is kept: a second run reuses the key, the definitions and the clock
    second = await _run(
        [*args[:-2], "--duration", "3", "--data-dir", str(tmp_path / "demo")], _env(), tmp_path, 60
    )
    assert second.returncode == 0, second.stdout + second.stderr
    assert "kept from an earlier run" in second.stdout
    assert "using the DEMO key" in second.stdout
    conn = await asyncpg.connect(pg_dsn)
    try:
        definitions = await conn.fetchval(f'SELECT count(*) FROM "{schema}".recurring_definitions')
    finally:
        await conn.close()
    assert definitions == 3

    # --fresh with a server drops the demo's own schemas and data directory, then starts
    # over; SIGTERM (like the first Ctrl-C) ends the run early with its summary, exit 0.
    third = await _spawn(
        [*args[:-4], "--duration", "50", "--fresh", "--data-dir", str(tmp_path / "demo")],
        _env(),
        tmp_path,
    )
    try:
        assert third.stdout is not None
        async with asyncio.timeout(60):
            while b"created recurring publications" not in await third.stdout.readline():
                pass
        await asyncio.sleep(2)
        rest, _ = await _stop(third)
    finally:
        await _reap(third)
    assert third.returncode == 0
    early = _summary(rest.decode())
    assert early["elapsed"] < 20


@pytest.mark.slow
async def test_demo_on_the_embedded_default(tmp_path: Path) -> None:
    """No DSN: the demo starts its own PostgreSQL (pgserver) in the data directory."""
    pytest.importorskip("pgserver")
    started = time.monotonic()
    result = await _run(["demo", "--duration", "4"], _env(), tmp_path, 120)
    took = time.monotonic() - started
    assert result.returncode == 0, result.stdout + result.stderr
    assert took < 60
    counts = _summary(result.stdout)
    assert counts["deliveries"] > 0
    assert counts["tasks_done"] > 0
    data = tmp_path / ".steeple" / "demo"
    assert (data / "pgdata" / "PG_VERSION").exists()
    assert (data / "journal.sqlite3").exists()
    # the server was stopped when the demo ended
    assert not (data / "pgdata" / "postmaster.pid").exists()
    # Issue 14: it ends with the exact commands that show what it stored; each one runs as
    # printed (with no environment) and starts the embedded server for its own run.
    printed = [
        shlex.split(line)[1:]
        for line in result.stdout.splitlines()
        if line.startswith("  steeple ")
    ]
    assert [args[0] for args in printed] == ["schedules", "occurrences", "tasks", "jobs", "keys"]
    outputs = {}
    for args in printed:
        shown = await _run([*args, "--json"], _env(), tmp_path, 120)
        assert shown.returncode == 0, (args, shown.stdout + shown.stderr)
        assert "superuser" not in shown.stderr  # the embedded server's role is its own
        outputs[args[0]] = json.loads(shown.stdout)
    assert {s["name"] for s in outputs["schedules"]["items"]} == {
        "heartbeat",
        "digest",
        "cache-refresh",
    }
    assert outputs["occurrences"]["items"]
    assert outputs["tasks"]["items"]
    assert [j["name"] for j in outputs["jobs"]["items"]]
    assert outputs["keys"]["keys"][0]["records"] > 0
    assert not (data / "pgdata" / "postmaster.pid").exists()  # stopped again
    fresh = await _run(["demo", "--duration", "2", "--fresh"], _env(), tmp_path, 120)
    assert fresh.returncode == 0, fresh.stdout + fresh.stderr
    assert "created the DEMO key" in fresh.stdout
    assert "created recurring publications" in fresh.stdout


def _clock_start(stdout: str) -> datetime:
    """Where the run's accelerated clock started (the line the demo prints)."""
    match = re.search(r"^demo clock: starts at (\S+ \S+) UTC", stdout, re.MULTILINE)
    assert match, stdout
    return datetime.fromisoformat(match.group(1)).replace(tzinfo=UTC)


DEMO_NAMESPACE_FLAGS = ["-n", "demo", "--max-definitions", "100", "--lease", "300s"]
"""What the demo initializes its namespace with, for other commands to open it."""


@pytest.mark.postgres
async def test_commands_work_on_the_namespace_a_demo_left(
    pg_dsn: str, tmp_path: Path, drop_queue_schema: list[str], pg_name: Callable[[str], str]
) -> None:
    """Issue 10 item 8: the demo's clock ran 49 minutes ahead and recorded it; every command
    on that database then refused with "local clock trails ...". It must never pass real
    time, so `steeple schedules` / `occurrences` work right after it."""
    schema = pg_name("demo")
    drop_queue_schema.extend([schema, f"{schema}_queue"])
    data = tmp_path / "demo"
    demo = ["demo", "--dsn", pg_dsn, "--schema", schema, "--data-dir", str(data)]
    before = datetime.now(UTC)
    first = await _run([*demo, "--duration", "3", "--speed", "600"], _env(), tmp_path, 60)
    assert first.returncode == 0, first.stdout + first.stderr
    start = _clock_start(first.stdout)
    # a new namespace starts six hours back; 3 s at 600x is 30 minutes: still in the past
    assert before - timedelta(hours=6, minutes=1) <= start <= before - timedelta(hours=5)
    assert _summary(first.stdout)["simulated"] >= 1200
    conn = await asyncpg.connect(pg_dsn)
    try:
        ahead = await conn.fetchval(
            f'SELECT max(recorded_time) - clock_timestamp() FROM "{schema}".recurring_namespaces'
        )
    finally:
        await conn.close()
    assert ahead < timedelta(0)

    keys = (data / "demo.key").read_text().strip()
    env = _env(STEEPLE_KEYS=keys)
    where = ["--dsn", pg_dsn, "--schema", schema, *DEMO_NAMESPACE_FLAGS]
    schedules = await _run(["schedules", *where], env, tmp_path, 60)
    occurrences = await _run(["occurrences", *where], env, tmp_path, 60)
    assert schedules.returncode == 0, schedules.stdout + schedules.stderr
    assert "heartbeat" in schedules.stdout
    assert occurrences.returncode == 0, occurrences.stdout + occurrences.stderr
    assert "published" in occurrences.stdout
    assert "trails" not in schedules.stderr + occurrences.stderr

    # Those commands recorded real time; the next demo resumes there (catching up the
    # missed minutes) instead of failing on its own namespace.
    second = await _run([*demo, "--duration", "2"], _env(), tmp_path, 60)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "kept from an earlier run" in second.stdout
    assert _clock_start(second.stdout) >= start + timedelta(hours=5)
    again = await _run(["schedules", *where], env, tmp_path, 60)
    assert again.returncode == 0, again.stdout + again.stderr


@pytest.mark.slow
@pytest.mark.postgres
async def test_embedded_and_server_demos_keep_their_own_clocks(
    pg_dsn: str, tmp_path: Path, drop_queue_schema: list[str], pg_name: Callable[[str], str]
) -> None:
    """The embedded run and a --dsn run in the same data directory share no clock state:
    each resumes at the time its own namespace recorded."""
    pytest.importorskip("pgserver")
    schema = pg_name("demo")
    drop_queue_schema.extend([schema, f"{schema}_queue"])
    embedded = await _run(["demo", "--duration", "2"], _env(), tmp_path, 120)
    assert embedded.returncode == 0, embedded.stdout + embedded.stderr
    embedded_start = _clock_start(embedded.stdout)
    embedded_end = embedded_start + timedelta(seconds=_summary(embedded.stdout)["simulated"])

    data = str(tmp_path / ".steeple" / "demo")  # the same directory the embedded run used
    server_args = ["demo", "--dsn", pg_dsn, "--schema", schema, "--data-dir", data]
    server = await _run([*server_args, "--duration", "3", "--speed", "600"], _env(), tmp_path, 60)
    assert server.returncode == 0, server.stdout + server.stderr
    server_start = _clock_start(server.stdout)
    server_end = server_start + timedelta(seconds=_summary(server.stdout)["simulated"])
    # the server's new namespace starts six hours back from now, not where the embedded
    # run stopped
    assert server_start < embedded_end
    assert server_end > embedded_end + timedelta(minutes=20)

    # ... and the embedded namespace resumes at its own recorded time, not the server's
    resumed = await _run(["demo", "--duration", "1"], _env(), tmp_path, 120)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    resumed_start = _clock_start(resumed.stdout)
    assert embedded_end - timedelta(seconds=5) <= resumed_start < server_end - timedelta(minutes=10)


async def _published(dsn: str, schema: str) -> int:
    conn = await asyncpg.connect(dsn)
    try:
        return int(
            await conn.fetchval(
                f"SELECT count(*) FROM \"{schema}\".recurring_occurrences WHERE state = 'published'"
            )
        )
    finally:
        await conn.close()


WORKER_APP = """
import asyncio
from pathlib import Path
from steeple.admin import WorkerApp
from steeple.postgres.queue import Task
from steeple.testing import MemoryBroker

DONE = Path(__file__).with_name("done.txt")
BROKER = MemoryBroker()
report = Task("write-report")

async def write_report(ctx, args):
    with DONE.open("a") as fh:
        fh.write(f"{args['n']}\\n")

def make():
    return WorkerApp(broker=BROKER, tasks=[(report, write_report)], drain_timeout=5)
"""


@pytest.mark.postgres
async def test_worker_runs_tasks_and_relay_and_stops_on_sigterm(
    pg_schema: tuple[str, str], tmp_path: Path
) -> None:
    from steeple.core import (
        MissedRunPolicy,
        RecurringConfig,
        RecurringDefinition,
        ScheduledMessage,
        SystemClock,
    )
    from steeple.keyring import Keyring, StorageKey
    from steeple.postgres import PostgresRecurringStore, queue

    dsn, schema = pg_schema
    key = StorageKey.generate("k1")
    store = await PostgresRecurringStore.initialize(
        dsn,
        RecurringConfig("default", 1000, 100_000),
        Keyring(key),
        SystemClock(),
        schema=schema,
    )
    try:
        await store.create(
            RecurringDefinition(
                "minutely",
                "* * * * *",
                datetime.now(UTC) - timedelta(minutes=3),
                MissedRunPolicy.CATCH_UP,
                ScheduledMessage("t", "T", b"{}"),
            )
        )
    finally:
        await store.close()
    conn = await asyncpg.connect(dsn)
    try:
        await queue.install(conn, schema=schema)
        for n in range(5):
            await queue.enqueue(conn, queue.Task("write-report"), {"n": n}, schema=schema)
    finally:
        await conn.close()
    (tmp_path / "myworker.py").write_text(textwrap.dedent(WORKER_APP))
    env = _env(
        STEEPLE_KEYS=f"k1:{key.to_base64()}",
        STEEPLE_DATABASE_URL=dsn,
        STEEPLE_SCHEMA=schema,
        STEEPLE_QUEUE_SCHEMA=schema,
    )
    proc = await _spawn(["worker", "--app", "myworker:make"], env, tmp_path)
    done = tmp_path / "done.txt"
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if (
                done.exists()
                and len(done.read_text().split()) == 5
                and await _published(dsn, schema) >= 3
            ):
                break
            await asyncio.sleep(0.2)
        _, raw_stderr = await _stop(proc)
    finally:
        await _reap(proc)
    stderr = raw_stderr.decode()
    assert sorted(done.read_text().split()) == ["0", "1", "2", "3", "4"]
    assert proc.returncode == 0, stderr
    assert "SIGTERM received, stopping gracefully" in stderr
    assert "steeple worker: stopped" in stderr
    relayed = re.search(r"relayed (\d+) occurrences?", stderr)
    assert relayed, stderr
    assert int(relayed.group(1)) >= 3
    conn = await asyncpg.connect(dsn)
    try:
        states = await conn.fetch(f'SELECT DISTINCT state FROM "{schema}".tasks')
    finally:
        await conn.close()
    assert [r["state"] for r in states] == ["succeeded"]
    store = await PostgresRecurringStore.connect(
        dsn,
        RecurringConfig("default", 1000, 100_000),
        Keyring(key),
        SystemClock(),
        schema=schema,
    )
    try:
        occurrences = (await store.occurrences(limit=100)).items
    finally:
        await store.close()
    # the relay ran too: the three missed minutes were materialized and published
    assert len(occurrences) >= 3
    assert {o.state.value for o in occurrences} == {"published"}


def test_keys_never_travel_as_arguments() -> None:
    """There is no option that takes key material: only STEEPLE_KEYS or --keys-file."""
    result = subprocess.run(
        [*STEEPLE, "initialize", "--help"],
        capture_output=True,
        text=True,
        env=_env(),
        check=False,
        timeout=60,
    )
    assert result.returncode == 0
    assert "--keys-file" in result.stdout
    assert "--key " not in result.stdout
    assert "--keys " not in result.stdout
    material = base64.b64encode(os.urandom(32)).decode()
    bad = subprocess.run(
        [*STEEPLE, "initialize", "--keys", f"k1:{material}"],
        capture_output=True,
        text=True,
        env=_env(),
        check=False,
        timeout=60,
    )
    assert bad.returncode == 2


@pytest.mark.postgres
async def test_admin_serve_answers_with_the_token_only(seeded: Any, tmp_path: Path) -> None:
    import socket

    import httpx

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    token = secrets.token_urlsafe(32)
    csrf = secrets.token_urlsafe(32)
    env = {
        **seeded.env(),
        "STEEPLE_ADMIN_TOKEN": token,
        "STEEPLE_ADMIN_CSRF_TOKEN": csrf,
    }
    proc = await _spawn(["admin", "serve", "--port", str(port)], env, tmp_path)
    base = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient(base_url=base, timeout=5) as http:
            for _ in range(150):
                try:
                    anonymous = await http.get("/ui/ops")
                    break
                except httpx.TransportError:
                    await asyncio.sleep(0.2)
            else:
                pytest.fail("admin serve did not start")
            bearer = {"authorization": f"Bearer {token}"}
            page = await http.get("/ui/ops", headers=bearer)
            tasks = await http.get("/api/ops/tasks", headers=bearer)
            cancel = await http.post(
                "/api/ops/tasks/cancel",
                json={"task_id": seeded.task_ids[0]},
                headers={**bearer, "X-Steeple-CSRF": csrf},
            )
            forged = await http.post(
                "/api/ops/tasks/cancel",
                json={"task_id": seeded.task_ids[1]},
                headers=bearer,
            )
    finally:
        await _stop(proc, signal.SIGINT)
    assert anonymous.status_code == 401
    assert page.status_code == 200
    assert page.text.count('class="row schedule"') == 2
    assert page.headers["x-frame-options"] == "DENY"
    assert "server" not in page.headers
    assert [t["task_id"] for t in tasks.json()["items"]] == list(seeded.task_ids)
    assert cancel.status_code == 200
    assert forged.status_code == 403


def _self_signed(directory: Path) -> tuple[Path, Path]:
    """Write a self-signed certificate for 127.0.0.1 and its key (PEM)."""
    import ipaddress
    from datetime import UTC, datetime, timedelta

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.now(UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(minutes=5))
        .not_valid_after(now + timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    certfile, keyfile = directory / "cert.pem", directory / "key.pem"
    certfile.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    keyfile.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return certfile, keyfile


@pytest.mark.postgres
async def test_admin_serve_on_every_interface_serves_https_with_a_certificate(
    seeded: Any, tmp_path: Path
) -> None:
    import socket
    import ssl

    import httpx

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    certfile, keyfile = _self_signed(tmp_path)
    token = secrets.token_urlsafe(32)
    env = {**seeded.env(), "STEEPLE_ADMIN_TOKEN": token}
    args = ["admin", "serve", "--host", "0.0.0.0", "--port", str(port)]
    tls = ["--certfile", str(certfile), "--keyfile", str(keyfile)]
    proc = await _spawn([*args, *tls], env, tmp_path)
    trusted = ssl.create_default_context(cafile=str(certfile))
    try:
        async with httpx.AsyncClient(
            base_url=f"https://127.0.0.1:{port}", timeout=5, verify=trusted
        ) as http:
            for _ in range(150):
                try:
                    anonymous = await http.get("/ui/ops")
                    break
                except httpx.TransportError:
                    await asyncio.sleep(0.2)
            else:
                pytest.fail("admin serve did not start")
            page = await http.get("/ui/ops", headers={"authorization": f"Bearer {token}"})
    finally:
        _, err = await _stop(proc, signal.SIGINT)
    assert anonymous.status_code == 401
    assert page.status_code == 200
    assert f"https://0.0.0.0:{port}/ui/ops" in err.decode()
    assert "plain HTTP" not in err.decode()


POISONED_APP = """
from steeple.admin import WorkerApp
from steeple.testing import MemoryBroker

class PoisonedBroker(MemoryBroker):
    '''A broker adapter with a bug: a plain TypeError for one message.'''

    async def publish(self, message, *, idempotency_key, timeout):
        if message.payload == b"poison":
            raise TypeError("a topic of 100 x '€' is 300 bytes")
        return await super().publish(message, idempotency_key=idempotency_key, timeout=timeout)

def make():
    return WorkerApp(broker=PoisonedBroker())
"""


@pytest.mark.postgres
async def test_worker_survives_a_broker_raising_type_error(
    pg_schema: tuple[str, str], tmp_path: Path
) -> None:
    """Issue 11: one message a broker adapter cannot handle (TypeError) is retried, then
    dead-lettered; `steeple worker` stays up and publishes everything else."""
    from steeple.core import (
        MissedRunPolicy,
        RecurringConfig,
        RecurringDefinition,
        ScheduledMessage,
        SystemClock,
    )
    from steeple.keyring import Keyring, StorageKey
    from steeple.postgres import PostgresRecurringStore

    dsn, schema = pg_schema
    key = StorageKey.generate("k1")
    # A 4 s delivery window: a failing occurrence is dead after its third attempt (the
    # next one would fall after the window), so the test runs in real time.
    config = RecurringConfig(
        "default",
        1000,
        100_000,
        delivery_window=timedelta(seconds=4),
        lease_duration=timedelta(seconds=1),
    )
    store = await PostgresRecurringStore.initialize(
        dsn, config, Keyring(key), SystemClock(), schema=schema
    )
    try:
        now = datetime.now(UTC)
        for name, back, payload in (("good", 3, b"{}"), ("poison", 1, b"poison")):
            await store.create(
                RecurringDefinition(
                    name,
                    "* * * * *",
                    now - timedelta(minutes=back, seconds=1),
                    MissedRunPolicy.CATCH_UP,
                    ScheduledMessage("t", "T", payload),
                )
            )
        (tmp_path / "poisoned.py").write_text(textwrap.dedent(POISONED_APP))
        env = _env(
            STEEPLE_KEYS=f"k1:{key.to_base64()}",
            STEEPLE_DATABASE_URL=dsn,
            STEEPLE_SCHEMA=schema,
            STEEPLE_DELIVERY_WINDOW="4s",
            STEEPLE_LEASE="1s",
        )
        proc = await _spawn(["worker", "--app", "poisoned:make"], env, tmp_path)
        try:
            async with asyncio.timeout(60):
                while True:
                    occurrences = (await store.occurrences(limit=100)).items
                    poison = [o for o in occurrences if o.definition_name == "poison"]
                    good = [o for o in occurrences if o.definition_name == "good"]
                    published = [o for o in good if o.state.value == "published"]
                    if any(o.state.value == "dead" for o in poison) and len(published) >= 3:
                        break
                    assert proc.returncode is None, await proc.communicate()
                    await asyncio.sleep(0.2)
            still_up = proc.returncode is None  # after the TypeErrors
            assert still_up
            _, raw_stderr = await _stop(proc)
        finally:
            await _reap(proc)
        [dead, *_] = [o for o in poison if o.state.value == "dead"]
        assert dead.attempts >= 2  # retried with backoff, then dead
        assert dead.last_error == "TypeError"
        stderr = raw_stderr.decode()
        assert proc.returncode == 0, stderr
        assert "steeple worker: stopped" in stderr
        relayed = re.search(r"relayed (\d+) occurrences? \((\d+) relay failures?\)", stderr)
        assert relayed, stderr
        assert int(relayed.group(1)) >= 3
        assert int(relayed.group(2)) >= 2
    finally:
        await store.close()


QUEUE_APP = """
import os
from pathlib import Path
from steeple.postgres import queue

DONE = Path(__file__).with_name("done.txt")
app = queue.App(schema=os.environ["APP_SCHEMA"])

@app.task(name="write-report", max_attempts=2, queue="reports")
def write_report(ctx, args):  # a plain def: runs in the worker's thread pool
    ctx.report_progress(1.0, "written")
    with DONE.open("a") as fh:
        fh.write(f"{args['n']}\\n")
    return {"written": args["n"]}
"""


@pytest.mark.postgres
async def test_worker_serves_a_queue_app_and_refuses_another_schema(
    pg_schema: tuple[str, str], tmp_path: Path
) -> None:
    from steeple.postgres import queue

    dsn, schema = pg_schema
    conn = await asyncpg.connect(dsn)
    try:
        await queue.install(conn, schema=schema)
        ids = [
            (
                await queue.enqueue(
                    conn,
                    queue.Task("write-report"),
                    {"n": n},
                    queue.EnqueueOptions(queue="reports"),  # served: the app's task is there
                    schema=schema,
                )
            ).id
            for n in range(3)
        ]
    finally:
        await conn.close()
    (tmp_path / "myqueue.py").write_text(textwrap.dedent(QUEUE_APP))
    # The app's schema is served (no --queue-schema needed; STEEPLE_SCHEMA is another one).
    env = _env(STEEPLE_DATABASE_URL=dsn, STEEPLE_SCHEMA="unrelated", APP_SCHEMA=schema)
    proc = await _spawn(["worker", "--app", "myqueue:app"], env, tmp_path)
    done = tmp_path / "done.txt"
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if done.exists() and len(done.read_text().split()) == 3:
                break
            await asyncio.sleep(0.2)
        _, raw_stderr = await _stop(proc)
    finally:
        await _reap(proc)
    stderr = raw_stderr.decode()
    assert proc.returncode == 0, stderr
    assert f"task worker on {schema!r}" in stderr
    assert sorted(done.read_text().split()) == ["0", "1", "2"]
    conn = await asyncpg.connect(dsn)
    try:
        for n, task_id in enumerate(ids):
            run = await queue.run_state(conn, task_id, schema=schema)
            assert (run.state.value, run.result) == ("succeeded", {"written": n})
            assert run.progress == queue.Progress(1.0, "written")
    finally:
        await conn.close()

    other = _env(STEEPLE_DATABASE_URL=dsn, STEEPLE_QUEUE_SCHEMA="not_the_apps", APP_SCHEMA=schema)
    proc = await _spawn(["worker", "--app", "myqueue:app"], other, tmp_path)
    try:
        _, raw_stderr = await asyncio.wait_for(proc.communicate(), 60)
    finally:
        await _reap(proc)
    assert proc.returncode == ExitCode.CONFIG, raw_stderr
    assert "differs from the app's schema" in raw_stderr.decode()


PERIODIC_APP = """
import os
from steeple.postgres import queue

app = queue.App(schema=os.environ["APP_SCHEMA"])

if os.environ.get("WITH_NIGHTLY") == "1":
    @app.periodic("0 2 * * *", timezone="Europe/Berlin", args={"n": 0}, name="nightly")
    @app.task(name="write-report", queue="reports")
    def write_report(ctx, args):
        return None
else:
    @app.task(name="write-report", queue="reports")
    def write_report(ctx, args):
        return None
"""


async def _job_names(dsn: str, schema: str) -> list[tuple[str, str, str]]:
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch(f'SELECT name, queue, timezone FROM "{schema}".jobs ORDER BY name')
        return [(r[0], r[1], r[2]) for r in rows]
    finally:
        await conn.close()


@pytest.mark.postgres
async def test_worker_app_ensures_its_periodic_jobs_and_removes_stale_ones_only_when_asked(
    pg_schema: tuple[str, str], tmp_path: Path
) -> None:
    """``steeple worker --app`` ensures an App's periodic jobs when it starts.

    A job its code no longer declares is reported and keeps running; it is deleted only
    with ``--remove-stale-periodic``.
    """
    from steeple.postgres import queue

    dsn, schema = pg_schema
    conn = await asyncpg.connect(dsn)
    try:
        await queue.install(conn, schema=schema)
    finally:
        await conn.close()
    (tmp_path / "periodic_app.py").write_text(textwrap.dedent(PERIODIC_APP))
    nightly = ("periodic:nightly", "reports", "Europe/Berlin")

    async def run_until(env: dict[str, str], args: list[str], marker: str) -> str:
        """Run the worker until its stderr shows ``marker`` (its start-up got there)."""
        proc = await _spawn(["worker", "--app", "periodic_app:app", *args], env, tmp_path)
        seen: list[str] = []
        try:
            assert proc.stderr is not None
            async with asyncio.timeout(30):
                while not any(marker in line for line in seen):
                    line = await proc.stderr.readline()
                    assert line, "".join(seen)  # the worker ended before the marker
                    seen.append(line.decode())
            _, rest = await _stop(proc)
        finally:
            await _reap(proc)
        stderr = "".join(seen) + rest.decode()
        assert proc.returncode == 0, stderr
        return stderr

    base = _env(STEEPLE_DATABASE_URL=dsn, APP_SCHEMA=schema)
    # The first start declares it; a start of the code without it reports it, and keeps it.
    await run_until({**base, "WITH_NIGHTLY": "1"}, [], "steeple worker: running")
    # It has exited: its start (which ensures the jobs, even when stopped at once) is done.
    assert await _job_names(dsn, schema) == [nightly]
    kept = await run_until(base, [], "is no longer declared by this app")
    assert "'periodic:nightly' is no longer declared by this app" in kept
    assert "--remove-stale-periodic" in kept
    assert await _job_names(dsn, schema) == [nightly]
    removed = await run_until(base, ["--remove-stale-periodic"], "removed periodic job")
    assert "removed periodic job 'periodic:nightly'" in removed
    assert await _job_names(dsn, schema) == []
