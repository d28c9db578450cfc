"""Which due tasks a work-queue claim may start: pauses, running limits and start rates.

A scope is a queue or a task name (the task name's limits count its tasks in every queue
together). Each scope may be paused (queues only), may cap how many of its tasks run at
once (``max_running``), and may cap how many of its tasks start in any sliding window of
``rate_period`` (``rate_limit``): a start counts while it is later than a period ago, so one
made exactly a period ago no longer does.

A claim asks each queue, in the order given, for up to its ``want`` tasks. Nothing comes
from a paused queue. A queue's budget is its want, cut to what its own limits leave room
for; within it, the task names that have limits come first (by name), each taking its own
due tasks within the room its limits leave, then the tasks of every other name. In each
step the candidates are taken in the order given (the claim order: highest priority, then
earliest due, then the order they became due). A claim whose budget a limit cut reports
that it was held back, and when the oldest start in a binding rate window leaves it.

A task may carry a limit key (a customer, a tenant), and a scope may limit each of its keys
apart: the most of its tasks with one key running at once (``max_running_per_key``) and
started per window (``rate_limit_per_key`` per ``rate_period_per_key``), counted over the
scope's tasks with that key. Within a step, a candidate whose key has no room left in its
queue or its task name is skipped (and reported held back, with when its key's rate window
frees a start) and the walk goes on to the next candidate: a saturated key never blocks
the other keys behind it. Tasks without a key are not limited per key.

Where a claim walks the claim order from (:class:`ClaimWalk`): a claimer may start a
queue's walk after the last task it took there (its :class:`ClaimPosition`) instead of at
the front, which skips what it already claimed (entries a held vacuum horizon keeps in the
claim index). A due task can still lie before the position (a higher priority or an
earlier due time enqueued later, a retry whose backoff ended, a task handed back, an
enqueue that committed late, one another claim had locked), and only a walk from the front
finds it. So the walk starts at the front when the claimer has no position, when its last
walk from the front is ``interval`` (its poll interval) old or more, and right after a
walk from its position found nothing (unless a limit held that claim back): a due task
before the position waits at most one interval for a claimer with room, and is then taken
in claim order.

Pure functions of the values they are given: the database's claim function applies the
same rule in SQL and the in-memory queue calls :func:`plan_claim`; a differential test
holds the two together.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from typing import Generic, Protocol, TypeVar

import attrs

__all__ = [
    "ClaimCandidate",
    "ClaimPlan",
    "ClaimPosition",
    "ClaimWalk",
    "KeyScope",
    "KeyState",
    "ScopeLimits",
    "ScopeState",
    "frees_at",
    "plan_claim",
    "record_starts",
    "room",
    "starts_in_window",
]


class ClaimCandidate(Protocol):
    """A due pending task a claim may start: the queue it is in and its task name."""

    @property
    def queue(self) -> str:
        """The queue the task waits in."""
        ...

    @property
    def task_name(self) -> str:
        """The task's name."""
        ...

    @property
    def limit_key(self) -> str | None:
        """The key its scopes' per-key limits count it under (``None``: no key)."""
        ...


C = TypeVar("C", bound=ClaimCandidate)


@attrs.frozen
class ScopeLimits:
    """A queue's or a task name's settings (``None``: no such limit)."""

    paused: bool = False
    max_running: int | None = None
    rate_limit: int | None = None
    rate_period: timedelta | None = None
    max_running_per_key: int | None = None
    rate_limit_per_key: int | None = None
    rate_period_per_key: timedelta | None = None

    @property
    def limited(self) -> bool:
        """Whether a running limit or a rate limit applies (to the scope as a whole)."""
        return self.max_running is not None or self.rate_limit is not None

    @property
    def keyed(self) -> bool:
        """Whether a per-key running limit or per-key rate limit applies."""
        return self.max_running_per_key is not None or self.rate_limit_per_key is not None

    def per_key(self) -> ScopeLimits:
        """Return the limits one key of this scope is held to, as a scope of its own."""
        return ScopeLimits(
            max_running=self.max_running_per_key,
            rate_limit=self.rate_limit_per_key,
            rate_period=self.rate_period_per_key,
        )


@attrs.frozen
class ScopeState:
    """A scope's limits with what of it runs now and the starts it recorded."""

    limits: ScopeLimits = ScopeLimits()
    running: int = 0
    starts: tuple[datetime, ...] = ()


@attrs.frozen
class KeyState:
    """What of one key of a scope runs now and the starts its window recorded."""

    running: int = 0
    starts: tuple[datetime, ...] = ()


KeyScope = tuple[str, str, str]
"""A key of a scope: (``"queue"`` or ``"task"``, the scope's name, the limit key)."""


def starts_in_window(
    starts: Sequence[datetime], period: timedelta, now: datetime
) -> tuple[datetime, ...]:
    """Return the starts later than ``period`` before ``now`` (that instant is out)."""
    return tuple(at for at in starts if at > now - period)


def record_starts(
    starts: Sequence[datetime], period: timedelta, now: datetime, count: int
) -> tuple[datetime, ...]:
    """Return a window's log after ``count`` starts at ``now``: older starts dropped."""
    return (*starts_in_window(starts, period, now), *([now] * count))


def room(scope: ScopeState, now: datetime, taken: int = 0) -> int | None:
    """Return how many more of a scope's tasks may start now (may be negative).

    ``taken``: what this claim already started in the scope. ``None``: no limit applies.
    """
    limits = scope.limits
    left: int | None = None
    if limits.max_running is not None:
        left = limits.max_running - taken - scope.running
    if limits.rate_limit is not None and limits.rate_period is not None:
        window = starts_in_window(scope.starts, limits.rate_period, now)
        by_rate = limits.rate_limit - taken - len(window)
        left = by_rate if left is None else min(left, by_rate)
    return left


def frees_at(scope: ScopeState, now: datetime) -> datetime | None:
    """Return when the oldest start in a scope's window leaves it (``now``'s, when empty).

    ``None`` when the scope has no rate limit.
    """
    limits = scope.limits
    if limits.rate_limit is None or limits.rate_period is None:
        return None
    window = starts_in_window(scope.starts, limits.rate_period, now)
    return min(window, default=now) + limits.rate_period


@attrs.frozen
class ClaimPlan(Generic[C]):
    """What a claim starts, whether a limit held work back, and when a start frees up."""

    started: tuple[C, ...]
    held: bool
    frees_at: datetime | None


def _earliest(a: datetime | None, b: datetime | None) -> datetime | None:
    if a is None:
        return b
    if b is None:
        return a
    return min(a, b)


@attrs.define
class _Walk:
    """One claim's bookkeeping: what it took, what held it back, when a start frees up.

    It counts what the claim took per limited name and per key of the scopes that limit keys.
    """

    queues: Mapping[str, ScopeState]
    names: Mapping[str, ScopeState]
    keys: Mapping[KeyScope, KeyState]
    now: datetime
    limited: Sequence[str]
    """The names with limits, in the order the claim serves them."""
    taken_by_name: dict[str, int]
    """What the claim took so far of each name in :attr:`limited` (its keys are those names)."""
    taken: dict[KeyScope, int] = attrs.field(factory=dict)
    held: bool = False
    frees: datetime | None = None

    def _keyed_scopes(self, c: ClaimCandidate) -> list[tuple[KeyScope, ScopeLimits]]:
        if c.limit_key is None:
            return []
        found = []
        for kind, name, settings in (
            ("queue", c.queue, self.queues.get(c.queue)),
            ("task", c.task_name, self.names.get(c.task_name)),
        ):
            if settings is not None and settings.limits.keyed:
                found.append(((kind, name, c.limit_key), settings.limits.per_key()))
        return found

    def take(self, pool: Sequence[C], n: int) -> list[C]:
        """Return up to ``n`` of ``pool`` in order, skipping those whose key is full."""
        chosen: list[C] = []
        for c in pool:
            if len(chosen) >= n:
                break
            scopes = self._keyed_scopes(c)
            blocked = False
            for key, limits in scopes:
                used = self.keys.get(key, KeyState())
                state = ScopeState(limits, used.running, used.starts)
                left = room(state, self.now, self.taken.get(key, 0))
                if left is not None and left <= 0:
                    blocked = True
                    self.frees = _earliest(self.frees, frees_at(state, self.now))
            if blocked:
                self.held = True
                continue
            for key, _limits in scopes:
                self.taken[key] = self.taken.get(key, 0) + 1
            chosen.append(c)
        return chosen

    def within(self, scope: ScopeState, want: int, left: int | None) -> int:
        """Return how many of ``want`` the scope's room ``left`` allows (``None``: all).

        It notes whether the scope's limits held work back and when the scope frees a start.
        """
        allowed = want if left is None else min(want, left)
        self.frees = _earliest(self.frees, frees_at(scope, self.now))
        if allowed < want:
            self.held = True
        return allowed

    def take_queue(self, mine: Sequence[C], budget: int) -> list[C]:
        """Return up to ``budget`` of one queue's tasks ``mine``, by name.

        Each limited name's tasks come first, within the name's limits; the other names'
        tasks get what is left.
        """
        chosen: list[C] = []
        for name in self.limited:
            want = budget - len(chosen)
            if want <= 0:
                break
            settings = self.names[name]
            left = room(settings, self.now, self.taken_by_name[name])
            allowed = self.within(settings, want, left)
            if allowed <= 0:
                continue
            named = self.take([c for c in mine if c.task_name == name], allowed)
            self.taken_by_name[name] += len(named)
            chosen.extend(named)
        if budget - len(chosen) > 0:
            others = [c for c in mine if c.task_name not in self.taken_by_name]
            chosen.extend(self.take(others, budget - len(chosen)))
        return chosen


def plan_claim(
    wants: Sequence[tuple[str, int]],
    candidates: Sequence[C],
    *,
    queues: Mapping[str, ScopeState],
    names: Mapping[str, ScopeState],
    now: datetime,
    total: int | None = None,
    keys: Mapping[KeyScope, KeyState] | None = None,
) -> ClaimPlan[C]:
    """Return which ``candidates`` a claim starts, by the rule in this module's docstring.

    Args:
        wants: each queue (once) with how many of its tasks the claimer wants, in order.
        candidates: the due pending tasks the claim may take, in claim order.
        queues: the queues' settings, running counts and starts (absent: none).
        names: the task names' settings, running counts and starts (absent: none); only
            the names the claimer runs.
        now: the claim's instant, that of its starts.
        total: the most tasks over all queues together (``None``: the wants alone); once
            it is reached, later queues are not asked.
        keys: what runs and what started per key of the scopes that limit keys (absent:
            nothing).

    The plan's ``frees_at`` is the earliest instant a start leaves the window of a rate
    limit the claim consulted, or of a key a limit skipped; it matters when ``held`` is true.
    """
    limited = sorted(n for n, s in names.items() if s.limits.limited)
    walk = _Walk(queues, names, keys or {}, now, limited, dict.fromkeys(limited, 0))
    started: list[C] = []
    for queue, want in wants:
        if total is not None:
            want = min(want, total - len(started))
            if want <= 0:
                break
        settings = queues.get(queue)
        if settings is None:
            budget = want
        elif settings.limits.paused:
            continue
        else:
            budget = walk.within(settings, want, room(settings, now))
        started.extend(walk.take_queue([c for c in candidates if c.queue == queue], budget))
    return ClaimPlan(tuple(started), walk.held, walk.frees)


@attrs.frozen
class ClaimPosition:
    """A task's place in its queue's claim order (highest priority, earliest due, oldest)."""

    priority: int
    run_at: datetime
    id: int

    def key(self) -> tuple[int, datetime, int]:
        """Return the sort key of the claim order (smallest first)."""
        return (-self.priority, self.run_at, self.id)

    def precedes(self, other: ClaimPosition) -> bool:
        """Tell whether this place comes before ``other`` in the claim order."""
        return self.key() < other.key()


@attrs.frozen
class ClaimWalk:
    """Where a claimer's next claim of one queue walks from; the rule in the module docstring.

    A claimer keeps one per queue, asks :meth:`start` before each claim, and replaces it by
    :meth:`after` with what the claim took. Times are the claimer's monotonic seconds.
    """

    position: ClaimPosition | None = None
    """The last task taken, in claim order (``None``: walk from the front)."""
    front_at: float | None = None
    """When a claim last walked from the front (``None``: never)."""
    owed: bool = False
    """A walk from the position found nothing: the next walks from the front at once."""

    def start(self, now: float, interval: float) -> ClaimPosition | None:
        """Return the position to walk after, or ``None`` to walk from the front."""
        if (
            self.position is None
            or self.owed
            or self.front_at is None
            or now - self.front_at >= interval
        ):
            return None
        return self.position

    def after(
        self,
        walked_from: ClaimPosition | None,
        taken: Sequence[ClaimPosition],
        at: float,
        *,
        held: bool = False,
    ) -> ClaimWalk:
        """Return the walk after a claim from ``walked_from`` (at ``at``) took ``taken``.

        ``held``: a limit held the claim back, so taking nothing says nothing of the walk
        (no walk from the front is owed; the position stays).
        """
        front_at = at if walked_from is None else self.front_at
        if taken:
            return ClaimWalk(max(taken, key=ClaimPosition.key), front_at)
        if held:
            return ClaimWalk(self.position, front_at)
        return ClaimWalk(None, front_at, owed=walked_from is not None)
