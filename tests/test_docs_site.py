"""The documentation site's generators and build checks (docs/_hooks/).

The full build (`mkdocs build --strict`) runs in `nox -s docs` and in .ci/run; these tests
pin what the hooks generate and what their checks catch, without building the site.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import re
import sys
from collections.abc import Iterable
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / "docs" / "_hooks" / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


hooks = _load("steeple_docs")
roles = _load("griffe_sphinx_roles")


def test_external_loads_are_flagged_and_local_ones_are_not() -> None:
    page = """
    <link rel="stylesheet" href="assets/main.css"><link rel="icon" href="../favicon.png">
    <script src="assets/bundle.js"></script><script>inline()</script>
    <a href="https://example.org/">a link is not a load</a>
    <script src="https://cdn.example.org/x.js"></script>
    <link rel="stylesheet" href="//fonts.example.org/css">
    <img srcset="small.png 1x, http://img.example.org/big.png 2x" src="data:image/png;base64,AA">
    <iframe src="HTTPS://frame.example.org/"></iframe>
    """
    assert hooks.external_loads(page) == [
        "<script src=https://cdn.example.org/x.js>",
        "<link href=//fonts.example.org/css>",
        "<img srcset=http://img.example.org/big.png>",
        "<iframe src=HTTPS://frame.example.org/>",
    ]


def test_missing_repository_paths_are_reported() -> None:
    markdown = (
        "See `packages/core/README.md`, `packages/*/pyproject.toml`, "
        "`packages/core/src/steeple/core/nope.py` and `tests/none_*.py`; "
        "`steeple.core` is not a path."
    )
    assert hooks.missing_paths(markdown) == [
        "packages/core/src/steeple/core/nope.py",
        "tests/none_*.py",
    ]


def _public_modules_on_disk() -> dict[str, set[str]]:
    """Every public module of every package, found by walking the files (not griffe)."""
    found: dict[str, set[str]] = {}
    for src in sorted(ROOT.glob("packages/*/src/steeple/*")):
        if not (src / "__init__.py").is_file():
            continue
        names = found.setdefault(f"steeple.{src.name}", set())
        for path in src.rglob("*.py"):
            parts = path.relative_to(src.parent.parent).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            if any(part.startswith("_") for part in parts):
                continue
            names.add(".".join(parts))
    return found


def test_every_public_module_of_every_package_has_a_reference_section() -> None:
    pages = hooks.reference_pages()
    on_disk = _public_modules_on_disk()
    assert sorted(pages) == sorted(f"reference/{p.removeprefix('steeple.')}.md" for p in on_disk)
    for package, modules in on_disk.items():
        page = pages[f"reference/{package.removeprefix('steeple.')}.md"]
        rendered = {
            line.removeprefix("::: ") for line in page.splitlines() if line.startswith(":::")
        }
        assert rendered == modules, package


def test_a_re_export_from_a_public_module_is_linked_not_rendered_twice() -> None:
    core = hooks.reference_pages()["reference/core.md"]
    first = core.split("::: steeple.core.", 1)[0]  # the package's own section
    assert "members: false" in first
    assert "[`CronCalendar`][steeple.core.calendar.CronCalendar]" in first
    queue = hooks.reference_pages()["reference/postgres.md"]
    # Scheduler is defined in a private module: rendered where it is public.
    section = queue.split("::: steeple.postgres.queue\n", 1)[1].split(":::", 1)[0]
    assert "Scheduler" in section.split("members: [", 1)[1].split("]", 1)[0]


def _typer_command_paths() -> set[tuple[str, ...]]:
    import typer

    def walk(app: typer.Typer, prefix: tuple[str, ...]) -> set[tuple[str, ...]]:
        paths = {prefix}
        for command in app.registered_commands:
            name = command.name or command.callback.__name__.replace("_", "-")  # type: ignore[union-attr]
            paths.add((*prefix, name))
        for group in app.registered_groups:
            assert group.name is not None
            assert group.typer_instance is not None
            paths |= walk(group.typer_instance, (*prefix, group.name))
        return paths

    # The app behind the `steeple` console script, wherever the CLI module lives.
    return walk(hooks._console_app(), ())


def test_the_cli_reference_has_the_help_of_every_command() -> None:
    text = hooks.cli_reference()
    sections = text.split("## `")[1:]
    titles = {tuple(section.split("`", 1)[0].split()[1:]) for section in sections}
    assert titles == _typer_command_paths()
    assert ("keys", "generate") in titles
    assert ("admin", "serve") in titles
    for section in sections:
        title = section.split("`", 1)[0]
        assert f"Usage: {title} " in section, title


@pytest.mark.parametrize(
    ("docstring", "expected"),
    [
        ("Run with a :class:`Scheduler`.", "Run with a `Scheduler`."),
        ("Uses :class:`~steeple.core.ports.Clock` and :mod:`.jobs`.", "Uses `Clock` and `jobs`."),
        (
            ":meth:`Scheduler.health` and :py:func:`steeple.x.f`",
            "`Scheduler.health` and `steeple.x.f`",
        ),
        ("plain ``code`` stays", "plain ``code`` stays"),
    ],
)
def test_sphinx_roles_render_as_code(docstring: str, expected: str) -> None:
    assert roles.render_roles(docstring) == expected


# --- code names in the queue's design pages ------------------------------------------------

QUEUE_DESIGN_PAGES = ("docs/queue/concurrency-model.md", "docs/queue/scheduler-design.md")
"""Pages that explain the code by naming it: every name they give must exist."""
_CODE_SPAN = re.compile(r"`([^`\n]+)`")
_FENCE = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*(?:\(\))?\Z")
_SOURCE_GLOBS = ("packages/*/src/**/*", "packages/*/tests/**/*", "tests/**/*", "benchmarks/**/*")


def code_names(markdown: str) -> list[str]:
    """Return the code names a page gives in backticks (fenced blocks left out).

    A name is a Python identifier or a dotted path (``Claimer.claim_until``,
    ``steeple.postgres.queue.jobs``, ``test_...``), optionally called (``f()``), that looks
    like code: it has an underscore, a dot or an inner capital. Plain words (``pending``)
    and anything with spaces or operators (``SET LOCAL``, ``min_size=2``) are not names.
    """
    names = []
    for span in _CODE_SPAN.findall(_FENCE.sub("", markdown)):
        if not _NAME.match(span):
            continue
        name = span.removesuffix("()")
        if "_" in name or "." in name or any(c.isupper() for c in name[1:]):
            names.append(name)
    return names


class SourceIndex:
    """What the source tree defines: names of Python and SQL files, and where each lives."""

    def __init__(self, files: Iterable[Path]) -> None:
        self.text: dict[Path, str] = {}
        self.words: set[str] = set()
        self.defined: dict[str, set[Path]] = {}
        self.classes: dict[str, set[Path]] = {}
        definition = re.compile(
            r"^\s*(?:async\s+def|def|class)\s+(\w+)"  # functions and classes
            r"|^\s*(?:self\.)?(\w+)\s*(?::[^=\n]*)?=(?!=)"  # assignments, attributes
            r"|^\s*(\w+)\s*:\s*[\w\[\]|., ]+$",  # annotated fields
            re.MULTILINE,
        )
        for path in files:
            text = path.read_text(encoding="utf-8", errors="replace")
            self.text[path] = text
            self.words.update(re.findall(r"\w+", text))
            for match in definition.finditer(text):
                name = next(group for group in match.groups() if group)
                self.defined.setdefault(name, set()).add(path)
            for name in re.findall(r"^\s*class\s+(\w+)", text, re.MULTILINE):
                self.classes.setdefault(name, set()).add(path)
            for name in re.findall(r"self\.(\w+)\s*(?::[^=\n]*)?=(?!=)", text):
                self.defined.setdefault(name, set()).add(path)

    def missing(self, name: str) -> bool:
        """Whether ``name`` names nothing in the source tree."""
        parts = name.split(".")
        if parts[0] == "steeple":
            # A module path, or an instrument's name (built from a prefix and a quoted name).
            quoted = (f'"{parts[-1]}"', f"'{parts[-1]}'")
            return not _importable(name) and not any(
                name in text or any(q in text for q in quoted) for text in self.text.values()
            )
        if any(part not in self.words for part in parts):
            return True
        owner, member = parts[0], parts[-1]
        if len(parts) == 2 and owner in self.classes:
            # A member named through its class must be defined where the class is.
            return not (self.defined.get(member, set()) & self.classes[owner])
        if member.startswith(("_", "test_")) and not member.startswith("__"):
            return member not in self.defined
        return False


def _importable(dotted: str) -> bool:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            target: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attribute in parts[cut:]:
            if not hasattr(target, attribute):
                return False
            target = getattr(target, attribute)
        return True
    return False


@functools.cache
def _source_index() -> SourceIndex:
    return SourceIndex(_source_files())


def _source_files() -> list[Path]:
    found = {
        path
        for pattern in _SOURCE_GLOBS
        for path in ROOT.glob(pattern)
        if path.suffix in {".py", ".sql"} and ".venv" not in path.parts
    }
    found.discard(Path(__file__).resolve())  # it names missing things on purpose
    return sorted(found)


def test_code_names_are_found_in_backticks_and_plain_words_are_not() -> None:
    markdown = (
        "The `claim loop` (`Claimer.claim_until`) and `pending`, `SET LOCAL`, "
        "`min_size=2`, `steeple.postgres.queue.jobs`, `_either()`, `WorkerStats`.\n"
        "```python\nx = `not_a_name_in_a_fence`\n```\n"
    )
    assert code_names(markdown) == [
        "Claimer.claim_until",
        "steeple.postgres.queue.jobs",
        "_either",
        "WorkerStats",
    ]


def test_a_name_that_no_longer_exists_is_reported() -> None:
    index = _source_index()
    assert not index.missing("Claimer.claim_until")
    assert not index.missing("Claimer._min_claim")
    assert not index.missing("steeple.postgres.queue.jobs.materialize_due")
    # Names the pages once gave: gone, or members of another class.
    assert index.missing("_claim_until")
    assert index.missing("Scheduler._flush_forever")
    assert index.missing("Scheduler._min_claim")
    assert index.missing("steeple.postgres.queue.no_such_function")
    assert index.missing("test_no_such_test_was_ever_written")


@pytest.mark.parametrize("page", QUEUE_DESIGN_PAGES)
def test_every_code_name_of_the_queue_design_pages_exists(page: str) -> None:
    names = code_names((ROOT / page).read_text(encoding="utf-8"))
    assert len(names) > 50  # the extraction found the page's names
    index = _source_index()
    assert sorted({name for name in names if index.missing(name)}) == []
