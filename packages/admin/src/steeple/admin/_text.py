"""Words the operator surfaces print, written once (the command, the worker, the simulator)."""

from __future__ import annotations

__all__ = ["plural"]


def plural(count: int, noun: str, nouns: str | None = None) -> str:
    """Write a count with its noun: ``1 task``, ``2 tasks``, ``1,024 tasks``.

    ``nouns`` is an irregular plural.
    """
    return f"{count:,} {noun if count == 1 else (nouns or noun + 's')}"
