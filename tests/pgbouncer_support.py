"""A private PgBouncer in transaction mode in front of the test server, for the pooler tests.

Debian's ``pgbouncer`` (``/usr/sbin/pgbouncer``) runs in the foreground with its own
configuration, auth file, log and Unix-socket-free listener on a free port of 127.0.0.1,
all in a temporary directory that is removed afterwards. It refuses to run as root, so
under root it is started with ``-u`` as the ``postgres`` system user (or ``nobody``).
:meth:`PgBouncer.kill` ends it with SIGKILL (every client and server connection drops),
:meth:`PgBouncer.start` starts it again on the same port.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

BINARY = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _run_as() -> str | None:
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        with contextlib.suppress(KeyError):
            pwd.getpwnam(name)
            return name
    return None


class PgBouncer:
    """One private PgBouncer (``pool_mode = transaction``) in front of ``server_dsn``."""

    def __init__(self, server_dsn: str, *, pool_size: int = 6) -> None:
        parts = urlsplit(server_dsn)
        self._parts = parts
        self.user = parts.username or "postgres"
        password = parts.password or ""
        self.port = _free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="steeple-pgbouncer-"))
        self.log = self.dir / "pgbouncer.log"
        self._process: subprocess.Popen[bytes] | None = None
        self._user = _run_as()
        (self.dir / "users.txt").write_text(f'"{self.user}" "{password}"\n')
        self.config = self.dir / "pgbouncer.ini"
        self.config.write_text(
            "[databases]\n"
            f"* = host={parts.hostname or '127.0.0.1'} port={parts.port or 5432}\n"
            "[pgbouncer]\n"
            "listen_addr = 127.0.0.1\n"
            f"listen_port = {self.port}\n"
            "unix_socket_dir =\n"
            "auth_type = trust\n"
            f"auth_file = {self.dir / 'users.txt'}\n"
            "pool_mode = transaction\n"
            f"default_pool_size = {pool_size}\n"
            "max_client_conn = 200\n"
            f"logfile = {self.log}\n"
            # Dead servers are noticed at once after a restart of either side.
            "server_login_retry = 1\n"
            "server_check_delay = 0\n"
        )
        self.dir.chmod(0o755)
        if self._user is not None:
            for path in (self.dir, *self.dir.iterdir()):
                shutil.chown(path, self._user)

    def dsn(self, query: str = "") -> str:
        """The test server's DSN with host and port replaced by the pooler's."""
        parts = self._parts
        auth = parts.username or "postgres"
        if parts.password:
            auth += f":{parts.password}"
        netloc = f"{auth}@127.0.0.1:{self.port}"
        return urlunsplit((parts.scheme, netloc, parts.path, query or parts.query, ""))

    def start(self) -> None:
        """Start it (again) and wait until it accepts connections."""
        args = [BINARY]
        if self._user is not None:
            args += ["-u", self._user]
        args.append(str(self.config))
        self._process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while True:
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.port), timeout=1),
            ):
                return
            if self._process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"pgbouncer did not start: {self.log_text()[-2000:]}")
            time.sleep(0.05)

    def kill(self) -> None:
        """End it with SIGKILL (connections drop, nothing is flushed) and wait for it."""
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGKILL)
            process.wait(timeout=20)

    def stop(self) -> None:
        """End it and remove its directory."""
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)

    def log_text(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""


def version() -> tuple[int, ...]:
    """The installed PgBouncer's version, e.g. ``(1, 18, 0)``."""
    out = subprocess.run([BINARY, "--version"], capture_output=True, text=True, check=True)
    first = out.stdout.split()[1]
    return tuple(int(p) for p in first.split(".") if p.isdigit())


@contextlib.contextmanager
def running_pgbouncer(server_dsn: str, *, pool_size: int = 6) -> Iterator[PgBouncer]:
    """A started :class:`PgBouncer`, stopped (and its directory removed) afterwards."""
    bouncer = PgBouncer(server_dsn, pool_size=pool_size)
    try:
        bouncer.start()
        yield bouncer
    finally:
        bouncer.stop()
