"""A worker process for the crash-point matrix (``test_fault_crash_points*.py``).

``python crash_worker.py recurring DSN SCHEMA JOURNAL LEASES MODE`` runs the recurring
relay: ``batched`` is :class:`RecurringRelay` (claim_and_relay), ``stepwise`` is tick,
claim, relay_many with each claimed lease written (fsynced) to LEASES before it is relayed,
so the test can try the dead worker's leases afterwards (they must be fenced).

``python crash_worker.py queue DSN SCHEMA JOURNAL`` runs a queue worker whose handler
appends each execution to JOURNAL (fsynced) before it returns; a task whose args say
``{"fail_first": true}`` fails its first attempt with a retry.

Both print ``ready`` once connected and stop on SIGTERM. The crash points are armed by the
environment (``STEEPLE_CRASH_AT``/``STEEPLE_CRASH_PAUSE``, see steeple.runtime.crashpoints).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from datetime import timedelta
from typing import Any

from steeple.core import RecurringConfig, ScheduledMessage, SystemClock
from steeple.core.errors import RecurringClockError, RecurringStorageError
from steeple.core.messages import BrokerReceipt
from steeple.engine.crashpoints import crash_point

KEY_BYTES = b"\x0c" * 32
CONFIG = RecurringConfig(
    "crash", 10, 1000, lease_duration=timedelta(seconds=1), delivery_window=timedelta(hours=1)
)


def append(path: str, record: list[Any]) -> None:
    """Append one JSON line to ``path`` and make it durable before returning."""
    with open(path, "a", encoding="utf-8") as out:
        out.write(json.dumps(record) + "\n")
        out.flush()
        os.fsync(out.fileno())


class FileBroker:
    """Accepts a publication by appending (key, payload, pid) durably to a journal."""

    def __init__(self, path: str) -> None:
        self.path = path

    async def publish(
        self, message: ScheduledMessage, *, idempotency_key: str, timeout: float
    ) -> BrokerReceipt:
        append(self.path, [idempotency_key, message.payload.decode(), os.getpid()])
        # Stored, not yet confirmed: the "mid-publish" crash point.
        crash_point("relay.broker_accepted")
        return BrokerReceipt("file", idempotency_key)


def _stop_on_sigterm() -> asyncio.Event:
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    return stop


async def recurring(dsn: str, schema: str, journal: str, leases: str, mode: str) -> None:
    from steeple.keyring import Keyring, StorageKey
    from steeple.postgres import PostgresRecurringStore, RecurringRelay

    stop = _stop_on_sigterm()
    store = await PostgresRecurringStore.connect(
        dsn, CONFIG, Keyring(StorageKey("k1", KEY_BYTES)), SystemClock(), schema=schema
    )
    broker = FileBroker(journal)
    async with store:
        print("ready", flush=True)
        if mode == "batched":
            relay = RecurringRelay(store, broker, tick_budget=3, claim_limit=3, idle_interval=0.05)
            await relay.run(stop)
            return
        while not stop.is_set():
            try:
                await store.tick(3)
                claimed = await store.claim(3)
                for lease in claimed:
                    append(
                        leases,
                        [lease.occurrence_id, lease.revision, lease.capability.hex(), os.getpid()],
                    )
                await store.relay_many(claimed, broker)
            except (RecurringStorageError, RecurringClockError):
                claimed = []
            if not claimed:
                try:
                    async with asyncio.timeout(0.05):
                        await stop.wait()
                except TimeoutError:
                    pass


async def queue(dsn: str, schema: str, journal: str) -> None:
    import asyncpg

    from steeple.postgres.queue import JobContext, JobError, Scheduler, Task

    stop = _stop_on_sigterm()
    pool = await asyncpg.create_pool(
        dsn, min_size=1, max_size=6, server_settings={"application_name": "steeple-queue"}
    )
    worker = Scheduler(
        pool,
        worker_id=f"crash-{os.getpid()}",
        schema=schema,
        poll_interval=0.1,
        maintenance_interval=0.2,
        concurrency=4,
        batch_size=2,
    )

    async def handler(ctx: JobContext, args: Any) -> None:
        await asyncio.sleep(args.get("sleep", 0))
        append(journal, [ctx.task_id, str(ctx.run_id), ctx.attempt, os.getpid()])
        if args.get("fail_first") and ctx.attempt == 1:
            raise JobError.retry("first attempt fails", timedelta(0))

    worker.register(Task("crash"), handler)
    print("ready", flush=True)
    await worker.run_until_shutdown(stop, drain_timeout=5)
    await pool.close()


def main(argv: list[str]) -> None:
    kind, *args = argv
    if kind == "recurring":
        asyncio.run(recurring(*args))
    else:
        asyncio.run(queue(*args))


if __name__ == "__main__":
    main(sys.argv[1:])
