"""Run the mutant catalogue: every named mutant must be killed by the tests of its area.

Each mutant of ``mutants/catalogue.toml`` replaces exact text (each ``find`` must occur exactly
once in its file; a mutant may list several ``find``/``replace`` pairs when one invariant is
guarded twice) in a scratch copy of the committed tree (``git archive HEAD``), runs its
tests there with this interpreter and the copy's ``packages/*/src`` first on the path, and
restores the file. A mutant is killed when its tests fail; a survivor fails the run. The
canary mutants run first and prove that a mutation reaches the code the tests import (a
Python module and an SQL migration the tests install): if one survives, nothing else is
trusted and the run stops.

Usage (``nox -s mutants -- ARGS`` passes ARGS here)::

    python mutants/run.py                          # the whole catalogue
    python mutants/run.py --sample 8 --seed 1234 --budget 300
    python mutants/run.py --only queue.pause.ignored --only keyring.nonce.fixed
    python mutants/run.py --area keyring --results mutants.json
    python mutants/run.py --all-killers --only queue.complete.token-dropped

``--all-killers`` runs each chosen mutant's tests to the end instead of stopping at the
first failure, and records every test that failed: which tests, of which kinds, defend an
invariant (a run without it names only the first).

``--seed`` defaults to ``STEEPLE_MUTANT_SEED``, else a fresh one; it is always printed so a
sample can be replayed. ``--budget`` time-boxes the run: no mutant starts after that many
seconds and one still running then is stopped; both are listed as not run (they neither
pass nor fail the run). The canaries always run to the end. ``--no-canaries`` leaves them
out, for a short time box that they would fill (CI's sample): a mutation that does not
reach the tests makes every mutant survive, which fails the run anyway; the canaries only
say why, first.

``killers`` in an entry lists node ids of its tests that killed it in an earlier run. They run
first (with ``-x``); if one fails, the mutant is killed. If they all pass (or no longer
exist), the hint is stale and the entry's whole ``tests`` run as without it: a hint only
saves time, it never decides a verdict alone. ``--all-killers`` ignores the hints.
``--record-killers`` writes what killed each mutant of the run back into the catalogue.

``--jobs N`` runs N mutants at once, each in its own scratch copy (every test uses its own
schema, so two mutants' tests do not meet); the canaries run first, alone.

A mutant whose entry has ``equivalent = "why"`` changes nothing any test could observe (a
second guard behind a first one that already decides): it is not run, not sampled, and
listed as equivalent with its reason, unless ``--only`` names it (then it runs, to show it
still survives or that it no longer does).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CATALOGUE = ROOT / "mutants" / "catalogue.toml"
# One mutant's tests may not run longer than this (a hang counts as killed, and says so).
PER_MUTANT_TIMEOUT = 1200.0
# "FAILED <node id> - <message>": a node id may hold spaces (a parameter's id). A captured
# log line ("ERROR    logger:file.py:12 ...") is not one: a node id starts with its file.
_FAILED_LINE = re.compile(r"^(FAILED|ERROR) ([^\s:]+\.py(?:::.+?)?)(?= - |$)")


class CatalogueError(Exception):
    """The catalogue is malformed, or an anchor text is missing or ambiguous."""


@dataclass(frozen=True)
class Mutant:
    """One named mutation and the tests that must kill it."""

    name: str
    area: str
    invariant: str
    file: str
    find: tuple[str, ...]
    replace: tuple[str, ...]
    tests: tuple[str, ...]
    canary: bool = False
    equivalent: str = ""  # why no test can tell it apart from the code (not run then)
    killers: tuple[str, ...] = ()  # node ids of its tests that killed it before: tried first


@dataclass
class Outcome:
    """What running one mutant's tests showed."""

    mutant: Mutant
    status: str  # "killed", "survived", "not run", "equivalent"
    by: str = ""
    seconds: float = 0.0
    detail: list[str] = field(default_factory=list)
    killers: list[str] = field(default_factory=list)  # every failing test (--all-killers)
    hint: str = ""  # "hit": a recorded killer killed it; "stale": they passed, tests ran


def load(path: Path = CATALOGUE) -> list[Mutant]:
    """Read the catalogue; refuse duplicate names, missing fields and unknown keys."""
    with path.open("rb") as f:
        entries = tomllib.load(f).get("mutant", [])
    mutants: list[Mutant] = []
    seen: set[str] = set()
    required = {"name", "area", "invariant", "file", "find", "replace", "tests"}
    for entry in entries:
        missing = required - entry.keys()
        extra = entry.keys() - required - {"canary", "equivalent", "killers"}
        if missing or extra:
            raise CatalogueError(f"{entry.get('name', entry)}: missing {missing}, unknown {extra}")
        if entry["name"] in seen:
            raise CatalogueError(f"two mutants are named {entry['name']!r}")
        finds, replaces = _texts(entry["find"]), _texts(entry["replace"])
        if len(finds) != len(replaces) or not finds:
            raise CatalogueError(f"{entry['name']}: find and replace must pair up")
        if any(f == r for f, r in zip(finds, replaces, strict=True)):
            raise CatalogueError(f"{entry['name']}: a replacement changes nothing")
        equivalent = entry.get("equivalent", "")
        if not isinstance(equivalent, str) or ("equivalent" in entry and not equivalent.strip()):
            raise CatalogueError(f"{entry['name']}: equivalent must say why, as a string")
        seen.add(entry["name"])
        mutants.append(
            Mutant(
                name=entry["name"],
                area=entry["area"],
                invariant=entry["invariant"],
                file=entry["file"],
                find=finds,
                replace=replaces,
                tests=tuple(entry["tests"]),
                canary=bool(entry.get("canary", False)),
                equivalent=equivalent.strip(),
                killers=_killers(entry),
            )
        )
    return mutants


def _killers(entry: dict[str, object]) -> tuple[str, ...]:
    """Return an entry's recorded killers: node ids within its own ``tests``."""
    killers = entry.get("killers", [])
    if not isinstance(killers, list) or not all(isinstance(k, str) and k for k in killers):
        raise CatalogueError(f"{entry['name']}: killers must be a list of test node ids")
    paths = _test_paths(tuple(entry["tests"]))  # type: ignore[arg-type]
    for killer in killers:
        if not any(_within(killer, path) for path in paths):
            raise CatalogueError(f"{entry['name']}: killer {killer!r} is not one of its tests")
    return tuple(killers)


def _test_paths(tests: tuple[str, ...]) -> list[str]:
    """Return the files, directories and node ids of a ``tests`` list (not its options)."""
    paths, skip = [], False
    for arg in tests:
        if not skip and not arg.startswith("-"):
            paths.append(arg)
        skip = arg in ("-k", "-m")
    return paths


def _within(node: str, path: str) -> bool:
    return node == path or node.startswith((f"{path}::", f"{path}[", f"{path.rstrip('/')}/"))


def _texts(value: object) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise CatalogueError(f"find and replace are a string or a list of strings, not {value!r}")


def check_anchors(mutants: list[Mutant], tree: Path) -> None:
    """Fail loudly unless every mutant's text occurs exactly once in its file under ``tree``."""
    problems = []
    for m in mutants:
        target = tree / m.file
        if not target.is_file():
            problems.append(f"{m.name}: no file {m.file}")
            continue
        text = target.read_text(encoding="utf-8")
        for find in m.find:
            count = text.count(find)
            if count != 1:
                problems.append(
                    f"{m.name}: its text occurs {count} times in {m.file} (must be once)"
                )
    if problems:
        raise CatalogueError(
            "the catalogue no longer matches the code:\n  " + "\n  ".join(problems)
        )


def scratch_tree(into: Path) -> Path:
    """Extract the committed tree (HEAD) into ``into``: what the mutants mutate."""
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", "--format=tar", "HEAD"],
        check=True,
        capture_output=True,
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def _env(tree: Path) -> dict[str, str]:
    env = dict(os.environ)
    sources = [str(p) for p in sorted(tree.glob("packages/*/src"))]
    # Before the editable installs' .pth entries (which point at the real tree); then this
    # directory, for the plugin that stops Hypothesis shrinking (see _no_shrink.py).
    path = [*sources, str(Path(__file__).resolve().parent), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(path).rstrip(os.pathsep)
    env.setdefault("STEEPLE_TEST_DSN", "postgresql://postgres@127.0.0.1:5432/test")
    return env


def run_one(
    m: Mutant, tree: Path, budget: float | None = None, *, all_killers: bool = False
) -> Outcome:
    """Apply ``m`` in ``tree``, run its tests, restore the file, and say what happened.

    Its recorded killers run first; only a test that fails kills it, so when they pass the
    entry's whole ``tests`` run (the hint was stale). Tests still running after ``budget``
    seconds are stopped and the mutant is "not run"; after :data:`PER_MUTANT_TIMEOUT` (a
    hang the mutant caused) it counts as killed. ``all_killers``: ignore the hints, run
    every test (no ``-x``) and list each one that failed.
    """
    target = tree / m.file
    original = target.read_text(encoding="utf-8")
    mutated = original
    for find, replace_by in zip(m.find, m.replace, strict=True):
        if mutated.count(find) != 1:
            raise CatalogueError(f"{m.name}: its text does not occur exactly once in {m.file}")
        mutated = mutated.replace(find, replace_by)
    target.write_text(mutated, encoding="utf-8")
    start = time.monotonic()
    try:
        if m.killers and not all_killers:
            hinted = _pytest(m, tree, m.killers, budget, hint=True)
            if hinted is not None and hinted.status in ("killed", "not run"):
                return replace(hinted, hint="hit" if hinted.status == "killed" else "")
            left = None if budget is None else budget - (time.monotonic() - start)
            if left is not None and left <= 0:
                return Outcome(m, "not run", "(stopped at the budget)", time.monotonic() - start)
            outcome = _pytest(m, tree, m.tests, left, all_killers=all_killers)
            assert outcome is not None
            return replace(outcome, seconds=time.monotonic() - start, hint="stale")
        outcome = _pytest(m, tree, m.tests, budget, all_killers=all_killers)
        assert outcome is not None
        return outcome
    finally:
        target.write_text(original, encoding="utf-8")


def _pytest(
    m: Mutant,
    tree: Path,
    tests: tuple[str, ...],
    budget: float | None,
    *,
    all_killers: bool = False,
    hint: bool = False,
) -> Outcome | None:
    """Run ``tests`` on the mutated ``tree``; ``None`` when a hint's node ids are gone."""
    command = [
        sys.executable, "-m", "pytest", *([] if all_killers else ["-x"]), "-q", "-rfE",
        "-p", "no:randomly", "-p", "no:cacheprovider", "-p", "_no_shrink",
        *tests,
    ]  # fmt: skip
    start = time.monotonic()
    try:
        done = subprocess.run(
            command,
            cwd=tree,
            env=_env(tree),
            capture_output=True,
            text=True,
            timeout=min(PER_MUTANT_TIMEOUT, budget) if budget is not None else PER_MUTANT_TIMEOUT,
        )
    except subprocess.TimeoutExpired:
        if budget is not None and budget < PER_MUTANT_TIMEOUT:
            return Outcome(m, "not run", "(stopped at the budget)", time.monotonic() - start)
        return Outcome(m, "killed", "(timeout)", time.monotonic() - start)
    seconds = time.monotonic() - start
    lines = done.stdout.splitlines()
    if done.returncode == 0:
        return Outcome(m, "survived", "", seconds)
    if done.returncode in (4, 5):  # usage error or nothing collected
        if hint:
            return None  # a recorded killer that no longer exists: the hint is stale
        raise CatalogueError(f"{m.name}: pytest exit {done.returncode}: {lines[-3:]}")
    killers = list(dict.fromkeys(g.group(2) for g in map(_FAILED_LINE.match, lines) if g))
    by = killers[0] if killers else f"(pytest exit {done.returncode})"
    return Outcome(m, "killed", by, seconds, lines[-15:], killers)


def _in_scope(mutants: list[Mutant], args: argparse.Namespace) -> list[Mutant]:
    """Return the mutants (canaries aside) that ``--only`` and ``--area`` select."""
    rest = [m for m in mutants if not m.canary]
    if args.only:
        unknown = set(args.only) - {m.name for m in mutants}
        if unknown:
            raise CatalogueError(f"no mutants named {sorted(unknown)}")
        rest = [m for m in rest if m.name in args.only]
    if args.area:
        rest = [m for m in rest if m.area in args.area]
    return rest


def set_aside(mutants: list[Mutant], args: argparse.Namespace) -> list[Mutant]:
    """Return the equivalent mutants in scope that are listed, not run (none in a sample)."""
    if args.only or args.sample is not None:
        return []
    return [m for m in _in_scope(mutants, args) if m.equivalent]


def choose(mutants: list[Mutant], args: argparse.Namespace, seed: int) -> list[Mutant]:
    """Return the canaries, then the selected mutants (a seeded sample when asked).

    Equivalent mutants are left out unless ``--only`` names them.
    """
    canaries = [m for m in mutants if m.canary and not getattr(args, "no_canaries", False)]
    rest = [m for m in _in_scope(mutants, args) if args.only or not m.equivalent]
    if args.sample is not None and args.sample < len(rest):
        rest = random.Random(seed).sample(rest, args.sample)
    return canaries + rest


def table(outcomes: list[Outcome]) -> str:
    """Return the outcomes as a Markdown table, then the totals."""
    rows = ["| mutant | invariant | killed | by | s |", "|---|---|---|---|---|"]
    for o in outcomes:
        killed = {
            "killed": "yes",
            "survived": "**no**",
            "not run": "not run",
            "equivalent": "equivalent",
        }[o.status]
        by = o.mutant.equivalent if o.status == "equivalent" else ", ".join(o.killers) or o.by
        rows.append(
            f"| {o.mutant.name} | {o.mutant.invariant} | {killed} | {by} | {o.seconds:.0f} |"
        )
    statuses = ("killed", "survived", "not run", "equivalent")
    counts = {s: sum(o.status == s for o in outcomes) for s in statuses}
    rows.append("")
    rows.append(
        f"{len(outcomes)} mutants: {counts['killed']} killed, {counts['survived']} survived, "
        f"{counts['not run']} not run, {counts['equivalent']} equivalent (not run); "
        f"{sum(o.seconds for o in outcomes):.0f} s of tests"
    )
    return "\n".join(rows)


def record_killers(path: Path, outcomes: list[Outcome]) -> int:
    """Write each killed mutant's killers into its catalogue entry (a survivor's are removed).

    Returns how many entries changed. Only the ``killers = [...]`` line after an entry's
    ``tests`` line is touched; the rest of the catalogue keeps its text.
    """
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    found = {o.mutant.name: o for o in outcomes if o.status in ("killed", "survived")}
    out: list[str] = []
    current: Outcome | None = None
    changed = 0
    for line in lines:
        if line.startswith("[[mutant]]"):
            current = None
        elif line.startswith("name = "):
            current = found.get(tomllib.loads(line)["name"])
        elif current is not None and line.startswith("killers = "):
            continue  # replaced below, after the tests line
        out.append(line)
        if current is not None and line.startswith("tests = "):
            names = [k for k in (current.killers or [current.by]) if not k.startswith("(")]
            if current.status == "killed" and names:
                out.append(f"killers = [{', '.join(json.dumps(n) for n in names)}]\n")
            changed += tuple(names if current.status == "killed" else ()) != (
                current.mutant.killers
            )
    path.write_text("".join(out), encoding="utf-8")
    return changed


def _run_chosen(
    chosen: list[Mutant], trees: list[Path], args: argparse.Namespace, started: float
) -> list[Outcome] | None:
    """Run the canaries alone, then the others on ``trees`` (one mutant per tree at once).

    Returns the outcomes in ``chosen`` order, or ``None`` when a canary survived.
    """
    outcomes: dict[str, Outcome] = {}
    lock = threading.Lock()
    free = list(trees)

    def one(m: Mutant) -> Outcome:
        left = None if args.budget is None else args.budget - (time.monotonic() - started)
        if m.canary:
            left = None  # the canaries always run to the end: everything rests on them
        elif left is not None and left <= 0:
            return Outcome(m, "not run")
        with lock:
            tree = free.pop()
        try:
            outcome = run_one(m, tree, left, all_killers=args.all_killers)
        finally:
            with lock:
                free.append(tree)
        with lock:
            _print(outcome)
        return outcome

    for m in (m for m in chosen if m.canary):
        outcomes[m.name] = one(m)
        if outcomes[m.name].status != "killed":
            print(f"canary {m.name} survived: mutations do not reach the tests")
            return None
    rest = [m for m in chosen if not m.canary]
    pool = ThreadPoolExecutor(max_workers=len(trees))
    try:
        for outcome in pool.map(one, rest):
            outcomes[outcome.mutant.name] = outcome
    finally:  # a stopped run starts no further mutant; those running end their tests
        pool.shutdown(wait=True, cancel_futures=True)
    return [outcomes[m.name] for m in chosen]


def _print(outcome: Outcome) -> None:
    hint = {"hit": " [recorded killer]", "stale": " [recorded killers passed: all tests ran]"}
    print(
        f"  {outcome.status:8} {outcome.mutant.name} {outcome.by} ({outcome.seconds:.0f} s)"
        f"{hint.get(outcome.hint, '')}"
    )
    for killer in outcome.killers[1:]:
        print(f"           also killed by {killer}")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    """Run the chosen mutants; exit 1 when any survives (or a canary does), 2 on a bad entry."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--catalogue", type=Path, default=CATALOGUE)
    parser.add_argument("--only", action="append", default=[], help="a mutant's name")
    parser.add_argument("--area", action="append", default=[], help="queue, recurring, ...")
    parser.add_argument("--sample", type=int, help="run this many mutants chosen by --seed")
    parser.add_argument("--seed", type=int, help="default: STEEPLE_MUTANT_SEED, else random")
    parser.add_argument(
        "--budget", type=float, help="time box in seconds (mutants past it: not run)"
    )
    parser.add_argument(
        "--no-canaries", action="store_true", help="leave the canaries out (short time boxes)"
    )
    parser.add_argument("--results", type=Path, help="also write the outcomes here (JSON)")
    parser.add_argument("--list", action="store_true", help="list the catalogue and exit")
    parser.add_argument(
        "--all-killers",
        action="store_true",
        help="run each mutant's tests to the end and record every test that kills it",
    )
    parser.add_argument(
        "--jobs", type=int, default=1, help="mutants run at once, each in its own copy"
    )
    parser.add_argument(
        "--record-killers",
        action="store_true",
        help="write what killed each mutant into the catalogue's killers (tried first next time)",
    )
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error("--jobs must be at least 1")
    # The real tree is never touched, but a stopped run must still end its pytest and
    # remove the scratch copy: SIGTERM unwinds like Ctrl-C.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    seed_text = os.environ.get("STEEPLE_MUTANT_SEED")
    seed = args.seed if args.seed is not None else int(seed_text or random.randrange(10**6))
    try:
        mutants = load(args.catalogue)
        if args.list:
            for m in mutants:
                print(f"{m.name}\t{m.file}\t{m.invariant}")
            return 0
        chosen = choose(mutants, args, seed)
        aside = set_aside(mutants, args)
        print(
            f"mutants: seed {seed} (replay: STEEPLE_MUTANT_SEED={seed}); {len(chosen)} chosen, "
            f"{len(aside)} equivalent set aside"
        )
        sys.stdout.flush()
        started = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="steeple-mutants-") as scratch:
            trees = [Path(scratch) / f"tree-{i}" for i in range(args.jobs)]
            for tree in trees:
                tree.mkdir()
                scratch_tree(tree)
            check_anchors(mutants, trees[0])  # the whole catalogue, whatever was chosen
            ran = _run_chosen(chosen, trees, args, started)
            if ran is None:
                return 1
            outcomes = ran
    except CatalogueError as e:
        print(f"mutants: {e}", file=sys.stderr)
        return 2
    outcomes += [Outcome(m, "equivalent") for m in aside]
    print(table(outcomes))
    print(f"seed {seed}; {time.monotonic() - started:.0f} s from start to end")
    if args.record_killers:
        changed = record_killers(args.catalogue, outcomes)
        print(f"killers recorded in {args.catalogue}: {changed} entries changed")
    if args.results is not None:
        args.results.write_text(
            json.dumps(
                [
                    {
                        "name": o.mutant.name,
                        "invariant": o.mutant.invariant,
                        "status": o.status,
                        "by": o.by,
                        "seconds": round(o.seconds, 1),
                        "equivalent": o.mutant.equivalent,
                        "hint": o.hint,
                        **({"killers": o.killers} if args.all_killers else {}),
                    }
                    for o in outcomes
                ],
                indent=1,
            )
            + "\n",
            encoding="utf-8",
        )
    return 1 if any(o.status == "survived" for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
