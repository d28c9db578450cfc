"""Delivery windows, lease arithmetic, fencing, shared-time adoption and relay-failure decisions.

Pure functions of the instants and values they are given: stores call them with the
persisted server time and the injected random source, and persist what they return.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from typing import Final

import attrs

from steeple.core import limits
from steeple.core._validate import aware_utc, byte_string, shown, unit_float
from steeple.core.backoff import RELAY_BACKOFF, Backoff
from steeple.core.errors import ConfigurationError, ConfigurationTypeError, RecurringClockError
from steeple.core.occurrences import OccurrenceState
from steeple.core.ports import RandomSource

__all__ = [
    "CAPABILITY_BYTES",
    "CLAIM_RULE",
    "GENERATION_BYTES",
    "ClaimRule",
    "FailureDecision",
    "Grant",
    "adopt_time",
    "after_publish_failure",
    "capability_digest",
    "capability_matches",
    "check_server_clock",
    "grant_leases",
    "holds_granted_lease",
    "holds_lease",
    "is_claimable",
    "is_live",
    "lease_expiry",
    "new_capability",
    "new_generation",
    "new_occurrence_id",
    "new_occurrence_ids",
    "occurrence_id_for",
    "window_end",
]

CAPABILITY_BYTES: Final = 16
"""Length of a lease capability (a fresh random secret per claim)."""
GENERATION_BYTES: Final = 16
"""Length of an occurrence's random generation (its id is the generation's hex)."""

_NO_TIME: Final = timedelta(0)


def _positive_duration(value: object, what: str) -> timedelta:
    if not isinstance(value, timedelta):
        raise ConfigurationTypeError(
            f"{what} must be a datetime.timedelta, not {type(value).__name__}"
        )
    if value <= _NO_TIME:
        raise ConfigurationError(f"{what} must be positive; got {value}")
    return value


def window_end(created_at: datetime, delivery_window: timedelta) -> datetime:
    """Return the end of the delivery window of an occurrence materialized at ``created_at``.

    The window is fixed at materialization, caught-up occurrences included.

    Raises:
        ConfigurationError: ``delivery_window`` is not a positive timedelta.
        ConfigurationError: ``created_at`` is naive (a ``ValueError``).
        ConfigurationTypeError: ``created_at`` is not a datetime (a ``TypeError``).
    """
    created = aware_utc(created_at, "created_at")
    window = _positive_duration(delivery_window, "delivery_window")
    try:
        return created + window
    except OverflowError:
        raise ConfigurationError(
            f"the delivery window of an occurrence created at {created.isoformat()} would end "
            "after the year 9999"
        ) from None


def lease_expiry(
    now: datetime, lease_duration: timedelta, window_ends_at: datetime
) -> datetime | None:
    """Return when a lease granted at ``now`` expires, or ``None`` if none may be granted.

    A lease near the end of its delivery window is shortened to the window's end; a lease
    that would already be over (the window has ended) is not handed out.

    Raises:
        ConfigurationError: ``lease_duration`` is not a positive timedelta.
        ConfigurationError: an instant is naive (a ``ValueError``).
        ConfigurationTypeError: an instant is not a datetime (a ``TypeError``).
    """
    start = aware_utc(now, "now")
    end = aware_utc(window_ends_at, "window_ends_at")
    lease = _positive_duration(lease_duration, "lease_duration")
    return _expiry(start, lease, end)


def _expiry(start: datetime, lease: timedelta, end: datetime) -> datetime | None:
    """:func:`lease_expiry` of checked values (aware instants, a positive duration)."""
    # Past the end of the datetime range the lease is cut to the window anyway.
    expires = end if end - start <= lease else start + lease
    return expires if expires > start else None


@attrs.define(repr=False)
class Grant:
    """A lease to grant (:func:`grant_leases`): its expiry, capability and the digest kept.

    Built once per occurrence a claim leases and never changed (slotted, not frozen: a
    frozen value costs about three times as much to build).
    """

    expires_at: datetime
    capability: bytes
    digest: bytes


def grant_leases(
    now: datetime,
    lease_duration: timedelta,
    windows: list[datetime],
    random: RandomSource,
) -> list[Grant | None]:
    """Decide a claim's leases: for each delivery window's end, the lease to grant or ``None``.

    Each is :func:`lease_expiry`, then :func:`new_capability` and its
    :func:`capability_digest`, drawn in order for the windows that get a lease (the
    random source gives the same capabilities as one call of each per window); ``now``,
    the duration and the source are checked once for the batch, each window's end as
    :func:`lease_expiry` checks it.

    Raises:
        ConfigurationError: ``lease_duration`` is not a positive timedelta, an instant is
            naive, or the random source returned the wrong number of bytes.
        ConfigurationTypeError: an instant is not a datetime, or ``random`` is not a
            RandomSource (a ``TypeError``).
    """
    start = aware_utc(now, "now")
    lease = _positive_duration(lease_duration, "lease_duration")
    draw = _token_source(random)
    sha256 = hashlib.sha256
    grants: list[Grant | None] = []
    for window in windows:
        expires = _expiry(start, lease, aware_utc(window, "window_ends_at"))
        if expires is None:
            grants.append(None)
            continue
        capability = _drawn(draw(CAPABILITY_BYTES), CAPABILITY_BYTES, "capability")
        # The capability is fresh bytes of the right length: hashed without re-checking.
        grants.append(Grant(expires, capability, sha256(capability).digest()))
    return grants


def is_live(expires_at: datetime, now: datetime) -> bool:
    """Return whether a lease expiring at ``expires_at`` is still live at ``now``.

    The expiry instant itself is already too late.

    Raises:
        ConfigurationError: an instant is naive (a ``ValueError``).
        ConfigurationTypeError: an instant is not a datetime (a ``TypeError``).
    """
    return aware_utc(now, "now") < aware_utc(expires_at, "expires_at")


@attrs.frozen
class ClaimRule:
    """Which occurrences a claim may lease, as data a store can turn into a query.

    Attributes:
        ready: states claimable at once.
        after_next_attempt: states claimable once their next attempt is due
            (``next_attempt_at <= now``).
        after_lease_expiry: states claimable once their lease has expired
            (``lease_expires_at <= now``).

    Nothing is claimable at or after the end of its delivery window (it is to be
    classified expired instead).
    """

    ready: frozenset[OccurrenceState]
    after_next_attempt: frozenset[OccurrenceState]
    after_lease_expiry: frozenset[OccurrenceState]

    @property
    def states(self) -> frozenset[OccurrenceState]:
        """Every state the rule may admit."""
        return self.ready | self.after_next_attempt | self.after_lease_expiry

    def admits(
        self,
        state: OccurrenceState,
        now: datetime,
        *,
        window_ends_at: datetime,
        lease_expires_at: datetime | None = None,
        next_attempt_at: datetime | None = None,
    ) -> bool:
        """Return whether a claim at ``now`` may lease an occurrence in ``state``.

        Raises:
            ConfigurationTypeError: ``state`` is not an :class:`OccurrenceState`, or an
                instant is not a datetime (a ``TypeError``).
            ConfigurationError: an instant is naive (a ``ValueError``).
        """
        if not isinstance(state, OccurrenceState):
            raise ConfigurationTypeError(f"state must be an OccurrenceState, not {shown(state)}")
        at = aware_utc(now, "now")
        if at >= aware_utc(window_ends_at, "window_ends_at"):
            return False
        if state in self.ready:
            return True
        if state in self.after_next_attempt:
            return next_attempt_at is None or aware_utc(next_attempt_at, "next_attempt_at") <= at
        if state in self.after_lease_expiry:
            return lease_expires_at is None or not is_live(lease_expires_at, at)
        return False


CLAIM_RULE: Final = ClaimRule(
    ready=frozenset({OccurrenceState.PENDING}),
    after_next_attempt=frozenset({OccurrenceState.RETRY_WAIT}),
    after_lease_expiry=frozenset({OccurrenceState.LEASED}),
)
"""Pending occurrences are claimable; ``retry_wait`` ones once their next attempt is due;
leased ones only once their lease has expired."""


def is_claimable(
    state: OccurrenceState,
    now: datetime,
    *,
    window_ends_at: datetime,
    lease_expires_at: datetime | None = None,
    next_attempt_at: datetime | None = None,
) -> bool:
    """Return whether a claim at ``now`` may lease an occurrence (:data:`CLAIM_RULE`).

    Pending occurrences are claimable; ``retry_wait`` ones once their next attempt is due;
    leased ones only once their lease has expired. Nothing is claimable once its delivery
    window has ended (it is to be classified expired instead).

    Raises:
        ConfigurationTypeError: ``state`` is not an :class:`OccurrenceState`, or an
            instant is not a datetime (a ``TypeError``).
        ConfigurationError: an instant is naive (a ``ValueError``).
    """
    return CLAIM_RULE.admits(
        state,
        now,
        window_ends_at=window_ends_at,
        lease_expires_at=lease_expires_at,
        next_attempt_at=next_attempt_at,
    )


_MAX_SECRET_BYTES = 1024
"""Longest capability or generation accepted for comparison (real ones are 16 bytes)."""


def _as_bytes(value: object, what: str) -> bytes:
    return byte_string(value, what, max_len=_MAX_SECRET_BYTES)


def capability_matches(expected: bytes, presented: bytes) -> bool:
    """Compare a stored lease capability with a presented one in constant time.

    Raises:
        ConfigurationTypeError: either value is not bytes-like (a ``TypeError``).
        ConfigurationError: either value is longer than 1024 bytes.
    """
    # compare_digest's time does not depend on where the first differing byte is, so a
    # forger learns nothing from how long a rejection takes.
    return hmac.compare_digest(_as_bytes(expected, "expected"), _as_bytes(presented, "presented"))


def capability_digest(capability: bytes) -> bytes:
    """Return what a store keeps of a lease capability: its SHA-256 digest.

    A reader of the database (or a backup) then cannot act as the lease holder.

    Raises:
        ConfigurationTypeError: ``capability`` is not bytes-like (a ``TypeError``).
        ConfigurationError: ``capability`` is longer than 1024 bytes.
    """
    return hashlib.sha256(_as_bytes(capability, "capability")).digest()


def holds_lease(
    stored_digest: bytes | None,
    stored_revision: int,
    capability: object,
    revision: object,
) -> bool:
    """Return whether a presented lease is the occurrence's current one (fencing).

    The presented capability's digest must equal the stored one (compared in constant
    time) and the revision must be the stored revision. A spent lease (no stored digest),
    a capability longer than any real one, and anything that is not bytes or an int are
    never held.
    """
    if stored_digest is None or not isinstance(capability, bytes | bytearray | memoryview):
        return False
    if len(capability) > _MAX_SECRET_BYTES:
        return False
    if isinstance(revision, bool) or not isinstance(revision, int):
        return False
    # The presented capability was checked above (bytes-like, at most 1024 bytes): its
    # digest is taken as is.
    raw = capability if type(capability) is bytes else bytes(capability)
    return _digest_held(stored_digest, stored_revision, hashlib.sha256(raw).digest(), revision)


def holds_granted_lease(
    stored_digest: bytes | None, stored_revision: int, granted_digest: bytes, revision: int
) -> bool:
    """:func:`holds_lease` for a lease the caller granted itself, judged by its digest.

    ``granted_digest`` is the :func:`capability_digest` of the lease's capability, taken
    when it was granted (``revision`` its revision): the answer is :func:`holds_lease`'s,
    without hashing the capability again. As there, a spent lease and a digest or
    revision of the wrong type (a bool is not a revision) are never held.
    """
    # Exact types, cheaply: this runs once per occurrence a batch records.
    if stored_digest is None or type(granted_digest) is not bytes or type(revision) is not int:
        return False
    return _digest_held(stored_digest, stored_revision, granted_digest, revision)


def _digest_held(
    stored_digest: bytes, stored_revision: int, presented: bytes, revision: int
) -> bool:
    # The stored digest is checked as any compared value is; compared in constant time.
    matches = hmac.compare_digest(_as_bytes(stored_digest, "stored_digest"), presented)
    return matches and revision == stored_revision


def _token_source(random: RandomSource) -> Callable[[int], object]:
    draw = getattr(random, "token_bytes", None)
    if not callable(draw):
        raise ConfigurationTypeError(
            f"random must be a RandomSource (with token_bytes), not {type(random).__name__}"
        )
    return draw  # type: ignore[no-any-return]  # a port: what it returns is checked


def _drawn(raw: object, n: int, what: str) -> bytes:
    if not isinstance(raw, bytes) or len(raw) != n:
        raise ConfigurationError(f"the random source returned a bad {what} (need {n} bytes)")
    return raw


def _random_bytes(random: RandomSource, n: int, what: str) -> bytes:
    return _drawn(_token_source(random)(n), n, what)


def new_capability(random: RandomSource) -> bytes:
    """Return a fresh lease capability (:data:`CAPABILITY_BYTES` random bytes).

    Raises:
        ConfigurationError: the random source returned the wrong number of bytes.
    """
    return _random_bytes(random, CAPABILITY_BYTES, "capability")


def new_generation(random: RandomSource) -> bytes:
    """Return a fresh occurrence generation (:data:`GENERATION_BYTES` random bytes).

    Raises:
        ConfigurationError: the random source returned the wrong number of bytes.
    """
    return _random_bytes(random, GENERATION_BYTES, "generation")


def new_occurrence_id(random: RandomSource) -> str:
    """Return the id of a fresh generation: ``occurrence_id_for(new_generation(random))``.

    The generation is checked once, as it is drawn (a tick draws one per occurrence).

    Raises:
        ConfigurationError: the random source returned the wrong number of bytes.
    """
    return next(new_occurrence_ids(random))


def new_occurrence_ids(random: RandomSource) -> Iterator[str]:
    """Yield :func:`new_occurrence_id` of ``random`` on each ``next``, for as long as asked.

    The source is looked up once, at the first id (a tick draws one per occurrence).

    Raises:
        ConfigurationTypeError: ``random`` has no ``token_bytes`` (at the first id).
        ConfigurationError: the random source returned the wrong number of bytes.
    """
    draw = _token_source(random)
    while True:
        yield _drawn(draw(GENERATION_BYTES), GENERATION_BYTES, "generation").hex()


def occurrence_id_for(generation: bytes) -> str:
    """Return the occurrence id of a generation: 32 lowercase hex characters.

    Raises:
        ConfigurationError: ``generation`` is not :data:`GENERATION_BYTES` long
            (a ``ValueError``).
        ConfigurationTypeError: ``generation`` is not bytes-like (a ``TypeError``).
    """
    raw = _as_bytes(generation, "generation")
    if len(raw) != GENERATION_BYTES:
        raise ConfigurationError(f"a generation is {GENERATION_BYTES} bytes; got {len(raw)}")
    return raw.hex()


def adopt_time(
    recorded: datetime | None,
    local: datetime,
    tolerance: timedelta = limits.CLOCK_TOLERANCE,
) -> datetime:
    """Return the shared time an instance uses: never earlier than the recorded time.

    Instances share the namespace's recorded time, not a clock. A local clock trailing
    the recorded time by at most ``tolerance`` adopts the recorded time, so shared time
    never moves backwards; a local clock ahead of it is used as is.

    Args:
        recorded: the namespace's last recorded time, or ``None`` if none yet.
        local: this instance's clock reading.
        tolerance: how far the local clock may trail (5 s by default).

    Raises:
        RecurringClockError: the local clock trails the recorded time by more than
            ``tolerance``.
        ConfigurationError: ``tolerance`` is negative or not a timedelta.
        ConfigurationError: an instant is naive (a ``ValueError``).
        ConfigurationTypeError: an instant is not a datetime (a ``TypeError``).
    """
    here = aware_utc(local, "local")
    if not isinstance(tolerance, timedelta) or tolerance < _NO_TIME:
        raise ConfigurationError("tolerance must be a non-negative timedelta")
    if recorded is None:
        return here
    shared = aware_utc(recorded, "recorded")
    if here >= shared:
        return here
    if shared - here > tolerance:
        raise RecurringClockError(
            f"the local clock ({here.isoformat()}) trails the recorded namespace time "
            f"({shared.isoformat()}) by {shared - here}, more than the {tolerance} tolerance; "
            "fix this host's clock synchronisation",
            recorded_time=shared,
            local_time=here,
        )
    return shared


def check_server_clock(
    local: datetime,
    server: datetime,
    round_trip: timedelta,
    bound: timedelta = limits.CLOCK_TOLERANCE,
) -> None:
    """Refuse a local clock ahead of the database server's clock by more than ``bound``.

    ``server`` is the server's reading, taken at most ``round_trip`` before ``local`` (the
    time from sending the statement that read it to reading ``local``). The local clock is
    ahead by at least ``local - server - round_trip``: only that much is held against it,
    so a slow round trip or a lock wait never refuses a host whose clock is right. The
    bound equals the tolerance :func:`adopt_time` gives a trailing clock, so a time any
    admitted host records is one a host on the server's time still adopts.

    Raises:
        RecurringClockError: the local clock is ahead by more than ``bound``; it names the
            skew and carries it (``skew``, ``server_time``, ``local_time``).
        ConfigurationError: an instant is naive, or ``round_trip`` is negative.
    """
    here = aware_utc(local, "local")
    there = aware_utc(server, "server")
    if not isinstance(round_trip, timedelta) or round_trip < _NO_TIME:
        raise ConfigurationError("round_trip must be a non-negative timedelta")
    ahead = here - there - round_trip
    if ahead <= bound:
        return
    seconds = ahead.total_seconds()
    trip_ms = round(round_trip / timedelta(milliseconds=1))
    raise RecurringClockError(
        f"this host's clock ({here.isoformat()}) is ahead of the database server's clock "
        f"({there.isoformat()}) by {timedelta(seconds=round(seconds))} ({seconds:.3f} s "
        f"at least, allowing for the {trip_ms} ms round trip), more than the {bound} "
        "bound; nothing was recorded. Fix this host's clock synchronisation (NTP)",
        local_time=here,
        server_time=there,
        skew=ahead,
    )


@attrs.frozen
class FailureDecision:
    """What a failed automatic publication leads to.

    Attributes:
        state: :attr:`OccurrenceState.RETRY_WAIT` or :attr:`OccurrenceState.DEAD`.
        next_attempt_at: when the next automatic attempt may run (``None`` when dead).
        reason: why it is dead (``"permanent"``, ``"attempts"``, ``"window"``), or ``""``.
    """

    state: OccurrenceState
    next_attempt_at: datetime | None
    reason: str = ""


def after_publish_failure(
    attempts: int,
    now: datetime,
    window_ends_at: datetime,
    permanent: bool,
    backoff: Backoff = RELAY_BACKOFF,
    max_attempts: int = limits.RELAY_MAX_ATTEMPTS,
    *,
    draw: float = 0.0,
) -> FailureDecision:
    """Decide what a failed automatic publication leads to.

    Dead when the failure is permanent, when ``attempts`` reached ``max_attempts``, or when
    the next attempt would fall at or after the end of the delivery window; otherwise
    ``retry_wait`` until ``now`` plus the backoff delay.

    Args:
        attempts: attempts made so far, the failed one included (>= 1).
        now: the current (shared) time.
        window_ends_at: the end of the occurrence's delivery window.
        permanent: the broker said retrying cannot help.
        backoff: the retry backoff (the relay's by default).
        max_attempts: the automatic attempt budget (ten by default).
        draw: a random float in [0, 1) for jitter, injected by the caller.

    Raises:
        ConfigurationError: ``attempts`` or ``max_attempts`` is not a positive int,
            ``backoff`` is not a :class:`Backoff`, or ``draw`` is NaN, infinite or not a
            number.
        ConfigurationError: an instant is naive (a ``ValueError``).
        ConfigurationTypeError: an instant is not a datetime (a ``TypeError``).
    """
    for value, what in ((attempts, "attempts"), (max_attempts, "max_attempts")):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigurationTypeError(f"{what} must be an int >= 1; got {shown(value)}")
        if value < 1:
            raise ConfigurationError(f"{what} must be an int >= 1; got {shown(value)}")
    if not isinstance(backoff, Backoff):
        raise ConfigurationTypeError(f"backoff must be a Backoff, not {type(backoff).__name__}")
    draw = unit_float(draw, "draw")
    start = aware_utc(now, "now")
    end = aware_utc(window_ends_at, "window_ends_at")
    if permanent:
        return FailureDecision(OccurrenceState.DEAD, None, "permanent")
    if attempts >= max_attempts:
        return FailureDecision(OccurrenceState.DEAD, None, "attempts")
    delay = backoff.delay(attempts, draw)
    # Comparing the delay with the time left avoids datetime overflow for huge caps.
    if start >= end or delay >= end - start:
        return FailureDecision(OccurrenceState.DEAD, None, "window")
    return FailureDecision(OccurrenceState.RETRY_WAIT, start + delay)
