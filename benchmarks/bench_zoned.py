"""How much does a time zone cost? ZonedCalendar.next_after beside CronCalendar.next_after.

Run: ``.venv/bin/python benchmarks/bench_zoned.py [--number N]``

For each expression it prints the microseconds per ``CronCalendar.next_after`` call (UTC)
and per ``ZonedCalendar.next_after`` call in UTC (the default, which delegates), in
Europe/Berlin from an ordinary instant, and in Europe/Berlin from just before the spring
gap and just inside the autumn repeat (where the search looks at the transition), each
with its ratio to CronCalendar. Calendars are parsed once; every call starts from the
same instant. Best of 5 repeats. The columns are measured in the same run, so the ratios
are meaningful on any machine; the absolute numbers are not.
"""

from __future__ import annotations

import argparse
import timeit
from collections.abc import Callable
from datetime import UTC, datetime

from steeple.core.calendar import CronCalendar
from steeple.core.zoned import ZonedCalendar

ORDINARY = datetime(2025, 3, 14, 9, 26, 53, 589000, tzinfo=UTC)
# Europe/Berlin 2025: 03-30 02:00 CET -> 03:00 CEST at 01:00Z; 10-26 03:00 CEST -> 02:00 CET
# at 01:00Z (02:00-02:59 twice).
BEFORE_GAP = datetime(2025, 3, 30, 0, 50, tzinfo=UTC)  # 01:50 CET
IN_REPEAT = datetime(2025, 10, 26, 0, 20, tzinfo=UTC)  # 02:20 CEST, first pass

CASES: list[tuple[str, str]] = [
    ("*/5 * * * *", "every 5 minutes (interval)"),
    ("0 * * * *", "hourly (interval)"),
    ("30 2 * * *", "daily at 02:30 (time of day, in the gap)"),
    ("0 9 * * Mon-Fri", "weekdays at 09:00"),
    ("15,45 8-18 * Jan-Jun,Sep-Dec Tue,Thu", "lists and ranges"),
    ("0 0 13 * Fri", "Friday the 13th (sparse)"),
    ("0 0 29 2 Mon", "Feb 29 on a Monday (very sparse)"),
]


def per_call_us(call: Callable[[], object], number: int) -> float:
    # Best of 5 repeats: the least disturbed by other processes on a shared machine.
    return min(timeit.repeat(call, number=number, repeat=5)) / number * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--number", type=int, default=2000, help="calls per timing repeat")
    number: int = parser.parse_args().number

    columns = ["Cron us", "UTC", "Berlin", "pre-gap", "repeat"]
    header = f"{'expression':38} " + " ".join(f"{c:>15}" for c in columns)
    print(f"next_after, best of 5 x {number} calls; ratio to CronCalendar in brackets")
    print(header)
    print("-" * len(header))
    ratios: list[float] = []
    for expression, note in CASES:
        plain = CronCalendar.parse(expression)
        base = per_call_us(lambda c=plain: c.next_after(ORDINARY), number)  # type: ignore[misc]
        cells = [f"{base:15.2f}"]
        for zone, start in (
            ("UTC", ORDINARY),
            ("Europe/Berlin", ORDINARY),
            ("Europe/Berlin", BEFORE_GAP),
            ("Europe/Berlin", IN_REPEAT),
        ):
            zoned = ZonedCalendar.parse(expression, zone)
            took = per_call_us(lambda z=zoned, s=start: z.next_after(s), number)  # type: ignore[misc]
            ratio = took / base
            if zone != "UTC":
                ratios.append(ratio)
            cells.append(f"{took:7.2f} ({ratio:4.1f}x)")
        print(f"{expression:38} " + " ".join(f"{c:>15}" for c in cells) + f"  # {note}")
    print(f"\nBerlin / CronCalendar: {min(ratios):.1f}x to {max(ratios):.1f}x")


if __name__ == "__main__":
    main()
