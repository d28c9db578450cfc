"""Keyring configuration, rotation in phases, the configuration binding, the seal budget.

RELIABILITY rows 34 (misconfiguration) and 35 (rotation: add, promote, re-seal the
binding, retire only when unused).
"""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from steeple.core.errors import (
    AuthenticationFailedError,
    ConfigurationError,
    KeyringBindingMismatchError,
    KeyringConfigurationError,
    KeyringError,
    MalformedEnvelopeError,
    SealBudgetExhaustedError,
    UnknownKeyIdError,
)
from steeple.keyring import (
    BINDING_IDENTITY,
    BINDING_PURPOSE,
    DEFAULT_SEAL_BUDGET,
    MAX_KEYS,
    MAX_SEAL_BUDGET,
    BindingStatus,
    Keyring,
    StorageKey,
)

CONTEXT = {"namespace": "billing", "purpose": "definition", "identity": "nightly#1"}
CONFIG: dict[str, str | int | bool] = {
    "namespace": "billing",
    "max_definitions": 100,
    "max_occurrences": 10_000,
    "delivery_window_s": 86_400,
    "strict": True,
}


def key(n: int, key_id: str | None = None) -> StorageKey:
    return StorageKey(key_id or f"k{n}", bytes([n]) * 32)


# --- misconfiguration (row 34) --------------------------------------------------------


def test_eight_keys_are_fine_nine_are_not() -> None:
    ring = Keyring(*[key(n) for n in range(MAX_KEYS)])
    assert ring.key_ids == tuple(f"k{n}" for n in range(8))
    with pytest.raises(KeyringConfigurationError, match="at most 8 keys, got 9"):
        Keyring(*[key(n) for n in range(9)])


def test_no_primary() -> None:
    with pytest.raises(KeyringConfigurationError, match="needs a primary key"):
        Keyring()
    with pytest.raises(KeyringConfigurationError, match="needs a primary key"):
        Keyring(*[])
    with pytest.raises(KeyringConfigurationError, match="needs a primary key"):
        Keyring(None)


def test_duplicate_ids() -> None:
    with pytest.raises(KeyringConfigurationError, match="'k1' appears twice"):
        Keyring(key(1), key(2), StorageKey("k1", bytes([9]) * 32))


def test_duplicate_material() -> None:
    with pytest.raises(KeyringConfigurationError, match="same key material") as caught:
        Keyring(key(1), key(2), StorageKey("copy", bytes([1]) * 32))
    assert (bytes([1]) * 32).hex() not in str(caught.value)


@pytest.mark.parametrize("length", [16, 24])
def test_short_keys_never_reach_a_keyring(length: int) -> None:
    with pytest.raises(KeyringConfigurationError, match=f"got {length}"):
        Keyring(StorageKey("short", bytes(length)))


@pytest.mark.parametrize("thing", [b"\x00" * 32, "k1", 7, AESGCM(bytes(32))])
def test_non_keys_are_refused(thing: Any) -> None:
    with pytest.raises(KeyringConfigurationError, match="must be a StorageKey"):
        Keyring(thing)
    with pytest.raises(KeyringConfigurationError, match="key #2 must be a StorageKey"):
        Keyring(key(1), thing)


@pytest.mark.parametrize("budget", [0, -1, MAX_SEAL_BUDGET + 1, 2**64])
def test_budget_out_of_range(budget: int) -> None:
    with pytest.raises(KeyringConfigurationError, match="seal_budget must be between"):
        Keyring(key(1), seal_budget=budget)


@pytest.mark.parametrize("budget", [True, 1.5, "10", None])
def test_budget_of_wrong_type(budget: Any) -> None:
    with pytest.raises(KeyringConfigurationError, match="seal_budget must be an int"):
        Keyring(key(1), seal_budget=budget)


@pytest.mark.parametrize(
    ("counts", "message"),
    [
        ({"nope": 1}, "does not hold"),
        ({"k1": -1}, "between 0 and the budget"),
        ({"k1": 11}, "between 0 and the budget"),
        ({"k1": "3"}, "must be an int"),
        ({"k1": True}, "must be an int"),
        ([("k1", 1)], "mapping"),
    ],
)
def test_bad_initial_counts(counts: Any, message: str) -> None:
    with pytest.raises(KeyringConfigurationError, match=message):
        Keyring(key(1), seal_budget=10, seal_counts=counts)


def test_configuration_errors_are_value_errors_and_keyring_errors() -> None:
    assert issubclass(KeyringConfigurationError, ValueError)
    assert issubclass(KeyringConfigurationError, KeyringError)
    assert issubclass(KeyringBindingMismatchError, ConfigurationError)
    assert issubclass(KeyringBindingMismatchError, KeyringError)


def test_repr_of_keyring_and_statistics_hide_material() -> None:
    keys = [key(0xA1, "2026-09"), key(0xB2, "2026-03")]
    ring = Keyring(*keys)
    sealed = ring.seal(b"PLAINTEXT-MARKER", **CONTEXT)
    shown = " ".join(
        [repr(ring), str(ring), repr(ring.statistics()), repr(ring.key_ids), repr(keys)]
    )
    assert "2026-09" in shown
    assert "2026-03" in shown
    for k in keys:
        assert k.key.hex() not in shown
        assert k.key.hex().upper() not in shown
        assert repr(k.key) not in shown
        assert repr(k.key)[2:-1] not in shown
        assert k.to_base64() not in shown
    assert "PLAINTEXT-MARKER" not in shown
    assert sealed.hex() not in shown
    assert repr(sealed)[2:-1] not in shown


def test_keyring_cannot_be_pickled() -> None:
    import pickle

    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(Keyring(key(1)))


# --- the seal budget ----------------------------------------------------------------------


def test_default_budget_is_well_under_the_nonce_limit() -> None:
    assert DEFAULT_SEAL_BUDGET == 2**30
    assert DEFAULT_SEAL_BUDGET <= 2**32 // 4
    assert Keyring(key(1)).statistics().seal_budget == DEFAULT_SEAL_BUDGET


def test_budget_reached_says_to_rotate() -> None:
    ring = Keyring(key(1), seal_budget=3)
    sealed = [ring.seal(bytes([n]), **CONTEXT) for n in range(3)]
    with pytest.raises(SealBudgetExhaustedError, match="rotate") as caught:
        ring.seal(b"one too many", **CONTEXT)
    assert "'k1'" in str(caught.value)
    with pytest.raises(SealBudgetExhaustedError):
        ring.seal_binding(CONFIG, namespace="billing")
    # Opening is not budgeted, and a failed seal is not counted.
    assert [ring.open(s, **CONTEXT) for s in sealed] == [b"\x00", b"\x01", b"\x02"]
    stats = ring.statistics()
    assert dict(stats.seal_counts) == {"k1": 3}
    assert stats.primary_remaining == 0
    rotated = ring.with_primary(key(2))
    assert rotated.open(rotated.seal(b"fresh", **CONTEXT), **CONTEXT) == b"fresh"
    assert dict(rotated.statistics().seal_counts) == {"k2": 1, "k1": 3}
    assert rotated.open(sealed[0], **CONTEXT) == b"\x00"


def test_initial_counts_let_a_store_persist_them() -> None:
    ring = Keyring(key(1), key(2), seal_budget=5, seal_counts={"k1": 4})
    assert dict(ring.statistics().seal_counts) == {"k1": 4, "k2": 0}
    ring.seal(b"last", **CONTEXT)
    with pytest.raises(SealBudgetExhaustedError):
        ring.seal(b"over", **CONTEXT)
    full = Keyring(key(1), seal_budget=5, seal_counts={"k1": 5})
    with pytest.raises(SealBudgetExhaustedError):
        full.seal(b"over", **CONTEXT)


def test_counts_are_per_key_and_per_instance() -> None:
    first = Keyring(key(1), key(2))
    second = Keyring(key(1), key(2))
    for _ in range(4):
        first.seal(b"x", **CONTEXT)
    assert dict(first.statistics().seal_counts) == {"k1": 4, "k2": 0}
    assert dict(second.statistics().seal_counts) == {"k1": 0, "k2": 0}
    promoted = first.promote("k2")
    promoted.seal(b"y", **CONTEXT)
    assert dict(promoted.statistics().seal_counts) == {"k2": 1, "k1": 4}
    assert dict(first.statistics().seal_counts) == {"k1": 4, "k2": 0}


def test_statistics_are_a_snapshot() -> None:
    ring = Keyring(key(1))
    stats = ring.statistics()
    ring.seal(b"x", **CONTEXT)
    assert stats.seal_counts["k1"] == 0
    assert ring.statistics().seal_counts["k1"] == 1
    with pytest.raises(TypeError):
        stats.seal_counts["k1"] = 9  # type: ignore[index]


def test_counter_does_not_race_across_threads() -> None:
    ring = Keyring(key(1), seal_budget=800)
    barrier = threading.Barrier(8)
    outcomes: list[str] = []
    lock = threading.Lock()

    def worker() -> None:
        barrier.wait()
        for _ in range(120):
            try:
                ring.seal(b"x", **CONTEXT)
                result = "sealed"
            except SealBudgetExhaustedError:
                result = "refused"
            with lock:
                outcomes.append(result)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert outcomes.count("sealed") == 800
    assert outcomes.count("refused") == 8 * 120 - 800
    assert ring.statistics().seal_counts["k1"] == 800


# --- rotation helpers ----------------------------------------------------------------------


def test_rotation_helpers_return_new_keyrings() -> None:
    ring = Keyring(key(1))
    added = ring.with_previous(key(2))
    assert ring.key_ids == ("k1",)
    assert added.key_ids == ("k1", "k2")
    assert added.promote("k2").key_ids == ("k2", "k1")
    assert added.key_ids == ("k1", "k2")
    assert ring.with_primary(key(2)).key_ids == ("k2", "k1")
    assert Keyring(key(1), key(2), key(3)).retire("k2").key_ids == ("k1", "k3")
    assert Keyring(key(1), key(2), key(3)).promote("k3").key_ids == ("k3", "k1", "k2")


def test_rotation_helpers_validate() -> None:
    ring = Keyring(key(1), key(2))
    with pytest.raises(KeyringConfigurationError, match="primary and cannot be retired"):
        ring.retire("k1")
    with pytest.raises(KeyringConfigurationError, match="no key with id 'k9'"):
        ring.retire("k9")
    with pytest.raises(KeyringConfigurationError, match="no key with id 'k9'"):
        ring.promote("k9")
    with pytest.raises(KeyringConfigurationError, match="appears twice"):
        ring.with_previous(key(2))
    with pytest.raises(KeyringConfigurationError, match="same key material"):
        ring.with_primary(StorageKey("new", key(1).key))
    full = Keyring(*[key(n) for n in range(8)])
    with pytest.raises(KeyringConfigurationError, match="at most 8"):
        full.with_previous(key(8))
    with pytest.raises(KeyringConfigurationError, match="at most 8"):
        full.with_primary(key(8))
    with pytest.raises(KeyringConfigurationError, match="must be a StorageKey"):
        ring.with_previous(b"\x00" * 32)  # type: ignore[arg-type]
    assert ring.promote("k1").key_ids == ("k1", "k2")


def test_rotation_keeps_budget() -> None:
    ring = Keyring(key(1), seal_budget=7)
    assert ring.with_primary(key(2)).seal_budget == 7
    assert ring.with_previous(key(2)).retire("k2").statistics().seal_budget == 7


# --- rotation in phases with the configuration binding (row 35) --------------------------


def test_rotation_in_phases() -> None:
    old, new = key(1, "2026-03"), key(2, "2026-09")
    ring = Keyring(old)
    binding = ring.seal_binding(CONFIG, namespace="billing")
    definition = ring.seal(b"definition body", **CONTEXT)
    assert ring.open_binding(binding, namespace="billing", expected=CONFIG) == BindingStatus(
        key_id="2026-03", needs_reseal=False
    )

    # Phase 1: add the new key as previous everywhere; the old one still seals.
    added = ring.with_previous(new)
    assert added.primary_key_id == "2026-03"
    assert added.key_id_of(added.seal(b"x", **CONTEXT)) == "2026-03"
    assert not added.open_binding(binding, namespace="billing", expected=CONFIG).needs_reseal

    # Phase 2: promote; the binding now reports it needs re-sealing.
    promoted = added.promote("2026-09")
    assert promoted.key_ids == ("2026-09", "2026-03")
    status = promoted.open_binding(binding, namespace="billing", expected=CONFIG)
    assert status == BindingStatus(key_id="2026-03", needs_reseal=True)

    # Phase 3: the store's first operation re-seals the binding under the primary.
    resealed = promoted.seal_binding(CONFIG, namespace="billing")
    assert promoted.key_id_of(resealed) == "2026-09"
    assert not promoted.open_binding(resealed, namespace="billing", expected=CONFIG).needs_reseal

    # Phase 4: retire the old key: the re-sealed binding no longer needs it ...
    retired = promoted.retire("2026-03")
    assert retired.key_ids == ("2026-09",)
    assert retired.open_binding(resealed, namespace="billing", expected=CONFIG) == BindingStatus(
        key_id="2026-09", needs_reseal=False
    )
    # ... but records sealed under it still do, and fail naming the key to restore.
    with pytest.raises(UnknownKeyIdError, match="'2026-03'"):
        retired.open(definition, **CONTEXT)
    with pytest.raises(UnknownKeyIdError, match="'2026-03'"):
        retired.open_binding(binding, namespace="billing", expected=CONFIG)
    assert promoted.open(definition, **CONTEXT) == b"definition body"
    # Restoring the retired key as previous makes the old record readable again.
    assert retired.with_previous(old).open(definition, **CONTEXT) == b"definition body"


def test_binding_mismatch_fails_closed_naming_fields_only() -> None:
    ring = Keyring(key(1))
    binding = ring.seal_binding(CONFIG, namespace="billing")
    cases: list[tuple[dict[str, Any], tuple[str, ...]]] = [
        ({**CONFIG, "max_definitions": 101}, ("max_definitions",)),
        ({**CONFIG, "strict": 1}, ("strict",)),  # True and 1 are different configurations
        ({**CONFIG, "max_occurrences": "10000"}, ("max_occurrences",)),
        ({k: v for k, v in CONFIG.items() if k != "strict"}, ("strict",)),
        ({**CONFIG, "extra": "x", "delivery_window_s": 1}, ("delivery_window_s", "extra")),
        ({}, tuple(sorted(CONFIG))),
    ]
    for expected, fields in cases:
        with pytest.raises(KeyringBindingMismatchError) as caught:
            ring.open_binding(binding, namespace="billing", expected=expected)
        assert caught.value.fields == fields
        assert caught.value.namespace == "billing"
        assert "10000" not in str(caught.value)
        assert "86400" not in str(caught.value)


def test_binding_is_order_independent_and_canonical() -> None:
    ring = Keyring(key(1))
    reordered = dict(reversed(list(CONFIG.items())))
    binding = ring.seal_binding(reordered, namespace="billing")
    assert ring.open_binding(binding, namespace="billing", expected=CONFIG).key_id == "k1"
    plaintext = ring.open(
        binding, namespace="billing", purpose=BINDING_PURPOSE, identity=BINDING_IDENTITY
    )
    assert (
        plaintext
        == json.dumps(
            {"binding": 1, "fields": CONFIG}, sort_keys=True, separators=(",", ":")
        ).encode()
    )


def test_binding_of_another_namespace_or_key_fails() -> None:
    ring = Keyring(key(1))
    binding = ring.seal_binding(CONFIG, namespace="billing")
    with pytest.raises(AuthenticationFailedError):
        ring.open_binding(binding, namespace="payroll", expected=CONFIG)
    with pytest.raises(AuthenticationFailedError):
        Keyring(StorageKey("k1", bytes(32))).open_binding(
            binding, namespace="billing", expected=CONFIG
        )
    with pytest.raises(UnknownKeyIdError, match="'k1'"):
        Keyring(key(2)).open_binding(binding, namespace="billing", expected=CONFIG)
    # An ordinary record is not a binding: its purpose differs, so it fails authentication.
    record = ring.seal(b"{}", namespace="billing", purpose="definition", identity="x")
    with pytest.raises(AuthenticationFailedError):
        ring.open_binding(record, namespace="billing", expected=CONFIG)
    with pytest.raises(MalformedEnvelopeError):
        ring.open_binding(b"junk", namespace="billing", expected=CONFIG)


@pytest.mark.parametrize(
    "plaintext",
    [
        b"not json",
        b"\xff\xfe",
        b"[]",
        b'{"binding":2,"fields":{}}',
        b'{"binding":1}',
        b'{"binding":true,"fields":{}}',
        b'{"binding":1,"fields":{"a":1.5}}',
        b'{"binding":1,"fields":[]}',
        b'{"binding":1,"fields":{},"x":0}',
    ],
)
def test_opened_record_that_is_not_a_binding_is_malformed(plaintext: bytes) -> None:
    ring = Keyring(key(1))
    forged = ring.seal(
        plaintext, namespace="billing", purpose=BINDING_PURPOSE, identity=BINDING_IDENTITY
    )
    with pytest.raises(MalformedEnvelopeError, match="not a format-1 configuration binding"):
        ring.open_binding(forged, namespace="billing", expected={})


@pytest.mark.parametrize(
    "fields",
    [{"a": 1.5}, {"a": None}, {"": 1}, {3: 1}, {"a": "\udc80"}, [("a", 1)], {"a": [1]}],
)
def test_binding_fields_must_be_str_int_or_bool(fields: Any) -> None:
    ring = Keyring(key(1))
    with pytest.raises(KeyringConfigurationError, match="binding field"):
        ring.seal_binding(fields, namespace="billing")
    good = ring.seal_binding({"a": 1}, namespace="billing")
    with pytest.raises(KeyringConfigurationError, match="binding field"):
        ring.open_binding(good, namespace="billing", expected=fields)


def test_binding_needs_a_namespace() -> None:
    with pytest.raises(KeyringConfigurationError, match="namespace"):
        Keyring(key(1)).seal_binding(CONFIG, namespace="")


def test_binding_status_and_error_reprs_hide_values() -> None:
    ring = Keyring(key(1))
    binding = ring.seal_binding({"secret_field": "VALUE-MARKER"}, namespace="n")
    status = ring.open_binding(binding, namespace="n", expected={"secret_field": "VALUE-MARKER"})
    assert "VALUE-MARKER" not in repr(status)
    with pytest.raises(KeyringBindingMismatchError) as caught:
        ring.open_binding(binding, namespace="n", expected={"secret_field": "OTHER-MARKER"})
    text = str(caught.value) + repr(caught.value)
    assert "secret_field" in text
    assert "MARKER" not in text


def test_binding_fields_give_operators_the_stored_values() -> None:
    """Issue 14: an operator holding the keys reads what a namespace was initialized with."""
    ring = Keyring(key(1))
    binding = ring.seal_binding(CONFIG, namespace="billing")
    assert ring.binding_fields(binding, namespace="billing") == CONFIG
    assert Keyring(key(2), key(1)).binding_fields(bytearray(binding), namespace="billing") == (
        CONFIG
    )
    with pytest.raises(UnknownKeyIdError):
        Keyring(key(2)).binding_fields(binding, namespace="billing")
    with pytest.raises(AuthenticationFailedError):
        Keyring(StorageKey("k1", b"\x09" * 32)).binding_fields(binding, namespace="billing")
    with pytest.raises(AuthenticationFailedError):
        ring.binding_fields(binding, namespace="payroll")
    other = ring.seal(
        b"{}", namespace="billing", purpose=BINDING_PURPOSE, identity=BINDING_IDENTITY
    )
    with pytest.raises(MalformedEnvelopeError):
        ring.binding_fields(other, namespace="billing")
