from __future__ import annotations

from datetime import UTC, datetime, timedelta

from hypothesis import given, settings
from hypothesis import strategies as st

from steeple.core.calendar import CronCalendar
from steeple.core.config import RecurringConfig, RecurringDefinition
from steeple.core.messages import ScheduledMessage
from steeple.testing.strategies import (
    aware_datetimes,
    cron_expressions,
    recurring_configs,
    recurring_definitions,
    scheduled_messages,
)


@settings(max_examples=300, deadline=None)
@given(cron_expressions())
def test_generated_cron_expressions_parse(expression: str) -> None:
    calendar = CronCalendar.parse(expression)
    assert calendar.expression == expression


@settings(max_examples=200, deadline=None)
@given(aware_datetimes())
def test_aware_datetimes_are_utc_milliseconds_in_range(instant: datetime) -> None:
    assert instant.tzinfo is UTC
    assert instant.microsecond % 1000 == 0
    assert datetime(1970, 1, 1, tzinfo=UTC) <= instant <= datetime(2100, 12, 31, 23, 59, tzinfo=UTC)


@settings(max_examples=200, deadline=None)
@given(recurring_definitions(), recurring_configs(), scheduled_messages(max_payload=16))
def test_domain_strategies_build_valid_values(
    definition: RecurringDefinition, config: RecurringConfig, message: ScheduledMessage
) -> None:
    assert definition.first_due > definition.first_after
    assert config.delivery_window >= 2 * config.lease_duration
    assert config.delivery_window <= timedelta(days=7)
    assert len(message.payload) <= 16


@settings(max_examples=50, deadline=None)
@given(recurring_definitions(names=st.just("fixed")))
def test_definition_names_can_be_pinned(definition: RecurringDefinition) -> None:
    assert definition.name == "fixed"
