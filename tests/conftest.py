"""Fixtures for the cross-package fault tests: a fault-injecting proxy and server probes.

``faultproxy`` sits next to this file; test directories have no ``__init__.py`` and run
with ``--import-mode=importlib``, so this directory is put on ``sys.path`` for the tests
to ``import faultproxy`` (and ``faultprobe``, ``recurring_fault_support``) directly.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
# The queue's test helpers (``queue_support``) serve the queue fault tests here as well.
_QUEUE_TESTS = str(Path(__file__).resolve().parent.parent / "packages" / "postgres" / "tests")
if _QUEUE_TESTS not in sys.path:
    sys.path.append(_QUEUE_TESTS)

from faultproxy import FaultProxy  # noqa: E402
from pg_cluster import pg_clusters  # noqa: E402, F401 - a shared fixture


@pytest.fixture
async def fault_proxy(pg_dsn: str) -> AsyncIterator[FaultProxy]:
    """A running :class:`FaultProxy` to the test server, stopped (connections reset) after."""
    proxy = FaultProxy.for_dsn(pg_dsn)
    await proxy.start()
    try:
        yield proxy
    finally:
        await proxy.stop()
