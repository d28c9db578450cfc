"""The definitions file: recurring definitions written as JSON or TOML, read in one place.

``steeple simulate --definitions FILE`` and ``steeple schedules create --file FILE`` read
it. A file holds a list of definitions, either as the whole JSON document or
under a ``definitions`` key (JSON object or TOML ``[[definitions]]`` tables)::

    [[definitions]]
    name = "nightly-billing"          # required
    cron = "0 2 * * *"                # required: steeple's five-field calendar
    policy = "catch_up"               # "catch_up" (default) or "coalesce"
    first_after = "2026-01-01T00:00Z" # exclusive; default: the caller's (e.g. --from)
    topic = "billing"                 # default: the caller's
    message_type = "billing.run"      # default: the caller's
    payload = '{"kind": "nightly"}'   # optional UTF-8 text (payload_base64 for bytes)
    headers = { team = "finance" }    # optional str -> str

Every field is validated by :class:`~steeple.core.RecurringDefinition` (names, calendar,
payload size, headers); unknown keys are refused so a typo never goes unnoticed.
"""

from __future__ import annotations

import base64
import binascii
import json
import sys
import tomllib
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Final

import attrs

from steeple.core.config import RecurringDefinition
from steeple.core.errors import ConfigurationError
from steeple.core.instants import parse_instant
from steeple.core.messages import ScheduledMessage
from steeple.core.policies import MissedRunPolicy

__all__ = [
    "DEFINITION_FIELDS",
    "MAX_FILE_BYTES",
    "DefinitionDefaults",
    "DefinitionsFileError",
    "definitions_from_data",
    "load_definitions",
    "parse_policy",
]

MAX_FILE_BYTES: Final = 4 * 1024 * 1024
"""A definitions file larger than this is refused before it is parsed."""
MAX_DEFINITIONS: Final = 10_000
DEFINITION_FIELDS: Final = frozenset(
    {
        "name",
        "cron",
        "policy",
        "first_after",
        "topic",
        "message_type",
        "payload",
        "payload_base64",
        "headers",
    }
)
_POLICIES: Final = {
    "catch_up": MissedRunPolicy.CATCH_UP,
    "catch-up": MissedRunPolicy.CATCH_UP,
    "coalesce": MissedRunPolicy.COALESCE,
}


class DefinitionsFileError(ConfigurationError):
    """A definitions file that cannot be read or holds a bad definition (one line, no echo)."""


@attrs.frozen
class DefinitionDefaults:
    """What a definition that leaves a field out gets (``None``: the field is required)."""

    first_after: datetime | None = None
    topic: str | None = None
    message_type: str | None = None


def _short(value: object) -> str:
    if isinstance(value, int) and value.bit_length() > 64:
        # A huge integer (a TOML hex literal) has no short decimal form: Python refuses
        # to write one of more than 4,300 digits.
        return "a very large number"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def parse_policy(value: object) -> MissedRunPolicy:
    """Return the policy named ``catch_up`` (or ``catch-up``) or ``coalesce``.

    Raises:
        DefinitionsFileError: any other value.
    """
    policy = _POLICIES.get(value.strip().lower()) if isinstance(value, str) else None
    if policy is None:
        raise DefinitionsFileError(f"policy {_short(value)} is not one of catch_up, coalesce")
    return policy


def _text(item: Mapping[str, Any], key: str, default: str | None, where: str) -> str:
    value = item.get(key, default)
    if value is None:
        raise DefinitionsFileError(f"{where}: {key!r} is required")
    if not isinstance(value, str):
        raise DefinitionsFileError(f"{where}: {key!r} must be a string")
    return value


def _payload(item: Mapping[str, Any], where: str) -> bytes:
    if "payload" in item and "payload_base64" in item:
        raise DefinitionsFileError(f"{where}: give payload or payload_base64, not both")
    if "payload_base64" in item:
        raw = item["payload_base64"]
        if not isinstance(raw, str):
            raise DefinitionsFileError(f"{where}: 'payload_base64' must be a string")
        try:
            return base64.b64decode(raw, validate=True)
        except (binascii.Error, ValueError):
            raise DefinitionsFileError(f"{where}: 'payload_base64' is not base64") from None
    text = item.get("payload", "")
    if not isinstance(text, str):
        raise DefinitionsFileError(f"{where}: 'payload' must be a string")
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        raise DefinitionsFileError(f"{where}: 'payload' is not valid text") from None


def _one(item: object, index: int, defaults: DefinitionDefaults) -> RecurringDefinition:
    where = f"definition #{index + 1}"
    if not isinstance(item, Mapping):
        raise DefinitionsFileError(f"{where} is not a table/object of fields")
    unknown = sorted(str(k) for k in item if k not in DEFINITION_FIELDS)
    if unknown:
        raise DefinitionsFileError(
            f"{where}: unknown field {_short(unknown[0])}; the fields are "
            + ", ".join(sorted(DEFINITION_FIELDS))
        )
    name = _text(item, "name", None, where)
    where = f"definition {_short(name)}"
    first_after: object = item.get("first_after", defaults.first_after)
    if first_after is None:
        raise DefinitionsFileError(f"{where}: 'first_after' is required")
    try:
        if isinstance(first_after, str):
            first_after = parse_instant(first_after)
        headers = item.get("headers", {})
        if not isinstance(headers, Mapping):
            raise DefinitionsFileError(f"{where}: 'headers' must be a table of strings")
        message = ScheduledMessage(
            _text(item, "topic", defaults.topic, where),
            _text(item, "message_type", defaults.message_type, where),
            _payload(item, where),
            dict(headers),
        )
        return RecurringDefinition(
            name,
            _text(item, "cron", None, where),
            first_after,
            parse_policy(item.get("policy", "catch_up")),
            message,
        )
    except DefinitionsFileError:
        raise
    except ConfigurationError as exc:
        raise DefinitionsFileError(f"{where}: {exc}") from None


def definitions_from_data(
    data: object, defaults: DefinitionDefaults = DefinitionDefaults()
) -> list[RecurringDefinition]:
    """Build definitions from parsed JSON/TOML: a list, or a mapping with ``definitions``.

    Raises:
        DefinitionsFileError: the shape is wrong, a definition is invalid, names repeat,
            or there are more than 10,000.
    """
    items: object = data
    if isinstance(data, Mapping):
        extra = sorted(str(k) for k in data if k != "definitions")
        if extra:
            raise DefinitionsFileError(
                f"unknown top-level key {_short(extra[0])}: put the list under 'definitions'"
            )
        items = data.get("definitions")
    if not isinstance(items, Sequence) or isinstance(items, str | bytes):
        raise DefinitionsFileError("the file must hold a list of definitions")
    if not items:
        raise DefinitionsFileError("the file holds no definitions")
    if len(items) > MAX_DEFINITIONS:
        raise DefinitionsFileError(
            f"the file holds {len(items)} definitions; the limit is {MAX_DEFINITIONS}"
        )
    definitions = [_one(item, i, defaults) for i, item in enumerate(items)]
    seen: set[str] = set()
    for definition in definitions:
        if definition.name in seen:
            raise DefinitionsFileError(f"the name {_short(definition.name)} appears twice")
        seen.add(definition.name)
    return definitions


def load_definitions(
    path: Path, defaults: DefinitionDefaults = DefinitionDefaults()
) -> list[RecurringDefinition]:
    """Read a ``.json`` or ``.toml`` definitions file (by suffix; JSON otherwise).

    Raises:
        DefinitionsFileError: unreadable, too large (4 MiB), not UTF-8, malformed JSON or
            TOML (too deeply nested included), or holding bad definitions.
    """
    try:
        with path.open("rb") as handle:
            raw = handle.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise DefinitionsFileError(
            f"cannot read the definitions file {_short(str(path))}: {exc.strerror or exc}"
        ) from None
    if len(raw) > MAX_FILE_BYTES:
        raise DefinitionsFileError(
            f"the definitions file is larger than {MAX_FILE_BYTES // (1024 * 1024)} MiB"
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise DefinitionsFileError("the definitions file is not UTF-8 text") from None
    try:
        if path.suffix.lower() == ".toml":
            data: object = tomllib.loads(text)
        else:
            data = json.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise DefinitionsFileError(f"the definitions file is not valid TOML: {exc}") from None
    except json.JSONDecodeError as exc:
        raise DefinitionsFileError(
            f"the definitions file is not valid JSON: {exc.msg} (line {exc.lineno})"
        ) from None
    except RecursionError:
        raise DefinitionsFileError("the definitions file is nested too deeply") from None
    except ValueError:
        # Python refuses to read an integer of more than 4,300 decimal digits (its guard
        # against quadratic-time conversion); no definition field takes such a number.
        raise DefinitionsFileError(
            "the definitions file holds an integer with more than "
            f"{sys.get_int_max_str_digits()} digits"
        ) from None
    return definitions_from_data(data, defaults)
