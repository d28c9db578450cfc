"""steeple.core.dsn against the real parsers: libpq (through psycopg) and asyncpg.

Whatever password libpq reads from a DSN never appears in ``redact_dsn``'s output and is
covered by ``dsn_secrets``; a DSN that ``check_dsn`` accepts is read the same way by libpq
and asyncpg (so what the user meant is what connects), and one it refuses would have
failed in asyncpg or meant something else to one of the two.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from steeple.core.dsn import check_dsn, conninfo_url, dsn_secrets, redact_dsn, scrub
from steeple.core.errors import ConfigurationError

conninfo = pytest.importorskip("psycopg.conninfo")
connect_utils = pytest.importorskip("asyncpg.connect_utils")

MARKERS = [f"Mk{n}q" for n in range(5)]
SPECIALS = ["@", ":", "/", "?", "#", "&", "=", "%", "%40", "%2F", "%25", " ", "'", "\\", ","]


def libpq(dsn: str) -> dict[str, str] | None:
    try:
        return dict(conninfo.conninfo_to_dict(dsn))
    except Exception:  # libpq refuses it (psycopg.ProgrammingError)
        return None


def asyncpg_reading(dsn: str) -> dict[str, Any] | None:
    """asyncpg's own reading of a DSN (its private parser: the one connect() uses)."""
    try:
        addrs, params = connect_utils._parse_connect_dsn_and_args(
            dsn=dsn,
            host=None,
            port=None,
            user=None,
            password=None,
            passfile="/nonexistent",
            database=None,
            ssl=None,
            service=None,
            servicefile=None,
            direct_tls=None,
            server_settings=None,
            target_session_attrs=None,
            krbsrvname=None,
            gsslib=None,
        )
    except Exception:
        return None
    return {"addrs": addrs, "user": params.user, "password": params.password, "db": params.database}


@st.composite
def passwords(draw: st.DrawFn) -> str:
    chosen = MARKERS[: draw(st.integers(1, len(MARKERS)))]
    specials = draw(st.lists(st.sampled_from(SPECIALS), max_size=len(chosen)))
    parts = [
        p for pair in zip(chosen, [*specials, *[""] * len(chosen)], strict=False) for p in pair
    ]
    return "".join(draw(st.permutations(parts)))


@st.composite
def url_dsns(draw: st.DrawFn) -> str:
    password = draw(passwords())
    place = draw(st.sampled_from(["userinfo", "query"]))
    host = draw(st.sampled_from(["h", "h:5432", "h1,h2:5433", "[::1]:5432", "/tmp%2Fpg", ""]))
    path = draw(st.sampled_from(["", "/db", "/d%20b"]))
    params = draw(st.lists(st.sampled_from(["sslmode=require", "application_name=a"]), max_size=2))
    if place == "query":
        params.append(f"{draw(st.sampled_from(['password', 'pass%77ord']))}={password}")
        userinfo = "app@"
    else:
        userinfo = f"app:{password}@"
    query = "?" + "&".join(params) if params else ""
    return f"{draw(st.sampled_from(['postgresql://', 'postgres://']))}{userinfo}{host}{path}{query}"


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(url_dsns())
@example("postgresql://app:Mk0q%40Mk1q @h")  # libpq stops at the space; '@' was encoded
@example("postgresql://app@h?password=Mk0q&Mk1q=")  # a raw '&' in the password
def test_url_passwords_libpq_reads_are_never_shown(dsn: str) -> None:
    shown = redact_dsn(dsn)
    assert not [m for m in MARKERS if m in shown], (dsn, shown)
    read = libpq(dsn)
    if read is not None and read.get("password"):
        password = read["password"]
        assert password not in shown or len(password) < 3, (dsn, shown)
        scrubbed = scrub(f"error: {password}!", dsn)
        assert not [m for m in MARKERS if m in scrubbed], (dsn, scrubbed)
    theirs = asyncpg_reading(dsn)
    if theirs is not None and theirs["password"] and len(theirs["password"]) >= 3:
        assert theirs["password"] not in shown, (dsn, shown)
        assert theirs["password"] not in scrub(theirs["password"], dsn), dsn


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(
    password=passwords(),
    quoting=st.sampled_from(["quoted", "escaped", "raw"]),
    before=st.sampled_from(["", "host=h ", "host='a b' port=5432 "]),
    after=st.sampled_from(["", " user=me", " dbname='x y'"]),
)
def test_key_value_passwords_libpq_reads_are_never_shown(
    password: str, quoting: str, before: str, after: str
) -> None:
    if quoting == "quoted":
        value = "'" + password.replace("\\", "\\\\").replace("'", "\\'") + "'"
    elif quoting == "escaped":
        value = "".join("\\" + c if c in " '\\" else c for c in password)
    else:
        value = password
    dsn = f"{before}password = {value}{after}"
    shown = redact_dsn(dsn)
    assert not [m for m in MARKERS if m in shown], (dsn, shown)
    read = libpq(dsn)
    if read is not None:
        # the parse is libpq's: same keys, the password masked
        assert read["password"] in dsn_secrets(dsn) or len(read["password"]) < 3
        reparsed = libpq(shown)
        assert reparsed is not None, shown
        assert reparsed.pop("password") == "***"
        assert reparsed == {k: v for k, v in read.items() if k != "password"}
    else:
        assert shown == "***"


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(url_dsns())
def test_accepted_urls_mean_the_same_to_libpq_and_asyncpg(dsn: str) -> None:
    try:
        check_dsn(dsn)
    except ConfigurationError:
        return
    read = libpq(dsn)
    theirs = asyncpg_reading(dsn)
    assert read is not None, dsn
    assert theirs is not None, dsn
    assert (read.get("password") or None) == (theirs["password"] or None), dsn
    assert read.get("user") == theirs["user"], dsn
    # asyncpg gives (host, port) pairs, or a socket path for a directory host
    hosts = [a if isinstance(a, str) else a[0] for a in theirs["addrs"]]
    if read.get("host"):
        # a socket directory comes back from asyncpg as the socket file's path
        assert [h.rsplit("/.s.PGSQL.", 1)[0] for h in hosts] == read["host"].split(","), dsn
    assert any(m in (read.get("password") or "") for m in MARKERS) or "password" not in read


@pytest.mark.parametrize(
    ("dsn", "meant"),
    [
        ("postgresql://u:pa/ss@h/db", "pa/ss"),  # asyncpg: port 'pa' (ValueError quoting it)
        ("postgresql://u:pa?ss@h/db", "pa?ss"),  # asyncpg: query 'ss@h/db'
        ("postgresql://u:pa#ss@h/db", "pa#ss"),  # asyncpg: port 'pa'
        ("postgresql://u:p@ss@h/db", "p@ss"),  # both: password 'p', host 'ss@h'
        ("postgresql://u:pass word@h/db", "pass word"),  # libpq refuses
        ("postgresql://u:pw@h:99999/db", "pw"),
        ("postgresql://u@h/db?password=a&b", "a&b"),
    ],
)
def test_refused_urls_would_fail_or_be_misread(dsn: str, meant: str) -> None:
    with pytest.raises(ConfigurationError):
        check_dsn(dsn)
    read, theirs = libpq(dsn), asyncpg_reading(dsn)
    assert (
        read is None
        or theirs is None
        or read.get("password") != meant
        or theirs["password"] != meant
        or any(not isinstance(a, str) and not 0 < a[1] < 65536 for a in theirs["addrs"])
    ), dsn


# --- multi-host DSNs (failover setups) -------------------------------------------------------


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(
    password=passwords(),
    hosts=st.sampled_from(["h1,h2", "10.0.0.1,10.0.0.2,10.0.0.3", "'h1,h2'", "h"]),
    ports=st.sampled_from(["", " port=5432,5433", " port=5432"]),
    extra=st.sampled_from(["", " target_session_attrs=read-write", " dbname='x y'"]),
)
def test_key_value_multi_host_dsns_read_the_same_as_urls(
    password: str, hosts: str, ports: str, extra: str
) -> None:
    """``conninfo_url``: asyncpg reads the rewritten URL as libpq reads the key=value form."""
    value = "'" + password.replace("\\", "\\\\").replace("'", "\\'") + "'"
    dsn = f"host={hosts}{ports} user=app password={value}{extra}"
    read = libpq(dsn)
    assert read is not None, dsn
    if len(read.get("port", "").split(",")) not in {1, len(read["host"].split(","))}:
        return  # libpq refuses it at connect ("could not match 2 port numbers to 3 hosts")
    url = conninfo_url(dsn)
    assert check_dsn(url) == url
    theirs = asyncpg_reading(url)
    assert theirs is not None, (dsn, url)
    assert theirs["password"] == read["password"]
    assert theirs["user"] == read["user"] == "app"
    assert [a[0] for a in theirs["addrs"]] == read["host"].split(",")
    if read.get("port"):
        listed = [int(p) for p in read["port"].split(",")]
        wanted = listed * len(theirs["addrs"]) if len(listed) == 1 else listed
        assert [a[1] for a in theirs["addrs"]] == wanted
    if "dbname" in read:
        assert theirs["db"] == read["dbname"]
    shown = redact_dsn(url)
    assert not [m for m in MARKERS if m in shown], (url, shown)
    assert not [m for m in MARKERS if m in redact_dsn(dsn)], dsn
    assert read["password"] in dsn_secrets(url) or len(read["password"]) < 3


def test_both_drivers_accept_the_multi_host_url() -> None:
    """The URL form of a failover DSN: several ``host:port`` and ``target_session_attrs``."""
    url = (
        "postgresql://app:s%40cret@127.0.0.1:5432,127.0.0.1:5433/db?target_session_attrs=read-write"
    )
    assert check_dsn(url) == url
    assert conninfo_url(url) == url
    read = libpq(url)
    assert read is not None
    assert read["host"] == "127.0.0.1,127.0.0.1"
    assert read["port"] == "5432,5433"
    assert read["target_session_attrs"] == "read-write"
    assert read["password"] == "s@cret"
    theirs = asyncpg_reading(url)
    assert theirs is not None
    assert theirs["addrs"] == [("127.0.0.1", 5432), ("127.0.0.1", 5433)]
    assert theirs["password"] == "s@cret"
    assert redact_dsn(url) == (
        "postgresql://app:***@127.0.0.1:5432,127.0.0.1:5433/db?target_session_attrs=read-write"
    )
