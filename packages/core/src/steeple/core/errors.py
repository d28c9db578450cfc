"""steeple's error hierarchy: one root, typed by meaning, subclassing the builtins callers catch.

Nested aliases give the seed's spelling: ``RecurringError.Clock``,
``RecurringRelayError.Acknowledgement`` and so on are the classes defined here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from datetime import datetime, timedelta

    from steeple.core.messages import BrokerReceipt

__all__ = [
    "AuthenticationFailedError",
    "BrokerError",
    "BrokerRejectedError",
    "BrokerTimeoutError",
    "BrokerUnavailableError",
    "ConfigurationError",
    "ConfigurationTypeError",
    "InvalidCronExpression",
    "InvalidTransitionError",
    "KeyringConfigurationError",
    "KeyringError",
    "MalformedEnvelopeError",
    "MessageTooLargeError",
    "RecurringCapacityError",
    "RecurringClockError",
    "RecurringConfigurationError",
    "RecurringConflictError",
    "RecurringDeadlineError",
    "RecurringError",
    "RecurringInvalidStateError",
    "RecurringNotFoundError",
    "RecurringRelayError",
    "RecurringStorageError",
    "RelayAcknowledgementError",
    "RelayBrokerError",
    "RelayBrokerTimeoutError",
    "RelayLeaseLostError",
    "SealBudgetExhaustedError",
    "SteepleError",
    "UnknownKeyIdError",
]


def shown(value: object, limit: int = 80) -> str:
    """Return a short ``repr`` of ``value`` that is safe to put in any message (private).

    Never raises: a hostile ``__repr__``, or an int too long for ``repr`` (more than 4300
    digits), is shown by its type instead. Lone surrogates come out escaped, so the
    message encodes as UTF-8 and can be logged.
    """
    try:
        text = repr(value)
    except Exception:
        return f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _plain(value: object, limit: int = 80) -> str:
    """Show a str as itself (escaped where it would not encode, shortened); others shown."""
    if not isinstance(value, str):
        return shown(value, limit)
    text = value if len(value) <= limit else value[: limit - 3] + "..."
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class SteepleError(Exception):
    """Root of every error steeple raises on purpose."""


class ConfigurationError(SteepleError, ValueError):
    """Bad input or configuration; the message says what to fix. Nothing was stored."""


class ConfigurationTypeError(ConfigurationError, TypeError):
    """Input of the wrong type (bytes for a str, a list for a mapping, a float for an int).

    Both a :class:`ConfigurationError` (a ``ValueError``) and a ``TypeError``, so callers
    catching either keep working.
    """


class InvalidCronExpression(ConfigurationError):
    """A cron expression that steeple's calendar does not accept.

    Attributes:
        expression: the rejected text (truncated for display).
        field: the field at fault (``"minute"`` ... ``"weekday"``) or ``None`` for the whole.
        reason: why it was rejected.
    """

    def __init__(self, expression: str, reason: str, *, field: str | None = None) -> None:
        # Escaped where it would not encode (lone surrogates), so the message can be logged.
        shown_text = _plain(expression)
        where = f" in the {_plain(field)} field" if isinstance(field, str) and field else ""
        super().__init__(f"invalid cron expression {shown_text!r}{where}: {reason}")
        self.expression = shown_text
        self.field = field
        self.reason = reason


class InvalidTransitionError(SteepleError):
    """A lifecycle event that the state table does not allow from the current state.

    Nothing changed: the caller still holds the previous state.
    """

    def __init__(self, lifecycle: str, state: object, event: object) -> None:
        state_name = getattr(state, "value", state)
        event_name = getattr(event, "value", event)
        super().__init__(
            f"{_plain(lifecycle)}: {_plain(event_name)} is not allowed in state "
            f"{_plain(state_name)}"
        )
        self.lifecycle = lifecycle
        self.state = state
        self.event = event


# --- recurring publications -------------------------------------------------------------


class RecurringError(SteepleError):
    """Base of the recurring-publication store's errors."""

    Configuration: ClassVar[type[RecurringConfigurationError]]
    Conflict: ClassVar[type[RecurringConflictError]]
    Capacity: ClassVar[type[RecurringCapacityError]]
    Clock: ClassVar[type[RecurringClockError]]
    Storage: ClassVar[type[RecurringStorageError]]
    Deadline: ClassVar[type[RecurringDeadlineError]]
    NotFound: ClassVar[type[RecurringNotFoundError]]
    InvalidState: ClassVar[type[RecurringInvalidStateError]]
    Keyring: ClassVar[type[RecurringKeyringError]]
    SchemaVersion: ClassVar[type[RecurringSchemaVersionError]]


class RecurringConfigurationError(RecurringError, ConfigurationError):
    """Invalid configuration or definition, or stored configuration/keys that do not match."""


class RecurringConflictError(RecurringError):
    """A name reused with a different definition (definitions are immutable)."""


class RecurringCapacityError(RecurringError):
    """A quota would be exceeded (definitions or occurrences); nothing was stored."""


class RecurringClockError(RecurringError):
    """The local clock trails the recorded time, or runs ahead of the server's clock.

    Trailing the namespace's recorded time by more than the tolerance, or running ahead of
    the database server's clock by more than the bound (stores that can read one).

    Attributes:
        recorded_time: the namespace's recorded time, when the raiser knows it.
        local_time: the local clock reading that was refused, when the raiser knows it.
        server_time: the database server's clock reading it was judged against (``None``
            when the refusal is a trailing one).
        skew: how far the local clock is ahead of the server's at least, allowing for the
            round trip (``None`` when the refusal is a trailing one).
    """

    def __init__(
        self,
        message: str,
        *,
        recorded_time: datetime | None = None,
        local_time: datetime | None = None,
        server_time: datetime | None = None,
        skew: timedelta | None = None,
    ) -> None:
        super().__init__(message)
        self.recorded_time = recorded_time
        self.local_time = local_time
        self.server_time = server_time
        self.skew = skew


class RecurringStorageError(RecurringError):
    """The database failed, refused, or is unfit (not durable, read-only, wrong schema)."""


class RecurringDeadlineError(RecurringStorageError, TimeoutError):
    """A storage deadline (call, acquisition, statement or lock wait) passed."""


class RecurringNotFoundError(RecurringError, LookupError):
    """No definition or occurrence with that identity in this namespace."""


class RecurringInvalidStateError(RecurringError):
    """The operation is not allowed in the record's current state."""


RecurringError.Configuration = RecurringConfigurationError
RecurringError.Conflict = RecurringConflictError
RecurringError.Capacity = RecurringCapacityError
RecurringError.Clock = RecurringClockError
RecurringError.Storage = RecurringStorageError
RecurringError.Deadline = RecurringDeadlineError
RecurringError.NotFound = RecurringNotFoundError
RecurringError.InvalidState = RecurringInvalidStateError


class RecurringRelayError(SteepleError):
    """Base of the errors of ``relay``: publication of one leased occurrence."""

    Acknowledgement: ClassVar[type[RelayAcknowledgementError]]
    LeaseLost: ClassVar[type[RelayLeaseLostError]]
    Broker: ClassVar[type[RelayBrokerError]]
    BrokerTimeout: ClassVar[type[RelayBrokerTimeoutError]]


class RelayAcknowledgementError(RecurringRelayError):
    """The broker accepted the message but its acknowledgement is uncertain.

    Brokers raise this too. Recovery republishes with the same idempotency key.

    Attributes:
        receipt: what the broker returned before the acknowledgement was lost.
    """

    def __init__(self, receipt: BrokerReceipt, detail: str = "acknowledgement uncertain") -> None:
        super().__init__(f"broker accepted the message but {detail}")
        self.receipt = receipt


class RelayLeaseLostError(RecurringRelayError):
    """The lease is no longer live (expired, fenced by a newer claim, or the work ended)."""


class RelayBrokerError(RecurringRelayError):
    """Publication failed; ``permanent`` says whether retrying can help."""

    def __init__(self, message: str, *, permanent: bool = False) -> None:
        super().__init__(message)
        self.permanent = permanent


class RelayBrokerTimeoutError(RelayBrokerError, TimeoutError):
    """Publication did not finish within its deadline (the broker may have accepted it)."""


RecurringRelayError.Acknowledgement = RelayAcknowledgementError
RecurringRelayError.LeaseLost = RelayLeaseLostError
RecurringRelayError.Broker = RelayBrokerError
RecurringRelayError.BrokerTimeout = RelayBrokerTimeoutError


# --- brokers ----------------------------------------------------------------------------


class BrokerError(SteepleError):
    """A broker adapter's failure. ``permanent`` failures must not be retried."""

    permanent: bool = False

    def __init__(self, message: str, **context: Any) -> None:
        super().__init__(message)
        self.context = context


class BrokerUnavailableError(BrokerError, ConnectionError):
    """The broker could not be reached or dropped the connection."""


class BrokerTimeoutError(BrokerError, TimeoutError):
    """The broker did not answer in time; it may have accepted the message."""


class BrokerRejectedError(BrokerError):
    """The broker refused the message for good (unroutable, forbidden, misconfigured)."""

    permanent = True


class MessageTooLargeError(BrokerRejectedError):
    """The message exceeds the broker's size limit; retrying cannot help."""


# --- keyring ----------------------------------------------------------------------------


class KeyringError(SteepleError):
    """Base of the keyring's errors."""


class KeyringConfigurationError(KeyringError, ConfigurationError):
    """A keyring that cannot be built: bad key length or id, duplicates, too many keys."""


class UnknownKeyIdError(KeyringError, LookupError):
    """The envelope names a key id this keyring does not hold (restore that key)."""

    def __init__(self, key_id: str) -> None:
        super().__init__(
            f"sealed with key id {shown(key_id)}, which this keyring does not hold; "
            "add that key back (as a previous key) to read this record"
        )
        self.key_id = key_id


class AuthenticationFailedError(KeyringError):
    """Tampered, truncated, wrong key material, or moved to another context."""


class MalformedEnvelopeError(KeyringError, ValueError):
    """Not a sealed envelope steeple understands (bad version or framing)."""


class SealBudgetExhaustedError(KeyringError):
    """The primary key sealed as many records as its budget allows; rotate to a new key."""


# --- keyring: configuration binding (appended by the keyring package) --------------------


class KeyringBindingMismatchError(KeyringError, ConfigurationError):
    """The stored configuration binding differs from the supplied configuration: fail closed.

    Only field names are reported, never values (a binding is sealed content).

    Attributes:
        namespace: the namespace whose binding did not match.
        fields: names of the fields that differ, are missing or are extra, sorted.
    """

    def __init__(self, namespace: str, fields: tuple[str, ...]) -> None:
        try:
            listed = ", ".join(_plain(f) for f in fields) if fields else "(format)"
        except TypeError:
            listed = "(format)"
        super().__init__(
            f"the stored configuration binding of namespace {shown(namespace)} does not match the "
            f"supplied configuration (fields: {listed}); supply the configuration the namespace "
            "was initialized with, or re-initialize it deliberately"
        )
        self.namespace = namespace
        self.fields = fields


__all__ += ["KeyringBindingMismatchError"]


# --- brokers: configuration that breaks the dedup promise (appended by the brokers package) --


class BrokerConfigurationError(BrokerRejectedError, ConfigurationError):
    """The broker is set up so that it cannot keep steeple's promise (permanent).

    For example a JetStream stream whose ``duplicate_window`` is shorter than the delivery
    window it must protect, or a missing stream the adapter is not allowed to create.
    The message says what the operator must change.
    """


__all__ += ["BrokerConfigurationError"]


# --- recurring store: sealed records and schema versions ----------------------------------


class RecurringKeyringError(RecurringError, KeyringError):
    """A record of the recurring store cannot be opened or sealed.

    Both a :class:`RecurringError` (every failure of a store operation is one) and a
    :class:`KeyringError` (it is the keyring that refused). The subclasses below are also
    the keyring's own class, so ``except UnknownKeyIdError`` keeps working.
    """


class RecurringUnknownKeyIdError(RecurringKeyringError, UnknownKeyIdError):
    """A record is sealed under a key id the keyring does not hold (restore that key).

    Attributes:
        key_id: the missing key's id.
        record: which record (e.g. ``definition 'daily'``).
    """

    def __init__(self, key_id: str, record: str = "a record") -> None:
        UnknownKeyIdError.__init__(self, key_id)
        self.args = (
            f"{_plain(record, 200)} is sealed with key id {shown(key_id)}, which this keyring "
            "does not hold; add that key back (as a previous key) to read it",
        )
        self.record = record


class RecurringAuthenticationFailedError(RecurringKeyringError, AuthenticationFailedError):
    """A record failed authentication: tampered, wrong key material, or moved elsewhere."""


class RecurringMalformedEnvelopeError(RecurringKeyringError, MalformedEnvelopeError):
    """A stored record is not a sealed envelope steeple understands."""


class RecurringSealBudgetExhaustedError(RecurringKeyringError, SealBudgetExhaustedError):
    """The primary key sealed as many records as its budget allows; rotate to a new key."""


def recurring_keyring_error(exc: KeyringError, record: str) -> RecurringKeyringError:
    """Return the recurring store's error for a keyring failure on ``record``.

    The result is also an instance of ``exc``'s keyring class (for the four known ones);
    raise it ``from exc``.
    """
    if isinstance(exc, RecurringKeyringError):
        return exc
    detail = f"{_plain(record, 200)}: {exc}"
    if isinstance(exc, UnknownKeyIdError):
        return RecurringUnknownKeyIdError(exc.key_id, record)
    if isinstance(exc, AuthenticationFailedError):
        return RecurringAuthenticationFailedError(detail)
    if isinstance(exc, MalformedEnvelopeError):
        return RecurringMalformedEnvelopeError(detail)
    if isinstance(exc, SealBudgetExhaustedError):
        return RecurringSealBudgetExhaustedError(detail)
    return RecurringKeyringError(detail)


def recurring_error(exc: SteepleError, what: str) -> RecurringError:
    """Return the recurring store's error for a library failure during ``what``.

    A store operation fails only with :class:`RecurringError` subtypes; this maps what a
    port (the keyring, the clock, a validator) raised into that family at the boundary,
    keeping the original class as a base where one exists. Raise the result ``from exc``.
    """
    if isinstance(exc, RecurringError):
        return exc
    if isinstance(exc, KeyringError):
        return recurring_keyring_error(exc, what)
    if isinstance(exc, ConfigurationError):
        return RecurringConfigurationError(f"{_plain(what, 200)}: {exc}")
    return RecurringError(f"{_plain(what, 200)}: {exc}")


class RecurringSchemaVersionError(RecurringStorageError):
    """The database holds another version of the recurring schema than this library uses.

    Attributes:
        found: the version the database holds.
        expected: the version this library reads and writes.
    """

    def __init__(self, schema: str, found: object, expected: int) -> None:
        if isinstance(found, int) and found < expected:
            action = "run initialize (the deployment role) to migrate it forward"
        else:
            action = "use a steeple release that knows this schema version"
        super().__init__(
            f"schema {shown(schema)} holds recurring schema version {shown(found)}; this "
            f"library uses version {expected}: {action}"
        )
        self.found = found
        self.expected = expected


RecurringError.Keyring = RecurringKeyringError
RecurringError.SchemaVersion = RecurringSchemaVersionError

__all__ += [
    "RecurringAuthenticationFailedError",
    "RecurringKeyringError",
    "RecurringMalformedEnvelopeError",
    "RecurringSchemaVersionError",
    "RecurringSealBudgetExhaustedError",
    "RecurringUnknownKeyIdError",
    "recurring_error",
    "recurring_keyring_error",
]


# --- time zones (appended by core's zoned calendar) ---------------------------------------


class InvalidTimeZoneError(ConfigurationError):
    """A time zone that the zoned calendar (``steeple.core.zoned``) cannot use.

    Attributes:
        zone: the rejected name, or ``<type>`` for a value of the wrong type (truncated).
        reason: why it was rejected.
    """

    def __init__(self, zone: object, reason: object) -> None:
        # Built from hostile input: formatting must never raise nor produce unencodable text.
        zone_text = zone if isinstance(zone, str) else f"<{type(zone).__name__}>"
        short = zone_text if len(zone_text) <= 80 else zone_text[:77] + "..."
        reason_text = reason if isinstance(reason, str) else shown(reason)
        reason_text = reason_text.encode("utf-8", "backslashreplace").decode("utf-8")
        super().__init__(f"invalid time zone {shown(short, 100)}: {reason_text}")
        self.zone = short
        self.reason = reason_text


__all__ += ["InvalidTimeZoneError"]


# --- cluster identity (failover) ----------------------------------------------------------


class ClusterIdentityError(SteepleError, ConnectionError):
    """A new connection reached another cluster, or a node left behind by a failover.

    steeple remembers the cluster it first wrote to (its system identifier) and the newest
    timeline it has seen there. A node with another system identifier, or on an older
    timeline (an old primary restarted after its standby was promoted), is refused: nothing
    is read, claimed or finalized on it. A ``ConnectionError``: workers back off and try
    again, and a later connection that reaches the current primary is accepted.

    Attributes:
        known: the identity remembered, ``(system identifier, timeline)`` (``None`` when
            not given).
        seen: the identity of the node refused (``None`` when not given).
    """

    def __init__(
        self,
        message: str,
        *,
        known: tuple[int, int] | None = None,
        seen: tuple[int, int] | None = None,
    ) -> None:
        super().__init__(message)
        self.known = known
        self.seen = seen


class RecurringClusterError(RecurringStorageError, ClusterIdentityError):
    """The recurring store refused a node (see :class:`ClusterIdentityError`)."""


__all__ += ["ClusterIdentityError", "RecurringClusterError"]
