"""Fixtures for the SQLite store's tests: small tmpfs mounts (a real full or read-only disk).

Mounting needs root. Elsewhere the tests that need a mount skip, and under CI (``CI=true``)
they fail: a fault test must never pass by not running.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# The tests import their helpers (sqlite_support.py) by bare name; with
# --import-mode=importlib the test directory is not on sys.path by itself.
_HERE = str(Path(__file__).parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

from sqlite_support import Mount  # noqa: E402

IN_CI = os.environ.get("CI", "").lower() in {"1", "true", "yes"}


def _unavailable(what: str) -> None:
    if IN_CI:
        pytest.fail(f"{what} is not possible here, and under CI=true that is a failure")
    pytest.skip(f"{what} is not possible here")


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Mount]:
    """Mount small tmpfs file systems under ``tmp_path``; all unmounted after the test."""
    mounts: list[Path] = []

    def mount(size: str) -> Path:
        if os.geteuid() != 0:
            _unavailable("mounting a tmpfs (needs root)")
        path = tmp_path / f"tmpfs{len(mounts)}"
        path.mkdir()
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
            check=False,
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            _unavailable(f"mounting a tmpfs ({done.stderr.strip()})")
        mounts.append(path)
        return path

    yield mount
    for path in reversed(mounts):
        if subprocess.run(["umount", str(path)], check=False, capture_output=True).returncode:
            subprocess.run(["umount", "-l", str(path)], check=False, capture_output=True)
