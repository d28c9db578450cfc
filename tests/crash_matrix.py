"""The crash-point matrix's plumbing: sampling, worker processes, pausing, restarting.

The whole matrix (every crash point x SIGKILL / immediate PostgreSQL restart) runs with
``STEEPLE_CRASH_MATRIX=all`` (``nox -s crashmatrix``). Otherwise each test runs a seeded
sample of its scenarios; the seed is in every test id and failure message, and
``STEEPLE_CRASH_SEED=<seed>`` picks the same sample again.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import sys
from collections.abc import Awaitable, Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

from pg_cluster import Cluster, poll

T = TypeVar("T")

WORKER = str(Path(__file__).resolve().parent / "crash_worker.py")
EVERYTHING = os.environ.get("STEEPLE_CRASH_MATRIX", "") == "all"
SEED = int(os.environ.get("STEEPLE_CRASH_SEED") or random.SystemRandom().randrange(1 << 31))


def sample(scenarios: Sequence[T], size: int, salt: str) -> list[T]:
    """Every scenario under ``STEEPLE_CRASH_MATRIX=all``, else ``size`` of them by the seed
    (``salt`` makes each test's sample its own)."""
    if EVERYTHING or size >= len(scenarios):
        return list(scenarios)
    return random.Random(f"{SEED}:{salt}").sample(list(scenarios), size)


def yearly_cron(fired: datetime) -> str:
    """A cron expression that fired at ``fired`` (UTC, to the minute) and next fires a
    year later: a minute boundary during a test adds no occurrence."""
    return f"{fired.minute} {fired.hour} {fired.day} {fired.month} *"


def read_lines(path: Path) -> list[str]:
    """The lines of ``path`` (none when it does not exist)."""
    return path.read_text().splitlines() if path.exists() else []


def reproduce() -> str:
    """What a failure message says to pick the same sample again."""
    return f"(reproduce with STEEPLE_CRASH_SEED={SEED})"


class Crashing:
    """A worker process armed to die (``kill``) or freeze (``restart``) at one crash point."""

    def __init__(self, how: str, point: str, workdir: Path) -> None:
        self.how = how
        self.point = point
        self.workdir = workdir
        self.proc: asyncio.subprocess.Process | None = None

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        for name in ("STEEPLE_CRASH_AT", "STEEPLE_CRASH_PAUSE", "STEEPLE_CRASH_TRACE"):
            env.pop(name, None)
        if self.how == "kill":
            env["STEEPLE_CRASH_AT"] = self.point
        else:
            env["STEEPLE_CRASH_PAUSE"] = self.point
            env["STEEPLE_CRASH_DIR"] = str(self.workdir)
            os.mkfifo(self.workdir / "release")
        return env

    async def start(self, *args: str) -> None:
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable,
            WORKER,
            *args,
            env=self.environment(),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        assert self.proc.stdout is not None
        line = await asyncio.wait_for(self.proc.stdout.readline(), 60)
        if line.strip() != b"ready":
            _, err = await self.proc.communicate()
            raise AssertionError(f"the worker did not start: {err.decode()[-2000:]}")

    async def crash(self, cluster: Cluster | None, snapshot: Callable[[], Awaitable[None]]) -> None:
        """Wait until the point is reached: the process died of SIGKILL, or it froze there
        and PostgreSQL was restarted immediately under it (then it is let go).

        ``snapshot`` runs once the worker is dead, or while it is frozen (before the
        restart): it sees the state the crash left.
        """
        proc = self.proc
        assert proc is not None
        if self.how == "kill":
            try:
                code = await asyncio.wait_for(proc.wait(), 60)
            except TimeoutError:
                proc.kill()
                await proc.wait()
                raise AssertionError(f"{self.point} was never reached {reproduce()}") from None
            assert code == -signal.SIGKILL, (code, await self._stderr())
            await snapshot()
            return
        assert cluster is not None
        paused = self.workdir / "paused"

        async def reached() -> bool:
            if proc.returncode is not None:
                raise AssertionError(f"the worker exited: {await self._stderr()}")
            return paused.exists()

        await poll(f"the worker to pause at {self.point}", reached, timeout=60)
        assert paused.read_text() == self.point
        await snapshot()
        # The worker is frozen mid-step (event loop included) while the server crashes and
        # comes back on the same port; then it goes on, over connections that are dead.
        await asyncio.to_thread(cluster.stop, "immediate")
        await asyncio.to_thread(cluster.start)
        await asyncio.to_thread((self.workdir / "release").write_text, "go")

    async def finish(self) -> int:
        """SIGTERM a surviving worker; return its exit status (the killed one's -9)."""
        proc = self.proc
        assert proc is not None
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
        try:
            return await asyncio.wait_for(proc.wait(), 60)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise AssertionError(f"the worker did not stop on SIGTERM {reproduce()}") from None

    async def _stderr(self) -> str:
        assert self.proc is not None
        assert self.proc.stderr is not None
        try:
            data = await asyncio.wait_for(self.proc.stderr.read(), 5)
        except TimeoutError:
            return ""
        return data.decode(errors="replace")[-3000:]

    async def stderr(self) -> str:
        """The worker's last words (for failure messages)."""
        return await self._stderr()


async def idle_in_transaction(dsn: str, application: str, schema: str) -> int:
    """Sessions of ``application`` on ``schema`` left idle in transaction (after settling)."""
    import asyncpg

    conn = await asyncpg.connect(dsn, timeout=10)
    try:
        count: Any = 0
        for _ in range(40):  # a session between two statements of one transaction
            count = await conn.fetchval(
                # The worker names its sessions "<application> <worker id>".
                "SELECT count(*) FROM pg_stat_activity "
                "WHERE (application_name = $1 OR application_name LIKE $1 || ' %') "
                "AND state LIKE 'idle in transaction%' AND position($2 in query) > 0",
                application,
                schema,
            )
            if count == 0:
                break
            await asyncio.sleep(0.05)
        return int(count)
    finally:
        await conn.close()
