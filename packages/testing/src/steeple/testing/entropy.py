"""A seeded random source, so tests that draw capabilities and generations repeat exactly."""

from __future__ import annotations

import random as _random

import attrs

__all__ = ["DeterministicRandom"]


@attrs.define(init=False)
class DeterministicRandom:
    """A :class:`steeple.core.ports.RandomSource` driven by :class:`random.Random` (tests only).

    Not cryptographically secure: capabilities drawn from it can be predicted. Never use it
    outside tests.

    Args:
        seed: the seed; the same seed gives the same sequence.
    """

    _seed: int
    _rng: _random.Random

    def __init__(self, seed: int = 0) -> None:
        self._seed = seed
        self._rng = _random.Random(seed)  # noqa: S311 - deterministic on purpose, tests only

    def token_bytes(self, n: int) -> bytes:
        """Return ``n`` pseudo-random bytes.

        Raises:
            ValueError: ``n`` is negative.
        """
        if n < 0:
            raise ValueError(f"n must be >= 0; got {n}")
        return self._rng.randbytes(n)

    def random(self) -> float:
        """Return a pseudo-random float in [0, 1)."""
        return self._rng.random()

    def __repr__(self) -> str:
        return f"DeterministicRandom(seed={self._seed})"
