"""The names of what one benchmark run creates on a PostgreSQL server, and their removal.

Several people may run benchmarks against one server at once. With a fixed schema name,
one run drops the other's schema while it works (deadlocks, failed runs) or has its
workers take the other's tasks (timeouts, wrong numbers). So every schema (or replication
slot) a run creates is named by :func:`run_name`: a fixed prefix and the run's process id.
Processes a run starts for it (workers) are given the names, never compute their own.
:func:`drop_schemas` removes a run's schemas; benchmarks call it in a ``finally`` block,
so a failure or Ctrl-C (``asyncio.run`` cancels the main task, ``finally`` runs) leaves
nothing behind.
"""

from __future__ import annotations

import os
import re

_PREFIX = re.compile(r"[a-z][a-z0-9_]*\Z")
_LONGEST = 63  # PostgreSQL keeps the first 63 bytes of an identifier (NAMEDATALEN - 1)


def run_name(prefix: str) -> str:
    """``prefix`` made this run's own: ``{prefix}_{process id}``.

    The same in every call of one process, different in two processes alive at once.
    ``prefix`` is lower-case letters, digits and ``_`` (no quoting needed anywhere).
    """
    if not _PREFIX.match(prefix):
        raise ValueError(f"a run name's prefix is [a-z][a-z0-9_]*, not {prefix!r}")
    name = f"{prefix}_{os.getpid()}"
    if len(name) > _LONGEST:
        raise ValueError(f"{name!r} is longer than PostgreSQL's {_LONGEST} characters")
    return name


async def drop_schemas(dsn: str, *schemas: str) -> None:
    """Drop ``schemas`` (those that exist) with everything in them."""
    import asyncpg

    conn = await asyncpg.connect(dsn)
    try:
        for schema in schemas:
            await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    finally:
        await conn.close()
