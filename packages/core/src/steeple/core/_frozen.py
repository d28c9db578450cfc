"""Building frozen values from values already checked, at the cost of plain ones (private).

A frozen attrs value sets each field through ``object.__setattr__``, which costs about
five times a plain attribute store. The values steeple builds once per occurrence and
step from values it already holds (rows, changes, leases, outcomes) are filled in as an
instance of :func:`writable`'s class instead, then made the frozen class by assigning
``__class__``.
"""

from __future__ import annotations

from typing import Final

import attrs

__all__ = ["new", "writable"]

new: Final = object.__new__
"""An instance of a class, uninitialised: ``new(writable(cls))`` to fill one in."""


def writable(cls: type) -> type:
    """Return a plain class with the slots of ``cls`` (a frozen attrs class) and nothing else.

    Fill in every field of ``new(writable(cls))``, then assign ``__class__ = cls``
    (allowed: the two layouts are the same); the value is the one ``cls(...)`` builds
    from the same fields, without its checks (a test requires both to be equal).

    Raises:
        TypeError: ``cls`` is not slotted, or has a weak reference slot (either would
            make the layouts differ).
    """
    if "__weakref__" in getattr(cls, "__slots__", ("__weakref__",)):
        raise TypeError(f"{cls.__name__} must be slotted, without a weak reference slot")
    names = tuple(field.name for field in attrs.fields(cls))
    return type(f"_Writable{cls.__name__}", (), {"__slots__": names})
