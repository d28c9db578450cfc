"""The README's five-minute tours are real: the README holds these files verbatim, and each
file runs against a real PostgreSQL and prints what the README says it prints."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
SNIPPETS = HERE / "readme_snippets"
README = HERE.parents[2] / "README.md"  # the top-level README holds the tours


def readme_snippets() -> dict[str, str]:
    text = README.read_text(encoding="utf-8")
    found = re.findall(r"<!-- snippet: (\S+) -->\n```python\n(.*?)```", text, re.DOTALL)
    return dict(found)


def test_readme_holds_every_snippet_verbatim() -> None:
    snippets = readme_snippets()
    files = sorted(p.name for p in SNIPPETS.glob("*.py"))
    assert sorted(snippets) == files
    for name, code in snippets.items():
        assert code == (SNIPPETS / name).read_text(encoding="utf-8"), name


async def _run(name: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return await asyncio.to_thread(
        subprocess.run,
        [sys.executable, str(SNIPPETS / name)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEEPLE_")}
    env.update(extra)
    return env


@pytest.mark.postgres
async def test_recurring_tour_runs(pg_schema: tuple[str, str]) -> None:
    dsn, schema = pg_schema
    result = await _run("recurring_tour.py", _env(STEEPLE_DATABASE_URL=dsn, STEEPLE_SCHEMA=schema))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "materialized 3"
    assert sum(line.startswith("published stp1-") for line in lines) == 3
    assert lines.count('billing b\'{"batch": "eu"}\'') == 3
    assert lines[-1] == "['published', 'published', 'published']"


async def test_conformance_tour_runs() -> None:
    result = await _run("conformance_tour.py", _env())
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["the SQLite store conforms"]


@pytest.mark.postgres
async def test_queue_tour_runs(pg_schema: tuple[str, str]) -> None:
    dsn, schema = pg_schema
    result = await _run(
        "queue_tour.py", _env(STEEPLE_DATABASE_URL=dsn, STEEPLE_QUEUE_SCHEMA=schema)
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    sent = sorted(line.split()[2] for line in lines if line.startswith("sent to"))
    assert sent == ["ada@example.com", "flaky@example.com", "later@example.com"]
    assert lines[-1] == "succeeded"
