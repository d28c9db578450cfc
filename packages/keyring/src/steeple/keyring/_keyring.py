"""The keyring: AES-256-GCM seal and open under explicit, rotating keys."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import attrs
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from steeple.core.errors import (
    AuthenticationFailedError,
    KeyringBindingMismatchError,
    KeyringConfigurationError,
    MalformedEnvelopeError,
    SealBudgetExhaustedError,
    UnknownKeyIdError,
)
from steeple.keyring._envelope import (
    NONCE_SIZE,
    associated_data,
    check_context,
    encode_header,
    parse_header,
    sealed_bytes,
)
from steeple.keyring._keys import StorageKey

__all__ = [
    "BINDING_IDENTITY",
    "BINDING_PURPOSE",
    "DEFAULT_SEAL_BUDGET",
    "MAX_KEYS",
    "MAX_SEAL_BUDGET",
    "BindingStatus",
    "BindingValue",
    "Keyring",
    "KeyringStatistics",
]

MAX_KEYS = 8
"""A keyring holds at most this many keys (the primary and up to seven previous)."""

DEFAULT_SEAL_BUDGET = 2**30
"""Seals allowed per key by default: a quarter of the 2^32 random-nonce limit for GCM."""

MAX_SEAL_BUDGET = 2**32
"""The largest budget accepted: NIST SP 800-38D's limit for 96-bit random nonces."""

BINDING_PURPOSE = "steeple.configuration-binding"
"""The purpose under which configuration bindings are sealed."""

BINDING_IDENTITY = "namespace-configuration"
"""The identity under which configuration bindings are sealed (one binding per namespace)."""

_BINDING_FORMAT = 1

BindingValue = str | int | bool
"""A configuration value a binding can hold (floats are refused: not canonical)."""


@attrs.frozen
class KeyringStatistics:
    """Seal counts per key id and the budget, as of the moment they were read.

    Attributes:
        primary_key_id: the key new seals use.
        key_ids: every key id held, the primary first.
        seal_budget: seals allowed per key.
        seal_counts: seals made per key id (this keyring instance plus its initial counts).
        primary_remaining: seals the primary may still make before it must be rotated.
    """

    primary_key_id: str
    key_ids: tuple[str, ...]
    seal_budget: int
    seal_counts: Mapping[str, int]
    primary_remaining: int


@attrs.frozen
class BindingStatus:
    """The outcome of opening a configuration binding that matched.

    Attributes:
        key_id: the key the binding was sealed under.
        needs_reseal: the binding was sealed under a key that is no longer the primary;
            re-seal it (``Keyring.seal_binding``) so the old key is no longer needed for it.
    """

    key_id: str
    needs_reseal: bool


def _check_budget(seal_budget: object) -> int:
    if isinstance(seal_budget, bool) or not isinstance(seal_budget, int):
        raise KeyringConfigurationError(
            f"seal_budget must be an int, not {type(seal_budget).__name__}"
        )
    if not 1 <= seal_budget <= MAX_SEAL_BUDGET:
        raise KeyringConfigurationError(
            f"seal_budget must be between 1 and {MAX_SEAL_BUDGET} (2^32, the random-nonce "
            f"limit), got {seal_budget}"
        )
    return seal_budget


def _plaintext_bytes(plaintext: object) -> bytes:
    if isinstance(plaintext, bytes):
        return plaintext
    if isinstance(plaintext, bytearray | memoryview):
        return bytes(plaintext)
    raise TypeError(f"only bytes can be sealed, not {type(plaintext).__name__}")


def _check_keys(keys: tuple[object, ...]) -> tuple[StorageKey, ...]:
    """Return ``keys``, refused unless they are at most ``MAX_KEYS`` distinct storage keys."""
    checked: list[StorageKey] = []
    for position, key in enumerate(keys):
        if not isinstance(key, StorageKey):
            raise KeyringConfigurationError(
                f"keyring key #{position + 1} must be a StorageKey, not {type(key).__name__}"
            )
        checked.append(key)
    if len(checked) > MAX_KEYS:
        raise KeyringConfigurationError(
            f"a keyring holds at most {MAX_KEYS} keys, got {len(checked)}; retire keys no "
            "record needs any more"
        )
    for index, key in enumerate(checked):
        for earlier in checked[:index]:
            if key.key_id == earlier.key_id:
                raise KeyringConfigurationError(
                    f"key id {key.key_id!r} appears twice in the keyring; ids must be unique"
                )
            if key.same_material(earlier):
                raise KeyringConfigurationError(
                    f"keys {earlier.key_id!r} and {key.key_id!r} hold the same key "
                    "material; every key must be distinct"
                )
    return tuple(checked)


def _initial_counts(
    keys: tuple[StorageKey, ...], seal_counts: Mapping[str, int] | None, budget: int
) -> dict[str, int]:
    """Return each held key's seal count: ``seal_counts``' (checked), else 0."""
    counts = {key.key_id: 0 for key in keys}
    if seal_counts is None:
        return counts
    if not isinstance(seal_counts, Mapping):
        raise KeyringConfigurationError("seal_counts must be a mapping of key id to int")
    for key_id, count in seal_counts.items():
        if key_id not in counts:
            raise KeyringConfigurationError(
                f"seal_counts names key id {key_id!r}, which this keyring does not hold"
            )
        if isinstance(count, bool) or not isinstance(count, int):
            raise KeyringConfigurationError(f"the seal count of {key_id!r} must be an int")
        if not 0 <= count <= budget:
            raise KeyringConfigurationError(
                f"the seal count of {key_id!r} must be between 0 and the budget "
                f"{budget}, got {count}"
            )
        counts[key_id] = count
    return counts


class Keyring:
    """AES-256-GCM sealing bound to namespace, purpose and identity, with rotation.

    The primary key seals; every held key opens only what was sealed under it (the key id
    travels in the envelope, and opening never tries other keys). The set of keys is
    immutable: rotation helpers return new keyrings.

    Seal counting: each key has a counter; a seal that would exceed ``seal_budget``
    raises :class:`SealBudgetExhaustedError`. Counters live in memory in this instance
    (rotation helpers carry them over); a store that wants them to survive restarts
    persists ``statistics().seal_counts`` and passes them back as ``seal_counts``.

    Args:
        primary: the key that seals (positional; ``Keyring(primary, *previous)``).
        *previous: older keys that still open records sealed under them.
        seal_budget: seals allowed per key, 1..2^32 (default 2^30).
        seal_counts: initial seal counts per held key id (missing ids start at 0).

    Raises:
        KeyringConfigurationError: no primary, more than eight keys, duplicate ids or key
            material, a non-key argument, or a bad budget or count.
    """

    __slots__ = ("_budget", "_ciphers", "_counts", "_key_ids", "_keys", "_lock")

    def __init__(
        self,
        primary: StorageKey | None = None,
        *previous: StorageKey,
        seal_budget: int = DEFAULT_SEAL_BUDGET,
        seal_counts: Mapping[str, int] | None = None,
    ) -> None:
        if primary is None:
            raise KeyringConfigurationError(
                "a keyring needs a primary key: Keyring(primary, *previous)"
            )
        keys = _check_keys((primary, *previous))
        budget = _check_budget(seal_budget)
        counts = _initial_counts(keys, seal_counts, budget)
        self._keys: tuple[StorageKey, ...] = keys
        self._key_ids: tuple[str, ...] = tuple(key.key_id for key in keys)
        self._ciphers: dict[str, AESGCM] = {key.key_id: AESGCM(key.key) for key in keys}
        self._budget = budget
        self._counts = counts
        # Seals may run on worker threads (asyncio.to_thread); the counter must not race.
        self._lock = threading.Lock()

    # --- introspection -----------------------------------------------------------------

    @property
    def primary_key_id(self) -> str:
        """The id of the key new seals use."""
        return self._key_ids[0]

    @property
    def key_ids(self) -> tuple[str, ...]:
        """Every key id held, the primary first, then previous keys in order."""
        return self._key_ids

    @property
    def seal_budget(self) -> int:
        """Seals allowed per key."""
        return self._budget

    def statistics(self) -> KeyringStatistics:
        """Return the seal counts per key id and the budget."""
        with self._lock:
            counts = dict(self._counts)
        primary = self.primary_key_id
        return KeyringStatistics(
            primary_key_id=primary,
            key_ids=self._key_ids,
            seal_budget=self._budget,
            seal_counts=MappingProxyType(counts),
            primary_remaining=self._budget - counts[primary],
        )

    def key_id_of(self, sealed: bytes | bytearray | memoryview) -> str:
        """Return the key id an envelope names, from its header, without opening it.

        Raises:
            MalformedEnvelopeError: the envelope's framing is wrong.
        """
        key_id, _ = parse_header(sealed_bytes(sealed))
        return key_id

    def __repr__(self) -> str:
        return (
            f"Keyring(primary_key_id={self.primary_key_id!r}, "
            f"previous_key_ids={self._key_ids[1:]!r})"
        )

    def __reduce__(self) -> Any:
        raise TypeError("Keyring cannot be pickled; it holds key material")

    # --- sealing -----------------------------------------------------------------------

    def seal(
        self,
        plaintext: bytes | bytearray | memoryview,
        *,
        namespace: str,
        purpose: str,
        identity: str,
    ) -> bytes:
        """Encrypt and authenticate ``plaintext`` under the primary key for this context.

        Args:
            plaintext: the bytes to protect.
            namespace: the tenant namespace (non-empty).
            purpose: what the record is, e.g. ``"definition"`` (non-empty).
            identity: which record, e.g. a definition generation (non-empty).

        Returns:
            The versioned envelope (header, nonce, ciphertext and tag).

        Raises:
            TypeError: ``plaintext`` is not bytes-like.
            KeyringConfigurationError: a context part is not a non-empty str.
            SealBudgetExhaustedError: the primary key has used its seal budget.
        """
        data = _plaintext_bytes(plaintext)
        parts = check_context(namespace, purpose, identity)
        key_id = self.primary_key_id
        with self._lock:
            used = self._counts[key_id]
            if used >= self._budget:
                raise SealBudgetExhaustedError(
                    f"key {key_id!r} has sealed {used} records, its whole budget of "
                    f"{self._budget}; rotate: add a new key and make it the primary"
                )
            # Counted before encrypting: a nonce drawn is a nonce spent, even if sealing fails.
            self._counts[key_id] = used + 1
        nonce = os.urandom(NONCE_SIZE)
        body = self._ciphers[key_id].encrypt(nonce, data, associated_data(key_id, *parts))
        return encode_header(key_id) + nonce + body

    def open(
        self,
        sealed: bytes | bytearray | memoryview,
        *,
        namespace: str,
        purpose: str,
        identity: str,
    ) -> bytes:
        """Authenticate and decrypt an envelope sealed for exactly this context.

        Only the key the envelope names is used; no other key is ever tried.

        Raises:
            KeyringConfigurationError: a context part is not a non-empty str.
            MalformedEnvelopeError: not an envelope (bad magic, version or framing, too
                short).
            UnknownKeyIdError: sealed under a key id this keyring does not hold (the
                message names it: restore that key).
            AuthenticationFailedError: tampered, truncated or extended, sealed under other
                material with the same id, or moved to another namespace, purpose or
                identity. No plaintext is returned.
        """
        parts = check_context(namespace, purpose, identity)
        raw = sealed_bytes(sealed)
        key_id, nonce_at = parse_header(raw)
        cipher = self._ciphers.get(key_id)
        if cipher is None:
            raise UnknownKeyIdError(key_id)
        nonce = raw[nonce_at : nonce_at + NONCE_SIZE]
        body = raw[nonce_at + NONCE_SIZE :]
        try:
            return cipher.decrypt(nonce, body, associated_data(key_id, *parts))
        except InvalidTag:
            raise AuthenticationFailedError(
                f"a record sealed under key {key_id!r} failed authentication: it was altered, "
                "truncated or extended, sealed under other material with that id, or belongs "
                "to another namespace, purpose or identity"
            ) from None

    # --- the configuration binding -----------------------------------------------------

    def seal_binding(self, config_fields: Mapping[str, BindingValue], *, namespace: str) -> bytes:
        """Seal a namespace's configuration as its authenticated, encrypted binding.

        The fields are encoded canonically (sorted-key JSON), so equal configurations give
        equal plaintexts.

        Raises:
            KeyringConfigurationError: a field name is not a non-empty str, a value is not
                str, int or bool, or the namespace is empty.
            SealBudgetExhaustedError: the primary key has used its seal budget.
        """
        fields = _binding_fields(config_fields)
        plaintext = _canonical({"binding": _BINDING_FORMAT, "fields": fields})
        return self.seal(
            plaintext, namespace=namespace, purpose=BINDING_PURPOSE, identity=BINDING_IDENTITY
        )

    def open_binding(
        self,
        sealed: bytes | bytearray | memoryview,
        *,
        namespace: str,
        expected: Mapping[str, BindingValue],
    ) -> BindingStatus:
        """Open a namespace's binding and check it against the supplied configuration.

        Fails closed on any difference. When the status says ``needs_reseal``, the caller
        re-seals the binding under the current primary (``seal_binding(expected, ...)``).

        Raises:
            KeyringConfigurationError: ``expected`` is malformed or the namespace is empty.
            MalformedEnvelopeError: not an envelope, or not a binding once opened.
            UnknownKeyIdError: sealed under a key this keyring does not hold.
            AuthenticationFailedError: tampered, wrong key material, or another namespace's
                binding.
            KeyringBindingMismatchError: the stored configuration differs from ``expected``.
        """
        wanted = _binding_fields(expected)
        raw = sealed_bytes(sealed)
        key_id = self.key_id_of(raw)
        plaintext = self.open(
            raw, namespace=namespace, purpose=BINDING_PURPOSE, identity=BINDING_IDENTITY
        )
        stored = _decode_binding(plaintext)
        differing = tuple(
            sorted(
                name
                for name in stored.keys() | wanted.keys()
                if name not in stored
                or name not in wanted
                or _canonical(stored[name]) != _canonical(wanted[name])
            )
        )
        if differing:
            raise KeyringBindingMismatchError(namespace, differing)
        return BindingStatus(key_id=key_id, needs_reseal=key_id != self.primary_key_id)

    def binding_fields(
        self, sealed: bytes | bytearray | memoryview, *, namespace: str
    ) -> dict[str, BindingValue]:
        """Open a namespace's binding and return the configuration fields it holds.

        For operators who hold the keys and need the values a namespace was initialized
        with (a mismatch error names only the fields). Checks nothing against a supplied
        configuration: use :meth:`open_binding` for that.

        Raises:
            KeyringConfigurationError: the namespace is empty.
            MalformedEnvelopeError: not an envelope, or not a binding once opened.
            UnknownKeyIdError: sealed under a key this keyring does not hold.
            AuthenticationFailedError: tampered, wrong key material, or another namespace's
                binding.
        """
        plaintext = self.open(
            sealed_bytes(sealed),
            namespace=namespace,
            purpose=BINDING_PURPOSE,
            identity=BINDING_IDENTITY,
        )
        return _decode_binding(plaintext)

    # --- rotation (each returns a new keyring; this one is unchanged) --------------------

    def with_previous(self, key: StorageKey) -> Keyring:
        """Return a keyring that also holds ``key`` as a previous key (rotation phase 1).

        Add the next key everywhere first, so every instance can open what it will seal.

        Raises:
            KeyringConfigurationError: a ninth key, or a duplicate id or material.
        """
        return self._derive((*self._keys, key))

    def promote(self, key_id: str) -> Keyring:
        """Return a keyring whose primary is the held key ``key_id`` (rotation phase 2).

        The former primary stays as the first previous key.

        Raises:
            KeyringConfigurationError: this keyring does not hold ``key_id``.
        """
        chosen = self._held(key_id)
        rest = tuple(key for key in self._keys if key.key_id != key_id)
        return self._derive((chosen, *rest))

    def with_primary(self, key: StorageKey) -> Keyring:
        """Return a keyring with ``key`` as a new primary, the current keys as previous.

        Phases 1 and 2 at once: only safe when no other instance must open new seals first.

        Raises:
            KeyringConfigurationError: a ninth key, or a duplicate id or material.
        """
        return self._derive((key, *self._keys))

    def retire(self, key_id: str) -> Keyring:
        """Return a keyring without the previous key ``key_id`` (the last rotation phase).

        Retire a key only when no stored record (definitions, retained occurrence content,
        an un-resealed binding) was sealed under it: those records then fail with
        :class:`UnknownKeyIdError`.

        Raises:
            KeyringConfigurationError: ``key_id`` is the primary or is not held.
        """
        self._held(key_id)
        if key_id == self.primary_key_id:
            raise KeyringConfigurationError(
                f"key {key_id!r} is the primary and cannot be retired; promote another first"
            )
        return self._derive(tuple(key for key in self._keys if key.key_id != key_id))

    def _held(self, key_id: str) -> StorageKey:
        for key in self._keys:
            if key.key_id == key_id:
                return key
        raise KeyringConfigurationError(f"this keyring holds no key with id {key_id!r}")

    def _derive(self, keys: tuple[StorageKey, ...]) -> Keyring:
        with self._lock:
            counts = dict(self._counts)
        held = {key.key_id for key in keys if isinstance(key, StorageKey)}
        return Keyring(
            *keys,
            seal_budget=self._budget,
            seal_counts={key_id: n for key_id, n in counts.items() if key_id in held},
        )


def _canonical(value: object) -> bytes:
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
    ).encode("ascii")


def _binding_fields(config_fields: object) -> dict[str, BindingValue]:
    if not isinstance(config_fields, Mapping):
        raise KeyringConfigurationError(
            "configuration binding fields must be a mapping of name to str, int or bool"
        )
    fields: dict[str, BindingValue] = {}
    for name, value in config_fields.items():
        if not isinstance(name, str) or not name:
            raise KeyringConfigurationError(
                "configuration binding field names must be non-empty str"
            )
        if not isinstance(value, str | int):  # bool is an int
            raise KeyringConfigurationError(
                f"configuration binding field {name!r} must be str, int or bool, not "
                f"{type(value).__name__}"
            )
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise KeyringConfigurationError(
                    f"configuration binding field {name!r} is not valid Unicode"
                ) from None
        fields[name] = value
    return fields


def _decode_binding(plaintext: bytes) -> dict[str, BindingValue]:
    """Return the stored fields of an opened binding.

    Raises:
        MalformedEnvelopeError: the opened record is not a binding this version reads.
    """
    not_binding = MalformedEnvelopeError(
        f"the sealed record opened but is not a format-{_BINDING_FORMAT} configuration binding"
    )
    try:
        document = json.loads(plaintext.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise not_binding from None
    if (
        not isinstance(document, dict)
        or set(document) != {"binding", "fields"}
        or type(document["binding"]) is not int
        or document["binding"] != _BINDING_FORMAT
        or not isinstance(document["fields"], dict)
    ):
        raise not_binding
    fields: dict[str, BindingValue] = {}
    for name, value in document["fields"].items():
        if not isinstance(value, str | int):
            raise not_binding
        fields[name] = value
    return fields
