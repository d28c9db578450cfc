"""Small asyncio waits shared by the worker's loops."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

__all__ = ["wait_either", "wait_event"]


async def wait_event(event: asyncio.Event, timeout: float) -> bool:
    """Wait for ``event`` at most ``timeout`` seconds; return whether it is set."""
    if event.is_set():
        return True
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout):
            await event.wait()
    return event.is_set()


async def wait_either(
    event: asyncio.Event, stop_waiter: asyncio.Future[Any], timeout: float | None
) -> None:
    """Wait until ``event`` is set, ``stop_waiter`` is done, or ``timeout`` seconds pass."""
    if event.is_set() or stop_waiter.done():
        return
    waiter = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait(
            {waiter, stop_waiter}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
        )
    finally:
        waiter.cancel()
