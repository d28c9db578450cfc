"""The node check of a new connection: the cluster and timeline it reached, judged once.

Workers run it on each connection of their pool; an application runs it on the
connections it enqueues on (:class:`ClusterGuard`). The rule is
:func:`steeple.core.cluster.judge_cluster`; this module reads the node's identity and
turns a refusal into :class:`~steeple.postgres.queue.QueueClusterError`.
"""

from __future__ import annotations

import logging
from typing import Any

from steeple.core.cluster import ClusterIdentity, ClusterWatch
from steeple.core.errors import ClusterIdentityError
from steeple.postgres._durability import IDENTITY_QUERY, cluster_identity
from steeple.postgres.queue import _driver
from steeple.postgres.queue.errors import QueueClusterError

__all__ = ["ClusterGuard", "guard_for"]

LOG = logging.getLogger("steeple.postgres.queue")


class ClusterGuard:
    """Refuses connections to another cluster or to a stale node left behind by a failover.

    The check queue workers run on each of their connections, for the connections an
    application enqueues on: the first node seen fixes the cluster (its system
    identifier); a node on an older timeline than the newest seen (an old primary started
    again after its standby was promoted) or of another cluster is refused. One round
    trip per connection, when it opens; nothing per statement.

    .. code-block:: python

        guard = queue.ClusterGuard()  # one per process and database
        pool = await asyncpg.create_pool(dsn, init=guard.check)
        pool = psycopg_pool.AsyncConnectionPool(conninfo, configure=guard.check)
        await guard.check(conn)  # a connection opened by hand, once

    What it remembers is this object's: share one guard between the pools and
    connections of a process that write to the same database.
    """

    def __init__(self) -> None:
        self._watch = ClusterWatch()
        self._who = "steeple queue"  # how its warnings start (see guard_for)

    def __repr__(self) -> str:
        return f"ClusterGuard(known={self.known!r})"

    @property
    def known(self) -> ClusterIdentity | None:
        """The cluster and newest timeline seen (``None`` before the first check)."""
        return self._watch.known

    async def check(self, conn: Any) -> None:
        """Read the node ``conn`` reached and accept it, or refuse it (logged as a warning).

        ``conn`` is an asyncpg connection or a psycopg ``AsyncConnection``; one outside a
        transaction is left outside one.

        Raises:
            QueueClusterError: another cluster, or a stale node; nothing was written.
            UnsupportedConnectionError: not an async asyncpg/psycopg connection.
        """
        idle = not _driver.in_transaction(conn)
        (row,) = await _driver.fetch(conn, IDENTITY_QUERY)
        if idle and _driver.in_transaction(conn):
            await conn.rollback()  # psycopg outside autocommit began one to read
        try:
            self._watch.observe(cluster_identity(row))
        except ClusterIdentityError as exc:
            LOG.warning("%s: %s", self._who, exc)
            raise QueueClusterError(str(exc), known=exc.known, seen=exc.seen) from None


def guard_for(who: str) -> ClusterGuard:
    """Return a :class:`ClusterGuard` whose warnings start with ``who`` (a worker)."""
    guard = ClusterGuard()
    guard._who = who
    return guard
