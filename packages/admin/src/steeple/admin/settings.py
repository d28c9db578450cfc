"""What the ``steeple`` command reads from its environment: DSN, keys, namespace configuration.

Keys come from the ``STEEPLE_KEYS`` environment variable or a keys file, never from a
command-line argument (arguments show up in ``ps`` output and shell history).
"""

from __future__ import annotations

import enum
import os
import re
import stat
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path

import attrs

from steeple.core.config import RecurringConfig
from steeple.core.errors import ConfigurationError, SteepleError
from steeple.keyring import Keyring, StorageKey

__all__ = [
    "DSN_ENV",
    "KEYS_ENV",
    "CliError",
    "ExitCode",
    "NamespaceSettings",
    "load_keyring",
    "parse_duration",
    "parse_keys",
    "redact_dsn",
    "resolve_dsn",
]

DSN_ENV = "STEEPLE_DATABASE_URL"
"""Environment variable naming the PostgreSQL server (a libpq URL)."""
KEYS_ENV = "STEEPLE_KEYS"
"""Environment variable holding the storage keys: ``id1:base64,id2:base64`` (first = primary)."""


class ExitCode(enum.IntEnum):
    """The ``steeple`` command's exit codes."""

    OK = 0
    FAILED = 1
    """The operation was refused (not found, wrong state, conflict) or failed otherwise."""
    USAGE = 2
    """The command line is wrong (unknown option, missing argument)."""
    CONFIG = 3
    """Configuration is missing or wrong (DSN, keys, namespace settings)."""
    UNAVAILABLE = 4
    """A needed service (PostgreSQL, the broker, the embedded server) is unreachable."""


class CliError(SteepleError):
    """A failure the command reports as one line (plus what to do) and an exit code."""

    def __init__(self, message: str, *, code: ExitCode, hint: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.hint = hint


def redact_dsn(dsn: str) -> str:
    """Return ``dsn`` with any password replaced by ``***`` (safe to print)."""
    return re.sub(r"(://[^:/@]*:)[^@]+@", r"\1***@", dsn)


def resolve_dsn(dsn: str | None, *, required: bool = True) -> str | None:
    """Return the DSN from the option or ``STEEPLE_DATABASE_URL``.

    Raises:
        CliError: (config) neither is set and ``required``, or the value is not a
            ``postgresql://`` / ``postgres://`` URL.
    """
    value = dsn or os.environ.get(DSN_ENV) or None
    if value is None:
        if required:
            raise CliError(
                "no database given",
                code=ExitCode.CONFIG,
                hint=f"pass --dsn postgresql://... or set {DSN_ENV}",
            )
        return None
    if not value.startswith(("postgresql://", "postgres://")):
        raise CliError(
            f"the database URL {redact_dsn(value)!r} is not a postgresql:// URL",
            code=ExitCode.CONFIG,
            hint="use a libpq URL such as postgresql://user@host:5432/dbname",
        )
    return value


def parse_keys(text: str, *, source: str) -> Keyring:
    """Parse ``id1:base64,id2:base64`` (commas or newlines; ``#`` comments) into a keyring.

    The first key is the primary (it seals); the others only open older records.

    Raises:
        CliError: (config) empty, malformed, or rejected by the keyring; the message
            names the source and the key id, never the key material.
    """
    keys: list[StorageKey] = []
    for raw in re.split(r"[,\n]", text):
        item = raw.strip()
        if not item or item.startswith("#"):
            continue
        key_id, sep, material = item.rpartition(":")
        if not sep or not key_id:
            raise CliError(
                f"a key in {source} is not written as id:base64",
                code=ExitCode.CONFIG,
                hint="write keys as id1:base64,id2:base64 "
                "(generate one with `steeple keys generate`)",
            )
        try:
            keys.append(StorageKey.from_base64(key_id, material))
        except ConfigurationError as exc:
            raise CliError(
                f"{source}: {exc}",
                code=ExitCode.CONFIG,
                hint="generate a key with `steeple keys generate`",
            ) from None
    if not keys:
        raise CliError(
            f"{source} holds no keys",
            code=ExitCode.CONFIG,
            hint="generate a key with `steeple keys generate`",
        )
    try:
        return Keyring(*keys)
    except ConfigurationError as exc:
        raise CliError(f"{source}: {exc}", code=ExitCode.CONFIG) from None


def load_keyring(keys_file: Path | None, *, environ: Mapping[str, str] | None = None) -> Keyring:
    """Build the keyring from ``--keys-file`` or ``STEEPLE_KEYS`` (the file wins).

    Raises:
        CliError: (config) neither is set, the file cannot be read, or the keys are
            malformed.
    """
    env = os.environ if environ is None else environ
    if keys_file is not None:
        try:
            mode = keys_file.stat().st_mode
            text = keys_file.read_text(encoding="utf-8")
        except OSError as exc:
            raise CliError(
                f"cannot read the keys file {str(keys_file)!r}: {exc.strerror or exc}",
                code=ExitCode.CONFIG,
                hint="check the path and its permissions",
            ) from None
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise CliError(
                f"the keys file {str(keys_file)!r} is readable by other users",
                code=ExitCode.CONFIG,
                hint=f"restrict it: chmod 600 {keys_file}",
            )
        return parse_keys(text, source=f"keys file {str(keys_file)!r}")
    text = env.get(KEYS_ENV, "")
    if not text.strip():
        raise CliError(
            "no storage keys given",
            code=ExitCode.CONFIG,
            hint=f"set {KEYS_ENV}=id:base64 or pass --keys-file PATH "
            "(create a key with `steeple keys generate`)",
        )
    return parse_keys(text, source=KEYS_ENV)


_DURATION = re.compile(r"(\d+)\s*(ms|s|m|h|d)")
_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str, *, what: str) -> timedelta:
    """Parse ``90s``, ``5m``, ``2h``, ``7d``, ``1h30m`` or a bare number of seconds.

    Raises:
        CliError: (usage) anything else.
    """
    value = text.strip().lower()
    if value.isdigit() and len(value) <= 12:
        return timedelta(seconds=int(value))
    pos = 0
    total = 0.0
    for match in _DURATION.finditer(value):
        if match.start() != pos:
            break
        total += int(match.group(1)) * _UNITS[match.group(2)]
        pos = match.end()
    if pos != len(value) or not value:
        raise CliError(
            f"{what} {text!r} is not a duration",
            code=ExitCode.USAGE,
            hint="write it like 30s, 5m, 2h, 7d or 1h30m",
        )
    try:
        return timedelta(seconds=total)
    except OverflowError:
        raise CliError(f"{what} {text[:40]!r} is too long", code=ExitCode.USAGE) from None


@attrs.frozen
class NamespaceSettings:
    """A namespace's configuration as the command line gives it (the stored binding must match).

    Raises:
        CliError: (config) the values are outside steeple's limits.
    """

    namespace: str
    max_definitions: int = 1000
    max_occurrences: int = 100_000
    delivery_window: timedelta = timedelta(days=1)
    lease_duration: timedelta = timedelta(seconds=60)

    def config(self) -> RecurringConfig:
        """Return the validated :class:`RecurringConfig`.

        Raises:
            CliError: (config) a value is out of range.
        """
        try:
            return RecurringConfig(
                self.namespace,
                self.max_definitions,
                self.max_occurrences,
                delivery_window=self.delivery_window,
                lease_duration=self.lease_duration,
            )
        except ConfigurationError as exc:
            raise CliError(str(exc), code=ExitCode.CONFIG) from None
