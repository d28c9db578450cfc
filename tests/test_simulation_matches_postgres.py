"""The simulator runs the same domain as production: one scenario, two stores, equal outcomes.

The scenario is driven once through the in-memory reference store (what ``steeple
simulate`` uses) and once through the real PostgreSQL store, the relay workers running
the worker's batched claim-and-relay rounds on both (sealed with a real keyring,
on the same fake clock, seed and broker model), and every occurrence must end the same:
due instant, state, attempts, when it was materialized and when it was published.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import asyncpg
import pytest

from steeple.core import (
    MissedRunPolicy,
    RecurringConfig,
    RecurringDefinition,
    ScheduledMessage,
)
from steeple.core.occurrences import OccurrenceState
from steeple.core.ports import Clock, RandomSource, RecurringStore
from steeple.keyring import Keyring, StorageKey
from steeple.postgres import PostgresRecurringStore
from steeple.testing import MemoryBroker
from steeple.testing.simulation import (
    BrokerModel,
    ClockRegression,
    Interval,
    RelayCapacity,
    Scenario,
    Ticking,
    simulate,
)

START = datetime(2026, 1, 31, 12, 0, 7, tzinfo=UTC)


def scenario() -> Scenario:
    """A 6-hour outage of a catch-up and a coalesce definition, a broker outage long
    enough to dead-letter, a lost acknowledgement or two, and a clock step back of 3 s."""
    message = ScheduledMessage("jobs", "job.run", b'{"n": 1}', {"trace": "t"})
    return Scenario(
        RecurringConfig(
            "proof",
            10,
            1000,
            delivery_window=timedelta(hours=4),
            lease_duration=timedelta(seconds=30),
        ),
        [
            RecurringDefinition(
                "hourly-catch-up", "0 * * * *", START, MissedRunPolicy.CATCH_UP, message
            ),
            RecurringDefinition(
                "quarter-coalesce", "*/15 * * * *", START, MissedRunPolicy.COALESCE, message
            ),
        ],
        START,
        START + timedelta(hours=20),
        ticking=Ticking(interval=timedelta(seconds=1), budget=4),
        relay=RelayCapacity(workers=2, rate=2.0, claim_limit=3),
        broker=BrokerModel(
            outages=[Interval.parse("2026-01-31T14:20Z/PT30M")],
            ack_loss_rate=0.1,
        ),
        host_outages=[Interval.parse("2026-01-31T22:00Z/PT6H")],
        clock_regressions=[
            ClockRegression(
                datetime(2026, 2, 1, 4, 0, 30, 250_000, tzinfo=UTC), timedelta(seconds=3)
            )
        ],
        sample_interval=timedelta(minutes=30),
    )


@pytest.mark.postgres
async def test_the_simulator_and_the_postgres_store_end_every_occurrence_alike(
    pg_schema: tuple[str, str],
) -> None:
    dsn, schema = pg_schema
    keyring = Keyring(StorageKey.generate("sim-proof"))

    async def postgres(
        config: RecurringConfig, clock: Clock, random: RandomSource
    ) -> RecurringStore:
        return await PostgresRecurringStore.initialize(
            dsn, config, keyring, clock, schema=schema, random=random
        )

    memory_side, postgres_side = MemoryBroker(), MemoryBroker()
    simulated = await simulate(scenario(), seed=7, broker=memory_side, trace=True)
    real = await simulate(scenario(), seed=7, store=postgres, broker=postgres_side, trace=True)

    assert simulated.occurrences is not None
    assert real.occurrences is not None
    # The scenario reaches every path it is meant to.
    states = {o.state for o in simulated.occurrences}
    assert {OccurrenceState.PUBLISHED, OccurrenceState.DEAD} <= states
    assert simulated.hits.acknowledgements_lost > 0
    assert simulated.hits.duplicates > 0
    caught_up = [
        o
        for o in simulated.occurrences
        if o.definition_name == "hourly-catch-up"
        and datetime(2026, 1, 31, 22, tzinfo=UTC) <= o.due_at < datetime(2026, 2, 1, 4, tzinfo=UTC)
    ]
    assert len(caught_up) == 6
    assert all(o.materialized_at == datetime(2026, 2, 1, 4, tzinfo=UTC) for o in caught_up)
    # Coalesce: the oldest missed due instant once, at the restart; then on schedule.
    coalesced = [
        o.due_at
        for o in simulated.occurrences
        if o.definition_name == "quarter-coalesce"
        and datetime(2026, 1, 31, 21, 45, tzinfo=UTC)
        <= o.due_at
        <= datetime(2026, 2, 1, 4, 15, tzinfo=UTC)
    ]
    assert coalesced == [
        datetime(2026, 1, 31, 21, 45, tzinfo=UTC),
        datetime(2026, 1, 31, 22, tzinfo=UTC),
        datetime(2026, 2, 1, 4, 15, tzinfo=UTC),
    ]

    # The clock stepped back 3 s after the restart: adopted (no clock error), and from
    # then on the host's clock reads 3 s behind, so work falls due 3 s later in real time.
    assert simulated.hits.clock_errors == 0
    after_step = next(
        o
        for o in simulated.occurrences
        if o.definition_name == "quarter-coalesce"
        and o.due_at == datetime(2026, 2, 1, 4, 15, tzinfo=UTC)
    )
    assert after_step.materialized_at == datetime(2026, 2, 1, 4, 15, tzinfo=UTC)
    # Relayed as the worker relays, in one batch with its claim; acknowledged after the
    # broker's half-second latency.
    assert after_step.published_at == datetime(2026, 2, 1, 4, 15, 3, 500_000, tzinfo=UTC)
    # The relay workers ran batched claim-and-relay rounds (some of several leases), on
    # both sides alike.
    assert simulated.hits.relays > simulated.hits.claims

    # Same due instants, states, attempts, materialization and publication instants.
    assert [o.to_json() for o in real.occurrences] == [o.to_json() for o in simulated.occurrences]
    assert real.to_json() == simulated.to_json()
    # And the broker saw the same publications under the same keys in the same order
    # (keys hash a random generation drawn from the same seed).
    assert [k for _, k in postgres_side.published] == [k for _, k in memory_side.published]
    # ... and the second run really went through PostgreSQL: what it left in the table (the
    # occurrences finished since the last purge) is what its trace says.
    conn = await asyncpg.connect(dsn)
    try:
        names = await conn.fetch(f'SELECT name FROM "{schema}".recurring_definitions ORDER BY name')
        rows = await conn.fetch(
            f'SELECT definition_name, due_at, state, attempts FROM "{schema}".recurring_occurrences'
        )
    finally:
        await conn.close()
    assert [r["name"] for r in names] == ["hourly-catch-up", "quarter-coalesce"]
    traced = {(o.definition_name, o.due_at): (o.state.value, o.attempts) for o in real.occurrences}
    assert rows
    for row in rows:
        assert traced[row["definition_name"], row["due_at"]] == (row["state"], row["attempts"])
