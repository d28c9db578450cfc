"""A TCP proxy that injects real network faults between a client and its server.

Point an adapter at ``proxy.url(...)`` instead of the server, then freeze the network
(:meth:`TcpProxy.stall`), lose the server's replies (:meth:`TcpProxy.drop_replies`) or
cut every connection as a server restart would (:meth:`TcpProxy.reset_all`)::

    async with running_proxy("127.0.0.1", 9092) as proxy:
        broker = MyKafkaBroker(f"127.0.0.1:{proxy.port}")
        proxy.stall()

The broker conformance harnesses of :mod:`steeple.testing.conformance.brokers` use it to
make a real server stop answering.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

__all__ = ["Connector", "TcpProxy", "running_proxy"]

Connector = Callable[[], Awaitable[tuple[asyncio.StreamReader, asyncio.StreamWriter]]]
"""Opens the upstream connection (instead of a TCP connection to ``host:port``)."""


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
        """Listen on a free port of 127.0.0.1 and return it (also in :attr:`port`)."""
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    def url(self, scheme: str, userinfo: str = "", path: str = "") -> str:
        """Return the proxy's address as ``scheme://userinfo127.0.0.1:port/path``."""
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
        """Stop stalling, and cut the connections that were frozen."""
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
        """Cut every connection and stop listening."""
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


@contextlib.asynccontextmanager
async def running_proxy(
    host: str, port: int, *, connect: Connector | None = None
) -> AsyncIterator[TcpProxy]:
    """Yield a started :class:`TcpProxy` to ``host:port`` (or through ``connect``); close it."""
    proxy = TcpProxy(host, port, connect=connect)
    await proxy.start()
    try:
        yield proxy
    finally:
        await proxy.close()
