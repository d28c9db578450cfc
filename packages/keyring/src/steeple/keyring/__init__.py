r"""steeple's AES-256-GCM keyring: explicit rotating keys, each seal bound to its context.

``Keyring(primary, *previous)`` seals definitions, occurrence content and the namespace
configuration binding at rest. It implements ``steeple.core.ports.Sealer``.

Envelope format, version 1 (``L`` is the key id length, 1..32)::

    offset       size  content
    0            3     magic b"STK" (0x53 0x54 0x4B)
    3            1     envelope version, 0x01
    4            1     L, the key id length, 1..32
    5            L     key id, ASCII from A-Z a-z 0-9 . _ : -
    5+L          12    nonce, fresh from os.urandom for every seal
    17+L         n     AES-256-GCM ciphertext of the n-byte plaintext
    17+L+n       16    GCM authentication tag

    total = 33 + L + n bytes (at least 34)

Associated data (authenticated, never stored; rebuilt from the header and the caller's
context on open), each part as a 4-byte big-endian length then the bytes::

    len|b"STK\x01"  len|key id (ASCII)  len|namespace  len|purpose  len|identity  (UTF-8)

So the version and key id are authenticated, and moving a record to another namespace,
purpose or identity fails authentication; with five length-prefixed parts no two contexts
produce the same associated data (namespace "ab" + purpose "c" differs from "a" + "bc").

Opening uses only the key the header names: an id not held raises ``UnknownKeyIdError``
(naming the id), a wrong id/material/context or any altered byte raises
``AuthenticationFailedError``, and bad framing raises ``MalformedEnvelopeError``. GCM
checks the tag before releasing any plaintext.

Seal counting: each key counts its seals in memory in the ``Keyring`` instance (rotation
helpers carry the counts over); reaching ``seal_budget`` (default 2^30, at most 2^32, the
random-nonce limit) raises ``SealBudgetExhaustedError``. A store can persist
``statistics().seal_counts`` and pass them back as ``Keyring(..., seal_counts=...)``.

Rotation in phases, each returning a new keyring: ``with_previous(new)`` (every instance
can open), ``promote(new.key_id)``, the store re-seals the configuration binding on its
first operation (``open_binding(...).needs_reseal``), then ``retire(old_id)`` once no
record needs the old key.
"""

from steeple.keyring._envelope import (
    ENVELOPE_VERSION,
    MAGIC,
    MIN_ENVELOPE_SIZE,
    NONCE_SIZE,
    TAG_SIZE,
)
from steeple.keyring._keyring import (
    BINDING_IDENTITY,
    BINDING_PURPOSE,
    DEFAULT_SEAL_BUDGET,
    MAX_KEYS,
    MAX_SEAL_BUDGET,
    BindingStatus,
    BindingValue,
    Keyring,
    KeyringStatistics,
)
from steeple.keyring._keys import KEY_ID_MAX_LENGTH, KEY_SIZE, StorageKey

__all__ = [
    "BINDING_IDENTITY",
    "BINDING_PURPOSE",
    "DEFAULT_SEAL_BUDGET",
    "ENVELOPE_VERSION",
    "KEY_ID_MAX_LENGTH",
    "KEY_SIZE",
    "MAGIC",
    "MAX_KEYS",
    "MAX_SEAL_BUDGET",
    "MIN_ENVELOPE_SIZE",
    "NONCE_SIZE",
    "TAG_SIZE",
    "BindingStatus",
    "BindingValue",
    "Keyring",
    "KeyringStatistics",
    "StorageKey",
]
