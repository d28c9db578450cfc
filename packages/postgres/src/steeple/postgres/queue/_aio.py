"""Small asyncio waits shared by the worker's loops."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

__all__ = ["wait_any", "wait_either", "wait_event"]


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


async def wait_any(
    events: tuple[asyncio.Event, ...], stop_waiter: asyncio.Future[Any], timeout: float | None
) -> None:
    """Wait until any of ``events`` is set, ``stop_waiter`` is done, or ``timeout`` passes."""
    if stop_waiter.done() or any(e.is_set() for e in events):
        return
    waiters = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(
            {*waiters, stop_waiter}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
        )
    finally:
        for waiter in waiters:
            waiter.cancel()
