"""``steeple worker`` fixes glibc's mmap threshold, so that large buffers never come from the
heap (where reconnection storms fragment it: see :mod:`steeple.admin._memory`)."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from typing import Any

import pytest
from typer.testing import CliRunner

from steeple.admin.cli import app
from steeple.admin.settings import ExitCode


def _glibc_with_mallinfo2() -> bool:
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018
        libc.mallinfo2  # noqa: B018 - glibc 2.33 and later
    except (OSError, AttributeError):
        return False
    return sys.platform.startswith("linux")


pytestmark = pytest.mark.skipif(not _glibc_with_mallinfo2(), reason="glibc 2.33+ only")

# In a fresh interpreter: free one 256 KiB block (glibc's dynamic threshold rises to its
# size), then allocate another and count the chunks mapped on their own around it.
_PROBE = """
import ctypes, sys
from steeple.admin._memory import pin_mmap_threshold

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
if sys.argv[1] == "pin":
    assert pin_mmap_threshold()
libc.free(libc.malloc(256 * 1024))
before = libc.mallinfo2().hblks
block = libc.malloc(256 * 1024)
print(libc.mallinfo2().hblks - before)
libc.free(block)
"""


def _mapped_on_its_own(mode: str, **env: str) -> int:
    environ = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, mode],
        env={**environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return int(done.stdout)


def test_a_pinned_threshold_keeps_large_blocks_off_the_heap() -> None:
    # glibc's own behaviour, which the pin exists for: the block comes from the heap.
    assert _mapped_on_its_own("leave") == 0
    assert _mapped_on_its_own("pin") == 1


def test_an_operator_choice_of_threshold_is_left_alone() -> None:
    from steeple.admin._memory import pin_mmap_threshold

    os.environ["MALLOC_MMAP_THRESHOLD_"] = "1048576"
    try:
        assert pin_mmap_threshold() is False
    finally:
        del os.environ["MALLOC_MMAP_THRESHOLD_"]


def test_the_worker_command_pins_the_threshold_first(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Any] = []
    monkeypatch.setattr("steeple.admin._memory.pin_mmap_threshold", lambda: calls.append(1))
    result = CliRunner().invoke(
        app, ["worker", "--app", "no_such_module_x:app", "--dsn", "postgresql://x@h/db"]
    )
    assert result.exit_code == ExitCode.CONFIG  # it got as far as importing the app
    assert calls == [1]
