"""A keyring's refusal names the record it was sealing or opening, and nothing else."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, NoReturn

import pytest

from steeple.core import RecurringConfig
from steeple.core.errors import AuthenticationFailedError, RecurringKeyringError
from steeple.engine.namespace_work import (
    PURPOSE_DEFINITION,
    PURPOSE_OCCURRENCE,
    NamespaceWork,
)
from steeple.testing import FakeClock

OCCURRENCE = "0a1b" * 8


class _Refusing:
    """A sealer whose every seal and open fails authentication (it checks nothing else)."""

    primary_key_id = "k1"

    def seal(self, plaintext: bytes, **context: str) -> NoReturn:
        raise AuthenticationFailedError("the key refused")

    def open(self, sealed: bytes, **context: str) -> NoReturn:
        raise AuthenticationFailedError("the key refused")


def _work() -> NamespaceWork:
    storage: Any = None  # sealing and opening never reach the storage
    return NamespaceWork(
        storage,
        RecurringConfig("ns", 10, 100),
        _Refusing(),
        FakeClock(datetime(2026, 1, 1, tzinfo=UTC)),
    )


@pytest.mark.parametrize(
    ("call", "record"),
    [
        (lambda w: w.seal(b"doc", PURPOSE_DEFINITION, "daily"), "definition 'daily'"),
        (lambda w: w.open_document(b"sealed", "daily"), "definition 'daily'"),
        (lambda w: w.seal_occurrence(b"msg", OCCURRENCE), f"occurrence {OCCURRENCE}"),
        (lambda w: w.open_occurrence(b"sealed", OCCURRENCE), f"occurrence {OCCURRENCE}"),
        (lambda w: w.open(b"sealed", PURPOSE_OCCURRENCE, OCCURRENCE), f"occurrence {OCCURRENCE}"),
    ],
    ids=["seal-definition", "open-definition", "seal-occurrence", "open-occurrence", "open"],
)
def test_a_refusal_names_the_record(call: Any, record: str) -> None:
    with pytest.raises(RecurringKeyringError) as caught:
        call(_work())
    assert isinstance(caught.value, AuthenticationFailedError)
    assert str(caught.value).startswith(record + ": ")
