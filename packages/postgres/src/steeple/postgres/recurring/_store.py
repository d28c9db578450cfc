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
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any, Self, TypeVar

import asyncpg
import attrs
from asyncpg.transaction import Transaction

from steeple.core import limits
from steeple.core.cluster import ClusterWatch
from steeple.core.config import RecurringConfig, RecurringDefinition
from steeple.core.dsn import conninfo_url
from steeple.core.entropy import SystemRandom
from steeple.core.errors import (
    ClusterIdentityError,
    ConfigurationError,
    KeyringError,
    RecurringClusterError,
    RecurringConfigurationError,
    RecurringConflictError,
    RecurringDeadlineError,
    RecurringError,
    RecurringNotFoundError,
    RecurringRelayError,
    RecurringSchemaVersionError,
    RecurringStorageError,
    SteepleError,
    recurring_error,
)
from steeple.core.leases import adopt_time
from steeple.core.messages import BrokerReceipt
from steeple.core.ports import Clock, MessageBroker, RandomSource, Sealer
from steeple.core.records import (
    Lease,
    OccurrenceInfo,
    Page,
    RelayOutcome,
    ScheduleInfo,
    TickResult,
)
from steeple.engine import (
    RecurringEngine,
    RecurringRepository,
    read_clock,
    recurring_errors,
    seal_binding,
    verify_binding,
)
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


class _StaleConnection(Exception):
    """Internal: the pooled connection was dead before the transaction began."""


def _map_driver_error(exc: BaseException, what: str) -> RecurringStorageError:
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
) -> str:
    # What initialize and connect both check before touching the network; returns the
    # DSN as the URL asyncpg reads (a libpq key=value string is rewritten).
    _check_inputs(config, keyring, clock)
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
        version = await conn.fetchval(queries.read_version)
    if version != SCHEMA_VERSION:
        raise RecurringSchemaVersionError(schema, version, SCHEMA_VERSION)
    row = await conn.fetchrow(queries.read_namespace + " FOR UPDATE", config.namespace)
    if row is not None:
        verify_binding(keyring, config, bytes(row["binding"]))
    else:
        await conn.execute(
            queries.insert_namespace,
            config.namespace,
            seal_binding(keyring, config),
            keyring.primary_key_id,
            read_clock(clock),
        )
    await transaction.commit()
    return migrated


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
        dsn = _check_open_args(dsn, config, keyring, clock, schema)
        try:
            async with asyncio.timeout(_CALL_DEADLINE):
                conn = await asyncpg.connect(
                    dsn, timeout=_POOL_DEADLINE, server_settings=dict(SERVER_SETTINGS)
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
        dsn = _check_open_args(dsn, config, keyring, clock, schema)
        try:
            async with asyncio.timeout(_CALL_DEADLINE):
                pool = await asyncpg.create_pool(
                    dsn,
                    min_size=0,
                    max_size=limits.POOL_MAX_SIZE,
                    timeout=_POOL_DEADLINE,
                    max_inactive_connection_lifetime=60.0,
                    server_settings=dict(SERVER_SETTINGS),
                    init=_connection_checker(ClusterWatch()),
                    reset=_no_reset,
                )
        except RecurringError:
            raise
        except _DRIVER_ERRORS as exc:
            raise _map_driver_error(exc, "connect") from exc
        queries = Queries.for_schema(quote_ident(schema))
        storage = _PostgresStorage(pool, queries, config.namespace, schema)
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
                random if random is not None else SystemRandom(),
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
                version = await conn.fetchval(self._queries.read_version)
                if version != SCHEMA_VERSION:
                    raise RecurringSchemaVersionError(self._schema, version, SCHEMA_VERSION)
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
        verify_binding(self._sealer, self._config, bytes(row["binding"]))
        adopt_time(row["recorded_time"], read_clock(self._clock))

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
        if self._storage.closed:
            return
        self._storage.closed = True
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
            f"schema={self._schema!r}, closed={self._storage.closed})"
        )

    # --- the engine's operations ---------------------------------------------------------

    async def create(self, definition: RecurringDefinition) -> ScheduleInfo:
        """Create an immutable definition, or replay an identical earlier creation.

        Returns:
            The definition's metadata (the original metadata on a replay).

        Raises:
            RecurringConfigurationError: ``definition`` is not a RecurringDefinition.
            RecurringConflictError: the name exists (active or cancelled) with a different
                definition.
            RecurringCapacityError: the namespace holds ``max_definitions`` already.
            RecurringKeyringError: the stored definition cannot be opened (its key is
                missing: also an ``UnknownKeyIdError`` naming the key id).
            RecurringStorageError: the database failed.
            RecurringDeadlineError: a storage deadline passed.
            RecurringClockError: the clock trails the recorded time by more than 5 s.
        """
        return await self._engine.create(definition)

    async def create_many(
        self, definitions: Sequence[RecurringDefinition]
    ) -> list[ScheduleInfo | RecurringConflictError]:
        """Create up to 100 definitions in one transaction; each judged as ``create``.

        Each entry is created, replays an identical definition (stored, or earlier in the
        batch) or conflicts; a conflict is that entry's result. The quota holds for the
        batch: if the new definitions do not all fit, none is created.

        Returns:
            One result per definition, in order: its metadata, or the
            :class:`RecurringConflictError` a single ``create`` raises.

        Raises:
            RecurringConfigurationError: not a sequence of at most 100 definitions.
            RecurringCapacityError: the new definitions would exceed ``max_definitions``;
                nothing was created.
            RecurringKeyringError: a stored definition cannot be opened.
            RecurringStorageError: the database failed.
            RecurringDeadlineError: a storage deadline passed.
            RecurringClockError: the clock trails the recorded time by more than 5 s.
        """
        return await self._engine.create_many(definitions)

    async def cancel(self, name: str) -> ScheduleInfo:
        """Cancel a definition permanently; its name stays reserved and counts to the quota.

        Its unfinished occurrences are cancelled and their content erased at once. A
        publication already in flight cannot be recalled. Cancelling twice is a no-op.

        Raises:
            RecurringNotFoundError: no definition of that name in this namespace.
            RecurringKeyringError: the definition cannot be opened for its metadata.
            RecurringStorageError: the database failed.
            RecurringDeadlineError: a storage deadline passed.
            RecurringClockError: the clock trails the recorded time by more than 5 s.
        """
        return await self._engine.cancel(name)

    async def schedules(self, after: str | None = None, limit: int = 100) -> Page[ScheduleInfo]:
        """List definitions' metadata by name, after the exclusive cursor ``after``.

        The topic and message type come from opening each definition.

        Raises:
            RecurringConfigurationError: ``limit`` outside 1..100.
            RecurringKeyringError: a listed definition cannot be opened.
            RecurringStorageError: the database failed.
            RecurringDeadlineError: a storage deadline passed.
            RecurringClockError: the clock trails the recorded time by more than 5 s.
        """
        return await self._engine.schedules(after, limit)

    async def tick(self, budget: int) -> TickResult:
        """Materialize due occurrences, oldest first, at most ``budget`` (1-100).

        Materialization and cursor advancement commit together; when the occurrence
        quota cannot hold the whole batch, nothing is stored.

        Raises:
            RecurringConfigurationError: ``budget`` outside 1..100.
            RecurringCapacityError: the batch would exceed ``max_occurrences``.
            RecurringKeyringError: a definition cannot be opened (its key is missing or it
                was tampered with).
            RecurringStorageError: the database failed.
            RecurringDeadlineError: a storage deadline passed.
            RecurringClockError: the clock trails the recorded time by more than 5 s.
        """
        return await self._engine.tick(budget)

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
        return await self._engine.claim(limit)

    async def relay(self, lease: Lease, broker: MessageBroker) -> BrokerReceipt:
        """Publish a leased occurrence and record the outcome.

        Transaction one re-checks the live lease and counts the attempt, then commits; the
        lease is judged again after the commit. The broker is called outside any
        transaction, bounded by the remaining lease and 10 s, always with the same
        message and idempotency key; transaction two records the outcome, fenced by the
        lease's capability and revision. Anything the broker raises is recorded (retry
        with backoff, dead after ten attempts or when permanent).

        Returns:
            The broker's receipt. If the definition was cancelled while the message was in
            flight, the occurrence stays cancelled and the receipt is still returned.

        Raises:
            RelayLeaseLostError: the lease expired, was fenced by a newer claim, or the
                occurrence is no longer leased (nothing was published, or a publication by
                a stale holder is not recorded).
            RelayAcknowledgementError: the broker accepted but the outcome is uncertain
                (the broker said so, or recording it failed: ``__cause__``); carries
                ``.receipt``; the occurrence is republished with the same key.
            RelayBrokerTimeoutError: the broker did not answer in time (retried later).
            RelayBrokerError: the broker failed, whatever it raised; ``permanent``
                failures become dead letters.
            RecurringKeyringError: the content cannot be opened (the occurrence is
                dead-lettered).
            RecurringStorageError: the database failed.
            RecurringDeadlineError: a storage deadline passed.
            RecurringClockError: the clock trails the recorded time by more than 5 s.
        """
        return await self._engine.relay(lease, broker)

    async def relay_many(
        self,
        leases: Sequence[Lease],
        broker: MessageBroker,
        *,
        concurrency: int = limits.RELAY_CONCURRENCY,
    ) -> list[RelayOutcome]:
        """Publish up to 100 leased occurrences and record each outcome (three steps).

        One transaction checks every lease (the content is opened after its commit); the
        publications run concurrently (at most ``concurrency`` at once) outside any
        transaction, each bounded by its remaining lease and 10 s; one transaction records
        the outcomes, each fenced by its own capability and revision.

        Returns:
            One :class:`RelayOutcome` per lease, in order: the receipt, or the error a
            single ``relay`` of that lease raises.

        Raises:
            RecurringConfigurationError: not a sequence of at most 100 Leases, no
                ``publish`` on ``broker``, or ``concurrency`` outside 1..100.
            RecurringStorageError: the database failed before anything was published.
            RecurringDeadlineError: a storage deadline passed before publication.
            RecurringClockError: the clock trails the recorded time by more than 5 s.
        """
        return await self._engine.relay_many(leases, broker, concurrency=concurrency)

    async def claim_and_relay(
        self,
        limit: int,
        broker: MessageBroker,
        *,
        concurrency: int = limits.RELAY_CONCURRENCY,
    ) -> list[RelayOutcome]:
        """Claim up to ``limit`` (1-100) occurrences and relay them (``claim`` + ``relay_many``).

        The claim and the relay's check of the new leases are one transaction; the
        publications and the recording are ``relay_many``'s.

        Returns:
            One :class:`RelayOutcome` per occurrence claimed, oldest due first.

        Raises:
            RecurringConfigurationError: ``limit`` or ``concurrency`` outside 1..100, or
                no ``publish`` on ``broker``.
            RecurringStorageError: the database failed; nothing was claimed or published.
            RecurringDeadlineError: a storage deadline passed.
            RecurringClockError: the clock trails the recorded time by more than 5 s.
        """
        return await self._engine.claim_and_relay(limit, broker, concurrency=concurrency)

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
        return await self._engine.retry_failed(occurrence_id)

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
        return await self._engine.occurrences(after, limit)

    async def purge_terminal(self, older_than: datetime, limit: int = 100) -> int:
        """Remove at most ``limit`` (1-100) terminal occurrences finished before ``older_than``.

        Expired work is classified first. Returns how many were removed.

        Raises:
            RecurringConfigurationError: ``limit`` outside 1..100, or a naive cutoff.
            RecurringStorageError: the database failed.
            RecurringDeadlineError: a storage deadline passed.
            RecurringClockError: the clock trails the recorded time by more than 5 s.
        """
        return await self._engine.purge_terminal(older_than, limit)


@attrs.define(repr=False)
class _PostgresStorage:
    """The engine's :class:`~steeple.engine.RecurringStorage` port on the store's pool."""

    pool: asyncpg.Pool
    queries: Queries
    namespace: str
    schema: str
    closed: bool = False

    async def transaction(
        self, operation: str, work: Callable[[RecurringRepository], Awaitable[T]]
    ) -> T:
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
        work: Callable[[RecurringRepository], Awaitable[T]],
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
        work: Callable[[RecurringRepository], Awaitable[T]],
    ) -> T:
        try:
            await transaction.start()
        except _LINK_ERRORS as exc:
            raise _StaleConnection() from exc
        row = await conn.fetchrow(self.queries.lock_namespace, self.namespace)
        if row is None:
            raise RecurringNotFoundError(
                f"namespace {self.namespace!r} no longer exists in schema {self.schema!r}"
            )
        repository = PostgresRepository(conn, self.queries, self.namespace, namespace_state(row))
        result = await work(repository)
        await repository.flush()  # a write the work queued after its last call
        await transaction.commit()
        return result
