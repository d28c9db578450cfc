"""Private PostgreSQL clusters a test may reconfigure, replicate, promote, stop and fill up.

Built with pgserver's binaries (the ``private_pg`` fixture's) in a temporary directory and
listening on a free port of 127.0.0.1 only, so nothing else on the machine is touched.
PostgreSQL refuses to run as root: as root every cluster runs as pgserver's system user
``pgserver`` (the one ``private_pg`` uses), which also owns the tmpfs mounts made here.

The :func:`pg_clusters` fixture (registered by the conftests beside the tests) yields a
:class:`Clusters` factory and, even when the test fails, stops every cluster it started,
unmounts every tmpfs and deletes the directory.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest

IN_CI = os.environ.get("CI", "").lower() in {"1", "true", "yes"}
_SYSTEM_USER = "pgserver"
_SETTINGS = {
    "listen_addresses": "'127.0.0.1'",
    "unix_socket_directories": "''",
    "max_connections": "40",
    "shared_buffers": "16MB",
    "fsync": "on",
    "log_min_messages": "warning",
    "log_checkpoints": "off",
}


def unavailable(what: str) -> None:
    """Fail under CI, skip elsewhere (as the root conftest does)."""
    if IN_CI:
        pytest.fail(f"{what} is not available, and under CI=true that is a failure")
    pytest.skip(f"{what} is not available on this machine")


def _bin_dir() -> Path:
    try:
        from pgserver._commands import POSTGRES_BIN_PATH
    except ImportError:
        unavailable("pgserver (private PostgreSQL clusters)")
        raise
    return Path(POSTGRES_BIN_PATH)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


async def poll(what: str, check: Callable[[], Awaitable[bool]], timeout: float = 30.0) -> None:
    """Wait until ``check()`` is true (synchronising on state, never on a fixed sleep)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not await check():
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.05)


async def fetchval(dsn: str, query: str, *args: Any) -> Any:
    """Run one query on a fresh connection and return its first value."""
    conn = await asyncpg.connect(dsn, timeout=10)
    try:
        return await conn.fetchval(query, *args)
    finally:
        await conn.close()


async def execute(dsn: str, *statements: str) -> None:
    """Run statements, each on its own, on one fresh connection."""
    conn = await asyncpg.connect(dsn, timeout=10)
    try:
        for statement in statements:
            await conn.execute(statement)
    finally:
        await conn.close()


class Cluster:
    """One PostgreSQL cluster: a data directory, a log, and (while running) a port."""

    def __init__(self, clusters: Clusters, name: str) -> None:
        self._clusters = clusters
        self.name = name
        self.data = clusters.root / name
        self.log = clusters.root / f"{name}.log"
        self.port: int | None = None

    def __repr__(self) -> str:
        return f"Cluster({self.name!r}, port={self.port})"

    def dsn(self, database: str = "postgres", user: str = "postgres", query: str = "") -> str:
        """A URI for this cluster (it must have been started)."""
        assert self.port is not None, f"{self.name} was never started"
        suffix = f"?{query}" if query else ""
        return f"postgresql://{user}@127.0.0.1:{self.port}/{database}{suffix}"

    def ctl(self, *args: str, timeout: float = 60) -> None:
        """Run ``pg_ctl -D <data> <args>``."""
        self._clusters.run("pg_ctl", "-D", str(self.data), *args, timeout=timeout)

    def start(self, port: int | None = None) -> None:
        """Start on ``port`` (default: the last one, or a free one) and wait until ready."""
        wanted = port or self.port
        for attempt in range(5):
            chosen = wanted or _free_port()
            try:
                self.ctl("-w", "-t", "60", "-l", str(self.log), "-o", f"-p {chosen}", "start")
            except subprocess.CalledProcessError:
                if wanted or attempt == 4:
                    raise
                continue  # another process took the free port in between
            self.port = chosen
            return

    def stop(self, mode: str = "fast") -> None:
        """Stop (``fast``: clean shutdown; ``immediate``: like a crash)."""
        self.ctl("-w", "-t", "60", "-m", mode, "stop")

    def running(self) -> bool:
        """Whether a postmaster runs on this data directory."""
        return (self.data / "postmaster.pid").exists()

    def promote(self) -> None:
        """Promote a standby to a primary and wait until it accepts writes."""
        self.ctl("-w", "-t", "60", "promote")

    def write_conf(self, settings: dict[str, str]) -> None:
        """Append settings to postgresql.conf (values as written in the file)."""
        with (self.data / "postgresql.conf").open("a") as conf:
            for name, value in settings.items():
                conf.write(f"{name} = {value}\n")


class Clusters:
    """Creates clusters and tmpfs mounts under one temporary directory; cleans up all."""

    def __init__(self) -> None:
        self._bin = _bin_dir()
        self.root = Path(tempfile.mkdtemp(prefix="steeple-clusters-"))
        self.user: str | None = None
        if os.geteuid() == 0:
            self.user = _SYSTEM_USER
            try:
                from pgserver.utils import (
                    ensure_folder_permissions,
                    ensure_prefix_permissions,
                    ensure_user_exists,
                )
            except ImportError:
                unavailable("pgserver (private PostgreSQL clusters)")
                raise
            ensure_user_exists(self.user)
            ensure_prefix_permissions(self._bin)
            ensure_folder_permissions(self._bin, 0o055)
            ensure_folder_permissions(self._bin.parent / "lib", 0o044)
            ensure_prefix_permissions(self.root)
            shutil.chown(self.root, self.user, self.user)
        self._clusters: list[Cluster] = []
        self._mounts: list[Path] = []

    def run(self, program: str, *args: str, timeout: float = 60) -> str:
        """Run one of the PostgreSQL programs as the clusters' user; return its stdout."""
        done = subprocess.run(
            [str(self._bin / program), *args],
            check=False,
            capture_output=True,
            text=True,
            timeout=timeout,
            user=self.user,
            cwd=self.root,
        )
        if done.returncode != 0:
            raise subprocess.CalledProcessError(
                done.returncode, done.args, done.stdout, done.stderr + self._log_tails()
            )
        return done.stdout

    def _log_tails(self) -> str:
        tails = []
        for cluster in self._clusters:
            if cluster.log.exists():
                tails.append(f"\n--- {cluster.log.name}:\n{cluster.log.read_text()[-2000:]}")
        return "".join(tails)

    def new(
        self,
        name: str,
        *,
        initdb_args: tuple[str, ...] = (),
        settings: dict[str, str] | None = None,
        start: bool = True,
    ) -> Cluster:
        """Create (initdb) and by default start a cluster named ``name``."""
        cluster = Cluster(self, name)
        self._clusters.append(cluster)
        self.run(
            "initdb",
            "-D",
            str(cluster.data),
            "-U",
            "postgres",
            "--auth=trust",
            "--encoding=utf8",
            "--no-instructions",
            *initdb_args,
        )
        cluster.write_conf({**_SETTINGS, **(settings or {})})
        if start:
            cluster.start()
        return cluster

    def replica(self, primary: Cluster, name: str) -> Cluster:
        """A streaming standby of ``primary`` (pg_basebackup -R), started."""
        assert primary.port is not None
        cluster = Cluster(self, name)
        self._clusters.append(cluster)
        self.run(
            "pg_basebackup",
            "-d",
            f"host=127.0.0.1 port={primary.port} user=postgres application_name={name}",
            "-D",
            str(cluster.data),
            "-R",
            "-X",
            "stream",
            "-c",
            "fast",
        )
        cluster.start()
        return cluster

    def tmpfs(self, name: str, size: str) -> Path:
        """Mount a tmpfs of ``size`` (``8m``...) owned by the clusters' user (needs root)."""
        if os.geteuid() != 0:
            unavailable("mounting a tmpfs (the full-disk tests need root)")
        path = self.root / name
        path.mkdir()
        owner = ""
        if self.user:
            import pwd

            entry = pwd.getpwnam(self.user)
            owner = f",uid={entry.pw_uid},gid={entry.pw_gid}"
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700{owner}", "tmpfs", str(path)],
            check=False,
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            unavailable(f"mounting a tmpfs ({done.stderr.strip()})")
        self._mounts.append(path)
        return path

    def owned_dir(self, path: Path) -> Path:
        """Create ``path`` owned by the clusters' user (a tablespace's location)."""
        path.mkdir()
        if self.user:
            shutil.chown(path, self.user, self.user)
        return path

    def cleanup(self) -> None:
        """Stop every cluster (immediately), unmount every tmpfs, delete the directory."""
        for cluster in self._clusters:
            if cluster.running():
                with contextlib.suppress(subprocess.SubprocessError, OSError):
                    cluster.stop("immediate")
        for path in reversed(self._mounts):
            done = subprocess.run(["umount", str(path)], check=False, capture_output=True)
            if done.returncode != 0:
                subprocess.run(["umount", "-l", str(path)], check=False)
        shutil.rmtree(self.root, ignore_errors=True)


def fill(directory: Path, leave: int) -> Path:
    """Fill the file system of ``directory`` with a filler file until ``leave`` bytes are free.

    Returns the filler's path (delete it to free the space).
    """
    filler = directory / "filler"
    stat = os.statvfs(directory)
    free = stat.f_bavail * stat.f_frsize
    with filler.open("wb") as out:
        remaining = max(free - leave, 0)
        chunk = b"\0" * (1 << 20)
        while remaining > 0:
            n = min(remaining, len(chunk))
            out.write(chunk[:n])
            remaining -= n
    return filler


def free_bytes(directory: Path) -> int:
    """Free bytes on the file system of ``directory``."""
    stat = os.statvfs(directory)
    return stat.f_bavail * stat.f_frsize


@pytest.fixture
def pg_clusters() -> Iterator[Clusters]:
    """A :class:`Clusters` factory; everything it made is removed afterwards."""
    clusters = Clusters()
    try:
        yield clusters
    finally:
        clusters.cleanup()
