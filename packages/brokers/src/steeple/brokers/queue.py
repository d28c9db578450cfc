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
from steeple.postgres.queue import DEFAULT_SCHEMA, EnqueueOptions, Task, enqueue
from steeple.postgres.queue.errors import ArgsEncodingError, QueueError

__all__ = ["WorkQueueBroker", "decode_task_args"]

_IDENT = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")

# SQLSTATE classes whose errors depend on the data, not on the database's state: the same
# message fails the same way on every attempt (22: data exception, e.g. a character the
# database encoding cannot hold; 54: program limit exceeded, e.g. an index row too large).
_PERMANENT_SQLSTATE_CLASSES = ("22", "54")
# Privileges and missing objects: the operator must change something (42501, 42P01...).
_CONFIGURATION_SQLSTATE_CLASSES = ("42",)


def _map_postgres_error(exc: asyncpg.PostgresError) -> BrokerError:
    state = str(getattr(exc, "sqlstate", "") or "")
    detail = f"{type(exc).__name__} ({state})" if state else type(exc).__name__
    if state[:2] in _PERMANENT_SQLSTATE_CLASSES:
        return BrokerRejectedError(f"work queue: the database refused the message: {detail}")
    if state[:2] in _CONFIGURATION_SQLSTATE_CLASSES:
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


class WorkQueueBroker(AsyncLifecycle):
    """Publishes each message as one task of steeple's work queue, deduplicated by key.

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
            each lookup) opens its own, and the others wait for a turn within their
            deadline. A relay publishes up to 32 at once, so without a bound a few relay
            processes exhaust the server's ``max_connections`` and every publication
            fails.

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
    ) -> None:
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
        self._closed = False
        self._open: set[Any] = set()

    def __repr__(self) -> str:
        return f"WorkQueueBroker(dsn={redact_dsn(self._dsn)!r}, schema={self._schema!r})"

    async def __aenter__(self) -> Self:
        # Nothing to open ahead: each publication connects on its own.
        return self

    async def close(self) -> None:
        """Refuse further publications and close any connection still open."""
        self._closed = True
        for conn in list(self._open):
            conn.terminate()
        self._open.clear()

    async def _connect(self) -> Any:
        """Wait for a free connection slot, then connect; :meth:`_release` frees both."""
        if self._closed:
            raise BrokerUnavailableError("work queue: this broker was closed")
        await self._slots.acquire()
        try:
            if self._closed:
                raise BrokerUnavailableError("work queue: this broker was closed")
            conn = await asyncpg.connect(self._dsn, timeout=self._connect_timeout)
        except (OSError, asyncpg.PostgresError, TimeoutError) as exc:
            self._slots.release()
            raise BrokerUnavailableError(
                f"work queue: cannot connect to {redact_dsn(self._dsn)} ({type(exc).__name__})"
            ) from None
        except BaseException:
            self._slots.release()
            raise
        self._open.add(conn)
        return conn

    async def _release(self, conn: Any) -> None:
        self._open.discard(conn)
        try:
            if not conn.is_closed():
                try:
                    async with asyncio.timeout(1):
                        await conn.close()
                except (TimeoutError, OSError, asyncpg.PostgresError):
                    conn.terminate()
                except BaseException:
                    conn.terminate()  # cancelled while closing: nothing may stay open
                    raise
        finally:
            self._slots.release()

    async def install(self) -> None:
        """Create the dedup ledger table in the queue's schema (idempotent).

        Raises:
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
            BrokerConfigurationError: the queue or the ledger is not installed, or the role
                lacks a privilege.
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
                queue refuses (empty, over 200 characters, control characters): the same
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
        conn = await self._connect()
        committing = False
        try:
            tx = conn.transaction()
            await tx.start()
            try:
                await conn.execute("SET LOCAL synchronous_commit = on")
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
            return BrokerReceipt(
                "queue", key, duplicate=enqueued.deduplicated, location=str(enqueued.id)
            )
        except ArgsEncodingError as exc:
            if "exceed" in str(exc):
                raise MessageTooLargeError(f"work queue: {exc}") from None
            raise BrokerRejectedError(f"work queue: {exc}") from None
        except QueueError as exc:
            if isinstance(exc, ConfigurationError | TypeError):
                raise BrokerRejectedError(f"work queue: {exc}") from None
            # Unavailable, or a duplicate that kept changing under us: worth retrying.
            raise BrokerUnavailableError(f"work queue: {exc}") from None
        except asyncpg.UndefinedTableError:
            raise BrokerConfigurationError(
                f"work queue: schema {self._schema!r} lacks the queue tables or the ledger: "
                "run steeple.postgres.queue.install(...) and WorkQueueBroker.install()"
            ) from None
        except (asyncpg.PostgresConnectionError, asyncpg.InterfaceError, OSError) as exc:
            if isinstance(exc, ValueError) and not committing:
                # asyncpg's client-side DataError: an argument it cannot encode, refused
                # before the statement was sent.
                raise BrokerRejectedError(
                    f"work queue: the driver cannot encode the task ({type(exc).__name__})"
                ) from None
            if committing:
                # COMMIT was sent; its outcome is unknown until we look.
                raise AckUncertainError(type(exc).__name__) from None
            raise BrokerUnavailableError(f"work queue: {type(exc).__name__}") from None
        except asyncpg.PostgresError as exc:
            raise _map_postgres_error(exc) from None
        finally:
            await self._release(conn)

    async def lookup(self, idempotency_key: str) -> BrokerReceipt | None:
        """Return the receipt recorded for ``idempotency_key``, if the ledger holds it.

        Raises:
            BrokerUnavailableError: the database cannot be reached.
        """
        conn = await self._connect()
        try:
            row = await conn.fetchrow(
                f'SELECT task_id FROM "{self._schema}".broker_dedup WHERE idempotency_key = $1',
                idempotency_key,
            )
        except (asyncpg.PostgresError, OSError) as exc:
            raise BrokerUnavailableError(f"work queue: {type(exc).__name__}") from None
        finally:
            await self._release(conn)
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
        try:
            status = await conn.execute(
                f'DELETE FROM "{self._schema}".broker_dedup'
                " WHERE created_at < clock_timestamp() - $1::interval",
                self._retention,
            )
        except (asyncpg.PostgresError, OSError) as exc:
            raise BrokerUnavailableError(f"work queue: {type(exc).__name__}") from None
        finally:
            await self._release(conn)
        return int(status.split()[-1])
