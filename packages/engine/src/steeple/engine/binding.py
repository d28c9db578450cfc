"""The namespace's configuration binding: sealed at initialization, checked by every call.

A keyring that offers ``seal_binding`` / ``open_binding`` (:class:`steeple.keyring.Keyring`)
seals the configuration's fingerprint itself; any other sealer seals the canonical
binding document under the ``"binding"`` purpose.
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

from steeple.core.config import RecurringConfig
from steeple.core.errors import KeyringError, RecurringConfigurationError, recurring_keyring_error
from steeple.core.ports import Sealer
from steeple.engine.codec import encode_binding

__all__ = ["PURPOSE_BINDING", "seal_binding", "verify_binding"]

PURPOSE_BINDING = "binding"


@runtime_checkable
class _BindingSealer(Protocol):
    """The keyring's configuration-binding API, used when the sealer offers it."""

    def seal_binding(self, config_fields: Mapping[str, Any], *, namespace: str) -> bytes: ...

    def open_binding(
        self, sealed: bytes, *, namespace: str, expected: Mapping[str, Any]
    ) -> object: ...


def seal_binding(sealer: Sealer, config: RecurringConfig) -> bytes:
    """Return the sealed configuration binding of ``config`` under the primary key.

    Raises:
        RecurringKeyringError: the sealer refused (e.g. its seal budget is exhausted); also
            an instance of the keyring's own error class.
    """
    try:
        if isinstance(sealer, _BindingSealer):
            return sealer.seal_binding(config.fingerprint(), namespace=config.namespace)
        return sealer.seal(
            encode_binding(config),
            namespace=config.namespace,
            purpose=PURPOSE_BINDING,
            identity=config.namespace,
        )
    except KeyringError as exc:
        raise recurring_keyring_error(exc, "the configuration binding") from exc


def verify_binding(sealer: Sealer, config: RecurringConfig, sealed: bytes) -> None:
    """Fail closed unless ``sealed`` authenticates and matches ``config``.

    Raises:
        RecurringConfigurationError: the binding does not open with this keyring or was
            made for another configuration (the keyring's error is the ``__cause__``).
    """
    namespace = config.namespace
    try:
        if isinstance(sealer, _BindingSealer):
            sealer.open_binding(sealed, namespace=namespace, expected=config.fingerprint())
            return
        plaintext = sealer.open(
            sealed, namespace=namespace, purpose=PURPOSE_BINDING, identity=namespace
        )
    except KeyringError as exc:
        raise RecurringConfigurationError(
            f"namespace {namespace!r}: the stored configuration binding does not match the "
            f"supplied configuration and keyring ({type(exc).__name__}: {exc})"
        ) from exc
    if not hmac.compare_digest(plaintext, encode_binding(config)):
        raise RecurringConfigurationError(
            f"namespace {namespace!r} was initialized with a different configuration; "
            "supply the configuration it was initialized with"
        )
