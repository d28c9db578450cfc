"""mutants/catalogue.toml and mutants/run.py (``nox -s mutants``), without running a mutant:
the catalogue matches the code, and the runner's choice, verdicts and refusals."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load() -> ModuleType:
    path = ROOT / "mutants" / "run.py"
    spec = importlib.util.spec_from_file_location("mutant_runner", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["mutant_runner"] = module
    spec.loader.exec_module(module)
    return module


runner = _load()


def test_every_anchor_occurs_exactly_once_in_the_working_tree() -> None:
    mutants = runner.load()
    runner.check_anchors(mutants, ROOT)
    assert len([m for m in mutants if not m.canary]) >= 60
    assert {m.area for m in mutants} >= {"queue", "recurring", "keyring", "calendar"}
    assert sum(m.canary for m in mutants) == 2


def test_a_missing_or_repeated_anchor_is_refused(tmp_path: Path) -> None:
    (tmp_path / "f.py").write_text("x = 1\nx = 1\n", encoding="utf-8")
    twice = runner.Mutant("twice", "a", "i", "f.py", ("x = 1",), ("x = 2",), ("t",))
    absent = runner.Mutant("absent", "a", "i", "f.py", ("y = 1",), ("y = 2",), ("t",))
    with pytest.raises(runner.CatalogueError, match=r"twice: its text occurs 2 times"):
        runner.check_anchors([twice], tmp_path)
    with pytest.raises(runner.CatalogueError, match=r"absent: its text occurs 0 times"):
        runner.check_anchors([absent], tmp_path)


def test_duplicate_names_and_unknown_keys_are_refused(tmp_path: Path) -> None:
    entry = 'name = "m"\narea = "a"\ninvariant = "i"\nfile = "f"\nfind = "a"\nreplace = "b"\n'
    entry += 'tests = ["t"]\n'
    twice = tmp_path / "twice.toml"
    twice.write_text(f"[[mutant]]\n{entry}[[mutant]]\n{entry}", encoding="utf-8")
    with pytest.raises(runner.CatalogueError, match="two mutants are named 'm'"):
        runner.load(twice)
    odd = tmp_path / "odd.toml"
    odd.write_text(f'[[mutant]]\n{entry}color = "red"\n', encoding="utf-8")
    with pytest.raises(runner.CatalogueError, match="unknown"):
        runner.load(odd)


def _args(**kw: object) -> argparse.Namespace:
    return argparse.Namespace(**{"only": [], "area": [], "sample": None, **kw})


def test_a_sample_is_the_canaries_then_a_choice_the_seed_replays() -> None:
    mutants = runner.load()
    first = runner.choose(mutants, _args(sample=5), 1234)
    assert [m.name for m in first] == [
        m.name for m in runner.choose(mutants, _args(sample=5), 1234)
    ]
    assert [m.canary for m in first] == [True, True, False, False, False, False, False]
    other = runner.choose(mutants, _args(sample=5), 4321)
    assert [m.name for m in other] != [m.name for m in first]
    bare = runner.choose(mutants, _args(sample=5, no_canaries=True), 1234)
    assert [m.name for m in bare] == [m.name for m in first[2:]]


def test_a_survivor_is_reported_and_a_failing_test_kills(tmp_path: Path) -> None:
    (tmp_path / "packages").mkdir()
    (tmp_path / "code.py").write_text("VALUE = 1\n", encoding="utf-8")
    (tmp_path / "test_code.py").write_text(
        "import pathlib\n\n"
        "def test_value() -> None:\n"
        "    assert 'VALUE = 1' in pathlib.Path('code.py').read_text()\n",
        encoding="utf-8",
    )
    killed = runner.run_one(
        runner.Mutant("k", "a", "i", "code.py", ("VALUE = 1",), ("VALUE = 2",), ("test_code.py",)),
        tmp_path,
    )
    assert killed.status == "killed"
    assert killed.by == "test_code.py::test_value"
    assert (tmp_path / "code.py").read_text(encoding="utf-8") == "VALUE = 1\n"  # restored
    survived = runner.run_one(
        runner.Mutant("s", "a", "i", "code.py", ("\n",), ("\n\n",), ("test_code.py",)), tmp_path
    )
    assert survived.status == "survived"
    assert "| s | i | **no** |  |" in runner.table([killed, survived])


def test_all_killers_runs_every_test_and_lists_each_that_failed(tmp_path: Path) -> None:
    (tmp_path / "packages").mkdir()
    (tmp_path / "code.py").write_text("VALUE = 1\n", encoding="utf-8")
    (tmp_path / "test_code.py").write_text(
        "import pathlib\n\n"
        "def value() -> str:\n"
        "    return pathlib.Path('code.py').read_text()\n\n"
        "def test_first() -> None:\n"
        "    assert 'VALUE = 1' in value()\n\n"
        "def test_unrelated() -> None:\n"
        "    assert 'VALUE' in value()\n\n"
        "def test_second() -> None:\n"
        "    assert value() == 'VALUE = 1\\n'\n",
        encoding="utf-8",
    )
    mutant = runner.Mutant(
        "k", "a", "i", "code.py", ("VALUE = 1",), ("VALUE = 2",), ("test_code.py",)
    )
    first_only = runner.run_one(mutant, tmp_path)
    assert first_only.killers == ["test_code.py::test_first"]
    every = runner.run_one(mutant, tmp_path, all_killers=True)
    assert every.status == "killed"
    assert every.by == "test_code.py::test_first"
    assert every.killers == ["test_code.py::test_first", "test_code.py::test_second"]
    assert "| k | i | yes | test_code.py::test_first, test_code.py::test_second |" in (
        runner.table([every])
    )


def test_paired_texts_must_pair_up_and_each_must_change_something(tmp_path: Path) -> None:
    head = '[[mutant]]\nname = "m"\narea = "a"\ninvariant = "i"\nfile = "f"\ntests = ["t"]\n'
    unpaired = tmp_path / "unpaired.toml"
    unpaired.write_text(head + 'find = ["a", "b"]\nreplace = ["c"]\n', encoding="utf-8")
    with pytest.raises(runner.CatalogueError, match="must pair up"):
        runner.load(unpaired)
    idle = tmp_path / "idle.toml"
    idle.write_text(head + 'find = ["a", "b"]\nreplace = ["c", "b"]\n', encoding="utf-8")
    with pytest.raises(runner.CatalogueError, match="changes nothing"):
        runner.load(idle)
    paired = tmp_path / "paired.toml"
    paired.write_text(head + 'find = ["a", "b"]\nreplace = ["c", "d"]\n', encoding="utf-8")
    [m] = runner.load(paired)
    assert (m.find, m.replace) == (("a", "b"), ("c", "d"))


def test_an_equivalent_mutant_is_listed_with_its_reason_never_run_or_sampled(
    tmp_path: Path,
) -> None:
    entry = 'area = "a"\ninvariant = "i"\nfile = "f"\nfind = "a"\nreplace = "b"\ntests = ["t"]\n'
    catalogue = tmp_path / "c.toml"
    catalogue.write_text(
        f'[[mutant]]\nname = "plain"\n{entry}'
        f'[[mutant]]\nname = "twin"\n{entry}equivalent = "a second guard"\n',
        encoding="utf-8",
    )
    mutants = runner.load(catalogue)
    assert [m.equivalent for m in mutants] == ["", "a second guard"]
    # A whole run lists it (with its reason) and does not run it; a sample never draws it.
    assert [m.name for m in runner.choose(mutants, _args(), 1)] == ["plain"]
    assert [m.name for m in runner.set_aside(mutants, _args())] == ["twin"]
    for seed in range(20):
        assert [m.name for m in runner.choose(mutants, _args(sample=1), seed)] == ["plain"]
    assert runner.set_aside(mutants, _args(sample=1)) == []
    # Named with --only, it runs.
    assert [m.name for m in runner.choose(mutants, _args(only=["twin"]), 1)] == ["twin"]
    shown = runner.table([runner.Outcome(mutants[1], "equivalent")])
    assert "| twin | i | equivalent | a second guard | 0 |" in shown
    assert "1 equivalent (not run)" in shown
    blank = tmp_path / "blank.toml"
    blank.write_text(f'[[mutant]]\nname = "m"\n{entry}equivalent = " "\n', encoding="utf-8")
    with pytest.raises(runner.CatalogueError, match="equivalent must say why"):
        runner.load(blank)


def test_the_only_equivalent_mutant_is_the_recovery_updates_recheck() -> None:
    equivalent = [m for m in runner.load() if m.equivalent]
    assert [m.name for m in equivalent] == ["queue.recover.no-recheck"]


def _three_tests(tree: Path) -> None:
    """A module and three tests: the first and last fail when VALUE changes, one never does."""
    (tree / "packages").mkdir(exist_ok=True)
    (tree / "code.py").write_text("VALUE = 1\n", encoding="utf-8")
    (tree / "test_code.py").write_text(
        "import pathlib\n\n"
        "def value() -> str:\n"
        "    return pathlib.Path('code.py').read_text()\n\n"
        "def test_first() -> None:\n"
        "    assert 'VALUE = 1' in value()\n\n"
        "def test_unrelated() -> None:\n"
        "    assert 'VALUE' in value()\n\n"
        "def test_second() -> None:\n"
        "    assert value() == 'VALUE = 1\\n'\n",
        encoding="utf-8",
    )


def _mutant(name: str = "k", killers: tuple[str, ...] = (), find: str = "VALUE = 1") -> object:
    replace = "VALUE = 2" if find == "VALUE = 1" else find + find
    return runner.Mutant(
        name, "a", "i", "code.py", (find,), (replace,), ("test_code.py",), killers=killers
    )


def test_a_recorded_killer_runs_first_and_kills_alone(tmp_path: Path) -> None:
    _three_tests(tmp_path)
    hit = runner.run_one(_mutant(killers=("test_code.py::test_second",)), tmp_path)
    # test_first would have failed first had the whole file run.
    assert (hit.status, hit.by, hit.hint) == ("killed", "test_code.py::test_second", "hit")
    assert (tmp_path / "code.py").read_text(encoding="utf-8") == "VALUE = 1\n"


def test_a_stale_killer_falls_back_to_the_entrys_tests(tmp_path: Path) -> None:
    _three_tests(tmp_path)
    for stale in ("test_code.py::test_unrelated", "test_code.py::test_gone"):
        outcome = runner.run_one(_mutant(killers=(stale,)), tmp_path)
        assert (outcome.status, outcome.by, outcome.hint) == (
            "killed",
            "test_code.py::test_first",
            "stale",
        )
    assert (tmp_path / "code.py").read_text(encoding="utf-8") == "VALUE = 1\n"


def test_a_killer_that_passes_is_no_kill(tmp_path: Path) -> None:
    _three_tests(tmp_path)
    # Doubling the newline changes nothing test_first or test_unrelated reads; the whole
    # file then runs, and test_second kills it: the hint alone decided nothing.
    mutant = _mutant(killers=("test_code.py::test_unrelated",), find="\n")
    outcome = runner.run_one(mutant, tmp_path)
    assert (outcome.status, outcome.by, outcome.hint) == (
        "killed",
        "test_code.py::test_second",
        "stale",
    )
    (tmp_path / "test_code.py").write_text(
        "def test_unrelated() -> None:\n    pass\n", encoding="utf-8"
    )
    survived = runner.run_one(mutant, tmp_path)
    assert (survived.status, survived.hint) == ("survived", "stale")


def test_all_killers_ignores_the_recorded_killers(tmp_path: Path) -> None:
    _three_tests(tmp_path)
    every = runner.run_one(
        _mutant(killers=("test_code.py::test_second",)), tmp_path, all_killers=True
    )
    assert every.killers == ["test_code.py::test_first", "test_code.py::test_second"]
    assert every.hint == ""


def test_killers_must_be_node_ids_of_the_entrys_tests(tmp_path: Path) -> None:
    head = '[[mutant]]\nname = "m"\narea = "a"\ninvariant = "i"\nfile = "f"\nfind = "a"\n'
    head += 'replace = "b"\ntests = ["pkg/tests/test_a.py", "t/test_b.py::test_x", "-k", "z"]\n'
    catalogue = tmp_path / "c.toml"
    good = '["pkg/tests/test_a.py::test_y[p 1]", "t/test_b.py::test_x", "pkg/tests/test_a.py"]'
    catalogue.write_text(f"{head}killers = {good}\n", encoding="utf-8")
    [m] = runner.load(catalogue)
    assert m.killers[0] == "pkg/tests/test_a.py::test_y[p 1]"
    for bad in ('["z::test_q"]', '["t/test_b.py::test_xy"]', '"t/test_b.py::test_x"', '[""]'):
        catalogue.write_text(f"{head}killers = {bad}\n", encoding="utf-8")
        with pytest.raises(runner.CatalogueError, match="killer"):
            runner.load(catalogue)


def test_recorded_killers_are_written_into_their_entries(tmp_path: Path) -> None:
    body = 'area = "a"\ninvariant = "i"\nfile = "f"\nfind = "a"\nreplace = "b"\n'
    body += 'tests = ["t.py"]\n'
    catalogue = tmp_path / "c.toml"
    catalogue.write_text(
        f'# head\n[[mutant]]\nname = "dies"\n{body}\n[[mutant]]\nname = "lives"\n{body}'
        f'killers = ["t.py::old"]\ncanary = false\n\n[[mutant]]\nname = "untouched"\n{body}'
        'killers = ["t.py::kept"]\n',
        encoding="utf-8",
    )
    dies, lives, untouched = runner.load(catalogue)
    outcomes = [
        runner.Outcome(dies, "killed", 't.py::test_x[a "b"]', 1.0, [], []),
        runner.Outcome(lives, "survived"),
        runner.Outcome(untouched, "not run"),
    ]
    assert runner.record_killers(catalogue, outcomes) == 2
    again = runner.load(catalogue)
    assert [m.killers for m in again] == [('t.py::test_x[a "b"]',), (), ("t.py::kept",)]
    text = catalogue.read_text(encoding="utf-8")
    assert text.startswith("# head\n")
    runner.record_killers(catalogue, outcomes)
    assert catalogue.read_text(encoding="utf-8") == text  # recording twice changes nothing


def test_jobs_run_mutants_at_once_each_in_its_own_tree(tmp_path: Path) -> None:
    trees = [tmp_path / "one", tmp_path / "two"]
    for tree in trees:
        tree.mkdir()
        _three_tests(tree)
    lives = runner.Mutant(
        "lives", "a", "i", "test_code.py", ("def test_unrelated",), ("def test_other",),
        ("test_code.py",),
    )  # fmt: skip
    mutants = [_mutant(name=f"m{i}") for i in range(3)] + [lives]
    args = argparse.Namespace(budget=None, all_killers=False)
    outcomes = runner._run_chosen(mutants, trees, args, 0.0)
    assert outcomes is not None
    assert [(o.mutant.name, o.status) for o in outcomes] == [
        ("m0", "killed"),
        ("m1", "killed"),
        ("m2", "killed"),
        ("lives", "survived"),
    ]
    for tree in trees:
        assert (tree / "code.py").read_text(encoding="utf-8") == "VALUE = 1\n"


def test_only_pytests_summary_lines_name_killers() -> None:
    lines = [
        "ERROR    steeple.queue:_execution.py:485 task 1 failed: TimeoutError: ",
        "FAILED pkg/tests/test_a.py::test_x[a b] - assert 1 == 2",
        "ERROR pkg/tests/test_b.py - ImportError: no module",
        "ERROR pkg/tests/test_c.py::test_y",
        "FAILED: not a summary line",
    ]
    found = [g.group(2) for g in map(runner._FAILED_LINE.match, lines) if g]
    assert found == [
        "pkg/tests/test_a.py::test_x[a b]",
        "pkg/tests/test_b.py",
        "pkg/tests/test_c.py::test_y",
    ]
