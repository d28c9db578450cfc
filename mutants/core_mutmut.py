"""Mutation testing of ``steeple.core`` with mutmut, over core's own tests.

mutmut (3.x) mutates every function of the chosen modules (operators, comparisons,
constants, arguments, return values), runs the tests that call each function, and records
whether they failed. It needs a project whose sources are under ``src/`` and whose tests
import them from the copy it makes (``mutants/``); the workspace's editable installs would
shadow that copy, so this script lays out core alone in a scratch directory (its ``src``,
its ``tests``, its README for the one test that runs the README's example) and runs mutmut
there, in an interpreter where no steeple package is installed (``nox -s mutmut-core``
makes one).

Tests that read core's source or import it in a subprocess check how core is built (its
imports, what it loads), not what it decides, and cannot run on mutmut's rewritten
modules: they are left out (:data:`NOT_UNDER_MUTMUT`).

Usage::

    python mutants/core_mutmut.py [--max-children N] [--tests FILE]... [MODULE ...]
    python mutants/core_mutmut.py --report-only WORKDIR               # score a finished run

It prints, per module: mutants, killed (a timeout counts as killed), survived, no tests,
equivalent (listed in ``mutants/core_equivalent.toml`` with the reason, and survived in
this run), not checked, and the score, killed / (mutants - equivalent): a mutant the run
did not check counts against it. Then every survivor that is not listed as equivalent, and
every listed equivalent that this run did not see survive (killed: the record's number now
names another mutant; absent: no such mutant). It exits 1 when the score over all modules
is below 90 %, when any mutant was not checked, or when any equivalent record is stale.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CORE = ROOT / "packages" / "core"
EQUIVALENT = ROOT / "mutants" / "core_equivalent.toml"
THRESHOLD = 0.90

DECISIONS = (
    "leases",
    "policies",
    "tasks",
    "occurrences",
    "backoff",
    "remote_clock",
    "idempotency",
    "publication",
    "limits",
    "claims",
    "cluster",
    "calendar",
)
"""The modules of steeple.core that hold decisions (the rest: errors, messages, ports,
records, configuration parsing and validation)."""

NOT_UNDER_MUTMUT = (
    "--ignore=tests/test_core_purity.py",
    "--deselect=tests/test_calendar_rules.py::test_calendar_module_imports_only_stdlib_attrs_and_core",
    "--deselect=tests/test_calendar_rules.py::test_importing_the_calendar_loads_no_third_party_module",
    "--deselect=tests/test_zoned_rules.py::test_importing_core_does_not_load_zoneinfo",
)

PYPROJECT = """\
[tool.pytest.ini_options]
addopts = "-ra --import-mode=importlib --strict-markers -p no:cacheprovider"
asyncio_mode = "auto"
asyncio_default_fixture_loop_scope = "function"
timeout = 300
markers = ["postgres: x", "broker: x", "slow: x"]

[tool.mutmut]
source_paths = ["src/"]
pytest_add_cli_args_test_selection = {tests}
pytest_add_cli_args = {extra}
also_copy = ["README.md", "conftest.py"]
only_mutate = {modules}
"""

FRESH_CACHES = '''\
"""Empty steeple.core's memo caches when a test session starts (mutants/core_mutmut.py).

mutmut forks each mutant's test run from a process that has already run the tests, so a
result memoised there by the unmutated code would answer in the mutant's place.
"""

import sys

from hypothesis import HealthCheck, settings

# Timing checks judge the machine, not the mutant: on a loaded machine they would fail
# the unmutated run (mutmut's first pass) and no mutant would be checked at all.
settings.register_profile(
    "mutmut", deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile("mutmut")


def pytest_sessionstart(session):
    for name, module in list(sys.modules.items()):
        if name == "steeple.core" or name.startswith("steeple.core."):
            for value in list(vars(module).values()):
                clear = getattr(value, "cache_clear", None)
                if callable(clear):
                    clear()
'''
"""The work directory's ``conftest.py``: a memoised function (``functools.cache``) must
compute again under each mutant, or its mutants survive untested."""

KILLED = {"killed", "timeout", "caught by type check", "segfault"}
_RESULT = re.compile(r"^\s+(steeple\.core\.(\w+)\.\S+): (.+)$")


def lay_out(work: Path, modules: list[str], tests: list[str]) -> None:
    """Copy core's sources, tests and README into ``work`` with mutmut's configuration."""
    shutil.copytree(CORE / "src", work / "src", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(CORE / "tests", work / "tests", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy2(CORE / "README.md", work / "README.md")
    (work / "conftest.py").write_text(FRESH_CACHES, encoding="utf-8")
    only = [f"src/steeple/core/{m}.py" for m in modules]
    (work / "pyproject.toml").write_text(
        PYPROJECT.format(
            extra=_toml_list(NOT_UNDER_MUTMUT),
            modules=_toml_list(only),
            tests=_toml_list([f"tests/{t}" for t in tests] or ["tests/"]),
        ),
        encoding="utf-8",
    )


def _toml_list(items: tuple[str, ...] | list[str]) -> str:
    return "[" + ", ".join(f'"{i}"' for i in items) + "]"


def equivalents() -> dict[str, str]:
    """Mutant name -> why no test can tell it apart (``mutants/core_equivalent.toml``)."""
    if not EQUIVALENT.is_file():
        return {}
    with EQUIVALENT.open("rb") as f:
        entries = tomllib.load(f).get("mutant", [])
    return {e["name"]: e["reason"] for e in entries}


def report(work: Path) -> int:
    """Print the per-module score of a finished run in ``work``; 1 when below the bar."""
    listed = subprocess.run(
        [sys.executable, "-m", "mutmut", "results", "--all", "true"],
        cwd=work,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    status, text = score_listing(listed, equivalents())
    print(f"{text}; work directory {work}")
    return status


def score_listing(listed: str, known: dict[str, str]) -> tuple[int, str]:
    """Score mutmut's ``results --all`` listing: the exit status and the table to print.

    The status is 1 when the score is below the bar, when any mutant was not checked (a
    run cut short proves nothing about the rest, and an empty one nothing at all), and
    when a record of ``known`` names a mutant of a module in the listing that did not
    survive in it: a stale record, reported and not counted as equivalent.
    """
    results = _results(listed)
    equivalent = {n for n, (_m, status) in results.items() if n in known and _survived(status)}
    stale = _stale(results, known)
    per, total = _tally(results, equivalent)
    rows = [
        "| module | mutants | killed | survived | no tests | equivalent | not checked | score |",
        "|---|---|---|---|---|---|---|---|",
        *(_row(module, per[module]) for module in sorted(per)),
        _row("**all**", total),
    ]
    survivors = [
        f"{n}: {status}"
        for n, (_m, status) in results.items()
        if n not in equivalent and _survived(status)
    ]
    if survivors:
        rows.append(
            "\nsurvivors not listed as equivalent (mutmut show NAME, in the work directory):"
        )
        rows += [f"  {s}" for s in survivors]
    failures = []
    if stale:
        rows.append(
            f"\nstale records in {EQUIVALENT.name} (not counted as equivalent; check each "
            "number with mutmut show NAME and list the mutant it now names, if equivalent):"
        )
        rows += [f"  {s}" for s in stale]
        failures.append(f"{len(stale)} stale equivalent record(s)")
    if not total["mutants"]:
        failures.append("no mutant was listed: the run failed before it made any")
    elif total["not checked"]:
        failures.append(
            f"{total['not checked']} of {total['mutants']} mutants were not checked: the run "
            "failed or was cut short, and a mutant not checked counts as not killed"
        )
    score = _score(total)
    rows.append(f"\nscore {score:.1%} (bar {THRESHOLD:.0%})")
    if score < THRESHOLD:
        failures.append(f"the score is below the bar of {THRESHOLD:.0%}")
    rows += [f"FAILED: {f}" for f in failures]
    return (1 if failures else 0), "\n".join(rows)


def _results(listed: str) -> dict[str, tuple[str, str]]:
    """Mutant name -> (module, status), from mutmut's listing."""
    found = (_RESULT.match(line) for line in listed.splitlines())
    return {m[1]: (m[2], m[3]) for m in found if m}


def _survived(status: str) -> bool:
    return status not in KILLED and status != "not checked"


def _stale(results: dict[str, tuple[str, str]], known: dict[str, str]) -> list[str]:
    """List the records of ``known``, for a module in ``results``, that did not survive it."""
    modules = {module for module, _status in results.values()}
    stale = []
    for name in sorted(known):
        parts = name.split(".")
        if len(parts) > 2 and parts[2] not in modules:
            continue  # a module this run did not mutate
        if name not in results:
            stale.append(f"{name}: no such mutant in this run")
        elif results[name][1] in KILLED:
            stale.append(f"{name}: {results[name][1]} (the number names a mutant a test kills)")
    return stale


def _tally(
    results: dict[str, tuple[str, str]], equivalent: set[str]
) -> tuple[dict[str, Counter[str]], Counter[str]]:
    per: dict[str, Counter[str]] = {}
    for name, (module, status) in results.items():
        counts = per.setdefault(module, Counter())
        counts["mutants"] += 1
        if name in equivalent:
            counts["equivalent"] += 1
        elif status in KILLED:
            counts["killed"] += 1
        elif status == "not checked":
            counts["not checked"] += 1
        else:
            counts["no tests" if status == "no tests" else "survived"] += 1
    total: Counter[str] = Counter()
    for counts in per.values():
        total.update(counts)
    return per, total


def _score(c: Counter[str]) -> float:
    """Killed over every mutant not known equivalent: one not checked counts as not killed."""
    judged = c["mutants"] - c["equivalent"]
    return c["killed"] / judged if judged else 0.0


def _row(module: str, c: Counter[str]) -> str:
    return (
        f"| {module} | {c['mutants']} | {c['killed']} | {c['survived']} | {c['no tests']} | "
        f"{c['equivalent']} | {c['not checked']} | {_score(c):.1%} |"
    )


def main(argv: list[str] | None = None) -> int:
    """Lay out core, run mutmut over the chosen modules, and score the run."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("modules", nargs="*", help=f"default: {' '.join(DECISIONS)}")
    parser.add_argument("--max-children", type=int, default=os.cpu_count() or 2)
    parser.add_argument(
        "--tests",
        action="append",
        default=[],
        help="a test file of packages/core/tests to run (default: all; fewer is faster, "
        "but a mutant only another file would kill then counts as a survivor)",
    )
    parser.add_argument("--work", type=Path, help="the scratch directory (default: a new one)")
    parser.add_argument("--report-only", type=Path, help="score the run in this directory")
    args = parser.parse_args(argv)
    if args.report_only is not None:
        return report(args.report_only)
    modules = args.modules or list(DECISIONS)
    unknown = [m for m in modules if not (CORE / "src" / "steeple" / "core" / f"{m}.py").is_file()]
    if unknown:
        print(f"no such modules in steeple.core: {unknown}", file=sys.stderr)
        return 2
    work = args.work or Path(tempfile.mkdtemp(prefix="steeple-mutmut-core-"))
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    lay_out(work, modules, args.tests)
    subprocess.run(
        [sys.executable, "-m", "mutmut", "run", "--max-children", str(args.max_children)],
        cwd=work,
        check=False,
    )
    return report(work)


if __name__ == "__main__":
    sys.exit(main())
