"""Keep a long-lived worker's C heap from growing at every database outage (glibc).

glibc serves an allocation of 128 KiB or more with a mapping of its own, until the first
such mapping is freed: from then on its threshold rises to that size and those
allocations come from the main heap. asyncio reads every socket into a fresh 256 KiB
buffer, shrunk to what arrived, so after the first read a worker's reads are carved from
the heap. When every connection is lost at once (a restart, a failover) and the pools
reconnect, that churn fragments the heap: it grows at each outage and keeps the growth,
although the memory in use does not grow (the soak measured it, see
``docs/operations/soak.md``). Pinning the threshold at glibc's own initial 128 KiB keeps
every such buffer in a mapping of its own, returned as soon as it is freed, and the heap
stays the size it was.
"""

from __future__ import annotations

import ctypes
import os
import sys

__all__ = ["MMAP_THRESHOLD", "pin_mmap_threshold"]

MMAP_THRESHOLD = 128 * 1024
"""Bytes from which glibc maps an allocation on its own: its default, kept fixed."""

_M_MMAP_THRESHOLD = -3  # mallopt's parameter number, from glibc's malloc.h


def pin_mmap_threshold() -> bool:
    """Fix glibc's mmap threshold at :data:`MMAP_THRESHOLD` for this process.

    Nothing is changed when the environment already sets ``MALLOC_MMAP_THRESHOLD_``
    (glibc applied that choice at start), or off glibc. Returns whether it was fixed.
    """
    if not sys.platform.startswith("linux") or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 - glibc only: musl's mallopt does nothing
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))
