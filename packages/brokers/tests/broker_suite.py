"""A broker conformance suite every adapter runs against its real server, and a TCP proxy.

steeple.testing.conformance.brokers was not available when these adapters were written,
so the generic suite lives here. An adapter's test module builds a ``Harness`` and runs
every check in ``CHECKS`` against it (parametrized).

What the suite asserts (the relay's promise, seed 000):
- a publication is delivered once, with its idempotency key and exact content;
- a replay under the same key delivers one copy (``receipt.duplicate`` where the broker
  deduplicates; the documented consumer-side dedup otherwise);
- an acknowledgement lost after the broker accepted surfaces as
  ``RelayAcknowledgementError`` carrying the receipt (or ``BrokerTimeoutError`` where the
  adapter cannot look the key up), and the republication delivers no second copy;
- an unresponsive broker gives ``BrokerTimeoutError`` within the deadline;
- an oversized message is a permanent ``MessageTooLargeError``;
- after a server restart (or every connection dropped) the adapter reconnects.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol, Self, TypeVar

import asyncpg

from steeple.brokers import Delivery
from steeple.brokers.queue import decode_task_args
from steeple.core.errors import (
    BrokerError,
    BrokerTimeoutError,
    BrokerUnavailableError,
    ConfigurationError,
    MessageTooLargeError,
    RelayAcknowledgementError,
)
from steeple.core.messages import BrokerReceipt, ScheduledMessage
from steeple.core.ports import MessageBroker
from steeple.postgres.queue import cancel


class Harness(Protocol):
    """What an adapter's tests provide to the suite."""

    name: str
    """The receipt's ``broker`` field."""
    broker_dedups: bool
    """True when the broker itself refuses a second copy (receipt.duplicate on replay)."""
    can_probe: bool
    """True when a lost acknowledgement is recognised (RelayAcknowledgementError)."""

    async def make_broker(self) -> Any:
        """A started broker; the harness closes it at teardown."""

    async def drain(self) -> list[tuple[str, ScheduledMessage]]:
        """Consume and acknowledge everything available, applying any consumer-side dedup."""

    def too_large(self) -> ScheduledMessage:
        """A message over the broker's limit."""

    async def stall(self) -> None:
        """Make the broker stop answering (held connections, nothing forwarded)."""

    async def heal(self) -> None:
        """Undo :meth:`stall`."""

    async def restart(self, broker: Any) -> Any:
        """Restart the server (or drop every connection as a restart would).

        Returns the broker to go on with: the same one, or (for an embedded broker whose
        "server" is the process) a new one over the same storage.
        """

    def secrets_in_config(self) -> list[str]:
        """Strings (passwords, full URLs) that must never appear in the broker's repr."""


def message(i: int = 0, size: int = 32) -> ScheduledMessage:
    body = (f"payload-{i}-".encode() * (size // 8 + 1))[:size]
    return ScheduledMessage(
        "reminders", "reminder.requested", body, {"tenant": "t1", "seq": str(i)}
    )


def new_key() -> str:
    return "stp1-" + uuid.uuid4().hex + uuid.uuid4().hex[:16]


def lose_next_ack(broker: Any) -> None:
    """Let the next transmission reach the broker, then lose its reply (adapter boundary)."""
    original = broker._transmit

    async def transmit_then_lose(*args: Any, **kwargs: Any) -> BrokerReceipt:
        broker._transmit = original
        await original(*args, **kwargs)
        raise TimeoutError("reply lost (injected after the broker accepted)")

    broker._transmit = transmit_then_lose


async def publish_retrying(
    broker: MessageBroker, msg: ScheduledMessage, key: str, *, attempts: int = 20
) -> BrokerReceipt:
    """What a relay does: republish the same message under the same key until accepted."""
    last: BaseException | None = None
    for _ in range(attempts):
        try:
            return await broker.publish(msg, idempotency_key=key, timeout=3.0)
        except RelayAcknowledgementError as exc:
            return exc.receipt
        except (BrokerTimeoutError, BrokerUnavailableError) as exc:
            last = exc
            await asyncio.sleep(0.25)
    raise AssertionError(f"never accepted after {attempts} attempts: {last!r}")


async def check_publish_and_consume(h: Harness) -> None:
    broker = await h.make_broker()
    keys = [new_key() for _ in range(3)]
    for i, key in enumerate(keys):
        receipt = await broker.publish(message(i), idempotency_key=key, timeout=5.0)
        assert receipt.broker == h.name
        assert receipt.idempotency_key == key
        assert receipt.duplicate is False
    got = await h.drain()
    assert [k for k, _ in got] == keys
    assert [m for _, m in got] == [message(i) for i in range(3)]
    assert dict(got[0][1].headers) == {"tenant": "t1", "seq": "0"}
    assert await h.drain() == []


async def check_replay_same_key(h: Harness) -> None:
    broker = await h.make_broker()
    key = new_key()
    first = await broker.publish(message(1), idempotency_key=key, timeout=5.0)
    second = await broker.publish(message(1), idempotency_key=key, timeout=5.0)
    assert first.duplicate is False
    assert second.duplicate is h.broker_dedups
    assert second.idempotency_key == key
    got = await h.drain()
    assert got == [(key, message(1))]


async def check_lost_ack(h: Harness) -> None:
    broker = await h.make_broker()
    key = new_key()
    lose_next_ack(broker)
    expected: type[BaseException] = RelayAcknowledgementError if h.can_probe else BrokerTimeoutError
    caught: BaseException | None = None
    try:
        await broker.publish(message(2), idempotency_key=key, timeout=3.0)
    except expected as exc:
        caught = exc
    if caught is None:
        raise AssertionError("a lost acknowledgement was reported as a success")
    if isinstance(caught, RelayAcknowledgementError):
        assert caught.receipt.idempotency_key == key
        assert caught.receipt.broker == h.name
    again = await broker.publish(message(2), idempotency_key=key, timeout=5.0)
    assert again.duplicate is h.broker_dedups
    assert await h.drain() == [(key, message(2))]


async def check_timeout(h: Harness) -> None:
    broker = await h.make_broker()
    warm = new_key()
    await broker.publish(message(3), idempotency_key=warm, timeout=5.0)
    await h.stall()
    key = new_key()
    started = time.monotonic()
    try:
        await broker.publish(message(4), idempotency_key=key, timeout=0.8)
    except (BrokerTimeoutError, RelayAcknowledgementError):
        pass
    else:
        raise AssertionError("a stalled broker did not time out")
    finally:
        await h.heal()
    assert time.monotonic() - started < 0.8 + 1.0  # slack for a loaded machine
    await publish_retrying(broker, message(4), key)
    got = await h.drain()
    assert got == [(warm, message(3)), (key, message(4))]


async def check_too_large(h: Harness) -> None:
    broker = await h.make_broker()
    too_large: MessageTooLargeError | None = None
    try:
        await broker.publish(h.too_large(), idempotency_key=new_key(), timeout=5.0)
    except MessageTooLargeError as exc:
        too_large = exc
    if too_large is None:
        raise AssertionError("an oversized message was accepted")
    assert too_large.permanent is True
    assert await h.drain() == []


async def check_reconnect_after_restart(h: Harness) -> None:
    broker = await h.make_broker()
    before, after = new_key(), new_key()
    await broker.publish(message(5), idempotency_key=before, timeout=5.0)
    broker = await h.restart(broker)
    await publish_retrying(broker, message(6), after)
    # The same key again after the restart: still one copy.
    again = await publish_retrying(broker, message(6), after)
    assert again.duplicate is h.broker_dedups
    assert await h.drain() == [(before, message(5)), (after, message(6))]


async def check_bad_arguments(h: Harness) -> None:
    broker = await h.make_broker()
    for timeout in (0, -1.0, math.nan, math.inf):
        try:
            await broker.publish(message(), idempotency_key=new_key(), timeout=timeout)
        except ConfigurationError:
            pass
        else:
            raise AssertionError(f"timeout {timeout!r} was accepted")
    for key in ("", "has space", "x" * 201, "caf\u00e9"):
        try:
            await broker.publish(message(), idempotency_key=key, timeout=1.0)
        except ConfigurationError:
            pass
        else:
            raise AssertionError(f"idempotency key {key!r} was accepted")
    text = repr(broker)
    for secret in h.secrets_in_config():
        assert secret not in text, f"{secret!r} leaked into the repr {text!r}"
    assert await h.drain() == []


async def check_exported_suite(h: Harness) -> None:
    """steeple.testing's broker suite (written in parallel to this one), run as well."""
    from steeple.testing.conformance.brokers import BrokerConformance
    from steeple.testing.conformance.brokers import check_timeout as exported_timeout

    broker = await h.make_broker()
    seen: list[tuple[bytes, str]] = []

    async def read_all() -> list[tuple[bytes, str]]:
        seen.extend((m.payload, k) for k, m in await h.drain())
        return list(seen)

    suite = BrokerConformance(broker, read_all, reports_duplicates=h.broker_dedups)
    await suite.run_basic()
    await suite.check_too_large(size=8000)
    await h.stall()
    try:
        await exported_timeout(broker, timeout=0.5, grace=1.0)
    finally:
        await h.heal()


CHECKS: dict[str, Callable[[Harness], Awaitable[None]]] = {
    "exported_suite": check_exported_suite,
    "publish_and_consume": check_publish_and_consume,
    "replay_same_key": check_replay_same_key,
    "lost_ack": check_lost_ack,
    "timeout": check_timeout,
    "too_large": check_too_large,
    "reconnect_after_restart": check_reconnect_after_restart,
    "bad_arguments": check_bad_arguments,
}


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


@contextlib.asynccontextmanager
async def running_proxy(
    host: str, port: int, *, connect: Connector | None = None
) -> AsyncIterator[TcpProxy]:
    """A started :class:`TcpProxy` to ``host:port`` (or through ``connect``), closed on exit."""
    proxy = TcpProxy(host, port, connect=connect)
    await proxy.start()
    try:
        yield proxy
    finally:
        await proxy.close()


# --- a TCP proxy for real network faults --------------------------------------------------


Connector = Callable[[], Awaitable[tuple[asyncio.StreamReader, asyncio.StreamWriter]]]


class TcpProxy:
    """Forwards 127.0.0.1:port to a target; can stall, drop replies or cut connections.

    ``connect`` opens the upstream connection instead of a TCP connection to ``host:port``
    (say, a PostgreSQL server's Unix socket).
    """

    def __init__(self, host: str, port: int, *, connect: Connector | None = None) -> None:
        self.target = (host, port)
        self._connect = connect
        self.port = 0
        self._server: asyncio.Server | None = None
        self._links: set[_Link] = set()
        self.stalled = False
        self._tasks: set[asyncio.Task[None]] = set()
        self.peak = 0
        """Most connections open through the proxy at once, so far."""
        self.accepted = 0
        """Connections accepted through the proxy, so far (reuse keeps it low)."""
        self.held = 0
        """Chunks read while stalled (held back, then dropped by :meth:`heal`)."""

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    def url(self, scheme: str, userinfo: str = "", path: str = "") -> str:
        return f"{scheme}://{userinfo}127.0.0.1:{self.port}{path}"

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            if self._connect is not None:
                up_reader, up_writer = await self._connect()
            else:
                up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        link = _Link(self, writer, up_writer)
        self.accepted += 1
        self._links.add(link)
        self.peak = max(self.peak, len(self._links))
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(link.pump(reader, up_writer, upstream=True))
                tg.create_task(link.pump(up_reader, writer, upstream=False))
        except* (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            self._links.discard(link)
            link.close()

    @property
    def connections(self) -> int:
        """Connections open through the proxy now."""
        return len(self._links)

    def stall(self) -> None:
        """Hold every byte in both directions (a frozen network), new connections too."""
        self.stalled = True

    def heal(self) -> None:
        self.stalled = False
        for link in list(self._links):
            # Bytes held during a stall belong to requests whose callers have given up;
            # a real frozen connection is unusable afterwards, so cut it.
            link.close()

    def drop_replies(self) -> None:
        """From now on, discard what the server sends on the existing connections."""
        for link in self._links:
            link.drop_replies = True

    def reset_all(self) -> None:
        """Cut every current connection, as a server restart would."""
        for link in list(self._links):
            link.close()

    async def close(self) -> None:
        self.reset_all()
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2)


class _Link:
    def __init__(
        self, proxy: TcpProxy, client: asyncio.StreamWriter, upstream: asyncio.StreamWriter
    ) -> None:
        self.proxy = proxy
        self.client = client
        self.upstream = upstream
        self.drop_replies = False
        self.closed = False

    def is_closed(self) -> bool:
        """Whether the link was closed (read afresh after every await: another task may)."""
        return self.closed

    async def pump(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, upstream: bool
    ) -> None:
        while not self.closed:
            data = await reader.read(65536)
            if not data:
                break
            if self.proxy.stalled:
                self.proxy.held += 1
            while self.proxy.stalled and not self.is_closed():  # noqa: ASYNC110 - a test proxy
                await asyncio.sleep(0.02)
            if self.is_closed():
                break
            if not upstream and self.drop_replies:
                continue
            writer.write(data)
            await writer.drain()
        self.close()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for w in (self.client, self.upstream):
            with contextlib.suppress(Exception):
                w.close()


async def eventually(fn: Callable[[], Awaitable[bool]], *, within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while True:
        if await fn():
            return
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.1)


__all__ = [
    "CHECKS",
    "BrokerError",
    "Harness",
    "TcpProxy",
    "eventually",
    "lose_next_ack",
    "message",
    "new_key",
    "publish_retrying",
]
