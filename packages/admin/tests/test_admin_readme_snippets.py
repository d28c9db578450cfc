"""The five-minute tours are real: the README holds the work-queue tour verbatim, the docs
include every tour from these files, and each file runs against a real PostgreSQL and
prints what the pages say it prints."""

from __future__ import annotations

import ast
import asyncio
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
SNIPPETS = HERE / "readme_snippets"
ROOT = HERE.parents[2]
README = ROOT / "README.md"  # the top-level README holds the work-queue tour
DOCS = ROOT / "docs"


def readme_snippets() -> dict[str, str]:
    text = README.read_text(encoding="utf-8")
    found = re.findall(r"<!-- snippet: (\S+) -->\n```python\n(.*?)```", text, re.DOTALL)
    return dict(found)


def docs_includes() -> set[str]:
    """The snippet files the documentation pages include (``--8<--``), by file name."""
    prefix = "packages/admin/tests/readme_snippets/"
    found: set[str] = set()
    for page in DOCS.rglob("*.md"):
        text = page.read_text(encoding="utf-8")
        found.update(re.findall(r'--8<-- "' + re.escape(prefix) + r'(\S+?)"', text))
    return found


def test_the_readme_holds_the_queue_tour_verbatim() -> None:
    snippets = readme_snippets()
    assert sorted(snippets) == ["queue_tour.py"]
    for name, code in snippets.items():
        assert code == (SNIPPETS / name).read_text(encoding="utf-8"), name


def test_the_readme_excerpts_are_tested_code_verbatim() -> None:
    """The workflow and per-key limit examples are cut, unchanged, from files the tests run."""
    text = README.read_text(encoding="utf-8")
    found = re.findall(r"<!-- excerpt: (\S+) -->\n```python\n(.*?)```", text, re.DOTALL)
    assert sorted(name for name, _ in found) == [
        "packages/admin/tests/readme_snippets/workflow_tour.py",
        "packages/postgres/tests/recipes/key_limits.py",
    ]
    for name, code in found:
        assert code.count("\n") >= 10, name
        assert code in (ROOT / name).read_text(encoding="utf-8"), name


def test_the_docs_include_every_snippet() -> None:
    files = {p.name for p in SNIPPETS.glob("*.py")}
    assert docs_includes() == files


async def _run(name: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return await asyncio.to_thread(
        subprocess.run,
        [sys.executable, str(SNIPPETS / name)],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )


def _env(**extra: str) -> dict[str, str]:
    """The outer environment without any STEEPLE_ variable, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEEPLE_")}
    env.update(extra)
    return env


def check_recurring_tour(result: subprocess.CompletedProcess[str], *, first: bool) -> None:
    """What the recurring tour prints: on the first run exactly what the README shows."""
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    materialized = int(lines[0].removeprefix("materialized "))
    published = [line for line in lines if line.startswith("published stp1-")]
    consumed = [line for line in lines if line == 'billing b\'{"batch": "eu"}\'']
    states = lines[-1]
    if first:
        assert materialized == 3
        assert states == "['published', 'published', 'published']"
    else:
        # a later run: the minutes since the last one (usually none), relayed the same way
        assert 0 <= materialized <= 3
        listed = ast.literal_eval(states)
        assert set(listed) == {"published"}
        assert len(listed) >= 3
    assert len(published) == len(consumed) == materialized


async def test_conformance_tour_runs(tmp_path: Path) -> None:
    result = await _run("conformance_tour.py", _env(), tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["the SQLite store conforms"]


def check_queue_tour(result: subprocess.CompletedProcess[str]) -> None:
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    sent = sorted(line.split()[2] for line in lines if line.startswith("sent to"))
    assert sent == ["ada@example.com", "flaky@example.com", "later@example.com"]
    assert "{'width': 256} Progress(fraction=1.0, message='tile 4 of 4')" in lines
    assert lines[-3:] == ["1 retried TimeoutError", "2 succeeded ", "succeeded"]


@pytest.mark.postgres
async def test_recurring_tour_runs_twice_in_a_row(
    pg_schema: tuple[str, str], tmp_path: Path
) -> None:
    """Issue 14: the key is kept in a file (mode 600) and reused, so a second run works."""
    dsn, schema = pg_schema
    env = _env(STEEPLE_DATABASE_URL=dsn, STEEPLE_SCHEMA=schema)
    first = await _run("recurring_tour.py", env, tmp_path)
    check_recurring_tour(first, first=True)
    key = tmp_path / ".steeple" / "tour" / "storage.key"
    assert key.stat().st_mode & 0o777 == 0o600
    kept = key.read_text()
    second = await _run("recurring_tour.py", env, tmp_path)
    check_recurring_tour(second, first=False)
    assert key.read_text() == kept
    assert "Traceback" not in first.stderr + second.stderr
    assert not (tmp_path / ".steeple" / "tour" / "pgdata").exists()  # the DSN was used


@pytest.mark.postgres
async def test_queue_tour_runs_twice_in_a_row(pg_schema: tuple[str, str], tmp_path: Path) -> None:
    dsn, schema = pg_schema
    env = _env(STEEPLE_DATABASE_URL=dsn, STEEPLE_QUEUE_SCHEMA=schema)
    for _ in range(2):
        check_queue_tour(await _run("queue_tour.py", env, tmp_path))


@pytest.mark.postgres
async def test_workflow_tour_runs_twice_in_a_row(
    pg_schema: tuple[str, str], tmp_path: Path
) -> None:
    dsn, schema = pg_schema
    env = _env(STEEPLE_DATABASE_URL=dsn, STEEPLE_QUEUE_SCHEMA=schema)
    for _ in range(2):
        result = await _run("workflow_tour.py", env, tmp_path)
        assert result.returncode == 0, result.stderr
        assert result.stdout.splitlines() == [
            "['succeeded', 'succeeded', 'succeeded', 'succeeded']",
            "[38, 57]",
        ]


@pytest.mark.slow
async def test_the_tours_run_with_no_environment_at_all(tmp_path: Path) -> None:
    """Copy-paste runnable: no STEEPLE_DATABASE_URL, so each starts the embedded server."""
    pytest.importorskip("pgserver")
    env = _env()
    check_recurring_tour(await _run("recurring_tour.py", env, tmp_path), first=True)
    check_queue_tour(await _run("queue_tour.py", env, tmp_path))
    data = tmp_path / ".steeple" / "tour"
    assert (data / "pgdata" / "PG_VERSION").exists()
    assert not (data / "pgdata" / "postmaster.pid").exists()  # stopped at the end
