"""No function in the checked packages is longer than LIMIT lines (its body, after the docstring).

A function's length includes the functions nested in it, so a factory of closures counts
whole. Only the packages in ROOTS are checked so far; the functions in KNOWN_LONGER are
the ones that were already longer when the rule came in: each may shrink, never grow, and
leaves the list once it is split.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 80
ROOTS = ("packages/admin/src",)
KNOWN_LONGER: dict[str, int] = {}


def body_length(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines from the first statement after the docstring to the function's last line."""
    body = node.body
    first = body[0]
    if (
        len(body) > 1
        and isinstance(first, ast.Expr)
        and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)
    ):
        first = body[1]
    end = node.end_lineno if node.end_lineno is not None else node.lineno
    return end - first.lineno + 1


def function_lengths(source: str, where: str) -> dict[str, int]:
    """Return ``{"where::qualified.name": body length}`` for every function in ``source``."""
    lengths: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                name = f"{prefix}{child.name}"
                lengths[f"{where}::{name}"] = body_length(child)
                visit(child, f"{name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return lengths


def checked_lengths() -> dict[str, int]:
    lengths: dict[str, int] = {}
    for root in ROOTS:
        for path in sorted((ROOT / root).rglob("*.py")):
            where = path.relative_to(ROOT).as_posix()
            lengths.update(function_lengths(path.read_text("utf-8"), where))
    return lengths


def test_no_function_is_longer_than_the_limit() -> None:
    lengths = checked_lengths()
    assert lengths, f"no functions found under {ROOTS}"
    too_long = {
        name: length
        for name, length in lengths.items()
        if length > LIMIT and name not in KNOWN_LONGER
    }
    assert not too_long, f"split these functions to at most {LIMIT} lines: {too_long}"


def test_known_longer_functions_only_shrink() -> None:
    lengths = checked_lengths()
    for name, recorded in KNOWN_LONGER.items():
        assert name in lengths, f"{name} is gone: remove it from KNOWN_LONGER"
        assert lengths[name] <= recorded, f"{name} grew to {lengths[name]} lines (was {recorded})"
        assert lengths[name] > LIMIT, (
            f"{name} is now {lengths[name]} lines: remove it from the list"
        )


def test_the_length_counts_nested_functions() -> None:
    source = (
        "def outer():\n    '''Doc.'''\n    x = 1\n"
        "    def inner():\n        return x\n    return inner\n"
    )
    lengths = function_lengths(source, "m.py")
    assert lengths == {"m.py::outer": 4, "m.py::outer.inner": 1}
