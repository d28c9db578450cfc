"""Cancel an operation at its k-th suspension point, for every k (RELIABILITY row 15).

:func:`cancel_at` runs a coroutine in its own task through a thin driver that counts the
times the coroutine really suspends (yields a future to the event loop: an ``await`` that
finished at once is no suspension). At the k-th one it cancels the task with
``Task.cancel()`` before handing the future to the task, so the real cancellation path
runs: the awaited future is cancelled and ``CancelledError`` is raised at that ``await``,
inside whatever driver call, lock wait or commit the operation was in.

:func:`every_suspension` calls it for k = 1, 2, ... until the operation completes before
reaching k, so every suspension point of that run is cut once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine, Generator
from typing import Any, TypeVar

import attrs

T = TypeVar("T")

_LIMIT = 2000  # far above any operation here: a loop that never ends is a bug


@attrs.define
class Cut:
    """What happened when an operation was cancelled at its k-th suspension."""

    k: int
    suspensions: int = 0
    completed: bool = False
    """It returned (after absorbing the cancellation when ``suspensions >= k``)."""
    cancelled: bool = False
    error: BaseException | None = None


class _Counting:
    def __init__(
        self,
        coro: Coroutine[Any, Any, Any],
        k: int,
        cut: Cut,
        gate: asyncio.Future[None] | None = None,
        paused: asyncio.Event | None = None,
    ) -> None:
        self._coro = coro
        self._k = k
        self._cut = cut
        self._gate = gate
        self._paused = paused

    def __await__(self) -> Generator[Any, Any, Any]:
        coro = self._coro
        value: Any = None
        error: BaseException | None = None
        while True:
            try:
                yielded = coro.throw(error) if error is not None else coro.send(value)
            except StopIteration as stop:
                return stop.value
            self._cut.suspensions += 1
            if self._cut.suspensions == self._k and self._gate is not None:
                # Paused here (between its awaits, its I/O in flight) until the gate opens.
                assert self._paused is not None
                self._paused.set()
                self._gate._asyncio_future_blocking = True
                yield self._gate
            elif self._cut.suspensions == self._k:
                task = asyncio.current_task()
                assert task is not None
                task.cancel()
            try:
                value, error = (yield yielded), None
            except BaseException as exc:  # delivered at the await: pass it on
                value, error = None, exc


async def cancel_at(k: int, operation: Callable[[], Coroutine[Any, Any, Any]]) -> Cut:
    """Run ``operation()`` in a task, cancelled at its ``k``-th suspension."""
    cut = Cut(k)

    async def driven() -> Any:
        return await _Counting(operation(), k, cut)

    task = asyncio.create_task(driven())
    try:
        await task
    except asyncio.CancelledError:
        if asyncio.current_task().cancelling():  # type: ignore[union-attr]
            raise  # the test itself is being cancelled
        cut.cancelled = True
    except Exception as exc:
        cut.error = exc
    else:
        cut.completed = True
    return cut


async def every_suspension(
    operation: Callable[[], Coroutine[Any, Any, Any]],
    check: Callable[[Cut], Awaitable[None]],
    prepare: Callable[[], Awaitable[None]] | None = None,
) -> list[Cut]:
    """Cut ``operation`` at k = 1, 2, ... until it completes first; ``check`` after each.

    ``prepare`` (awaited before each run) sets up fresh state for the operation.
    Returns every cut (the last one completed).
    """
    cuts: list[Cut] = []
    for k in range(1, _LIMIT):
        if prepare is not None:
            await prepare()
        cut = await cancel_at(k, operation)
        cuts.append(cut)
        await check(cut)
        if cut.error is not None:
            raise AssertionError(f"cancelled at suspension {k}: raised {cut.error!r}")
        if cut.completed and cut.suspensions < k:
            return cuts
        # Cancelled; or completed though cancelled (a shielded step absorbed it: checked
        # like any other outcome, and the next k goes on past it).
        assert cut.cancelled or cut.completed, cut
    raise AssertionError("the operation never completed")


class Paused:
    """An operation running in its own task, held at its k-th suspension until released."""

    def __init__(self, k: int, operation: Callable[[], Coroutine[Any, Any, Any]]) -> None:
        self.cut = Cut(k)
        self.paused = asyncio.Event()
        self._gate: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        counting = _Counting(operation(), k, self.cut, self._gate, self.paused)

        async def driven() -> Any:
            return await counting

        self.task: asyncio.Task[Any] = asyncio.create_task(driven())

    async def reached(self) -> bool:
        """Wait until it is paused (True) or finished without reaching k (False)."""
        waiter = asyncio.ensure_future(self.paused.wait())
        try:
            await asyncio.wait({waiter, self.task}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
        return self.paused.is_set()

    def release(self) -> None:
        """Let it go on."""
        if not self._gate.done():
            self._gate.set_result(None)
