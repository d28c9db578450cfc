"""Working through a transaction-mode connection pooler (PgBouncer ``pool_mode = transaction``).

Behind such a pooler each transaction of one client connection may run on a different
server session, so steeple relies on no session state there:

- no named prepared statements: asyncpg connections are opened with
  ``statement_cache_size=0`` (each statement is parsed in the same round trip that runs
  it), and psycopg statements are always sent unprepared (``prepare=False``, whatever the
  connection's ``prepare_threshold``);
- session settings are not sent as startup parameters (PgBouncer refuses those it does not
  know, and would not carry them to the server session anyway): only
  ``application_name``, which PgBouncer tracks per client; timeouts a store needs are set
  per transaction with ``set_config(..., true)`` instead;
- no LISTEN on the pooled connections: a worker LISTENs on a direct connection given
  separately (``listen_dsn``), or polls and says so once in its log;
- no advisory locks, temporary tables or ``SET`` outside a transaction.

steeple does not guess: a transaction pooler cannot be told from a server reliably from
the client's side (it forwards the server's version and settings). It is declared with
``pooler="transaction"`` (CLI ``--pooler transaction``, ``STEEPLE_POOLER``). Without it,
steeple's own connections send session settings as startup parameters, which PgBouncer
refuses ("unsupported startup parameter"); that refusal is recognised here, once
(:func:`pooler_refusal`), and each caller reports it as a configuration error naming the
setting and what to change in its own terms (:class:`PoolerAdvice`): a class's keyword
argument, or the CLI's option and environment variable.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

__all__ = [
    "POOLER_HINT",
    "Pooler",
    "PoolerAdvice",
    "PoolerProblem",
    "PoolerRefusal",
    "asyncpg_options",
    "check_pooler",
    "local_settings_sql",
    "pooler_refusal",
]

Pooler = Literal["transaction"]
"""The pooler modes steeple supports: ``"transaction"`` (``None``: a direct connection)."""

POOLER_HINT: Final = (
    "set pooler='transaction' (CLI: --pooler transaction, or STEEPLE_POOLER=transaction)"
)
"""What to change when a worker's DSN leads to a transaction pooler it was not told about
(in its API and CLI forms: the wake-up listener's warning cannot tell which built it)."""

# The startup parameters PgBouncer accepts and tracks per client connection (it restores
# them on whichever server session the client's next transaction gets).
_TRACKED: Final = frozenset({"application_name"})


class PoolerProblem(ValueError):
    """A ``pooler`` value that is not ``None`` or ``"transaction"`` (adapters translate it)."""


def check_pooler(value: object) -> Pooler | None:
    """Return ``value`` as a pooler mode.

    Raises:
        PoolerProblem: anything but ``None`` or ``"transaction"`` (session-mode pooling
            needs no setting: it keeps one server session per client connection).
    """
    if value is None or value == "transaction":
        return value
    shown = repr(value) if isinstance(value, str) else type(value).__name__
    raise PoolerProblem(
        f"pooler must be None (a direct connection, or a pooler in session mode) or "
        f"'transaction', not {shown}"
    )


def asyncpg_options(
    pooler: Pooler | None, server_settings: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """Keyword arguments for ``asyncpg.connect`` / ``create_pool`` through ``pooler``.

    Direct: ``server_settings`` as given. Through a transaction pooler: no statement cache
    (no named prepared statements) and only the startup settings the pooler tracks; the
    others are to be set per transaction (:func:`local_settings_sql`).
    """
    settings = dict(server_settings or {})
    if pooler is None:
        return {"server_settings": settings} if settings else {}
    tracked = {name: value for name, value in settings.items() if name in _TRACKED}
    return {"statement_cache_size": 0, "server_settings": tracked}


def local_settings_sql(pooler: Pooler | None, settings: Mapping[str, str]) -> str | None:
    """One statement applying ``settings`` to the current transaction, or ``None``.

    ``None`` for a direct connection (they were sent at connect). Through a transaction
    pooler, the settings that are not socket options: ``tcp_*`` settings concern the
    pooler's own server connections (its ``tcp_keepalive*`` settings) and are left out.
    Names and values are steeple's own constants, never user input.
    """
    if pooler is None:
        return None
    chosen = [
        (name, value)
        for name, value in settings.items()
        if name not in _TRACKED and not name.startswith("tcp_")
    ]
    if not chosen:
        return None
    return "SELECT " + ", ".join(f"set_config('{n}', '{v}', true)" for n, v in chosen)


@dataclass(frozen=True, slots=True)
class PoolerAdvice:
    """What a caller tells its user to change on a :class:`PoolerRefusal`, in its own terms.

    ``declare``: how to declare the pooler (``"create it as WorkQueueBroker(...,
    pooler='transaction')"``); ``listen``: where a direct DSN for LISTEN/NOTIFY wake-ups
    is given, or ``None`` where the caller has none.
    """

    declare: str
    listen: str | None = None

    def __str__(self) -> str:
        if self.listen is None:
            return self.declare
        return (
            f"{self.declare}, and give {self.listen} a direct connection to PostgreSQL "
            "for LISTEN/NOTIFY wake-ups"
        )


@dataclass(frozen=True, slots=True)
class PoolerRefusal:
    """A connection pooler in transaction mode refused a session setting at connect.

    ``setting`` is the refused parameter's name (``"?"`` when the server's answer did not
    give a plain name). A caller raises its typed configuration error with
    :meth:`explain` and chains the driver's error, so a front end that configured the
    caller (the CLI) can recognise the refusal again and word it in its own terms.
    """

    setting: str

    def __str__(self) -> str:
        return (
            f"the server refused the session setting {self.setting!r} at connect, as a "
            "connection pooler in transaction mode (PgBouncer) does"
        )

    def explain(self, advice: PoolerAdvice) -> str:
        """Return the refusal and what to change, as ``advice`` words it."""
        return f"{self}: {advice}"


def pooler_refusal(exc: BaseException) -> PoolerRefusal | None:
    """Recognise a pooler refusing steeple's startup settings (``None``: any other failure).

    PgBouncer answers a startup parameter it does not know with ``unsupported startup
    parameter: NAME`` (SQLSTATE 08P01).
    """
    text = str(exc)
    marker = "unsupported startup parameter"
    if marker not in text:
        return None
    words = text.split(marker, 1)[1].lstrip(": ").split()
    name = words[0] if words else "?"
    return PoolerRefusal(name if name.replace("_", "").isalnum() else "?")
