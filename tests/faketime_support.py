"""Stepping a real process's wall clock with Debian's libfaketime (``apt-get install faketime``).

A process started with ``LD_PRELOAD=libfaketime.so.1`` reads its wall clock (``time()``,
``gettimeofday``, ``clock_gettime(CLOCK_REALTIME)``) as the real one plus the offset written
in a control file, re-read on every call (``FAKETIME_NO_CACHE``). Writing the file steps the
clock of the running process, as NTP or an operator would. Its monotonic clock is left alone
(``FAKETIME_DONT_FAKE_MONOTONIC``): a real step does not move ``CLOCK_MONOTONIC`` either.
That works for a Python worker and for a PostgreSQL server (its backends inherit the
environment), so both sides of a queue can have their clocks stepped for real.
"""

from __future__ import annotations

import glob
import itertools
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1",
    "/usr/lib/aarch64-linux-gnu/faketime/libfaketime.so.1",
    "/usr/lib/faketime/libfaketime.so.1",
    "/usr/local/lib/faketime/libfaketime.so.1",
)


def libfaketime() -> str | None:
    """Return the path of libfaketime.so.1, or None when it is not installed."""
    for path in (*_CANDIDATES, *sorted(glob.glob("/usr/lib/*/faketime/libfaketime.so.1"))):
        if os.path.exists(path):
            return path
    return None


class SteppedClock:
    """The control file of a libfaketime'd process: its wall clock's offset from the real one."""

    def __init__(self, path: Path, library: str) -> None:
        self.path = path
        self.library = library
        self.offset = 0
        self.set(0)

    def set(self, offset_seconds: int) -> None:
        """Step the clock to the real time plus ``offset_seconds`` (whole seconds)."""
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(f"{offset_seconds:+d}\n")
        tmp.chmod(0o644)
        os.replace(tmp, self.path)  # atomic: a reader never sees a half-written file
        self.offset = offset_seconds

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """The environment that puts a child process on this clock."""
        env = dict(os.environ if base is None else base)
        env.update(
            LD_PRELOAD=self.library,
            FAKETIME_TIMESTAMP_FILE=str(self.path),
            FAKETIME_NO_CACHE="1",
            FAKETIME_DONT_FAKE_MONOTONIC="1",
        )
        return env


def steps(offsets: list[int]) -> Iterator[tuple[int, int]]:
    """Yield ``(step, offset)`` for each new offset after the first."""
    for before, after in itertools.pairwise(offsets):
        yield after - before, after


# Every step the issue asks for, both ways, from both sides of the real time: +-31 s,
# +-10 min and +-1 h (each offset differs from the one before by exactly that much).
OFFSETS: list[int] = [0, 31, 0, -31, 0, 600, 0, -600, 0, 3600, 0, -3600, 0]


def restart_under_faketime(server: Any, clock: SteppedClock) -> None:
    """Restart a pgserver cluster (``private_pg``) with its clock on ``clock``."""
    from pgserver._commands import pg_ctl  # type: ignore[attr-defined]

    match = re.search(r"host=([^&]+)", server.get_uri())
    assert match, "expected a Unix-socket DSN from pgserver"
    socket_dir = match.group(1)
    # The control file must be readable by the server's user (pgserver runs it as
    # "postgres" when the tests run as root).
    clock.path.parent.chmod(0o755)
    pg_ctl(["-m", "fast", "-w", "stop"], pgdata=server.pgdata, user=server.system_user, timeout=60)
    pg_ctl(
        ["-w", "-o", '-h ""', "-o", f"-k {socket_dir}", "-l", str(server.log), "start"],
        pgdata=server.pgdata,
        user=server.system_user,
        timeout=60,
        env=clock.env(),
    )
