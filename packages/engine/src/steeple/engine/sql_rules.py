"""The core's selection rules as SQL text, for the stores that keep rows in SQL databases.

What the PostgreSQL and SQLite repositories select by (a set of occurrence states, the
claim rule) is decided in :mod:`steeple.core`; this renders it once, in SQL both accept.
Only enum values (fixed identifiers) are inlined; every instant is a parameter the caller
names (``$2`` for PostgreSQL, ``?2`` for SQLite).
"""

from __future__ import annotations

from collections.abc import Iterable

from steeple.core.leases import ClaimRule
from steeple.core.occurrences import OccurrenceState

__all__ = ["claim_predicate", "state_list"]


def state_list(states: Iterable[OccurrenceState | str]) -> str:
    """Return ``states`` as a parenthesized SQL list of their values, sorted.

    Enum values only (fixed identifiers), so inlining cannot inject; sorted, so a list
    spelled like an index's condition matches it. An empty set is ``(NULL)`` (matches no
    row).

    Raises:
        ValueError: a value that is not an occurrence state.
    """
    values = sorted(OccurrenceState(s).value for s in states)
    return "(" + ", ".join(f"'{v}'" for v in values) + ")" if values else "(NULL)"


def claim_predicate(rule: ClaimRule, now: str) -> str:
    """Return the condition an occurrence row meets when ``rule`` admits it at ``now``.

    ``now`` is the parameter that carries the instant. The window's end is not part of it
    (the queries compare ``window_ends_at`` on their own, to use their indexes).
    """
    arms = []
    if rule.ready:
        arms.append(f"state IN {state_list(rule.ready)}")
    if rule.after_next_attempt:
        arms.append(
            f"(state IN {state_list(rule.after_next_attempt)} AND next_attempt_at <= {now})"
        )
    if rule.after_lease_expiry:
        arms.append(
            f"(state IN {state_list(rule.after_lease_expiry)} AND lease_expires_at <= {now})"
        )
    return f"({' OR '.join(arms) or 'FALSE'})"
