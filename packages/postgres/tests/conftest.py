"""Fixtures for the PostgreSQL package's tests."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

# The tests import the helper module beside them (queue_support.py); with
# --import-mode=importlib the test directory is not on sys.path by itself.
_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

from queue_support import QueueFixture, installed_queue  # noqa: E402


@pytest.fixture
async def queue(pg_schema: tuple[str, str]) -> AsyncIterator[QueueFixture]:
    """``(dsn, schema, conn)``: a fresh schema with the queue installed and a connection to it."""
    dsn, schema = pg_schema
    async with installed_queue(dsn, schema) as conn:
        yield dsn, schema, conn


from pg_cluster import pg_clusters  # noqa: E402, F401 - a shared fixture
