"""Crash points of the recurring store, systematically (RELIABILITY rows 1, 2, 3, 12).

For each named crash point of tick, claim and relay (steeple.engine.crashpoints), a relay
worker process either SIGKILLs itself there, or freezes there while the PostgreSQL server
under it is restarted with ``pg_ctl -m immediate`` and is then let go. A fresh worker then
finishes the work. After each scenario the checker asserts:

- no occurrence lost: every due instant of every definition is materialized once and
  ends published, and reached the broker;
- no publication under a different key: the broker's journal holds exactly the keys
  derived from the stored occurrences (one per occurrence, repeats only of that key);
- fencing while the work is taken over: once a killed worker's leases have lapsed, a new
  claim takes its unpublished occurrences and, while it holds them (before it publishes),
  the dead worker's lease for each is refused by ``relay`` with ``RelayLeaseLostError``:
  nothing reaches the broker and the row does not change;
- fencing afterwards: every lease the crashed worker had claimed is refused by ``relay``
  (nothing published), and one whose occurrence it had not published was re-claimed
  under a higher revision;
- no session of the store left idle in transaction; a frozen worker that was let go
  survived the restart and stops cleanly.

The matrix is sampled per run (see ``crash_matrix``); ``nox -s crashmatrix`` runs it all.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from crash_matrix import SEED, Crashing, idle_in_transaction, read_lines, reproduce, sample
from crash_worker import CONFIG, KEY_BYTES, FileBroker
from pg_cluster import Cluster, Clusters, poll
from steeple.core import (
    MissedRunPolicy,
    RecurringDefinition,
    RelayLeaseLostError,
    ScheduledMessage,
    SystemClock,
)
from steeple.core.idempotency import PUBLISH_PURPOSE, idempotency_key
from steeple.core.records import Lease
from steeple.keyring import Keyring, StorageKey
from steeple.postgres import PostgresRecurringStore, RecurringRelay
from steeple.runtime.crashpoints import CRASH_POINTS

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

KEYRING = Keyring(StorageKey("k1", KEY_BYTES))
DEFINITIONS = ("alpha", "beta")
CATCH_UP_MINUTES = 4


def _modes(point: str) -> list[str]:
    if point.startswith("tick"):
        return ["batched"]
    if point.startswith("relay.check"):
        return ["stepwise"]  # claim_and_relay checks inside its claim transaction
    return ["stepwise", "batched"]


RECURRING = [
    (point, mode)
    for point in CRASH_POINTS
    if not point.startswith("queue.")
    for mode in _modes(point)
]
KILLS = sample(RECURRING, 4, "recurring-kill")
RESTARTS = sample(RECURRING, 3, "recurring-restart")


def _ids(scenario: tuple[str, str]) -> str:
    return f"{scenario[0]}-{scenario[1]}-seed{SEED}"


@pytest.fixture(scope="module")
def private_server() -> Iterator[Cluster]:
    """One private cluster for the module's restart scenarios (each uses its own schema)."""
    clusters = Clusters()
    try:
        yield clusters.new("crash")
    finally:
        clusters.cleanup()


@pytest.fixture
async def private_schema(
    private_server: Cluster, pg_name: Any
) -> AsyncIterator[tuple[str, str, Cluster]]:
    """A schema on the private cluster, dropped afterwards."""
    schema = pg_name("crash")
    dsn = private_server.dsn()
    conn = await asyncpg.connect(dsn, timeout=30)
    try:
        await conn.execute(f'CREATE SCHEMA "{schema}"')
    finally:
        await conn.close()
    try:
        yield dsn, schema, private_server
    finally:
        conn = await asyncpg.connect(dsn, timeout=30)
        try:
            await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        finally:
            await conn.close()


async def _prepare(dsn: str, schema: str) -> dict[str, list[datetime]]:
    """Initialize the store with definitions that owe a few minutes of catch-up."""
    now = datetime.now(UTC)
    start = now.replace(second=0, microsecond=0) - timedelta(minutes=CATCH_UP_MINUTES)
    store = await PostgresRecurringStore.initialize(
        dsn, CONFIG, KEYRING, SystemClock(), schema=schema
    )
    async with store:
        for name in DEFINITIONS:
            await store.create(
                RecurringDefinition(
                    name,
                    "* * * * *",
                    start,
                    MissedRunPolicy.CATCH_UP,
                    ScheduledMessage("crash", "tick", name.encode()),
                )
            )
    owed = [start + timedelta(minutes=m) for m in range(1, CATCH_UP_MINUTES + 1)]
    return {name: owed for name in DEFINITIONS}


async def _rows(dsn: str, schema: str) -> dict[str, tuple[str, datetime, str, int]]:
    """occurrence id -> (definition, due, state, lease revision)."""
    conn = await asyncpg.connect(dsn, timeout=30)
    try:
        rows = await conn.fetch(
            f"SELECT id, definition_name, due_at, state, lease_revision "
            f'FROM "{schema}".recurring_occurrences'
        )
    finally:
        await conn.close()
    return {
        r["id"]: (r["definition_name"], r["due_at"], r["state"], r["lease_revision"]) for r in rows
    }


async def _finish(dsn: str, schema: str, journal: Path, owed: dict[str, list[datetime]]) -> None:
    """A fresh worker (in this process) relays until everything owed is published.

    The definitions are due every minute by the system clock, so the round running when
    the poll saw everything published may tick the next minute before it stops: the worker
    is stopped, then everything is looked at again, and it goes on until nothing is left.
    """
    store = await PostgresRecurringStore.connect(dsn, CONFIG, KEYRING, SystemClock(), schema=schema)
    wanted = {(name, due) for name, dues in owed.items() for due in dues}

    async def published() -> bool:
        rows = (await _rows(dsn, schema)).values()
        done = {(name, due) for name, due, state, _ in rows if state == "published"}
        return wanted <= done and all(r[2] == "published" for r in rows)

    async with store:
        for _ in range(5):
            stop = asyncio.Event()
            relay = RecurringRelay(
                store, FileBroker(str(journal)), tick_budget=3, claim_limit=3, idle_interval=0.05
            )
            runner = asyncio.create_task(relay.run(stop))

            async def done(runner: asyncio.Task[None] = runner) -> bool:
                if runner.done():
                    runner.result()  # raises what stopped it
                return await published()

            try:
                await poll("the fresh worker to publish everything", done, timeout=90)
            finally:
                stop.set()
                await runner
            if await published():
                return
    raise AssertionError(f"occurrences still unpublished after five rounds: {reproduce()}")


async def _probe_while_taken_over(
    dsn: str,
    schema: str,
    journal: Path,
    leases: Path,
    at_crash: dict[str, tuple[str, datetime, str, int]],
) -> int:
    """Take over the killed worker's unpublished occurrences and, while the new claim holds
    them, present each of the dead worker's leases to ``relay``: refused, nothing sent,
    nothing recorded. Then publish what was taken. Return how many stale leases were probed
    while their new holder was live (its own relay, right after, succeeded).

    The new claim's lease is as short as the worker's (the configuration is bound to the
    namespace), so a round whose claim lapsed before its relay is simply taken again.
    """
    stale = [json.loads(line) for line in read_lines(leases)]
    owed = {lease[0] for lease in stale if at_crash[lease[0]][2] == "leased"}
    if not owed:
        return 0
    probe = FileBroker(str(journal.with_name("takeover-probe.jsonl")))
    broker = FileBroker(str(journal))
    probed = 0
    store = await PostgresRecurringStore.connect(dsn, CONFIG, KEYRING, SystemClock(), schema=schema)
    async with store:

        async def taken_over() -> bool:
            nonlocal probed
            taken = {lease.occurrence_id: lease for lease in await store.claim(10)}
            before = await _rows(dsn, schema)
            tried: set[str] = set()
            for occurrence_id, revision, capability, _pid in stale:
                holder = taken.get(occurrence_id)
                if holder is None:
                    continue
                assert holder.revision > revision, (occurrence_id, reproduce())
                old = Lease(
                    occurrence_id,
                    datetime.now(UTC) + timedelta(hours=1),
                    revision,
                    bytes.fromhex(capability),
                )
                with pytest.raises(RelayLeaseLostError):
                    await store.relay(old, probe)
                tried.add(occurrence_id)
            after = await _rows(dsn, schema)
            assert {o: after[o] for o in tried} == {o: before[o] for o in tried}, reproduce()
            assert not read_lines(journal.with_name("takeover-probe.jsonl")), reproduce()
            for occurrence_id, lease in taken.items():
                try:
                    await store.relay(lease, broker)
                except RelayLeaseLostError:
                    continue  # lapsed before its turn: claimed again next round
                owed.discard(occurrence_id)
                probed += occurrence_id in tried
            return not owed

        await poll("the dead worker's occurrences to be taken over", taken_over, timeout=90)
    return probed


async def _check(
    dsn: str,
    schema: str,
    journal: Path,
    leases: Path,
    owed: dict[str, list[datetime]],
    at_crash: dict[str, tuple[str, datetime, str, int]],
    how: str,
) -> None:
    rows = await _rows(dsn, schema)
    # nothing lost, nothing materialized twice
    pairs = [(name, due) for name, due, _, _ in rows.values()]
    assert len(pairs) == len(set(pairs))
    for name, dues in owed.items():
        assert set(dues) <= {due for n, due in pairs if n == name}, (name, reproduce())
    assert {state for _, _, state, _ in rows.values()} == {"published"}, reproduce()
    # each occurrence reached the broker, only ever under its own key
    expected = {
        idempotency_key(
            purpose=PUBLISH_PURPOSE,
            namespace=CONFIG.namespace,
            definition_name=name,
            due_at=due,
            generation=bytes.fromhex(occurrence_id),
        ): name
        for occurrence_id, (name, due, _, _) in rows.items()
    }
    published = [json.loads(line) for line in read_lines(journal)]
    assert {key for key, _, _ in published} == set(expected), reproduce()
    assert all(expected[key] == payload for key, payload, _ in published)
    # whatever the dead worker held when it died was re-claimed under a higher revision
    if how == "kill":
        for occurrence_id, (_, _, state, revision) in at_crash.items():
            if state == "leased":
                assert rows[occurrence_id][3] > revision, (occurrence_id, reproduce())
    # the crashed worker's leases are fenced: refused, nothing published
    store = await PostgresRecurringStore.connect(dsn, CONFIG, KEYRING, SystemClock(), schema=schema)
    probe = FileBroker(str(journal.with_name("probe.jsonl")))
    async with store:
        for line in read_lines(leases):
            occurrence_id, revision, capability, _pid = json.loads(line)
            old = Lease(
                occurrence_id,
                datetime.now(UTC) + timedelta(hours=1),
                revision,
                bytes.fromhex(capability),
            )
            with pytest.raises(RelayLeaseLostError):
                await store.relay(old, probe)
            # A dead worker's unpublished occurrence was re-claimed: a higher revision.
            # (A frozen worker let go may go on to publish its own leases itself.)
            if how == "kill" and at_crash[occurrence_id][2] != "published":
                assert rows[occurrence_id][3] > revision, (occurrence_id, reproduce())
    assert not read_lines(journal.with_name("probe.jsonl"))


async def _scenario(
    dsn: str, schema: str, tmp_path: Path, point: str, mode: str, how: str, cluster: Cluster | None
) -> int:
    """Run one crash scenario and check it; return how many stale leases were probed while
    taken over (kills only)."""
    owed = await _prepare(dsn, schema)
    journal = tmp_path / "broker.jsonl"
    journal.touch()
    leases = tmp_path / "leases.jsonl"
    worker = Crashing(how, point, tmp_path)
    await worker.start("recurring", dsn, schema, str(journal), str(leases), mode)
    seen: dict[str, Any] = {}

    async def snapshot() -> None:
        seen["rows"] = await _rows(dsn, schema)

    probed = 0
    try:
        await worker.crash(cluster, snapshot)
        if how == "kill":
            probed = await _probe_while_taken_over(dsn, schema, journal, leases, seen["rows"])
        await _finish(dsn, schema, journal, owed)
    finally:
        code = await worker.finish()
    if how == "restart":
        assert code == 0, (code, await worker.stderr(), reproduce())
    # The surviving worker may have ticked a new minute before its SIGTERM: published now,
    # with nothing else running, so the check sees a settled store.
    await _finish(dsn, schema, journal, owed)
    await _check(dsn, schema, journal, leases, owed, seen["rows"], how)
    assert await idle_in_transaction(dsn, "steeple-recurring", schema) == 0
    return probed


@pytest.mark.timeout(900)
@pytest.mark.parametrize("scenario", KILLS, ids=_ids)
async def test_sigkill_at_a_crash_point_loses_and_repeats_nothing(
    scenario: tuple[str, str], pg_schema: tuple[str, str], tmp_path: Path
) -> None:
    dsn, schema = pg_schema
    point, mode = scenario
    await _scenario(dsn, schema, tmp_path, point, mode, "kill", None)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("scenario", RESTARTS, ids=_ids)
async def test_immediate_restart_at_a_crash_point_loses_and_repeats_nothing(
    scenario: tuple[str, str], private_schema: tuple[str, str, Cluster], tmp_path: Path
) -> None:
    dsn, schema, cluster = private_schema
    point, mode = scenario
    await _scenario(dsn, schema, tmp_path, point, mode, "restart", cluster)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("point", ["relay.check.committed", "relay.record.begin"])
async def test_a_killed_relays_leases_are_fenced_while_another_claim_holds_them(
    point: str, pg_schema: tuple[str, str], tmp_path: Path
) -> None:
    """Killed between checking its leases and publishing, or after publishing and before
    recording: its unpublished occurrences are taken over, and its leases are refused while
    the new claim still holds them (every scenario, not a sample)."""
    dsn, schema = pg_schema
    probed = await _scenario(dsn, schema, tmp_path, point, "stepwise", "kill", None)
    assert probed >= 1, reproduce()
