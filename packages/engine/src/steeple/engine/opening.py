"""What every recurring store does the same way when it opens a namespace.

A store operation fails only with :class:`~steeple.core.errors.RecurringError` subtypes,
whichever port (keyring, clock, storage) refused: :func:`recurring_errors` maps the rest
at the boundary, and :func:`read_clock` refuses a clock reading no store could record.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from datetime import datetime

from steeple.core.errors import (
    ConfigurationError,
    RecurringConfigurationError,
    RecurringError,
    RecurringRelayError,
    SteepleError,
    recurring_error,
)
from steeple.core.leases import adopt_time
from steeple.core.ports import Clock

__all__ = ["read_clock", "recurring_errors"]


def read_clock(clock: Clock) -> datetime:
    """Return the clock's reading as an aware UTC datetime.

    Raises:
        RecurringConfigurationError: the clock returned a naive datetime or no datetime.
    """
    try:
        return adopt_time(None, clock.now())
    except ConfigurationError as exc:
        # ConfigurationTypeError (not a datetime) is a ConfigurationError too.
        raise RecurringConfigurationError(
            f"the clock's reading is unusable: {exc} (a Clock returns aware UTC datetimes)"
        ) from None


@contextlib.contextmanager
def recurring_errors(what: str) -> Iterator[None]:
    """Re-raise any library error of the block as its recurring-store error.

    Recurring errors and relay errors pass unchanged; any other
    :class:`~steeple.core.errors.SteepleError` (a keyring's, a validator's) becomes the
    matching :class:`~steeple.core.errors.RecurringError` subtype, with the original as
    its ``__cause__``.
    """
    try:
        yield
    except (RecurringError, RecurringRelayError):
        raise
    except SteepleError as exc:
        raise recurring_error(exc, what) from exc
