"""Who holds the vacuum horizon while steeple's tables collect dead rows.

VACUUM can only remove a dead row version once no transaction could still see it: the
oldest snapshot of any session (an ``idle in transaction`` session, a long report, a
``REPEATABLE READ`` reader), a prepared transaction, or a replication slot whose standby
reports its own snapshots (``hot_standby_feedback``) holds back every table of the database.
While it does, a queue's tables grow with every claim, outcome and prune.

:func:`held_horizon` reads the statistics views (no table is scanned): when a table of the
given schemas has at least ``dead_rows`` dead row versions, it names the oldest holder.
The work queue's worker checks it in its maintenance loop and reports it in
``Scheduler.health_reasons()``; a recurring deployment calls it with its store's schema.

A logical replication slot holds back only the system catalogues (its ``catalog_xmin``), not
steeple's tables; it keeps WAL instead, which :func:`held_horizon` does not judge.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

import attrs

from steeple.postgres.queue import _driver

__all__ = ["DEAD_ROWS_THRESHOLD", "HeldHorizon", "held_horizon"]

DEAD_ROWS_THRESHOLD: Final = 100_000
"""Dead row versions in one table past which :func:`held_horizon` looks for the holder (a
queue finishing 300 tasks/s leaves about that many in two minutes when nothing can be
vacuumed)."""

_QUERY: Final = """
WITH bloated AS (
    SELECT schemaname || '.' || relname AS name, n_dead_tup AS dead
    FROM pg_stat_user_tables
    WHERE schemaname = ANY($1::text[]) AND n_dead_tup >= $2
), holders AS (
    SELECT 'session' AS kind, pid, application_name, state,
           greatest(age(backend_xmin), age(backend_xid)) AS xid_age,
           extract(epoch FROM clock_timestamp() - xact_start)::double precision AS seconds,
           NULL::text AS slot
    FROM pg_stat_activity
    WHERE pid <> pg_backend_pid() AND (backend_xmin IS NOT NULL OR backend_xid IS NOT NULL)
    UNION ALL
    SELECT 'replication slot', active_pid, NULL, CASE WHEN active THEN 'active' ELSE 'inactive' END,
           age(xmin), NULL, slot_name::text
    FROM pg_replication_slots WHERE xmin IS NOT NULL
    UNION ALL
    SELECT 'prepared transaction', NULL, NULL, 'prepared', age(transaction),
           extract(epoch FROM clock_timestamp() - prepared)::double precision, gid
    FROM pg_prepared_xacts WHERE database = current_database()
)
SELECT b.name, b.dead, h.kind, h.pid, h.application_name, h.state, h.xid_age, h.seconds,
       h.slot
FROM (SELECT * FROM bloated ORDER BY dead DESC, name LIMIT 1) AS b
LEFT JOIN LATERAL (
    SELECT * FROM holders ORDER BY xid_age DESC NULLS LAST LIMIT 1
) AS h ON true"""


@attrs.frozen
class HeldHorizon:
    """A steeple table full of dead rows, and the oldest holder of the vacuum horizon.

    Attributes:
        table: the schema-qualified table with the most dead row versions.
        dead_rows: its dead row versions (``pg_stat_user_tables.n_dead_tup``).
        kind: ``"session"``, ``"replication slot"`` or ``"prepared transaction"``; ``None``
            when no holder is visible (the role lacks ``pg_read_all_stats`` to see other
            roles' sessions, or autovacuum simply has not run yet).
        pid: the holding backend's process id (a slot's walsender, if active).
        application_name: the holding session's ``application_name``.
        state: the session's state (``idle in transaction``, ``active``...), or the
            slot's (``active``/``inactive``).
        xid_age: how many transactions old the held snapshot is.
        seconds: how long the holding transaction has been open.
        slot: the replication slot's name, or the prepared transaction's identifier.
    """

    table: str
    dead_rows: int
    kind: str | None = None
    pid: int | None = None
    application_name: str | None = None
    state: str | None = None
    xid_age: int | None = None
    seconds: float | None = None
    slot: str | None = None

    def describe(self) -> str:
        """One line for an operator: the table, its dead rows, and who holds the horizon."""
        head = f"{self.dead_rows:,} dead rows in {self.table}"
        if self.kind is None:
            return (
                f"{head}; no holder of the vacuum horizon is visible (grant "
                "pg_read_all_stats to see other roles' sessions, or autovacuum is behind)"
            )
        if self.kind == "session":
            app = self.application_name or ""
            who = f"session pid {self.pid} (application {app!r}, {self.state})"
        elif self.kind == "replication slot":
            who = f"replication slot {self.slot!r} ({self.state})"
        else:
            who = f"prepared transaction {self.slot!r}"
        age = "" if self.seconds is None else f", transaction open {self.seconds:.0f} s"
        return (
            f"{head}: vacuum cannot remove them while {who} holds a snapshot "
            f"{self.xid_age:,} transactions old{age}"
        )


async def held_horizon(
    conn: Any, schemas: Sequence[str], *, dead_rows: int = DEAD_ROWS_THRESHOLD
) -> HeldHorizon | None:
    """Return the most bloated table of ``schemas`` and the horizon's holder, or ``None``.

    ``None`` when no table of ``schemas`` has ``dead_rows`` dead row versions or more. The
    counts are the statistics collector's (updated by each session at most once a second,
    and at the end of its transactions), so they trail the tables a little.

    Args:
        conn: an asyncpg connection or pool, or a psycopg ``AsyncConnection``.
        schemas: the schemas whose tables are judged (the queue's, the recurring store's).
        dead_rows: the threshold (at least 1).

    Raises:
        ValueError: ``dead_rows`` below 1 or ``schemas`` empty.
        TypeError: ``dead_rows`` is not an int, or ``schemas`` is a str.
    """
    if isinstance(schemas, str) or not all(isinstance(s, str) for s in schemas):
        raise TypeError("schemas must be a sequence of schema names")
    if not schemas:
        raise ValueError("give at least one schema")
    if not isinstance(dead_rows, int) or isinstance(dead_rows, bool):
        raise TypeError(f"dead_rows must be an int, not {type(dead_rows).__name__}")
    if dead_rows < 1:
        raise ValueError("dead_rows must be at least 1")
    rows = await _driver.fetch(conn, _QUERY, list(schemas), dead_rows)
    if not rows:
        return None
    table, dead, kind, pid, app, state, xid_age, seconds, slot = rows[0]
    return HeldHorizon(
        table=table,
        dead_rows=int(dead),
        kind=kind,
        pid=pid,
        application_name=app,
        state=state,
        xid_age=None if xid_age is None else int(xid_age),
        seconds=seconds,
        slot=slot,
    )
