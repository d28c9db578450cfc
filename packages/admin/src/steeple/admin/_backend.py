"""How the command reaches PostgreSQL: targets, store opening, and error classification."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from steeple.admin.settings import (
    CliError,
    ExitCode,
    NamespaceSettings,
    load_keyring,
    redact_dsn,
)
from steeple.core.clock import SystemClock
from steeple.core.dsn import scrub
from steeple.core.errors import (
    BrokerError,
    ConfigurationError,
    KeyringError,
    RecurringCapacityError,
    RecurringConflictError,
    RecurringInvalidStateError,
    RecurringNotFoundError,
    RecurringStorageError,
    SteepleError,
)
from steeple.core.ports import Clock

if TYPE_CHECKING:
    from steeple.keyring import Keyring
    from steeple.postgres import PostgresRecurringStore

__all__ = ["Target", "classify", "connect_store", "initialize_store"]


@attrs.frozen
class Target:
    """Where a command works: a server, a schema, a namespace and how to find the keys."""

    dsn: str = attrs.field(repr=lambda dsn: repr(redact_dsn(dsn)))
    schema: str
    settings: NamespaceSettings
    keys_file: Path | None = None
    queue_schema_override: str | None = None

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

        Raises:
            CliError: (config) no or malformed keys.
        """
        return load_keyring(self.keys_file)


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
    from steeple.postgres import PostgresRecurringStore

    opener = PostgresRecurringStore.initialize if initialize else PostgresRecurringStore.connect
    try:
        return await opener(
            target.dsn,
            target.settings.config(),
            keyring or target.keyring(),
            clock or SystemClock(),
            schema=target.schema,
        )
    except Exception as exc:
        raise classify(exc, target) from exc


def _is_driver_unavailable(exc: BaseException) -> bool:
    if isinstance(exc, OSError | ConnectionError | asyncio.TimeoutError | TimeoutError):
        return True
    module = type(exc).__module__
    name = type(exc).__name__
    if module.startswith(("asyncpg", "psycopg")):
        return name in {
            "ConnectionDoesNotExistError",
            "CannotConnectNowError",
            "ConnectionFailureError",
            "InvalidCatalogNameError",
            "TooManyConnectionsError",
            "OperationalError",
            "InterfaceError",
            "ClientCannotConnectError",
            "ConnectionRejectionError",
            "InvalidAuthorizationSpecificationError",
            "InvalidPasswordError",
        }
    return False


def _is_data_exception(exc: BaseException | None) -> bool:
    """Whether ``exc`` is a driver error of SQLSTATE class 22 (data exception)."""
    if exc is None or not type(exc).__module__.startswith(("asyncpg", "psycopg")):
        return False
    state = getattr(exc, "sqlstate", None)
    return isinstance(state, str) and state.startswith("22")


def classify(exc: BaseException, target: Target | None = None) -> CliError:
    """Map any failure to a one-line :class:`CliError` with an exit code and a hint.

    Configuration and key problems exit 3, unreachable services 4, refused operations 1,
    arguments PostgreSQL refuses as data (SQLSTATE class 22) 2. The message is scrubbed of
    the target DSN's secrets.
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


def _classify(exc: BaseException, target: Target | None) -> CliError:
    if isinstance(exc, CliError):
        return exc
    where = f" ({redact_dsn(target.dsn)}, schema {target.schema!r})" if target else ""
    if isinstance(exc, RecurringNotFoundError | RecurringInvalidStateError):
        return CliError(str(exc), code=ExitCode.FAILED)
    if isinstance(exc, RecurringConflictError | RecurringCapacityError):
        return CliError(str(exc), code=ExitCode.FAILED)
    if isinstance(exc, KeyringError) and not isinstance(exc, ConfigurationError):
        return CliError(
            str(exc),
            code=ExitCode.CONFIG,
            hint="supply the keys this namespace was sealed with (STEEPLE_KEYS or --keys-file)",
        )
    if isinstance(exc, ConfigurationError):
        hint = None
        if "binding" in str(exc):
            hint = (
                "pass the keys and the --max-definitions / --max-occurrences / "
                "--delivery-window / --lease the namespace was initialized with"
            )
        return CliError(str(exc), code=ExitCode.CONFIG, hint=hint)
    name = type(exc).__name__
    if name == "SchemaVersionMismatchError":
        return CliError(str(exc), code=ExitCode.CONFIG, hint="run `steeple migrate`")
    for candidate in (exc, exc.__cause__):
        if type(candidate).__name__ == "ClientConfigurationError":
            # asyncpg refusing a connection option (e.g. an unknown sslmode).
            return CliError(
                f"PostgreSQL connection settings refused{where}: {candidate}",
                code=ExitCode.CONFIG,
                hint="fix --dsn / STEEPLE_DATABASE_URL",
            )
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
    if isinstance(exc, RecurringStorageError):
        text = str(exc)
        lowered = text.lower()
        if exc.__cause__ is not None and _is_driver_unavailable(exc.__cause__):
            # Checked first: the message starts with the operation ("initialize: ...").
            return CliError(
                text + where,
                code=ExitCode.UNAVAILABLE,
                hint="check that PostgreSQL is running and --dsn is right",
            )
        if "not initialized" in lowered or "does not exist" in lowered or "initialize" in lowered:
            return CliError(
                text + where, code=ExitCode.CONFIG, hint="run `steeple initialize` first"
            )
        if any(word in lowered for word in ("connect", "unavailable", "refused", "timeout")):
            return CliError(
                text + where,
                code=ExitCode.UNAVAILABLE,
                hint="check that PostgreSQL is running and --dsn is right",
            )
        return CliError(text + where, code=ExitCode.UNAVAILABLE)
    if isinstance(exc, BrokerError):
        return CliError(str(exc), code=ExitCode.UNAVAILABLE, hint="check the broker")
    if _is_driver_unavailable(exc):
        detail = str(exc) or name
        return CliError(
            f"cannot reach PostgreSQL{where}: {detail}",
            code=ExitCode.UNAVAILABLE,
            hint="check that the server is running and --dsn / STEEPLE_DATABASE_URL is right",
        )
    if isinstance(exc, SteepleError):
        return CliError(str(exc), code=ExitCode.FAILED)
    if type(exc).__module__.startswith(("asyncpg", "psycopg")):
        return CliError(f"PostgreSQL refused{where}: {exc}", code=ExitCode.FAILED)
    return CliError(f"unexpected {name}: {exc}", code=ExitCode.FAILED)


def describe(value: Any) -> str:
    """Short text for a value in a message."""
    return repr(value) if isinstance(value, str) else str(value)
