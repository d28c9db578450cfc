"""Product text speaks of the product, and the README is a front door.

Everything a user reads (the README, the package READMEs, the documentation pages, and the
docstrings, comments and messages of the shipped sources) describes steeple's guarantees in
its own words: never the vocabulary of how the project is organised (requirement documents
by number, tracker items, batches of work, rows of an internal fault list). The README
stays a landing page: short, the queue first, its commands the ones CI runs, its links
pointing at pages that exist.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"

INTERNAL_TERMS = re.compile(
    r"\bseeds?[ -]?0\d\d\b"  # requirement documents by number: "seed 000", "Seed 002"
    r"|\bissues? ?#?\d"  # tracker items: "issue 11", "issue #13", "issues 11/13"
    r"|\btranches?\b"  # batches of work
    r"|\bRELIABILITY(?:\.md)?,? rows?\b"  # the internal fault list and its rows
    r"|(?-i:\bRELIABILITY\.md\b)"  # (docs/reliability.md is the product's page)
    r"|\brows? \d+\b"  # its rows by number: "row 17", "rows 18, 19"
    r"|\bthe project's seeds\b",
    re.IGNORECASE,
)
"""Process vocabulary that product text must not use (case-insensitive)."""

_TEXT_SUFFIXES = {".py", ".sql", ".html", ".js", ".css", ".md", ".toml", ".txt", ".json"}


def product_text_files() -> list[Path]:
    """README, package READMEs, documentation pages and every shipped source text file."""
    found = {README, *ROOT.glob("packages/*/README.md"), *ROOT.glob("docs/**/*.md")}
    found.update(
        path
        for path in ROOT.glob("packages/*/src/**/*")
        if path.is_file() and path.suffix in _TEXT_SUFFIXES
    )
    return sorted(p for p in found if ".venv" not in p.parts and "__pycache__" not in p.parts)


def internal_terms(text: str) -> list[tuple[int, str]]:
    """Return ``(line number, term)`` for each internal process term in ``text``."""
    return [
        (number, match.group(0))
        for number, line in enumerate(text.splitlines(), 1)
        for match in INTERNAL_TERMS.finditer(line)
    ]


@pytest.mark.parametrize(
    "text",
    [
        "The work queue (seed 002) turns",
        "Seed 000 draws the line",
        "every seed-000 operation",
        "The targets of issue 13 hold",
        "see issue #7",
        "issues 11/13",
        "the final code of this tranche",
        "RELIABILITY row 17",
        "(RELIABILITY.md, facts measured on PostgreSQL 15)",
        "row 26 on the wire",
        "reliability row 17",
        "the project's seeds",
    ],
)
def test_each_internal_term_is_found(text: str) -> None:
    assert internal_terms(text), text


@pytest.mark.parametrize(
    "text",
    [
        "`deterministic_random` (seed 0) and `memory_broker`",
        "the seed is in each test id (`...-seed1236961598`)",
        "nox -s mutants -- --sample 6 --seed 1234",
        "Work queue (seed 3032544841)",
        "a raw 100-row INSERT; 100 rows a page",
        "the weaker row lock `FOR NO KEY UPDATE`",
        "the keys it issued; an issue with the network",
        "[Reliability](docs/reliability.md)",
    ],
)
def test_ordinary_words_are_not_internal_terms(text: str) -> None:
    assert internal_terms(text) == []


def test_product_text_uses_no_internal_process_terms() -> None:
    files = product_text_files()
    assert README in files
    assert any(p.suffix == ".py" and "src" in p.parts for p in files)
    found = [
        f"{path.relative_to(ROOT)}:{number}: {term!r}"
        for path in files
        for number, term in internal_terms(path.read_text(encoding="utf-8", errors="replace"))
    ]
    assert found == []


# --- the README as a front door -----------------------------------------------------------

README_MAX_LINES = 250
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)


def _sections(markdown: str) -> list[str]:
    return re.findall(r"^## (.+)$", _FENCE.sub("", markdown), re.MULTILINE)


def test_the_readme_is_a_short_landing_page_with_the_queue_first() -> None:
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= README_MAX_LINES
    sections = _sections(text)
    for name in ("Quick start", "Install", "Speed", "Documentation"):
        assert name in sections, name
    queue = next(i for i, s in enumerate(sections) if "work queue" in s.lower())
    recurring = next(i for i, s in enumerate(sections) if "recurring" in s.lower())
    assert sections.index("Install") < queue < recurring
    assert "- **Operations**:" in text  # the list operations pages are added to


def test_the_readme_gives_the_commands_ci_runs() -> None:
    """The quick start's two commands, and CI runs the test command exactly as given."""
    text = README.read_text(encoding="utf-8")
    block = text.split("## Quick start", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    commands = [line.split("#", 1)[0].strip() for line in block.splitlines()]
    assert commands == ["python3 dev.py demo", "python3 dev.py test"]
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert re.search(r"^stage tests python3 dev\.py test$", ci, re.MULTILINE)


def _slug(heading: str) -> str:
    """The anchor MkDocs gives a heading (the site)."""
    text = re.sub(r"[^\w\s-]", "", heading.replace("`", "")).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def _github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading (the README's links, read on the repository)."""
    text = re.sub(r"[^\w\s-]", "", heading.replace("`", "")).strip().lower()
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    """The anchors of a page's headings that the site and the repository agree on."""
    markdown = _FENCE.sub("", page.read_text(encoding="utf-8"))
    headings = re.findall(r"^#{1,6} (.+?)\s*$", markdown, re.MULTILINE)
    return {_slug(h) for h in headings if _slug(h) == _github_slug(h)}


def test_every_link_of_the_readme_points_at_something_that_exists() -> None:
    text = _FENCE.sub("", README.read_text(encoding="utf-8"))
    links = _LINK.findall(text)
    assert any(link.startswith("docs/") for link in links)
    broken = []
    for link in links:
        if link.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, anchor = link.partition("#")
        target = (ROOT / path) if path else README
        missing_anchor = bool(anchor) and target.suffix == ".md" and target.exists()
        if not target.exists() or (missing_anchor and anchor not in _anchors(target)):
            broken.append(link)
    assert broken == []


def test_a_missing_anchor_is_reported() -> None:
    page = ROOT / "docs" / "getting-started.md"
    assert "the-demo" in _anchors(page)
    assert "no-such-section" not in _anchors(page)
    assert _slug("Settings: `steeple.toml`") == "settings-steepletoml"
    assert _slug("`steeple worker --app module:object`") == "steeple-worker-app-moduleobject"
    # GitHub keeps both hyphens of "--app": an anchor the two disagree on is no anchor.
    assert _github_slug("`steeple worker --app module:object`") != _slug(
        "`steeple worker --app module:object`"
    )
    assert "steeple-worker-app-moduleobject" not in _anchors(ROOT / "docs" / "cli.md")
