"""The default random source: the OS's CSPRNG. The only randomness reader in core."""

from __future__ import annotations

import secrets

__all__ = ["SystemRandom"]


class SystemRandom:
    """Random bytes from the operating system (``secrets``), for capabilities and generations."""

    def token_bytes(self, n: int) -> bytes:
        """Return ``n`` cryptographically random bytes."""
        return secrets.token_bytes(n)

    def random(self) -> float:
        """Return a float in [0, 1) for jitter."""
        return secrets.randbits(53) / float(1 << 53)

    def __repr__(self) -> str:
        return "SystemRandom()"
