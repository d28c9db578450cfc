"""Idempotency keys: deterministic, purpose-separated, unambiguous."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta, timezone

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from steeple.core import PUBLISH_PURPOSE, idempotency_key
from steeple.core.errors import ConfigurationError, ConfigurationTypeError
from steeple.core.idempotency import trusted_idempotency_key

DUE = datetime(2030, 1, 2, 3, 4, tzinfo=UTC)
GEN = bytes(range(16))
KEY = re.compile(r"stp1-[0-9a-f]{48}\Z")


def _key(**overrides: object) -> str:
    args: dict[str, object] = {
        "purpose": PUBLISH_PURPOSE,
        "namespace": "ns",
        "definition_name": "daily",
        "due_at": DUE,
        "generation": GEN,
    }
    args.update(overrides)
    return idempotency_key(**args)  # type: ignore[arg-type]


def test_format_and_determinism() -> None:
    first = _key()
    assert KEY.match(first)
    assert _key() == first
    # The same instant in another zone is the same occurrence.
    assert _key(due_at=DUE.astimezone(timezone(timedelta(hours=5)))) == first


def test_every_identity_part_changes_the_key() -> None:
    base = _key()
    assert _key(purpose="other.v1") != base
    assert _key(namespace="ns2") != base
    assert _key(definition_name="daily2") != base
    assert _key(due_at=DUE + timedelta(minutes=1)) != base
    assert _key(generation=bytes(16)) != base


def test_parts_cannot_run_together() -> None:
    assert _key(namespace="ab", definition_name="c") != _key(namespace="a", definition_name="bc")


@settings(max_examples=200, deadline=None)
@given(
    st.text(min_size=1, max_size=20),
    st.text(min_size=1, max_size=20),
    st.text(min_size=1, max_size=20),
    st.text(min_size=1, max_size=20),
)
def test_distinct_identities_distinct_keys(ns1: str, n1: str, ns2: str, n2: str) -> None:
    k1 = _key(namespace=ns1, definition_name=n1)
    k2 = _key(namespace=ns2, definition_name=n2)
    assert KEY.match(k1)
    assert (k1 == k2) == ((ns1, n1) == (ns2, n2))


def test_keys_are_stable_across_versions() -> None:
    """A key is part of the published record: a change of its derivation republishes.

    Brokers deduplicate by key, so a version that derived other keys for the same
    occurrences would send every in-flight occurrence again. These are the keys of today.
    """
    assert _key() == "stp1-241365154d1e5427dec6f50a00b51e55ebecdea417dd6c7e"
    later = DUE + timedelta(milliseconds=1)
    assert _key(due_at=later) == "stp1-c2eb89a2e667d053fc4f0674d21ddfe0ab817d05453f97c7"


@pytest.mark.parametrize(
    ("field", "value", "error", "message"),
    [
        ("purpose", 3, ConfigurationTypeError, "purpose must be a str, not int"),
        ("namespace", b"ns", ConfigurationTypeError, "namespace must be a str, not bytes"),
        ("definition_name", None, ConfigurationTypeError, "definition_name must be a str, not"),
        ("purpose", "\ud800", ConfigurationError, "purpose contains the lone surrogate"),
        ("namespace", "n\udfff", ConfigurationError, "namespace contains the lone surrogate"),
        ("definition_name", "a\udfffb", ConfigurationError, "definition_name contains the lone"),
        ("due_at", datetime(2030, 1, 2), ConfigurationError, "due_at must be timezone-aware"),
        ("generation", "g", ConfigurationTypeError, "generation must be bytes, not str"),
    ],
)
def test_each_bad_part_is_refused_by_name(
    field: str, value: object, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match="^" + re.escape(message)):
        _key(**{field: value})


@settings(max_examples=200, derandomize=True)
@given(
    namespace=st.text(min_size=1, max_size=20).filter(lambda s: s.isprintable()),
    name=st.text(min_size=1, max_size=40).filter(lambda s: s.isprintable()),
    due=st.datetimes(
        min_value=datetime(1970, 1, 1), max_value=datetime(2100, 12, 31), timezones=st.just(UTC)
    ),
    offset=st.integers(min_value=-14 * 60, max_value=14 * 60),
    generation=st.binary(min_size=0, max_size=32),
)
def test_the_unchecked_key_the_relay_derives_is_the_checked_one(
    namespace: str, name: str, due: datetime, offset: int, generation: bytes
) -> None:
    # The relay derives keys from its rows without checks: they must be the same keys.
    due_there = due.astimezone(timezone(timedelta(minutes=offset)))
    args = {
        "purpose": PUBLISH_PURPOSE,
        "namespace": namespace,
        "definition_name": name,
        "due_at": due_there,
        "generation": generation,
    }
    key = idempotency_key(**args)  # type: ignore[arg-type]
    # Twice: what a definition's keys share is computed once and must not be changed by use.
    assert trusted_idempotency_key(**args) == key  # type: ignore[arg-type]
    assert trusted_idempotency_key(**args) == key  # type: ignore[arg-type]
    for other in (
        {"namespace": namespace + "x"},
        {"definition_name": name + "x"},
        {"generation": generation + b"\0"},
    ):
        assert trusted_idempotency_key(**(args | other)) != idempotency_key(**args)  # type: ignore[arg-type]
