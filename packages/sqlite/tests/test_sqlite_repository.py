"""The SQLite repository's translation: instants to the microsecond, and reads by id in
batches of any size (padded to a few statement shapes)."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta
from pathlib import Path

import attrs
import pytest

from sqlite_support import CONFIG, KEYRING, START, definition
from steeple.engine import DefinitionRow, OccurrenceRow, RecurringRepository
from steeple.sqlite import SqliteRecurringStore
from steeple.sqlite._repository import instant, microseconds
from steeple.testing import FakeClock


@pytest.mark.parametrize(
    "at",
    [
        datetime(1, 1, 1, tzinfo=UTC),
        datetime(1969, 12, 31, 23, 59, 59, 999999, tzinfo=UTC),
        datetime(1970, 1, 1, tzinfo=UTC),
        START,
        datetime(9999, 12, 31, 23, 59, 59, 999998, tzinfo=UTC),
    ],
)
def test_instants_round_trip_to_the_microsecond(at: datetime) -> None:
    us = microseconds(at)
    assert isinstance(us, int)
    assert instant(us) == at
    assert microseconds(at + timedelta(microseconds=1)) == us + 1
    assert microseconds(None) is None
    assert instant(None) is None


async def test_reads_by_id_of_any_batch_size(tmp_path: Path) -> None:
    async with await SqliteRecurringStore.initialize(
        tmp_path / "store.db", CONFIG, KEYRING, FakeClock(START)
    ) as store:
        for i in range(10):
            await store.create(definition(f"d{i}", minutes_back=60))
        ids: list[str] = []
        while result := (await store.tick(100)).occurrence_ids:
            ids.extend(result)
        assert len(ids) == 600
        rng = random.Random(5)
        unknown = ["f" * 32, "0" * 32]
        for size in (0, 1, 2, 3, 7, 64, 100, 511, 512, 513, 600):
            wanted = rng.sample(ids, size)
            asked = wanted + unknown + wanted[:3]  # unknown ids and repeats are ignored

            async def read(
                repo: RecurringRepository, asked: list[str] = asked
            ) -> list[OccurrenceRow]:
                return list(await repo.occurrences(asked))

            rows = await store._storage.transaction("read", read)
            assert sorted(r.occurrence_id for r in rows) == sorted(wanted)
            assert all(r.content is not None and r.key_id == "k1" for r in rows)


async def test_definitions_are_read_by_name_and_inserted_in_batches(tmp_path: Path) -> None:
    async with await SqliteRecurringStore.initialize(
        tmp_path / "store.db", CONFIG, KEYRING, FakeClock(START)
    ) as store:
        names = [f"d{i}" for i in range(8)]
        for name in names[:5]:
            await store.create(definition(name))

        async def copy_three(repo: RecurringRepository) -> list[DefinitionRow]:
            # Three new rows in one call, made from stored ones under new names.
            rows = list(await repo.definitions_named(names[:3]))
            await repo.insert_definitions(
                [attrs.evolve(r, name=n) for r, n in zip(rows, names[5:], strict=True)]
            )
            return rows

        await store._storage.transaction("insert", copy_three)
        for asked in ([], names[:1], names, [*names, "missing", names[0]]):

            async def read(
                repo: RecurringRepository, asked: list[str] = asked
            ) -> list[DefinitionRow]:
                return list(await repo.definitions_named(asked))

            rows = await store._storage.transaction("read", read)
            assert sorted(r.name for r in rows) == sorted(n for n in set(asked) if n in names)
