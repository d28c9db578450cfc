"""What the ``steeple`` command reads from its environment: DSN, keys, namespace configuration.

Keys come from the ``STEEPLE_KEYS`` environment variable or a keys file, never from a
command-line argument (arguments show up in ``ps`` output and shell history).

Settings are written once in a settings file, ``steeple.toml`` (found in the current
directory, or named by ``--config`` / ``STEEPLE_CONFIG``); environment variables override
it and command-line flags override both. See :func:`load_settings_file` for its keys.
"""

from __future__ import annotations

import base64
import enum
import os
import re
import stat
import sys
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import attrs

from steeple.core.dsn import check_dsn, conninfo_url, dsn_secrets, redact_dsn
from steeple.core.errors import ConfigurationError, SteepleError

if TYPE_CHECKING:
    # Imported where used: the command's --help must not load cryptography.
    from steeple.core.config import RecurringConfig
    from steeple.keyring import Keyring, StorageKey

__all__ = [
    "CONFIG_ENV",
    "DSN_ENV",
    "KEYS_ENV",
    "SETTINGS_FILE",
    "CliError",
    "ExitCode",
    "NamespaceSettings",
    "SettingsFile",
    "format_duration",
    "load_keyring",
    "load_settings_file",
    "parse_duration",
    "parse_keys",
    "redact_dsn",
    "resolve_dsn",
    "write_key_file",
]

DSN_ENV = "STEEPLE_DATABASE_URL"
"""Environment variable naming the PostgreSQL server (a libpq URL)."""
KEYS_ENV = "STEEPLE_KEYS"
"""Environment variable holding the storage keys: ``id1:base64,id2:base64`` (first = primary)."""
CONFIG_ENV = "STEEPLE_CONFIG"
"""Environment variable naming the settings file (as ``--config`` does)."""
SETTINGS_FILE = "steeple.toml"
"""The settings file read from the current directory when none is named."""


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


def resolve_dsn(dsn: str | None, *, required: bool = True, source: str | None = None) -> str | None:
    """Return the DSN from the option or ``STEEPLE_DATABASE_URL``, as a ``postgresql://`` URL.

    Both libpq forms are accepted: a URL, and a ``key=value`` string (``host=db1,db2
    port=5432 dbname=app user=app target_session_attrs=read-write``), which is rewritten
    here, once, to the URL every driver reads (:func:`steeple.core.dsn.conninfo_url`).
    ``source`` names where the value came from in error hints.

    Raises:
        CliError: (config) neither is set and ``required``, or the value is neither a
            well-formed ``postgresql://`` / ``postgres://`` URL (see
            :func:`steeple.core.dsn.check_dsn`) nor a valid ``key=value`` string; the
            message shows it redacted.
    """
    value = dsn or os.environ.get(DSN_ENV) or None
    if value is None:
        if required:
            raise CliError(
                "no database given",
                code=ExitCode.CONFIG,
                hint=f'pass --dsn postgresql://..., set {DSN_ENV}, or write dsn = "..." in '
                f'{SETTINGS_FILE} (or embedded = "DIR" there for the private PostgreSQL '
                "steeple demo starts in DIR, e.g. .steeple/demo)",
            )
        return None
    fix = source or f"--dsn or {DSN_ENV}"
    try:
        url = conninfo_url(value)
    except ConfigurationError as exc:
        raise CliError(
            f"{exc} (given: {redact_dsn(value)})", code=ExitCode.CONFIG, hint=f"fix {fix}"
        ) from None
    if not url.startswith(("postgresql://", "postgres://")):
        raise CliError(
            f"the database URL {redact_dsn(value)} is not a postgresql:// URL",
            code=ExitCode.CONFIG,
            hint="use a libpq URL such as postgresql://user@host:5432/dbname, or key=value "
            "pairs such as host=db1,db2 port=5432 dbname=app user=app",
        )
    try:
        check_dsn(url)
    except ConfigurationError as exc:
        # The message names the fault, never the text; the URL is shown redacted.
        raise CliError(
            f"{exc} (given: {redact_dsn(value)})", code=ExitCode.CONFIG, hint=f"fix {fix}"
        ) from None
    return url


def parse_keys(text: str, *, source: str) -> Keyring:
    """Parse ``id1:base64,id2:base64`` (commas or newlines; ``#`` comments) into a keyring.

    The first key is the primary (it seals); the others only open older records.

    Raises:
        CliError: (config) empty, malformed, or rejected by the keyring; the message
            names the source, the key's position and a well-formed id, never key material
            (nor a malformed id, which is often key material in the wrong place).
    """
    from steeple.keyring import Keyring, StorageKey

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
    """Parse ``90s``, ``5m``, ``2h``, ``7d``, ``1h30m`` or ``250ms``.

    At most 100 years; no sign, fraction, ``nan`` or ``inf``. A bare number is refused: is
    ``--in 10`` ten seconds or ten minutes? The unit is written, so nobody has to guess.

    Raises:
        CliError: (usage) anything else, a number without a unit included.
    """
    value = text.strip().lower()
    total: float | None = None
    if value.isascii() and value.isdigit():
        shown = value if len(value) <= 20 else value[:17] + "..."
        raise CliError(
            f"{what} {_shown(text)} has no unit",
            code=ExitCode.USAGE,
            hint=f"write {shown}s for seconds ({shown}m minutes, {shown}h hours, {shown}d days)",
        )
    if len(value) <= 64:
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
        from steeple.core.config import RecurringConfig

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


def format_duration(value: timedelta) -> str:
    """Write ``value`` the way :func:`parse_duration` reads it, largest unit first (``1h30m``).

    Sub-millisecond parts are dropped; zero is ``0s``.
    """
    millis = max(0, value // timedelta(milliseconds=1))
    parts = []
    for unit, size in (("d", 86_400_000), ("h", 3_600_000), ("m", 60_000), ("s", 1000)):
        count, millis = divmod(millis, size)
        if count:
            parts.append(f"{count}{unit}")
    if millis:
        parts.append(f"{millis}ms")
    return "".join(parts) or "0s"


def write_key_file(path: Path, key: StorageKey, *, force: bool = False) -> None:
    """Write ``key`` as ``id:base64`` to a new file readable by its owner only (mode 600).

    The file is created with that mode (never widened first); with ``force`` an existing
    file is replaced atomically.

    Raises:
        CliError: (failed) the file exists and ``force`` is not set; (config) it cannot be
            written.
    """
    line = f"{key.key_id}:{key.to_base64()}\n".encode()
    target = path if not force else path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise CliError(
            f"{str(path)!r} already exists; it is not overwritten",
            code=ExitCode.FAILED,
            hint="choose another file, or pass --force to replace it",
        ) from None
    except OSError as exc:
        raise CliError(
            f"cannot create {str(path)!r}: {exc.strerror or type(exc).__name__}",
            code=ExitCode.CONFIG,
            hint="check the directory exists and is writable",
        ) from None
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(line)
            handle.flush()
            os.fsync(handle.fileno())
        if force:
            os.replace(target, path)
    except OSError as exc:
        if force:
            target.unlink(missing_ok=True)
        raise CliError(
            f"cannot write {str(path)!r}: {exc.strerror or type(exc).__name__}",
            code=ExitCode.CONFIG,
        ) from None


_SETTINGS_MAX_BYTES: Final = 64 * 1024
_TEXT_KEYS: Final = (
    "dsn",
    "listen_dsn",
    "pooler",
    "embedded",
    "schema",
    "queue_schema",
    "namespace",
    "keys_file",
)
_INT_KEYS: Final = ("max_definitions", "max_occurrences")
_DURATION_KEYS: Final = ("delivery_window", "lease")
SETTINGS_KEYS: Final = (*_TEXT_KEYS, *_INT_KEYS, *_DURATION_KEYS)
"""Every key a settings file may hold."""


@attrs.frozen
class SettingsFile:
    """What a settings file says (``None``: not set there). Paths are absolute.

    Attributes:
        path: the file read, or ``None`` when there was none.
        dsn: the PostgreSQL DSN, a URL or libpq ``key=value`` string (its repr is redacted).
        listen_dsn: a DSN straight to PostgreSQL for the worker's LISTEN/NOTIFY wake-ups
            when ``dsn`` leads through a transaction pooler (its repr is redacted).
        pooler: ``"transaction"`` when ``dsn`` leads through a transaction pooler.
        embedded: a data directory holding the embedded PostgreSQL (``pgdata/``), used
            when no DSN is given anywhere.
        schema: the recurring store's schema.
        queue_schema: the work queue's schema.
        namespace: the recurring namespace.
        keys_file: the storage keys file.
        max_definitions: the namespace's definition quota.
        max_occurrences: the namespace's occurrence quota.
        delivery_window: the namespace's delivery window.
        lease: the namespace's lease duration.
    """

    path: Path | None = None
    dsn: str | None = attrs.field(
        default=None, repr=lambda dsn: "None" if dsn is None else repr(redact_dsn(dsn))
    )
    listen_dsn: str | None = attrs.field(
        default=None, repr=lambda dsn: "None" if dsn is None else repr(redact_dsn(dsn))
    )
    pooler: str | None = None
    embedded: Path | None = None
    schema: str | None = None
    queue_schema: str | None = None
    namespace: str | None = None
    keys_file: Path | None = None
    max_definitions: int | None = None
    max_occurrences: int | None = None
    delivery_window: timedelta | None = None
    lease: timedelta | None = None


def load_settings_file(config: Path | None, *, cwd: Path | None = None) -> SettingsFile:
    """Read the settings file ``config``, else ``steeple.toml`` in ``cwd`` if there is one.

    The file is flat TOML; every key is optional and unknown keys are refused::

        dsn = "postgresql://app@db.internal:5432/app?sslmode=verify-full"
        # or libpq key=value: dsn = "host=db1,db2 dbname=app target_session_attrs=read-write"
        # pooler = "transaction"         # dsn leads through PgBouncer in transaction mode
        # listen_dsn = "postgresql://app@db1:5432/app"  # direct, for worker wake-ups
        # embedded = ".steeple/demo"     # or: the embedded PostgreSQL in this directory
        schema = "steeple"               # the recurring store's schema
        queue_schema = "steeple_queue"   # the work queue's schema
        namespace = "default"
        keys_file = "/run/secrets/steeple-keys"
        max_definitions = 1000           # the namespace's settings, as initialized
        max_occurrences = 100000
        delivery_window = "1d"
        lease = "60s"

    Relative paths (``embedded``, ``keys_file``) are relative to the file's directory. A
    file holding a DSN with a password must be readable by its owner only.

    Raises:
        CliError: (config) a named file that cannot be read, a file that is not TOML, an
            unknown key, a value of the wrong type or out of range, or a password in a
            file other users can read.
    """
    path = config
    if path is None:
        candidate = (cwd or Path.cwd()) / SETTINGS_FILE
        if not candidate.is_file():
            return SettingsFile()
        path = candidate
    path = path.absolute()
    shown = repr(str(path))
    try:
        mode = path.stat().st_mode
        if not stat.S_ISREG(mode):
            raise IsADirectoryError(0, "not a regular file")
        with path.open("rb") as handle:
            data = handle.read(_SETTINGS_MAX_BYTES + 1)
    except OSError as exc:
        raise CliError(
            f"cannot read the settings file {shown}: {exc.strerror or type(exc).__name__}",
            code=ExitCode.CONFIG,
            hint=f"check --config / {CONFIG_ENV}",
        ) from None
    if len(data) > _SETTINGS_MAX_BYTES:
        raise CliError(f"the settings file {shown} is larger than 64 KiB", code=ExitCode.CONFIG)
    import tomllib

    try:
        values = tomllib.loads(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise CliError(
            f"the settings file {shown} is not UTF-8 text", code=ExitCode.CONFIG
        ) from None
    except tomllib.TOMLDecodeError as exc:
        # The parser's message names a line and column, never the text there.
        raise CliError(
            f"the settings file {shown} is not valid TOML: {exc}", code=ExitCode.CONFIG
        ) from None
    except ValueError:
        # Python refuses to read an integer of more than 4,300 decimal digits (its guard
        # against quadratic-time conversion); no setting takes such a number.
        raise CliError(
            f"the settings file {shown} holds an integer with more than "
            f"{sys.get_int_max_str_digits()} digits",
            code=ExitCode.CONFIG,
        ) from None
    return _settings(path, values, mode)


def _settings(path: Path, values: dict[str, Any], mode: int) -> SettingsFile:
    shown = repr(str(path))
    fields: dict[str, Any] = {}
    for key, value in values.items():
        if key not in SETTINGS_KEYS:
            raise CliError(
                f"unknown key {_shown(key)} in the settings file {shown}",
                code=ExitCode.CONFIG,
                hint="the keys are " + ", ".join(SETTINGS_KEYS),
            )
        fields[key] = _setting(key, value, f"{key!r} in the settings file {shown}")
    for key in ("embedded", "keys_file"):
        if key in fields:
            fields[key] = path.parent / Path(fields[key]).expanduser()
    if "pooler" in fields:
        fields["pooler"] = _file_pooler(fields["pooler"], f"'pooler' in the settings file {shown}")
    for key in ("dsn", "listen_dsn"):
        dsn = fields.get(key)
        if dsn is not None:
            _check_file_dsn(path, key, dsn, mode)
    return SettingsFile(path=path, **fields)


def _setting(key: str, value: object, where: str) -> object:
    """Return the value of one known setting, checked for its kind (text, number, duration)."""
    if key in _TEXT_KEYS:
        if not isinstance(value, str):
            raise CliError(f"{where} must be a string", code=ExitCode.CONFIG)
        return value
    if key in _INT_KEYS:
        if isinstance(value, bool) or not isinstance(value, int):
            raise CliError(f"{where} must be a whole number", code=ExitCode.CONFIG)
        if value.bit_length() > 63:  # beyond every limit, and maybe beyond str()
            raise CliError(f"{where} is far too large", code=ExitCode.CONFIG)
        return value
    if isinstance(value, str):
        return _config_duration(value, where)
    if isinstance(value, int) and not isinstance(value, bool):
        if value.bit_length() > 64:  # a huge hex literal: no decimal text to parse
            raise CliError(f"{where} is longer than 100 years", code=ExitCode.CONFIG)
        # A TOML integer is a number of seconds (the file's documented meaning).
        return _config_duration(f"{value}s", where)
    raise CliError(f'{where} must be a duration such as "60s" or "1d"', code=ExitCode.CONFIG)


def _check_file_dsn(path: Path, key: str, dsn: str, mode: int) -> None:
    """Refuse a malformed DSN (redacted), or a password in a file others can read."""
    shown = repr(str(path))
    resolve_dsn(dsn, source=f"{key} in the settings file {shown}")
    if dsn_secrets(dsn) and mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise CliError(
            f"the settings file {shown} holds a database password ({key}) and other "
            "users can read it",
            code=ExitCode.CONFIG,
            hint=f"restrict it (chmod 600 {path}), or set the password in {DSN_ENV}, "
            "PGPASSWORD or ~/.pgpass instead",
        )


def _file_pooler(value: str, where: str) -> str:
    from steeple.postgres.pooler import PoolerProblem, check_pooler

    try:
        check_pooler(value)
    except PoolerProblem:
        raise CliError(
            f'{where} must be "transaction", not {_shown(value)}',
            code=ExitCode.CONFIG,
            hint='write pooler = "transaction" when the DSN leads through a connection pooler '
            "in transaction mode (PgBouncer pool_mode = transaction); remove the key for a "
            "direct connection or a pooler in session mode",
        ) from None
    return value


def _config_duration(text: str, where: str) -> timedelta:
    try:
        return parse_duration(text, what=where)
    except CliError as exc:
        raise CliError(str(exc), code=ExitCode.CONFIG, hint=exc.hint) from None
