"""What another host's clock reads, judged from its last answer and our own monotonic clock.

A client that tells a server "ignore this request if it reaches you after I gave up" must
say when in the server's clock, which it cannot read directly. Estimating it from the local
wall clock plus an offset measured once breaks as soon as either wall clock is stepped (NTP,
an operator, a failover to a server whose clock differs). Instead every answer from the
server that carries its clock is an observation: the server's clock read ``reading`` at some
moment before the answer arrived at local monotonic time ``received``. As long as the
server's clock runs at the rate of the local monotonic clock (it is not stepped), at local
monotonic time ``t`` it reads at least ``reading + (t - received)``: the request delay and
the reply delay only make the true value larger.

That lower bound is the safe direction for a give-up time: a request the server executes
after the client gave up finds the server clock past the bound and takes nothing. Only the
latest observation is used, so a step of the server's clock is forgotten after one round
trip (the first request after a forward step is refused once; after a backward step, the
bound is too late by the step until the next answer arrives).

Pure: the caller passes every local time in; nothing here reads a clock.
"""

from __future__ import annotations

import math

import attrs

__all__ = ["RemoteClockEstimate"]


def _finite(value: float, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{what} must be a finite number of seconds, not {value!r}")
    return float(value)


@attrs.define
class RemoteClockEstimate:
    """A lower bound of a remote clock, anchored on the latest reading of it.

    Times are seconds: remote readings on the remote clock's scale (e.g. Unix epoch
    seconds), local times on a local monotonic clock (e.g. ``time.monotonic()``).
    """

    _reading: float | None = None
    _received: float = 0.0

    @property
    def known(self) -> bool:
        """Whether any reading was observed yet."""
        return self._reading is not None

    def observe(self, reading: float, received: float) -> None:
        """Record that the remote clock read ``reading`` before local time ``received``.

        Raises:
            ValueError: a non-finite reading or local time.
        """
        # Both checked before either is kept: a refused observation changes nothing.
        checked = _finite(reading, "a remote clock reading")
        self._received = _finite(received, "a local monotonic time")
        self._reading = checked

    def at_least(self, local: float) -> float:
        """Return a value the remote clock has certainly reached at local time ``local``.

        Raises:
            ValueError: nothing observed yet, or a non-finite ``local``.
        """
        if self._reading is None:
            raise ValueError("no remote clock reading was observed yet")
        return self._reading + (_finite(local, "a local monotonic time") - self._received)

    def until(self, remote_instant: float, local: float) -> float:
        """Return the local seconds until the remote clock surely reads ``remote_instant``.

        Counted from local time ``local``; zero or negative when it already does.

        Raises:
            ValueError: nothing observed yet, or non-finite arguments.
        """
        return _finite(remote_instant, "a remote instant") - self.at_least(local)
