"""Task ids and task-listing cursors: the one rule the queue's operator surfaces read."""

from __future__ import annotations

import pytest

from steeple.core.errors import ConfigurationError, ConfigurationTypeError
from steeple.core.tasks import MAX_TASK_ID, check_task_id, parse_task_cursor


def test_a_task_id_is_a_positive_bigint() -> None:
    assert MAX_TASK_ID == 2**63 - 1
    assert check_task_id(1) == 1
    assert check_task_id(MAX_TASK_ID) == MAX_TASK_ID


@pytest.mark.parametrize(
    "value",
    [0, -1, MAX_TASK_ID + 1, -(2**63), 10**5000],
    ids=["zero", "negative", "over", "int64-min", "5000-digits"],
)
def test_a_task_id_out_of_range_is_refused(value: int) -> None:
    with pytest.raises(ConfigurationError, match="whole number from 1 to") as caught:
        check_task_id(value)
    assert not isinstance(caught.value, ConfigurationTypeError)


@pytest.mark.parametrize("value", [True, False, 1.0, "1", b"1", None, [1]])
def test_a_task_id_of_another_type_is_refused_as_a_type_error(value: object) -> None:
    with pytest.raises(ConfigurationTypeError, match="whole number from 1 to"):
        check_task_id(value)


@pytest.mark.parametrize(
    ("after", "task_id"),
    [(None, 0), ("0", 0), ("1", 1), ("42", 42), (str(MAX_TASK_ID), MAX_TASK_ID)],
)
def test_a_cursor_names_the_last_task_id_of_a_page(after: str | None, task_id: int) -> None:
    assert parse_task_cursor(after) == task_id


@pytest.mark.parametrize(
    "after",
    [
        "",
        str(MAX_TASK_ID + 1),
        "1" * 20,
        "+1",
        "-1",
        " 1",
        "1\n",
        "1\x00",
        "\uff11",  # a FULLWIDTH DIGIT ONE: a digit to str.isdigit, not to a cursor
        "\ud800",
        1,
        b"1",
    ],
)
def test_anything_else_is_not_a_cursor(after: object) -> None:
    with pytest.raises(ConfigurationError) as refused:
        parse_task_cursor(after)
    # The whole message: it says what a cursor is, and shows nothing of what was given
    # (of something not a str, only its type).
    what = "the cursor of a task listing is a task id in decimal"
    expected = (
        f"{what} (its next_cursor)"
        if isinstance(after, str)
        else f"{what} (a str), not {type(after).__name__}"
    )
    assert str(refused.value) == expected
