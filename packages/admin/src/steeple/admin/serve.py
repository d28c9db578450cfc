"""``steeple admin serve``: the admin app for one namespace behind a token, under uvicorn.

Queue-only users need no keys and no recurring namespace: without them the app serves the
work queue's tasks alone.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import errno
import hmac
import os
import signal
import socket
from collections.abc import Callable, Collection, Iterator
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from steeple.admin.app import SECURITY_HEADERS, create_admin_app
from steeple.core.ports import RecurringStore

if TYPE_CHECKING:
    from steeple.admin._backend import Target
    from steeple.admin.tasks import TaskAdmin
    from steeple.keyring import Keyring

__all__ = ["bind", "presented_token", "serve", "token_app", "url_of"]


def presented_token(request: Request) -> str | None:
    """Return the token a request presents: ``Bearer <token>`` or the password of basic auth."""
    header = request.headers.get("authorization", "")
    scheme, _, value = header.partition(" ")
    if scheme.lower() == "bearer":
        return value.strip()
    if scheme.lower() == "basic":
        try:
            decoded = base64.b64decode(value.strip(), validate=True).decode("utf-8")
        except (binascii.Error, UnicodeDecodeError):
            return None
        return decoded.partition(":")[2]
    return None


class _Challenge:
    """Answer 401 with a basic-auth challenge when no credentials were sent at all."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = dict(scope.get("headers", []))
            if b"authorization" not in headers:
                await send(
                    {
                        "type": "http.response.start",
                        "status": 401,
                        "headers": [
                            (b"www-authenticate", b'Basic realm="steeple admin", charset="UTF-8"'),
                            (b"content-type", b"application/json"),
                            *SECURITY_HEADERS,
                        ],
                    }
                )
                await send(
                    {
                        "type": "http.response.body",
                        "body": b'{"error":"unauthorized","detail":"sign in with the admin token"}',
                    }
                )
                return
        await self.app(scope, receive, send)


def token_app(
    *,
    token: str,
    namespace: str,
    stores: Any,
    tasks: Any,
    csrf_token: str | None,
    reveal_args: Collection[str] = (),
) -> ASGIApp:
    """Build the admin app whose only grant is: this token, on this one namespace.

    The token grants every action; the providers (``stores``, ``tasks``) serve ``namespace``
    alone, so any other namespace is answered 404 (an HTML page linking to this one).
    ``reveal_args`` names the tasks whose args the task page may show.
    """
    expected = token.encode("utf-8")

    async def authorize(request: Request, action: str, requested: str) -> bool:
        presented = (presented_token(request) or "").encode("utf-8")
        return hmac.compare_digest(presented, expected)

    inner = create_admin_app(
        authorize=authorize,
        stores=stores,
        tasks=tasks,
        csrf_token=csrf_token,
        reveal_args=reveal_args,
        namespaces=(namespace,),
    )
    return _Challenge(inner)


def bind(host: str, port: int) -> socket.socket:
    """Bind a listening TCP socket on ``host:port`` (``0``: any free port).

    Raises:
        CliError: (unavailable) the port is taken or cannot be bound; (config) the host
            does not resolve to an address of this machine.
    """
    from steeple.admin.settings import CliError, ExitCode

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError, ValueError) as exc:
        reason = getattr(exc, "strerror", None) or str(exc)
        raise CliError(
            f"cannot listen on host {host!r}: {reason}",
            code=ExitCode.CONFIG,
            hint="use an address of this machine, e.g. --host 127.0.0.1",
        ) from None
    family, _, _, _, address = infos[0]
    try:
        return socket.create_server(address, family=family)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise CliError(
                f"cannot listen on {host}:{port}: the port is in use",
                code=ExitCode.UNAVAILABLE,
                hint="choose another with --port (0 picks a free one), or stop what listens there",
            ) from None
        reason = os.strerror(exc.errno) if exc.errno else type(exc).__name__
        raise CliError(
            f"cannot listen on {host}:{port}: {reason}",
            code=ExitCode.CONFIG,
            hint="use an address of this machine (e.g. --host 127.0.0.1) and a port you may "
            "bind (1024 and above, or 0 for any)",
        ) from None


def url_of(sock: socket.socket, namespace: str) -> str:
    """Return the dashboard's URL on a bound socket."""
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}/ui/{namespace}"


async def serve(
    target: Target,
    keyring: Keyring | None,
    *,
    token: str,
    csrf_token: str | None,
    sock: socket.socket,
    announce: Callable[[str], None],
    reveal_args: Collection[str] = (),
) -> None:
    """Run the admin app on ``sock`` under uvicorn until SIGINT or SIGTERM (then return).

    With a ``keyring`` the namespace's recurring publications are served beside the tasks;
    without one (or when the namespace is not initialized) only the tasks are: the
    queue-only mode. ``announce`` gets one line per thing to say, the URL last, once the
    app is ready. ``reveal_args`` names the tasks whose args the task page may show.

    Raises:
        CliError: the store cannot be opened (classified).
    """
    import uvicorn

    from steeple.admin._backend import connect_store
    from steeple.admin.queue_admin import PostgresTaskAdmin
    from steeple.admin.settings import CliError

    store: RecurringStore | None = None
    if keyring is not None:
        try:
            store = await connect_store(target, keyring=keyring)
        except CliError as exc:
            if not _not_initialized(exc):
                raise
            announce(
                f"recurring publications not served: namespace {target.namespace!r} is not "
                f"initialized in schema {target.schema!r} (tasks only)"
            )
    if store is None:
        # Queue-only: nothing was opened yet; a wrong DSN must fail now, not at the first
        # request (the queue itself is opened on first use, so the dashboard works before
        # steeple migrate was run).
        await _probe(target)
    resources = contextlib.AsyncExitStack()
    opening = asyncio.Lock()
    task_admin: TaskAdmin | None = None

    async def stores(namespace: str) -> RecurringStore:
        if namespace != target.namespace or store is None:
            raise LookupError(namespace)
        return store

    async def tasks(namespace: str) -> TaskAdmin:
        # Opened on first use, so the dashboard works before `steeple migrate` was run.
        nonlocal task_admin
        if namespace != target.namespace:
            raise LookupError(namespace)
        async with opening:
            if task_admin is None:
                task_admin = await resources.enter_async_context(
                    PostgresTaskAdmin.open(target.dsn, schema=target.queue_schema)
                )
        return task_admin

    app = token_app(
        token=token,
        namespace=target.namespace,
        stores=stores if store is not None else None,
        tasks=tasks,
        csrf_token=csrf_token,
        reveal_args=reveal_args,
    )

    class _Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            # Stopped by this function's own handlers: uvicorn's would re-raise the signal
            # after its graceful shutdown, and Ctrl-C would end the command with 130.
            yield

    config = uvicorn.Config(
        app, log_level="info", lifespan="off", server_header=False, access_log=True
    )
    server = _Server(config)
    loop = asyncio.get_running_loop()
    installed: list[signal.Signals] = []

    def stop() -> None:
        if server.should_exit:
            server.force_exit = True  # a second Ctrl-C: stop waiting for connections
        server.should_exit = True

    for signum in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(signum, stop)
            installed.append(signum)
    if store is None:
        announce("queue-only mode: the dashboard shows the work queue's tasks")
    announce(
        f"steeple admin: {url_of(sock, target.namespace)} (state changes "
        f"{'enabled' if csrf_token else 'disabled: set STEEPLE_ADMIN_CSRF_TOKEN'}; "
        "Ctrl-C to stop)"
    )
    try:
        async with resources:
            await server.serve(sockets=[sock])
    finally:
        for signum in installed:
            loop.remove_signal_handler(signum)
        if store is not None:
            await store.close()


async def _probe(target: Target) -> None:
    """Connect once to the target's database and hang up (raises what connecting raises)."""
    import asyncpg

    conn = await asyncpg.connect(target.dsn, timeout=10)
    await conn.close()


def _not_initialized(error: Exception) -> bool:
    """Whether ``error`` says the recurring namespace or its tables do not exist yet."""
    from steeple.core.errors import RecurringNotFoundError, RecurringStorageError

    cause = error.__cause__
    return isinstance(cause, RecurringNotFoundError | RecurringStorageError) and (
        "run initialize" in str(cause)
    )
