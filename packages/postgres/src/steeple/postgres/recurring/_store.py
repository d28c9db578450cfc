"""The PostgreSQL recurring-publication store on asyncpg.

:class:`PostgresRecurringStore` is the recurring engine (:mod:`steeple.engine`, which
holds every operation and, through the core, every decision) over a PostgreSQL adapter
of the engine's persistence port. This module does what is PostgreSQL's own: schema and
migrations, durability, role and TLS checks, the pool, deadlines, driver-error mapping
and the stale-connection retry. Each call is one transaction that first locks the
namespace's control row, so all work in a namespace is serialized and shares one
recorded time. Broker publication never happens inside a transaction.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine, Mapping
from datetime import datetime, timedelta
from typing import Any, Final, Self, TypeVar

import asyncpg
import attrs
from asyncpg.transaction import Transaction

from steeple.core import limits
from steeple.core.cluster import ClusterWatch
from steeple.core.config import RecurringConfig
from steeple.core.dsn import conninfo_url
from steeple.core.errors import (
    ClusterIdentityError,
    ConfigurationError,
    KeyringError,
    RecurringClusterError,
    RecurringConfigurationError,
    RecurringDeadlineError,
    RecurringError,
    RecurringNotFoundError,
    RecurringRelayError,
    RecurringStorageError,
    SteepleError,
    recurring_error,
)
from steeple.core.ports import Clock, RandomSource, Sealer
from steeple.engine import EngineStore, RecurringEngine
from steeple.engine.opening import check_parts, install_namespace, open_namespace, recurring_errors
from steeple.engine.ports import RepositoryWork, ServerClockReading, StoredNamespace
from steeple.postgres._durability import (
    IDENTITY_QUERY,
    AnyConnection,
    DurabilityProblem,
    check_privileges,
    check_schema_name,
    check_server_durability,
    check_tables_permanent,
    check_transport,
    cluster_identity,
    quote_ident,
    write_refusal,
)
from steeple.postgres.pooler import (
    Pooler,
    PoolerAdvice,
    PoolerProblem,
    asyncpg_options,
    check_pooler,
    local_settings_sql,
    pooler_refusal,
)
from steeple.postgres.recurring._repository import PostgresRepository, namespace_state
from steeple.postgres.recurring._sql import (
    MIGRATIONS,
    RUNTIME_PRIVILEGES,
    SCHEMA_VERSION,
    TABLES,
    Queries,
    package_sql,
)
from steeple.postgres.sqlstate import LOCK_NOT_AVAILABLE, QUERY_CANCELED, sqlstate

__all__ = ["PostgresRecurringStore"]

_log = logging.getLogger("steeple.postgres.recurring")

T = TypeVar("T")

_CALL_DEADLINE = limits.CALL_DEADLINE.total_seconds()
_POOL_DEADLINE = limits.POOL_DEADLINE.total_seconds()
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


_POOLER_ADVICE: Final = PoolerAdvice(
    "open it with PostgresRecurringStore.connect(..., pooler='transaction') (or "
    "initialize(..., pooler='transaction'))"
)


class _StaleConnection(Exception):
    """Internal: the pooled connection was dead before the transaction began."""


def _map_driver_error(exc: BaseException, what: str) -> RecurringError:
    refused = pooler_refusal(exc)
    if refused is not None:
        return RecurringConfigurationError(f"{what}: {refused.explain(_POOLER_ADVICE)}")
    if isinstance(exc, TimeoutError):
        return RecurringDeadlineError(
            f"{what}: the storage deadline passed (10 s per call, 5 s to acquire a connection)"
        )
    if sqlstate(exc) == LOCK_NOT_AVAILABLE:
        return RecurringDeadlineError(
            f"{what}: a lock wait exceeded lock_timeout (5 s); another session holds the "
            "namespace's control row"
        )
    if sqlstate(exc) == QUERY_CANCELED:
        return RecurringDeadlineError(f"{what}: a statement exceeded statement_timeout (5 s)")
    refusal = write_refusal(exc)
    if refusal is not None:
        return RecurringStorageError(f"{what}: {refusal[1]}")
    if isinstance(exc, asyncpg.PostgresError):
        return RecurringStorageError(
            f"{what}: PostgreSQL failed (SQLSTATE {sqlstate(exc) or '?'}, {type(exc).__name__})"
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


def _connection_checker(
    watch: ClusterWatch,
) -> Callable[[asyncpg.Connection[asyncpg.Record]], Coroutine[Any, Any, None]]:
    async def check_new_connection(conn: asyncpg.Connection[asyncpg.Record]) -> None:
        # Every pooled connection is checked when opened: a role or session setting such
        # as synchronous_commit=off may appear after the store was connected, and after a
        # failover the DSN's first writable host may be the stale old primary.
        try:
            await check_server_durability(conn)
            row = await conn.fetchrow(IDENTITY_QUERY)
            assert row is not None
            watch.observe(cluster_identity(tuple(row)))
        except DurabilityProblem as exc:
            raise RecurringStorageError(str(exc)) from None
        except ClusterIdentityError as exc:
            _log.warning("steeple recurring store: %s", exc)
            raise RecurringClusterError(str(exc), known=exc.known, seen=exc.seen) from None

    return check_new_connection


def _check_pooler(pooler: object) -> Pooler | None:
    try:
        return check_pooler(pooler)
    except PoolerProblem as exc:
        raise RecurringConfigurationError(str(exc)) from None


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


def _check_open_args(
    dsn: str, config: object, keyring: object, clock: object, schema: object
) -> str:
    # What initialize and connect both check before touching the network; returns the
    # DSN as the URL asyncpg reads (a libpq key=value string is rewritten).
    check_parts(config, keyring, clock, sealer_is="keyring")
    _check_schema_name(schema)
    try:
        url = conninfo_url(dsn)
        check_transport(url)
    except ConfigurationError as exc:
        raise RecurringConfigurationError(str(exc)) from None
    except DurabilityProblem as exc:
        raise _problem(exc) from None
    return url


async def _install(
    conn: AnyConnection, schema: str, config: RecurringConfig, keyring: Sealer, clock: Clock
) -> bool:
    """Create or migrate the schema and create the namespace, once each.

    Serialized by an advisory lock, so concurrent initializers converge. Returns whether
    this call migrated an older schema forward.
    """
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
    migrated = False
    if isinstance(version, int) and version < SCHEMA_VERSION:
        for target in range(version + 1, SCHEMA_VERSION + 1):
            if target not in MIGRATIONS:
                break
            await conn.execute(package_sql(MIGRATIONS[target]).replace("{schema}", quoted))
            migrated = True
    opening = _PostgresOpening(conn, queries, schema, config.namespace, lock=True)
    await install_namespace(opening, config, keyring, clock)
    await transaction.commit()
    return migrated


@attrs.define(repr=False)
class PostgresRecurringStore(EngineStore):
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
    _schema: str
    _queries: Queries
    _storage: _PostgresStorage
    _engine: RecurringEngine
    warnings: list[str] = attrs.field(factory=list)

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
        pooler: Pooler | None = None,
    ) -> Self:
        """Create the fixed schema and the namespace once, then connect.

        Run it as the deployment role. Concurrent initializers converge (an advisory lock
        serializes them); initializing an existing namespace with the same configuration
        and keyring is a no-op. ``pooler`` as in :meth:`connect`.

        Raises:
            RecurringConfigurationError: bad arguments, unverified TLS to a remote host, or
                the namespace exists with a different configuration (or keyring).
            RecurringStorageError: the database failed, is not durable, or holds another
                schema version.
            RecurringDeadlineError: a deadline passed.
        """
        dsn = _check_open_args(dsn, config, keyring, clock, schema)
        chosen = _check_pooler(pooler)
        try:
            async with asyncio.timeout(_CALL_DEADLINE):
                conn = await asyncpg.connect(
                    dsn, timeout=_POOL_DEADLINE, **asyncpg_options(chosen, SERVER_SETTINGS)
                )
                try:
                    await check_server_durability(conn)
                    if await _install(conn, schema, config, keyring, clock):
                        # Dropped columns stay in the data files until the table is
                        # rewritten: rewrite it so the old plaintext is gone.
                        await conn.execute(
                            f"VACUUM FULL {quote_ident(schema)}.recurring_definitions"
                        )
                except BaseException:
                    # Never wait on a ROLLBACK over a link that may be dead: closing the
                    # socket ends the server's transaction.
                    conn.terminate()
                    raise
                await conn.close(timeout=_POOL_DEADLINE)
        except DurabilityProblem as exc:
            raise _problem(exc) from None
        except RecurringError:
            raise
        except SteepleError as exc:
            # e.g. the keyring's seal budget, a naive clock: still a recurring error.
            raise recurring_error(exc, "initialize") from exc
        except _DRIVER_ERRORS as exc:
            raise _map_driver_error(exc, "initialize") from exc
        return await cls.connect(
            dsn, config, keyring, clock, schema=schema, random=random, pooler=pooler
        )

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
        pooler: Pooler | None = None,
    ) -> Self:
        """Connect to an initialized namespace; never creates, repairs or changes anything.

        Checks durability (permanent tables, ``fsync``, ``full_page_writes``,
        ``synchronous_commit``, a writable primary), the schema version, the runtime
        role's privileges and the configuration binding.

        ``pooler="transaction"``: ``dsn`` leads through a connection pooler in transaction
        mode (PgBouncer ``pool_mode = transaction``; see :mod:`steeple.postgres.pooler`).
        The pool then keeps no statement cache and sends only ``application_name`` at
        connect; the statement, lock-wait and idle-in-transaction timeouts are set at the
        start of each transaction instead (one more round trip per call).

        Raises:
            RecurringConfigurationError: bad arguments, unverified TLS to a remote host, a
                configuration/keyring that does not match the namespace's binding, or a
                DSN leading through a transaction pooler without ``pooler="transaction"``.
            RecurringNotFoundError: the namespace was never initialized.
            RecurringStorageError: missing tables, a non-durable setting or table, a
                read-only server, a missing privilege (named), another schema version, or
                a database failure.
            RecurringDeadlineError: a deadline passed.
            RecurringClockError: the clock trails the recorded time by more than 5 s, or is
                ahead of the database server's clock by more than 5 s (PostgreSQL).
        """
        dsn = _check_open_args(dsn, config, keyring, clock, schema)
        chosen = _check_pooler(pooler)
        try:
            async with asyncio.timeout(_CALL_DEADLINE):
                pool = await asyncpg.create_pool(
                    dsn,
                    min_size=0,
                    max_size=limits.POOL_MAX_SIZE,
                    timeout=_POOL_DEADLINE,
                    max_inactive_connection_lifetime=60.0,
                    **asyncpg_options(chosen, SERVER_SETTINGS),
                    init=_connection_checker(ClusterWatch()),
                    reset=_no_reset,
                )
        except RecurringError:
            raise
        except _DRIVER_ERRORS as exc:
            raise _map_driver_error(exc, "connect") from exc
        queries = Queries.for_schema(quote_ident(schema))
        storage = _PostgresStorage(
            pool, queries, config.namespace, schema, local_settings_sql(chosen, SERVER_SETTINGS)
        )
        store = cls(
            pool=pool,
            config=config,
            sealer=keyring,
            clock=clock,
            schema=schema,
            queries=queries,
            storage=storage,
            engine=RecurringEngine(
                storage,
                config,
                keyring,
                clock,
                random,
            ),
        )
        try:
            with recurring_errors("connect"):
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
                opening = _PostgresOpening(
                    conn, self._queries, self._schema, self._config.namespace, lock=False
                )
                await open_namespace(opening, self._config, self._sealer, self._clock)
        except DurabilityProblem as exc:
            raise _problem(exc) from None
        except (RecurringError, KeyringError):
            raise
        except _DRIVER_ERRORS as exc:
            raise _map_driver_error(exc, "connect") from exc

    # --- lifecycle -----------------------------------------------------------------------

    async def close(self) -> None:
        """Close this store's pool (not other stores' pools). Idempotent."""
        if self._storage.closed:
            return
        self._storage.closed = True
        try:
            async with asyncio.timeout(_CALL_DEADLINE):
                await self._pool.close()
        except TimeoutError:
            self._pool.terminate()

    def __repr__(self) -> str:
        return (
            f"PostgresRecurringStore(namespace={self._config.namespace!r}, "
            f"schema={self._schema!r}, closed={self._storage.closed})"
        )


@attrs.frozen
class _PostgresOpening:
    """The open sequence's reads and writes on one connection (a ``NamespaceOpening``)."""

    conn: AnyConnection
    queries: Queries
    schema: str
    name: str
    lock: bool
    """Read the namespace ``FOR UPDATE`` (initialize, inside its transaction)."""
    schema_version: int = SCHEMA_VERSION

    async def stored_version(self) -> object:
        return await self.conn.fetchval(self.queries.read_version)

    async def namespace(self) -> StoredNamespace | None:
        query = self.queries.read_namespace + (" FOR UPDATE" if self.lock else "")
        row = await self.conn.fetchrow(query, self.name)
        if row is None:
            return None
        return StoredNamespace(bytes(row["binding"]), row["recorded_time"])

    async def insert_namespace(self, binding: bytes, key_id: str, now: datetime) -> None:
        await self.conn.execute(self.queries.insert_namespace, self.name, binding, key_id, now)

    async def server_clock(self) -> ServerClockReading:
        sent = time.monotonic()
        at = await self.conn.fetchval("SELECT clock_timestamp()")
        return ServerClockReading(at, sent)


@attrs.define(repr=False)
class _PostgresStorage:
    """The engine's :class:`~steeple.engine.RecurringStorage` port on the store's pool."""

    pool: asyncpg.Pool
    queries: Queries
    namespace: str
    schema: str
    local_settings: str | None = None
    """Set at the start of each transaction: the session settings a transaction pooler
    does not carry (``None`` on a direct connection: they were sent at connect)."""
    closed: bool = False

    async def transaction(self, operation: str, work: RepositoryWork[T]) -> T:
        """Run ``work`` in one transaction holding the namespace's control row.

        Raises:
            RecurringNotFoundError: the namespace no longer exists.
            RecurringStorageError, RecurringDeadlineError: the database failed, a deadline
                passed, or the store is closed; nothing was committed.
        """
        if self.closed:
            raise RecurringStorageError(f"{operation}: the store is closed")
        deadline = asyncio.get_running_loop().time() + _CALL_DEADLINE
        for retry in (False, True):
            try:
                return await self._attempt(operation, work, deadline)
            except _StaleConnection as stale:
                # A pooled connection died while idle (server restart, terminated
                # backend); nothing was sent but BEGIN, so one more attempt on a fresh
                # one is safe.
                await self._forget_connections()
                if retry:
                    cause = stale.__cause__ or stale
                    raise _map_driver_error(cause, operation) from cause
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
        await self.pool.expire_connections()

    async def _attempt(
        self,
        what: str,
        work: RepositoryWork[T],
        deadline: float,
    ) -> T:
        try:
            async with asyncio.timeout_at(deadline):
                conn = await self.pool.acquire(timeout=_POOL_DEADLINE)
        except RecurringError:
            raise  # a new connection's checks refused it (a stale node, a lost setting)
        except _DRIVER_ERRORS as exc:
            raise _map_driver_error(exc, what) from exc
        healthy = False
        transaction = conn.transaction()
        try:
            try:
                async with asyncio.timeout_at(deadline):
                    result = await self._transaction(conn, transaction, work)
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
            await self.pool.release(conn, timeout=_RELEASE_DEADLINE)

    async def _transaction(
        self,
        conn: AnyConnection,
        transaction: Transaction,
        work: RepositoryWork[T],
    ) -> T:
        try:
            await transaction.start()
        except _LINK_ERRORS as exc:
            raise _StaleConnection() from exc
        if self.local_settings is not None:
            await conn.execute(self.local_settings)
        sent = time.monotonic()
        row = await conn.fetchrow(self.queries.lock_namespace, self.namespace)
        if row is None:
            raise RecurringNotFoundError(
                f"namespace {self.namespace!r} no longer exists in schema {self.schema!r}"
            )
        state = namespace_state(row, sent)
        repository = PostgresRepository(conn, self.queries, self.namespace, state)
        result = await work(repository)
        await repository.flush()  # a write the work queued after its last call
        await transaction.commit()
        return result
