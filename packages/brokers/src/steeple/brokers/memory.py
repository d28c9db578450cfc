"""The in-memory broker, re-exported from ``steeple.testing`` (install ``steeple-testing``).

It keeps every accepted ``(message, idempotency_key)`` in ``published``, deduplicates by key
for the life of the object and injects faults on demand. For tests and simulations only:
nothing survives the process.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from steeple.testing.broker import MemoryBroker

__all__ = ["MemoryBroker"]


def __getattr__(name: str) -> Any:
    if name != "MemoryBroker":
        raise AttributeError(f"module 'steeple.brokers.memory' has no attribute {name!r}")
    try:
        module = importlib.import_module("steeple.testing.broker")
    except ImportError as exc:
        raise ImportError(
            "steeple.brokers.memory re-exports steeple.testing.MemoryBroker: install "
            "steeple-testing"
        ) from exc
    return module.MemoryBroker
