"""How the command reaches PostgreSQL: targets, store opening, and error classification."""

from __future__ import annotations

import contextlib
import logging
import socket
import ssl
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import parse_qs, urlsplit

import attrs

from steeple.admin.settings import (
    DSN_ENV,
    SETTINGS_FILE,
    CliError,
    ExitCode,
    NamespaceSettings,
    format_duration,
    load_keyring,
    redact_dsn,
)
from steeple.core.dsn import scrub
from steeple.core.errors import (
    AuthenticationFailedError,
    BrokerError,
    ConfigurationError,
    KeyringBindingMismatchError,
    KeyringError,
    RecurringCapacityError,
    RecurringConflictError,
    RecurringError,
    RecurringInvalidStateError,
    RecurringNotFoundError,
    RecurringSchemaVersionError,
    RecurringStorageError,
    SteepleError,
    UnknownKeyIdError,
)

if TYPE_CHECKING:
    import asyncpg

    from steeple.core.config import RecurringConfig
    from steeple.core.ports import Clock
    from steeple.keyring import Keyring
    from steeple.postgres import PostgresRecurringStore
    from steeple.postgres.pooler import Pooler

__all__ = [
    "Target",
    "classify",
    "connect_store",
    "initialize_store",
    "keyring_from",
    "quiet_role_warnings",
    "server_of",
]


@attrs.frozen
class Target:
    """Where a command works: a server, a schema, a namespace and how to find the keys.

    ``keys_file`` is the keys file to read (``--keys-file``); ``fallback_keys_file`` the one
    a settings file names, read only when neither the option nor ``STEEPLE_KEYS`` is set.
    """

    dsn: str = attrs.field(repr=lambda dsn: repr(redact_dsn(dsn)))
    schema: str
    settings: NamespaceSettings
    keys_file: Path | None = None
    queue_schema_override: str | None = None
    fallback_keys_file: Path | None = None
    embedded: bool = False
    """The server is the embedded PostgreSQL (a private cluster, run as its superuser)."""
    pooler: Pooler | None = None
    """``"transaction"``: the DSN leads through a transaction pooler (``--pooler``)."""
    listen_dsn: str | None = attrs.field(
        default=None, repr=lambda dsn: "None" if dsn is None else repr(redact_dsn(dsn))
    )
    """A direct DSN for the task worker's LISTEN (``steeple worker --listen-dsn``)."""

    async def connect(self) -> asyncpg.Connection[asyncpg.Record]:
        """Open one connection to the DSN, fit for the pooler it leads through (if any)."""
        import asyncpg

        from steeple.postgres.pooler import asyncpg_options

        return await asyncpg.connect(self.dsn, timeout=10, **asyncpg_options(self.pooler))

    @property
    def namespace(self) -> str:
        """The namespace name."""
        return self.settings.namespace

    @property
    def queue_schema(self) -> str:
        """The work queue's schema: ``--queue-schema``, else ``<schema>_queue``."""
        return self.queue_schema_override or f"{self.schema}_queue"

    def keyring(self) -> Keyring:
        """Load the keyring (see :func:`steeple.admin.settings.load_keyring`).

        ``--keys-file`` first, then ``STEEPLE_KEYS``, then the settings file's keys file.

        Raises:
            CliError: (config) no or malformed keys.
        """
        return keyring_from(self.keys_file, self.fallback_keys_file)


def keyring_from(keys_file: Path | None, fallback: Path | None = None) -> Keyring:
    """Load the keyring: ``keys_file``, else ``STEEPLE_KEYS``, else ``fallback``.

    Raises:
        CliError: (config) no or malformed keys.
    """
    import os

    from steeple.admin.settings import KEYS_ENV

    chosen = keys_file
    if chosen is None and not os.environ.get(KEYS_ENV, "").strip():
        chosen = fallback
    return load_keyring(chosen)


class _RoleWarnings(logging.Filter):
    """Hold back the store's runtime-role warnings (superuser, owner, CREATE)."""

    def __init__(self) -> None:
        super().__init__()
        self.held: list[str] = []

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "runtime role" in message or "superuser" in message:
            self.held.append(message)
            return False
        return True


@contextlib.contextmanager
def quiet_role_warnings() -> Iterator[list[str]]:
    """Hold back the runtime-role warnings the recurring store logs while opening.

    For commands run by the deployment role (``initialize``, the demo), where a
    superuser is expected. Yields the list of the messages held back.
    """
    quiet = _RoleWarnings()
    # Logger filters see only records logged on that very logger, not on its children.
    loggers = [logging.getLogger(n) for n in ("steeple.postgres", "steeple.postgres.recurring")]
    for logger in loggers:
        logger.addFilter(quiet)
    try:
        yield quiet.held
    finally:
        for logger in loggers:
            logger.removeFilter(quiet)


async def initialize_store(
    target: Target, *, clock: Clock | None = None, keyring: Keyring | None = None
) -> PostgresRecurringStore:
    """Create the schema and namespace if needed (deployment role) and return the store.

    Raises:
        CliError: classified failures (see :func:`classify`).
    """
    return await _open_store(target, clock, keyring, initialize=True)


async def connect_store(
    target: Target, *, clock: Clock | None = None, keyring: Keyring | None = None
) -> PostgresRecurringStore:
    """Connect to an initialized namespace (runtime role).

    Raises:
        CliError: classified failures (see :func:`classify`).
    """
    return await _open_store(target, clock, keyring, initialize=False)


async def _open_store(
    target: Target, clock: Clock | None, keyring: Keyring | None, *, initialize: bool
) -> PostgresRecurringStore:
    from steeple.core.clock import SystemClock
    from steeple.postgres import PostgresRecurringStore

    opener = PostgresRecurringStore.initialize if initialize else PostgresRecurringStore.connect
    keys = keyring or target.keyring()
    # The embedded server's only role is its superuser: a warning about it helps nobody.
    quiet = quiet_role_warnings() if target.embedded else contextlib.nullcontext()
    try:
        with quiet:
            return await opener(
                target.dsn,
                target.settings.config(),
                keys,
                clock or SystemClock(),
                schema=target.schema,
                pooler=target.pooler,
            )
    except Exception as exc:
        if _cause(exc, KeyringBindingMismatchError) is not None:
            described = await _describe_mismatch(target, keys)
            if described is not None:
                raise described from exc
        raise classify(exc, target) from exc


def _cause(exc: BaseException, kind: type[BaseException]) -> BaseException | None:
    """Return the first exception of type ``kind`` in ``exc``'s cause/context chain."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, kind):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


_OPTIONS = {
    "max_definitions": "--max-definitions",
    "max_occurrences": "--max-occurrences",
    "delivery_window": "--delivery-window",
    "lease": "--lease",
}


def _values(config: RecurringConfig) -> dict[str, str]:
    return {
        "max_definitions": str(config.max_definitions),
        "max_occurrences": str(config.max_occurrences),
        "delivery_window": format_duration(config.delivery_window),
        "lease": format_duration(config.lease_duration),
    }


async def _describe_mismatch(target: Target, keyring: Keyring) -> CliError | None:
    """Name the values the namespace was initialized with (the keys open its binding).

    ``None`` when they cannot be read (the caller reports the store's error instead).
    """
    import asyncpg

    from steeple.core.config import RecurringConfig
    from steeple.postgres.recurring import admin

    try:
        conn = await target.connect()
        try:
            binding = await admin.namespace_binding(
                conn, schema=target.schema, namespace=target.namespace
            )
        finally:
            await conn.close()
        if binding is None:
            return None
        fields = keyring.binding_fields(binding.sealed, namespace=target.namespace)
        stored = _values(RecurringConfig.from_fingerprint(fields))
        given = _values(target.settings.config())
    except (OSError, asyncpg.PostgresError, SteepleError, CliError):
        return None
    differ = [name for name in stored if stored[name] != given[name]]
    if not differ:
        return None
    quoted = {"delivery_window", "lease"}
    return CliError(
        f"namespace {target.namespace!r} was initialized with "
        + ", ".join(f"{name}={stored[name]}" for name in differ)
        + "; this command used "
        + ", ".join(f"{name}={given[name]}" for name in differ),
        code=ExitCode.CONFIG,
        hint=f"write them once in {SETTINGS_FILE}: "
        + ", ".join(
            f'{name} = "{stored[name]}"' if name in quoted else f"{name} = {stored[name]}"
            for name in differ
        )
        + " (or pass "
        + " ".join(f"{_OPTIONS[name]} {stored[name]}" for name in differ)
        + ")",
    )


# --- error classification ---------------------------------------------------------------


def server_of(dsn: str) -> str:
    """Return ``host:port`` (or the socket directory) a DSN names, for messages."""
    try:
        parts = urlsplit(dsn)
        query = parse_qs(parts.query)
        host = parts.hostname or (query.get("host") or [""])[0] or "localhost"
        port = parts.port or (query.get("port") or ["5432"])[0]
    except ValueError:
        return "the server"
    if host.startswith("/"):
        return f"the socket in {host}"
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _from_driver(exc: BaseException) -> bool:
    return type(exc).__module__.startswith(("asyncpg", "psycopg"))


def _driver_error(exc: BaseException) -> BaseException | None:
    """Return the driver or network exception behind ``exc`` (itself, a cause, a context)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        # The library's own errors (some are also OSError or TimeoutError) wrap the cause.
        ours = isinstance(current, SteepleError)
        if _from_driver(current) or (isinstance(current, OSError | TimeoutError) and not ours):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def _server_message(exc: BaseException) -> str:
    """Return the server's own words: message, then detail and hint when it sent them."""
    text = str(exc) or type(exc).__name__
    for extra in ("detail", "hint"):
        value = getattr(exc, extra, None)
        if isinstance(value, str) and value and value not in text:
            text += f" ({value})"
    return text


_DSN_HINT = f"fix --dsn / {DSN_ENV} (or dsn in {SETTINGS_FILE})"


def _connection_problem(driver: BaseException, target: Target | None) -> CliError | None:
    """Tell a failure to connect in the server's (or the network's) words."""
    import asyncpg

    from steeple.postgres.sqlstate import (
        CANNOT_CONNECT_NOW,
        INVALID_AUTHORIZATION,
        INVALID_CATALOG_NAME,
        INVALID_PASSWORD,
        TOO_MANY_CONNECTIONS,
        sqlstate,
    )

    server = server_of(target.dsn) if target else "the server"
    state = sqlstate(driver)
    config = ExitCode.CONFIG
    if isinstance(driver, asyncpg.ClientConfigurationError):
        # asyncpg refusing a connection option: an unknown sslmode, a missing root cert...
        return CliError(
            f"the connection settings are refused: {_server_message(driver)}",
            code=config,
            hint=_DSN_HINT,
        )
    if state == INVALID_CATALOG_NAME:
        return CliError(
            f"{_server_message(driver)} on {server}",
            code=config,
            hint=f"create it (CREATE DATABASE) or fix the database name in {_DSN_HINT[4:]}",
        )
    if state == INVALID_PASSWORD:
        return CliError(
            f"{_server_message(driver)} ({server})",
            code=config,
            hint="check the user and password (in the DSN, PGPASSWORD or ~/.pgpass)",
        )
    if state == INVALID_AUTHORIZATION:
        return CliError(
            f"{_server_message(driver)} ({server})",
            code=config,
            hint="check the user name in the DSN, and the server's pg_hba.conf for this "
            "client, user and database",
        )
    if state in {TOO_MANY_CONNECTIONS, CANNOT_CONNECT_NOW}:
        return CliError(
            f"{_server_message(driver)} ({server})",
            code=ExitCode.UNAVAILABLE,
            hint="try again shortly"
            + (
                "; or raise max_connections / lower pool sizes"
                if state == TOO_MANY_CONNECTIONS
                else ""
            ),
        )
    return _network_problem(driver, target, server)


def _network_problem(driver: BaseException, target: Target | None, server: str) -> CliError | None:
    """Tell a failure to reach the server (TLS, files, names, sockets) in plain words."""
    problem = _tls_problem(driver, target, server)
    return _socket_problem(driver, server) if problem is None else problem


def _tls_problem(driver: BaseException, target: Target | None, server: str) -> CliError | None:
    """Tell a failed TLS handshake, or a TLS file the DSN names that cannot be read."""
    config = ExitCode.CONFIG
    if isinstance(driver, ssl.SSLCertVerificationError):
        reason = driver.verify_message or driver.reason or str(driver)
        return CliError(
            f"TLS verification of {server} failed: {reason}",
            code=config,
            hint="with sslmode=verify-full the server's certificate must be signed by the CA "
            "in sslrootcert and name the host of the DSN",
        )
    if isinstance(driver, ssl.SSLError):
        return CliError(
            f"the TLS handshake with {server} failed: {driver.reason or driver}",
            code=config,
            hint="check the server's TLS setup and the DSN's sslmode, sslrootcert, sslcert",
        )
    if isinstance(driver, ConnectionError) and "SSL" in str(driver):
        return CliError(
            f"{server} does not accept TLS connections ({driver})",
            code=config,
            hint="enable ssl on the server, or connect over a Unix socket or loopback",
        )
    if isinstance(driver, FileNotFoundError | PermissionError) and target is not None:
        query = parse_qs(urlsplit(target.dsn).query) if "?" in target.dsn else {}
        files = [f"{k}={v[0]}" for k, v in query.items() if k.startswith("ssl") and v]
        files = [f for f in files if not f.startswith("sslmode=")]
        if files:
            return CliError(
                f"cannot read the TLS file the DSN names ({', '.join(files)}): "
                f"{driver.strerror or type(driver).__name__}",
                code=config,
                hint="fix the path in the DSN",
            )
    return None


def _socket_problem(driver: BaseException, server: str) -> CliError | None:
    """Tell a host name that does not resolve, a refused or lost connection, a timeout."""
    name = type(driver).__name__
    if isinstance(driver, socket.gaierror):
        return CliError(
            f"cannot resolve the host of {server}: {driver.strerror or driver}",
            code=ExitCode.CONFIG,
            hint=f"check the host name in {_DSN_HINT[4:]}",
        )
    if isinstance(driver, ConnectionRefusedError):
        return CliError(
            f"cannot connect to {server}: connection refused",
            code=ExitCode.UNAVAILABLE,
            hint="check that PostgreSQL is running there and the DSN names the right host and port",
        )
    if isinstance(driver, TimeoutError):
        return CliError(
            f"no answer from {server} in time",
            code=ExitCode.UNAVAILABLE,
            hint="check that the server is up and reachable (firewall, host, port)",
        )
    if isinstance(driver, OSError) and not _from_driver(driver):
        return CliError(
            f"cannot reach {server}: {driver.strerror or driver or name}",
            code=ExitCode.UNAVAILABLE,
            hint="check that PostgreSQL is running and the DSN names the right host and port",
        )
    if name in {"ConnectionDoesNotExistError", "ConnectionFailureError", "InterfaceError"}:
        return CliError(
            f"the connection to {server} was lost: {_server_message(driver)}",
            code=ExitCode.UNAVAILABLE,
            hint="try again; check the server's log if it persists",
        )
    return None


# The work queue's typed storage errors (steeple.postgres.queue.errors), told apart by name
# like SchemaVersionMismatchError: the queue's own message names the cause in one line.
_QUEUE_UNAVAILABLE = {"QueueUnavailableError", "QueueDeadlineError"}
_QUEUE_REFUSALS = {"read_only", "disk_full", "insufficient_resources"}


def _queue_storage_problem(exc: BaseException) -> str | None:
    """Return a hint when ``exc`` is the queue's typed storage failure, else ``None``."""
    name = type(exc).__name__
    if name == "QueueDeadlineError":
        return "try again; if it persists, find the session holding the lock (pg_locks)"
    if name in _QUEUE_UNAVAILABLE:
        return "try again; check the server's log if it persists"
    if name == "UnfitDatabaseError" and getattr(exc, "setting", None) in _QUEUE_REFUSALS:
        if exc.setting == "read_only":  # type: ignore[attr-defined]
            return "connect to the writable primary (the DSN names a standby or read-only session)"
        return "free space or resources on the server, then try again"
    return None


def _is_data_exception(exc: BaseException | None) -> bool:
    """Whether ``exc`` is a driver error of SQLSTATE class 22 (data exception)."""
    if exc is None or not _from_driver(exc):
        return False
    from steeple.postgres.sqlstate import is_data_exception, sqlstate

    return is_data_exception(sqlstate(exc))


def classify(exc: BaseException, target: Target | None = None) -> CliError:
    """Map any failure to a one-line :class:`CliError` with an exit code and a hint.

    Configuration, DSN and key problems exit 3, unreachable services 4, refused operations
    1, arguments PostgreSQL refuses as data (SQLSTATE class 22) 2. A failure the server
    reported is told in its own words. The message is scrubbed of the target DSN's secrets.
    """
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        # A TaskGroup (worker, demo) wraps the failure that stopped it: report that one.
        exc = exc.exceptions[0]
    error = _classify(exc, target)
    if target is not None:
        # Defense in depth: no driver text may carry a piece of the DSN's password.
        return CliError(
            scrub(str(error), target.dsn),
            code=error.code,
            hint=None if error.hint is None else scrub(error.hint, target.dsn),
        )
    return error


_KEYS_HINT = (
    "supply the keys this namespace was sealed with (STEEPLE_KEYS, --keys-file or keys_file "
    f"in {SETTINGS_FILE})"
)


def _classify(exc: BaseException, target: Target | None) -> CliError:
    if isinstance(exc, CliError):
        return exc
    where = f" ({redact_dsn(target.dsn)}, schema {target.schema!r})" if target else ""
    problem = _pooler_problem(exc)
    if problem is None:
        problem = _refusal_problem(exc)
    if problem is None:
        problem = _keys_problem(exc)
    if problem is None:
        problem = _schema_problem(exc, where)
    driver = _driver_error(exc)
    if problem is None and driver is not None:
        problem = _connection_problem(driver, target)
    if problem is None:
        problem = _data_problem(exc, where)
    if problem is None:
        problem = _service_problem(exc, driver, where)
    return problem


_POOLER_DECLARE = (
    'give --pooler transaction (or STEEPLE_POOLER=transaction, or pooler = "transaction" '
    f"in {SETTINGS_FILE})"
)
_LISTEN_DSN = f"--listen-dsn (or STEEPLE_LISTEN_DSN, or listen_dsn in {SETTINGS_FILE})"


def _pooler_problem(exc: BaseException) -> CliError | None:
    """Tell an undeclared transaction pooler, in the options of what the command built.

    The command builds the recurring store and the task worker with ``--pooler``: their
    refusal names the option (and, for the worker, ``--listen-dsn``). A broker the
    application built itself keeps its own words.
    """
    from steeple.postgres.pooler import PoolerAdvice, pooler_refusal
    from steeple.postgres.queue.errors import QueueError

    if isinstance(exc, RecurringError):
        advice = PoolerAdvice(_POOLER_DECLARE)
    elif isinstance(exc, QueueError):
        advice = PoolerAdvice(_POOLER_DECLARE, listen=_LISTEN_DSN)
    else:
        return None
    driver = _driver_error(exc)
    refused = None if driver is None else pooler_refusal(driver)
    if refused is None:
        return None
    return CliError(str(refused), code=ExitCode.CONFIG, hint=str(advice))


def _refusal_problem(exc: BaseException) -> CliError | None:
    """Tell a recurring operation the namespace refused (missing, conflicting, full)."""
    if isinstance(
        exc,
        RecurringNotFoundError
        | RecurringInvalidStateError
        | RecurringConflictError
        | RecurringCapacityError,
    ):
        hint = "run steeple initialize first" if "initialize" in str(exc) else None
        code = ExitCode.CONFIG if hint else ExitCode.FAILED
        return CliError(str(exc), code=code, hint=hint)
    return None


def _keys_problem(exc: BaseException) -> CliError | None:
    """Tell keys that do not fit the namespace (binding, key id, key material)."""
    mismatch = _cause(exc, KeyringBindingMismatchError)
    if mismatch is not None:
        return CliError(
            str(mismatch),
            code=ExitCode.CONFIG,
            hint=f"use the namespace's settings (max_definitions, max_occurrences, "
            f"delivery_window, lease in {SETTINGS_FILE} or the options of the same names)",
        )
    unknown = _cause(exc, UnknownKeyIdError)
    if isinstance(unknown, UnknownKeyIdError):
        return CliError(
            f"the namespace is sealed under key id {unknown.key_id!r}, which the keys given "
            "do not hold",
            code=ExitCode.CONFIG,
            hint=f"add that key (as a previous key) to the keys; {_KEYS_HINT}",
        )
    if _cause(exc, AuthenticationFailedError) is not None:
        return CliError(
            "the keys given do not open this namespace's records (a key id they share "
            "holds other key material)",
            code=ExitCode.CONFIG,
            hint=_KEYS_HINT,
        )
    if isinstance(exc, KeyringError) and not isinstance(exc, ConfigurationError):
        return CliError(str(exc), code=ExitCode.CONFIG, hint=_KEYS_HINT)
    return None


def _schema_problem(exc: BaseException, where: str) -> CliError | None:
    """Tell a schema at another version than this code's."""
    if isinstance(exc, RecurringSchemaVersionError):
        return CliError(str(exc) + where, code=ExitCode.CONFIG)
    from steeple.postgres.queue.errors import SchemaVersionMismatchError

    if isinstance(exc, SchemaVersionMismatchError):
        return CliError(str(exc), code=ExitCode.CONFIG, hint="run steeple migrate")
    return None


def _data_problem(exc: BaseException, where: str) -> CliError | None:
    """Tell an argument PostgreSQL refused as data (SQLSTATE class 22)."""
    for candidate in (exc, exc.__cause__):
        if _is_data_exception(candidate):
            # PostgreSQL refused a value as data (a NUL, an undecodable character, a number
            # out of range): the argument is wrong, not the server.
            return CliError(
                f"PostgreSQL cannot take an argument as given (SQLSTATE "
                f"{getattr(candidate, 'sqlstate', '22000')}){where}",
                code=ExitCode.USAGE,
                hint="remove NUL, control characters and undecodable bytes; keep numbers "
                "within 64 bits",
            )
    return None


def _service_problem(exc: BaseException, driver: BaseException | None, where: str) -> CliError:
    """Tell any other failure: configuration, storage, the broker, or the server's words."""
    if isinstance(exc, ConfigurationError):
        return CliError(str(exc), code=ExitCode.CONFIG)
    if isinstance(exc, RecurringStorageError):
        text = str(exc)
        if "initialize" in text.lower():
            return CliError(text + where, code=ExitCode.CONFIG, hint="run steeple initialize first")
        if driver is not None and _from_driver(driver):
            text += f": {_server_message(driver)}"
        return CliError(text + where, code=ExitCode.UNAVAILABLE)
    if isinstance(exc, BrokerError):
        return CliError(str(exc), code=ExitCode.UNAVAILABLE, hint="check the broker")
    queue_storage = _queue_storage_problem(exc)
    if queue_storage is not None:
        return CliError(str(exc) + where, code=ExitCode.UNAVAILABLE, hint=queue_storage)
    if isinstance(exc, SteepleError):
        return CliError(str(exc), code=ExitCode.FAILED)
    if _from_driver(exc):
        return CliError(f"PostgreSQL refused{where}: {_server_message(exc)}", code=ExitCode.FAILED)
    return CliError(f"unexpected {type(exc).__name__}: {exc}", code=ExitCode.FAILED)
