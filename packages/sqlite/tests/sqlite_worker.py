"""A separate process for the SQLite store's fault tests: ``python sqlite_worker.py MODE ...``.

Modes (every acknowledgement is one JSON line on stdout, printed only after the call that
it reports returned, i.e. after its transaction committed):

- ``loop PATH JOURNAL T0 SPEED``: tick, claim and relay to a SQLite journal broker, for
  ever (the test SIGKILLs it); prints ``{"ready": 1}``, then ``{"ticked": [ids]}`` and
  ``{"published": id}``.
- ``tickers PATH T0 SPEED STORES``: ``STORES`` stores of its own on the file; prints
  ``{"ready": 1}`` once they are open, then, from a ``go`` line on stdin to a ``stop``
  line (or stdin's end), each ticks in a loop; prints ``{"ticked": [ids]}`` per tick, then
  ``{"errors": [...]}``.
- ``hold PATH``: a plain sqlite3 connection that takes the file's write lock
  (``BEGIN IMMEDIATE``) on each ``hold`` line of stdin and releases it on ``release``,
  answering ``held`` / ``released``.

The clock of ``loop`` and ``tickers`` runs ``SPEED`` times faster than the wall clock
from the wall-clock instant ``T0`` (shared by every process of a test), starting at
``sqlite_support.START``.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import sys
import time
from datetime import datetime, timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from sqlite_support import CONFIG, KEYRING, START, definition
from steeple.brokers.sqlite import SqliteJournalBroker
from steeple.core.errors import RecurringDeadlineError, RecurringError
from steeple.sqlite import SqliteRecurringStore

DEFINITIONS = 10
MINUTES_BACK = 30


class SpedClock:
    """``START`` at wall-clock ``t0``, running ``speed`` times faster since."""

    def __init__(self, t0: float, speed: float) -> None:
        self.t0 = t0
        self.speed = speed

    def now(self) -> datetime:
        return START + timedelta(seconds=(time.time() - self.t0) * self.speed)


def say(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


async def loop(path: str, journal_path: str, t0: float, speed: float) -> None:
    clock = SpedClock(t0, speed)
    store = await SqliteRecurringStore.initialize(path, CONFIG, KEYRING, clock)
    journal = SqliteJournalBroker(journal_path, KEYRING, namespace="faults", clock=clock)
    await journal.start()
    for i in range(DEFINITIONS):
        await store.create(definition(f"d{i}", minutes_back=MINUTES_BACK))  # replays
    say(ready=1)
    while True:
        result = await store.tick(100)
        if result.occurrence_ids:
            say(ticked=list(result.occurrence_ids))
        for lease in await store.claim(20):
            await store.relay(lease, journal)
            say(published=lease.occurrence_id)


async def tickers(path: str, t0: float, speed: float, stores: int) -> None:
    clock = SpedClock(t0, speed)
    opened = [
        await SqliteRecurringStore.connect(path, CONFIG, KEYRING, clock) for _ in range(stores)
    ]
    errors: list[str] = []
    say(ready=1)
    await asyncio.to_thread(sys.stdin.readline)  # "go"
    stop = asyncio.Event()

    async def stop_on_line() -> None:
        await asyncio.to_thread(sys.stdin.readline)  # "stop", or the end of stdin
        stop.set()

    stopper = asyncio.create_task(stop_on_line())

    async def tick(store: SqliteRecurringStore) -> None:
        while not stop.is_set():
            try:
                result = await store.tick(100)
            except RecurringDeadlineError as exc:  # typed, nothing stored: counted
                errors.append(type(exc).__name__)
                continue
            except RecurringError as exc:
                errors.append(f"{type(exc).__name__}: {exc}")
                continue
            if result.occurrence_ids:
                say(ticked=list(result.occurrence_ids))

    async with asyncio.TaskGroup() as group:
        for store in opened:
            group.create_task(tick(store))
    await stopper
    for store in opened:
        await store.close()
    say(errors=errors)


def hold(path: str) -> None:
    conn = sqlite3.connect(path, isolation_level=None, timeout=30)
    for line in sys.stdin:
        if line.strip() == "hold":
            conn.execute("BEGIN IMMEDIATE")
            print("held", flush=True)
        elif line.strip() == "release":
            conn.execute("ROLLBACK")
            print("released", flush=True)
    conn.close()


def main(argv: list[str]) -> None:
    mode, *args = argv
    if mode == "loop":
        asyncio.run(loop(args[0], args[1], float(args[2]), float(args[3])))
    elif mode == "tickers":
        asyncio.run(tickers(args[0], float(args[1]), float(args[2]), int(args[3])))
    elif mode == "hold":
        hold(args[0])
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
