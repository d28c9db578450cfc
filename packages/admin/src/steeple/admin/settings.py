"""What the ``steeple`` command reads from its environment: DSN, keys, namespace configuration.

Keys come from the ``STEEPLE_KEYS`` environment variable or a keys file, never from a
command-line argument (arguments show up in ``ps`` output and shell history).
"""

from __future__ import annotations

import base64
import enum
import os
import re
import stat
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path

import attrs

from steeple.core.config import RecurringConfig
from steeple.core.dsn import check_dsn, redact_dsn
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


def resolve_dsn(dsn: str | None, *, required: bool = True) -> str | None:
    """Return the DSN from the option or ``STEEPLE_DATABASE_URL``.

    Raises:
        CliError: (config) neither is set and ``required``, or the value is not a
            well-formed ``postgresql://`` / ``postgres://`` URL (see
            :func:`steeple.core.dsn.check_dsn`).
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
            f"the database URL {redact_dsn(value)} is not a postgresql:// URL",
            code=ExitCode.CONFIG,
            hint="use a libpq URL such as postgresql://user@host:5432/dbname",
        )
    try:
        check_dsn(value)
    except ConfigurationError as exc:
        # The message names the fault, never the text; the URL is shown redacted.
        raise CliError(
            f"{exc} (given: {redact_dsn(value)})",
            code=ExitCode.CONFIG,
            hint=f"fix --dsn or {DSN_ENV}",
        ) from None
    return value


def parse_keys(text: str, *, source: str) -> Keyring:
    """Parse ``id1:base64,id2:base64`` (commas or newlines; ``#`` comments) into a keyring.

    The first key is the primary (it seals); the others only open older records.

    Raises:
        CliError: (config) empty, malformed, or rejected by the keyring; the message
            names the source, the key's position and a well-formed id, never key material
            (nor a malformed id, which is often key material in the wrong place).
    """
    keys: list[StorageKey] = []
    hint = "write keys as id1:base64,id2:base64 (generate one with `steeple keys generate`)"
    for raw in re.split(r"[,\n]", text):
        item = raw.strip()
        if not item or item.startswith("#"):
            continue
        where = f"key {len(keys) + 1} in {source}"
        # Ids may hold ':' but base64 never does, so the material follows the last ':'.
        key_id, sep, material = item.rpartition(":")
        if not sep or not key_id:
            raise CliError(f"{where} is not written as id:base64", code=ExitCode.CONFIG, hint=hint)
        try:
            keys.append(StorageKey.from_base64(key_id, material))
        except ConfigurationError as exc:
            if _looks_like_material(key_id.rpartition(":")[2]) or _looks_like_material(
                key_id.partition(":")[0]
            ):
                raise CliError(
                    f"{where} is not written as id:base64 (the key material is not after "
                    "the last ':'; is the line the wrong way round or followed by more text?)",
                    code=ExitCode.CONFIG,
                    hint=hint,
                ) from None
            raise CliError(f"{where}: {exc}", code=ExitCode.CONFIG, hint=hint) from None
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


def _looks_like_material(text: str) -> bool:
    try:
        return len(base64.b64decode(text.strip(), validate=True)) >= 16
    except ValueError:
        return False


_KEYS_FILE_MAX_BYTES = 64 * 1024


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
            if not stat.S_ISREG(mode):
                raise IsADirectoryError(0, "not a regular file")
            with keys_file.open("rb") as handle:
                data = handle.read(_KEYS_FILE_MAX_BYTES + 1)
        except OSError as exc:
            reason = exc.strerror or type(exc).__name__
            raise CliError(
                f"cannot read the keys file {str(keys_file)!r}: {reason}",
                code=ExitCode.CONFIG,
                hint="check the path and its permissions",
            ) from None
        if len(data) > _KEYS_FILE_MAX_BYTES:
            raise CliError(
                f"the keys file {str(keys_file)!r} is larger than 64 KiB; it holds at most 8 "
                "keys as id:base64 lines",
                code=ExitCode.CONFIG,
            )
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            # The decoder's message quotes a byte of the file: it is not repeated.
            raise CliError(
                f"the keys file {str(keys_file)!r} is not UTF-8 text (raw key bytes?)",
                code=ExitCode.CONFIG,
                hint="write keys as id:base64 lines (generate one with `steeple keys generate`)",
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


_DURATION = re.compile(r"(\d{1,12})\s*(ms|s|m|h|d)")
_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}
_MAX_DURATION = timedelta(days=36_500)


def _shown(text: str) -> str:
    return repr(text if len(text) <= 40 else text[:37] + "...")


def parse_duration(text: str, *, what: str) -> timedelta:
    """Parse ``90s``, ``5m``, ``2h``, ``7d``, ``1h30m`` or a bare number of seconds.

    At most 100 years; no sign, fraction, ``nan`` or ``inf``.

    Raises:
        CliError: (usage) anything else.
    """
    value = text.strip().lower()
    total: float | None = None
    if len(value) <= 64:
        if value.isascii() and value.isdigit():
            total = float(int(value))
        else:
            pos = 0
            total = 0.0
            for match in _DURATION.finditer(value):
                if match.start() != pos:
                    break
                total += int(match.group(1)) * _UNITS[match.group(2)]
                pos = match.end()
            if pos != len(value) or not value:
                total = None
    if total is None:
        raise CliError(
            f"{what} {_shown(text)} is not a duration",
            code=ExitCode.USAGE,
            hint="write it like 30s, 5m, 2h, 7d or 1h30m",
        )
    if total > _MAX_DURATION.total_seconds():
        raise CliError(
            f"{what} {_shown(text)} is longer than 100 years",
            code=ExitCode.USAGE,
            hint="write it like 30s, 5m, 2h, 7d or 1h30m",
        )
    return timedelta(seconds=total)


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
