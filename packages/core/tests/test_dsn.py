"""DSN redaction and checking: no libpq form shows a password, no message quotes the DSN."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from steeple.core.dsn import check_dsn, conninfo_url, dsn_secrets, redact_dsn, scrub
from steeple.core.errors import ConfigurationError

SECRET = "Hunter2Secret"


@pytest.mark.parametrize(
    ("dsn", "shown"),
    [
        ("postgresql://u:hunter2@h:5432/db", "postgresql://u:***@h:5432/db"),
        ("postgres://u:hunter2@h/db", "postgres://u:***@h/db"),
        ("POSTGRESQL://u:hunter2@h/db", "POSTGRESQL://u:***@h/db"),
        ("postgresql://u@h/db", "postgresql://u@h/db"),
        # an empty password is shown as written (nothing to hide)
        (
            "postgresql://postgres:@/postgres?host=/tmp",
            "postgresql://postgres:@/postgres?host=/tmp",
        ),
        ("postgresql://u:p%40ss%3Aw%2Fd@h/db", "postgresql://u:***@h/db"),
        ("postgresql://u:p@ss@h/db", "postgresql://u:***@h/db"),
        ("postgresql://u:p:a:ss@h/db", "postgresql://u:***@h/db"),
        ("postgresql://u:pa#ss@h/db", "postgresql://u:***@h/db"),
        ("postgresql://u:pa,ss@h1,h2:5433/db", "postgresql://u:***@h1,h2:5433/db"),
        # parsers disagree where the secret ends: nothing but the scheme is shown
        ("postgresql://u:pa/ss@h/db", "postgresql://***"),
        ("postgresql://u:pa?ss@h/db", "postgresql://***"),
        ("postgresql://u@h/db?application_name=a@b", "postgresql://***"),
        ("postgresql://u@h?password=x:y@z", "postgresql://***"),
        # password parameters, any case or encoding; unknown keys are masked too
        ("postgresql://u@h/db?password=pw1", "postgresql://u@h/db?password=***"),
        (
            "postgresql://u@h/db?sslmode=require&password=pw1&application_name=app",
            "postgresql://u@h/db?sslmode=require&password=***&application_name=app",
        ),
        ("postgresql://u@h/db?PassWord=pw1", "postgresql://u@h/db?PassWord=***"),
        ("postgresql://u@h/db?pass%77ord=pw1", "postgresql://u@h/db?pass%77ord=***"),
        ("postgresql://u@h/db?sslpassword=pw1", "postgresql://u@h/db?sslpassword=***"),
        ("postgresql://u@h/db?password=a%26b&x", "postgresql://u@h/db?password=***&***"),
        # a raw '&' in the password: its tail looks like a parameter of its own
        ("postgresql://u@h?password=pw0&pw1tail=", "postgresql://u@h?password=***&***=***"),
        (
            "postgresql://u@h?password=pw0&pw1&sslmode=require",
            "postgresql://u@h?password=***&***&sslmode=require",
        ),
        ("postgresql://u@h/db?password", "postgresql://u@h/db?***"),
        ("postgresql://u@h/db?k%20ey=pw1", "postgresql://u@h/db?k%20ey=***"),
        ("postgresql://u@h/db?k;ey=pw1", "postgresql://u@h/db?***=***"),
        ("postgresql://u@h/db?dbname=host%3Dx%20password%3Dy", "postgresql://u@h/db?dbname=***"),
        # key=value strings (libpq's conninfo)
        ("host=x password=secret", "host=x password=***"),
        ("host=x  password = secret  user=me", "host=x password=*** user=me"),
        ("host=x password='a b\\'c' user=me", "host=x password=*** user=me"),
        ("password=a\\ b host=x", "password=*** host=x"),
        ("host='my host' dbname=db", "host='my host' dbname=db"),
        ("dbname='password=zz host=h'", "dbname=***"),
        ("host=x PASSWORD=secret", "host=x PASSWORD=***"),
        # libpq refuses these: the whole string is masked
        ("host=x password='unterminated", "***"),
        ("host=x garbage secret", "***"),
        ("secret", "***"),
        ("", ""),
    ],
)
def test_redact_dsn(dsn: str, shown: str) -> None:
    assert redact_dsn(dsn) == shown


def test_redact_dsn_is_one_bounded_printable_line() -> None:
    shown = redact_dsn("postgresql://u:pw@h/d\nb\x1b[31m\udc80" + "x" * 10_000)
    assert "\n" not in shown
    assert "\x1b" not in shown
    assert "\udc80" not in shown
    assert len(shown) <= 300
    shown.encode("utf-8")
    assert redact_dsn(None) == "***"
    assert redact_dsn(b"postgresql://u:pw@h") == "***"


# Password material: unique markers between the characters that confuse parsers. A marker
# (or any fragment holding one) in the output is a leak.
MARKERS = [f"Mk{n}q" for n in range(6)]
SPECIALS = ["@", ":", "/", "?", "#", "&", "=", "%", "%40", "%2F", "%3A", " ", "'", "\\", ","]


@st.composite
def passwords(draw: st.DrawFn) -> str:
    parts = draw(st.lists(st.sampled_from(SPECIALS), min_size=0, max_size=6))
    out = []
    for index, marker in enumerate(MARKERS[: draw(st.integers(1, len(MARKERS)))]):
        out.append(marker)
        if index < len(parts):
            out.append(parts[index])
    return "".join(draw(st.permutations(out)))


def leaked(shown: str) -> list[str]:
    return [m for m in MARKERS if m in shown]


def refusal(dsn: str) -> str:
    """check_dsn's message for ``dsn`` ("" when accepted; only ConfigurationError may come)."""
    try:
        assert check_dsn(dsn) == dsn
    except ConfigurationError as exc:
        return str(exc)
    return ""


@given(
    password=passwords(),
    scheme=st.sampled_from(["postgresql://", "postgres://"]),
    host=st.sampled_from(["h", "h:5432", "h1,h2:5433", "[::1]:5432", ""]),
    path=st.sampled_from(["", "/db", "/d%20b"]),
    where=st.sampled_from(["userinfo", "query", "both"]),
    key=st.sampled_from(["password", "PASSWORD", "Password", "pass%77ord", "sslpassword"]),
    extra=st.sampled_from(["", "sslmode=require", "application_name=app"]),
)
def test_no_url_form_shows_a_password(
    password: str, scheme: str, host: str, path: str, where: str, key: str, extra: str
) -> None:
    userinfo = f"app:{password}@" if where in {"userinfo", "both"} else "app@"
    params = [extra] if extra else []
    if where in {"query", "both"}:
        params.append(f"{key}={password}")
    dsn = scheme + userinfo + host + path + ("?" + "&".join(params) if params else "")
    shown = redact_dsn(dsn)
    assert leaked(shown) == [], (dsn, shown)
    assert leaked(scrub(dsn, dsn)) == [], dsn
    assert leaked(refusal(dsn)) == [], dsn


@given(
    password=passwords(),
    quoting=st.sampled_from(["quoted", "escaped", "raw"]),
    key=st.sampled_from(["password", "PASSWORD", "sslpassword", "passwd"]),
    before=st.sampled_from(["", "host=h ", "host='my h' port=5432 "]),
    after=st.sampled_from(["", " user=me", " dbname='x y'"]),
)
def test_no_key_value_form_shows_a_password(
    password: str, quoting: str, key: str, before: str, after: str
) -> None:
    if quoting == "quoted":
        value = "'" + password.replace("\\", "\\\\").replace("'", "\\'") + "'"
    elif quoting == "escaped":
        value = "".join("\\" + c if c in " '\\" else c for c in password)
    else:
        value = password
    dsn = f"{before}{key} = {value}{after}"
    shown = redact_dsn(dsn)
    assert leaked(shown) == [], (dsn, shown)
    assert leaked(scrub(dsn, dsn)) == [], dsn
    with pytest.raises(ConfigurationError) as caught:
        check_dsn(dsn)
    assert leaked(str(caught.value)) == []


@given(st.text(max_size=200))
def test_arbitrary_text_never_raises_from_redact_and_only_typed_from_check(text: str) -> None:
    redact_dsn(text)
    scrub(text, text)
    refusal(text)
    candidate = "postgresql://" + text
    assert candidate not in refusal(candidate)


@pytest.mark.parametrize(
    "dsn",
    [
        "postgresql://u:pw@127.0.0.1:5432/test",
        "postgres://u@h/db",
        "postgresql://postgres:@/postgres?host=/tmp/pg",
        "postgresql:///db?host=/var/run/postgresql",
        "postgresql://u:p%40ss%3Aw%2Fd%3F%23@h/db",
        "postgresql://u:pa,ss:x@h1:5432,h2:5433/db",
        "postgresql://u@[::1]:5432/db",
        "postgresql://u@[::1],h:1/db",
        "postgresql://u@h/db?sslmode=verify-full&sslrootcert=/etc/ca.pem",
        "postgresql://u@h/db?port=5432,5433",
        "postgresql://u@h/db?",
        "postgresql://u@h:/db",
        "postgresql://u@h/db?application_name=a%40b",
        "postgresql://u@h/db?password=a:b",
        "postgresql://h/db?options=-c%20search_path%3Dx",
    ],
)
def test_check_dsn_accepts_well_formed_urls(dsn: str) -> None:
    assert check_dsn(dsn) == dsn


@pytest.mark.parametrize(
    ("dsn", "fault"),
    [
        (f"postgresql://u:{SECRET}@h:99999/db", "port"),
        (f"postgresql://u:{SECRET}@h:abc/db", "port"),
        (f"postgresql://u:{SECRET}@h:0/db", "port"),
        (f"postgresql://u:{SECRET}@h:-1/db", "port"),
        (f"postgresql://u:{SECRET}@h:5432:9/db", "port"),
        (f"postgresql://u:{SECRET}@h:{'9' * 5000}/db", "port"),
        (f"postgresql://u:{SECRET}@h1,h2:x/db", "host 2"),
        (f"postgresql://u:{SECRET}/x@h/db", "after the host"),  # a raw '/' in the password
        (f"postgresql://u:{SECRET}/x:1@h/db", "after the host"),
        (f"postgresql://u:{SECRET}?x@h/db", "after the host"),
        ("postgresql://u@h/d@b", "after the host"),
        ("postgresql://u@h/db?application_name=a@b", "after the host"),
        (f"postgresql://u:x/{SECRET}/db", "port"),  # no '@' at all: drivers read port 'x
        (f"postgresql://u:{SECRET}#x@h/db", "'#'"),
        (f"postgresql://u:{SECRET}@x@h/db", "more than one '@'"),
        (f"postgresql://u:{SECRET}%zz@h/db", "escape"),
        (f"postgresql://u:{SECRET}%00@h/db", "escape"),
        (f"postgresql://u:{SECRET}@h/db?password", "key=value"),
        (f"postgresql://u@h/db?password={SECRET}&&a=b", "key=value"),
        (f"postgresql://u@h/db?password={SECRET}=x", "key=value"),
        (f"postgresql://u@h/db?password={SECRET}&port=abc", "port"),
        (f"postgresql://u:{SECRET}@[::1/db", "IPv6"),
        (f"postgresql://u:{SECRET}@[::1]x/db", "IPv6"),
        (f"postgresql://u:{SECRET}\x00@h/db", "control character"),
        (f"postgresql://u:{SECRET}\n@h/db", "control character"),
        (f"postgresql://u:{SECRET} x@h/db", "space"),
        (f"postgresql://u:{SECRET}\u00a0@h/db", "space"),
        (f"postgresql://u:{SECRET}\udc80@h/db", "not valid text"),
        (f"host=h password={SECRET}", "not a postgresql:// URL"),
        (f"mysql://u:{SECRET}@h/db", "not a postgresql:// URL"),
        (f"POSTGRESQL://u:{SECRET}@h/db", "not a postgresql:// URL"),
        (SECRET, "not a postgresql:// URL"),
        ("", "not a postgresql:// URL"),
    ],
)
def test_check_dsn_names_the_fault_and_never_quotes_the_dsn(dsn: str, fault: str) -> None:
    with pytest.raises(ConfigurationError) as caught:
        check_dsn(dsn)
    message = str(caught.value)
    assert fault in message
    assert SECRET[:6] not in message
    assert len(message) < 400
    assert isinstance(caught.value, ValueError)


def test_check_dsn_refuses_non_str() -> None:
    with pytest.raises(ConfigurationError, match="must be a str"):
        check_dsn(b"postgresql://h/db")


def test_secrets_cover_every_reading_of_the_password() -> None:
    # libpq/asyncpg read "p" and host "ss@h", a person "p@ss": all are scrubbed (>= 3 chars)
    assert {"p@ss"} <= set(dsn_secrets("postgresql://u:p@ss@h/db"))
    # a raw '/': drivers read port "pass" and database "word@h/db"
    secrets = set(dsn_secrets("postgresql://u:pass/word@h/db"))
    assert {"pass", "word", "pass/word"} <= secrets
    assert scrub("invalid literal for int() with base 10: 'pass'", "postgresql://u:pass/w@h") == (
        "invalid literal for int() with base 10: '***'"
    )
    assert "sEcret" not in scrub("x sEcret y", "postgresql://u@h/db?PASSWORD=sEcret")
    assert "sEcret" not in scrub("x sEcret y", "host=h password='sEcret'")
    # values shown by redact_dsn are not secrets
    assert dsn_secrets("postgresql://u@h/db?sslmode=require") == ()
    assert dsn_secrets(None) == ()


@pytest.mark.parametrize(
    ("dsn", "text", "hidden"),
    [
        # libpq stops the password at the space; the '@' in it was percent-encoded.
        ("postgresql://app:pw0%40pw1 @h", "error: pw0@pw1!", ("pw0", "pw1")),
        # a raw '&' in a ?password= value: its tail reads as a parameter of its own.
        ("postgresql://app@h?password=pw0&pw1tail=", "bad option pw1tail", ("pw1tail",)),
    ],
)
def test_scrub_masks_every_reading_of_the_password(
    dsn: str, text: str, hidden: tuple[str, ...]
) -> None:
    scrubbed = scrub(text, dsn)
    assert [h for h in hidden if h in scrubbed] == [], scrubbed


@pytest.mark.parametrize(
    "dsn",
    [
        "password = Mk0q@Mk1q Mk2q=Mk3q@",
        "host=h sslpassword = Mk0q@Mk1q Mk2q=Mk3q@ user=me",
        "passwd = Mk0q Mk1q=Mk2q dbname='x y'",
    ],
)
def test_an_unknown_pair_after_a_secret_is_masked_as_part_of_it(dsn: str) -> None:
    # A raw space in a key=value password makes its tail read as a pair of its own.
    assert leaked(redact_dsn(dsn)) == [], redact_dsn(dsn)
    assert leaked(scrub(dsn, dsn)) == [], scrub(dsn, dsn)


# --- multi-host DSNs (failover setups) -------------------------------------------------------


@pytest.mark.parametrize(
    ("dsn", "shown"),
    [
        (
            "postgresql://app:pw1@10.0.0.1:5432,10.0.0.2:5433/db?target_session_attrs=read-write",
            "postgresql://app:***@10.0.0.1:5432,10.0.0.2:5433/db?target_session_attrs=read-write",
        ),
        (
            "postgresql://app@/db?host=a,b&port=1,2&password=pw1&target_session_attrs=primary",
            "postgresql://app@/db?host=a,b&port=1,2&password=***&target_session_attrs=primary",
        ),
        (
            "host=a,b port=5432,5433 password=pw1 target_session_attrs=read-write",
            "host=a,b port=5432,5433 password=*** target_session_attrs=read-write",
        ),
        (
            "host=a,b password='pw1 pw2,pw3' user=me",
            "host=a,b password=*** user=me",
        ),
    ],
)
def test_multi_host_dsns_are_shown_without_their_password(dsn: str, shown: str) -> None:
    assert redact_dsn(dsn) == shown
    assert "pw1" in dsn_secrets(dsn) or "pw1 pw2,pw3" in dsn_secrets(dsn)
    assert "pw" not in scrub(f"failed: {dsn}", dsn).replace("password", "")


def test_multi_host_urls_are_accepted() -> None:
    for dsn in (
        "postgresql://app@10.0.0.1:5432,10.0.0.2:5433/db?target_session_attrs=read-write",
        "postgresql://app@10.0.0.1,10.0.0.2/db?port=5432,5433&target_session_attrs=read-write",
        "postgresql://app@[::1]:5432,10.0.0.2:5433/db?target_session_attrs=primary",
    ):
        assert check_dsn(dsn) == dsn
        assert conninfo_url(dsn) == dsn
    with pytest.raises(ConfigurationError, match="host 2"):
        check_dsn("postgresql://app@a:5432,b:99999/db")
    with pytest.raises(ConfigurationError, match="port parameter"):
        check_dsn("postgresql://app@a,b/db?port=5432,x")


@pytest.mark.parametrize(
    ("dsn", "url"),
    [
        (
            "host=127.0.0.1,127.0.0.1 port=5432,5433 target_session_attrs=read-write",
            "postgresql://?host=127.0.0.1,127.0.0.1&port=5432,5433&target_session_attrs=read-write",
        ),
        (
            "host=a dbname='my db' user=me password='p@ss w/rd?&#%'",
            "postgresql://?host=a&dbname=my%20db&user=me&password=p%40ss%20w%2Frd%3F%26%23%25",
        ),
    ],
)
def test_key_value_dsns_become_urls(dsn: str, url: str) -> None:
    assert conninfo_url(dsn) == url
    assert check_dsn(url) == url
    assert "p@ss" not in redact_dsn(url)
    assert "p%40ss" not in redact_dsn(url)


@pytest.mark.parametrize(
    "dsn",
    ["host=a password='Mk9unclosed", "host=a garbage Mk9secret=1", "host=a password=Mk9\ud800"],
)
def test_unreadable_key_value_dsns_are_refused_without_quoting_them(dsn: str) -> None:
    with pytest.raises(ConfigurationError, match=r"key=value|not valid text") as refused:
        conninfo_url(dsn)
    assert "Mk9" not in str(refused.value)


def test_strings_without_pairs_pass_through_for_check_dsn() -> None:
    assert conninfo_url("postgresql://h/db") == "postgresql://h/db"
    assert conninfo_url("just text") == "just text"
    with pytest.raises(ConfigurationError):
        conninfo_url(None)
