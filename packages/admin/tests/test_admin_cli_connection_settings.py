"""pooler and listen_dsn in steeple.toml, and libpq key=value DSNs wherever the CLI takes one."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import pytest
from typer.testing import CliRunner

from steeple.admin._cli.options import Where
from steeple.admin.cli import app
from steeple.admin.settings import CliError, ExitCode, load_settings_file

pytestmark = pytest.mark.usefixtures("clean_env")

SECRET = "s3cr3t-Pw"
UNREACHABLE = "postgresql://postgres@127.0.0.1:1/nowhere"
DIRECT = f"postgresql://app:{SECRET}@db1:5432/app"
DIRECT_KV = f"host=db1 port=5432 dbname=app user=app password={SECRET}"


def invoke(args: list[str], env: dict[str, str] | None = None) -> Any:
    return CliRunner().invoke(app, args, env=env, catch_exceptions=False)


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o600)
    return path


def key_value(url: str) -> str:
    """The libpq key=value form of a ``postgresql://`` URL (as operators write it)."""
    parts = urlsplit(url)
    pairs = {
        "host": parts.hostname,
        "port": parts.port,
        "dbname": parts.path.lstrip("/"),
        "user": unquote(parts.username or ""),
        "password": unquote(parts.password or ""),
    }
    return " ".join(f"{k}='{v}'" for k, v in pairs.items() if v)


# --- pooler and listen_dsn in the file --------------------------------------------------


def test_the_file_alone_gives_pooler_and_listen_dsn(tmp_path: Path) -> None:
    config = write(
        tmp_path / "steeple.toml",
        f'dsn = "{UNREACHABLE}"\npooler = "transaction"\nlisten_dsn = "{DIRECT_KV}"\n',
    )
    target = Where(config=config).target()
    assert target.pooler == "transaction"
    # the key=value listen_dsn is rewritten once, to the URL every driver reads
    assert target.listen_dsn is not None
    assert target.listen_dsn.startswith("postgresql://")
    assert "host=db1" in target.listen_dsn
    assert f"password={SECRET}" in target.listen_dsn
    # without the keys: a direct connection, no listen DSN
    bare = write(tmp_path / "bare.toml", f'dsn = "{UNREACHABLE}"\n')
    plain = Where(config=bare).target()
    assert plain.pooler is None
    assert plain.listen_dsn is None


def test_the_environment_overrides_the_file_and_a_flag_the_environment(tmp_path: Path) -> None:
    write(
        tmp_path / "steeple.toml",
        f'dsn = "{UNREACHABLE}"\npooler = "transaction"\n',
    )
    config = str(tmp_path / "steeple.toml")
    by_env = invoke(["tasks", "--config", config], {"STEEPLE_POOLER": "sesion"})
    assert by_env.exit_code == ExitCode.CONFIG, by_env.output
    assert "'sesion'" in by_env.stderr
    by_flag = invoke(
        ["tasks", "--config", config, "--pooler", "transaction"], {"STEEPLE_POOLER": "sesion"}
    )
    # past the settings: the (unreachable) server is tried
    assert by_flag.exit_code == ExitCode.UNAVAILABLE, by_flag.output


def test_listen_dsn_flag_then_environment_then_file(tmp_path: Path) -> None:
    bad_env = f"host=db1 password={SECRET} port=99999"
    config = write(
        tmp_path / "steeple.toml",
        f'dsn = "{UNREACHABLE}"\nlisten_dsn = "{DIRECT}"\n',
    )
    base = ["worker", "--app", "no_such_module_here:app", "--config", str(config)]
    # the file's value alone passes; the app is what is missing
    alone = invoke(base)
    assert "no_such_module_here" in alone.stderr, alone.output
    # the environment overrides the file (and its bad port is reported, masked)
    by_env = invoke(base, {"STEEPLE_LISTEN_DSN": bad_env})
    assert by_env.exit_code == ExitCode.CONFIG, by_env.output
    assert "port" in by_env.stderr
    assert "STEEPLE_LISTEN_DSN" in by_env.stderr
    assert SECRET not in by_env.output
    # a flag overrides the environment
    by_flag = invoke([*base, "--listen-dsn", DIRECT_KV], {"STEEPLE_LISTEN_DSN": bad_env})
    assert "no_such_module_here" in by_flag.stderr, by_flag.output
    assert SECRET not in by_flag.output


@pytest.mark.parametrize("value", ['"session"', '"Transaction"', "true", '""'])
def test_a_bad_pooler_in_the_file_names_the_key_and_what_to_write(
    tmp_path: Path, value: str
) -> None:
    config = write(tmp_path / "steeple.toml", f"pooler = {value}\n")
    with pytest.raises(CliError) as caught:
        load_settings_file(config)
    assert caught.value.code == ExitCode.CONFIG
    assert "'pooler' in the settings file" in str(caught.value)
    assert "unknown key" not in str(caught.value)
    if value != "true":
        assert 'pooler = "transaction"' in (caught.value.hint or "")
    result = invoke(["tasks", "--config", str(config)])
    assert result.exit_code == ExitCode.CONFIG
    assert "'pooler'" in result.stderr


def test_listen_dsn_is_masked_in_every_output_that_shows_settings(tmp_path: Path) -> None:
    config = write(
        tmp_path / "steeple.toml",
        f'dsn = "{DIRECT}"\nlisten_dsn = "{DIRECT_KV}"\npooler = "transaction"\n',
    )
    settings = load_settings_file(config)
    assert settings.listen_dsn == DIRECT_KV
    target = Where(config=config).target()
    for shown in (repr(settings), str(settings), repr(target), str(target)):
        assert SECRET not in shown
        assert "***" in shown
    # a malformed listen_dsn: refused, naming the key, masked
    for bad in (f"host=db1 password={SECRET} port=99999", f"host=db1 password='{SECRET}"):
        write(config, f'listen_dsn = "{bad}"\n')
        with pytest.raises(CliError) as caught:
            load_settings_file(config)
        assert SECRET not in str(caught.value)
        assert "listen_dsn" in (caught.value.hint or "")
        result = invoke(["tasks", "--config", str(config)])
        assert result.exit_code == ExitCode.CONFIG
        assert SECRET not in result.output
    # a password in a listen_dsn others can read is refused, as for dsn
    write(config, f'listen_dsn = "{DIRECT}"\n')
    config.chmod(0o644)
    with pytest.raises(CliError, match="listen_dsn") as refused:
        load_settings_file(config)
    assert SECRET not in str(refused.value)


# --- key=value DSNs ---------------------------------------------------------------------------


@pytest.mark.postgres
async def test_a_key_value_dsn_works_in_every_place_a_dsn_is_given(
    seeded: Any, tmp_path: Path
) -> None:
    conninfo = key_value(seeded.dsn)
    env = seeded.env()
    del env["STEEPLE_DATABASE_URL"]
    by_flag = await asyncio.to_thread(invoke, ["tasks", "--json", "--dsn", conninfo], env)
    assert by_flag.exit_code == 0, by_flag.output
    assert sorted(t["task_id"] for t in json.loads(by_flag.stdout)["items"]) == sorted(
        seeded.task_ids
    )
    by_env = await asyncio.to_thread(
        invoke, ["schedules", "--json"], {**env, "STEEPLE_DATABASE_URL": conninfo}
    )
    assert by_env.exit_code == 0, by_env.output
    config = write(tmp_path / "steeple.toml", f'dsn = "{conninfo}"\n')
    by_file = await asyncio.to_thread(invoke, ["tasks", "--json", "--config", str(config)], env)
    assert by_file.exit_code == 0, by_file.output


@pytest.mark.parametrize(
    ("conninfo", "fault"),
    [
        (f"host=127.0.0.1 password={SECRET} dbname", "valid key=value"),  # a word without '='
        (f"host=127.0.0.1 password='{SECRET} dbname=x", "valid key=value"),  # open quote
        (f"host=127.0.0.1 port=99999 password={SECRET}", "from 1 to 65535"),  # a bad port
    ],
)
@pytest.mark.parametrize("where", ["flag", "env", "file"])
def test_a_wrong_key_value_dsn_is_a_typed_error_with_the_password_masked(
    tmp_path: Path, conninfo: str, fault: str, where: str
) -> None:
    args, env = ["tasks"], {}
    if where == "flag":
        args += ["--dsn", conninfo]
    elif where == "env":
        env["STEEPLE_DATABASE_URL"] = conninfo
    else:
        config = write(tmp_path / "steeple.toml", f'dsn = "{conninfo}"\n')
        args += ["--config", str(config)]
    result = invoke(args, env)
    assert result.exit_code == ExitCode.CONFIG, result.output
    assert SECRET not in result.output
    assert "Traceback" not in result.output
    assert fault in result.stderr
