"""What a simulation runs: the scenario values (definitions, time range, capacities, faults)."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from datetime import UTC, datetime, timedelta
from typing import Final

import attrs

from steeple.core import instants, limits
from steeple.core.config import RecurringConfig, RecurringDefinition
from steeple.core.errors import ConfigurationError
from steeple.core.policies import validate_budget

__all__ = [
    "CALENDAR_END",
    "BrokerModel",
    "ClockRegression",
    "Interval",
    "RelayCapacity",
    "Scenario",
    "ScenarioError",
    "ScheduleChange",
    "Ticking",
    "parse_instant",
    "parse_iso_duration",
]

CALENDAR_END: Final = datetime(2101, 1, 1, tzinfo=UTC)
"""Nothing is due after 2100 (the calendar is exhausted): a scenario ends by this instant."""
_MAX_TEXT: Final = 100
"""Longest instant, duration or interval text accepted (a longer one is not ISO 8601 here)."""
_MAX_SAMPLES: Final = 100_000
_MAX_WORKERS: Final = 1000
_MAX_REGRESSION: Final = timedelta(days=7)


class ScenarioError(ConfigurationError):
    """A scenario value is malformed or outside what the simulator accepts.

    A ``ValueError`` (through :class:`~steeple.core.errors.ConfigurationError`); the message
    is one line saying what to fix and never echoes more than the start of a long input.
    """


def _shown(text: str) -> str:
    return repr(text if len(text) <= 40 else text[:37] + "...")


def _instant(value: object, what: str) -> datetime:
    if not isinstance(value, datetime):
        raise ScenarioError(f"{what} must be a datetime, not {type(value).__name__}")
    if value.tzinfo is None or value.utcoffset() is None:
        raise ScenarioError(f"{what} must be timezone-aware (UTC); got naive {value.isoformat()}")
    return value.astimezone(UTC)


def _positive(value: object, what: str, *, minimum: timedelta = timedelta(milliseconds=1)) -> None:
    if not isinstance(value, timedelta):
        raise ScenarioError(f"{what} must be a datetime.timedelta, not {type(value).__name__}")
    if value < minimum:
        raise ScenarioError(f"{what} must be at least {minimum}; got {value}")
    if value % timedelta(milliseconds=1):
        raise ScenarioError(f"{what} must be a whole number of milliseconds; got {value}")


def _rate(value: object, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ScenarioError(f"{what} must be a number, not {type(value).__name__}")
    if not math.isfinite(value) or not 0.0 <= value <= 1.0:
        raise ScenarioError(f"{what} must be a finite number within [0, 1]; got {value!r}")
    return float(value)


def _count(value: object, what: str, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ScenarioError(f"{what} must be an int, not {type(value).__name__}")
    if not lo <= value <= hi:
        raise ScenarioError(f"{what} must be between {lo} and {hi}; got {value}")


# --- ISO 8601 text ------------------------------------------------------------------------

_DURATION: Final = re.compile(
    r"P(?:(?P<w>\d{1,6})W)?(?:(?P<d>\d{1,6})D)?"
    r"(?:T(?:(?P<h>\d{1,7})H)?(?:(?P<m>\d{1,9})M)?(?:(?P<s>\d{1,11}(?:\.\d{1,6})?)S)?)?\Z"
)


def parse_iso_duration(text: str) -> timedelta:
    """Parse an ISO 8601 duration of weeks, days, hours, minutes and seconds (``PT6H``, ``P1DT2H``).

    Years and months are refused: their length depends on the calendar.

    Raises:
        ScenarioError: not such a duration, an empty one (``P``, ``PT``), or one too long to
            represent.
    """
    if not isinstance(text, str):
        raise ScenarioError(f"a duration must be a str, not {type(text).__name__}")
    value = text.strip().upper()
    match = _DURATION.match(value) if len(value) <= _MAX_TEXT else None
    if match is None or value in ("P", "PT") or value.endswith("T"):
        raise ScenarioError(
            f"{_shown(text)} is not an ISO 8601 duration: write it like PT6H, PT30M, P1D or P1DT2H"
        )
    parts = {k: float(v) if k == "s" else int(v) for k, v in match.groupdict().items() if v}
    try:
        return timedelta(
            weeks=parts.get("w", 0),
            days=parts.get("d", 0),
            hours=parts.get("h", 0),
            minutes=parts.get("m", 0),
            seconds=parts.get("s", 0),
        )
    except OverflowError:
        raise ScenarioError(f"the duration {_shown(text)} is too long") from None


def parse_instant(text: str) -> datetime:
    """Parse an ISO 8601 instant with an explicit offset (``2026-01-31T22:00Z``).

    The core's parser (:func:`steeple.core.instants.parse_instant`) with the simulator's
    error.

    Raises:
        ScenarioError: not an ISO 8601 date-time, or one without ``Z`` or an offset.
    """
    try:
        return instants.parse_instant(text)
    except ConfigurationError as exc:
        raise ScenarioError(str(exc)) from None


def _start(value: object) -> datetime:
    return _instant(value, "start")


def _end(value: object) -> datetime:
    return _instant(value, "end")


def _at(value: object) -> datetime:
    return _instant(value, "the instant")


def _failure_rate(value: object) -> float:
    return _rate(value, "failure rate")


def _ack_loss_rate(value: object) -> float:
    return _rate(value, "acknowledgement-loss rate")


def _broker_outages(value: Iterable[Interval]) -> tuple[Interval, ...]:
    return _intervals(value, "broker outages")


def _host_outages(value: Iterable[Interval]) -> tuple[Interval, ...]:
    return _intervals(value, "host outages")


def _regressions(value: Iterable[ClockRegression]) -> tuple[ClockRegression, ...]:
    items = tuple(value)
    for item in items:
        if not isinstance(item, ClockRegression):
            raise ScenarioError("clock_regressions must be ClockRegression values")
    return tuple(sorted(items, key=lambda r: r.at))


def _changes(value: Iterable[ScheduleChange]) -> tuple[ScheduleChange, ...]:
    items = tuple(value)
    for item in items:
        if not isinstance(item, ScheduleChange):
            raise ScenarioError("changes must be ScheduleChange values")
    return tuple(sorted(items, key=lambda c: c.at))


# --- values ------------------------------------------------------------------------------------


@attrs.frozen
class Interval:
    """A half-open time interval ``[start, end)`` (an outage).

    Raises:
        ScenarioError: an instant is naive or not a datetime, or ``end`` is not after ``start``.
    """

    start: datetime = attrs.field(converter=_start)
    end: datetime = attrs.field(converter=_end)

    def __attrs_post_init__(self) -> None:
        if self.end <= self.start:
            raise ScenarioError(
                f"interval {self.start.isoformat()}/{self.end.isoformat()} is empty or reversed: "
                "its end must come after its start"
            )

    @classmethod
    def parse(cls, text: str) -> Interval:
        """Parse ISO 8601 ``start/end``, ``start/duration`` or ``duration/end``.

        Example: ``2026-01-31T22:00Z/PT6H`` is six hours from 22:00 UTC.

        Raises:
            ScenarioError: malformed, naive, or reversed.
        """
        if not isinstance(text, str):
            raise ScenarioError(f"an interval must be a str, not {type(text).__name__}")
        if len(text) > 2 * _MAX_TEXT or text.count("/") != 1:
            raise ScenarioError(
                f"{_shown(text)} is not an ISO 8601 interval: write start/end or start/duration, "
                "like 2026-01-31T22:00Z/PT6H"
            )
        first, second = (part.strip() for part in text.split("/"))
        try:
            if first.upper().startswith("P"):
                end = parse_instant(second)
                return cls(end - parse_iso_duration(first), end)
            start = parse_instant(first)
            if second.upper().startswith("P"):
                return cls(start, start + parse_iso_duration(second))
            return cls(start, parse_instant(second))
        except OverflowError:
            raise ScenarioError(f"the interval {_shown(text)} leaves the datetime range") from None

    def contains(self, instant: datetime) -> bool:
        """Return whether ``instant`` lies in ``[start, end)``."""
        return self.start <= instant < self.end

    def iso(self) -> str:
        """Return the interval as ISO 8601 ``start/end`` text."""
        return f"{_iso(self.start)}/{_iso(self.end)}"


def _iso(instant: datetime) -> str:
    return instant.astimezone(UTC).isoformat().replace("+00:00", "Z")


def _intervals(value: Iterable[Interval], what: str) -> tuple[Interval, ...]:
    items = tuple(value)
    for item in items:
        if not isinstance(item, Interval):
            raise ScenarioError(f"{what} must be Interval values, not {type(item).__name__}")
    return tuple(sorted(items, key=lambda i: (i.start, i.end)))


@attrs.frozen
class Ticking:
    """How the ticker runs: every ``interval`` while work is due, ``budget`` occurrences a tick.

    A tick that fills its budget ticks again at once (a backlog is being caught up), as the
    ``steeple worker`` loops do.

    Raises:
        ScenarioError: ``interval`` under 1 ms or not whole milliseconds.
        RecurringConfigurationError: ``budget`` outside 1..100.
    """

    interval: timedelta = timedelta(seconds=1)
    budget: int = 100

    def __attrs_post_init__(self) -> None:
        _positive(self.interval, "tick interval")
        validate_budget(self.budget, "tick budget")


@attrs.frozen
class RelayCapacity:
    """The relay workers: how many, how fast each publishes, how much each claims.

    Each worker runs what ``steeple worker`` runs: one batched claim-and-relay of up to
    ``claim_limit`` leases, its publications ``concurrency`` at a time.

    Attributes:
        workers: relay workers claiming and publishing independently (1-1000).
        rate: publications per second of one publication slot: each publication takes
            ``1 / rate`` seconds (the broker's latency; ``None``: no time), so a worker
            publishes up to ``concurrency * rate`` per second.
        claim_limit: leases claimed at once (1-100); a full claim is claimed again right
            after its batch, a short one waits for new work.
        concurrency: publications of a batch in flight at once (1-100; the worker's
            default is 32).
        poll_interval: how often an idle worker would poll (the simulator jumps straight to
            the poll that can find work).

    Raises:
        ScenarioError: a value out of range, NaN or infinite.
        RecurringConfigurationError: ``claim_limit`` outside 1..100.
    """

    workers: int = 1
    rate: float | None = 50.0
    claim_limit: int = 100
    poll_interval: timedelta = timedelta(seconds=1)
    concurrency: int = limits.RELAY_CONCURRENCY

    def __attrs_post_init__(self) -> None:
        _count(self.workers, "workers", 1, _MAX_WORKERS)
        if self.rate is not None:
            if isinstance(self.rate, bool) or not isinstance(self.rate, int | float):
                raise ScenarioError(f"rate must be a number, not {type(self.rate).__name__}")
            if not math.isfinite(self.rate) or not 0.001 <= self.rate <= 1_000_000:
                raise ScenarioError(
                    "rate must be a finite number of publications per second between 0.001 and "
                    f"1,000,000 (or None for no limit); got {self.rate!r}"
                )
        validate_budget(self.claim_limit, "claim limit")
        _positive(self.poll_interval, "poll interval")
        _count(self.concurrency, "concurrency", limits.MIN_BATCH, limits.MAX_BATCH)


@attrs.frozen
class BrokerModel:
    """How the simulated broker fails (seeded: the same seed fails the same publications).

    Attributes:
        outages: intervals in which every publication fails (retryable, nothing accepted).
        failure_rate: the probability that a publication outside an outage fails
            (retryable, nothing accepted).
        ack_loss_rate: the probability that a publication is accepted but its
            acknowledgement is lost (the retry is deduplicated by the idempotency key).

    Raises:
        ScenarioError: a rate outside [0, 1], NaN, or rates summing over 1.
    """

    outages: tuple[Interval, ...] = attrs.field(default=(), converter=_broker_outages)
    failure_rate: float = attrs.field(default=0.0, converter=_failure_rate)
    ack_loss_rate: float = attrs.field(default=0.0, converter=_ack_loss_rate)

    def __attrs_post_init__(self) -> None:
        if self.failure_rate + self.ack_loss_rate > 1.0:
            raise ScenarioError("failure rate and acknowledgement-loss rate sum to more than 1")


@attrs.frozen
class ClockRegression:
    """At ``at`` the host clock is stepped back by ``by`` and runs on from there.

    A step of at most 5 s is absorbed (the store adopts its recorded time); a longer one
    makes calls fail with a clock error until the clock has caught up.

    Raises:
        ScenarioError: a naive instant, or ``by`` not a positive whole-millisecond duration
            of at most 7 days.
    """

    at: datetime = attrs.field(converter=_at)
    by: timedelta = attrs.field()

    def __attrs_post_init__(self) -> None:
        _positive(self.by, "clock regression")
        if self.by > _MAX_REGRESSION:
            raise ScenarioError(f"a clock regression is at most {_MAX_REGRESSION}; got {self.by}")

    @classmethod
    def parse(cls, text: str) -> ClockRegression:
        """Parse ``instant/duration``, e.g. ``2026-02-01T03:00Z/PT3S`` (3 s back at 03:00).

        Raises:
            ScenarioError: malformed.
        """
        if not isinstance(text, str):
            raise ScenarioError(f"a clock regression must be a str, not {type(text).__name__}")
        first, sep, second = text.partition("/")
        if not sep or len(text) > 2 * _MAX_TEXT:
            raise ScenarioError(
                f"{_shown(text)} is not a clock regression: write instant/duration, "
                "like 2026-02-01T03:00Z/PT3S"
            )
        return cls(parse_instant(first), parse_iso_duration(second))


def _definitions(value: Iterable[RecurringDefinition]) -> tuple[RecurringDefinition, ...]:
    items = tuple(value)
    for item in items:
        if not isinstance(item, RecurringDefinition):
            raise ScenarioError(
                f"definitions must be RecurringDefinition values, not {type(item).__name__}"
            )
    return items


def _names(value: Iterable[str]) -> tuple[str, ...]:
    items = tuple(value)
    for item in items:
        if not isinstance(item, str):
            raise ScenarioError(f"cancelled names must be str, not {type(item).__name__}")
    return items


@attrs.frozen
class ScheduleChange:
    """At ``at``, cancel the named definitions, then create new ones (a schedule change).

    Raises:
        ScenarioError: a naive instant or values of the wrong type.
    """

    at: datetime = attrs.field(converter=_at)
    cancel: tuple[str, ...] = attrs.field(default=(), converter=_names)
    create: tuple[RecurringDefinition, ...] = attrs.field(default=(), converter=_definitions)


_SAMPLE_STEPS: Final = tuple(
    timedelta(minutes=m) for m in (1, 5, 15, 30, 60, 120, 360, 720, 1440, 10080)
)


@attrs.frozen
class Scenario:
    """One what-if: definitions, a time range, capacities and faults.

    Attributes:
        config: the namespace (quotas, delivery window, lease duration).
        definitions: created at ``start``, in this order.
        start: when the simulation starts (the definitions' creation time).
        end: when it stops (exclusive); at most the calendar's end (2101-01-01T00:00Z).
        ticking: tick interval and budget.
        relay: relay workers, their rate and claim limit.
        broker: broker outages and failure rates.
        host_outages: intervals in which nothing ticks, claims or relays (the database or
            the application is down); leases held when one starts lapse.
        clock_regressions: host clock steps backwards.
        changes: cancellations and creations at given instants.
        sample_interval: spacing of the backlog samples and lateness buckets (default:
            chosen from the range, at most ~700 samples).

    Raises:
        ScenarioError: naive instants, ``end`` not after ``start`` or beyond 2100, duplicate
            definition names, more definitions than the quota allows, events outside the
            range, or too many samples.
    """

    config: RecurringConfig
    definitions: tuple[RecurringDefinition, ...] = attrs.field(converter=_definitions)
    start: datetime = attrs.field(converter=_start)
    end: datetime = attrs.field(converter=_end)
    ticking: Ticking = attrs.field(factory=Ticking, kw_only=True)
    relay: RelayCapacity = attrs.field(factory=RelayCapacity, kw_only=True)
    broker: BrokerModel = attrs.field(factory=BrokerModel, kw_only=True)
    host_outages: tuple[Interval, ...] = attrs.field(
        default=(), converter=_host_outages, kw_only=True
    )
    clock_regressions: tuple[ClockRegression, ...] = attrs.field(
        default=(), converter=_regressions, kw_only=True
    )
    changes: tuple[ScheduleChange, ...] = attrs.field(default=(), converter=_changes, kw_only=True)
    sample_interval: timedelta | None = attrs.field(default=None, kw_only=True)

    def __attrs_post_init__(self) -> None:
        self._check_types()
        if self.end <= self.start:
            raise ScenarioError(
                f"the range {_iso(self.start)} .. {_iso(self.end)} is empty or reversed"
            )
        if self.end > CALENDAR_END:
            raise ScenarioError(
                f"the range ends {_iso(self.end)}, beyond the calendar's last year (2100): "
                f"end it by {_iso(CALENDAR_END)}"
            )
        self._check_names()
        self._check_events()
        if self.sample_interval is not None:
            _positive(self.sample_interval, "sample interval", minimum=timedelta(seconds=1))
            if (self.end - self.start) / self.sample_interval > _MAX_SAMPLES:
                raise ScenarioError(
                    f"the sample interval {self.sample_interval} gives more than "
                    f"{_MAX_SAMPLES:,} samples over the range: lengthen it"
                )

    def _check_names(self) -> None:
        names = [d.name for d in self.definitions]
        names += [d.name for c in self.changes for d in c.create]
        if len(set(names)) != len(names):
            raise ScenarioError("definition names must be unique (definitions are immutable)")
        if len(names) > self.config.max_definitions:
            raise ScenarioError(
                f"{len(names)} definitions exceed the namespace quota of "
                f"{self.config.max_definitions}"
            )

    def _check_events(self) -> None:
        known = {d.name for d in self.definitions}
        for change in self.changes:
            if not self.start <= change.at < self.end:
                raise ScenarioError(f"a schedule change at {_iso(change.at)} is outside the range")
            for name in change.cancel:
                if name not in known:
                    raise ScenarioError(
                        f"a schedule change at {_iso(change.at)} cancels {name[:40]!r}, which "
                        "no earlier definition or change creates"
                    )
            known.update(d.name for d in change.create)
        for regression in self.clock_regressions:
            if not self.start < regression.at < self.end:
                raise ScenarioError(
                    f"a clock regression at {_iso(regression.at)} is outside the range"
                )

    def _check_types(self) -> None:
        if not isinstance(self.config, RecurringConfig):
            raise ScenarioError("config must be a RecurringConfig")
        for value, kind, what in (
            (self.ticking, Ticking, "ticking"),
            (self.relay, RelayCapacity, "relay"),
            (self.broker, BrokerModel, "broker"),
        ):
            if not isinstance(value, kind):
                raise ScenarioError(f"{what} must be a {kind.__name__}")

    @property
    def samples_every(self) -> timedelta:
        """The sample interval in effect (given, or chosen from the range's length)."""
        if self.sample_interval is not None:
            return self.sample_interval
        span = self.end - self.start
        for step in _SAMPLE_STEPS:
            if span / step <= 720:
                return step
        return _SAMPLE_STEPS[-1]
