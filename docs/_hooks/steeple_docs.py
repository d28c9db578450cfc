"""MkDocs hooks of steeple's documentation site: generated pages and build checks.

Generated at build time, so they cannot drift from the code:

- ``reference/<package>.md``: one API page per package found under
  ``packages/*/src/steeple/*``, rendering every public module (no ``_`` in its dotted
  name) with mkdocstrings. A name a module re-exports from another *public* module is
  linked, not rendered twice; names re-exported from private modules are rendered where
  they are public. The pages are added to the nav under "API reference".
- ``cli.md``: the marker ``<!-- steeple:cli-reference -->`` is replaced by the ``--help``
  of every command of the ``steeple`` console script (found through its entry point, so
  commands added later appear by themselves).

Checked at build time (a problem is a warning, so ``mkdocs build --strict`` fails):

- every repository path a page names in backticks (``packages/...``, ``benchmarks/...``,
  ``tests/...``) exists;
- no built page loads a script, stylesheet, image or frame from another host.
"""

from __future__ import annotations

import functools
import html.parser
import importlib
import logging
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
"""The repository root (mkdocs.yml lives here)."""

CLI_MARKER = "<!-- steeple:cli-reference -->"
REFERENCE_DIR = "reference"
_NAV_SECTION = "API reference"
_PATH_IN_BACKTICKS = re.compile(r"`((?:packages|benchmarks|tests|docs)/[A-Za-z0-9_./*-]+)`")
_LOADING_ATTRIBUTES = {
    "script": ("src",),
    "link": ("href",),
    "img": ("src", "srcset"),
    "iframe": ("src",),
    "source": ("src", "srcset"),
    "audio": ("src",),
    "video": ("src", "poster"),
    "embed": ("src",),
    "object": ("data",),
}

log = logging.getLogger("mkdocs.plugins.steeple_docs")


# --- packages and modules -------------------------------------------------------------


def source_dirs(root: Path = ROOT) -> list[Path]:
    """Return every package's ``src`` directory, in name order.

    The ``steeple`` distribution has none: it only installs the others.
    """
    found = (p.parent / "src" for p in root.glob("packages/*/pyproject.toml"))
    return sorted(src for src in found if src.is_dir())


def packages(root: Path = ROOT) -> list[tuple[str, str]]:
    """Return ``(package directory name, import name)`` of every steeple package."""
    found = []
    for src in source_dirs(root):
        for child in sorted((src / "steeple").iterdir()):
            if (child / "__init__.py").is_file() and not child.name.startswith("_"):
                found.append((src.parent.name, f"steeple.{child.name}"))
    return found


def _is_public(path: str) -> bool:
    return not any(part.startswith("_") for part in path.split("."))


def _walk(module: Any) -> Iterator[Any]:
    yield module
    for name, child in sorted(module.modules.items()):
        if _is_public(name) and name != "tests" and not child.is_alias:
            yield from _walk(child)


def _module_of(path: str, loader: Any) -> str:
    """Return the longest prefix of ``path`` that is a module known to ``loader``."""
    parts = path.split(".")
    for end in range(len(parts) - 1, 0, -1):
        candidate = ".".join(parts[:end])
        try:
            if loader.modules_collection[candidate].is_module:
                return candidate
        except KeyError:
            continue
    return parts[0]


def _members(module: Any, loader: Any) -> tuple[list[str] | None, list[tuple[str, str]]]:
    """Split a module's public names: rendered here, and linked to their public home.

    Returns:
        The names to render (``None``: mkdocstrings' default selection) and the
        ``(name, target path)`` pairs re-exported from other public modules.
    """
    exports = module.exports
    if exports is None:
        return None, []
    render: list[str] = []
    linked: list[tuple[str, str]] = []
    for name in exports:
        name = str(name)
        member = module.members.get(name)
        if member is None or member.is_module:
            continue  # a submodule: it has its own section
        if member.is_alias:
            target = member.target_path
            home = _module_of(target, loader)
            if _is_public(home) and home != module.path:
                linked.append((name, target))
                continue
        render.append(name)
    return render, linked


def _loaded(import_name: str, loader: Any) -> Any:
    """Return the module ``import_name``, loading it unless an earlier load brought it.

    griffe loads the whole ``steeple`` namespace package (every distribution's modules) for
    any one of them, and loads it again on each call: once is enough for all nine pages.
    """
    try:
        return loader.modules_collection[import_name]
    except KeyError:
        return loader.load(import_name)


def reference_page(import_name: str, directory: str, loader: Any) -> str:
    """Return the Markdown of one package's API page."""
    package = _loaded(import_name, loader)
    lines = [
        f"# `{import_name}`",
        "",
        f"Distribution `steeple-{directory}`, source `packages/{directory}/src/"
        f"{import_name.replace('.', '/')}/`. Generated from the docstrings of every public "
        "module (names without a leading underscore).",
        "",
    ]
    for module in _walk(package):
        render, linked = _members(module, loader)
        lines += [f"::: {module.path}", "    options:", "      show_root_heading: true"]
        lines += ["      heading_level: 2"]
        if render is not None:
            lines.append(
                f"      members: [{', '.join(render)}]" if render else "      members: false"
            )
        lines.append("")
        if linked:
            links = ", ".join(f"[`{name}`][{target}]" for name, target in linked)
            lines += [f"Also importable from `{module.path}`: {links}.", ""]
    return "\n".join(lines)


@functools.cache
def reference_pages(root: Path = ROOT) -> dict[str, str]:
    """Return ``{docs path: Markdown}`` of every package's API page (computed once per build)."""
    import griffe

    loader = griffe.GriffeLoader(
        search_paths=[str(p) for p in source_dirs(root)],
        docstring_parser=griffe.Parser.google,
    )
    pages = {}
    for directory, import_name in packages(root):
        short = import_name.removeprefix("steeple.")
        pages[f"{REFERENCE_DIR}/{short}.md"] = reference_page(import_name, directory, loader)
    return pages


# --- the CLI reference ------------------------------------------------------------------


def _console_app() -> Any:
    """Return the Typer app behind the ``steeple`` console script."""
    from importlib.metadata import entry_points

    import typer

    (entry,) = [e for e in entry_points(group="console_scripts") if e.name == "steeple"]
    module = importlib.import_module(entry.module)
    apps = [v for v in vars(module).values() if isinstance(v, typer.Typer)]
    nested = {id(group.typer_instance) for app in apps for group in app.registered_groups}
    (root,) = [app for app in apps if id(app) not in nested]
    return root


def _command_paths(command: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    # Duck-typed: typer builds its commands on a vendored click, not on `click` itself.
    yield path
    if hasattr(command, "list_commands"):
        context = command.context_class(command)
        for name in command.list_commands(context):
            child = command.get_command(context, name)
            if child is not None and not child.hidden:
                yield from _command_paths(child, (*path, name))


def cli_reference() -> str:
    """Return Markdown with the ``--help`` of every ``steeple`` command."""
    import typer
    from typer.testing import CliRunner

    app = _console_app()
    runner = CliRunner()
    env = {"TERMINAL_WIDTH": "80", "NO_COLOR": "1", "COLUMNS": "80"}
    sections = []
    for path in _command_paths(typer.main.get_command(app)):
        result = runner.invoke(app, [*path, "--help"], prog_name="steeple", env=env)
        if result.exit_code != 0:
            raise RuntimeError(f"`steeple {' '.join(path)} --help` exited {result.exit_code}")
        text = "\n".join(line.rstrip() for line in result.output.splitlines()).strip("\n")
        title = " ".join(("steeple", *path))
        sections += [f"## `{title}`", "", "```text", text, "```", ""]
    return "\n".join(sections)


# --- build checks -----------------------------------------------------------------------


def missing_paths(markdown: str, root: Path = ROOT) -> list[str]:
    """Return the repository paths named in backticks in ``markdown`` that do not exist."""
    missing = []
    for match in _PATH_IN_BACKTICKS.finditer(markdown):
        path = match.group(1).rstrip(".")
        if "*" in path:
            if not list(root.glob(path)):
                missing.append(path)
        elif not (root / path).exists():
            missing.append(path)
    return missing


def _is_external(url: str) -> bool:
    url = url.strip().lower()
    return url.startswith(("http:", "https:", "//", "ftp:")) or (
        ":" in url.split("/", 1)[0] and not url.startswith(("data:", "blob:"))
    )


class _Loads(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.external: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for name, value in attrs:
            if value and name in _LOADING_ATTRIBUTES.get(tag, ()):
                if name == "srcset":  # "url 2x, url 3x"
                    urls = [part.split()[0] for part in value.split(",") if part.strip()]
                else:
                    urls = [value]
                self.external += [f"<{tag} {name}={u}>" for u in urls if _is_external(u)]


def external_loads(page_html: str) -> list[str]:
    """Return what ``page_html`` would load from another host (scripts, styles, images)."""
    parser = _Loads()
    parser.feed(page_html)
    return parser.external


# --- MkDocs events ----------------------------------------------------------------------


def on_config(config: Any) -> Any:
    """Add the generated API pages to the nav's "API reference" section."""
    pages = sorted(reference_pages())
    for item in config["nav"] or []:
        if isinstance(item, dict) and _NAV_SECTION in item:
            section = item[_NAV_SECTION]
            listed = {entry if isinstance(entry, str) else next(iter(entry.values()))
                      for entry in section}  # fmt: skip
            section += [page for page in pages if page not in listed]
    return config


def on_files(files: Any, config: Any) -> Any:
    """Add the generated API pages to the site."""
    from mkdocs.structure.files import File

    for path, content in reference_pages().items():
        files.append(File.generated(config, path, content=content))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Fill in the CLI reference; warn about repository paths that do not exist."""
    for path in missing_paths(markdown):
        log.warning("%s names `%s`, which does not exist", page.file.src_uri, path)
    if CLI_MARKER in markdown:
        markdown = markdown.replace(CLI_MARKER, cli_reference())
    return markdown


def on_post_build(config: Any) -> None:
    """Fail the strict build if any page loads something from another host."""
    site = Path(config["site_dir"])
    for page in sorted(site.rglob("*.html")):
        for load in external_loads(page.read_text(encoding="utf-8")):
            log.warning("%s loads from another host: %s", os.path.relpath(page, site), load)
