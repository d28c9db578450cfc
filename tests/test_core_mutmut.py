"""mutants/core_mutmut.py scores a finished mutmut run, without running mutmut."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def _load() -> ModuleType:
    path = ROOT / "mutants" / "core_mutmut.py"
    spec = importlib.util.spec_from_file_location("core_mutmut", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["core_mutmut"] = module
    spec.loader.exec_module(module)
    return module


mutmut = _load()


def _listing(*statuses: str) -> str:
    return "".join(
        f"    steeple.core.tasks.x_transition__mutmut_{i}: {status}\n"
        for i, status in enumerate(statuses, 1)
    )


def test_a_run_that_checked_nothing_fails_with_a_clear_message() -> None:
    status, text = mutmut.score_listing(_listing("not checked", "not checked"), {})
    assert status == 1
    assert "no mutant was checked (2 listed, 2 not checked, 0 equivalent)" in text
    assert "score 100" not in text


def test_an_empty_listing_fails() -> None:
    status, text = mutmut.score_listing("", {})
    assert status == 1
    assert "no mutant was checked (0 listed" in text


def test_only_equivalents_checked_nothing() -> None:
    name = "steeple.core.tasks.x_transition__mutmut_1"
    status, _text = mutmut.score_listing(_listing("survived"), {name: "same behaviour"})
    assert status == 1


def test_the_score_leaves_out_the_unchecked_and_holds_the_bar() -> None:
    passing = _listing(*["killed"] * 9, "survived", "not checked")
    status, text = mutmut.score_listing(passing, {})
    assert status == 0
    assert "score 90.0% (bar 90%)" in text
    assert "steeple.core.tasks.x_transition__mutmut_10: survived" in text
    failing = _listing(*["killed"] * 8, "timeout", "survived", "no tests")
    status, text = mutmut.score_listing(failing, {})
    assert status == 1
    assert "score 81.8%" in text
