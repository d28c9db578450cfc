"""docs/state-diagrams.md is what the core's transition tables give, drawn and tabulated.

Regenerate it with ``python docs/_hooks/state_diagrams.py`` after changing a table.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

from steeple.core.occurrences import OCCURRENCE_TRANSITIONS, OccurrenceEvent, OccurrenceState
from steeple.core.tasks import TASK_TRANSITIONS, TaskEvent, TaskState

ROOT = Path(__file__).resolve().parent.parent


def _generator() -> ModuleType:
    path = ROOT / "docs" / "_hooks" / "state_diagrams.py"
    spec = importlib.util.spec_from_file_location("state_diagrams", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_page_is_current() -> None:
    page = (ROOT / "docs" / "state-diagrams.md").read_text(encoding="utf-8")
    assert page == _generator().render(), (
        "docs/state-diagrams.md is not current: run python docs/_hooks/state_diagrams.py"
    )


def test_every_move_of_both_tables_is_on_the_page() -> None:
    page = _generator().render()
    assert page.count("stateDiagram-v2") == 2
    for (state, event), target in TASK_TRANSITIONS.items():
        assert f"| `{state.value}` | `{event.value}` | `{target.value}` |" in page
    for (o_state, o_event), o_target in OCCURRENCE_TRANSITIONS.items():
        to = "(removed)" if not isinstance(o_target, OccurrenceState) else f"`{o_target.value}`"
        assert f"| `{o_state.value}` | `{o_event.value}` | {to} |" in page
    for member in [*TaskState, *TaskEvent, *OccurrenceState, *OccurrenceEvent]:
        assert str(member.value) in page


def test_a_changed_table_changes_the_drawing() -> None:
    generator = _generator()
    initial = (TaskState.PENDING, "enqueue")
    drawn = generator._diagram(TASK_TRANSITIONS, initial, ())
    changed = {**TASK_TRANSITIONS, (TaskState.SUCCEEDED, TaskEvent.RETRY): TaskState.PENDING}
    redrawn = generator._diagram(changed, initial, ())
    assert "succeeded --> pending: retry" in redrawn
    assert "succeeded --> pending" not in drawn
