"""Names a package exports but imports on first use (so a command's ``--help`` stays light)."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Mapping, MutableMapping
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(
    package: str,
    homes: Mapping[str, str],
    namespace: MutableMapping[str, Any],
    exported: Iterable[str],
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """Return a package's module ``__getattr__`` and ``__dir__`` for names loaded on first use.

    ``homes`` maps each exported name to the module that defines it; the first access
    imports that module and caches the value in ``namespace`` (the package's globals), so
    later accesses are plain lookups. An unknown name raises ``AttributeError`` as a module
    attribute would.
    """
    names = frozenset(exported)

    def __getattr__(name: str) -> Any:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(home), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *names})

    return __getattr__, __dir__
