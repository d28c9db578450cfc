"""The default random source: the OS's CSPRNG. The only randomness reader in core."""

from __future__ import annotations

import secrets

from steeple.core._validate import bounded_int
from steeple.core.errors import ConfigurationError

__all__ = ["SystemRandom"]


class SystemRandom:
    """Random bytes from the operating system (``secrets``), for capabilities and generations."""

    def token_bytes(self, n: int) -> bytes:
        """Return ``n`` cryptographically random bytes.

        Raises:
            ConfigurationError: ``n`` is not an int in 0..65536.
        """
        return secrets.token_bytes(bounded_int(n, "n", 0, 65536, ConfigurationError))

    def random(self) -> float:
        """Return a float in [0, 1) for jitter."""
        return secrets.randbits(53) / float(1 << 53)

    def __repr__(self) -> str:
        return "SystemRandom()"
