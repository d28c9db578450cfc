"""Hostile input against every public constructor and function of steeple.core.

Each case drives one entry point with arguments drawn from "valid" and "hostile"
strategies (lone surrogates, NUL and control characters, 10 KB strings, ints beyond
int64 and beyond ``repr``'s 4300 digits, bools for ints, NaN/inf, negative and extreme
durations, naive datetimes and offsets that overflow, wrong types, hostile mappings) and
asserts that the only exceptions that come out are steeple's typed errors (subclasses of
``SteepleError``), whose messages always encode as UTF-8 (so they can be logged).

``test_every_public_name_is_covered`` walks ``steeple.core.__all__``: a new public name must
be added to a case (or to the short lists of constants and protocols) or the test fails.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta, timezone, tzinfo
from typing import Any

import attrs
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import steeple.core
from steeple.core import (
    CAPABILITY_BYTES,
    CLAIM_RULE,
    PUBLISH_PURPOSE,
    Backoff,
    BrokerReceipt,
    BrokerRejectedError,
    ClaimRule,
    ConfigurationError,
    ConfigurationTypeError,
    CronCalendar,
    DefinitionAdvance,
    DueDefinition,
    Effects,
    FailureDecision,
    FailureKind,
    InvalidCronExpression,
    Lease,
    MissedRunPolicy,
    NamespaceTickPlan,
    OccurrenceEvent,
    OccurrenceInfo,
    OccurrenceState,
    Page,
    PublicationFailure,
    PurgedType,
    RecurringConfig,
    RecurringConfigurationError,
    RecurringDefinition,
    RelayAcknowledgementError,
    RelayBrokerTimeoutError,
    RelayOutcome,
    RetryDecision,
    ScheduledMessage,
    ScheduleInfo,
    SteepleError,
    Step,
    SystemClock,
    SystemRandom,
    TaskEvent,
    TaskState,
    TickPlan,
    TickResult,
    ZonedCalendar,
    adopt_time,
    after_publish_failure,
    attempts_exhausted,
    capability_digest,
    capability_matches,
    classify_publication_failure,
    holds_lease,
    idempotency_key,
    is_claimable,
    is_live,
    lease_expiry,
    lease_expiry_event,
    new_capability,
    new_generation,
    occurrence_id_for,
    plan_namespace_tick,
    plan_tick,
    publication_error,
    retry_decision,
    validate_budget,
    window_end,
)
from steeple.core import errors as core_errors
from steeple.core import occurrences as occurrence_module
from steeple.core import tasks as task_module

# --- hostile strategies, one per class of bad input ---------------------------------------

SURROGATE = st.integers(0xD800, 0xDFFF).map(chr)
CONTROL = st.sampled_from(["\x00", "\x01", "\x1b", "\x7f", "\x85", "\r", "\n", "\t"])
INVISIBLE = st.sampled_from(["\u200b", "\u202e", "\ufeff", "\u2028", "\u2029", "\ue000"])
ANY_CHARACTER = st.one_of(st.characters(), SURROGATE, CONTROL, INVISIBLE)

hostile_text = st.one_of(
    st.sampled_from(["", " ", "  x", "x  ", "x" * 10_240, "€" * 100, "€" * 300, "٣", "\u00a0"]),
    st.builds(lambda a, b, c: a + b + c, st.text(max_size=5), SURROGATE, st.text(max_size=5)),
    st.builds(lambda a, b, c: a + b + c, st.text(max_size=5), CONTROL, st.text(max_size=5)),
    st.builds(lambda a, b, c: a + b + c, st.text(max_size=5), INVISIBLE, st.text(max_size=5)),
    st.text(ANY_CHARACTER, max_size=40),
)
hostile_ints = st.one_of(
    st.integers(),
    st.sampled_from([0, -1, 2**31, 2**63 - 1, 2**63, -(2**63) - 1, 2**64, 10**400]),
    st.sampled_from([10**5000, -(10**5000)]),  # repr() refuses ints this long
    st.booleans(),
)
hostile_floats = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([math.nan, math.inf, -math.inf, -0.0, 1e308, 5e-324]),
)
hostile_durations = st.one_of(
    st.timedeltas(),
    st.sampled_from(
        [
            timedelta(0),
            -timedelta(microseconds=1),
            timedelta.max,
            timedelta.min,
            timedelta(microseconds=1),
            timedelta(days=-1),
        ]
    ),
)


class BrokenOffset(tzinfo):
    """A tzinfo whose utcoffset() fails (third-party tz objects can)."""

    def utcoffset(self, dt: datetime | None) -> timedelta:
        raise ValueError("broken tzinfo")

    def dst(self, dt: datetime | None) -> timedelta | None:
        return None

    def tzname(self, dt: datetime | None) -> str:
        return "BROKEN"


class HugeOffset(tzinfo):
    """A tzinfo whose offset is out of range (datetime itself raises ValueError)."""

    def utcoffset(self, dt: datetime | None) -> timedelta:
        return timedelta(hours=30)

    def dst(self, dt: datetime | None) -> timedelta | None:
        return None


ONE_DAY = timedelta(hours=23, minutes=59)
PLUS_5 = timezone(timedelta(hours=5))
MINUS_5 = timezone(timedelta(hours=-5))
hostile_datetimes = st.one_of(
    st.datetimes(),  # naive
    st.datetimes(timezones=st.builds(timezone, st.timedeltas(-ONE_DAY, ONE_DAY))),
    st.sampled_from(
        [
            datetime.min.replace(tzinfo=PLUS_5),  # overflows when converted to UTC
            datetime.max.replace(tzinfo=MINUS_5),
            datetime.min.replace(tzinfo=UTC),
            datetime.max.replace(tzinfo=UTC),
            datetime(2024, 1, 1),
        ]
    ),
    # Built per draw: hashing these raises, which hypothesis must not see in sampled_from.
    st.builds(datetime, st.just(2024), st.just(1), st.just(1), tzinfo=st.builds(BrokenOffset)),
    st.builds(datetime, st.just(2024), st.just(1), st.just(1), tzinfo=st.builds(HugeOffset)),
)


class HostileRepr:
    """An object whose repr() and str() raise."""

    def __repr__(self) -> str:
        raise RuntimeError("no repr for you")

    __str__ = __repr__

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        # How hypothesis shows a failing example (it must not fail itself).
        printer.text("HostileRepr()")


wrong_types = st.sampled_from(
    [
        None,
        b"bytes",
        bytearray(b"ba"),
        memoryview(b"mv"),
        [],
        {},
        (),
        [("k", "v")],
        object(),
        HostileRepr(),
        1.5,
        7,
        "text",
        {"k"},
        frozenset({1}),
        timedelta(seconds=1),
        datetime(2024, 1, 1, tzinfo=UTC),
        MissedRunPolicy.CATCH_UP,
        OccurrenceState.PENDING,
    ]
)
hostile_bytes = st.one_of(st.binary(max_size=64), st.just(bytes(20_000)))
hostile_mappings = st.one_of(
    st.dictionaries(hostile_text, st.one_of(hostile_text, hostile_ints, wrong_types), max_size=4),
    st.builds(lambda n: {f"h{i}": "v" for i in range(n)}, st.integers(30, 40)),
    st.lists(st.tuples(st.text(max_size=3), st.text(max_size=3)), max_size=3),
)
HOSTILE = st.one_of(
    hostile_text,
    hostile_ints,
    hostile_floats,
    hostile_durations,
    hostile_datetimes,
    wrong_types,
    hostile_bytes,
    hostile_mappings,
)

# --- valid values, so each hostile argument is also tried next to good ones ---------------

NAMES = st.text(st.characters(categories=("L", "N")), min_size=1, max_size=20)
INSTANTS = st.datetimes(datetime(1971, 1, 1), datetime(2099, 1, 1), timezones=st.just(UTC))
LEASES = st.timedeltas(timedelta(seconds=1), timedelta(seconds=300))
CRONS = st.sampled_from(["*/5 * * * *", "0 9 * * Mon-Fri", "0 0 1 * *", "0 0 30 2 *"])
CALENDAR = CronCalendar.parse("*/5 * * * *")
ZONED = ZonedCalendar.parse("30 2 * * *", "Europe/Berlin")
MESSAGE = ScheduledMessage("billing.daily", "invoice.due", b"{}", {"tenant": "t1"})


class FixedRandom:
    """A RandomSource that returns what it is told (possibly the wrong thing)."""

    def __init__(self, raw: object) -> None:
        self.raw = raw

    def token_bytes(self, n: int) -> Any:
        return self.raw if self.raw is not None else b"\x01" * n

    def random(self) -> float:
        return 0.5


class AnsweringCalendar:
    """A DueCalendar port that answers a fixed (possibly hostile) value."""

    def __init__(self, answer: object) -> None:
        self.answer = answer

    def next_after(self, instant: datetime) -> Any:
        return self.answer


DUE_DEFINITIONS = st.builds(
    DueDefinition,
    NAMES,
    st.sampled_from(list(MissedRunPolicy)),
    st.just(CALENDAR),
    INSTANTS,
    st.one_of(st.none(), INSTANTS),
)
EXCEPTIONS = st.sampled_from(
    [
        TypeError("adapter bug"),
        TimeoutError(),
        ConnectionError("reset"),
        BrokerRejectedError("no"),
        RelayBrokerTimeoutError("late", permanent=True),
        RelayAcknowledgementError(BrokerReceipt("memory", "k"), "unsure"),
        KeyboardInterrupt(),
    ]
)


def valid(name: str) -> st.SearchStrategy[Any]:
    return {
        "name": NAMES,
        "cron": CRONS,
        "instant": INSTANTS,
        "lease": LEASES,
        "window": st.timedeltas(timedelta(minutes=10), timedelta(days=7)),
        "quota": st.integers(1, 10_000),
        "budget": st.integers(1, 100),
        "attempts": st.integers(1, 20),
        "unit": st.floats(0, 1),
        "bool": st.booleans(),
        "bytes16": st.binary(min_size=16, max_size=16),
        "policy": st.sampled_from(list(MissedRunPolicy)),
        "state": st.sampled_from(list(OccurrenceState)),
        "event": st.sampled_from(list(OccurrenceEvent)),
        "task_state": st.sampled_from(list(TaskState)),
        "task_event": st.sampled_from(list(TaskEvent)),
        "headers": st.dictionaries(NAMES, NAMES, max_size=3),
        "payload": st.binary(max_size=64),
        "backoff": st.just(Backoff()),
        "calendar": st.just(CALENDAR),
        "message": st.just(MESSAGE),
        "random": st.just(SystemRandom()),
        "set": st.just(frozenset({1, 2})),
        "id": st.text("0123456789abcdef", min_size=32, max_size=32),
        "revision": st.integers(0, 2**63 - 1),
        "key": st.just("stp1-" + "0" * 48),
        "optional_text": st.one_of(st.none(), NAMES),
        "optional_instant": st.one_of(st.none(), INSTANTS),
        "digest": st.binary(min_size=32, max_size=32),
        "due_definitions": st.lists(DUE_DEFINITIONS, max_size=3),
        "exception": EXCEPTIONS,
        "failure": st.builds(
            PublicationFailure, st.sampled_from(list(FailureKind)), st.booleans(), NAMES
        ),
        "any": st.none(),
    }[name]


EXTRA_HOSTILE: dict[str, st.SearchStrategy[Any]] = {
    "random": st.builds(FixedRandom, st.one_of(st.none(), hostile_bytes, wrong_types)),
    "calendar": st.builds(AnsweringCalendar, st.one_of(HOSTILE, INSTANTS)),
}


@attrs.frozen
class Case:
    """One public entry point: how to call it and the kind of each argument."""

    label: str
    call: Callable[..., object]
    args: Sequence[str] = ()
    kwargs: dict[str, str] = attrs.field(factory=dict)
    covers: tuple[str, ...] = ()


def _iterate(expression: str, *a: Any) -> object:
    return list(zip(range(3), CronCalendar.parse(expression).iter_after(*a), strict=False))


CASES = [
    Case("Backoff", Backoff, ("lease", "lease", "attempts", "unit"), covers=("Backoff",)),
    Case("Backoff.delay", lambda *a: Backoff(jitter=0.5).delay(*a), ("attempts", "unit")),
    Case("RELAY_BACKOFF.delay", lambda a: steeple.core.RELAY_BACKOFF.delay(a), ("attempts",)),
    Case("CronCalendar.parse", CronCalendar.parse, ("cron",), covers=("CronCalendar",)),
    Case(
        "CronCalendar()",
        CronCalendar,
        ("cron", "set", "set", "set", "set", "set"),
    ),
    Case("CronCalendar.next_after", lambda a: CALENDAR.next_after(a), ("instant",)),
    Case("CronCalendar.matches", lambda a: CALENDAR.matches(a), ("instant",)),
    Case("CronCalendar.iter_after", _iterate, ("cron", "instant")),
    Case("ZonedCalendar.parse", ZonedCalendar.parse, ("cron",), covers=("ZonedCalendar",)),
    Case(
        "ZonedCalendar.parse(zone)",
        lambda z: ZonedCalendar.parse("0 9 * * *", z),
        ("cron",),
    ),
    Case("ZonedCalendar.next_after", lambda a: ZONED.next_after(a), ("instant",)),
    Case("ZonedCalendar.matches", lambda a: ZONED.matches(a), ("instant",)),
    Case(
        "RecurringConfig",
        RecurringConfig,
        ("name", "quota", "quota"),
        {"delivery_window": "window", "lease_duration": "lease"},
        covers=("RecurringConfig",),
    ),
    Case("RecurringConfig.fingerprint", lambda: RecurringConfig("ns", 1, 1).fingerprint()),
    Case(
        "RecurringDefinition",
        RecurringDefinition,
        ("name", "cron", "instant", "policy", "message"),
        covers=("RecurringDefinition",),
    ),
    Case(
        "ScheduledMessage",
        ScheduledMessage,
        ("name", "name", "payload", "headers"),
        covers=("ScheduledMessage",),
    ),
    Case(
        "BrokerReceipt",
        BrokerReceipt,
        ("name", "key", "bool", "optional_text"),
        covers=("BrokerReceipt",),
    ),
    Case("Lease", Lease, ("id", "instant", "revision", "bytes16"), covers=("Lease",)),
    Case(
        "RelayOutcome",
        lambda i, r, e: RelayOutcome(i, receipt=r, error=e).result(),
        ("id", "optional_text", "optional_text"),
        covers=("RelayOutcome",),
    ),
    Case("SystemClock.now", lambda: SystemClock().now(), covers=("SystemClock",)),
    Case(
        "SystemRandom.token_bytes",
        lambda n: SystemRandom().token_bytes(n),
        ("budget",),
        covers=("SystemRandom",),
    ),
    Case(
        "idempotency_key",
        lambda *a: idempotency_key(
            purpose=a[0], namespace=a[1], definition_name=a[2], due_at=a[3], generation=a[4]
        ),
        ("name", "name", "name", "instant", "bytes16"),
        covers=("idempotency_key",),
    ),
    Case("adopt_time", adopt_time, ("instant", "instant", "lease"), covers=("adopt_time",)),
    Case(
        "after_publish_failure",
        after_publish_failure,
        ("attempts", "instant", "instant", "bool", "backoff", "attempts"),
        {"draw": "unit"},
        covers=("after_publish_failure", "FailureDecision"),
    ),
    Case(
        "capability_matches",
        capability_matches,
        ("bytes16", "bytes16"),
        covers=("capability_matches",),
    ),
    Case(
        "is_claimable",
        is_claimable,
        ("state", "instant"),
        {"window_ends_at": "instant", "lease_expires_at": "instant", "next_attempt_at": "instant"},
        covers=("is_claimable",),
    ),
    Case(
        "CLAIM_RULE.admits",
        CLAIM_RULE.admits,
        ("state", "instant"),
        {"window_ends_at": "instant", "lease_expires_at": "instant", "next_attempt_at": "instant"},
        covers=("CLAIM_RULE", "ClaimRule"),
    ),
    Case("capability_digest", capability_digest, ("bytes16",), covers=("capability_digest",)),
    Case(
        "holds_lease",
        holds_lease,
        ("digest", "revision", "bytes16", "revision"),
        covers=("holds_lease",),
    ),
    Case("is_live", is_live, ("instant", "instant"), covers=("is_live",)),
    Case("lease_expiry", lease_expiry, ("instant", "lease", "instant"), covers=("lease_expiry",)),
    Case("new_capability", new_capability, ("random",), covers=("new_capability",)),
    Case("new_generation", new_generation, ("random",), covers=("new_generation",)),
    Case("occurrence_id_for", occurrence_id_for, ("bytes16",), covers=("occurrence_id_for",)),
    Case("window_end", window_end, ("instant", "window"), covers=("window_end",)),
    Case(
        "plan_tick",
        plan_tick,
        ("policy", "calendar", "instant", "instant", "budget"),
        covers=("plan_tick", "TickPlan", "DueCalendar"),
    ),
    Case(
        "plan_namespace_tick",
        lambda *a: plan_namespace_tick([DueDefinition(*a[:5])], a[5], a[6]),
        ("name", "policy", "calendar", "instant", "optional_instant", "instant", "budget"),
        covers=("plan_namespace_tick", "DueDefinition", "DefinitionAdvance", "NamespaceTickPlan"),
    ),
    Case(
        "plan_namespace_tick(definitions)",
        plan_namespace_tick,
        ("due_definitions", "instant", "budget"),
    ),
    Case(
        "classify_publication_failure",
        classify_publication_failure,
        ("exception",),
        covers=("classify_publication_failure", "PublicationFailure", "FailureKind"),
    ),
    Case(
        "publication_error",
        publication_error,
        ("failure", "exception", "id", "name"),
        covers=("publication_error",),
    ),
    Case("validate_budget", validate_budget, ("budget",), covers=("validate_budget",)),
    Case(
        "retry_decision",
        retry_decision,
        ("attempts", "attempts", "backoff", "instant", "unit"),
        covers=("retry_decision", "RetryDecision"),
    ),
    Case(
        "attempts_exhausted",
        attempts_exhausted,
        ("attempts", "attempts"),
        covers=("attempts_exhausted",),
    ),
    Case(
        "lease_expiry_event",
        lease_expiry_event,
        ("attempts", "attempts"),
        covers=("lease_expiry_event",),
    ),
    Case(
        "occurrences.transition",
        occurrence_module.transition,
        ("state", "event"),
        covers=("OCCURRENCE_TRANSITIONS",),
    ),
    Case(
        "occurrences.step",
        occurrence_module.step,
        ("state", "event"),
        covers=("OCCURRENCE_STEPS", "Step", "Effects"),
    ),
    Case("occurrences.states_for", occurrence_module.states_for, ("event",)),
    Case(
        "tasks.transition",
        task_module.transition,
        ("task_state", "task_event"),
        covers=("TASK_TRANSITIONS",),
    ),
    *(
        Case(f"{kind.__name__}(value)", kind, ("any",), covers=(kind.__name__,))
        for kind in (
            MissedRunPolicy,
            OccurrenceState,
            OccurrenceEvent,
            TaskState,
            TaskEvent,
            PurgedType,
            FailureKind,
        )
    ),
    # Records the stores hand out: outputs, built from stored rows. They take any value,
    # so the property is only that building them never raises a builtin.
    *(
        Case(
            kind.__name__,
            kind,
            tuple("any" for field in attrs.fields(kind) if field.init and not field.kw_only),
            covers=(name,),
        )
        for name, kind in (
            ("FailureDecision", FailureDecision),
            ("RetryDecision", RetryDecision),
            ("TickPlan", TickPlan),
            ("TickResult", TickResult),
            ("ScheduleInfo", ScheduleInfo),
            ("OccurrenceInfo", OccurrenceInfo),
            ("Page", Page),
            ("ClaimRule", ClaimRule),
            ("Step", Step),
            ("Effects", Effects),
            ("DueDefinition", DueDefinition),
            ("DefinitionAdvance", DefinitionAdvance),
            ("NamespaceTickPlan", NamespaceTickPlan),
            ("PublicationFailure", PublicationFailure),
        )
    ),
]

# Names of steeple.core.__all__ that take no input: constants and Protocols.
CONSTANTS = {
    "CAPABILITY_BYTES",
    "CLAIMABLE_STATES",
    "GENERATION_BYTES",
    "OCCURRENCE_TRANSITIONS",
    "PUBLISH_PURPOSE",
    "PURGED",
    "RELAY_BACKOFF",
    "TASK_TRANSITIONS",
    "TERMINAL_STATES",
    "TERMINAL_TASK_STATES",
    "ScheduleState",
}
PROTOCOLS = {"Clock", "MessageBroker", "RandomSource", "RecurringStore", "Sealer"}
ERROR_CLASSES = [
    value
    for value in vars(core_errors).values()
    if isinstance(value, type) and issubclass(value, SteepleError)
]


def _strategy(kind: str, hostile: bool) -> st.SearchStrategy[Any]:
    if not hostile:
        return valid(kind)
    return st.one_of(HOSTILE, EXTRA_HOSTILE[kind]) if kind in EXTRA_HOSTILE else HOSTILE


def _assert_typed(exc: BaseException) -> None:
    assert isinstance(exc, SteepleError), f"untyped {type(exc).__name__}: {exc!r}"[:500]
    # Every message can be logged: nothing in it fails to encode.
    str(exc).encode("utf-8")


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.label)
@settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(data=st.data())
def test_only_typed_errors_come_out(case: Case, data: st.DataObject) -> None:
    names = [*case.args, *case.kwargs.values()]
    # Half the time exactly one argument is hostile (the others valid), otherwise any mix.
    one_bad: bool = data.draw(st.booleans(), label="one bad argument")
    if names and one_bad:
        bad = {data.draw(st.integers(0, len(names) - 1), label="which")}
    else:
        bad = {i for i in range(len(names)) if data.draw(st.booleans())}
    values = [data.draw(_strategy(kind, i in bad), label=kind) for i, kind in enumerate(names)]
    positional = values[: len(case.args)]
    keywords = dict(zip(case.kwargs, values[len(case.args) :], strict=True))
    try:
        case.call(*positional, **keywords)
    except Exception as exc:  # the property: whatever comes out is typed
        _assert_typed(exc)


VALUE_FORMATTING_ERRORS = (
    core_errors.InvalidCronExpression,
    core_errors.InvalidTransitionError,
    core_errors.UnknownKeyIdError,
    core_errors.KeyringBindingMismatchError,
    core_errors.InvalidTimeZoneError,
    core_errors.RecurringUnknownKeyIdError,
    core_errors.RecurringSchemaVersionError,
)


@pytest.mark.parametrize("kind", ERROR_CLASSES, ids=lambda k: k.__name__)
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_error_constructors_never_raise(kind: type[SteepleError], data: st.DataObject) -> None:
    """Building an error from hostile values must not itself fail (it would mask the first).

    Errors that format the values they are given into their message (a cron expression, a
    state, a key id, a namespace) must also produce a message that encodes as UTF-8.
    """
    if kind is core_errors.RelayAcknowledgementError:
        kind(BrokerReceipt("memory", "k"), data.draw(hostile_text))
        return
    if kind is core_errors.InvalidTimeZoneError:
        error: BaseException = kind(data.draw(HOSTILE), data.draw(HOSTILE))
    elif kind is core_errors.InvalidCronExpression:
        error = kind(data.draw(HOSTILE), "reason", field=data.draw(HOSTILE))
    elif kind is core_errors.InvalidTransitionError:
        error = kind(data.draw(HOSTILE), data.draw(HOSTILE), data.draw(HOSTILE))
    elif kind is core_errors.RecurringUnknownKeyIdError:
        error = kind(data.draw(HOSTILE), data.draw(HOSTILE))
    elif kind is core_errors.RecurringSchemaVersionError:
        error = kind(data.draw(HOSTILE), data.draw(HOSTILE), 2)
    elif kind is core_errors.UnknownKeyIdError:
        error = kind(data.draw(HOSTILE))
    elif kind is core_errors.KeyringBindingMismatchError:
        error = kind(data.draw(HOSTILE), data.draw(st.one_of(HOSTILE, st.tuples(HOSTILE))))
    elif kind is core_errors.RelayBrokerError or kind is core_errors.RelayBrokerTimeoutError:
        kind(data.draw(hostile_text), permanent=data.draw(st.booleans()))
        return
    else:
        kind(data.draw(hostile_text))
        return
    assert isinstance(error, VALUE_FORMATTING_ERRORS)
    str(error).encode("utf-8")


def test_every_public_name_is_covered() -> None:
    covered = {name for case in CASES for name in case.covers}
    errors = {kind.__name__ for kind in ERROR_CLASSES}
    missing = set(steeple.core.__all__) - covered - CONSTANTS - PROTOCOLS - errors
    assert missing == set(), f"add a hostile-input case for {sorted(missing)}"


# --- the regressions this test file was written for (each failed before the fix) ----------


def test_lone_surrogate_header_value_refused_at_construction() -> None:
    with pytest.raises(RecurringConfigurationError, match="lone surrogate"):
        ScheduledMessage("t", "m", b"", {"k": "a\ud800"})


@pytest.mark.parametrize(
    "kwargs",
    [
        {"definition_name": "x\udc80"},
        {"namespace": "\ud800"},
        {"due_at": datetime(2024, 1, 1)},  # naive: was read as local time
        {"generation": "not bytes"},
    ],
)
def test_idempotency_key_refuses_bad_parts(kwargs: dict[str, Any]) -> None:
    args: dict[str, Any] = {
        "purpose": PUBLISH_PURPOSE,
        "namespace": "ns",
        "definition_name": "daily",
        "due_at": datetime(2024, 1, 1, tzinfo=UTC),
        "generation": b"\x01" * 16,
    }
    args.update(kwargs)
    with pytest.raises(ConfigurationError):
        idempotency_key(**args)


def test_int_too_long_for_repr_is_a_typed_error() -> None:
    with pytest.raises(RecurringConfigurationError, match="budget"):
        validate_budget(10**5000)
    with pytest.raises(ConfigurationError, match="not a valid OccurrenceState"):
        OccurrenceState(10**5000)
    with pytest.raises(ConfigurationError, match="attempt numbers start at 1"):
        Backoff().delay(-(10**5000))


def test_enum_lookup_errors_are_typed_value_errors() -> None:
    with pytest.raises(ConfigurationError, match="'bogus' is not a valid MissedRunPolicy"):
        MissedRunPolicy("bogus")
    assert MissedRunPolicy("catch_up") is MissedRunPolicy.CATCH_UP
    assert issubclass(ConfigurationError, ValueError)


@pytest.mark.parametrize("draw", [math.nan, math.inf, "0.5", None])
def test_backoff_jitter_draw_must_be_a_finite_number(draw: object) -> None:
    with pytest.raises(ConfigurationError):
        Backoff(jitter=0.5).delay(1, draw)  # type: ignore[arg-type]


def test_backoff_factor_fits_32_bits() -> None:
    assert Backoff(factor=2**31 - 1).delay(3) == timedelta(minutes=5)
    with pytest.raises(ConfigurationError, match="factor"):
        Backoff(factor=2**31)


def test_instants_that_overflow_in_utc_are_typed() -> None:
    edge = datetime.min.replace(tzinfo=PLUS_5)
    with pytest.raises(ConfigurationError, match="outside the range"):
        is_live(edge, datetime(2024, 1, 1, tzinfo=UTC))
    with pytest.raises(ConfigurationError, match="after the year 9999"):
        window_end(datetime(9999, 12, 31, tzinfo=UTC), timedelta(days=7))
    late = datetime(9999, 12, 31, 23, 59, tzinfo=UTC)
    assert lease_expiry(late, timedelta(days=2), datetime.max.replace(tzinfo=UTC)) == (
        datetime.max.replace(tzinfo=UTC)
    )
    with pytest.raises(ConfigurationError, match="offset"):
        CALENDAR.next_after(datetime(2024, 1, 1, tzinfo=BrokenOffset()))


def test_not_a_datetime_is_both_typed_and_a_type_error() -> None:
    with pytest.raises(ConfigurationTypeError) as caught:
        CALENDAR.next_after("2024-01-01")  # type: ignore[arg-type]
    assert isinstance(caught.value, TypeError)
    assert isinstance(caught.value, ConfigurationError)


def test_lease_fields_are_checked() -> None:
    at = datetime(2024, 1, 1, tzinfo=UTC)
    assert Lease("ab" * 16, at, 2**63 - 1, bytearray(16)).capability == bytes(16)
    for bad in (
        {"revision": 2**63},
        {"revision": -1},
        {"revision": True},
        {"occurrence_id": "\ud800" * 32},
        {"occurrence_id": ""},
        {"expires_at": datetime(2024, 1, 1)},
        {"capability": "secret"},
    ):
        fields: dict[str, Any] = {
            "occurrence_id": "ab" * 16,
            "expires_at": at,
            "revision": 1,
            "capability": bytes(CAPABILITY_BYTES),
        }
        fields.update(bad)
        with pytest.raises(ConfigurationError):
            Lease(**fields)


def test_broker_receipt_fields_are_checked() -> None:
    assert BrokerReceipt("nats", "k", duplicate=True, location="S:1").duplicate is True
    with pytest.raises(ConfigurationError, match="lone surrogate"):
        BrokerReceipt("nats", "k", location="\ud800")
    with pytest.raises(ConfigurationTypeError, match="duplicate"):
        BrokerReceipt("nats", "k", duplicate="yes")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="empty"):
        BrokerReceipt("", "k")


def test_ports_and_collaborators_of_the_wrong_kind_are_typed() -> None:
    now = datetime(2024, 1, 1, tzinfo=UTC)
    with pytest.raises(ConfigurationTypeError, match="RandomSource"):
        new_capability(None)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationTypeError, match="Backoff"):
        retry_decision(1, 2, "backoff", now)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationTypeError, match="Backoff"):
        after_publish_failure(1, now, now, False, backoff=None)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationTypeError, match="next_after"):
        plan_tick(MissedRunPolicy.CATCH_UP, None, now, now, 1)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="calendar"):
        plan_tick(MissedRunPolicy.CATCH_UP, AnsweringCalendar("soon"), now, now, 1)
    with pytest.raises(ConfigurationTypeError, match="OccurrenceState"):
        is_claimable("pending", now, window_ends_at=now)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationTypeError):
        capability_matches("secret", b"secret")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError):
        SystemRandom().token_bytes(-1)


def test_released_payload_buffer_is_typed() -> None:
    view = memoryview(b"payload")
    view.release()
    with pytest.raises(RecurringConfigurationError, match="unreadable"):
        ScheduledMessage("t", "m", view)


def test_error_constructors_survive_hostile_values() -> None:
    assert "invalid cron expression" in str(InvalidCronExpression(b"x", "r"))  # type: ignore[arg-type]
    message = str(core_errors.InvalidTransitionError("occurrence", 10**5000, "\ud800"))
    message.encode("utf-8")
    assert "int" in message
    str(core_errors.UnknownKeyIdError(HostileRepr())).encode("utf-8")  # type: ignore[arg-type]


def test_enums_still_behave_as_enums() -> None:
    assert isinstance(OccurrenceState.PENDING, enum.Enum)
    assert OccurrenceState("pending") is OccurrenceState.PENDING
    assert next(iter(TaskState)).value == "waiting"  # the lifecycle order: waiting first


# --- the recurring engine's decisions (merged from h-engine): same rules --------------------


def test_holds_lease_refuses_oversized_capability_instead_of_raising() -> None:
    digest = capability_digest(bytes(CAPABILITY_BYTES))
    assert holds_lease(digest, 1, bytes(CAPABILITY_BYTES), 1)
    assert not holds_lease(digest, 1, bytes(20_000), 1)  # was ConfigurationError
    assert not holds_lease(digest, 1, "secret", 1)
    assert not holds_lease(digest, 1, bytes(CAPABILITY_BYTES), True)


def test_plan_namespace_tick_refuses_what_is_not_a_due_definition() -> None:
    now = datetime(2031, 1, 1, tzinfo=UTC)
    with pytest.raises(ConfigurationTypeError, match="iterable"):
        plan_namespace_tick(7, now, 1)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationTypeError, match="DueDefinition"):
        plan_namespace_tick(["daily"], now, 1)  # type: ignore[list-item]
    nameless = DueDefinition(None, MissedRunPolicy.CATCH_UP, CALENDAR, now, now)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationTypeError, match="name"):
        plan_namespace_tick([nameless], now, 1)


def test_publication_error_formats_hostile_values_safely() -> None:
    failure = PublicationFailure(FailureKind.BROKER, False, "TypeError")
    error = publication_error(failure, TypeError("x"), "\ud800" * 500, HostileRepr())  # type: ignore[arg-type]
    str(error).encode("utf-8")
    assert len(str(error)) < 1000  # shortened before escaping
    with pytest.raises(ConfigurationTypeError, match="PublicationFailure"):
        publication_error(None, TypeError("x"), "id", "retry")  # type: ignore[arg-type]


def test_recurring_keyring_and_schema_errors_format_hostile_values() -> None:
    unknown = core_errors.RecurringUnknownKeyIdError("\ud800", "definition " + "x" * 10_000)
    assert len(str(unknown)) < 600
    str(unknown).encode("utf-8")
    version = core_errors.RecurringSchemaVersionError(HostileRepr(), 10**5000, 2)  # type: ignore[arg-type]
    assert "version 2" in str(version)
    assert isinstance(unknown, core_errors.UnknownKeyIdError)
    with pytest.raises(ConfigurationError, match="not a valid FailureKind"):
        FailureKind("bogus")


# --- the one name rule (steeple.core.names) --------------------------------------------------

LOOKALIKE_NAMES = [
    "mail\u200b",  # zero-width space: shown as "mail"
    "\u202eliame-dnes",  # right-to-left override: shown as "send-email"
    "\u2066mail\u2069",  # bidi isolates
    "\ufeffmail",  # byte-order mark
    "ma\u00adil",  # soft hyphen (format character)
    " mail",
    "mail ",
    "\tmail",
    "   ",
    "\u3000",  # ideographic space only
    "",
    "mail\u2028",  # line separator
    "mail\u2029",  # paragraph separator
    "mail\x85",  # next line (C1 control)
    "\u3164",  # Hangul filler: renders as nothing
    "m\u034fail",  # combining grapheme joiner
    "mail\x1b[31m",
    "mail\x00",
    "mail\ud800",
    "mail\ue000",  # private use
    "mail\U000e0001",  # language tag
    "x" * 201,
]


@pytest.mark.parametrize("name", LOOKALIKE_NAMES)
def test_the_one_name_rule_refuses_lookalikes_everywhere_in_core(name: str) -> None:
    """Schedule names (definitions, the schedules cursor) and names checked by
    steeple.core.names.check_name refuse what looks like another name, or like none."""
    from steeple.core.config import validate_definition_name
    from steeple.core.names import check_name, name_problem

    problem = name_problem(name, "name")
    assert problem is not None
    assert "\n" not in problem
    problem.encode("utf-8")
    with pytest.raises(ConfigurationError):
        check_name(name, "name")
    with pytest.raises(ConfigurationError):
        validate_definition_name(name)


@pytest.mark.parametrize("name", ["mail", "e-mail box", "résumé", "邮件", "a\u00a0b", "📦 parcels"])
def test_the_one_name_rule_keeps_readable_names(name: str) -> None:
    from steeple.core.names import check_name

    assert check_name(name, "name") == name


def test_the_name_rule_raises_the_callers_error_types() -> None:
    from steeple.core.names import check_name

    class Mine(ValueError):
        pass

    class MineType(Mine, TypeError):
        pass

    with pytest.raises(Mine):
        check_name(" x", "name", error=Mine, type_error=MineType)
    with pytest.raises(MineType):
        check_name(5, "name", error=Mine, type_error=MineType)
    with pytest.raises(ConfigurationTypeError):
        check_name(5, "name")
