"""A relay whose lease lapsed, let go while a newer claim holds the occurrence: fenced.

A relay process claims the one due occurrence and freezes at a named step of ``relay``
(``STEEPLE_CRASH_PAUSE``: the whole process stops), before its check step or after the
broker accepted its publication, just before its record step. Past its lease a second
relay claims the occurrence (the next revision) and holds it, unpublished. Then the first
is let go: its stale lease must be refused with ``RelayLeaseLostError`` at the step it
reaches, the row must not change at all (no attempt counted, no publication recorded),
and a stale check must send nothing to the broker. The second relay then publishes under
the occurrence's one idempotency key.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from crash_matrix import read_lines
from crash_worker import KEY_BYTES, FileBroker
from pg_cluster import poll
from steeple.core import (
    MissedRunPolicy,
    RecurringConfig,
    RecurringDefinition,
    ScheduledMessage,
    SystemClock,
)
from steeple.core.records import Lease
from steeple.keyring import Keyring, StorageKey
from steeple.postgres import PostgresRecurringStore

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

KEYRING = Keyring(StorageKey("k1", KEY_BYTES))
HERE = str(Path(__file__).resolve().parent)  # where the relay process imports crash_worker
# Long enough that the second relay's lease outlives the first one's late step; short
# enough that the first one's lapses quickly while it is frozen.
CONFIG = RecurringConfig(
    "stale", 10, 1000, lease_duration=timedelta(seconds=3), delivery_window=timedelta(hours=1)
)

# The first relay: claims one occurrence, relays it, prints what ``relay`` did.
STALE_RELAY = """
import asyncio, sys
from datetime import timedelta

sys.path.insert(0, sys.argv[5])
from crash_worker import KEY_BYTES, FileBroker
from steeple.core import RecurringConfig, SystemClock
from steeple.keyring import Keyring, StorageKey
from steeple.postgres import PostgresRecurringStore


async def main(dsn, schema, journal, lease_ms):
    config = RecurringConfig(
        "stale", 10, 1000, lease_duration=timedelta(milliseconds=int(lease_ms)),
        delivery_window=timedelta(hours=1),
    )
    keyring = Keyring(StorageKey("k1", KEY_BYTES))
    store = await PostgresRecurringStore.connect(
        dsn, config, keyring, SystemClock(), schema=schema
    )
    async with store:
        [lease] = await store.claim(1)
        print("claimed", lease.revision, flush=True)
        try:
            await store.relay(lease, FileBroker(journal))
        except Exception as exc:
            print("outcome", type(exc).__name__, flush=True)
        else:
            print("outcome published", flush=True)


asyncio.run(main(*sys.argv[1:5]))
"""


async def _row(dsn: str, schema: str) -> dict[str, Any]:
    conn = await asyncpg.connect(dsn, timeout=10)
    try:
        [row] = await conn.fetch(f'SELECT * FROM "{schema}".recurring_occurrences')
    finally:
        await conn.close()
    return dict(row)


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("point", "sent_by_stale"),
    [("relay.check.begin", 0), ("relay.record.begin", 1)],
    ids=["at-the-check-step", "at-the-record-step"],
)
async def test_a_stale_relay_let_go_while_a_newer_claim_holds_the_occurrence_is_fenced(
    pg_schema: tuple[str, str], tmp_path: Path, point: str, sent_by_stale: int
) -> None:
    dsn, schema = pg_schema
    journal = tmp_path / "broker.jsonl"
    journal.touch()
    store = await PostgresRecurringStore.initialize(
        dsn, CONFIG, KEYRING, SystemClock(), schema=schema
    )
    proc: asyncio.subprocess.Process | None = None
    try:
        now = SystemClock().now()
        # Coalesce: exactly one occurrence, whatever the minute.
        await store.create(
            RecurringDefinition(
                "m",
                "* * * * *",
                now - timedelta(minutes=10),
                MissedRunPolicy.COALESCE,
                ScheduledMessage("stale", "stale.run", b"p"),
            )
        )
        assert (await store.tick(10)).materialized == 1
        os.mkfifo(tmp_path / "release")
        env = {k: v for k, v in os.environ.items() if not k.startswith("STEEPLE_CRASH")}
        env.update(STEEPLE_CRASH_PAUSE=point, STEEPLE_CRASH_DIR=str(tmp_path))
        lease_ms = str(CONFIG.lease_duration // timedelta(milliseconds=1))
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            STALE_RELAY,
            dsn,
            schema,
            str(journal),
            lease_ms,
            HERE,
            env=env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 60)
        assert line.split() == [b"claimed", b"1"], (line, proc.returncode)
        paused = tmp_path / "paused"

        async def frozen() -> bool:
            return paused.exists()

        await poll(f"the first relay to pause at {point}", frozen, timeout=60)
        assert paused.read_text() == point
        assert len(read_lines(journal)) == sent_by_stale

        # Past the frozen relay's lease, the second relay claims: the next revision.
        taken: list[Lease] = []

        async def claimed() -> bool:
            taken[:] = await store.claim(1)
            return bool(taken)

        await poll("the second relay to claim the lapsed lease", claimed, timeout=60)
        [lease] = taken
        assert lease.revision == 2
        held = await _row(dsn, schema)
        assert (held["state"], held["lease_revision"]) == ("leased", 2)

        # The stale relay goes on while the second holds the occurrence, unpublished.
        await asyncio.to_thread((tmp_path / "release").write_text, "go")
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 0, err.decode()
        assert out.decode().split()[-2:] == ["outcome", "RelayLeaseLostError"], out.decode()
        # Nothing recorded: not an attempt, not the publication, not a failure.
        assert await _row(dsn, schema) == held
        assert len(read_lines(journal)) == sent_by_stale

        receipt = await store.relay(lease, FileBroker(str(journal)))
        row = await _row(dsn, schema)
        assert (row["state"], row["lease_revision"]) == ("published", 2)
        keys = [json.loads(entry)[0] for entry in read_lines(journal)]
        assert len(keys) == sent_by_stale + 1
        assert set(keys) == {receipt.idempotency_key}
    finally:
        if proc is not None and proc.returncode is None:
            proc.kill()
            await proc.wait()
        await store.close()
