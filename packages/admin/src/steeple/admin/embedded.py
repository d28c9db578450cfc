"""The embedded default: a private PostgreSQL (the ``pgserver`` package) in a named directory.

The data directory is kept between runs, so what a run stored is still there in the next
one (durability is real, not simulated); ``reset`` removes it first. The server listens
only on a Unix socket inside the data directory and is stopped when the handle closes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

import attrs

from steeple.admin.settings import CliError, ExitCode

__all__ = ["EmbeddedPostgres", "database_url", "running_server"]


@attrs.define
class EmbeddedPostgres:
    """A private PostgreSQL cluster in ``data_dir / "pgdata"``.

    Use it as a context manager: entering starts (or reuses) the server, leaving stops it.

    Raises:
        CliError: (unavailable) ``pgserver`` is not installed or the server does not start.
    """

    data_dir: Path
    reset: bool = False
    _server: Any = attrs.field(default=None, init=False)

    @property
    def pgdata(self) -> Path:
        """The PostgreSQL data directory."""
        return self.data_dir / "pgdata"

    def start(self) -> str:
        """Start (or reuse) the server and return its DSN.

        A server already running on this directory (started by a demo, ``steeple admin
        serve`` or another command still running) is connected to as it is: nothing is
        started, and :meth:`stop` leaves it running for whoever started it.

        Raises:
            CliError: (unavailable) it cannot be started; (config) the directory is unusable.
        """
        if not self.reset:
            running = running_server(self.pgdata)
            if running is not None:
                return running
        try:
            with warnings.catch_warnings():
                # platformdirs warns when XDG_RUNTIME_DIR is unset; pgserver copes with it.
                warnings.simplefilter("ignore")
                from pgserver.postgres_server import get_server
        except ImportError:
            raise CliError(
                "the embedded PostgreSQL needs the pgserver package, which is not installed",
                code=ExitCode.UNAVAILABLE,
                hint="pip install pgserver, or pass --dsn postgresql://... to use a server",
            ) from None
        if self.reset and self.data_dir.exists():
            self._stop_leftover()
            shutil.rmtree(self.data_dir)
        try:
            self.data_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CliError(
                f"cannot create the data directory {str(self.data_dir)!r}: {exc.strerror}",
                code=ExitCode.CONFIG,
                hint="choose another one with --data-dir",
            ) from None
        # pgserver logs its progress at INFO; the demo shows its own.
        logging.getLogger("pgserver").setLevel(logging.WARNING)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self._server = get_server(self.pgdata, cleanup_mode="stop")
            uri: str = self._server.get_uri()
        except (OSError, subprocess.SubprocessError, AssertionError) as exc:
            raise CliError(
                f"the embedded PostgreSQL in {str(self.pgdata)!r} did not start ({exc})",
                code=ExitCode.UNAVAILABLE,
                hint=f"see {self.pgdata / 'log'}; or start afresh with --fresh",
            ) from None
        return uri

    def _stop_leftover(self) -> None:
        # A server left running on this directory (e.g. a killed run) must stop before its
        # files are removed, or it would keep writing into the new cluster's place.
        if not (self.pgdata / "postmaster.pid").exists():
            return
        try:
            from pgserver._commands import pg_ctl  # type: ignore[attr-defined]

            pg_ctl(
                ["-w", "-m", "fast", "stop"],
                pgdata=self.pgdata,
                user="pgserver" if _is_root() else None,
            )
        except (OSError, subprocess.SubprocessError, ImportError):
            pass  # nothing running (a stale pid file): removing the files is enough

    def stop(self) -> None:
        """Stop the server (the data stays for the next run)."""
        server, self._server = self._server, None
        if server is not None:
            server.cleanup()

    def __enter__(self) -> str:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def running_server(pgdata: Path) -> str | None:
    """Return the DSN of the server running on ``pgdata``, or ``None`` if none is.

    Read from its ``postmaster.pid`` without importing ``pgserver`` (which costs more than
    the command): running means the pid is alive and a postgres process, the server says
    it is ready, and its socket is there. A stale file (a killed server, a reused pid)
    reads as none, and the caller starts one.
    """
    try:
        lines = (pgdata / "postmaster.pid").read_text("utf-8").splitlines()
        pid, port, socket_dir, status = int(lines[0]), int(lines[3]), lines[4], lines[7]
    except (OSError, ValueError, IndexError, UnicodeDecodeError):
        return None
    if status.strip() != "ready" or not socket_dir.strip() or pid <= 0:
        return None
    try:
        os.kill(pid, 0)
    except PermissionError:
        pass  # alive, run by another user (pgserver runs it as its own user under root)
    except OSError:
        return None
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        command = b"postgres"  # no /proc here: the live pid and the socket must do
    if b"postgres" not in command:
        return None
    socket_dir = socket_dir.strip()
    if not (Path(socket_dir) / f".s.PGSQL.{port}").exists():
        return None
    at_port = "" if port == 5432 else f"&port={port}"
    return f"postgresql://postgres:@/postgres?host={socket_dir}{at_port}"


def _is_root() -> bool:
    import os

    return hasattr(os, "geteuid") and os.geteuid() == 0


@contextlib.contextmanager
def database_url(data_dir: str | Path = ".steeple/tour") -> Iterator[str]:
    """Yield ``STEEPLE_DATABASE_URL`` if it is set, else the embedded PostgreSQL's URL.

    The embedded server (a private cluster in ``data_dir / "pgdata"``, kept between runs)
    is started on entry and stopped on exit; with the variable set nothing is started. What
    the five-minute tours use, so they run with no environment at all.

    Raises:
        CliError: (unavailable) the embedded server cannot start (e.g. ``pgserver`` is not
            installed); (config) ``data_dir`` cannot be created.
    """
    given = os.environ.get("STEEPLE_DATABASE_URL")
    if given:
        yield given
        return
    with EmbeddedPostgres(Path(data_dir)) as dsn:
        yield dsn
