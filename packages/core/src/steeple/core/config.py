"""Validated configuration values: a namespace's configuration and recurring definitions."""

from __future__ import annotations

import re
from collections.abc import Mapping
from datetime import datetime, timedelta

import attrs

from steeple.core import limits
from steeple.core._validate import aware_utc, bounded_int, duration, shown, text
from steeple.core.calendar import CronCalendar
from steeple.core.errors import InvalidCronExpression, RecurringConfigurationError
from steeple.core.messages import ScheduledMessage
from steeple.core.policies import MissedRunPolicy

__all__ = [
    "RecurringConfig",
    "RecurringDefinition",
    "is_definition_name",
    "validate_definition_name",
    "validate_namespace",
]

_NAMESPACE = re.compile(r"[a-z0-9][a-z0-9._-]{0,62}\Z")


def validate_namespace(value: object) -> str:
    """Return ``value`` if it is a valid namespace name.

    Raises:
        RecurringConfigurationError: not 1-63 characters of lowercase letters, digits,
            ``.``, ``_`` or ``-`` starting with a letter or digit.
    """
    if not isinstance(value, str) or not _NAMESPACE.match(value):
        raise RecurringConfigurationError(
            f"namespace {shown(value)} is invalid: use 1-63 characters of lowercase letters, "
            "digits, '.', '_' or '-', starting with a letter or digit"
        )
    return value


def validate_definition_name(value: object) -> str:
    """Return ``value`` if it is a valid definition name (also the schedules cursor).

    Raises:
        RecurringConfigurationError: not a str; empty or blank; over 200 characters;
            leading or trailing whitespace; a control, format, surrogate, private-use or
            unassigned character.
    """
    return text(
        value,
        "definition name",
        max_len=limits.MAX_NAME_LENGTH,
        error=RecurringConfigurationError,
    )


@attrs.frozen
class RecurringConfig:
    """A namespace's configuration: quotas, delivery window and lease duration.

    Raises:
        RecurringConfigurationError: a bad namespace; quotas outside 1..10,000 definitions or
            1..100,000 occurrences; a lease outside 1-300 s; a window over 7 days or shorter
            than two leases.
    """

    namespace: str = attrs.field(converter=validate_namespace)
    max_definitions: int = attrs.field()
    max_occurrences: int = attrs.field()
    delivery_window: timedelta = attrs.field(default=limits.DEFAULT_DELIVERY_WINDOW, kw_only=True)
    lease_duration: timedelta = attrs.field(default=limits.DEFAULT_LEASE, kw_only=True)

    def __attrs_post_init__(self) -> None:
        err = RecurringConfigurationError
        bounded_int(self.max_definitions, "max_definitions", 1, limits.MAX_DEFINITIONS, err)
        bounded_int(self.max_occurrences, "max_occurrences", 1, limits.MAX_OCCURRENCES, err)
        lease = duration(self.lease_duration, "lease_duration", err)
        window = duration(self.delivery_window, "delivery_window", err)
        if not limits.MIN_LEASE <= lease <= limits.MAX_LEASE:
            raise err(f"lease_duration must be between 1 and 300 seconds; got {lease}")
        if lease % timedelta(milliseconds=1):
            raise err("lease_duration must be a whole number of milliseconds")
        if window > limits.MAX_DELIVERY_WINDOW:
            raise err(f"delivery_window must be at most 7 days; got {window}")
        if window % timedelta(milliseconds=1):
            raise err("delivery_window must be a whole number of milliseconds")
        if window < 2 * lease:
            raise err(
                f"delivery_window ({window}) must hold at least two leases "
                f"(2 x {lease}); lengthen the window or shorten the lease"
            )

    def fingerprint(self) -> dict[str, str | int]:
        """Return the canonical fields a configuration binding authenticates."""
        return {
            "namespace": self.namespace,
            "max_definitions": self.max_definitions,
            "max_occurrences": self.max_occurrences,
            "delivery_window_ms": self.delivery_window // timedelta(milliseconds=1),
            "lease_duration_ms": self.lease_duration // timedelta(milliseconds=1),
        }

    @classmethod
    def from_fingerprint(cls, fields: Mapping[str, object]) -> RecurringConfig:
        """Rebuild the configuration whose :meth:`fingerprint` is ``fields``.

        Raises:
            RecurringConfigurationError: a field is missing, extra or of the wrong type, or
                the values are outside steeple's limits.
        """
        names = {"namespace", "max_definitions", "max_occurrences"}
        names |= {"delivery_window_ms", "lease_duration_ms"}
        if not isinstance(fields, Mapping) or set(fields) != names:
            raise RecurringConfigurationError(
                "a configuration fingerprint holds exactly: " + ", ".join(sorted(names))
            )
        millis = []
        for name in ("delivery_window_ms", "lease_duration_ms"):
            millis.append(bounded_int(fields[name], name, 0, 2**53, RecurringConfigurationError))
        return cls(
            fields["namespace"],  # the converter validates it
            fields["max_definitions"],  # type: ignore[arg-type]  # __attrs_post_init__ checks
            fields["max_occurrences"],  # type: ignore[arg-type]
            delivery_window=timedelta(milliseconds=millis[0]),
            lease_duration=timedelta(milliseconds=millis[1]),
        )


def _calendar(value: object) -> CronCalendar:
    if isinstance(value, CronCalendar):
        return value
    if not isinstance(value, str):
        raise InvalidCronExpression(shown(value), "a cron expression must be a str")
    return CronCalendar.parse(value)


def _policy(value: object) -> MissedRunPolicy:
    if isinstance(value, MissedRunPolicy) and value in (
        MissedRunPolicy.CATCH_UP,
        MissedRunPolicy.COALESCE,
    ):
        return value
    raise RecurringConfigurationError(
        f"policy must be MissedRunPolicy.CATCH_UP or MissedRunPolicy.COALESCE, not {shown(value)}"
    )


def _first_after(value: object) -> datetime:
    try:
        instant = aware_utc(value, "first_after")
    except TypeError as exc:
        raise RecurringConfigurationError(str(exc)) from None
    except ValueError as exc:
        raise RecurringConfigurationError(str(exc)) from None
    # The store keeps milliseconds (the contract's first_after_ms); finer parts would make
    # two "identical" creations differ after a round trip.
    return instant.replace(microsecond=instant.microsecond // 1000 * 1000)


def is_definition_name(value: object) -> bool:
    """Return whether ``value`` could name a definition (what ``RecurringDefinition`` accepts).

    Stores answer "not found" for anything else without asking their storage.
    """
    try:
        validate_definition_name(value)
    except RecurringConfigurationError:
        return False
    return True


@attrs.frozen
class RecurringDefinition:
    """An immutable recurring publication: a name, a calendar, a policy and a message.

    ``first_after`` is exclusive: the first due time is the calendar's first instant
    strictly after it.

    Raises:
        RecurringConfigurationError: a bad name, a naive ``first_after``, an unsupported
            policy, or a calendar with no instant after ``first_after`` (it could never
            publish).
        InvalidCronExpression: the cron expression is malformed.
    """

    name: str = attrs.field()
    cron: CronCalendar = attrs.field(converter=_calendar)
    first_after: datetime = attrs.field(converter=_first_after)
    policy: MissedRunPolicy = attrs.field(converter=_policy)
    message: ScheduledMessage = attrs.field()

    @name.validator
    def _check_name(self, _: object, value: str) -> None:
        validate_definition_name(value)

    @message.validator
    def _check_message(self, _: object, value: object) -> None:
        if not isinstance(value, ScheduledMessage):
            raise RecurringConfigurationError("message must be a ScheduledMessage")

    def __attrs_post_init__(self) -> None:
        if self.cron.next_after(self.first_after) is None:
            raise RecurringConfigurationError(
                f"definition {self.name!r}: calendar {self.cron.expression!r} has no instant "
                f"after {self.first_after.isoformat()}, so it could never publish"
            )

    @property
    def first_due(self) -> datetime:
        """The first due instant (strictly after ``first_after``)."""
        due = self.cron.next_after(self.first_after)
        assert due is not None  # checked at construction
        return due
