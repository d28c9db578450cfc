"""Fixtures for the cross-package fault tests: a fault-injecting proxy and server probes.

``faultproxy`` sits next to this file; test directories have no ``__init__.py`` and run
with ``--import-mode=importlib``, so this directory is put on ``sys.path`` for the tests
to ``import faultproxy`` (and ``faultprobe``, ``recurring_fault_support``) directly.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

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


# --- recurring stores under the shared operation tests ------------------------------------

from recurring_stores import STORE_KINDS, OpenableStore, OpenStore, StoreKind  # noqa: E402


@pytest.fixture(params=[pytest.param(k, marks=k.marks, id=k.name) for k in STORE_KINDS])
def store_kind(request: pytest.FixtureRequest) -> OpenableStore:
    """Each recurring store in turn (in memory, PostgreSQL, and whatever is added)."""
    kind: StoreKind = request.param
    return OpenableStore(kind, {name: request.getfixturevalue(name) for name in kind.needs})


@pytest.fixture
async def open_store(store_kind: OpenableStore) -> AsyncIterator[OpenStore]:
    """Open stores of the kind under test; each is closed after the test."""
    opened: list[Any] = []

    async def open_(cfg: Any, at: Any, *, random: Any = None) -> Any:
        store = await store_kind.kind.open(store_kind.fixtures, cfg, at, random)
        opened.append(store)
        return store

    yield open_
    for store in opened:
        await store.close()
