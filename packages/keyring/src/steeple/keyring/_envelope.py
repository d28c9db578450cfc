r"""The sealed envelope's framing and associated data (no cryptography here).

Layout (offsets in bytes, ``L`` is the key id length)::

    0 .. 2      magic b"STK"
    3           envelope version, 0x01
    4           L, the key id length, 1..32
    5 .. 4+L    key id, ASCII from A-Z a-z 0-9 . _ : -
    5+L .. 16+L nonce, 12 random bytes
    17+L .. end ciphertext (as long as the plaintext), then the 16-byte GCM tag

Associated data (never stored, rebuilt on open)::

    lp(b"STK\x01") | lp(key id) | lp(namespace) | lp(purpose) | lp(identity)

where ``lp(x)`` is the 4-byte big-endian length of ``x`` followed by ``x`` (strings in
UTF-8). A fixed number of length-prefixed parts makes the encoding injective, so no two
contexts share associated data ("ab" + "c" differs from "a" + "bc").
"""

from __future__ import annotations

from steeple.core.errors import KeyringConfigurationError, MalformedEnvelopeError
from steeple.keyring._keys import KEY_ID_MAX_LENGTH, is_valid_key_id

__all__ = [
    "ENVELOPE_VERSION",
    "HEADER_PREFIX",
    "MAGIC",
    "MIN_ENVELOPE_SIZE",
    "NONCE_SIZE",
    "TAG_SIZE",
    "associated_data",
    "check_context",
    "encode_header",
    "parse_header",
    "sealed_bytes",
]

MAGIC = b"STK"
ENVELOPE_VERSION = 1
HEADER_PREFIX = MAGIC + bytes([ENVELOPE_VERSION])
NONCE_SIZE = 12
TAG_SIZE = 16
MIN_ENVELOPE_SIZE = len(HEADER_PREFIX) + 1 + 1 + NONCE_SIZE + TAG_SIZE
"""The smallest well-framed envelope: a one-character key id and an empty plaintext."""

_LENGTH_BYTES = 4


def _length_prefixed(part: bytes) -> bytes:
    return len(part).to_bytes(_LENGTH_BYTES, "big") + part


def check_context(namespace: object, purpose: object, identity: object) -> tuple[bytes, ...]:
    """Validate the three context parts and return them as UTF-8.

    Raises:
        KeyringConfigurationError: a part is not a non-empty str, or is not encodable.
    """
    encoded: list[bytes] = []
    for name, value in (("namespace", namespace), ("purpose", purpose), ("identity", identity)):
        if not isinstance(value, str):
            raise KeyringConfigurationError(
                f"the sealing {name} must be a non-empty str, not {type(value).__name__}"
            )
        if not value:
            raise KeyringConfigurationError(f"the sealing {name} must be a non-empty str")
        try:
            encoded.append(value.encode("utf-8"))
        except UnicodeEncodeError:
            raise KeyringConfigurationError(
                f"the sealing {name} must be valid Unicode (it contains a lone surrogate)"
            ) from None
    return tuple(encoded)


def associated_data(key_id: str, namespace: bytes, purpose: bytes, identity: bytes) -> bytes:
    """Return the GCM associated data binding version, key id and context."""
    return b"".join(
        _length_prefixed(part)
        for part in (HEADER_PREFIX, key_id.encode("ascii"), namespace, purpose, identity)
    )


def encode_header(key_id: str) -> bytes:
    """Return magic, version, key id length and key id (the id is already validated)."""
    raw = key_id.encode("ascii")
    return HEADER_PREFIX + bytes([len(raw)]) + raw


def sealed_bytes(sealed: object) -> bytes:
    """Return ``sealed`` as bytes.

    Raises:
        MalformedEnvelopeError: it is not bytes-like.
    """
    if isinstance(sealed, bytes):
        return sealed
    if isinstance(sealed, bytearray | memoryview):
        return bytes(sealed)
    raise MalformedEnvelopeError(f"a sealed envelope is bytes, not {type(sealed).__name__}")


def parse_header(sealed: bytes) -> tuple[str, int]:
    """Return the key id and the offset of the nonce, checking only the framing.

    Raises:
        MalformedEnvelopeError: too short, wrong magic, unknown version, bad key id framing.
    """
    if len(sealed) < MIN_ENVELOPE_SIZE:
        raise MalformedEnvelopeError(
            f"a sealed envelope is at least {MIN_ENVELOPE_SIZE} bytes, got {len(sealed)}"
        )
    if sealed[: len(MAGIC)] != MAGIC:
        raise MalformedEnvelopeError("not a steeple sealed envelope (bad magic bytes)")
    version = sealed[len(MAGIC)]
    if version != ENVELOPE_VERSION:
        raise MalformedEnvelopeError(
            f"unsupported sealed envelope version {version} (this keyring reads version "
            f"{ENVELOPE_VERSION})"
        )
    id_length = sealed[len(HEADER_PREFIX)]
    if not 1 <= id_length <= KEY_ID_MAX_LENGTH:
        raise MalformedEnvelopeError(
            f"sealed envelope key id length {id_length} is outside 1..{KEY_ID_MAX_LENGTH}"
        )
    start = len(HEADER_PREFIX) + 1
    nonce_at = start + id_length
    if len(sealed) < nonce_at + NONCE_SIZE + TAG_SIZE:
        raise MalformedEnvelopeError("sealed envelope is too short for its key id length")
    raw_id = sealed[start:nonce_at]
    try:
        key_id = raw_id.decode("ascii")
    except UnicodeDecodeError:
        raise MalformedEnvelopeError("sealed envelope key id is not ASCII") from None
    if not is_valid_key_id(key_id):
        raise MalformedEnvelopeError("sealed envelope key id has characters outside the id set")
    return key_id, nonce_at
