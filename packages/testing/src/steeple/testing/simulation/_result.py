"""What a simulation returns: counts, lateness, backlog over time and the limits it hit."""

from __future__ import annotations

import bisect
import json
from array import array
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from typing import Any

import attrs

from steeple.core.occurrences import OccurrenceState
from steeple.core.policies import MissedRunPolicy
from steeple.testing.simulation._scenario import Scenario

__all__ = [
    "DefinitionResult",
    "DueRun",
    "Hits",
    "Lateness",
    "OccurrenceOutcome",
    "Series",
    "SimulationResult",
    "Stats",
]


def _iso(instant: datetime | None) -> str | None:
    if instant is None:
        return None
    return instant.astimezone(UTC).isoformat().replace("+00:00", "Z")


def _seconds(us: int | None) -> float | None:
    return None if us is None else us / 1_000_000


@attrs.frozen
class Lateness:
    """How late publications were: from the due instant to the recorded publication, seconds.

    Percentiles are nearest-rank over every published occurrence; all ``None`` when
    nothing was published.
    """

    count: int = 0
    p50: float | None = None
    p90: float | None = None
    p99: float | None = None
    max: float | None = None

    @classmethod
    def of(cls, values_us: Iterable[int]) -> Lateness:
        """Summarize latenesses given in microseconds."""
        ordered = sorted(values_us)
        n = len(ordered)
        if not n:
            return cls()

        def rank(p: int) -> float | None:
            # Nearest rank: the smallest value with at least p% of the values at or below it.
            return _seconds(ordered[max(0, -(-p * n // 100) - 1)])

        return cls(n, rank(50), rank(90), rank(99), _seconds(ordered[-1]))

    def to_json(self) -> dict[str, Any]:
        """Return a JSON-ready dict (seconds)."""
        return attrs.asdict(self)


@attrs.frozen
class Stats:
    """Counts of one definition, one policy or everything.

    Attributes:
        materialized: occurrences the ticks created.
        published: recorded as published by a relay.
        dead: dead-lettered (a permanent failure, ten attempts, or the window's end).
        expired: their delivery window ended before publication.
        cancelled: cancelled with their definition.
        live: not finished when the simulation ended (pending, leased or waiting to retry).
        attempts: publication attempts made on them (failures included).
        lateness: due instant to recorded publication.
    """

    materialized: int = 0
    published: int = 0
    dead: int = 0
    expired: int = 0
    cancelled: int = 0
    live: int = 0
    attempts: int = 0
    lateness: Lateness = Lateness()

    def to_json(self) -> dict[str, Any]:
        """Return a JSON-ready dict."""
        data = attrs.asdict(self, recurse=False)
        data["lateness"] = self.lateness.to_json()
        return data


@attrs.frozen
class DefinitionResult:
    """One definition's outcome."""

    name: str
    cron: str
    policy: MissedRunPolicy
    stats: Stats

    def to_json(self) -> dict[str, Any]:
        """Return a JSON-ready dict."""
        return {
            "name": self.name,
            "cron": self.cron,
            "policy": self.policy.value,
            **self.stats.to_json(),
        }


@attrs.frozen
class Hits:
    """Limits and faults the run ran into, and how much work the store did.

    Attributes:
        ticks: successful tick calls.
        saturated_ticks: ticks that filled their budget (a backlog was being caught up).
        capacity_errors: ticks refused because the occurrence quota was full.
        clock_errors: calls refused because the clock trailed the recorded time by > 5 s.
        claims: claim calls.
        relays: relay calls.
        broker_failures: relays whose publication failed (outage or drawn failure).
        acknowledgements_lost: relays whose broker accepted but lost the acknowledgement.
        duplicates: publications the broker recognised by their idempotency key.
        leases_lost: relays refused because their lease had lapsed or been fenced.
        leases_abandoned: leases dropped unrelayed (a host outage or a clock error began).
        store_calls: every call made to the store, listings and purges included.
    """

    ticks: int = 0
    saturated_ticks: int = 0
    capacity_errors: int = 0
    clock_errors: int = 0
    claims: int = 0
    relays: int = 0
    broker_failures: int = 0
    acknowledgements_lost: int = 0
    duplicates: int = 0
    leases_lost: int = 0
    leases_abandoned: int = 0
    store_calls: int = 0

    def to_json(self) -> dict[str, Any]:
        """Return a JSON-ready dict."""
        return attrs.asdict(self)


@attrs.frozen
class Series:
    """Backlog and lateness over time, one bucket per sample interval.

    Attributes:
        times: the end of each bucket (the instant its backlog was sampled).
        backlog: live occurrences (pending, leased, waiting to retry) left at the end of
            each bucket (sampled before the work due at that instant), per policy value and
            under ``"all"``; while the host is down the last value is carried (nothing
            can change the store then).
        materialized: occurrences materialized in each bucket (by the store's time),
            per policy and ``"all"``.
        published: publications recorded in each bucket, per policy and ``"all"``.
        max_lateness: the largest lateness (seconds) among each bucket's publications,
            ``None`` when there were none; per policy and ``"all"``.
    """

    times: tuple[datetime, ...]
    backlog: Mapping[str, tuple[int, ...]]
    materialized: Mapping[str, tuple[int, ...]]
    published: Mapping[str, tuple[int, ...]]
    max_lateness: Mapping[str, tuple[float | None, ...]]

    def to_json(self) -> dict[str, Any]:
        """Return a JSON-ready dict."""
        return {
            "times": [_iso(t) for t in self.times],
            "backlog": {k: list(v) for k, v in self.backlog.items()},
            "materialized": {k: list(v) for k, v in self.materialized.items()},
            "published": {k: list(v) for k, v in self.published.items()},
            "max_lateness": {k: list(v) for k, v in self.max_lateness.items()},
        }


@attrs.frozen
class OccurrenceOutcome:
    """One occurrence's end (recorded only when the run is asked to trace)."""

    definition_name: str
    due_at: datetime
    state: OccurrenceState
    attempts: int
    materialized_at: datetime
    published_at: datetime | None

    def to_json(self) -> dict[str, Any]:
        """Return a JSON-ready dict."""
        return {
            "definition": self.definition_name,
            "due_at": _iso(self.due_at),
            "state": self.state.value,
            "attempts": self.attempts,
            "materialized_at": _iso(self.materialized_at),
            "published_at": _iso(self.published_at),
        }


@attrs.frozen
class DueRun:
    """One due instant of a definition's calendar in the simulated range, and its end.

    Derived from the traced occurrences and the calendars (see
    :meth:`SimulationResult.due_runs`); a due instant no occurrence was materialized for
    is here too, which the occurrence trace alone cannot show.

    Attributes:
        definition_name: whose calendar.
        due_at: the due instant.
        state: the end of the occurrence materialized for it, ``None`` when none was.
        published_at: when a relay recorded its publication, if it was published.
        lateness: ``published_at - due_at`` in seconds, if it was published.
        coalesced_into: for a due instant a coalesce definition folded into another run
            (the one materialized for the oldest missed instant), that run's due instant;
            ``None`` otherwise. ``state`` is then ``None``.
    """

    definition_name: str
    due_at: datetime
    state: OccurrenceState | None
    published_at: datetime | None = None
    lateness: float | None = None
    coalesced_into: datetime | None = None


@attrs.frozen
class SimulationResult:
    """Everything one run measured. Same scenario and seed: an equal result.

    Attributes:
        scenario: what was run.
        seed: the seed of the store's random source and the broker model.
        definitions: per definition, in creation order.
        policies: per missed-run policy value (``"catch_up"``, ``"coalesce"``).
        overall: everything together.
        series: backlog and lateness over time.
        hits: limits and faults hit.
        occurrences: each occurrence's end, by definition and due time (only when traced).
        stopped_at: when the run was stopped early (its progress callback said so, or
            Ctrl-C): the counts cover the range up to that simulated instant only, and
            what was still open then counts as open. None: the whole range ran.
    """

    scenario: Scenario
    seed: int
    definitions: tuple[DefinitionResult, ...]
    policies: Mapping[str, Stats]
    overall: Stats
    series: Series
    hits: Hits
    occurrences: tuple[OccurrenceOutcome, ...] | None = None
    stopped_at: datetime | None = None

    def to_json(self) -> dict[str, Any]:
        """Return the whole result as JSON-ready data (instants ISO 8601, durations seconds)."""
        data: dict[str, Any] = {
            "scenario": scenario_json(self.scenario),
            "seed": self.seed,
            "overall": self.overall.to_json(),
            "policies": {k: v.to_json() for k, v in self.policies.items()},
            "definitions": [d.to_json() for d in self.definitions],
            "hits": self.hits.to_json(),
            "series": self.series.to_json(),
        }
        if self.occurrences is not None:
            data["occurrences"] = [o.to_json() for o in self.occurrences]
        if self.stopped_at is not None:
            data["stopped_at"] = _iso(self.stopped_at)
        return data

    def dumps(self, *, indent: int | None = 2) -> str:
        """Return :meth:`to_json` as JSON text (keys in a fixed order, no NaN)."""
        return json.dumps(self.to_json(), indent=indent, allow_nan=False)

    def due_runs(self) -> tuple[DueRun, ...]:
        """Return every due instant of every definition in the range, with what became of it.

        By definition name, then due instant. A definition's calendar counts from its
        ``first_after`` to the end of the range or to the scheduled cancellation of its name.
        A due instant with no materialized occurrence was coalesced into the first run of
        its definition materialized at or after it (a coalesce definition), or was not
        materialized before the range ended.

        Raises:
            ValueError: the run was not traced (``trace=True`` records the occurrences).
        """
        if self.occurrences is None:
            raise ValueError("due runs need the occurrences: run the simulation with trace=True")
        return _due_runs(self.scenario, self.occurrences)


def _due_runs(scenario: Scenario, traced: Iterable[OccurrenceOutcome]) -> tuple[DueRun, ...]:
    made: dict[str, list[OccurrenceOutcome]] = {}
    for outcome in traced:
        made.setdefault(outcome.definition_name, []).append(outcome)
    created = [(scenario.start, d) for d in scenario.definitions]
    created += [(c.at, d) for c in scenario.changes for d in c.create]
    runs: list[DueRun] = []
    seen: set[tuple[str, datetime]] = set()
    for since, definition in created:
        name = definition.name
        stop = min(
            [scenario.end] + [c.at for c in scenario.changes if name in c.cancel and c.at >= since]
        )
        # The runs by materialization: the first one materialized at or after an instant
        # is the one a coalesce definition folded the instant into.
        by_making = sorted(made.get(name, ()), key=lambda o: (o.materialized_at, o.due_at))
        making = [o.materialized_at for o in by_making]
        due = definition.cron.next_after(definition.first_after)
        while due is not None and due < stop:
            if (name, due) not in seen:
                seen.add((name, due))
                into = None
                if definition.policy is MissedRunPolicy.COALESCE:
                    k = bisect.bisect_left(making, due)
                    into = by_making[k].due_at if k < len(by_making) else None
                runs.append(DueRun(name, due, None, coalesced_into=into))
            due = definition.cron.next_after(due)
    index = {(r.definition_name, r.due_at): i for i, r in enumerate(runs)}
    for outcome in traced:
        late = None
        if outcome.published_at is not None:
            late = (outcome.published_at - outcome.due_at).total_seconds()
        run = DueRun(
            outcome.definition_name, outcome.due_at, outcome.state, outcome.published_at, late
        )
        key = (run.definition_name, run.due_at)
        if key in index:
            runs[index[key]] = run
        else:
            runs.append(run)
    return tuple(sorted(runs, key=lambda r: (r.definition_name, r.due_at)))


def scenario_json(scenario: Scenario) -> dict[str, Any]:
    """Return the scenario as JSON-ready data (what a reader needs to rerun it)."""
    config = scenario.config
    relay = scenario.relay
    return {
        "namespace": config.namespace,
        "max_definitions": config.max_definitions,
        "max_occurrences": config.max_occurrences,
        "delivery_window_s": config.delivery_window.total_seconds(),
        "lease_s": config.lease_duration.total_seconds(),
        "start": _iso(scenario.start),
        "end": _iso(scenario.end),
        "definitions": [_definition_json(d) for d in scenario.definitions],
        "tick_interval_s": scenario.ticking.interval.total_seconds(),
        "tick_budget": scenario.ticking.budget,
        "workers": relay.workers,
        "rate_per_worker": relay.rate,
        "claim_limit": relay.claim_limit,
        "concurrency": relay.concurrency,
        "poll_interval_s": relay.poll_interval.total_seconds(),
        "broker_outages": [i.iso() for i in scenario.broker.outages],
        "broker_failure_rate": scenario.broker.failure_rate,
        "broker_ack_loss_rate": scenario.broker.ack_loss_rate,
        "host_outages": [i.iso() for i in scenario.host_outages],
        "clock_regressions": [
            {"at": _iso(r.at), "by_s": r.by.total_seconds()} for r in scenario.clock_regressions
        ],
        "changes": [
            {
                "at": _iso(c.at),
                "cancel": list(c.cancel),
                "create": [_definition_json(d) for d in c.create],
            }
            for c in scenario.changes
        ],
        "sample_interval_s": scenario.samples_every.total_seconds(),
    }


def _definition_json(definition: Any) -> dict[str, Any]:
    return {
        "name": definition.name,
        "cron": definition.cron.expression,
        "policy": definition.policy.value,
        "first_after": _iso(definition.first_after),
        "topic": definition.message.topic,
        "message_type": definition.message.message_type,
    }


class Tally:
    """Mutable counts while a run goes on (private to the simulator)."""

    __slots__ = (
        "attempts",
        "cancelled",
        "dead",
        "expired",
        "lateness",
        "live",
        "materialized",
        "published",
    )

    def __init__(self) -> None:
        self.materialized = 0
        self.published = 0
        self.dead = 0
        self.expired = 0
        self.cancelled = 0
        self.live = 0
        self.attempts = 0
        self.lateness: array[int] = array("q")

    def add(self, other: Tally) -> None:
        """Add ``other``'s counts and latenesses to these."""
        self.materialized += other.materialized
        self.published += other.published
        self.dead += other.dead
        self.expired += other.expired
        self.cancelled += other.cancelled
        self.live += other.live
        self.attempts += other.attempts
        self.lateness.extend(other.lateness)

    def freeze(self) -> Stats:
        """Return the counts as a :class:`Stats` value."""
        return Stats(
            materialized=self.materialized,
            published=self.published,
            dead=self.dead,
            expired=self.expired,
            cancelled=self.cancelled,
            live=self.live,
            attempts=self.attempts,
            lateness=Lateness.of(self.lateness),
        )
