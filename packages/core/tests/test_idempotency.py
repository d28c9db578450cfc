"""Idempotency keys: deterministic, purpose-separated, unambiguous."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta, timezone

from hypothesis import given, settings
from hypothesis import strategies as st

from steeple.core import PUBLISH_PURPOSE, idempotency_key

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
