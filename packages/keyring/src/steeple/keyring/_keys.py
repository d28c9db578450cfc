"""Storage keys: 32 bytes of AES-256 material under a short printable id."""

from __future__ import annotations

import base64
import binascii
import hmac
import re
import secrets
from typing import Any

import attrs

from steeple.core.errors import KeyringConfigurationError

__all__ = ["KEY_ID_MAX_LENGTH", "KEY_SIZE", "StorageKey", "is_valid_key_id"]

KEY_SIZE = 32
"""Bytes of key material: AES-256 only (16- and 24-byte keys are refused)."""

KEY_ID_MAX_LENGTH = 32
"""Longest key id, in characters (each is one ASCII byte in the envelope)."""

_KEY_ID = re.compile(r"[A-Za-z0-9._:-]{1,32}")


def is_valid_key_id(text: str) -> bool:
    """Return whether ``text`` is a well-formed key id (1–32 of ``A-Z a-z 0-9 . _ : -``)."""
    return _KEY_ID.fullmatch(text) is not None


def _check_key_id(value: object) -> str:
    if not isinstance(value, str):
        raise KeyringConfigurationError(
            f"a key id must be a str, not {type(value).__name__}; use a short label such as "
            "'2026-09'"
        )
    if not is_valid_key_id(value):
        # A malformed id is never echoed: it is often key material written in the id's
        # place (a key line the wrong way round, "base64:id" or "id:base64:extra").
        if not value:
            fault = "it is empty"
        elif len(value) > KEY_ID_MAX_LENGTH:
            fault = f"it is {len(value)} characters long"
        else:
            fault = "it holds another character"
        raise KeyringConfigurationError(
            f"invalid key id ({fault}): an id is 1 to {KEY_ID_MAX_LENGTH} characters from "
            "A-Z, a-z, 0-9, '.', '_', ':' and '-' (for example '2026-09'); written as "
            "id:base64, the id comes first"
        )
    return value


def _check_key_material(value: object) -> bytes:
    if isinstance(value, str):
        raise KeyringConfigurationError(
            "key material must be 32 raw bytes, not str; decode text keys with "
            "StorageKey.from_base64(key_id, text)"
        )
    if not isinstance(value, bytes | bytearray | memoryview):
        raise KeyringConfigurationError(
            f"key material must be 32 bytes, not {type(value).__name__}"
        )
    material = bytes(value)
    if len(material) != KEY_SIZE:
        # The length is safe to report; the bytes never are.
        raise KeyringConfigurationError(
            f"key material must be exactly {KEY_SIZE} bytes (AES-256), got {len(material)}; "
            "generate one with StorageKey.generate(key_id)"
        )
    return material


@attrs.frozen(eq=False, repr=False)
class StorageKey:
    """One AES-256 key under a short printable id.

    The id travels in every envelope sealed under the key; the material never appears in
    ``repr``, ``str`` or error messages.

    Attributes:
        key_id: 1–32 characters from ``A-Z a-z 0-9 . _ : -`` (e.g. ``"2026-09"``).
        key: exactly 32 bytes of key material.

    Raises:
        KeyringConfigurationError: the id or the material is malformed (the message says
            what to fix and never echoes the material).
    """

    key_id: str = attrs.field(converter=_check_key_id)
    key: bytes = attrs.field(converter=_check_key_material)

    @classmethod
    def generate(cls, key_id: str) -> StorageKey:
        """Return a new key with 32 bytes from the operating system's CSPRNG.

        Raises:
            KeyringConfigurationError: the id is malformed.
        """
        return cls(key_id, secrets.token_bytes(KEY_SIZE))

    @classmethod
    def from_base64(cls, key_id: str, text: str | bytes) -> StorageKey:
        """Decode a key from standard base64 (surrounding whitespace is ignored).

        Meant for operators loading keys from environment variables or files.

        Raises:
            KeyringConfigurationError: the text is not valid base64, does not decode to 32
                bytes, or the id is malformed. Neither the text nor a malformed id is
                echoed.
        """
        # The id is checked first: a message may name a well-formed id, never a malformed
        # one (it may be the key material itself, written in the id's place).
        checked_id = _check_key_id(key_id)
        if not isinstance(text, str | bytes):
            raise KeyringConfigurationError(
                f"a base64 key must be str or bytes, not {type(text).__name__}"
            )
        try:
            material = base64.b64decode(text.strip(), validate=True)
        except (binascii.Error, ValueError):
            raise KeyringConfigurationError(
                f"key {checked_id!r} is not valid standard base64 (A-Z a-z 0-9 + / with = padding)"
            ) from None
        return cls(checked_id, material)

    def to_base64(self) -> str:
        """Return the key material as standard base64 (a secret: store it as one)."""
        return base64.b64encode(self.key).decode("ascii")

    def same_material(self, other: StorageKey) -> bool:
        """Return whether ``other`` holds the same key material (constant-time comparison)."""
        return hmac.compare_digest(self.key, other.key)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, StorageKey):
            return NotImplemented
        return self.key_id == other.key_id and self.same_material(other)

    def __hash__(self) -> int:
        # Hash the id only, so a hash value never depends on (or leaks bits of) the material.
        return hash(("StorageKey", self.key_id))

    def __repr__(self) -> str:
        return f"StorageKey(key_id={self.key_id!r})"

    def __reduce__(self) -> Any:
        # Pickling would copy key material into caches, queues or logs: refuse it.
        raise TypeError("StorageKey cannot be pickled; load keys from your secret store")
