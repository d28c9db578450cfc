"""What every recurring store does the same way when it opens a namespace.

The open sequence, once: :func:`check_parts` refuses arguments of the wrong kind before
anything is touched; :func:`install_namespace` (``initialize``) checks the schema version
and creates the namespace with its sealed configuration binding, or verifies the binding
of an existing one; :func:`open_namespace` (``connect``) checks the schema version, that
the namespace exists, its binding, and adopts its shared time. A store supplies the reads
and writes through a :class:`~steeple.engine.ports.NamespaceOpening`.

A store operation fails only with :class:`~steeple.core.errors.RecurringError` subtypes,
whichever port (keyring, clock, storage) refused: :func:`recurring_errors` maps the rest
at the boundary, and :func:`read_clock` refuses a clock reading no store could record.
:func:`judge_clock` refuses a host clock ahead of the database server's (where the store
can read one), before the namespace's shared time is adopted or moved.
"""

from __future__ import annotations

import contextlib
import time
from datetime import datetime, timedelta

from steeple.core._validate import aware_utc
from steeple.core.clock import is_simulated
from steeple.core.config import RecurringConfig
from steeple.core.errors import (
    ConfigurationError,
    RecurringConfigurationError,
    RecurringError,
    RecurringNotFoundError,
    RecurringRelayError,
    RecurringSchemaVersionError,
    SteepleError,
    recurring_error,
)
from steeple.core.leases import adopt_time, check_server_clock
from steeple.core.ports import Clock, Sealer
from steeple.engine.binding import seal_binding, verify_binding
from steeple.engine.ports import NamespaceOpening, ServerClockReading

__all__ = [
    "check_parts",
    "install_namespace",
    "judge_clock",
    "open_namespace",
    "read_clock",
    "recurring_errors",
]


def check_parts(config: object, sealer: object, clock: object, *, sealer_is: str) -> None:
    """Refuse a configuration, sealer or clock of the wrong kind, before anything is opened.

    ``sealer_is`` is what the caller calls the sealer (``"keyring"`` for a store).

    Raises:
        RecurringConfigurationError: naming the argument that is wrong.
    """
    if not isinstance(config, RecurringConfig):
        raise RecurringConfigurationError("config must be a RecurringConfig")
    if not all(callable(getattr(sealer, m, None)) for m in ("seal", "open")):
        raise RecurringConfigurationError(f"{sealer_is} must implement the Sealer protocol")
    if not callable(getattr(clock, "now", None)):
        raise RecurringConfigurationError("clock must implement the Clock protocol")


async def _check_version(opening: NamespaceOpening) -> None:
    found = await opening.stored_version()
    if found != opening.schema_version:
        raise RecurringSchemaVersionError(opening.schema, found, opening.schema_version)


async def install_namespace(
    opening: NamespaceOpening, config: RecurringConfig, sealer: Sealer, clock: Clock
) -> None:
    """Check the schema version, then create the namespace or verify it (``initialize``).

    A namespace that exists must have been bound to the same configuration with a key of
    this keyring; a new one is stored with its binding sealed under the primary key.

    Raises:
        RecurringSchemaVersionError: the store holds another schema version.
        RecurringConfigurationError: the namespace exists with another configuration or
            keyring, or the clock's reading is unusable.
        RecurringKeyringError: the binding cannot be sealed.
        RecurringClockError: the clock is ahead of the database server's by more than 5 s.
    """
    await _check_version(opening)
    found = await opening.namespace()
    if found is not None:
        verify_binding(sealer, config, found.binding)
        return
    binding = seal_binding(sealer, config)
    server = await opening.server_clock()
    await opening.insert_namespace(binding, sealer.primary_key_id, judge_clock(clock, server))


async def open_namespace(
    opening: NamespaceOpening, config: RecurringConfig, sealer: Sealer, clock: Clock
) -> None:
    """Check the schema version, the namespace, its binding; adopt its time (``connect``).

    Raises:
        RecurringSchemaVersionError: the store holds another schema version.
        RecurringNotFoundError: the namespace was never initialized.
        RecurringConfigurationError: the configuration or keyring does not match the
            namespace's binding, or the clock's reading is unusable.
        RecurringClockError: the clock trails the recorded time by more than 5 s, or is
            ahead of the database server's clock by more than 5 s.
    """
    await _check_version(opening)
    found = await opening.namespace()
    if found is None:
        raise RecurringNotFoundError(
            f"namespace {config.namespace!r} does not exist in schema "
            f"{opening.schema!r}; run initialize first"
        )
    verify_binding(sealer, config, found.binding)
    # The host's clock is judged against the server's (where the store has one), then
    # against the namespace's shared time.
    server = await opening.server_clock()
    adopt_time(found.recorded_time, judge_clock(clock, server))


def read_clock(clock: Clock) -> datetime:
    """Return the clock's reading as an aware UTC datetime.

    Raises:
        RecurringConfigurationError: the clock returned a naive datetime or no datetime.
    """
    try:
        return aware_utc(clock.now(), "local")
    except ConfigurationError as exc:
        # ConfigurationTypeError (not a datetime) is a ConfigurationError too.
        raise RecurringConfigurationError(
            f"the clock's reading is unusable: {exc} (a Clock returns aware UTC datetimes)"
        ) from None


def judge_clock(clock: Clock, server: ServerClockReading | None) -> datetime:
    """Read ``clock`` and judge it against the database server's reading ``server``.

    The one place a store's server clock is used: the round trip is measured from when the
    statement that read ``server`` was sent to this reading, and
    :func:`steeple.core.leases.check_server_clock` decides. With no server clock (SQLite,
    in memory) or a clock that declares itself simulated, the reading is returned unjudged.

    Raises:
        RecurringClockError: the clock is ahead of the server's by more than 5 s.
        RecurringConfigurationError: the clock's reading is unusable.
    """
    local = read_clock(clock)
    if server is not None and not is_simulated(clock):
        round_trip = timedelta(seconds=max(0.0, time.monotonic() - server.sent))
        check_server_clock(local, server.at, round_trip)
    return local


def recurring_errors(what: str) -> contextlib.AbstractContextManager[None]:
    """Re-raise any library error of the block as its recurring-store error.

    Recurring errors and relay errors pass unchanged; any other
    :class:`~steeple.core.errors.SteepleError` (a keyring's, a validator's) becomes the
    matching :class:`~steeple.core.errors.RecurringError` subtype, with the original as
    its ``__cause__``.
    """
    return _RecurringErrors(what)


class _RecurringErrors(contextlib.ContextDecorator):
    """The context :func:`recurring_errors` returns (a decorator too, as before).

    A class: every transaction enters one, and a generator-based context costs several
    times as much.
    """

    __slots__ = ("_what",)

    def __init__(self, what: str) -> None:
        self._what = what

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: object, exc: BaseException | None, traceback: object) -> None:
        if isinstance(exc, SteepleError) and not isinstance(
            exc, RecurringError | RecurringRelayError
        ):
            raise recurring_error(exc, self._what) from exc
