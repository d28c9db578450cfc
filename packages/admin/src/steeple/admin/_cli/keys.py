"""Storage keys: generate one (to stdout or a new mode-600 file), show the key ids in use."""

from __future__ import annotations

import os
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated

import typer

from steeple.admin._cli import output
from steeple.admin._cli.options import (
    ConfigOpt,
    DsnOpt,
    JsonOpt,
    KeysFileOpt,
    NamespaceOpt,
    SchemaOpt,
    Typer,
    Where,
)
from steeple.admin._cli.output import fail, guard, say
from steeple.admin.settings import KEYS_ENV, CliError, ExitCode

__all__ = ["register"]

keys_app = Typer(
    help="Storage keys: generate one, show the key ids in use.",
    no_args_is_help=True,
    rich_markup_mode=None,
)


def register(app: typer.Typer) -> None:
    """Add the ``keys`` commands to ``app``."""
    app.add_typer(keys_app, name="keys")


@keys_app.command("generate")
def keys_generate(
    key_id: Annotated[
        str | None,
        typer.Option("--id", show_default=False, help="Key id (default: key-YYYYMMDD-HHMMSS)."),
    ] = None,
    out: Annotated[
        Path | None,
        typer.Option(
            "--out",
            show_default=False,
            help="Write the key to this new file, readable by you only (mode 600), instead "
            "of printing it.",
        ),
    ] = None,
    force: Annotated[
        bool, typer.Option("--force", help="With --out: replace an existing file.")
    ] = False,
) -> None:
    """Make a new 32-byte storage key, written as id:base64 (a secret: keep it as one).

    Use it with --keys-file FILE, keys_file in steeple.toml, or STEEPLE_KEYS. To rotate,
    put the new key first and keep the old ones after it.
    """
    from steeple.admin.settings import write_key_file
    from steeple.keyring import StorageKey

    chosen = key_id or datetime.now(UTC).strftime("key-%Y%m%d-%H%M%S")
    try:
        key = StorageKey.generate(chosen)
    except ValueError as exc:
        raise fail(CliError(str(exc), code=ExitCode.USAGE)) from None
    if out is not None:
        guard(lambda: write_key_file(out, key, force=force))
        say(f"wrote key {key.key_id!r} to {out} (mode 600): use --keys-file {out}", stderr=True)
        return
    sys.stdout.write(f"{key.key_id}:{key.to_base64()}\n")
    say(
        f"this is a secret: put it in {KEYS_ENV} or a keys file (chmod 600; or use --out "
        "FILE); to rotate, put the new key first and keep the old ones after it",
        stderr=True,
    )


@keys_app.command("show")
def keys_show(
    keys_file: KeysFileOpt = None,
    dsn: DsnOpt = None,
    config: ConfigOpt = None,
    schema: SchemaOpt = None,
    namespace: NamespaceOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Show the configured key ids (the first seals), never the key material.

    With a database (--dsn, STEEPLE_DATABASE_URL or the settings file) it also counts the
    namespace's records sealed under each key id: a previous key with none can be retired;
    an id in use but not configured must be added back.
    """
    from steeple.admin._cli.options import remember_dsn
    from steeple.admin.settings import DSN_ENV

    where = Where(dsn=dsn, config=config, schema=schema, namespace=namespace, keys_file=keys_file)
    remember_dsn(dsn or os.environ.get(DSN_ENV))
    file = guard(where.settings_file)
    from steeple.admin._backend import keyring_from

    keyring = guard(lambda: keyring_from(keys_file, file.keys_file))
    has_database = bool(dsn or os.environ.get(DSN_ENV) or file.dsn or file.embedded)
    target = guard(where.target) if has_database else None
    ids = list(keyring.key_ids)
    usage: dict[str, int] | None = None
    if target is not None:
        chosen = target

        async def body() -> dict[str, int]:

            from steeple.postgres.recurring import admin

            conn = await chosen.connect()
            try:
                return await admin.sealed_key_usage(
                    conn, schema=chosen.schema, namespace=chosen.namespace
                )
            finally:
                await conn.close()

        usage = output.run(body, target)
    rows = []
    for key_id in dict.fromkeys([*ids, *(usage or {})]):
        role = ("primary" if key_id == ids[0] else "previous") if key_id in ids else "missing"
        rows.append(
            {
                "key_id": key_id,
                "role": role,
                "records": None if usage is None else usage.get(key_id, 0),
            }
        )
    if as_json:
        output.print_json({"primary": ids[0], "key_ids": ids, "keys": rows})
        return
    labels = {
        "primary": "primary (seals)",
        "previous": "previous (opens only)",
        "missing": "NOT CONFIGURED: add it back",
    }
    columns = ["key id", "role"]
    if usage is not None and target is not None:
        columns.append(f"records in {target.namespace}")
    output.print_table(
        "storage keys",
        columns,
        [
            [str(row["key_id"]), labels[str(row["role"])]]
            + ([] if usage is None else [str(row["records"])])
            for row in rows
        ],
    )
