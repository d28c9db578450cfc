"""Benchmarks name the schemas they create per run, so runs on one server do not collide.

Two runs started at once against one PostgreSQL server must neither drop each other's
schemas nor take each other's tasks: every schema name a benchmark (or a script that
drives one) creates comes from ``benchmarks/_run_names.run_name`` (a prefix and the
process id). Checked here without running a benchmark: the naming function in two
processes, and the sources, read for schema names written out in them.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._run_names import run_name  # noqa: E402

HELPERS = {"_run_names.py", "_private_pg.py"}
# Scripts that only ever run on a PostgreSQL cluster they initdb themselves (no way to
# point them at another server): their fixed names cannot meet another run's.
OWN_SERVER_ONLY = {"benchmarks/bench_backlog.py", "tests/soak.py"}
SOURCES = sorted(
    [p for p in (ROOT / "benchmarks").glob("*.py") if p.name not in HELPERS]
    + [ROOT / "tests" / "soak.py"]
)
# A CREATE/DROP SCHEMA whose name is written in the text rather than filled in.
LITERAL_DDL = re.compile(
    r"\b(?:CREATE|DROP)\s+SCHEMA\s+(?:IF\s+(?:NOT\s+)?EXISTS\s+)?(?!IF\b)\"?[A-Za-z_]",
    re.IGNORECASE,
)
DDL = re.compile(r"\b(?:CREATE|DROP)\s+SCHEMA\b", re.IGNORECASE)
SCHEMA_NAME = re.compile(r"schema", re.IGNORECASE)


def test_a_run_name_is_the_same_within_a_process_and_differs_between_processes() -> None:
    code = (
        f"import sys; sys.path.insert(0, {str(ROOT)!r}); "
        "from benchmarks._run_names import run_name; print(run_name('bench_x'))"
    )
    others = {
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        ).stdout.strip()
        for _ in range(2)
    }
    mine = run_name("bench_x")
    assert mine == run_name("bench_x")
    assert mine.startswith("bench_x_")
    assert len(others | {mine}) == 3


@pytest.mark.parametrize("prefix", ["", "Bench", "bench-x", 'x"; DROP', "x" * 60])
def test_a_prefix_that_is_not_a_plain_identifier_is_refused(prefix: str) -> None:
    with pytest.raises(ValueError, match=r"prefix|longer"):
        run_name(prefix)


def _fixed(node: ast.expr | None) -> bool:
    """A name written out in the source: a string, an f-string, or a collection of them."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str)
    if isinstance(node, ast.JoinedStr):
        return True  # a naming rule of its own, not run_name's
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return any(_fixed(e) for e in node.elts)
    if isinstance(node, ast.Dict):
        return any(_fixed(v) for v in node.values)
    if isinstance(node, ast.DictComp):
        return _fixed(node.value)
    if isinstance(node, ast.ListComp | ast.SetComp | ast.GeneratorExp):
        return _fixed(node.elt)
    return False


def _ddl_names(tree: ast.Module) -> set[str]:
    """The variables filled into CREATE/DROP SCHEMA statements."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.JoinedStr):
            continue
        text = "".join(str(v.value) for v in node.values if isinstance(v, ast.Constant))
        if DDL.search(text):
            for value in node.values:
                if isinstance(value, ast.FormattedValue):
                    names.update(n.id for n in ast.walk(value.value) if isinstance(n, ast.Name))
    return names


def _schema_variables(tree: ast.Module) -> set[str]:
    """Names holding schema names: so called, filled into DDL, or looped to such names."""
    tracked = _ddl_names(tree)
    tracked |= {
        n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and SCHEMA_NAME.search(n.id)
    }
    tracked |= {
        a.arg for a in ast.walk(tree) if isinstance(a, ast.arg) and SCHEMA_NAME.search(a.arg)
    }
    loops = [n for n in ast.walk(tree) if isinstance(n, ast.For | ast.comprehension)]
    grew = True
    while grew:
        grew = False
        for loop in loops:
            if (
                isinstance(loop.target, ast.Name)
                and loop.target.id in tracked
                and isinstance(loop.iter, ast.Name)
                and loop.iter.id not in tracked
            ):
                tracked.add(loop.iter.id)
                grew = True
    return tracked


def _parameters(tree: ast.Module) -> dict[str, list[str]]:
    functions = (ast.FunctionDef, ast.AsyncFunctionDef)
    return {
        f.name: [a.arg for a in f.args.posonlyargs + f.args.args]
        for f in ast.walk(tree)
        if isinstance(f, functions)
    }


def _call_findings(call: ast.Call, tracked: set[str], params: dict[str, list[str]]) -> list[str]:
    found = [
        f"{k.arg}= a fixed name"
        for k in call.keywords
        if k.arg is not None and SCHEMA_NAME.search(k.arg) and _fixed(k.value)
    ]
    is_schema_option = any(
        isinstance(a, ast.Constant) and isinstance(a.value, str) and SCHEMA_NAME.search(a.value)
        for a in call.args
    )
    if isinstance(call.func, ast.Attribute) and call.func.attr == "add_argument":
        if is_schema_option:
            found += [
                f"a {k.arg} schema name"
                for k in call.keywords
                if k.arg == "default" and _fixed(k.value)
            ]
        return found
    if isinstance(call.func, ast.Name) and call.func.id in params:
        names = params[call.func.id]
        found += [
            f"{call.func.id}({name}=a fixed name)"
            for name, arg in zip(names, call.args, strict=False)
            if name in tracked and _fixed(arg)
        ]
    return found


def fixed_schema_names(source: str) -> list[str]:
    """Where ``source`` writes out a schema name instead of taking one from run_name."""
    tree = ast.parse(source)
    tracked, params = _schema_variables(tree), _parameters(tree)
    found: list[str] = []
    for node in ast.walk(tree):
        where = f"line {getattr(node, 'lineno', '?')}: "
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if LITERAL_DDL.search(node.value):
                found.append(where + "a schema named in DDL")
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = [t.id for t in targets if isinstance(t, ast.Name)]
            if any(n in tracked for n in names) and _fixed(node.value):
                found.append(where + f"{names[0]} = a fixed name")
        elif isinstance(node, ast.For | ast.comprehension):
            target = node.target
            if isinstance(target, ast.Name) and target.id in tracked and _fixed(node.iter):
                found.append(where + f"{target.id} loops over fixed names")
        elif isinstance(node, ast.Call):
            found += [where + f for f in _call_findings(node, tracked, params)]
    return found


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_benchmark_writes_out_a_schema_name(path: Path) -> None:
    relative = str(path.relative_to(ROOT))
    source = path.read_text()
    if relative in OWN_SERVER_ONLY:
        # True only while it takes no server from outside: no --dsn, no DSN variable.
        assert 'add_argument("--dsn"' not in source
        assert "STEEPLE_TEST_DSN" not in source
        assert "STEEPLE_DATABASE_URL" not in source
        return
    assert fixed_schema_names(source) == []


@pytest.mark.parametrize(
    "source",
    [
        'SCHEMA = "bench_x"\nasync def f(c):\n    await c.execute(f"DROP SCHEMA {SCHEMA}")',
        'async def f(c):\n    await c.execute("DROP SCHEMA IF EXISTS bench_x CASCADE")',
        'async def f(c, mode):\n    schema = f"bench_{mode}"\n    await install(c, schema=schema)',
        'SIDES = ("a", "b")\nasync def f(c):\n    for s in SIDES:\n'
        "        await c.execute(f'CREATE SCHEMA \"{s}\"')",
        "def run(dsn, schema): ...\nrun('dsn', f'bench_{1}')",
        'p.add_argument("--schema", default="bench_x")',
        'async def f(c):\n    await install(c, schema="bench_x")',
    ],
)
def test_the_reading_finds_each_way_of_writing_a_name_out(source: str) -> None:
    assert fixed_schema_names(source)


def test_the_reading_accepts_run_names() -> None:
    source = (
        'SCHEMA = run_name("bench_x")\n'
        'SCHEMAS = {k: run_name(v) for k, v in {"a": "bench_a"}.items()}\n'
        "async def f(c, schema):\n"
        "    await c.execute(f'DROP SCHEMA IF EXISTS \"{schema}\" CASCADE')\n"
        "    await install(c, schema=SCHEMA)\n"
    )
    assert fixed_schema_names(source) == []
