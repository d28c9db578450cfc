"""The PostgreSQL recurring-publication store (seed 000) on asyncpg.

The domain core makes every decision (calendar, policies, leases, lifecycle, backoff);
this module does storage, locking and atomicity. Each call is one transaction that first
locks the namespace's control row, so all work in a namespace is serialized and shares
one recorded time. Broker publication never happens inside a transaction.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import heapq
import hmac
import logging
from collections.abc import Awaitable, Callable, Mapping
from datetime import datetime, timedelta
from typing import Any, Protocol, Self, TypeVar, runtime_checkable

import asyncpg
import attrs
from asyncpg.transaction import Transaction

from steeple.core import leases, limits
from steeple.core.calendar import CronCalendar
from steeple.core.config import RecurringConfig, RecurringDefinition
from steeple.core.entropy import SystemRandom
from steeple.core.errors import (
    BrokerError,
    InvalidTransitionError,
    KeyringError,
    RecurringCapacityError,
    RecurringConfigurationError,
    RecurringConflictError,
    RecurringDeadlineError,
    RecurringError,
    RecurringInvalidStateError,
    RecurringNotFoundError,
    RecurringRelayError,
    RecurringStorageError,
    RelayAcknowledgementError,
    RelayBrokerError,
    RelayBrokerTimeoutError,
    RelayLeaseLostError,
)
from steeple.core.idempotency import PUBLISH_PURPOSE, idempotency_key
from steeple.core.messages import BrokerReceipt, ScheduledMessage
from steeple.core.occurrences import OccurrenceEvent, OccurrenceState, transition
from steeple.core.policies import MissedRunPolicy, plan_tick, validate_budget
from steeple.core.ports import Clock, MessageBroker, RandomSource, Sealer
from steeple.core.records import Lease, OccurrenceInfo, Page, ScheduleInfo, TickResult
from steeple.postgres._durability import (
    AnyConnection,
    DurabilityProblem,
    check_privileges,
    check_schema_name,
    check_server_durability,
    check_tables_permanent,
    check_transport,
    quote_ident,
    write_refusal,
)
from steeple.postgres.recurring import _codec
from steeple.postgres.recurring._sql import (
    RUNTIME_PRIVILEGES,
    SCHEMA_VERSION,
    TABLES,
    Queries,
    package_sql,
)

__all__ = ["PostgresRecurringStore"]

_log = logging.getLogger("steeple.postgres.recurring")

T = TypeVar("T")

PURPOSE_DEFINITION = "definition"
PURPOSE_OCCURRENCE = "occurrence"
PURPOSE_BINDING = "binding"

_CALL_DEADLINE = limits.CALL_DEADLINE.total_seconds()
_POOL_DEADLINE = limits.POOL_DEADLINE.total_seconds()
_PUBLISH_DEADLINE = limits.PUBLISH_DEADLINE.total_seconds()
_RELEASE_DEADLINE = 1.0
_DRIVER_ERRORS = (
    TimeoutError,
    asyncpg.PostgresError,
    asyncpg.InterfaceError,
    asyncpg.exceptions.InternalClientError,
    OSError,
)
"""What the driver and the network raise; mapped to typed storage errors at the boundary."""
_LINK_ERRORS = (
    asyncpg.PostgresConnectionError,
    asyncpg.InterfaceError,
    asyncpg.exceptions.InternalClientError,
    OSError,
)
"""Errors of a connection that is gone (as opposed to a server that answered)."""
_SERVER_GONE = (
    asyncpg.PostgresConnectionError,
    asyncpg.exceptions.AdminShutdownError,
    asyncpg.exceptions.CrashShutdownError,
    asyncpg.exceptions.CannotConnectNowError,
)
"""Answers meaning the server ended (or is ending) the session: the link is dead too."""
_ANSWERED = (RecurringError, RecurringRelayError, KeyringError, asyncpg.PostgresError)
"""Failures after which the link may still be alive (a PostgresConnectionError is not)."""
_MS = str(int(limits.POOL_DEADLINE / timedelta(milliseconds=1)))

SERVER_SETTINGS: Mapping[str, str] = {
    "statement_timeout": _MS,
    "lock_timeout": _MS,
    # A worker frozen inside a transaction (SIGSTOP, a blocked loop) must not hold the
    # namespace's control row forever: the server ends such a session.
    "idle_in_transaction_session_timeout": str(3 * int(_MS)),
    # A client that goes silent mid-statement (Parse/Flush sent, nothing more) leaves the
    # backend "active", so neither timeout above fires; only TCP notices, after ~2 h by
    # default. Keepalives and a user timeout bound that to well under a minute.
    "tcp_keepalives_idle": "10",
    "tcp_keepalives_interval": "5",
    "tcp_keepalives_count": "3",
    "tcp_user_timeout": "30000",
    "application_name": "steeple-recurring",
}
"""Session settings of every connection the store opens (5 s statement and lock waits)."""


@runtime_checkable
class _BindingSealer(Protocol):
    """The keyring's configuration-binding API, used when the sealer offers it."""

    def seal_binding(self, config_fields: Mapping[str, Any], *, namespace: str) -> bytes: ...

    def open_binding(
        self, sealed: bytes, *, namespace: str, expected: Mapping[str, Any]
    ) -> object: ...


@functools.lru_cache(maxsize=1024)
def _calendar(expression: str) -> CronCalendar:
    # Parsing is pure and the expressions of a namespace repeat on every tick.
    return CronCalendar.parse(expression)


def _capability_digest(capability: bytes) -> bytes:
    # Only a digest is stored: a database reader cannot act as the lease holder.
    return hashlib.sha256(capability).digest()


def _affected(status: str) -> int:
    try:
        return int(status.rsplit(" ", 1)[-1])
    except ValueError:
        return 0


def _short_error(exc: BaseException) -> str:
    text = str(exc).replace("\n", " ")
    return f"{type(exc).__name__}: {text[:200]}"


class _StaleConnection(Exception):
    """Internal: the pooled connection was dead before the transaction began."""


@attrs.define
class _Tx:
    """One locked transaction: its connection, adopted time and counter changes."""

    conn: AnyConnection
    now: datetime
    definition_count: int
    occurrence_count: int
    definition_delta: int = 0
    occurrence_delta: int = 0


@attrs.define
class _Planned:
    """A due definition while a tick plans it."""

    name: str
    sealed: bytes
    calendar: CronCalendar
    policy: MissedRunPolicy
    cursor: datetime
    next_due: datetime | None
    exhausted: bool = False
    changed: bool = False


@attrs.frozen
class _Prepared:
    message: ScheduledMessage
    key: str
    remaining: timedelta
    attempts: int


@attrs.frozen
class _Unopenable:
    error: BaseException


def _map_driver_error(exc: BaseException, what: str) -> RecurringStorageError:
    if isinstance(exc, TimeoutError):
        return RecurringDeadlineError(
            f"{what}: the storage deadline passed (10 s per call, 5 s to acquire a connection)"
        )
    if isinstance(exc, asyncpg.LockNotAvailableError):
        return RecurringDeadlineError(
            f"{what}: a lock wait exceeded lock_timeout (5 s); another session holds the "
            "namespace's control row"
        )
    if isinstance(exc, asyncpg.QueryCanceledError):
        return RecurringDeadlineError(f"{what}: a statement exceeded statement_timeout (5 s)")
    refusal = write_refusal(exc)
    if refusal is not None:
        return RecurringStorageError(f"{what}: {refusal[1]}")
    if isinstance(exc, asyncpg.PostgresError):
        state = getattr(exc, "sqlstate", "?")
        return RecurringStorageError(
            f"{what}: PostgreSQL failed (SQLSTATE {state}, {type(exc).__name__})"
        )
    return RecurringStorageError(f"{what}: the database connection failed ({type(exc).__name__})")


async def _rollback(conn: AnyConnection, transaction: Transaction) -> bool:
    """Roll back after an answered failure; return whether the connection is reusable."""
    try:
        if conn.is_closed():
            return False
        async with asyncio.timeout(_RELEASE_DEADLINE):
            if conn.is_in_transaction():
                await transaction.rollback()
    except _DRIVER_ERRORS:
        return False
    return True


async def _no_reset(conn: asyncpg.Connection[asyncpg.Record]) -> None:
    # Sessions are never changed (settings are transaction-local, no session locks or
    # LISTEN), so the pool's per-release reset round trip is not needed.
    del conn


def _problem(exc: DurabilityProblem) -> RecurringError:
    if exc.setting in {"sslmode", "dsn"}:
        return RecurringConfigurationError(str(exc))
    return RecurringStorageError(str(exc))


async def _check_new_connection(conn: asyncpg.Connection[asyncpg.Record]) -> None:
    # Every pooled connection is checked when opened: a role or session setting such as
    # synchronous_commit=off may appear after the store was connected.
    try:
        await check_server_durability(conn)
    except DurabilityProblem as exc:
        raise RecurringStorageError(str(exc)) from None


def _check_schema_name(schema: object) -> str:
    if not isinstance(schema, str):
        raise RecurringConfigurationError("schema must be a str")
    try:
        quote_ident(schema)
    except ValueError as exc:
        raise RecurringConfigurationError(str(exc)) from None
    try:
        check_schema_name(schema)
    except DurabilityProblem as exc:
        raise RecurringConfigurationError(str(exc)) from None
    return schema


def _check_inputs(config: object, keyring: object, clock: object) -> None:
    if not isinstance(config, RecurringConfig):
        raise RecurringConfigurationError("config must be a RecurringConfig")
    if not all(callable(getattr(keyring, m, None)) for m in ("seal", "open")):
        raise RecurringConfigurationError("keyring must implement the Sealer protocol")
    if not callable(getattr(clock, "now", None)):
        raise RecurringConfigurationError("clock must implement the Clock protocol")


def _check_open_args(
    dsn: str, config: object, keyring: object, clock: object, schema: object
) -> None:
    # What initialize and connect both check before touching the network.
    _check_inputs(config, keyring, clock)
    _check_schema_name(schema)
    try:
        check_transport(dsn)
    except DurabilityProblem as exc:
        raise _problem(exc) from None


def _seal_binding(sealer: Sealer, config: RecurringConfig) -> bytes:
    if isinstance(sealer, _BindingSealer):
        return sealer.seal_binding(config.fingerprint(), namespace=config.namespace)
    return sealer.seal(
        _codec.encode_binding(config),
        namespace=config.namespace,
        purpose=PURPOSE_BINDING,
        identity=config.namespace,
    )


def _verify_binding(sealer: Sealer, config: RecurringConfig, sealed: bytes) -> None:
    """Fail closed unless ``sealed`` authenticates and matches ``config``."""
    namespace = config.namespace
    try:
        if isinstance(sealer, _BindingSealer):
            sealer.open_binding(sealed, namespace=namespace, expected=config.fingerprint())
            return
        plaintext = sealer.open(
            sealed, namespace=namespace, purpose=PURPOSE_BINDING, identity=namespace
        )
    except KeyringError as exc:
        raise RecurringConfigurationError(
            f"namespace {namespace!r}: the stored configuration binding does not match the "
            f"supplied configuration and keyring ({type(exc).__name__}: {exc})"
        ) from exc
    if not hmac.compare_digest(plaintext, _codec.encode_binding(config)):
        raise RecurringConfigurationError(
            f"namespace {namespace!r} was initialized with a different configuration; "
            "supply the configuration it was initialized with"
        )


async def _install(
    conn: AnyConnection, schema: str, config: RecurringConfig, keyring: Sealer, clock: Clock
) -> None:
    """Create the schema (once) and the namespace (once), serialized by an advisory lock."""
    quoted = quote_ident(schema)
    queries = Queries.for_schema(quoted)
    transaction = conn.transaction()
    await transaction.start()
    await conn.execute("SET LOCAL synchronous_commit = on")
    await conn.execute(
        "SELECT pg_advisory_xact_lock(hashtextextended($1, 0))",
        f"steeple.recurring.initialize:{schema}",
    )
    installed = await conn.fetchval(
        "SELECT to_regclass($1) IS NOT NULL", f"{quoted}.recurring_schema_version"
    )
    if not installed:
        await conn.execute(package_sql("schema.sql").replace("{schema}", quoted))
    version = await conn.fetchval(queries.read_version)
    if version != SCHEMA_VERSION:
        raise RecurringStorageError(
            f"schema {schema!r} holds recurring schema version {version}; "
            f"this library uses version {SCHEMA_VERSION}"
        )
    row = await conn.fetchrow(queries.read_namespace + " FOR UPDATE", config.namespace)
    if row is not None:
        _verify_binding(keyring, config, bytes(row["binding"]))
    else:
        await conn.execute(
            queries.insert_namespace,
            config.namespace,
            _seal_binding(keyring, config),
            keyring.primary_key_id,
            clock.now(),
        )
    await transaction.commit()


@attrs.define(repr=False)
class PostgresRecurringStore:
    """Recurring publications in PostgreSQL, for one namespace, on a private asyncpg pool.

    Build it with :meth:`initialize` (deployment) or :meth:`connect` (workers). Every call
    runs in one transaction with a 10-second deadline; the pool holds at most four
    connections, with 5-second acquisition, statement and lock-wait deadlines.

    Attributes:
        warnings: problems found with the runtime role at connect (superuser, table owner,
            CREATE on the schema); also logged.
    """

    _pool: asyncpg.Pool
    _config: RecurringConfig
    _sealer: Sealer
    _clock: Clock
    _random: RandomSource
    _schema: str
    _queries: Queries
    warnings: list[str] = attrs.field(factory=list)
    _closed: bool = False

    # --- construction --------------------------------------------------------------------

    @classmethod
    async def initialize(
        cls,
        dsn: str,
        config: RecurringConfig,
        keyring: Sealer,
        clock: Clock,
        *,
        schema: str = "steeple",
        random: RandomSource | None = None,
    ) -> Self:
        """Create the fixed schema and the namespace once, then connect.

        Run it as the deployment role. Concurrent initializers converge (an advisory lock
        serializes them); initializing an existing namespace with the same configuration
        and keyring is a no-op.

        Raises:
            RecurringConfigurationError: bad arguments, unverified TLS to a remote host, or
                the namespace exists with a different configuration (or keyring).
            RecurringStorageError: the database failed, is not durable, or holds another
                schema version.
            RecurringDeadlineError: a deadline passed.
        """
        _check_open_args(dsn, config, keyring, clock, schema)
        try:
            async with asyncio.timeout(_CALL_DEADLINE):
                conn = await asyncpg.connect(
                    dsn, timeout=_POOL_DEADLINE, server_settings=dict(SERVER_SETTINGS)
                )
                try:
                    await check_server_durability(conn)
                    await _install(conn, schema, config, keyring, clock)
                except BaseException:
                    # Never wait on a ROLLBACK over a link that may be dead: closing the
                    # socket ends the server's transaction.
                    conn.terminate()
                    raise
                await conn.close(timeout=_POOL_DEADLINE)
        except DurabilityProblem as exc:
            raise _problem(exc) from None
        except (RecurringError, KeyringError):
            raise
        except _DRIVER_ERRORS as exc:
            raise _map_driver_error(exc, "initialize") from exc
        return await cls.connect(dsn, config, keyring, clock, schema=schema, random=random)

    @classmethod
    async def connect(
        cls,
        dsn: str,
        config: RecurringConfig,
        keyring: Sealer,
        clock: Clock,
        *,
        schema: str = "steeple",
        random: RandomSource | None = None,
    ) -> Self:
        """Connect to an initialized namespace; never creates, repairs or changes anything.

        Checks durability (permanent tables, ``fsync``, ``full_page_writes``,
        ``synchronous_commit``, a writable primary), the schema version, the runtime
        role's privileges and the configuration binding.

        Raises:
            RecurringConfigurationError: bad arguments, unverified TLS to a remote host, or
                a configuration/keyring that does not match the namespace's binding.
            RecurringNotFoundError: the namespace was never initialized.
            RecurringStorageError: missing tables, a non-durable setting or table, a
                read-only server, a missing privilege (named), another schema version, or
                a database failure.
            RecurringDeadlineError: a deadline passed.
            RecurringClockError: the clock trails the recorded time by more than 5 s.
        """
        _check_open_args(dsn, config, keyring, clock, schema)
        try:
            async with asyncio.timeout(_CALL_DEADLINE):
                pool = await asyncpg.create_pool(
                    dsn,
                    min_size=0,
                    max_size=limits.POOL_MAX_SIZE,
                    timeout=_POOL_DEADLINE,
                    max_inactive_connection_lifetime=60.0,
                    server_settings=dict(SERVER_SETTINGS),
                    init=_check_new_connection,
                    reset=_no_reset,
                )
        except RecurringError:
            raise
        except _DRIVER_ERRORS as exc:
            raise _map_driver_error(exc, "connect") from exc
        store = cls(
            pool=pool,
            config=config,
            sealer=keyring,
            clock=clock,
            random=random if random is not None else SystemRandom(),
            schema=schema,
            queries=Queries.for_schema(quote_ident(schema)),
        )
        try:
            await store._verify()
        except BaseException:
            pool.terminate()
            raise
        for warning in store.warnings:
            _log.warning("steeple recurring store: %s", warning)
        return store

    async def _verify(self) -> None:
        try:
            async with (
                asyncio.timeout(_CALL_DEADLINE),
                self._pool.acquire(timeout=_POOL_DEADLINE) as conn,
            ):
                await check_server_durability(conn)
                await check_tables_permanent(conn, self._schema, TABLES)
                self.warnings = await check_privileges(conn, self._schema, RUNTIME_PRIVILEGES)
                version = await conn.fetchval(self._queries.read_version)
                if version != SCHEMA_VERSION:
                    raise RecurringStorageError(
                        f"schema {self._schema!r} holds recurring schema version {version}; "
                        f"this library uses version {SCHEMA_VERSION}"
                    )
                row = await conn.fetchrow(self._queries.read_namespace, self._config.namespace)
        except DurabilityProblem as exc:
            raise _problem(exc) from None
        except (RecurringError, KeyringError):
            raise
        except _DRIVER_ERRORS as exc:
            raise _map_driver_error(exc, "connect") from exc
        if row is None:
            raise RecurringNotFoundError(
                f"namespace {self._config.namespace!r} does not exist in schema "
                f"{self._schema!r}; run initialize with the deployment role first"
            )
        _verify_binding(self._sealer, self._config, bytes(row["binding"]))
        leases.adopt_time(row["recorded_time"], self._clock.now())

    # --- lifecycle -----------------------------------------------------------------------

    @property
    def config(self) -> RecurringConfig:
        """The namespace's configuration."""
        return self._config

    @property
    def namespace(self) -> str:
        """The namespace this store serves."""
        return self._config.namespace

    async def close(self) -> None:
        """Close this store's pool (not other stores' pools). Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            async with asyncio.timeout(_CALL_DEADLINE):
                await self._pool.close()
        except TimeoutError:
            self._pool.terminate()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __repr__(self) -> str:
        return (
            f"PostgresRecurringStore(namespace={self._config.namespace!r}, "
            f"schema={self._schema!r}, closed={self._closed})"
        )

    # --- the transaction every call runs in ----------------------------------------------

    async def _run(self, what: str, body: Callable[[_Tx], Awaitable[T]]) -> T:
        if self._closed:
            raise RecurringStorageError(f"{what}: the store is closed")
        deadline = asyncio.get_running_loop().time() + _CALL_DEADLINE
        for retry in (False, True):
            try:
                return await self._attempt(what, body, deadline)
            except _StaleConnection as stale:
                # A pooled connection died while idle (server restart, terminated
                # backend); nothing was sent but BEGIN, so one more attempt on a fresh
                # one is safe.
                await self._forget_connections()
                if retry:
                    cause = stale.__cause__ or stale
                    raise _map_driver_error(cause, what) from cause
            except RecurringStorageError as exc:
                if isinstance(exc.__cause__, _LINK_ERRORS + _SERVER_GONE):
                    await self._forget_connections()
                raise
        raise AssertionError("unreachable")  # pragma: no cover

    async def _forget_connections(self) -> None:
        # Whatever killed one pooled connection (a restart, an administrator terminating
        # backends) has usually killed its idle siblings too, and their sockets can still
        # look open. Expiring the pool makes each one reconnect on its next acquire
        # instead of failing the next calls one corpse at a time.
        # (It only bumps the pool's generation: nothing here waits on the network.)
        await self._pool.expire_connections()

    async def _attempt(self, what: str, body: Callable[[_Tx], Awaitable[T]], deadline: float) -> T:
        try:
            async with asyncio.timeout_at(deadline):
                conn = await self._pool.acquire(timeout=_POOL_DEADLINE)
        except _DRIVER_ERRORS as exc:
            raise _map_driver_error(exc, what) from exc
        healthy = False
        transaction = conn.transaction()
        try:
            try:
                async with asyncio.timeout_at(deadline):
                    result = await self._transaction(conn, transaction, body)
                healthy = True
                return result
            except _ANSWERED as exc:
                if not isinstance(exc, asyncpg.PostgresConnectionError):
                    # The server answered, so the link is alive: roll back over it (bounded).
                    healthy = await _rollback(conn, transaction)
                raise
        except (RecurringError, RecurringRelayError, KeyringError, _StaleConnection):
            raise
        except _DRIVER_ERRORS as exc:
            raise _map_driver_error(exc, what) from exc
        finally:
            if not healthy:
                # A deadline, a cancellation or a broken link: never wait for a ROLLBACK
                # over it. Closing the socket ends the server's transaction (or, if the
                # link is blackholed, idle_in_transaction_session_timeout does). A link
                # that broke by itself was already handed back to the pool by asyncpg.
                with contextlib.suppress(asyncpg.InterfaceError):
                    conn.terminate()
            await self._pool.release(conn, timeout=_RELEASE_DEADLINE)

    async def _transaction(
        self, conn: AnyConnection, transaction: Transaction, body: Callable[[_Tx], Awaitable[T]]
    ) -> T:
        q = self._queries
        namespace = self._config.namespace
        try:
            await transaction.start()
        except _LINK_ERRORS as exc:
            raise _StaleConnection() from exc
        row = await conn.fetchrow(q.lock_namespace, namespace)
        if row is None:
            raise RecurringNotFoundError(
                f"namespace {namespace!r} no longer exists in schema {self._schema!r}"
            )
        # The clock is read only now, after the lock wait, so time spent queued behind
        # other instances is never judged as earlier.
        now = leases.adopt_time(row["recorded_time"], self._clock.now())
        _verify_binding(self._sealer, self._config, bytes(row["binding"]))
        if row["binding_key_id"] != self._sealer.primary_key_id:
            # First operation after a rotation: re-seal under the current primary so the
            # initial key is no longer needed for the binding.
            await conn.execute(
                q.reseal_binding,
                namespace,
                _seal_binding(self._sealer, self._config),
                self._sealer.primary_key_id,
            )
        tx = _Tx(conn, now, row["definition_count"], row["occurrence_count"])
        result = await body(tx)
        await conn.execute(
            q.touch_namespace, namespace, tx.now, tx.definition_delta, tx.occurrence_delta
        )
        await transaction.commit()
        return result

    def _open(self, sealed: bytes, purpose: str, identity: str) -> bytes:
        return self._sealer.open(
            bytes(sealed),
            namespace=self._config.namespace,
            purpose=purpose,
            identity=identity,
        )

    def _seal(self, plaintext: bytes, purpose: str, identity: str) -> bytes:
        return self._sealer.seal(
            plaintext, namespace=self._config.namespace, purpose=purpose, identity=identity
        )

    # --- definitions ---------------------------------------------------------------------

    async def create(self, definition: RecurringDefinition) -> ScheduleInfo:
        """Create an immutable definition, or replay an identical earlier creation.

        Returns:
            The definition's metadata (the original metadata on a replay).

        Raises:
            RecurringConfigurationError: ``definition`` is not a RecurringDefinition.
            RecurringConflictError: the name exists (active or cancelled) with a different
                definition.
            RecurringCapacityError: the namespace holds ``max_definitions`` already.
            KeyringError: the stored definition cannot be opened (e.g. its key is missing).
            RecurringStorageError: the database failed.
            RecurringDeadlineError: a storage deadline passed.
            RecurringClockError: the clock trails the recorded time by more than 5 s.
        """
        if not isinstance(definition, RecurringDefinition):
            raise RecurringConfigurationError("create needs a RecurringDefinition")
        plaintext = _codec.encode_definition(definition)
        name = definition.name
        q = self._queries
        namespace = self._config.namespace

        async def body(tx: _Tx) -> ScheduleInfo:
            row = await tx.conn.fetchrow(q.select_definition, namespace, name)
            if row is not None:
                stored = self._open(row["sealed"], PURPOSE_DEFINITION, name)
                if not hmac.compare_digest(stored, plaintext):
                    raise RecurringConflictError(
                        f"definition {name!r} already exists with different content; "
                        "definitions are immutable: cancel it and create a new name"
                    )
                return _codec.schedule_info(row)
            if tx.definition_count >= self._config.max_definitions:
                raise RecurringCapacityError(
                    f"namespace {namespace!r} holds {tx.definition_count} definitions (cancelled "
                    f"ones included), its quota of {self._config.max_definitions}"
                )
            created = await tx.conn.fetchrow(
                q.insert_definition,
                namespace,
                name,
                self._seal(plaintext, PURPOSE_DEFINITION, name),
                self._sealer.primary_key_id,
                definition.cron.expression,
                definition.policy.value,
                definition.first_after,
                definition.message.topic,
                definition.message.message_type,
                definition.first_due,
                tx.now,
            )
            assert created is not None
            tx.definition_delta = 1
            return _codec.schedule_info(created)

        return await self._run("create", body)

    async def cancel(self, name: str) -> ScheduleInfo:
        """Cancel a definition permanently; its name stays reserved and counts to the quota.

        Its unfinished occurrences are cancelled and their content erased at once. A
        publication already in flight cannot be recalled. Cancelling twice is a no-op.

        Raises:
            RecurringNotFoundError: no definition of that name in this namespace.
            RecurringStorageError: the database failed.
            RecurringDeadlineError: a storage deadline passed.
            RecurringClockError: the clock trails the recorded time by more than 5 s.
        """
        if not isinstance(name, str):
            raise RecurringConfigurationError("a definition name is a str")
        q = self._queries
        namespace = self._config.namespace

        async def body(tx: _Tx) -> ScheduleInfo:
            row = await tx.conn.fetchrow(q.select_definition, namespace, name)
            if row is None:
                raise RecurringNotFoundError(f"no definition named {name!r} in {namespace!r}")
            # Work whose window already ended is expired, not cancelled.
            await tx.conn.execute(q.expire_occurrences, namespace, tx.now)
            if row["state"] == "cancelled":
                return _codec.schedule_info(row)
            updated = await tx.conn.fetchrow(q.cancel_definition, namespace, name, tx.now)
            await tx.conn.execute(q.cancel_occurrences, namespace, name, tx.now)
            assert updated is not None
            return _codec.schedule_info(updated)

        return await self._run("cancel", body)

    async def schedules(self, after: str | None = None, limit: int = 100) -> Page[ScheduleInfo]:
        """List definitions' metadata by name, after the exclusive cursor ``after``.

        Raises:
            RecurringConfigurationError: ``limit`` outside 1..100.
            RecurringStorageError: the database failed.
            RecurringDeadlineError: a storage deadline passed.
            RecurringClockError: the clock trails the recorded time by more than 5 s.
        """
        limit = validate_budget(limit, "limit")
        if after is not None and not isinstance(after, str):
            raise RecurringConfigurationError("a cursor is a str or None")
        q = self._queries

        async def body(tx: _Tx) -> Page[ScheduleInfo]:
            rows = await tx.conn.fetch(q.list_definitions, self._config.namespace, after, limit + 1)
            items = [_codec.schedule_info(r) for r in rows[:limit]]
            more = len(rows) > limit
            return Page(items=items, next_cursor=items[-1].name if more else None)

        return await self._run("schedules", body)

    # --- tick ----------------------------------------------------------------------------

    async def tick(self, budget: int) -> TickResult:
        """Materialize due occurrences, oldest first, at most ``budget`` (1-100).

        Materialization and cursor advancement commit together; when the occurrence
        quota cannot hold the whole batch, nothing is stored.

        Raises:
            RecurringConfigurationError: ``budget`` outside 1..100.
            RecurringCapacityError: the batch would exceed ``max_occurrences``.
            KeyringError: a definition cannot be opened (its key is missing or it was
                tampered with).
            RecurringStorageError: the database failed.
            RecurringDeadlineError: a storage deadline passed.
            RecurringClockError: the clock trails the recorded time by more than 5 s.
        """
        budget = validate_budget(budget)
        q = self._queries
        namespace = self._config.namespace

        async def body(tx: _Tx) -> TickResult:
            rows = await tx.conn.fetch(q.due_definitions, namespace, tx.now, budget)
            planned = {
                r["name"]: _Planned(
                    name=r["name"],
                    sealed=bytes(r["sealed"]),
                    calendar=_calendar(r["cron"]),
                    policy=MissedRunPolicy(r["policy"]),
                    cursor=r["cursor_at"],
                    next_due=r["next_due_at"],
                )
                for r in rows
            }
            # Merge the definitions' due instants so the oldest are materialized first
            # across the namespace, one planned instant at a time.
            heap = [(p.next_due, p.name) for p in planned.values() if p.next_due is not None]
            heapq.heapify(heap)
            emitted: list[tuple[str, datetime]] = []
            while heap and len(emitted) < budget:
                _, name = heapq.heappop(heap)
                p = planned[name]
                plan = plan_tick(p.policy, p.calendar, p.cursor, tx.now, 1)
                p.changed = True
                if plan.due:
                    emitted.append((name, plan.due[0]))
                p.cursor = plan.cursor if plan.cursor is not None else max((p.cursor, *plan.due))
                p.exhausted = plan.exhausted
                p.next_due = plan.next_due
                if p.next_due is not None and p.next_due <= tx.now and plan.due:
                    heapq.heappush(heap, (p.next_due, name))
            if tx.occurrence_count + len(emitted) > self._config.max_occurrences:
                raise RecurringCapacityError(
                    f"materializing {len(emitted)} occurrences would exceed the quota of "
                    f"{self._config.max_occurrences} ({tx.occurrence_count} stored); nothing "
                    "was materialized: tick a smaller budget or purge terminal occurrences"
                )
            messages: dict[str, bytes] = {}
            ids: list[str] = []
            contents: list[bytes] = []
            for name, _due in emitted:
                if name not in messages:
                    opened = self._open(planned[name].sealed, PURPOSE_DEFINITION, name)
                    messages[name] = _codec.definition_message_plaintext(opened)
                occurrence_id = leases.occurrence_id_for(leases.new_generation(self._random))
                ids.append(occurrence_id)
                contents.append(self._seal(messages[name], PURPOSE_OCCURRENCE, occurrence_id))
            if emitted:
                await tx.conn.execute(
                    q.insert_occurrences,
                    namespace,
                    leases.window_end(tx.now, self._config.delivery_window),
                    self._sealer.primary_key_id,
                    tx.now,
                    ids,
                    [name for name, _ in emitted],
                    [due for _, due in emitted],
                    contents,
                )
            changed = [p for p in planned.values() if p.changed]
            if changed:
                await tx.conn.execute(
                    q.advance_definitions,
                    namespace,
                    [p.name for p in changed],
                    [p.cursor for p in changed],
                    [None if p.exhausted else p.next_due for p in changed],
                    ["exhausted" if p.exhausted else "active" for p in changed],
                )
            tx.occurrence_delta = len(emitted)
            return TickResult(
                materialized=len(emitted),
                occurrence_ids=tuple(ids),
                exhausted=tuple(
                    dict.fromkeys(name for name, _ in emitted if planned[name].exhausted)
                ),
            )

        return await self._run("tick", body)

    # --- claim ---------------------------------------------------------------------------

    async def claim(self, limit: int) -> list[Lease]:
        """Lease up to ``limit`` (1-100) publishable occurrences, oldest due first.

        Each lease gets a fresh random capability and a new revision, fencing any earlier
        holder, and ends no later than the delivery window. Expired work is classified
        (and its content erased) first. Leases already expired when the claim commits
        are not returned (they are reclaimed normally) and do not fail the batch.

        Raises:
            RecurringConfigurationError: ``limit`` outside 1..100.
            RecurringStorageError: the database failed.
            RecurringDeadlineError: a storage deadline passed.
            RecurringClockError: the clock trails the recorded time by more than 5 s.
        """
        limit = validate_budget(limit, "limit")
        q = self._queries
        namespace = self._config.namespace
        lease_duration = self._config.lease_duration

        async def body(tx: _Tx) -> tuple[list[Lease], datetime]:
            await tx.conn.execute(q.expire_occurrences, namespace, tx.now)
            rows = await tx.conn.fetch(q.claimable, namespace, tx.now, limit)
            ids: list[str] = []
            capabilities: dict[str, bytes] = {}
            expiries: list[datetime] = []
            for r in rows:
                expires = leases.lease_expiry(tx.now, lease_duration, r["window_ends_at"])
                if expires is None:
                    continue
                ids.append(r["id"])
                capabilities[r["id"]] = leases.new_capability(self._random)
                expiries.append(expires)
            if not ids:
                return [], tx.now
            updated = await tx.conn.fetch(
                q.lease_occurrences,
                namespace,
                tx.now,
                ids,
                [_capability_digest(capabilities[i]) for i in ids],
                expiries,
            )
            by_id = {u["id"]: u for u in updated}
            granted = [
                Lease(
                    occurrence_id=i,
                    expires_at=by_id[i]["lease_expires_at"],
                    revision=by_id[i]["lease_revision"],
                    capability=capabilities[i],
                )
                for i in ids
                if i in by_id
            ]
            return granted, tx.now

        granted, claimed_at = await self._run("claim", body)
        # Judged after the commit: a lease that lapsed while the claim committed is not
        # handed out; its occurrence stays claimable for the next claim.
        after = max(claimed_at, self._clock.now())
        return [lease for lease in granted if leases.is_live(lease.expires_at, after)]

    # --- relay ---------------------------------------------------------------------------

    def _holds(self, row: asyncpg.Record | None, lease: Lease) -> bool:
        if row is None or row["lease_capability"] is None:
            return False
        matches = leases.capability_matches(
            bytes(row["lease_capability"]), _capability_digest(lease.capability)
        )
        return matches and row["lease_revision"] == lease.revision

    async def relay(self, lease: Lease, broker: MessageBroker) -> BrokerReceipt:
        """Publish a leased occurrence and record the outcome.

        Transaction one re-checks the live lease and opens the content, then commits;
        the broker is called outside any transaction, bounded by the remaining lease and
        10 s, always with the same message and idempotency key; transaction two records
        the outcome, fenced by the lease's capability and revision.

        Returns:
            The broker's receipt. If the definition was cancelled while the message was in
            flight, the occurrence stays cancelled and the receipt is still returned.

        Raises:
            RelayLeaseLostError: the lease expired, was fenced by a newer claim, or the
                occurrence is no longer leased (nothing was published, or a publication by
                a stale holder is not recorded).
            RelayAcknowledgementError: the broker accepted but the acknowledgement is
                uncertain (carries ``.receipt``); the occurrence is retried with the same key.
            RelayBrokerTimeoutError: the broker did not answer in time (retried later).
            RelayBrokerError: the broker failed; ``permanent`` failures become dead letters.
            KeyringError: the content cannot be opened (the occurrence is dead-lettered).
            RecurringStorageError: the database failed.
            RecurringDeadlineError: a storage deadline passed.
            RecurringClockError: the clock trails the recorded time by more than 5 s.
        """
        if not isinstance(lease, Lease):
            raise TypeError("relay needs a Lease returned by claim")
        q = self._queries
        namespace = self._config.namespace
        occurrence_id = lease.occurrence_id

        async def start(tx: _Tx) -> _Prepared | _Unopenable:
            row = await tx.conn.fetchrow(q.read_occurrence, namespace, occurrence_id)
            held = self._holds(row, lease)
            if (
                not held
                or row is None
                or row["state"] != OccurrenceState.LEASED.value
                or not leases.is_live(row["lease_expires_at"], tx.now)
            ):
                raise RelayLeaseLostError(
                    f"the lease on occurrence {occurrence_id} is no longer live (expired, "
                    "fenced by a newer claim, or the occurrence moved on)"
                )
            try:
                if row["content"] is None:
                    raise RecurringStorageError("the occurrence has no content")
                message = _codec.decode_message(
                    self._open(row["content"], PURPOSE_OCCURRENCE, occurrence_id)
                )
            except (KeyringError, RecurringStorageError) as exc:
                final = transition(OccurrenceState.LEASED, OccurrenceEvent.PUBLISH_FAILED_FINAL)
                assert isinstance(final, OccurrenceState)
                await tx.conn.execute(
                    q.mark_failed,
                    namespace,
                    occurrence_id,
                    final.value,
                    None,
                    f"content cannot be opened ({type(exc).__name__})",
                    tx.now,
                )
                return _Unopenable(exc)
            attempts = await tx.conn.fetchval(q.start_attempt, namespace, occurrence_id, tx.now)
            key = idempotency_key(
                purpose=PUBLISH_PURPOSE,
                namespace=namespace,
                definition_name=row["definition_name"],
                due_at=row["due_at"],
                generation=bytes.fromhex(occurrence_id),
            )
            return _Prepared(message, key, row["lease_expires_at"] - tx.now, attempts)

        prepared = await self._run("relay", start)
        if isinstance(prepared, _Unopenable):
            raise prepared.error
        timeout = min(prepared.remaining.total_seconds(), _PUBLISH_DEADLINE)
        try:
            async with asyncio.timeout(timeout):
                receipt = await broker.publish(
                    prepared.message, idempotency_key=prepared.key, timeout=timeout
                )
        except RelayAcknowledgementError as exc:
            await self._record_failure(lease, exc, permanent=False)
            raise
        except (BrokerError, RelayBrokerError) as exc:
            permanent = bool(getattr(exc, "permanent", False))
            decision = await self._record_failure(lease, exc, permanent=permanent)
            error_type = (
                RelayBrokerTimeoutError if isinstance(exc, TimeoutError) else (RelayBrokerError)
            )
            raise error_type(
                f"publication of occurrence {occurrence_id} failed ({type(exc).__name__}); "
                f"{decision}",
                permanent=permanent,
            ) from exc
        except (TimeoutError, ConnectionError) as exc:
            decision = await self._record_failure(lease, exc, permanent=False)
            error_type = (
                RelayBrokerTimeoutError if isinstance(exc, TimeoutError) else (RelayBrokerError)
            )
            raise error_type(
                f"publication of occurrence {occurrence_id} did not complete within "
                f"{timeout:.3f} s ({type(exc).__name__}); {decision}",
                permanent=False,
            ) from exc

        async def finish(tx: _Tx) -> None:
            row = await tx.conn.fetchrow(q.read_occurrence, namespace, occurrence_id)
            if not self._holds(row, lease) or row is None:
                raise RelayLeaseLostError(
                    f"occurrence {occurrence_id} was claimed by another worker while this one "
                    "published it; the broker accepted it under the same idempotency key, the "
                    "new holder records the outcome"
                )
            state = OccurrenceState(row["state"])
            if state is OccurrenceState.CANCELLED:
                return  # cancelled after the final check: the publication cannot be recalled
            try:
                transition(state, OccurrenceEvent.PUBLISHED)
            except InvalidTransitionError:
                raise RelayLeaseLostError(
                    f"occurrence {occurrence_id} is {state.value}; this lease cannot record "
                    "its publication"
                ) from None
            await tx.conn.execute(q.mark_published, namespace, occurrence_id, tx.now)

        await self._run("relay", finish)
        return receipt

    async def _record_failure(self, lease: Lease, exc: BaseException, *, permanent: bool) -> str:
        """Record a failed publication (fenced); return a description of what follows."""
        q = self._queries
        namespace = self._config.namespace
        occurrence_id = lease.occurrence_id

        async def body(tx: _Tx) -> str:
            row = await tx.conn.fetchrow(q.read_occurrence, namespace, occurrence_id)
            # A stale (fenced) holder records nothing: it can neither retry nor bury the
            # new holder's occurrence. The caller still learns what the broker said.
            if not self._holds(row, lease) or row is None:
                return "nothing recorded: the lease was fenced by a newer claim"
            state = OccurrenceState(row["state"])
            if state is OccurrenceState.CANCELLED:
                return "the occurrence was cancelled meanwhile"
            if state is not OccurrenceState.LEASED:
                return f"nothing recorded: the occurrence is {state.value}"
            decision = leases.after_publish_failure(
                max(row["attempts"], 1),
                tx.now,
                row["window_ends_at"],
                permanent,
                draw=self._random.random(),
            )
            event = (
                OccurrenceEvent.PUBLISH_FAILED_RETRYABLE
                if decision.state is OccurrenceState.RETRY_WAIT
                else OccurrenceEvent.PUBLISH_FAILED_FINAL
            )
            new_state = transition(state, event)
            assert isinstance(new_state, OccurrenceState)
            await tx.conn.execute(
                q.mark_failed,
                namespace,
                occurrence_id,
                new_state.value,
                decision.next_attempt_at,
                _short_error(exc),
                tx.now,
            )
            if decision.next_attempt_at is not None:
                return f"retry after {decision.next_attempt_at.isoformat()}"
            return f"dead letter ({decision.reason})"

        return await self._run("relay", body)

    # --- operator actions and listings ---------------------------------------------------

    async def retry_failed(self, occurrence_id: str) -> OccurrenceInfo:
        """Give a dead occurrence a fresh automatic attempt budget inside its window.

        Success is reported once the reset is committed.

        Raises:
            RecurringNotFoundError: no such occurrence in this namespace (or purged).
            RecurringInvalidStateError: the occurrence is not dead (published, cancelled,
                expired and live work cannot be revived), or its window has ended.
            RecurringStorageError: the database failed.
            RecurringDeadlineError: a storage deadline passed.
            RecurringClockError: the clock trails the recorded time by more than 5 s.
        """
        if not isinstance(occurrence_id, str):
            raise RecurringConfigurationError("an occurrence id is a str")
        q = self._queries
        namespace = self._config.namespace

        async def body(tx: _Tx) -> OccurrenceInfo:
            await tx.conn.execute(q.expire_occurrences, namespace, tx.now)
            row = await tx.conn.fetchrow(q.read_occurrence, namespace, occurrence_id)
            if row is None:
                raise RecurringNotFoundError(
                    f"no occurrence {occurrence_id!r} in namespace {namespace!r}"
                )
            state = OccurrenceState(row["state"])
            try:
                transition(state, OccurrenceEvent.OPERATOR_RETRY)
            except InvalidTransitionError:
                raise RecurringInvalidStateError(
                    f"occurrence {occurrence_id} is {state.value}; only dead occurrences "
                    "inside their delivery window can be retried"
                ) from None
            updated = await tx.conn.fetchrow(q.operator_retry, namespace, occurrence_id, tx.now)
            assert updated is not None
            return _codec.occurrence_info(updated)

        return await self._run("retry_failed", body)

    async def occurrences(self, after: str | None = None, limit: int = 100) -> Page[OccurrenceInfo]:
        """List occurrences' metadata by (due time, id), after the exclusive cursor ``after``.

        Expired work is classified (and its content erased) first. No payloads, no lease
        credentials.

        Raises:
            RecurringConfigurationError: ``limit`` outside 1..100, or a cursor this store
                did not return.
            RecurringStorageError: the database failed.
            RecurringDeadlineError: a storage deadline passed.
            RecurringClockError: the clock trails the recorded time by more than 5 s.
        """
        limit = validate_budget(limit, "limit")
        position = _codec.parse_occurrence_cursor(after)
        q = self._queries
        namespace = self._config.namespace

        async def body(tx: _Tx) -> Page[OccurrenceInfo]:
            await tx.conn.execute(q.expire_occurrences, namespace, tx.now)
            rows = await tx.conn.fetch(
                q.list_occurrences, namespace, position[0], position[1], limit + 1
            )
            items = [_codec.occurrence_info(r) for r in rows[:limit]]
            cursor = None
            if len(rows) > limit:
                cursor = _codec.occurrence_cursor(items[-1].due_at, items[-1].occurrence_id)
            return Page(items=items, next_cursor=cursor)

        return await self._run("occurrences", body)

    async def purge_terminal(self, older_than: datetime, limit: int = 100) -> int:
        """Remove at most ``limit`` (1-100) terminal occurrences finished before ``older_than``.

        Expired work is classified first. Returns how many were removed.

        Raises:
            RecurringConfigurationError: ``limit`` outside 1..100, or a naive cutoff.
            RecurringStorageError: the database failed.
            RecurringDeadlineError: a storage deadline passed.
            RecurringClockError: the clock trails the recorded time by more than 5 s.
        """
        limit = validate_budget(limit, "limit")
        if not isinstance(older_than, datetime) or older_than.utcoffset() is None:
            raise RecurringConfigurationError(
                "older_than must be a timezone-aware datetime (steeple works in UTC)"
            )
        q = self._queries
        namespace = self._config.namespace

        async def body(tx: _Tx) -> int:
            await tx.conn.execute(q.expire_occurrences, namespace, tx.now)
            removed = _affected(await tx.conn.execute(q.purge, namespace, older_than, limit))
            tx.occurrence_delta = -removed
            return removed

        return await self._run("purge_terminal", body)
