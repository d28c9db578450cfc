"""Hypothesis properties: round trips over random payloads, contexts and key rings."""

from __future__ import annotations

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from steeple.core.errors import AuthenticationFailedError, MalformedEnvelopeError
from steeple.keyring import Keyring, StorageKey
from steeple.keyring._envelope import associated_data

RUNS = settings(max_examples=200, deadline=None)

key_ids = st.text(
    alphabet="ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._:-",
    min_size=1,
    max_size=32,
)
parts = st.text(min_size=1, max_size=24)
contexts = st.tuples(parts, parts, parts)
payloads = st.binary(max_size=2048)


def as_kwargs(context: tuple[str, str, str]) -> dict[str, str]:
    namespace, purpose, identity = context
    return {"namespace": namespace, "purpose": purpose, "identity": identity}


@st.composite
def keyrings(draw: st.DrawFn) -> Keyring:
    ids = draw(st.lists(key_ids, min_size=1, max_size=8, unique=True))
    materials = draw(
        st.lists(
            st.binary(min_size=32, max_size=32), min_size=len(ids), max_size=len(ids), unique=True
        )
    )
    return Keyring(*[StorageKey(i, m) for i, m in zip(ids, materials, strict=True)])


@RUNS
@given(ring=keyrings(), payload=payloads, context=contexts)
def test_round_trip(ring: Keyring, payload: bytes, context: tuple[str, str, str]) -> None:
    sealed = ring.seal(payload, **as_kwargs(context))
    assert ring.key_id_of(sealed) == ring.primary_key_id
    assert len(sealed) == 33 + len(ring.primary_key_id) + len(payload)
    assert ring.open(sealed, **as_kwargs(context)) == payload


@RUNS
@given(ring=keyrings(), payload=payloads, context=contexts, other=contexts)
def test_any_other_context_fails(
    ring: Keyring, payload: bytes, context: tuple[str, str, str], other: tuple[str, str, str]
) -> None:
    assume(context != other)
    sealed = ring.seal(payload, **as_kwargs(context))
    with pytest.raises(AuthenticationFailedError):
        ring.open(sealed, **as_kwargs(other))


@RUNS
@given(key_id=key_ids, first=contexts, second=contexts)
def test_associated_data_is_injective(
    key_id: str, first: tuple[str, str, str], second: tuple[str, str, str]
) -> None:
    assume(first != second)
    encode = [tuple(p.encode() for p in c) for c in (first, second)]
    assert associated_data(key_id, *encode[0]) != associated_data(key_id, *encode[1])


@RUNS
@given(
    ring=keyrings(),
    payload=payloads,
    context=contexts,
    data=st.data(),
)
def test_any_single_byte_change_is_rejected(
    ring: Keyring, payload: bytes, context: tuple[str, str, str], data: st.DataObject
) -> None:
    sealed = ring.seal(payload, **as_kwargs(context))
    position = data.draw(st.integers(0, len(sealed) - 1))
    mask = data.draw(st.integers(1, 255))
    changed = bytearray(sealed)
    changed[position] ^= mask
    header = 5 + len(ring.primary_key_id)
    if position >= header:
        with pytest.raises(AuthenticationFailedError):
            ring.open(bytes(changed), **as_kwargs(context))
    else:
        # Header changes give a typed error of some kind, never plaintext.
        with pytest.raises((MalformedEnvelopeError, LookupError, AuthenticationFailedError)):
            ring.open(bytes(changed), **as_kwargs(context))


@RUNS
@given(ring=keyrings(), payload=payloads, context=contexts, data=st.data())
def test_previous_keys_open_after_promotion(
    ring: Keyring, payload: bytes, context: tuple[str, str, str], data: st.DataObject
) -> None:
    sealed = ring.seal(payload, **as_kwargs(context))
    new_primary = data.draw(st.sampled_from(ring.key_ids))
    promoted = ring.promote(new_primary)
    assert promoted.primary_key_id == new_primary
    assert promoted.open(sealed, **as_kwargs(context)) == payload
    assert sorted(promoted.key_ids) == sorted(ring.key_ids)


@RUNS
@given(
    fields=st.dictionaries(
        st.text(min_size=1, max_size=12),
        st.one_of(st.text(max_size=12), st.integers(), st.booleans()),
        max_size=6,
    ),
    namespace=parts,
)
def test_binding_round_trip(fields: dict[str, str | int | bool], namespace: str) -> None:
    ring = Keyring(StorageKey("k", bytes(range(32))))
    binding = ring.seal_binding(fields, namespace=namespace)
    status = ring.open_binding(binding, namespace=namespace, expected=dict(fields))
    assert status.key_id == "k"
    assert not status.needs_reseal
