"""A private PostgreSQL server for a benchmark: initdb in a temporary directory, one port.

Uses the server binaries of ``STEEPLE_PG_BIN`` (default ``/usr/lib/postgresql/15/bin``);
as root, the cluster runs as the ``postgres`` system user. Nothing else on the machine is
touched, and :meth:`PrivateServer.close` stops it and deletes its directory.
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

BIN = Path(os.environ.get("STEEPLE_PG_BIN", "/usr/lib/postgresql/15/bin"))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


class PrivateServer:
    """One cluster with the given ``postgresql.conf`` settings, started on a free port."""

    def __init__(self, settings: dict[str, str]) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="steeple-bench-pg-"))
        self.data = self.root / "data"
        self.log = self.root / "server.log"
        self.user: str | None = None
        if os.geteuid() == 0:
            self.user = "postgres"
            entry = pwd.getpwnam(self.user)
            os.chown(self.root, entry.pw_uid, entry.pw_gid)
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "-A", "trust", "-E", "UTF8")
        base = {
            "listen_addresses": "'127.0.0.1'",
            "unix_socket_directories": "''",
            "log_min_messages": "warning",
        }
        with (self.data / "postgresql.conf").open("a") as conf:
            for name, value in {**base, **settings}.items():
                conf.write(f"{name} = {value}\n")
        self.port = _free_port()
        self._run(
            "pg_ctl", "-D", str(self.data), "-w", "-t", "120", "-l", str(self.log),
            "-o", f"-p {self.port}", "start",
        )  # fmt: skip

    def dsn(self, database: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def _run(self, program: str, *args: str) -> None:
        done = subprocess.run(
            [str(BIN / program), *args],
            check=False,
            capture_output=True,
            text=True,
            user=self.user,
            cwd=self.root,
            timeout=300,
        )
        if done.returncode != 0:
            tail = self.log.read_text()[-2000:] if self.log.exists() else ""
            raise RuntimeError(f"{program} failed: {done.stderr.strip()}\n{tail}")

    def close(self) -> None:
        try:
            if (self.data / "postmaster.pid").exists():
                self._run("pg_ctl", "-D", str(self.data), "-w", "-m", "fast", "stop")
        finally:
            shutil.rmtree(self.root, ignore_errors=True)
