"""steeple-brokers: implementations of the core's ``MessageBroker`` port.

Importing this package loads no client library. Each backend is its own module behind an
extra, and the names below are resolved lazily, on first use:

=====================================  ==========================  =========================
name                                   module                      extra
=====================================  ==========================  =========================
``SqliteJournalBroker``                ``steeple.brokers.sqlite``  ``steeple-brokers[sqlite]``
``JetStreamBroker``, ``JetStreamConsumer``  ``steeple.brokers.nats``  ``[nats]``
``RedisStreamBroker``, ``RedisStreamConsumer``  ``steeple.brokers.redis``  ``[redis]``
``RabbitMQBroker``, ``RabbitMQConsumer``, ``DedupingConsumer``  ``steeple.brokers.rabbitmq``
                                                                   ``[rabbitmq]``
``WorkQueueBroker``                    ``steeple.brokers.queue``   ``[queue]``
``MemoryBroker``, ``BrokerFault``     ``steeple.brokers.memory``  (none)
=====================================  ==========================  =========================
"""

from __future__ import annotations

import importlib as _importlib
from typing import TYPE_CHECKING, Any

from steeple.brokers._common import Delivery

if TYPE_CHECKING:
    from steeple.brokers.memory import BrokerFault, MemoryBroker
    from steeple.brokers.nats import JetStreamBroker, JetStreamConsumer
    from steeple.brokers.queue import WorkQueueBroker
    from steeple.brokers.rabbitmq import DedupingConsumer, RabbitMQBroker, RabbitMQConsumer
    from steeple.brokers.redis import RedisStreamBroker, RedisStreamConsumer
    from steeple.brokers.sqlite import SqliteJournalBroker

__all__ = [
    "BrokerFault",
    "DedupingConsumer",
    "Delivery",
    "JetStreamBroker",
    "JetStreamConsumer",
    "MemoryBroker",
    "RabbitMQBroker",
    "RabbitMQConsumer",
    "RedisStreamBroker",
    "RedisStreamConsumer",
    "SqliteJournalBroker",
    "WorkQueueBroker",
]

_LAZY = {
    "SqliteJournalBroker": "steeple.brokers.sqlite",
    "JetStreamBroker": "steeple.brokers.nats",
    "JetStreamConsumer": "steeple.brokers.nats",
    "RedisStreamBroker": "steeple.brokers.redis",
    "RedisStreamConsumer": "steeple.brokers.redis",
    "RabbitMQBroker": "steeple.brokers.rabbitmq",
    "RabbitMQConsumer": "steeple.brokers.rabbitmq",
    "DedupingConsumer": "steeple.brokers.rabbitmq",
    "WorkQueueBroker": "steeple.brokers.queue",
    "MemoryBroker": "steeple.brokers.memory",
    "BrokerFault": "steeple.brokers.memory",
}


# What each backend module needs beyond steeple-brokers itself, and the extra that brings it.
_EXTRAS: dict[str, tuple[tuple[str, ...], str]] = {
    "steeple.brokers.nats": (("nats",), "steeple-brokers[nats]"),
    "steeple.brokers.redis": (("redis",), "steeple-brokers[redis]"),
    "steeple.brokers.rabbitmq": (("aio_pika", "aiormq"), "steeple-brokers[rabbitmq]"),
    "steeple.brokers.queue": (("asyncpg", "steeple.postgres"), "steeple-brokers[queue]"),
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'steeple.brokers' has no attribute {name!r}")
    try:
        return getattr(_importlib.import_module(module), name)
    except ModuleNotFoundError as exc:
        needed, extra = _EXTRAS.get(module, ((), ""))
        missing = exc.name or ""
        if not any(missing == top or missing.startswith(f"{top}.") for top in needed):
            raise
        raise ImportError(
            f"steeple.brokers.{name} needs the optional package {missing!r}: install {extra}",
            name=missing,
        ) from exc


def __dir__() -> list[str]:
    return sorted(__all__)
