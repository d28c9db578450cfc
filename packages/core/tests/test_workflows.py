"""steeple.core.workflows: the settlement rule and the dependency order, without a database."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from steeple.core.errors import ConfigurationError, ConfigurationTypeError
from steeple.core.tasks import TERMINAL_TASK_STATES, TaskEvent, TaskState
from steeple.core.workflows import (
    ParentFailure,
    Settlement,
    WorkflowCycleError,
    parent_failure,
    settlement,
    workflow_order,
)


@pytest.mark.parametrize("policy", list(ParentFailure))
@pytest.mark.parametrize("parent", [s for s in TaskState if s in TERMINAL_TASK_STATES])
def test_settlement_table(parent: TaskState, policy: ParentFailure) -> None:
    want = (
        Settlement.ONE_FEWER
        if parent is TaskState.SUCCEEDED or policy is ParentFailure.RUN
        else Settlement.CANCEL
    )
    assert settlement(parent, policy) is want
    assert want.event is (TaskEvent.DEPENDENCY_FAILED if want is Settlement.CANCEL else None)


def test_a_live_parent_settles_nothing_and_types_are_checked() -> None:
    for live in set(TaskState) - TERMINAL_TASK_STATES:
        with pytest.raises(ConfigurationError):
            settlement(live, ParentFailure.CANCEL)
    with pytest.raises(ConfigurationTypeError):
        settlement("succeeded", ParentFailure.CANCEL)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationTypeError):
        settlement(TaskState.SUCCEEDED, "run")  # type: ignore[arg-type]


def test_parent_failure_accepts_its_values_only() -> None:
    assert parent_failure("run") is ParentFailure.RUN
    assert parent_failure(ParentFailure.CANCEL) is ParentFailure.CANCEL
    for bad in ("Run", "", "cancel\x00", "\ud800"):
        with pytest.raises(ConfigurationError):
            parent_failure(bad)
    for wrong in (None, 1, b"run", ["run"]):
        with pytest.raises(ConfigurationTypeError):
            parent_failure(wrong)


@given(st.lists(st.sets(st.integers(0, 40), max_size=4), max_size=40))
def test_an_acyclic_graph_is_ordered_parents_first(raw: list[set[int]]) -> None:
    parents = [sorted(u for u in ups if u < i) for i, ups in enumerate(raw)]
    order = workflow_order(parents)
    assert order == list(range(len(parents)))  # given in dependency order: kept as it is
    shuffled = list(reversed(range(len(parents))))
    place = {old: new for new, old in enumerate(shuffled)}
    moved = [[place[u] for u in parents[old]] for old in shuffled]
    seen: set[int] = set()
    for node in workflow_order(moved):
        assert set(moved[node]) <= seen
        seen.add(node)
    assert len(seen) == len(parents)


def test_a_cycle_is_refused_and_named() -> None:
    with pytest.raises(WorkflowCycleError) as info:
        workflow_order([[2], [0], [1], []])
    assert info.value.cycle == (0, 2, 1, 0)
    with pytest.raises(WorkflowCycleError):
        workflow_order([[0]])
    with pytest.raises(ConfigurationError):
        workflow_order([[5]])
