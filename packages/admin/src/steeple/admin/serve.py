"""``steeple admin serve``: the admin app for one namespace behind a token, under uvicorn.

Queue-only users need no keys and no recurring namespace: without them the app serves the
work queue's tasks alone.

The token is the only credential, so it must be one nobody can guess (at least
:data:`MIN_TOKEN_BITS` bits of entropy, estimated conservatively by :func:`token_bits`);
a client that keeps presenting wrong tokens is refused for a while (429), longer after each
further failure, and every failure is logged with the client's address (never the token).
A listener that other machines can reach serves HTTPS (``--certfile``/``--keyfile``):
plain HTTP there sends the token in clear text, and is refused unless asked for
(``--insecure``).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import errno
import hmac
import ipaddress
import logging
import math
import os
import signal
import socket
import string
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Collection, Iterator
from itertools import pairwise
from typing import TYPE_CHECKING, Any, Final

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from steeple.admin.app import SECURITY_HEADERS, create_admin_app
from steeple.core.errors import ConfigurationError
from steeple.core.ports import RecurringStore

if TYPE_CHECKING:
    import uvicorn

    from steeple.admin._backend import Target
    from steeple.admin.tasks import TaskAdmin
    from steeple.keyring import Keyring

__all__ = [
    "MIN_TOKEN_BITS",
    "TOKEN_RECIPE",
    "LivePollFilter",
    "Throttle",
    "bind",
    "check_exposure",
    "check_token",
    "is_loopback",
    "presented_token",
    "serve",
    "token_app",
    "token_bits",
    "url_of",
]

_log = logging.getLogger("steeple.admin")

MIN_TOKEN_BITS: Final = 128
"""The least entropy (bits, as :func:`token_bits` estimates it) a sign-in token may have."""
TOKEN_RECIPE: Final = "python3 -c 'import secrets; print(secrets.token_urlsafe(32))'"  # noqa: S105
"""A command that prints a token strong enough (32 random bytes, 43 characters)."""
_CHARACTER_CLASSES: Final = (
    (frozenset(string.ascii_lowercase), 26),
    (frozenset(string.ascii_uppercase), 26),
    (frozenset(string.digits), 10),
    (frozenset(string.punctuation), 32),
)


def token_bits(token: str) -> float:
    """Estimate, conservatively, how many bits of entropy ``token`` has.

    Each character counts as at most ``log2`` of the alphabet of the character classes the
    token uses (lowercase, uppercase, digits, punctuation, anything else), and at most the
    token's own per-character Shannon entropy (so repeats count little); a character equal
    or next to the one before it (``aaaa``, ``abcd``, ``4321``) counts nothing. A random
    token from :data:`TOKEN_RECIPE` scores well above :data:`MIN_TOKEN_BITS`.
    """
    if not token:
        return 0.0
    used = set(token)
    alphabet = sum(size for chars, size in _CHARACTER_CLASSES if used & chars)
    if any(not (c.isascii() and c.isprintable()) or c == " " for c in used):
        alphabet += 32
    n = len(token)
    shannon = -sum(k / n * math.log2(k / n) for k in Counter(token).values())
    per_character = min(math.log2(alphabet), shannon)
    fresh = 1 + sum(1 for a, b in pairwise(token) if abs(ord(a) - ord(b)) > 1)
    return fresh * per_character


def check_token(token: object, what: str = "the admin token") -> str:
    """Return ``token`` if it is a str with at least :data:`MIN_TOKEN_BITS` bits of entropy.

    Raises:
        ConfigurationError: a weaker token (the message says how to make one; it never
            repeats the token).
    """
    if not isinstance(token, str):
        raise ConfigurationError(f"{what} must be a str")
    bits = token_bits(token)
    if bits < MIN_TOKEN_BITS:
        raise ConfigurationError(
            f"{what} is too easy to guess (about {bits:.0f} bits of entropy; at least "
            f"{MIN_TOKEN_BITS} are needed): make a random one with {TOKEN_RECIPE}"
        )
    return token


def is_loopback(sock: socket.socket) -> bool:
    """Whether ``sock`` listens on a loopback address only (not every interface)."""
    host = sock.getsockname()[0]
    try:
        address = ipaddress.ip_address(host.split("%")[0])
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped.is_loopback
    return address.is_loopback


def check_exposure(sock: socket.socket, *, tls: bool, insecure: bool) -> str | None:
    """Refuse plain HTTP that other machines can reach; return a warning to print, if any.

    Raises:
        CliError: (config) ``sock`` is not on a loopback address, there is no TLS and
            ``insecure`` was not given.
    """
    from steeple.admin.settings import CliError, ExitCode

    if tls or is_loopback(sock):
        return None
    host = sock.getsockname()[0]
    if not insecure:
        raise CliError(
            f"refusing to serve plain HTTP on {host}, which other machines can reach: the "
            "token would cross the network in clear text",
            code=ExitCode.CONFIG,
            hint="serve HTTPS with --certfile and --keyfile, listen on 127.0.0.1 (behind "
            "your own TLS proxy), or pass --insecure to accept the risk",
        )
    return (
        f"warning: serving plain HTTP on {host} (--insecure): anyone on the network path "
        "can read the token and the pages"
    )


class Throttle:
    """Per client address: after repeated wrong tokens, refuse that client for a while.

    After ``allowed`` failures within ``window`` seconds, each further failure blocks the
    client for ``base`` seconds, doubled per failure up to ``longest``; while blocked every
    request from it is answered 429 with ``Retry-After`` and its token is not even checked.
    A right token clears the client's record. At most ``clients`` addresses are remembered
    (the oldest forgotten first), so a flood of addresses cannot grow memory.
    """

    def __init__(
        self,
        *,
        allowed: int = 5,
        window: float = 600.0,
        base: float = 1.0,
        longest: float = 900.0,
        clients: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._allowed = allowed
        self._window = window
        self._base = base
        self._longest = longest
        self._clients = clients
        self._clock = clock
        # address -> (failures in the window, first failure at, blocked until)
        self._failures: OrderedDict[str, tuple[int, float, float]] = OrderedDict()

    def blocked_for(self, client: str) -> float:
        """Seconds ``client`` must still wait (0: it may try)."""
        entry = self._failures.get(client)
        if entry is None:
            return 0.0
        return max(0.0, entry[2] - self._clock())

    def failed(self, client: str) -> float:
        """Record a wrong token from ``client``; return how long it is now blocked."""
        now = self._clock()
        count, first, _ = self._failures.pop(client, (0, now, now))
        if now - first > self._window:
            count, first = 0, now
        count += 1
        over = count - self._allowed
        delay = 0.0 if over <= 0 else min(self._longest, self._base * 2.0 ** min(over - 1, 30))
        self._failures[client] = (count, first, now + delay)
        while len(self._failures) > self._clients:
            self._failures.popitem(last=False)
        _log.warning(
            "steeple admin: wrong token from %s (%d in the last %.0f s)%s",
            client,
            count,
            self._window,
            f"; refused for {delay:.0f} s" if delay else "",
        )
        return delay

    def succeeded(self, client: str) -> None:
        """Forget ``client``'s failures (it presented the right token)."""
        self._failures.pop(client, None)


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
    """Check the token before the app runs.

    No token or a wrong one: 401 with a basic-auth challenge; a client refused for repeated
    wrong tokens: 429.
    """

    def __init__(self, app: ASGIApp, expected: bytes, throttle: Throttle) -> None:
        self.app = app
        self.expected = expected
        self.throttle = throttle

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        client = (scope.get("client") or ("unknown", 0))[0]
        wait = self.throttle.blocked_for(client)
        if wait > 0:
            await _refuse(
                send,
                429,
                b"too_many_failures",
                b"too many wrong tokens from this address; wait and try again",
                [(b"retry-after", str(math.ceil(wait)).encode())],
            )
            return
        headers = dict(scope.get("headers", []))
        if b"authorization" not in headers:
            await _refuse(send, 401, b"unauthorized", b"sign in with the admin token")
            return
        presented = (presented_token(Request(scope)) or "").encode("utf-8")
        if not hmac.compare_digest(presented, self.expected):
            self.throttle.failed(client)
            await _refuse(send, 401, b"unauthorized", b"wrong token: sign in with the admin token")
            return
        self.throttle.succeeded(client)
        await self.app(scope, receive, send)


async def _refuse(
    send: Send,
    status: int,
    error: bytes,
    detail: bytes,
    extra: list[tuple[bytes, bytes]] | None = None,
) -> None:
    challenge = [(b"www-authenticate", b'Basic realm="steeple admin", charset="UTF-8"')]
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                *(challenge if status == 401 else []),
                *(extra or []),
                (b"content-type", b"application/json"),
                *SECURITY_HEADERS,
            ],
        }
    )
    await send(
        {
            "type": "http.response.body",
            "body": b'{"error":"' + error + b'","detail":"' + detail + b'"}',
        }
    )


def token_app(
    *,
    token: str,
    namespace: str,
    stores: Any,
    tasks: Any,
    csrf_token: str | None,
    reveal_args: Collection[str] = (),
    throttle: Throttle | None = None,
) -> ASGIApp:
    """Build the admin app whose only grant is: this token, on this one namespace.

    The token grants every action; the providers (``stores``, ``tasks``) serve ``namespace``
    alone, so any other namespace is answered 404 (an HTML page linking to this one).
    ``reveal_args`` names the tasks whose args the task page may show. Wrong tokens are
    answered 401 and counted per client address by ``throttle`` (a default
    :class:`Throttle` if none), which then refuses that address for a while (429).

    Raises:
        ConfigurationError: a token with less than :data:`MIN_TOKEN_BITS` bits of entropy.
    """
    expected = check_token(token).encode("utf-8")

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
    return _Challenge(inner, expected, throttle if throttle is not None else Throttle())


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


def url_of(sock: socket.socket, namespace: str, *, tls: bool = False) -> str:
    """Return the dashboard's URL on a bound socket (``https`` with ``tls``)."""
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    return f"{'https' if tls else 'http'}://{shown}:{port}/ui/{namespace}"


async def serve(
    target: Target,
    keyring: Keyring | None,
    *,
    token: str,
    csrf_token: str | None,
    sock: socket.socket,
    announce: Callable[[str], None],
    reveal_args: Collection[str] = (),
    certfile: str | None = None,
    keyfile: str | None = None,
) -> None:
    """Run the admin app on ``sock`` under uvicorn until SIGINT or SIGTERM (then return).

    With a ``keyring`` the namespace's recurring publications are served beside the tasks;
    without one (or when the namespace is not initialized) only the tasks are: the
    queue-only mode. ``announce`` gets one line per thing to say, the URL last, once the
    app is ready. ``reveal_args`` names the tasks whose args the task page may show.
    ``certfile`` and ``keyfile`` (PEM): serve HTTPS.

    Raises:
        CliError: the store cannot be opened (classified).
    """
    from steeple.admin.queue_admin import PostgresTaskAdmin

    store = await _open_store(target, keyring, announce)
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
                    PostgresTaskAdmin.open(
                        target.dsn, schema=target.queue_schema, pooler=target.pooler
                    )
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

    server = _server(app, certfile, keyfile)
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
        f"steeple admin: {url_of(sock, target.namespace, tls=certfile is not None)} "
        "(state changes "
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


async def _open_store(
    target: Target, keyring: Keyring | None, announce: Callable[[str], None]
) -> RecurringStore | None:
    """Open the namespace's recurring store, or ``None`` for the queue-only mode.

    Raises:
        CliError: the store cannot be opened (classified), or, queue-only, the database.
    """
    from steeple.admin._backend import connect_store
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
    return store


def _server(app: ASGIApp, certfile: str | None, keyfile: str | None) -> uvicorn.Server:
    """Return the uvicorn server of ``app``; :func:`serve`'s own handlers stop it."""
    import uvicorn

    class _Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            # Stopped by serve's own handlers: uvicorn's would re-raise the signal after
            # its graceful shutdown, and Ctrl-C would end the command with 130.
            yield

    config = uvicorn.Config(
        app,
        log_level="info",
        lifespan="off",
        server_header=False,
        access_log=True,
        ssl_certfile=certfile,
        ssl_keyfile=keyfile,
    )
    # After the config: building it configures uvicorn's loggers.
    logging.getLogger("uvicorn.access").addFilter(LivePollFilter())
    return _Server(config)


class LivePollFilter(logging.Filter):
    """Leave an open page's answered live refreshes (``?live=1``) out of the access log.

    A dashboard polls every few seconds; logging each poll would bury the requests a
    person made. A refused or failed poll is still logged.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        """Return whether ``record`` is logged (uvicorn's access record: path, status)."""
        args = record.args
        if not isinstance(args, tuple) or len(args) < 5:
            return True
        path, status = str(args[2]), args[4]
        query = path.partition("?")[2]
        live = "live=1" in query.split("&")
        return not (live and isinstance(status, int) and status < 400)


async def _probe(target: Target) -> None:
    """Connect once to the target's database and hang up (raises what connecting raises)."""
    conn = await target.connect()
    await conn.close()


def _not_initialized(error: Exception) -> bool:
    """Whether ``error`` says the recurring namespace or its tables do not exist yet."""
    from steeple.core.errors import RecurringNotFoundError, RecurringStorageError

    cause = error.__cause__
    return isinstance(cause, RecurringNotFoundError | RecurringStorageError) and (
        "run initialize" in str(cause)
    )
