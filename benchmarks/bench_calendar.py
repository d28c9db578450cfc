"""How long does CronCalendar.next_after take? Side by side with croniter when it is installed.

Run: ``.venv/bin/python benchmarks/bench_calendar.py [--number N]``

For each expression it prints the microseconds per ``next_after`` call (calendar parsed
once, same start instant every call) and, if ``croniter`` is importable, the microseconds
per ``get_next`` on a reused croniter object reset to the same start (``set_current``),
with the expression translated to croniter's dialect (weekdays 0-6, intersecting
day-of-month and weekday via ``day_or=False``). croniter is not a steeple dependency:
without it that column is skipped. The two columns are measured in the same run, so their
ratio is meaningful on any machine; the absolute numbers are not.
"""

from __future__ import annotations

import argparse
import timeit
from collections.abc import Callable
from datetime import UTC, datetime

from steeple.core.calendar import CronCalendar

START = datetime(2025, 3, 14, 9, 26, 53, 589000, tzinfo=UTC)

# (steeple expression, croniter translation or None when croniter cannot express it)
CASES: list[tuple[str, str | None, str]] = [
    ("*/5 * * * *", "*/5 * * * *", "every 5 minutes"),
    ("0 9 * * Mon-Fri", "0 9 * * mon-fri", "weekdays at 09:00"),
    ("0 0 1 * *", "0 0 1 * *", "monthly"),
    ("15,45 8-18 * Jan-Jun,Sep-Dec Tue,Thu", "15,45 8-18 * 1-6,9-12 2,4", "lists and ranges"),
    ("59 23 31 12 *", "59 23 31 12 *", "yearly, end of year"),
    ("0 0 13 * Fri", "0 0 13 * 5", "Friday the 13th (intersection)"),
    ("0 0 29 2 Mon", "0 0 29 2 1", "Feb 29 on a Monday (sparse: 2044)"),
    ("0 0 31 * Sun", "0 0 31 * 0", "31st on a Sunday (sparse)"),
    ("0 0 30 2 *", None, "never fires (exhausted at once)"),
]


def per_call_us(call: Callable[[], object], number: int) -> float:
    # Best of 5 repeats: the least disturbed by other processes on a shared machine.
    return min(timeit.repeat(call, number=number, repeat=5)) / number * 1e6


def croniter_call(expression: str) -> Callable[[], object] | None:
    try:
        from croniter import croniter  # type: ignore[import-untyped]
    except ImportError:
        return None
    iterator = croniter(expression, START, day_or=False)

    def call() -> object:
        iterator.set_current(START, force=True)
        return iterator.get_next(datetime)

    return call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--number", type=int, default=2000, help="calls per timing repeat")
    args = parser.parse_args()
    number: int = args.number

    have_croniter = croniter_call("* * * * *") is not None
    header = f"{'expression':40} {'steeple us':>11} {'croniter us':>12} {'ratio':>7}  result"
    print(f"next_after from {START.isoformat()}; best of 5 x {number} calls")
    print(header)
    print("-" * len(header))
    for expression, translated, note in CASES:
        calendar = CronCalendar.parse(expression)
        ours = per_call_us(lambda calendar=calendar: calendar.next_after(START), number)  # type: ignore[misc]
        result = calendar.next_after(START)
        theirs_text, ratio_text = "-", "-"
        if have_croniter and translated is not None:
            call = croniter_call(translated)
            assert call is not None
            reference = call()
            if reference != result:
                theirs_text = "differs"
            else:
                theirs = per_call_us(call, max(number // 10, 50))
                theirs_text = f"{theirs:12.2f}"
                ratio_text = f"{theirs / ours:6.1f}x"
        shown = result.isoformat() if result else "None (exhausted)"
        print(f"{expression:40} {ours:11.2f} {theirs_text:>12} {ratio_text:>7}  {shown}  # {note}")
    parse_us = per_call_us(lambda: CronCalendar.parse("15,45 8-18 * Jan-Jun,Sep-Dec Tue,Thu"), 500)
    print(f"\nCronCalendar.parse of a list/range expression: {parse_us:.2f} us")
    if not have_croniter:
        print("croniter is not installed: comparison column skipped")


if __name__ == "__main__":
    main()
