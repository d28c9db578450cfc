from datetime import UTC, datetime, timedelta

from steeple.core import MissedRunPolicy, RecurringConfig, RecurringDefinition, ScheduledMessage
from steeple.testing.simulation import Interval, Scenario, run

start = datetime(2026, 1, 30, tzinfo=UTC)
jobs = [
    RecurringDefinition(name, cron, start, policy, ScheduledMessage("jobs", name, b""))
    for name, cron, policy in [
        ("hourly-sync", "0 * * * *", MissedRunPolicy.CATCH_UP),
        ("cache-warm", "*/15 * * * *", MissedRunPolicy.COALESCE),
    ]
]
scenario = Scenario(
    RecurringConfig("what-if", 100, 100_000),
    jobs,
    start,
    start + timedelta(days=3),
    host_outages=[Interval.parse("2026-01-31T22:00Z/PT6H")],  # the database is down
)
result = run(scenario, seed=1)  # same seed, same result
for job in result.definitions:
    s = job.stats
    print(f"{job.name}: {s.published}/{s.materialized} published, {s.lateness.max:.0f} s late")
