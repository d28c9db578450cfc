"""Plumbing the adapters' conformance harnesses share (the checks are the test kit's).

Every adapter's test module builds a harness (``steeple.testing.conformance.brokers.
BrokerHarness``) and runs every check of ``BROKER_CHECKS`` against it, parametrized.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any, Self, TypeVar

import asyncpg

from steeple.brokers import Delivery
from steeple.brokers.queue import decode_task_args
from steeple.core.messages import BrokerReceipt, ScheduledMessage
from steeple.postgres.queue import cancel
from steeple.testing.conformance.brokers import BROKER_CHECKS, publish_retrying
from steeple.testing.conformance.brokers import conformance_message as message
from steeple.testing.conformance.brokers import fresh_key as new_key
from steeple.testing.proxy import TcpProxy, running_proxy


def lose_next_ack(broker: Any) -> None:
    """Let the next transmission reach the broker, then lose its reply (adapter boundary)."""
    original = broker._transmit

    async def transmit_then_lose(*args: Any, **kwargs: Any) -> BrokerReceipt:
        broker._transmit = original
        await original(*args, **kwargs)
        raise TimeoutError("reply lost (injected after the broker accepted)")

    broker._transmit = transmit_then_lose


# --- pieces the adapters' harnesses share ------------------------------------------------


async def drain_deliveries(
    fetch: Callable[[], Awaitable[list[Delivery]]],
    acknowledge: Callable[[Delivery], Awaitable[bool]],
) -> list[tuple[str, ScheduledMessage]]:
    """Fetch until nothing comes, acknowledging each delivery; ``(key, message)`` in order."""
    out: list[tuple[str, ScheduledMessage]] = []
    while batch := await fetch():
        for d in batch:
            out.append((d.idempotency_key, d.message))
            assert await acknowledge(d)
    return out


async def take_pending_tasks(dsn: str, schema: str) -> list[tuple[str, ScheduledMessage]]:
    """A SQL consumer of the work queue: read pending tasks in order, then finish them.

    ``cancel`` is the public way to end a task without a worker.
    """
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch(
            f'SELECT id, args::text AS args FROM "{schema}".tasks'
            " WHERE state = 'pending' ORDER BY id"
        )
        out = []
        for row in rows:
            out.append(decode_task_args(json.loads(row["args"])))
            await cancel(conn, row["id"], schema=schema)
        return out
    finally:
        await conn.close()


_BrokerT = TypeVar("_BrokerT")


async def start_kept(brokers: list[Any], broker: _BrokerT) -> _BrokerT:
    """Keep ``broker`` in ``brokers`` (closed at teardown), then start it."""
    brokers.append(broker)
    await broker.start()  # type: ignore[attr-defined]
    return broker


class ProxiedHarness:
    """The parts of a :class:`Harness` whose broker is reached through a :class:`TcpProxy`.

    Subclasses append every broker they make to ``brokers``; :meth:`close` closes them.
    """

    def __init__(self, proxy: TcpProxy) -> None:
        self.proxy = proxy
        self.brokers: list[Any] = []

    def too_large(self) -> ScheduledMessage:
        return message(0, size=8000)

    def lose_next_acknowledgement(self, broker: Any) -> None:
        lose_next_ack(broker)

    async def stall(self) -> None:
        self.proxy.stall()

    async def heal(self) -> None:
        self.proxy.heal()

    async def restart(self, broker: Any) -> Any:
        self.proxy.reset_all()  # a shared server must not be restarted
        return broker

    async def close(self) -> None:
        for b in self.brokers:
            await b.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


async def eventually(fn: Callable[[], Awaitable[bool]], *, within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while True:
        if await fn():
            return
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.1)


__all__ = [
    "BROKER_CHECKS",
    "ProxiedHarness",
    "TcpProxy",
    "drain_deliveries",
    "eventually",
    "lose_next_ack",
    "message",
    "new_key",
    "publish_retrying",
    "running_proxy",
    "start_kept",
    "take_pending_tasks",
]
