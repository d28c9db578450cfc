"""The complexity limits hold the packages' sources, and the known exceptions only shrink.

``pyproject.toml`` selects ruff's McCabe complexity (C901) and pylint's too-many-returns,
-branches and -statements rules (PLR0911, PLR0912, PLR0915) for ``packages/*/src``; the
files listed there with some of these rules ignored hold functions that were over the
limits when the rules came in. A listed file whose functions no longer break a listed rule
fails here: its exemption is dropped in the same change that splits the function, so the
list can only get shorter.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RULES = frozenset({"C901", "PLR0911", "PLR0912", "PLR0915"})


def _lint_config() -> dict[str, object]:
    with (ROOT / "pyproject.toml").open("rb") as f:
        lint: dict[str, object] = tomllib.load(f)["tool"]["ruff"]["lint"]
    return lint


def _known_exceptions() -> dict[str, set[str]]:
    ignores = _lint_config()["per-file-ignores"]
    assert isinstance(ignores, dict)
    return {
        pattern: set(codes) & RULES
        for pattern, codes in ignores.items()
        if pattern.startswith("packages/") and set(codes) & RULES
    }


def test_the_limits_are_selected_for_the_sources_only() -> None:
    lint = _lint_config()
    assert set(lint["select"]) >= RULES  # type: ignore[call-overload]
    assert lint["mccabe"] == {"max-complexity": 12}
    ignores = lint["per-file-ignores"]
    assert isinstance(ignores, dict)
    assert set(ignores["!packages/*/src/**"]) == RULES


def test_every_known_exception_is_a_source_file_that_still_needs_it() -> None:
    known = _known_exceptions()
    assert known, "the list of known-longer files is read from pyproject.toml"
    for path in known:
        assert (ROOT / path).is_file(), f"{path} is listed but does not exist"
        assert "/src/" in path, f"{path} is not a package source file"
    ruff = Path(sys.executable).parent / "ruff"
    done = subprocess.run(
        [
            str(ruff),
            "check",
            "--no-cache",
            "--exit-zero",
            "--output-format=json",
            "--config=lint.per-file-ignores = {}",
            f"--select={','.join(sorted(RULES))}",
            *sorted(known),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    found: dict[str, set[str]] = {path: set() for path in known}
    for diagnostic in json.loads(done.stdout):
        path = Path(diagnostic["filename"]).resolve().relative_to(ROOT).as_posix()
        found[path].add(diagnostic["code"])
    stale = {
        path: sorted(codes - found[path]) for path, codes in known.items() if codes - found[path]
    }
    assert not stale, (
        "these files no longer break these rules: drop them from the known exceptions "
        f"in pyproject.toml: {stale}"
    )
