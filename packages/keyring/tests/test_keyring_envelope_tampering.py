"""Sealing and opening: round trips, the byte layout, and every kind of tampering.

RELIABILITY rows 31–33: flipped bytes of nonce, ciphertext and tag; truncation and
extension; unknown, retired and wrong-material keys as distinct errors; moved contexts.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from steeple.core.errors import (
    AuthenticationFailedError,
    KeyringConfigurationError,
    KeyringError,
    MalformedEnvelopeError,
    UnknownKeyIdError,
)
from steeple.core.ports import Sealer
from steeple.keyring import MIN_ENVELOPE_SIZE, NONCE_SIZE, TAG_SIZE, Keyring, StorageKey

PRIMARY = StorageKey("alpha-2026", bytes(range(32)))
OTHER = StorageKey("beta-2025", bytes(range(32, 64)))
CONTEXT = {"namespace": "billing", "purpose": "definition", "identity": "nightly#3"}
PLAINTEXT = b"hello"
KEY_ID_CHARS = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._:-")


def _open(keyring: Keyring, sealed: bytes | bytearray | memoryview, **overrides: str) -> bytes:
    context = {**CONTEXT, **overrides}
    return keyring.open(sealed, **context)


def _flip(data: bytes, position: int, mask: int) -> bytes:
    changed = bytearray(data)
    changed[position] ^= mask
    return bytes(changed)


@pytest.fixture
def keyring() -> Keyring:
    return Keyring(PRIMARY, OTHER)


@pytest.fixture
def sealed(keyring: Keyring) -> bytes:
    return keyring.seal(PLAINTEXT, **CONTEXT)


def test_round_trip(keyring: Keyring) -> None:
    for plaintext in (b"", b"x", PLAINTEXT, bytes(range(256)) * 40):
        assert _open(keyring, keyring.seal(plaintext, **CONTEXT)) == plaintext


def test_bytearray_and_memoryview_round_trip(keyring: Keyring) -> None:
    sealed = keyring.seal(bytearray(b"abc"), **CONTEXT)
    assert _open(keyring, bytearray(sealed)) == b"abc"
    assert _open(keyring, memoryview(sealed)) == b"abc"


def test_keyring_is_a_sealer(keyring: Keyring) -> None:
    def use(sealer: Sealer) -> tuple[str, bytes]:  # mypy checks the structural fit
        return sealer.primary_key_id, sealer.open(sealer.seal(b"p", **CONTEXT), **CONTEXT)

    assert use(keyring) == (PRIMARY.key_id, b"p")


def test_byte_layout(keyring: Keyring, sealed: bytes) -> None:
    key_id = PRIMARY.key_id.encode()
    assert sealed[:3] == b"STK"
    assert sealed[3] == 1
    assert sealed[4] == len(key_id)
    assert sealed[5 : 5 + len(key_id)] == key_id
    assert len(sealed) == 5 + len(key_id) + NONCE_SIZE + len(PLAINTEXT) + TAG_SIZE
    assert PLAINTEXT not in sealed
    assert keyring.key_id_of(sealed) == PRIMARY.key_id
    assert MIN_ENVELOPE_SIZE == 34


def test_each_seal_uses_a_fresh_nonce(keyring: Keyring) -> None:
    offset = 5 + len(PRIMARY.key_id)
    nonces = {keyring.seal(PLAINTEXT, **CONTEXT)[offset : offset + NONCE_SIZE] for _ in range(200)}
    assert len(nonces) == 200


def test_seal_matches_an_independent_aes_gcm(sealed: bytes) -> None:
    """The documented AAD layout, rebuilt here without the keyring's helpers."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    def lp(part: bytes) -> bytes:
        return len(part).to_bytes(4, "big") + part

    aad = b"".join(
        lp(part) for part in (b"STK\x01", b"alpha-2026", b"billing", b"definition", b"nightly#3")
    )
    offset = 5 + len(b"alpha-2026")
    nonce, body = sealed[offset : offset + 12], sealed[offset + 12 :]
    assert AESGCM(PRIMARY.key).decrypt(nonce, body, aad) == PLAINTEXT


def test_every_flip_of_nonce_ciphertext_and_tag_fails_authentication(
    keyring: Keyring, sealed: bytes
) -> None:
    start = 5 + len(PRIMARY.key_id)
    assert len(sealed) - start == NONCE_SIZE + len(PLAINTEXT) + TAG_SIZE
    checked = 0
    for position in range(start, len(sealed)):
        for mask in range(1, 256):
            with pytest.raises(AuthenticationFailedError):
                _open(keyring, _flip(sealed, position, mask))
            checked += 1
    assert checked == (NONCE_SIZE + len(PLAINTEXT) + TAG_SIZE) * 255


def _expected_header_error(keyring: Keyring, data: bytes) -> type[KeyringError]:
    """An independent model of header parsing: which error a changed header must give."""
    if data[:3] != b"STK" or data[3] != 1:
        return MalformedEnvelopeError
    length = data[4]
    if not 1 <= length <= 32 or len(data) < 5 + length + 12 + 16:
        return MalformedEnvelopeError
    raw_id = data[5 : 5 + length]
    if not set(raw_id) <= KEY_ID_CHARS:
        return MalformedEnvelopeError
    if raw_id.decode() in keyring.key_ids:
        return AuthenticationFailedError
    return UnknownKeyIdError


def test_every_flip_of_the_header_gives_its_typed_error(keyring: Keyring, sealed: bytes) -> None:
    seen: set[type[KeyringError]] = set()
    for position in range(5 + len(PRIMARY.key_id)):
        for mask in range(1, 256):
            changed = _flip(sealed, position, mask)
            expected = _expected_header_error(keyring, changed)
            with pytest.raises(KeyringError) as caught:
                _open(keyring, changed)
            assert type(caught.value) is expected, (position, mask)
            if position < 4:
                assert expected is MalformedEnvelopeError
            if isinstance(caught.value, UnknownKeyIdError):
                assert caught.value.key_id != PRIMARY.key_id
                assert caught.value.key_id in str(caught.value)
            seen.add(expected)
    assert seen == {MalformedEnvelopeError, UnknownKeyIdError}


def test_bad_magic_and_version_messages(keyring: Keyring, sealed: bytes) -> None:
    with pytest.raises(MalformedEnvelopeError, match="magic"):
        _open(keyring, b"XTK" + sealed[3:])
    with pytest.raises(MalformedEnvelopeError, match="version 2"):
        _open(keyring, sealed[:3] + b"\x02" + sealed[4:])
    with pytest.raises(MalformedEnvelopeError, match="version 2"):
        keyring.key_id_of(sealed[:3] + b"\x02" + sealed[4:])


def test_key_id_length_outside_range_is_malformed(keyring: Keyring, sealed: bytes) -> None:
    for length in (0, 33, 255):
        with pytest.raises(MalformedEnvelopeError, match="key id length"):
            _open(keyring, sealed[:4] + bytes([length]) + sealed[5:])


def test_non_ascii_key_id_is_malformed(keyring: Keyring, sealed: bytes) -> None:
    with pytest.raises(MalformedEnvelopeError, match="not ASCII"):
        _open(keyring, _flip(sealed, 5, 0x80))
    with pytest.raises(MalformedEnvelopeError, match="characters"):
        _open(keyring, sealed[:5] + b" " + sealed[6:])


def test_header_naming_another_held_key_fails_authentication(
    keyring: Keyring, sealed: bytes
) -> None:
    """Relabelled to a key the ring holds: that key alone is tried, and it fails."""
    body = sealed[5 + len(PRIMARY.key_id) :]
    relabelled = b"STK\x01" + bytes([len(OTHER.key_id)]) + OTHER.key_id.encode() + body
    assert keyring.key_id_of(relabelled) == OTHER.key_id
    with pytest.raises(AuthenticationFailedError, match="beta-2025"):
        _open(keyring, relabelled)


def test_every_truncation(keyring: Keyring, sealed: bytes) -> None:
    for length in range(len(sealed)):
        with pytest.raises(KeyringError) as caught:
            _open(keyring, sealed[:length])
        if length < 5 + len(PRIMARY.key_id) + NONCE_SIZE + TAG_SIZE:
            assert type(caught.value) is MalformedEnvelopeError, length
        else:
            assert type(caught.value) is AuthenticationFailedError, length


def test_extension_fails_authentication(keyring: Keyring, sealed: bytes) -> None:
    for suffix in (b"\x00", b"x", bytes(16), sealed[-16:], b"\xff" * 1000):
        with pytest.raises(AuthenticationFailedError):
            _open(keyring, sealed + suffix)


@pytest.mark.parametrize(
    "moved",
    [
        {"namespace": "payroll"},
        {"purpose": "occurrence"},
        {"identity": "nightly#4"},
        {"namespace": "Billing"},
        {"identity": "nightly#3 "},
        {"namespace": "definition", "purpose": "billing"},
    ],
)
def test_moved_context_fails_authentication(
    keyring: Keyring, sealed: bytes, moved: dict[str, str]
) -> None:
    with pytest.raises(AuthenticationFailedError):
        _open(keyring, sealed, **moved)
    assert _open(keyring, sealed) == PLAINTEXT


@pytest.mark.parametrize(
    ("sealed_as", "opened_as"),
    [
        (("ab", "c", "i"), ("a", "bc", "i")),
        (("a", "bc", "i"), ("ab", "c", "i")),
        (("n", "ab", "c"), ("n", "a", "bc")),
        (("n", "p\x00\x00\x00\x01x", "i"), ("n", "p", "x\x00\x00\x00\x01i")),
    ],
)
def test_length_prefixes_keep_contexts_apart(
    keyring: Keyring, sealed_as: tuple[str, str, str], opened_as: tuple[str, str, str]
) -> None:
    def context(parts: tuple[str, str, str]) -> dict[str, Any]:
        return dict(zip(("namespace", "purpose", "identity"), parts, strict=True))

    sealed = keyring.seal(b"secret", **context(sealed_as))
    assert keyring.open(sealed, **context(sealed_as)) == b"secret"
    with pytest.raises(AuthenticationFailedError):
        keyring.open(sealed, **context(opened_as))


def test_unknown_key_id_names_the_key(sealed: bytes) -> None:
    stranger = Keyring(OTHER)
    with pytest.raises(UnknownKeyIdError, match=re.escape(repr(PRIMARY.key_id))) as caught:
        _open(stranger, sealed)
    assert caught.value.key_id == PRIMARY.key_id
    assert isinstance(caught.value, LookupError)


def test_wrong_material_under_the_same_id_fails_authentication(sealed: bytes) -> None:
    impostor = Keyring(StorageKey(PRIMARY.key_id, bytes(range(64, 96))))
    with pytest.raises(AuthenticationFailedError):
        _open(impostor, sealed)


def test_no_other_key_is_tried() -> None:
    """A record sealed under one key must not open under a ring holding only others."""
    sealed_by_other = Keyring(OTHER).seal(PLAINTEXT, **CONTEXT)
    ring = Keyring(PRIMARY, StorageKey("gamma", bytes(range(1, 33))))
    with pytest.raises(UnknownKeyIdError, match="beta-2025"):
        _open(ring, sealed_by_other)


def test_previous_keys_open_what_they_sealed() -> None:
    sealed_by_other = Keyring(OTHER).seal(PLAINTEXT, **CONTEXT)
    assert _open(Keyring(PRIMARY, OTHER), sealed_by_other) == PLAINTEXT


def test_failures_release_no_plaintext(keyring: Keyring) -> None:
    secret = b"TOP-SECRET-PAYLOAD"
    sealed = keyring.seal(secret, **CONTEXT)
    attempts = [_flip(sealed, len(sealed) - 1, 1), sealed[:-1], sealed + b"\x00"]
    for attempt in attempts:
        with pytest.raises(AuthenticationFailedError) as caught:
            _open(keyring, attempt)
        error = caught.value
        assert error.__cause__ is None
        assert error.__suppress_context__
        text = str(error) + repr(error) + repr(error.args)
        assert "TOP-SECRET" not in text
        assert sealed.hex() not in text
        assert sealed[-16:].hex() not in text


@pytest.mark.parametrize("part", ["namespace", "purpose", "identity"])
@pytest.mark.parametrize("bad", ["", None, 5, b"ns", "\ud800"])
def test_context_parts_must_be_non_empty_str(keyring: Keyring, part: str, bad: object) -> None:
    sealed = keyring.seal(PLAINTEXT, **CONTEXT)
    context: dict[str, Any] = {**CONTEXT, part: bad}
    with pytest.raises(KeyringConfigurationError, match=part):
        keyring.seal(PLAINTEXT, **context)
    with pytest.raises(KeyringConfigurationError, match=part):
        keyring.open(sealed, **context)


@pytest.mark.parametrize("plaintext", ["text", None, 5, [1, 2]])
def test_only_bytes_are_sealed(keyring: Keyring, plaintext: object) -> None:
    with pytest.raises(TypeError, match="only bytes"):
        keyring.seal(plaintext, **CONTEXT)  # type: ignore[arg-type]


@pytest.mark.parametrize("sealed", ["STK", None, 12, ["S"]])
def test_non_bytes_envelopes_are_malformed(keyring: Keyring, sealed: object) -> None:
    with pytest.raises(MalformedEnvelopeError, match="bytes"):
        keyring.open(sealed, **CONTEXT)  # type: ignore[arg-type]
    with pytest.raises(MalformedEnvelopeError):
        keyring.key_id_of(sealed)  # type: ignore[arg-type]


def test_key_id_of_short_input_is_malformed(keyring: Keyring) -> None:
    for data in (b"", b"STK\x01", b"STK\x01\x01a" + bytes(27)):
        with pytest.raises(MalformedEnvelopeError, match="at least 34"):
            keyring.key_id_of(data)
