"""HandlerThreads: the bounded pool of daemon threads that runs plain ``def`` handlers.

A thread cannot be interrupted, so a handler stuck forever keeps its thread forever. The
standard ``ThreadPoolExecutor`` joins its threads when the interpreter exits, and such a
handler would then keep the process alive after the worker stopped; these threads are
daemons, so a process whose worker has stopped (its tasks handed back) exits whatever its
handlers' threads are doing.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["HandlerThreads"]

T = TypeVar("T")

_Work = tuple["concurrent.futures.Future[Any]", Callable[..., Any], tuple[Any, ...], dict[str, Any]]


class HandlerThreads(concurrent.futures.Executor):
    """At most ``max_workers`` daemon threads, started as work arrives, reused when idle."""

    def __init__(self, max_workers: int, thread_name_prefix: str) -> None:
        self._max = max_workers
        self._prefix = thread_name_prefix
        self._work: queue.SimpleQueue[_Work | None] = queue.SimpleQueue()
        self._idle = threading.Semaphore(0)
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._closed = False

    def submit(
        self, fn: Callable[..., T], /, *args: Any, **kwargs: Any
    ) -> concurrent.futures.Future[T]:
        """Run ``fn(*args, **kwargs)`` in a thread of the pool.

        Raises:
            RuntimeError: the pool was shut down.
        """
        with self._lock:
            if self._closed:
                raise RuntimeError("cannot schedule new futures after shutdown")
            future: concurrent.futures.Future[T] = concurrent.futures.Future()
            self._work.put((future, fn, args, kwargs))
            # An idle thread takes it; otherwise start one while the bound allows.
            if not self._idle.acquire(blocking=False) and len(self._threads) < self._max:
                thread = threading.Thread(
                    target=self._serve,
                    name=f"{self._prefix}_{len(self._threads)}",
                    daemon=True,
                )
                thread.start()
                self._threads.append(thread)
            return future

    def _serve(self) -> None:
        while (item := self._work.get()) is not None:
            future, fn, args, kwargs = item
            del item
            if future.set_running_or_notify_cancel():
                try:
                    result = fn(*args, **kwargs)
                except BaseException as exc:  # the caller reads it from the future
                    future.set_exception(exc)
                    del exc
                else:
                    future.set_result(result)
                    del result
            del future, fn, args, kwargs
            self._idle.release()
        self._work.put(None)  # wakes the next thread to stop

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Stop taking work; let each thread end once it is idle (``wait``: join them)."""
        with self._lock:
            self._closed = True
            if cancel_futures:
                while True:
                    try:
                        item = self._work.get_nowait()
                    except queue.Empty:
                        break
                    if item is not None:
                        item[0].cancel()
            self._work.put(None)
        if wait:
            for thread in list(self._threads):
                thread.join()
