"""What ``pooler="transaction"`` changes in how steeple connects (no server needed).

The same settings through a real PgBouncer: ``tests/test_pgbouncer.py``.
"""

from __future__ import annotations

import pytest

from steeple.postgres.pooler import (
    PoolerAdvice,
    PoolerProblem,
    PoolerRefusal,
    asyncpg_options,
    check_pooler,
    local_settings_sql,
    pooler_refusal,
)
from steeple.postgres.recurring._store import SERVER_SETTINGS


def test_only_none_and_transaction_are_pooler_modes() -> None:
    assert check_pooler(None) is None
    assert check_pooler("transaction") == "transaction"
    for wrong in ("session", "Transaction", "", 1, b"transaction"):
        with pytest.raises(PoolerProblem, match="pooler must be None"):
            check_pooler(wrong)


def test_direct_connections_send_their_settings_at_connect() -> None:
    assert asyncpg_options(None, SERVER_SETTINGS) == {"server_settings": dict(SERVER_SETTINGS)}
    assert asyncpg_options(None) == {}
    assert local_settings_sql(None, SERVER_SETTINGS) is None


def test_through_a_transaction_pooler_settings_move_into_each_transaction() -> None:
    options = asyncpg_options("transaction", SERVER_SETTINGS)
    assert options == {
        "statement_cache_size": 0,
        "server_settings": {"application_name": "steeple-recurring"},
    }
    sql = local_settings_sql("transaction", SERVER_SETTINGS)
    assert sql is not None
    assert "set_config('statement_timeout', '5000', true)" in sql
    assert "set_config('lock_timeout', '5000', true)" in sql
    assert "set_config('idle_in_transaction_session_timeout', '15000', true)" in sql
    # Socket options belong to the pooler's server connections; the name is tracked.
    assert "tcp_" not in sql
    assert "application_name" not in sql
    assert local_settings_sql("transaction", {"application_name": "x"}) is None


def test_pgbouncers_refusal_is_recognised_and_names_the_setting() -> None:
    refused = pooler_refusal(Exception("unsupported startup parameter: tcp_keepalives_idle"))
    assert refused is not None
    assert refused.setting == "tcp_keepalives_idle"
    refusal = (
        "the server refused the session setting 'tcp_keepalives_idle' at connect, as a "
        "connection pooler in transaction mode (PgBouncer) does"
    )
    assert str(refused) == refusal
    # Each caller words what to change; the direct DSN only where the caller has one.
    assert refused.explain(PoolerAdvice("create it as X(..., pooler='transaction')")) == (
        refusal + ": create it as X(..., pooler='transaction')"
    )
    assert refused.explain(PoolerAdvice("declare it", listen="listen_dsn")) == (
        refusal + ": declare it, and give listen_dsn a direct connection to PostgreSQL "
        "for LISTEN/NOTIFY wake-ups"
    )
    hostile = pooler_refusal(Exception("unsupported startup parameter: x'; DROP --"))
    assert hostile is not None
    assert hostile.setting == "?"
    assert "DROP" not in str(hostile)
    assert pooler_refusal(Exception("unsupported startup parameter:")) == PoolerRefusal("?")
    assert pooler_refusal(Exception("password authentication failed")) is None
