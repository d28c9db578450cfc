"""The documentation site's generators and build checks (docs/_hooks/).

The full build (`mkdocs build --strict`) runs in `nox -s docs` and in .ci/run; these tests
pin what the hooks generate and what their checks catch, without building the site.
"""

from __future__ import annotations

import importlib.util
import sys
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
