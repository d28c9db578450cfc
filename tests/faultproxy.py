"""A small asyncio TCP proxy that injects network faults between a client and PostgreSQL.

There is no netem on the test machines, so connection faults are made here: every client
connection accepted on ``127.0.0.1:<ephemeral>`` is relayed to the upstream server, and
the proxy's mode can be switched at any time:

- ``pass_through()``: forward everything (also resumes blackholed connections);
- ``delay(seconds)``: every chunk, both ways, is delivered ``seconds`` late (one-way
  latency, so a round trip takes ``2 * seconds`` more; chunks stay ordered and pipelined);
- ``delay_close(seconds)``: an end of stream (FIN) arrives ``seconds`` after the data
  before it (a terminated backend's last message, then a while later the close);
- ``blackhole()``: stop forwarding both ways, keep every socket open (new connections
  are accepted and then hang too); data waits in the kernel's buffers until the mode
  changes, so the protocol is intact if the connection survives;
- ``blackhole_after(trigger, at_reply=False)``: forward the client's chunk holding
  ``trigger`` (say a statement's text), then blackhole (or, ``at_reply``, blackhole
  when the server next goes idle inside the transaction, holding that answer);
- ``cut_reply_after(trigger)``: one shot: the connection that executes a statement
  holding ``trigger`` is cut at the server's answer to it, which is dropped (an
  ambiguous autocommit);
- ``refuse()``: the server is down: every current connection is aborted and each new
  one is reset (TCP RST) as soon as it is accepted, counted in ``refused``, until
  ``pass_through()``;
- ``reset()``: abort every current connection with a TCP RST on both sides;
- ``cut_before(trigger)``: one shot: the client chunk holding ``trigger`` (say a
  statement's text) is dropped and its connection reset: the server never sees it;
- ``cut_after(n)``: one shot: after ``n`` more bytes are forwarded (either way), abort
  that connection;
- ``cut_at_client_chunk(n)``: one shot: drop the ``n``-th client chunk from now and
  reset its connection (``n=2``: past a transaction's BEGIN, at its first statement);
- ``cut_after_commit(count=1, skip=0)``: one shot: when a client sends a ``COMMIT``
  (simple Query or Parse message), forward it, close the server side gracefully (so the
  server does read and run it) and abort the client side before any reply can reach
  it: an ambiguous commit whose transaction did commit;
- ``cut_before_commit(count=1, skip=0)``: the same, but the COMMIT itself is dropped
  (the server rolls back): the other outcome of an ambiguous commit.

The proxy records the pid of every backend that served a connection through it (from
the server's BackendKeyData message): tests find exactly those sessions in
``pg_stat_activity`` / ``pg_locks``, without touching other sessions on a shared server.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
import struct
import time
from collections.abc import AsyncIterator
from urllib.parse import parse_qs, unquote, urlencode, urlsplit, urlunsplit

__all__ = ["FaultProxy", "dsn_via", "open_pg", "pg_endpoint", "running_proxy"]

_CHUNK = 65536
_SSL_REQUEST = 80877103
_GSSENC_REQUEST = 80877104
_CANCEL_REQUEST = 80877102
# ReadyForQuery (any status), and with status 'T': idle inside a transaction block.
_READY = b"Z\x00\x00\x00\x05"
_READY_IN_TRANSACTION = _READY + b"T"
_COMMIT = re.compile(rb"\b(COMMIT|END)\b", re.IGNORECASE)


def pg_endpoint(dsn: str) -> tuple[str, int]:
    """The one server a libpq URL names: ``(host, port)``, the host maybe a socket directory.

    Never a guess: a URL that names no host (libpq would try its default socket, then
    localhost) or several hosts is refused, so a proxy cannot relay to a server the tests
    were not given.

    Raises:
        ValueError: not a ``postgresql://`` URL, or no host, or several hosts or ports.
    """
    parts = urlsplit(dsn)
    if parts.scheme not in {"postgresql", "postgres"}:
        raise ValueError("the fault proxy needs a postgresql:// URL")
    query = parse_qs(parts.query)
    netloc_host = parts.netloc.rpartition("@")[2]
    if netloc_host.startswith("["):  # an IPv6 literal
        netloc_host = netloc_host[1:].partition("]")[0]
    else:
        netloc_host = netloc_host.partition(":")[0]
    hosts = query.get("host") or query.get("hostaddr") or [unquote(netloc_host)]
    ports = query.get("port") or [str(parts.port or 5432)]
    if len(hosts) != 1 or len(ports) != 1 or "," in hosts[0] or "," in ports[0]:
        raise ValueError("the fault proxy relays to exactly one server: name one host and port")
    if not hosts[0]:
        raise ValueError("the DSN names no host: name the test server (a host or host=/socket/dir)")
    return hosts[0], int(ports[0])


async def open_pg(host: str, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Connect to a PostgreSQL server by TCP, or by its Unix socket when ``host`` is a path."""
    if host.startswith("/"):
        return await asyncio.open_unix_connection(f"{host}/.s.PGSQL.{port}")
    return await asyncio.open_connection(host, port)


def dsn_via(dsn: str, port: int) -> str:
    """``dsn`` (user, password, database and options kept) through ``127.0.0.1:port``."""
    parts = urlsplit(dsn)
    userinfo, at, _ = parts.netloc.rpartition("@")
    query = [
        (k, v)
        for k, values in parse_qs(parts.query, keep_blank_values=True).items()
        if k not in {"host", "hostaddr", "port"}
        for v in values
    ]
    return urlunsplit(
        parts._replace(netloc=f"{userinfo}{at}127.0.0.1:{port}", query=urlencode(query))
    )


def _abort(writer: asyncio.StreamWriter) -> None:
    """Close ``writer``'s socket with a TCP RST (SO_LINGER 0), dropping unsent data."""
    transport = writer.transport
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


class _CommitWatcher:
    """Splits the client's byte stream into PostgreSQL frontend messages, finds COMMIT.

    Returns the offset just past the first COMMIT message in each fed chunk, if any.
    """

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._startup = True  # untyped startup-phase messages come first
        self._consumed = 0  # stream offset of the start of _buffer
        self.single_byte_replies = 0  # SSL/GSS requests the server answers with one byte
        self.watch_text: bytes | None = None  # statements whose execution is watched
        self._watched: set[bytes] = set()  # their prepared-statement names
        self.watched_bound = False  # a Bind of a watched statement went by

    def feed(self, data: bytes) -> int | None:
        base = self._consumed + len(self._buffer)
        self._buffer += data
        found: int | None = None
        while True:
            if self._startup:
                if len(self._buffer) < 8:
                    break
                length, code = struct.unpack("!ii", self._buffer[:8])
                if len(self._buffer) < length:
                    break
                # After an SSL/GSS request (refused: the DSN says sslmode=disable) another
                # untyped startup message follows; after the startup message, typed ones.
                if code in (_SSL_REQUEST, _GSSENC_REQUEST):
                    self.single_byte_replies += 1
                else:
                    self._startup = code == _CANCEL_REQUEST
                self._drop(length)
                continue
            if len(self._buffer) < 5:
                break
            kind = bytes(self._buffer[0:1])
            (length,) = struct.unpack("!i", self._buffer[1:5])
            if len(self._buffer) < 1 + length:
                break
            body = bytes(self._buffer[5 : 1 + length])
            end = self._consumed + 1 + length
            self._drop(1 + length)
            if found is None and self._is_commit(kind, body):
                found = end - base
            self._watch(kind, body)
        return found

    def _drop(self, n: int) -> None:
        del self._buffer[:n]
        self._consumed += n

    def _watch(self, kind: bytes, body: bytes) -> None:
        if kind == b"P" and self.watch_text is not None:
            name, _, rest = body.partition(b"\x00")
            if self.watch_text in rest.split(b"\x00", 1)[0]:
                self._watched.add(name)
        elif kind == b"Q" and self.watch_text is not None and self.watch_text in body:
            self.watched_bound = True
        elif kind == b"B":
            statement = body.split(b"\x00", 2)[1]
            if statement in self._watched:
                self.watched_bound = True

    @staticmethod
    def _is_commit(kind: bytes, body: bytes) -> bool:
        if kind == b"Q":
            text = body.split(b"\x00", 1)[0]
        elif kind == b"P":
            parts = body.split(b"\x00", 2)
            text = parts[1] if len(parts) > 1 else b""
        else:
            return False
        stripped = text.strip().rstrip(b";").strip()
        return bool(_COMMIT.fullmatch(stripped))


class _BackendWatcher:
    """Reads the server's stream until BackendKeyData ('K'), which carries the backend pid."""

    def __init__(self, client: _CommitWatcher) -> None:
        self._client = client
        self._buffer = bytearray()
        self._replies_seen = 0
        self.pid: int | None = None

    def feed(self, data: bytes) -> int | None:
        if self.pid is not None:
            return None
        self._buffer += data
        while True:
            if self._replies_seen < self._client.single_byte_replies:
                if not self._buffer:
                    return None
                del self._buffer[:1]
                self._replies_seen += 1
                continue
            if len(self._buffer) < 5:
                return None
            kind = self._buffer[0:1]
            (length,) = struct.unpack("!i", self._buffer[1:5])
            if len(self._buffer) < 1 + length:
                return None
            if kind == b"K":
                (self.pid,) = struct.unpack("!i", self._buffer[5:9])
                self._buffer.clear()
                return self.pid
            del self._buffer[: 1 + length]


class _Link:
    """One relayed connection: the client's and the upstream's streams and two pumps."""

    def __init__(
        self,
        proxy: FaultProxy,
        client: tuple[asyncio.StreamReader, asyncio.StreamWriter],
        upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    ) -> None:
        self.proxy = proxy
        self.client_reader, self.client_writer = client
        self.up_reader, self.up_writer = upstream
        self.watcher = _CommitWatcher()
        self.backend = _BackendWatcher(self.watcher)
        self.closed = asyncio.Event()
        self.cut = False
        self.reply_cut_armed = False
        self.tasks: list[asyncio.Task[None]] = []

    def is_cut(self) -> bool:
        """Whether the link was cut (read afresh after every await)."""
        return self.cut

    def start(self) -> None:
        self.tasks = [
            asyncio.create_task(self._pump(self.client_reader, self.up_writer, upstream=True)),
            asyncio.create_task(self._pump(self.up_reader, self.client_writer, upstream=False)),
        ]

    async def _pump(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, upstream: bool
    ) -> None:
        proxy = self.proxy
        # Delivery (the writer side) is a separate task so a delay adds latency without
        # serializing chunks: each chunk is due `delay` after it was read.
        queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue()
        deliver = asyncio.create_task(self._deliver(queue, writer, upstream=upstream))
        try:
            while not self.cut:
                await proxy._flowing.wait()
                try:
                    data = await reader.read(_CHUNK)
                except (ConnectionError, OSError):
                    data = b""
                if self.is_cut():
                    break
                await proxy._flowing.wait()  # a chunk read just before a blackhole waits
                if not data:
                    queue.put_nowait(None)
                    break
                queue.put_nowait((time.monotonic() + proxy._delay, data))
            await deliver
        finally:
            deliver.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await deliver
            self.close()

    async def _deliver(
        self,
        queue: asyncio.Queue[tuple[float, bytes] | None],
        writer: asyncio.StreamWriter,
        *,
        upstream: bool,
    ) -> None:
        proxy = self.proxy
        while not self.cut:
            item = await queue.get()
            if item is None:
                if proxy._eof_delay:
                    # The peer's close travels slower than its last words.
                    proxy.eofs_held += 1
                    await asyncio.sleep(proxy._eof_delay)
                with contextlib.suppress(OSError, RuntimeError):
                    writer.write_eof()
                return
            due, data = item
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            await proxy._flowing.wait()
            if self.is_cut():
                return
            if not upstream and self.reply_cut_armed and _READY in data:
                # The statement ran (and, outside a transaction block, committed); its
                # answer never arrives.
                proxy.replies_cut += 1
                proxy._reply_trigger = None
                self.abort()
                return
            if not upstream and proxy._awaiting_ready and _READY_IN_TRANSACTION in data:
                # The server finished and went idle inside the transaction: hold its
                # answer and everything after it.
                proxy._awaiting_ready = False
                proxy._flowing.clear()
                await proxy._flowing.wait()
                if self.is_cut():
                    return
            if upstream and proxy._drop_trigger is not None and proxy._drop_trigger in data:
                proxy._drop_trigger = None
                proxy.cuts += 1
                self.abort()  # this chunk never reaches the server
                return
            if upstream and proxy._cut_chunk is not None:
                proxy._cut_chunk -= 1
                if proxy._cut_chunk <= 0:
                    proxy._cut_chunk = None
                    proxy.cuts += 1
                    self.abort()  # this chunk never reaches the server
                    return
            if upstream:
                self.watcher.watch_text = proxy._reply_trigger
            commit_end = self.watcher.feed(data) if upstream else None
            if upstream and self.watcher.watched_bound and proxy._reply_trigger is not None:
                self.watcher.watched_bound = False
                self.reply_cut_armed = True
            if not upstream and (pid := self.backend.feed(data)) is not None:
                proxy.backend_pids.add(pid)
            if commit_end is not None and proxy._cut_commits > 0:
                if proxy._skip_commits > 0:
                    proxy._skip_commits -= 1
                else:
                    proxy._cut_commits -= 1
                    self._cut_at_commit(data, commit_end)
                    return
            if proxy._cut_budget is not None:
                if len(data) >= proxy._cut_budget:
                    head = data[: proxy._cut_budget]
                    proxy._cut_budget = None
                    proxy.cuts += 1
                    with contextlib.suppress(OSError, RuntimeError):
                        writer.write(head)
                    self.abort()
                    return
                proxy._cut_budget -= len(data)
            try:
                writer.write(data)
                await writer.drain()
            except (ConnectionError, OSError, RuntimeError):
                return
            trigger = proxy._blackhole_trigger
            if upstream and trigger is not None and trigger in data:
                proxy._blackhole_trigger = None
                if proxy._blackhole_at_reply:
                    proxy._awaiting_ready = True
                else:
                    # Forwarded, and from now on nothing else is: the server runs this
                    # statement and its reply is held.
                    proxy._flowing.clear()

    def _cut_at_commit(self, data: bytes, commit_end: int) -> None:
        """Cut the link at the COMMIT ending at ``data[commit_end]``.

        With ``forward_commit`` the COMMIT (and what preceded it) reaches the server, which
        runs it; otherwise the server never sees it and rolls back. Either way no byte of
        the server's reply reaches the client.
        """
        self.cut = True
        self.proxy.commits_cut += 1
        _abort(self.client_writer)
        if self.proxy._forward_commit:
            with contextlib.suppress(OSError, RuntimeError):
                self.up_writer.write(data[:commit_end])
                # A graceful close (FIN) after the data: the server reads the COMMIT,
                # runs it, then finds the socket gone when it answers.
                self.up_writer.close()
        else:
            _abort(self.up_writer)
        self._finish()

    def abort(self) -> None:
        """Reset both sides now."""
        self.cut = True
        _abort(self.client_writer)
        _abort(self.up_writer)
        self._finish()

    def close(self) -> None:
        """Close both sides (after a normal end of either stream)."""
        for writer in (self.client_writer, self.up_writer):
            with contextlib.suppress(OSError, RuntimeError):
                writer.close()
        self._finish()

    def _finish(self) -> None:
        if not self.closed.is_set():
            self.closed.set()
            self.proxy._links.discard(self)
        for task in self.tasks:
            if task is not asyncio.current_task():
                task.cancel()


class FaultProxy:
    """A TCP proxy to ``upstream_host:upstream_port`` with runtime-switchable faults.

    Attributes:
        port: the local port it listens on (after :meth:`start`).
        accepted: connections accepted so far.
        commits_cut: COMMITs after which a connection was cut.
        cuts: connections cut by :meth:`cut_after`, :meth:`cut_at_client_chunk` or
            :meth:`cut_before`.
        replies_cut: connections cut by :meth:`cut_reply_after`.
        refused: connection attempts reset at once while :meth:`refuse` was on.
        eofs_held: ends of stream held back by :meth:`delay_close` (counted when the data
            before them has been delivered).
        backend_pids: pids of every PostgreSQL backend that served a connection through
            this proxy (read from BackendKeyData), kept after the connection ends.
    """

    def __init__(
        self,
        upstream_host: str,
        upstream_port: int,
        *,
        database: str = "postgres",
        user: str = "postgres",
    ) -> None:
        self.upstream_host = upstream_host
        self.upstream_port = upstream_port
        self.database = database
        self.user = user
        self.port = 0
        self.accepted = 0
        self.commits_cut = 0
        self.cuts = 0
        self.backend_pids: set[int] = set()
        self._server: asyncio.Server | None = None
        self._links: set[_Link] = set()
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._delay = 0.0
        self._eof_delay = 0.0
        self._cut_chunk: int | None = None
        self._cut_budget: int | None = None
        self._cut_commits = 0
        self._skip_commits = 0
        self._blackhole_trigger: bytes | None = None
        self._blackhole_at_reply = False
        self._awaiting_ready = False
        self._reply_trigger: bytes | None = None
        self.replies_cut = 0
        self.refused = 0
        self.eofs_held = 0
        self._refusing = False
        self._drop_trigger: bytes | None = None
        self._forward_commit = True
        self._handlers: set[asyncio.Task[None]] = set()

    # --- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        """Stop listening and reset every connection still open."""
        if self._server is not None:
            self._server.close()
        self._flowing.set()
        self.reset()
        # Each handler ends once its link is closed; cancelling them would make asyncio's
        # stream callback log the cancellation as an error.
        if self._handlers:
            await asyncio.wait(self._handlers, timeout=5)
        if self._server is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(5):
                    await self._server.wait_closed()

    @classmethod
    def for_dsn(cls, dsn: str) -> FaultProxy:
        """A proxy to the server, database and user of ``dsn`` (TCP or a Unix socket).

        Raises:
            ValueError: ``dsn`` does not name one server (see :func:`pg_endpoint`).
        """
        parts = urlsplit(dsn)
        host, port = pg_endpoint(dsn)
        return cls(
            host,
            port,
            database=unquote(parts.path.lstrip("/")) or "postgres",
            user=unquote(parts.username or "postgres"),
        )

    def dsn(self, user: str | None = None, **params: str) -> str:
        """A DSN that connects through the proxy (TLS off so COMMITs can be seen)."""
        query = "&".join(f"{k}={v}" for k, v in {"sslmode": "disable", **params}.items())
        return f"postgresql://{user or self.user}@127.0.0.1:{self.port}/{self.database}?{query}"

    @property
    def live_backend_pids(self) -> set[int]:
        """Backend pids of the connections open through the proxy right now."""
        return {link.backend.pid for link in self._links if link.backend.pid is not None}

    @property
    def open_connections(self) -> int:
        return len(self._links)

    # --- modes -------------------------------------------------------------------------

    def pass_through(self) -> None:
        """Forward everything without delay; resume blackholed connections; accept again."""
        self._delay = 0.0
        self._refusing = False
        self._flowing.set()

    def refuse(self) -> None:
        """Act as a stopped server: abort every connection, reset each new one at once."""
        self._refusing = True
        self.reset()

    def delay(self, seconds: float) -> None:
        """Deliver every chunk, both ways, ``seconds`` after it was read."""
        self._delay = float(seconds)
        self._flowing.set()

    def delay_close(self, seconds: float) -> None:
        """Deliver an end of stream (FIN) ``seconds`` after the data before it.

        A client then sees, say, a terminated backend's FATAL message on a connection that
        still looks open for that long.
        """
        self._eof_delay = float(seconds)

    def blackhole(self) -> None:
        """Stop forwarding both ways; sockets stay open and new ones are accepted."""
        self._flowing.clear()

    def blackhole_after(self, trigger: bytes, *, at_reply: bool = False) -> None:
        """Blackhole right after forwarding a client chunk that contains ``trigger``.

        With ``at_reply``, blackhole later instead: when the server next reports it is idle
        inside a transaction (ReadyForQuery 'T'), holding that answer. Without it, the
        server may be left mid-way through an extended-protocol exchange (after a Flush,
        before a Sync), where it counts as active and no server timeout applies.
        """
        self._blackhole_trigger = trigger
        self._blackhole_at_reply = at_reply

    def cut_reply_after(self, trigger: bytes) -> None:
        """Cut the connection that next executes a statement whose text contains
        ``trigger``, at the server's complete answer to it, which is dropped (one shot).

        The statement is recognized by its simple Query, or by the Bind of a statement
        whose Parse (seen after this call) held the text. Outside a transaction block the
        server has run and committed it; the client only sees the link die.
        """
        self._reply_trigger = trigger

    def reset(self) -> None:
        """Abort every current connection (TCP RST to both sides)."""
        for link in list(self._links):
            link.abort()

    def cut_before(self, trigger: bytes) -> None:
        """Drop the next client chunk holding ``trigger`` and reset its connection (one shot)."""
        self._drop_trigger = trigger

    def cut_after(self, n: int) -> None:
        """Abort the connection that forwards the ``n``-th byte from now (one shot)."""
        self._cut_budget = n

    def cut_at_client_chunk(self, n: int) -> None:
        """Reset the connection that sends the ``n``-th client chunk from now, which is
        dropped (one shot). ``n=2`` lets a transaction's BEGIN through and cuts it at its
        first statement."""
        self._cut_chunk = n

    def cut_after_commit(self, count: int = 1, *, skip: int = 0) -> None:
        """Let ``skip`` COMMITs through, then cut right after each of the next ``count``."""
        self._cut_commits = count
        self._skip_commits = skip
        self._forward_commit = True

    def cut_before_commit(self, count: int = 1, *, skip: int = 0) -> None:
        """Like :meth:`cut_after_commit`, but the COMMIT never reaches the server."""
        self._cut_commits = count
        self._skip_commits = skip
        self._forward_commit = False

    def disarm(self) -> None:
        """Forget pending one-shot cuts."""
        self._cut_chunk = None
        self._cut_budget = None
        self._cut_commits = 0
        self._skip_commits = 0
        self._blackhole_trigger = None
        self._awaiting_ready = False
        self._reply_trigger = None
        self._drop_trigger = None

    # --- relaying ----------------------------------------------------------------------

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        self.accepted += 1
        if self._refusing:
            self.refused += 1
            _abort(writer)
            self._handlers.discard(task)
            return
        try:
            try:
                upstream = await open_pg(self.upstream_host, self.upstream_port)
            except OSError:
                _abort(writer)
                return
            link = _Link(self, (reader, writer), upstream)
            self._links.add(link)
            link.start()
            await link.closed.wait()
            await asyncio.gather(*link.tasks, return_exceptions=True)
        except asyncio.CancelledError:
            _abort(writer)
            raise
        finally:
            self._handlers.discard(task)


@contextlib.asynccontextmanager
async def running_proxy(dsn: str) -> AsyncIterator[FaultProxy]:
    """Start a :class:`FaultProxy` to the server of ``dsn``, yield it, stop it."""
    proxy = FaultProxy.for_dsn(dsn)
    await proxy.start()
    try:
        yield proxy
    finally:
        await proxy.stop()
