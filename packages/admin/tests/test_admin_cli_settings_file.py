"""steeple.toml: settings written once; environment variables override it, flags override both."""

from __future__ import annotations

import asyncio
import json
import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from steeple.admin.cli import app
from steeple.admin.settings import (
    CliError,
    ExitCode,
    SettingsFile,
    format_duration,
    load_settings_file,
    parse_duration,
)

pytestmark = pytest.mark.usefixtures("clean_env")


def invoke(args: list[str], env: dict[str, str] | None = None, cwd: Path | None = None) -> Any:
    runner = CliRunner()
    if cwd is None:
        return runner.invoke(app, args, env=env, catch_exceptions=False)
    here = Path.cwd()
    os.chdir(cwd)
    try:
        return runner.invoke(app, args, env=env, catch_exceptions=False)
    finally:
        os.chdir(here)


def write(path: Path, text: str, mode: int = 0o600) -> Path:
    path.write_text(text)
    path.chmod(mode)
    return path


# --- the file on its own -------------------------------------------------------------------


def test_a_full_file_is_read_with_paths_relative_to_it(tmp_path: Path) -> None:
    path = write(
        tmp_path / "steeple.toml",
        'dsn = "postgresql://app@db.internal:5432/app?sslmode=verify-full"\n'
        'schema = "billing"\nqueue_schema = "billing_q"\nnamespace = "shop"\n'
        'keys_file = "secrets/keys"\nembedded = "../pg"\n'
        'max_definitions = 50\nmax_occurrences = 5000\ndelivery_window = "2h"\nlease = 90\n',
    )
    settings = load_settings_file(None, cwd=tmp_path)
    assert settings == SettingsFile(
        path=path,
        dsn="postgresql://app@db.internal:5432/app?sslmode=verify-full",
        embedded=tmp_path / ".." / "pg",
        schema="billing",
        queue_schema="billing_q",
        namespace="shop",
        keys_file=tmp_path / "secrets" / "keys",
        max_definitions=50,
        max_occurrences=5000,
        delivery_window=timedelta(hours=2),
        lease=timedelta(seconds=90),
    )
    assert load_settings_file(None, cwd=tmp_path / "nowhere") == SettingsFile()


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ('colour = "red"\n', "unknown key 'colour'"),
        ("schema = 5\n", "'schema' in the settings file"),
        ('max_definitions = "many"\n', "whole number"),
        ("max_definitions = true\n", "whole number"),
        ('lease = "soon"\n', "not a duration"),
        ("lease = [1]\n", "a duration"),
        ("schema = \n", "not valid TOML"),
        ('dsn = "mysql://x@h/db"\n', "not a postgresql:// URL"),
        ("[namespace]\nname = 'x'\n", "'namespace' in the settings file"),  # flat: no tables
    ],
)
def test_bad_files_are_configuration_errors(tmp_path: Path, text: str, fragment: str) -> None:
    path = write(tmp_path / "steeple.toml", text)
    with pytest.raises(CliError) as refused:
        load_settings_file(path)
    assert refused.value.code == ExitCode.CONFIG
    assert fragment in str(refused.value)


def test_a_password_in_a_file_others_can_read_is_refused(tmp_path: Path) -> None:
    text = 'dsn = "postgresql://app:Hunter2Secret@127.0.0.1/app"\n'
    open_file = write(tmp_path / "open.toml", text, 0o644)
    with pytest.raises(CliError) as refused:
        load_settings_file(open_file)
    assert "chmod 600" in str(refused.value.hint)
    assert "Hunter2Secret" not in str(refused.value) + str(refused.value.hint)
    private = write(tmp_path / "private.toml", text, 0o600)
    settings = load_settings_file(private)
    assert settings.dsn is not None
    assert "Hunter2Secret" not in repr(settings)
    no_password = write(tmp_path / "plain.toml", 'dsn = "postgresql://app@h/app"\n', 0o644)
    assert load_settings_file(no_password).dsn == "postgresql://app@h/app"


def test_a_named_file_that_is_missing_or_binary(tmp_path: Path) -> None:
    with pytest.raises(CliError, match="cannot read the settings file"):
        load_settings_file(tmp_path / "missing.toml")
    with pytest.raises(CliError, match="cannot read the settings file"):
        load_settings_file(tmp_path)  # a directory
    binary = tmp_path / "b.toml"
    binary.write_bytes(b"schema = '\xff'\n")
    with pytest.raises(CliError, match="not UTF-8"):
        load_settings_file(binary)
    big = tmp_path / "big.toml"
    big.write_text("# " + "x" * 70_000)
    with pytest.raises(CliError, match="64 KiB"):
        load_settings_file(big)


@pytest.mark.parametrize("text", ["0s", "90s", "5m", "1h30m", "1d", "7d", "250ms", "1d2h3m4s"])
def test_format_duration_is_read_back_by_parse_duration(text: str) -> None:
    value = parse_duration(text, what="x")
    assert parse_duration(format_duration(value), what="x") == value
    assert format_duration(timedelta(seconds=300)) == "5m"


# --- precedence, through the command -----------------------------------------------------------


@pytest.mark.postgres
async def test_flags_override_environment_override_file(
    pg_schema: tuple[str, str], tmp_path: Path
) -> None:
    """The namespace is initialized with the file's quotas; every command then opens it
    with nothing but the file; the environment and then a flag each win over it."""
    dsn, schema = pg_schema
    keys = tmp_path / "keys"
    assert invoke(["keys", "generate", "--out", str(keys)]).exit_code == 0
    write(
        tmp_path / "steeple.toml",
        f'dsn = "{dsn}"\nschema = "{schema}"\nqueue_schema = "{schema}"\n'
        'namespace = "shop"\nkeys_file = "keys"\nmax_definitions = 7\nlease = "90s"\n',
    )

    def run(args: list[str], env: dict[str, str] | None = None) -> Any:
        return asyncio.to_thread(invoke, args, env, tmp_path)

    initialized = await run(["initialize"])
    assert initialized.exit_code == 0, initialized.output
    assert "namespace 'shop'" in initialized.stdout
    assert (await run(["migrate"])).exit_code == 0
    listed = await run(["schedules", "--json"])
    assert listed.exit_code == 0, listed.output
    # the environment overrides the file: a quota the namespace was not initialized with
    by_env = await run(["schedules"], {"STEEPLE_MAX_DEFINITIONS": "9"})
    assert by_env.exit_code == ExitCode.CONFIG
    assert "initialized with max_definitions=7" in by_env.stderr
    assert "used max_definitions=9" in by_env.stderr
    # ... and a flag overrides the environment
    by_flag = await run(["schedules", "--max-definitions", "7"], {"STEEPLE_MAX_DEFINITIONS": "9"})
    assert by_flag.exit_code == 0, by_flag.output
    # a namespace given by the environment is another namespace: not initialized
    other = await run(["schedules"], {"STEEPLE_NAMESPACE": "other"})
    assert other.exit_code == ExitCode.CONFIG
    assert "steeple initialize" in other.stderr
    # STEEPLE_KEYS overrides the file's keys_file (and here it is the wrong key)
    wrong = await run(["schedules"], {"STEEPLE_KEYS": "k9:" + "A" * 43 + "="})
    assert wrong.exit_code == ExitCode.CONFIG
    assert "key" in wrong.stderr
    # the DSN: the environment wins over the file, a flag over both
    unreachable = "postgresql://postgres@127.0.0.1:1/nowhere"
    env_dsn = await run(["schedules"], {"STEEPLE_DATABASE_URL": unreachable})
    assert env_dsn.exit_code == ExitCode.UNAVAILABLE
    flag_dsn = await run(["schedules", "--dsn", dsn], {"STEEPLE_DATABASE_URL": unreachable})
    assert flag_dsn.exit_code == 0, flag_dsn.output
    # --config names another file; STEEPLE_CONFIG too
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    moved = write(elsewhere / "prod.toml", (tmp_path / "steeple.toml").read_text())
    (elsewhere / "keys").write_bytes(keys.read_bytes())
    (elsewhere / "keys").chmod(0o600)
    by_option = await asyncio.to_thread(invoke, ["schedules", "--config", str(moved)])
    assert by_option.exit_code == 0, by_option.output
    by_variable = await asyncio.to_thread(
        invoke, ["tasks", "--json"], {"STEEPLE_CONFIG": str(moved)}
    )
    assert by_variable.exit_code == 0, by_variable.output
    assert json.loads(by_variable.stdout)["items"] == []
    missing = await asyncio.to_thread(invoke, ["schedules", "--config", str(tmp_path / "x")])
    assert missing.exit_code == ExitCode.CONFIG


def test_a_bad_file_in_the_current_directory_stops_every_database_command(
    tmp_path: Path,
) -> None:
    write(tmp_path / "steeple.toml", 'shema = "typo"\n')
    for args in (["schedules"], ["tasks"], ["keys", "show"], ["migrate"], ["purge", "--dry-run"]):
        result = invoke(args, {"STEEPLE_KEYS": "k1:" + "A" * 43 + "="}, tmp_path)
        assert result.exit_code == ExitCode.CONFIG, (args, result.output)
        assert "unknown key 'shema'" in result.stderr
    # commands that read no settings are not affected
    assert invoke(["keys", "generate"], None, tmp_path).exit_code == 0
    assert invoke(["--version"], None, tmp_path).exit_code == 0


def test_embedded_without_a_server_there_says_so(tmp_path: Path) -> None:
    write(tmp_path / "steeple.toml", 'embedded = "pg-here"\n')
    result = invoke(["tasks"], None, tmp_path)
    assert result.exit_code == ExitCode.CONFIG
    assert "holds none" in result.stderr
    assert "steeple demo" in result.stderr


@pytest.mark.parametrize(
    "text",
    [
        "max_definitions = " + "7" * 5000 + "\n",  # Python refuses to read it
        "lease = 0x" + "f" * 5000 + "\n",  # read, but has no decimal text under the limit
        "max_definitions = 0x" + "f" * 5000 + "\n",
    ],
)
def test_an_integer_of_thousands_of_digits_is_one_configuration_error(
    tmp_path: Path, text: str
) -> None:
    write(tmp_path / "steeple.toml", text)
    result = invoke(["tasks"], None, tmp_path)
    assert result.exit_code == ExitCode.CONFIG, result.output
    lines = result.stderr.strip().splitlines()
    assert lines[0].startswith("steeple: error: ")
    assert "the settings file" in lines[0]
    assert len(lines) <= 2
    assert all(len(line) < 400 for line in lines)
    assert "Traceback" not in result.output
