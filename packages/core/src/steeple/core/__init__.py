"""steeple's pure domain core: calendar, policies, leases, lifecycles, backoff, limits, ports.

No I/O: time comes from an injected :class:`Clock`, randomness from an injected source.
"""

from steeple.core.backoff import RELAY_BACKOFF, Backoff
from steeple.core.calendar import CronCalendar
from steeple.core.clock import SystemClock
from steeple.core.config import RecurringConfig, RecurringDefinition
from steeple.core.entropy import SystemRandom
from steeple.core.errors import (
    AuthenticationFailedError,
    BrokerError,
    BrokerRejectedError,
    BrokerTimeoutError,
    BrokerUnavailableError,
    ConfigurationError,
    InvalidCronExpression,
    InvalidTransitionError,
    KeyringConfigurationError,
    KeyringError,
    MalformedEnvelopeError,
    MessageTooLargeError,
    RecurringCapacityError,
    RecurringClockError,
    RecurringConfigurationError,
    RecurringConflictError,
    RecurringDeadlineError,
    RecurringError,
    RecurringInvalidStateError,
    RecurringNotFoundError,
    RecurringRelayError,
    RecurringStorageError,
    RelayAcknowledgementError,
    RelayBrokerError,
    RelayBrokerTimeoutError,
    RelayLeaseLostError,
    SealBudgetExhaustedError,
    SteepleError,
    UnknownKeyIdError,
)
from steeple.core.idempotency import PUBLISH_PURPOSE, idempotency_key
from steeple.core.messages import BrokerReceipt, ScheduledMessage
from steeple.core.occurrences import OccurrenceState
from steeple.core.policies import MissedRunPolicy
from steeple.core.ports import Clock, MessageBroker, RandomSource, RecurringStore, Sealer
from steeple.core.records import (
    Lease,
    OccurrenceInfo,
    Page,
    ScheduleInfo,
    ScheduleState,
    TickResult,
)
from steeple.core.tasks import TaskState

__all__ = [
    "PUBLISH_PURPOSE",
    "RELAY_BACKOFF",
    "AuthenticationFailedError",
    "Backoff",
    "BrokerError",
    "BrokerReceipt",
    "BrokerRejectedError",
    "BrokerTimeoutError",
    "BrokerUnavailableError",
    "Clock",
    "ConfigurationError",
    "CronCalendar",
    "InvalidCronExpression",
    "InvalidTransitionError",
    "KeyringConfigurationError",
    "KeyringError",
    "Lease",
    "MalformedEnvelopeError",
    "MessageBroker",
    "MessageTooLargeError",
    "MissedRunPolicy",
    "OccurrenceInfo",
    "OccurrenceState",
    "Page",
    "RandomSource",
    "RecurringCapacityError",
    "RecurringClockError",
    "RecurringConfig",
    "RecurringConfigurationError",
    "RecurringConflictError",
    "RecurringDeadlineError",
    "RecurringDefinition",
    "RecurringError",
    "RecurringInvalidStateError",
    "RecurringNotFoundError",
    "RecurringRelayError",
    "RecurringStorageError",
    "RecurringStore",
    "RelayAcknowledgementError",
    "RelayBrokerError",
    "RelayBrokerTimeoutError",
    "RelayLeaseLostError",
    "ScheduleInfo",
    "ScheduleState",
    "ScheduledMessage",
    "SealBudgetExhaustedError",
    "Sealer",
    "SteepleError",
    "SystemClock",
    "SystemRandom",
    "TaskState",
    "TickResult",
    "UnknownKeyIdError",
    "idempotency_key",
]
