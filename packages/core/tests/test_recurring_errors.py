"""Keyring failures of the recurring store are RecurringErrors too; schema-version errors."""

from __future__ import annotations

import pytest

from steeple.core.errors import (
    AuthenticationFailedError,
    KeyringConfigurationError,
    KeyringError,
    MalformedEnvelopeError,
    RecurringError,
    RecurringKeyringError,
    RecurringSchemaVersionError,
    RecurringStorageError,
    RecurringUnknownKeyIdError,
    SealBudgetExhaustedError,
    UnknownKeyIdError,
    recurring_keyring_error,
)


@pytest.mark.parametrize(
    "original",
    [
        UnknownKeyIdError("2026-09"),
        AuthenticationFailedError("tampered"),
        MalformedEnvelopeError("bad version"),
        SealBudgetExhaustedError("rotate"),
        KeyringConfigurationError("odd"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_a_keyring_failure_becomes_both_a_recurring_and_its_keyring_error(
    original: KeyringError,
) -> None:
    mapped = recurring_keyring_error(original, "definition 'daily'")
    assert isinstance(mapped, RecurringError)
    assert isinstance(mapped, RecurringKeyringError)
    assert isinstance(mapped, KeyringError)
    if not isinstance(original, KeyringConfigurationError):
        assert isinstance(mapped, type(original))  # ``except UnknownKeyIdError`` still works
    assert "definition 'daily'" in str(mapped)
    assert recurring_keyring_error(mapped, "again") is mapped


def test_the_unknown_key_message_names_the_key_id() -> None:
    mapped = recurring_keyring_error(UnknownKeyIdError("2026-09"), "occurrence 0a1b")
    assert isinstance(mapped, RecurringUnknownKeyIdError)
    assert mapped.key_id == "2026-09"
    assert "'2026-09'" in str(mapped)
    assert "occurrence 0a1b" in str(mapped)
    assert isinstance(mapped, LookupError)


def test_older_schema_says_run_initialize_newer_says_upgrade() -> None:
    older = RecurringSchemaVersionError("steeple", 1, 2)
    assert isinstance(older, RecurringStorageError)
    assert "version 1" in str(older)
    assert "run initialize" in str(older)
    newer = RecurringSchemaVersionError("steeple", 99, 2)
    assert "version 99" in str(newer)
    assert "initialize" not in str(newer)
    assert (older.found, older.expected) == (1, 2)
    assert RecurringError.SchemaVersion is RecurringSchemaVersionError
    assert RecurringError.Keyring is RecurringKeyringError
