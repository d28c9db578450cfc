"""The dashboard in a real browser: headless Chromium renders it, and the screenshot shows rows.

Needs Debian's ``chromium`` (``/usr/bin/chromium``). Without it the test skips, except under
CI (``CI=true``) where a missing browser is a failure.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import struct
import subprocess
import tempfile
import threading
import zlib
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from starlette.requests import Request

from steeple.admin import create_admin_app
from steeple.core import MissedRunPolicy, RecurringConfig, RecurringDefinition, ScheduledMessage
from steeple.testing import FakeClock, InMemoryRecurringStore

IN_CI = os.environ.get("CI", "").lower() in {"1", "true", "yes"}
OCCURRENCES = 7
# The stylesheet's row border colour (--line: #d0d5dd): one horizontal line per table row.
BORDER = (0xD0, 0xD5, 0xDD)
HEADER = (0x1D, 0x23, 0x30)


def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    if IN_CI:
        pytest.fail("chromium is not installed, and under CI=true that is a failure")
    pytest.skip("chromium is not installed (apt-get install chromium)")


def decode_png(data: bytes) -> tuple[int, int, list[bytes], int]:
    """Decode an 8-bit, non-interlaced RGB/RGBA PNG: (width, height, rows, bytes per pixel)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat = 8, b""
    width = height = bpp = 0
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos : pos + 8])
        body = data[pos + 8 : pos + 8 + length]
        if kind == b"IHDR":
            width, height, depth, color, _, _, interlace = struct.unpack(">IIBBBBB", body)
            assert depth == 8
            assert interlace == 0
            assert color in (2, 6)
            bpp = 3 if color == 2 else 4
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    raw = zlib.decompress(idat)
    stride = width * bpp
    rows: list[bytes] = []
    previous = bytearray(stride)
    for y in range(height):
        start = y * (stride + 1)
        kind = raw[start]
        line = bytearray(raw[start + 1 : start + 1 + stride])
        for i in range(stride):
            left = line[i - bpp] if i >= bpp else 0
            up = previous[i]
            corner = previous[i - bpp] if i >= bpp else 0
            if kind == 1:
                line[i] = (line[i] + left) & 0xFF
            elif kind == 2:
                line[i] = (line[i] + up) & 0xFF
            elif kind == 3:
                line[i] = (line[i] + (left + up) // 2) & 0xFF
            elif kind == 4:
                p = left + up - corner
                pa, pb, pc = abs(p - left), abs(p - up), abs(p - corner)
                pred = left if pa <= pb and pa <= pc else up if pb <= pc else corner
                line[i] = (line[i] + pred) & 0xFF
        rows.append(bytes(line))
        previous = line
    return width, height, rows, bpp


def _pixel(row: bytes, x: int, bpp: int) -> tuple[int, int, int]:
    return row[x * bpp], row[x * bpp + 1], row[x * bpp + 2]


def _close(a: tuple[int, int, int], b: tuple[int, int, int], tolerance: int = 6) -> bool:
    return all(abs(p - q) <= tolerance for p, q in zip(a, b, strict=True))


@pytest.fixture
def served() -> Iterator[str]:
    """The dashboard served by uvicorn on a free local port, from an in-memory store."""
    import uvicorn

    clock = FakeClock(datetime(2026, 3, 1, 12, 0, tzinfo=UTC))
    store = InMemoryRecurringStore(RecurringConfig("shop", 10, 1000), clock)

    async def seed() -> None:
        for name in ("invoices", "digest"):
            await store.create(
                RecurringDefinition(
                    name,
                    "* * * * *",
                    clock.now() - timedelta(minutes=OCCURRENCES // 2 + 1),
                    MissedRunPolicy.CATCH_UP,
                    ScheduledMessage("billing", "Run", b"{}"),
                )
            )
        await store.tick(OCCURRENCES)

    asyncio.run(seed())

    async def stores(namespace: str) -> Any:
        return store

    async def allow(request: Request, action: str, namespace: str) -> bool:
        # the stylesheet belongs to no namespace: it is asked for as ("static.read", "")
        return namespace == "shop" or (action, namespace) == ("static.read", "")

    app = create_admin_app(authorize=allow, stores=stores)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    for _ in range(100):
        if server.started:
            break
        threading.Event().wait(0.05)
    try:
        yield f"http://127.0.0.1:{port}/ui/shop"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def test_dashboard_screenshot_shows_the_rows(served: str) -> None:
    browser = _chromium()
    common = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--hide-scrollbars",
        "--no-first-run",
        "--disable-dev-shm-usage",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        profile = ["--user-data-dir=" + tmp]
        dom = subprocess.run(
            [browser, *common, *profile, "--dump-dom", served],
            capture_output=True,
            text=True,
            timeout=90,
            check=False,
        )
        assert dom.returncode == 0, dom.stderr[-2000:]
        assert dom.stdout.count('class="row schedule"') == 2
        assert dom.stdout.count('class="row occurrence"') == OCCURRENCES
        shot = Path(tmp) / "dashboard.png"
        result = subprocess.run(
            [browser, *common, *profile, "--window-size=1200,900", f"--screenshot={shot}", served],
            capture_output=True,
            text=True,
            timeout=90,
            check=False,
        )
        assert result.returncode == 0, result.stderr[-2000:]
        width, height, rows, bpp = decode_png(shot.read_bytes())
    assert (width, height) == (1200, 900)
    # The stylesheet was applied (it is served by the app, not inline): the dark header band.
    assert _close(_pixel(rows[5], 5, bpp), HEADER)
    # Every rendered table row ends in a 1 px border line across the table, and each table
    # has a top border: count the lines that have the border colour at three points across
    # the table (anti-aliased text can match the colour at one point, not along a line).
    # Two tables: header + 2 schedule rows, header + 7 occurrence rows.
    xs = (60, width // 2, width - 60)
    lines = 0
    inside = False
    for row in rows:
        hit = all(_close(_pixel(row, x, bpp), BORDER) for x in xs)
        if hit and not inside:
            lines += 1
        inside = hit
    assert lines == 2 + (1 + 2) + (1 + OCCURRENCES), lines
