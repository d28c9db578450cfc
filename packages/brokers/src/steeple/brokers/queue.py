"""The work-queue broker (extra ``steeple-brokers[queue]``): relay into steeple's own queue.

Each publication becomes one task of steeple's PostgreSQL work queue
(:mod:`steeple.postgres.queue`), named after the message type (or by ``task_name``), with
the message as its JSON args and the idempotency key as its ``dedup_key``.

The queue's own ``dedup_key`` only protects against *live* (pending or running) tasks, so
a republication after the task finished would enqueue it again. This adapter closes that
gap with a small ledger table, ``<schema>.broker_dedup`` (created by :meth:`install`): in
one transaction on its own connection it inserts the key into the ledger and, only if the
key was new, enqueues the task. The ledger keeps a key for ``dedup_retention`` (>= the
delivery window); :meth:`purge` removes older keys. Two relays racing on one key: the second
waits on the first's uncommitted ledger row and then reports a duplicate.
"""

from __future__ import annotations

import asyncio
import base64
import re
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Self

import asyncpg
import attrs

from steeple.brokers._common import (
    AckUncertainError,
    AsyncLifecycle,
    check_dedup_window,
    check_key,
    check_message,
    check_size,
    check_timeout,
    encoded_size,
    positive_duration,
    publish_guarded,
)
from steeple.core import limits
from steeple.core.dsn import check_dsn, redact_dsn
from steeple.core.errors import (
    BrokerConfigurationError,
    BrokerError,
    BrokerRejectedError,
    BrokerUnavailableError,
    ConfigurationError,
    MessageTooLargeError,
    SteepleError,
)
from steeple.core.messages import BrokerReceipt, ScheduledMessage
from steeple.postgres.pooler import (
    Pooler,
    PoolerAdvice,
    PoolerProblem,
    asyncpg_options,
    check_pooler,
    local_settings_sql,
    pooler_refusal,
)
from steeple.postgres.queue import (
    DEFAULT_SCHEMA,
    ClusterGuard,
    EnqueueOptions,
    QueueClusterError,
    Task,
    enqueue,
)
from steeple.postgres.queue.errors import ArgsEncodingError, QueueError
from steeple.postgres.sqlstate import is_access_or_missing_object, is_message_refused, sqlstate

__all__ = ["WorkQueueBroker", "decode_task_args"]

_IDENT = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")

# Every commit waits for its WAL flush: the ledger promises durability.
_SESSION_SETTINGS = {"synchronous_commit": "on"}


_POOLER_ADVICE = PoolerAdvice("create it as WorkQueueBroker(..., pooler='transaction')")


class _StaleConnectionError(Exception):
    """A reused connection failed before COMMIT was sent: retry on a new connection."""


def _map_postgres_error(exc: asyncpg.PostgresError) -> BrokerError:
    state = sqlstate(exc)
    detail = f"{type(exc).__name__} ({state})" if state else type(exc).__name__
    if is_message_refused(state):
        return BrokerRejectedError(f"work queue: the database refused the message: {detail}")
    if is_access_or_missing_object(state):
        # The operator must change something (42501 privileges, 42P01 a missing table...).
        return BrokerConfigurationError(
            f"work queue: the database refused the statement ({detail}); check the schema "
            "and the role's privileges"
        )
    return BrokerUnavailableError(f"work queue: the database refused: {detail}")


def _encode_args(message: ScheduledMessage, key: str) -> dict[str, Any]:
    return {
        "topic": message.topic,
        "message_type": message.message_type,
        "headers": dict(message.headers),
        "payload_b64": base64.b64encode(message.payload).decode("ascii"),
        "idempotency_key": key,
    }


def decode_task_args(args: Any) -> tuple[str, ScheduledMessage]:
    """Turn a relayed task's args back into ``(idempotency_key, message)``.

    Raises:
        ConfigurationError: the args were not written by :class:`WorkQueueBroker`.
    """
    try:
        return args["idempotency_key"], ScheduledMessage(
            args["topic"],
            args["message_type"],
            base64.b64decode(args["payload_b64"]),
            args["headers"],
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigurationError(f"not a relayed message: {type(exc).__name__}") from None


def _refused(exc: ArgsEncodingError | QueueError) -> Exception:
    """Return the broker error for a task the queue refused or could not enqueue."""
    if isinstance(exc, ArgsEncodingError):
        if "exceed" in str(exc):
            return MessageTooLargeError(f"work queue: {exc}")
        return BrokerRejectedError(f"work queue: {exc}")
    if isinstance(exc, ConfigurationError | TypeError):
        return BrokerRejectedError(f"work queue: {exc}")
    # Unavailable, or a duplicate that kept changing under us: worth retrying.
    return BrokerUnavailableError(f"work queue: {exc}")


def _driver_failure(exc: BaseException, *, committing: bool, reused: bool) -> Exception:
    """Return what a connection or driver failure amounts to, by how far the insert got."""
    if isinstance(exc, ValueError) and not committing:
        # asyncpg's client-side DataError: an argument it cannot encode, refused
        # before the statement was sent.
        return BrokerRejectedError(
            f"work queue: the driver cannot encode the task ({type(exc).__name__})"
        )
    if committing:
        # COMMIT was sent; its outcome is unknown until we look.
        return AckUncertainError(type(exc).__name__)
    if reused:
        # Uncommitted, so the server rolled it back: safe to redo on a new one.
        return _StaleConnectionError()
    return BrokerUnavailableError(f"work queue: {type(exc).__name__}")


class WorkQueueBroker(AsyncLifecycle):
    """Publishes each message as one task of steeple's work queue, deduplicated by key.

    Each connection it opens is checked once, as a queue worker checks its own (see
    :class:`~steeple.postgres.queue.ClusterGuard`): a node of another cluster, or an old
    primary left behind by a failover, is refused with ``BrokerUnavailableError`` (logged
    as a warning) and nothing is enqueued there; the relay retries later.

    Args:
        dsn: PostgreSQL DSN (its password is never shown).
        schema: the work queue's schema (``install`` it first with
            :func:`steeple.postgres.queue.install`); the ledger lives there too.
        task_name: maps a message to a task name (default: its ``message_type``).
        options: enqueue options (priority, lease, attempts, backoff); the dedup key is
            always the idempotency key.
        dedup_retention: how long the ledger remembers a key (default 7 days).
        required_window: the delivery window the ledger must cover.
        max_message_bytes: refuse larger messages for good.
        connect_timeout: seconds allowed to connect.
        max_connections: connections open at once (default 8); each publication (and
            each lookup) takes one, and the others wait for a turn within their
            deadline. A relay publishes up to 32 at once, so without a bound a few relay
            processes exhaust the server's ``max_connections`` and every publication
            fails. A connection that finished its work cleanly is kept for the next
            publication (connecting costs more than the publication itself); one that
            saw any error is closed, and one kept idle over ``idle_timeout`` seconds
            (default 30) is closed instead of reused.
        pooler: ``"transaction"`` when ``dsn`` leads through a connection pooler in
            transaction mode (PgBouncer ``pool_mode = transaction``; see
            :mod:`steeple.postgres.pooler`): no statement cache, and
            ``synchronous_commit`` set in each publication's transaction instead of at
            connect. ``None`` (the default) for a direct connection or a pooler in
            session mode.

    Raises:
        ConfigurationError: invalid arguments.
        BrokerConfigurationError: ``dedup_retention`` shorter than ``required_window``.
    """

    def __init__(
        self,
        dsn: str,
        *,
        schema: str = DEFAULT_SCHEMA,
        task_name: Callable[[ScheduledMessage], str] | None = None,
        options: EnqueueOptions | None = None,
        dedup_retention: timedelta = limits.MAX_DELIVERY_WINDOW,
        required_window: timedelta = limits.DEFAULT_DELIVERY_WINDOW,
        max_message_bytes: int = 256 * 1024,
        connect_timeout: float = 5.0,
        max_connections: int = 8,
        idle_timeout: float = 30.0,
        pooler: Pooler | None = None,
    ) -> None:
        try:
            self._pooler = check_pooler(pooler)
        except PoolerProblem as exc:
            raise ConfigurationError(str(exc)) from None
        self._connect_options = asyncpg_options(self._pooler, _SESSION_SETTINGS)
        self._local_settings = local_settings_sql(self._pooler, _SESSION_SETTINGS)
        if (
            isinstance(max_connections, bool)
            or not isinstance(max_connections, int)
            or not 1 <= max_connections <= 100
        ):
            raise ConfigurationError("max_connections must be an int from 1 to 100")
        self._slots = asyncio.Semaphore(max_connections)
        if (
            isinstance(max_message_bytes, bool)
            or not isinstance(max_message_bytes, int)
            or (max_message_bytes < 1)
        ):
            raise ConfigurationError("max_message_bytes must be a positive int")
        self._max_bytes = max_message_bytes
        if not isinstance(dsn, str) or not dsn:
            raise ConfigurationError("dsn must be a non-empty str")
        check_dsn(dsn)  # a malformed DSN would come back from the driver partly echoed
        if not isinstance(schema, str) or not _IDENT.match(schema):
            raise ConfigurationError("schema must be a lowercase SQL identifier")
        self._dsn = dsn
        self._schema = schema
        self._task_name = task_name or (lambda m: m.message_type)
        self._options = options or EnqueueOptions.immediate()
        if self._options.dedup_key is not None:
            raise ConfigurationError("options must not carry a dedup_key (the key is used)")
        self._retention = positive_duration(dedup_retention, "dedup_retention")
        check_dedup_window(
            self._retention,
            positive_duration(required_window, "required_window"),
            broker="work queue",
            what="dedup_retention",
            fix="Pass a dedup_retention at least as long as the delivery window.",
        )
        self._connect_timeout = check_timeout(connect_timeout)
        try:
            self._idle_timeout = check_timeout(idle_timeout)
        except ConfigurationError:
            raise ConfigurationError(
                "idle_timeout must be a positive finite number of seconds"
            ) from None
        self._closed = False
        self._open: set[Any] = set()
        # Connections that finished cleanly, with the loop time they were put back.
        self._idle: list[tuple[Any, float]] = []
        self.connections_opened = 0
        """How many connections this broker has opened so far (reuse keeps it low)."""
        self._guard = ClusterGuard()

    def __repr__(self) -> str:
        return (
            f"WorkQueueBroker(dsn={redact_dsn(self._dsn)!r}, schema={self._schema!r}, "
            f"pooler={self._pooler!r})"
        )

    async def __aenter__(self) -> Self:
        # Nothing to open ahead: the first publication connects.
        return self

    async def close(self) -> None:
        """Refuse further publications and close every connection, idle or in use."""
        self._closed = True
        idle = [conn for conn, _ in self._idle]
        self._idle.clear()
        for conn in list(self._open):
            conn.terminate()
        self._open.clear()
        await asyncio.gather(*(self._close_conn(conn) for conn in idle))

    @staticmethod
    async def _close_conn(conn: Any) -> None:
        if conn.is_closed():
            return
        try:
            async with asyncio.timeout(1):
                await conn.close()
        except (TimeoutError, OSError, asyncpg.PostgresError, asyncpg.InterfaceError):
            conn.terminate()
        except BaseException:
            conn.terminate()  # cancelled while closing: nothing may stay open
            raise

    def _take_idle(self) -> Any | None:
        """Return the most recently released idle connection still fit for reuse, if any."""
        now = asyncio.get_running_loop().time()
        while self._idle:
            conn, since = self._idle.pop()
            if not conn.is_closed() and now - since <= self._idle_timeout:
                return conn
            conn.terminate()  # cut while idle, or idle so long the server may drop it
        return None

    async def _connect(self) -> Any:
        """Wait for a free slot, then take an idle connection or open one (see _release)."""
        conn, _ = await self._acquire(fresh=False)
        return conn

    async def _acquire(self, *, fresh: bool) -> tuple[Any, bool]:
        """Like :meth:`_connect`, never reusing if ``fresh``; also says whether reused."""
        if self._closed:
            raise BrokerUnavailableError("work queue: this broker was closed")
        await self._slots.acquire()
        try:
            if self._closed:
                raise BrokerUnavailableError("work queue: this broker was closed")
            conn = None if fresh else self._take_idle()
            if conn is None:
                conn = await self._open_checked()
                reused = False
            else:
                reused = True
        except QueueClusterError as exc:
            self._slots.release()
            raise BrokerUnavailableError(f"work queue: {exc}") from None
        except (OSError, asyncpg.PostgresError, TimeoutError) as exc:
            self._slots.release()
            refused = pooler_refusal(exc)
            if refused is not None:
                raise BrokerConfigurationError(
                    f"work queue: {refused.explain(_POOLER_ADVICE)}"
                ) from None
            raise BrokerUnavailableError(
                f"work queue: cannot connect to {redact_dsn(self._dsn)} ({type(exc).__name__})"
            ) from None
        except BaseException:
            self._slots.release()
            raise
        self._open.add(conn)
        return conn, reused

    async def _open_checked(self) -> Any:
        """Open a connection and check the node it reached (see :class:`ClusterGuard`).

        After a failover the DSN's first writable host may be the old primary started
        again: a task enqueued there is lost with it, so such a node is refused.
        """
        # Directly, the settings go with the startup packet (no statement per
        # transaction); through a transaction pooler, see _transmit_once.
        conn = await asyncpg.connect(
            self._dsn, timeout=self._connect_timeout, **self._connect_options
        )
        self.connections_opened += 1
        try:
            async with asyncio.timeout(self._connect_timeout):
                await self._guard.check(conn)
        except BaseException:
            conn.terminate()
            raise
        return conn

    async def _release(self, conn: Any, *, reusable: bool = False) -> None:
        """Free the slot; keep ``conn`` for reuse only if its work ended cleanly.

        Any error (a cut, a timeout, a cancellation, a refused statement) leaves the
        connection in a state we cannot vouch for, so it is closed, never pooled.
        """
        self._open.discard(conn)
        try:
            if (
                reusable
                and not self._closed
                and not conn.is_closed()
                and not conn.is_in_transaction()
            ):
                self._idle.append((conn, asyncio.get_running_loop().time()))
            else:
                # At once, never a graceful close: the caller's deadline may be spent
                # (a cancelled publication must not overrun it waiting on a frozen link).
                conn.terminate()
        finally:
            self._slots.release()

    async def install(self) -> None:
        """Create the dedup ledger table in the queue's schema (idempotent).

        Raises:
            BrokerConfigurationError: ``dsn`` leads through a transaction pooler without
                ``pooler="transaction"``.
            BrokerUnavailableError: the database cannot be reached or refused the DDL.
        """
        conn = await self._connect()
        try:
            await conn.execute(f'CREATE SCHEMA IF NOT EXISTS "{self._schema}"')
            await conn.execute(
                f'CREATE TABLE IF NOT EXISTS "{self._schema}".broker_dedup ('
                " idempotency_key text PRIMARY KEY,"
                " task_name text NOT NULL,"
                " task_id bigint,"
                " created_at timestamptz NOT NULL DEFAULT clock_timestamp())"
            )
            await conn.execute(
                "CREATE INDEX IF NOT EXISTS broker_dedup_created_idx"
                f' ON "{self._schema}".broker_dedup (created_at)'
            )
        except asyncpg.PostgresError as exc:
            raise BrokerUnavailableError(f"work queue: install failed: {exc}") from None
        finally:
            await self._release(conn)

    async def publish(
        self, message: ScheduledMessage, *, idempotency_key: str, timeout: float
    ) -> BrokerReceipt:
        """Enqueue one task for ``message`` unless ``idempotency_key`` is in the ledger.

        The task name and the task's JSON args are built and checked before connecting:
        what the queue refuses never reaches the database.

        Raises:
            ConfigurationError: a bad key or timeout, or not a ScheduledMessage.
            MessageTooLargeError: the args exceed the queue's limit (permanent).
            BrokerConfigurationError: the queue or the ledger is not installed, the role
                lacks a privilege, or ``dsn`` leads through a transaction pooler without
                ``pooler="transaction"`` (PgBouncer refused a session setting).
            BrokerRejectedError: the queue refuses the task name or args (a message type
                over 200 characters, a text field without a UTF-8 encoding...), or the
                database refuses the data (permanent).
            BrokerUnavailableError: the database cannot be reached.
            BrokerTimeoutError: no answer in time; the task may have been committed.
            RelayAcknowledgementError: the commit's reply was lost but the key is recorded.
        """
        key = check_key(idempotency_key)
        seconds = check_timeout(timeout)
        check_message(message, "work queue")
        # base64 grows the payload by a third in the task's JSON args.
        check_size(
            encoded_size(message, key) + len(message.payload) // 3 + 4,
            self._max_bytes,
            "the work-queue adapter",
        )
        task = self._task_for(message)
        args = _encode_args(message, key)
        try:
            # Everything the queue would refuse is refused here, before connecting.
            task.encode(args)
        except ArgsEncodingError as exc:
            if "exceed" in str(exc):
                raise MessageTooLargeError(f"work queue: {exc}") from None
            raise BrokerRejectedError(f"work queue: {exc}") from None
        except (UnicodeError, TypeError, ValueError) as exc:
            raise BrokerRejectedError(
                f"work queue: the task's args cannot be encoded ({type(exc).__name__})"
            ) from None
        return await publish_guarded(
            broker="work queue",
            key=key,
            timeout=seconds,
            transmit=lambda: self._transmit(task, args, key),
            probe=lambda: self.lookup(key),
        )

    def _task_for(self, message: ScheduledMessage) -> Task[Any]:
        """Build the task the message becomes, named by ``task_name`` (its type by default).

        Raises:
            BrokerRejectedError: ``task_name`` failed on this message, or returned a name the
                queue refuses (see :mod:`steeple.core.names`): the same
                message would fail the same way on every attempt.
        """
        try:
            name = self._task_name(message)
        except Exception as exc:
            raise BrokerRejectedError(
                f"work queue: task_name failed on this message ({type(exc).__name__})"
            ) from None
        try:
            return Task(name)
        except (SteepleError, TypeError, ValueError) as exc:
            raise BrokerRejectedError(
                f"work queue: the queue refuses this task name ({exc}); the message type "
                "(or task_name's result) must be a valid task name"
            ) from None

    async def _transmit(self, task: Task[Any], args: dict[str, Any], key: str) -> BrokerReceipt:
        try:
            return await self._transmit_once(task, args, key, fresh=False)
        except _StaleConnectionError:
            # A pooled connection was cut while idle (a server restart, a proxy, an idle
            # timeout) and nothing was committed on it: that is no fault of this
            # publication, so it gets one attempt on a new connection.
            return await self._transmit_once(task, args, key, fresh=True)

    async def _transmit_once(
        self, task: Task[Any], args: dict[str, Any], key: str, *, fresh: bool
    ) -> BrokerReceipt:
        conn, reused = await self._acquire(fresh=fresh)
        committing = False
        reusable = False
        try:
            tx = conn.transaction()
            await tx.start()
            try:
                if self._local_settings is not None:
                    await conn.execute(self._local_settings)
                new = await conn.fetchval(
                    f'INSERT INTO "{self._schema}".broker_dedup (idempotency_key, task_name)'
                    " VALUES ($1, $2) ON CONFLICT (idempotency_key) DO NOTHING"
                    " RETURNING true",
                    key,
                    task.name,
                )
                if not new:
                    task_id = await conn.fetchval(
                        f'SELECT task_id FROM "{self._schema}".broker_dedup'
                        " WHERE idempotency_key = $1",
                        key,
                    )
                    await tx.rollback()
                    reusable = True
                    return BrokerReceipt(
                        "queue",
                        key,
                        duplicate=True,
                        location=None if task_id is None else str(task_id),
                    )
                # Every option the caller set (run_at or delay included), keyed for dedup.
                options = attrs.evolve(self._options, dedup_key=key)
                enqueued = await enqueue(conn, task, args, options, schema=self._schema)
                await conn.execute(
                    f'UPDATE "{self._schema}".broker_dedup SET task_id = $2'
                    " WHERE idempotency_key = $1",
                    key,
                    enqueued.id,
                )
                committing = True
                await tx.commit()
            except BaseException:
                if not committing and not conn.is_closed():
                    try:
                        await tx.rollback()
                    except (asyncpg.PostgresError, OSError):
                        conn.terminate()
                raise
            reusable = True
            return BrokerReceipt(
                "queue", key, duplicate=enqueued.deduplicated, location=str(enqueued.id)
            )
        except (ArgsEncodingError, QueueError) as exc:
            raise _refused(exc) from None
        except asyncpg.UndefinedTableError:
            raise BrokerConfigurationError(
                f"work queue: schema {self._schema!r} lacks the queue tables or the ledger: "
                "run steeple.postgres.queue.install(...) and WorkQueueBroker.install()"
            ) from None
        except (asyncpg.PostgresConnectionError, asyncpg.InterfaceError, OSError) as exc:
            raise _driver_failure(exc, committing=committing, reused=reused) from None
        except asyncpg.PostgresError as exc:
            raise _map_postgres_error(exc) from None
        finally:
            await self._release(conn, reusable=reusable)

    async def lookup(self, idempotency_key: str) -> BrokerReceipt | None:
        """Return the receipt recorded for ``idempotency_key``, if the ledger holds it.

        Raises:
            BrokerUnavailableError: the database cannot be reached.
        """
        conn = await self._connect()
        reusable = False
        try:
            row = await conn.fetchrow(
                f'SELECT task_id FROM "{self._schema}".broker_dedup WHERE idempotency_key = $1',
                idempotency_key,
            )
            reusable = True
        except (asyncpg.PostgresError, asyncpg.InterfaceError, OSError) as exc:
            raise BrokerUnavailableError(f"work queue: {type(exc).__name__}") from None
        finally:
            await self._release(conn, reusable=reusable)
        if row is None:
            return None
        task_id = row["task_id"]
        return BrokerReceipt(
            "queue",
            idempotency_key,
            duplicate=True,
            location=None if task_id is None else str(task_id),
        )

    async def purge(self) -> int:
        """Forget ledger keys older than ``dedup_retention``; return how many.

        Raises:
            BrokerUnavailableError: the database cannot be reached.
        """
        conn = await self._connect()
        reusable = False
        try:
            status = await conn.execute(
                f'DELETE FROM "{self._schema}".broker_dedup'
                " WHERE created_at < clock_timestamp() - $1::interval",
                self._retention,
            )
            reusable = True
        except (asyncpg.PostgresError, asyncpg.InterfaceError, OSError) as exc:
            raise BrokerUnavailableError(f"work queue: {type(exc).__name__}") from None
        finally:
            await self._release(conn, reusable=reusable)
        return int(status.split()[-1])
