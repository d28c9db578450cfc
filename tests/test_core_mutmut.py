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


NAME = "steeple.core.tasks.x_transition__mutmut_{}"


def test_a_run_that_checked_nothing_fails_with_a_clear_message() -> None:
    status, text = mutmut.score_listing(_listing("not checked", "not checked"), {})
    assert status == 1
    assert "FAILED: 2 of 2 mutants were not checked" in text
    assert "score 0.0%" in text


def test_an_empty_listing_fails() -> None:
    status, text = mutmut.score_listing("", {})
    assert status == 1
    assert "FAILED: no mutant was listed" in text


def test_only_equivalents_checked_nothing() -> None:
    status, _text = mutmut.score_listing(_listing("survived"), {NAME.format(1): "same"})
    assert status == 1


def test_the_score_holds_the_bar() -> None:
    passing = _listing(*["killed"] * 9, "survived")
    status, text = mutmut.score_listing(passing, {})
    assert status == 0
    assert "score 90.0% (bar 90%)" in text
    assert f"{NAME.format(10)}: survived" in text
    assert "FAILED" not in text
    failing = _listing(*["killed"] * 8, "timeout", "survived", "no tests")
    status, text = mutmut.score_listing(failing, {})
    assert status == 1
    assert "score 81.8%" in text
    assert "FAILED: the score is below the bar of 90%" in text


def test_a_run_that_judged_a_few_and_left_the_rest_unchecked_fails() -> None:
    """Four killed and 96 not checked once read 100 %: the unchecked count as not killed."""
    status, text = mutmut.score_listing(_listing(*["killed"] * 4, *["not checked"] * 96), {})
    assert status == 1
    assert "| **all** | 100 | 4 | 0 | 0 | 0 | 96 | 4.0% |" in text
    assert "score 4.0%" in text
    assert "FAILED: 96 of 100 mutants were not checked" in text
    # one left unchecked fails the run even when the score holds the bar
    status, text = mutmut.score_listing(_listing(*["killed"] * 99, "not checked"), {})
    assert (status, "score 99.0%" in text) == (1, True)
    assert "FAILED: 1 of 100 mutants were not checked" in text


def test_a_recorded_equivalent_counts_only_when_it_survived() -> None:
    known = {NAME.format(10): "same behaviour"}
    status, text = mutmut.score_listing(_listing(*["killed"] * 9, "survived"), known)
    assert status == 0
    assert "| **all** | 10 | 9 | 0 | 0 | 1 | 0 | 100.0% |" in text
    assert "stale" not in text


def test_a_stale_equivalent_record_is_reported_and_not_counted() -> None:
    """The record's number now names a mutant a test kills, or no mutant at all."""
    known = {NAME.format(3): "was equivalent", NAME.format(12): "gone"}
    status, text = mutmut.score_listing(_listing(*["killed"] * 10), known)
    assert status == 1
    assert "| **all** | 10 | 10 | 0 | 0 | 0 | 0 | 100.0% |" in text  # not counted
    assert f"{NAME.format(3)}: killed (the number names a mutant a test kills)" in text
    assert f"{NAME.format(12)}: no such mutant in this run" in text
    assert "FAILED: 2 stale equivalent record(s)" in text


def test_records_of_modules_the_run_did_not_mutate_are_left_alone() -> None:
    known = {"steeple.core.leases.x_holds_lease__mutmut_1": "elsewhere"}
    status, text = mutmut.score_listing(_listing(*["killed"] * 10), known)
    assert status == 0
    assert "stale" not in text


def test_the_checked_in_equivalents_name_mutants_of_decision_modules() -> None:
    for name in mutmut.equivalents():
        assert name.split(".")[2] in mutmut.DECISIONS, name
