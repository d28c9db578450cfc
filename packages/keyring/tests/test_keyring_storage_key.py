"""StorageKey: validation, text forms, and secrecy of the material."""

from __future__ import annotations

import base64
import copy
import pickle

import pytest

from steeple.core.errors import ConfigurationError, KeyringConfigurationError
from steeple.keyring import KEY_SIZE, StorageKey

MATERIAL = bytes(range(100, 132))


def test_valid_key_keeps_id_and_material() -> None:
    key = StorageKey("2026-09", MATERIAL)
    assert key.key_id == "2026-09"
    assert key.key == MATERIAL
    assert len(key.key) == KEY_SIZE


@pytest.mark.parametrize("length", [0, 1, 16, 24, 31, 33, 64])
def test_wrong_material_lengths_are_refused(length: int) -> None:
    with pytest.raises(KeyringConfigurationError, match=f"exactly 32 bytes.*got {length}"):
        StorageKey("k", b"\x07" * length)


def test_configuration_error_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="exactly 32"):
        StorageKey("k", b"\x00" * 16)
    assert issubclass(KeyringConfigurationError, ConfigurationError)


@pytest.mark.parametrize("material", ["x" * 32, 32, None, [0] * 32])
def test_non_bytes_material_is_refused(material: object) -> None:
    with pytest.raises(KeyringConfigurationError, match="32"):
        StorageKey("k", material)


def test_str_material_points_at_from_base64() -> None:
    with pytest.raises(KeyringConfigurationError, match="from_base64"):
        StorageKey("k", "a" * 32)


def test_bytearray_and_memoryview_material_become_bytes() -> None:
    assert StorageKey("k", bytearray(MATERIAL)).key == MATERIAL
    assert type(StorageKey("k", memoryview(MATERIAL)).key) is bytes


@pytest.mark.parametrize(
    "key_id",
    ["", "x" * 33, "has space", "tab\t", "new\nline", "é", "slash/", "nul\x00", "ünï"],
)
def test_malformed_key_ids_are_refused(key_id: str) -> None:
    with pytest.raises(KeyringConfigurationError, match="invalid key id"):
        StorageKey(key_id, MATERIAL)


@pytest.mark.parametrize("key_id", ["a", "x" * 32, "2026-09", "A.b_c:d-9"])
def test_well_formed_key_ids_are_accepted(key_id: str) -> None:
    assert StorageKey(key_id, MATERIAL).key_id == key_id


@pytest.mark.parametrize("key_id", [None, 7, b"k"])
def test_non_str_key_id_is_refused(key_id: object) -> None:
    with pytest.raises(KeyringConfigurationError, match="must be a str"):
        StorageKey(key_id, MATERIAL)


def test_very_long_id_is_truncated_in_the_message() -> None:
    with pytest.raises(KeyringConfigurationError) as caught:
        StorageKey("y" * 10_000, MATERIAL)
    assert len(str(caught.value)) < 300


def test_generate_gives_distinct_32_byte_keys() -> None:
    first, second = StorageKey.generate("a"), StorageKey.generate("a")
    assert len(first.key) == 32
    assert first.key != second.key
    with pytest.raises(KeyringConfigurationError):
        StorageKey.generate("")


def test_base64_round_trip_and_whitespace() -> None:
    key = StorageKey("k1", MATERIAL)
    text = key.to_base64()
    assert base64.b64decode(text) == MATERIAL
    assert StorageKey.from_base64("k1", text) == key
    assert StorageKey.from_base64("k1", "  " + text + "\n") == key
    assert StorageKey.from_base64("k1", text.encode()) == key


def test_base64_errors_never_echo_the_text() -> None:
    secretish = "QUJD!!notbase64$$" + "Z" * 20
    with pytest.raises(KeyringConfigurationError, match="not valid standard base64") as caught:
        StorageKey.from_base64("k1", secretish)
    assert secretish not in str(caught.value)
    short = base64.b64encode(b"\x01" * 16).decode()
    with pytest.raises(KeyringConfigurationError, match="got 16") as caught:
        StorageKey.from_base64("k1", short)
    assert short not in str(caught.value)
    with pytest.raises(KeyringConfigurationError, match="str or bytes"):
        StorageKey.from_base64("k1", 5)  # type: ignore[arg-type]


def test_repr_and_str_show_only_the_id() -> None:
    key = StorageKey("2026-09", MATERIAL)
    for shown in (repr(key), str(key), f"{key!r}", f"{[key]}"):
        assert "2026-09" in shown
        assert MATERIAL.hex() not in shown
        assert MATERIAL.hex().upper() not in shown
        assert repr(MATERIAL)[2:-1] not in shown
        assert key.to_base64() not in shown
        assert str(list(MATERIAL)) not in shown


def test_equality_and_hash() -> None:
    key = StorageKey("k", MATERIAL)
    assert key == StorageKey("k", MATERIAL)
    assert key != StorageKey("k", bytes(32))
    assert key != StorageKey("j", MATERIAL)
    assert key != "k"
    assert hash(key) == hash(StorageKey("k", bytes(32)))
    assert len({key, StorageKey("k", MATERIAL)}) == 1
    assert key.same_material(StorageKey("other", MATERIAL))
    assert not key.same_material(StorageKey("k", bytes(32)))


def test_keys_are_immutable_and_unpicklable() -> None:
    key = StorageKey("k", MATERIAL)
    with pytest.raises(AttributeError):
        key.key = bytes(32)  # type: ignore[misc]
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(key)
    with pytest.raises(TypeError, match="cannot be pickled"):
        copy.deepcopy(key)


def test_keyring_imports_no_other_adapter() -> None:
    import subprocess
    import sys

    probe = (
        "import sys, steeple.keyring\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[:2] in (['steeple', 'postgres'],"
        " ['steeple', 'brokers'], ['steeple', 'admin'], ['steeple', 'testing']))\n"
        "print(','.join(bad))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == ""
