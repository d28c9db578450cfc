"""PostgreSQL connection strings, read only to show them without secrets and to name faults.

Every surface that prints a DSN (the command line, reprs, error messages) goes through
:func:`redact_dsn`; every surface that accepts one checks it with :func:`check_dsn` before a
driver sees it, because drivers echo pieces of a malformed DSN (a password cut at a raw
``/`` or ``?`` comes back as "invalid literal for int(): 'pa'").

Both libpq forms are read: URLs (``postgresql://`` or ``postgres://``, userinfo, several
hosts, ``?key=value`` parameters, percent-encoding) and ``key=value`` strings (values
optionally in single quotes, backslash escapes). Parsers disagree on some malformed URLs:
libpq ends the userinfo at the first ``@`` before a ``/``, asyncpg at the first ``@`` before
a ``/``, ``?`` or ``#``, and a person meant the last one. Redaction masks the union of those
readings, and shows nothing when no reading is certain.
"""

from __future__ import annotations

import re
import unicodedata

from steeple.core.errors import ConfigurationError

__all__ = ["SAFE_PARAMETERS", "check_dsn", "conninfo_url", "dsn_secrets", "redact_dsn", "scrub"]

MASK = "***"
"""What a secret is shown as."""

SAFE_PARAMETERS = frozenset(
    {
        "application_name",
        "channel_binding",
        "client_encoding",
        "connect_timeout",
        "database",
        "dbname",
        "fallback_application_name",
        "gssencmode",
        "gsslib",
        "host",
        "hostaddr",
        "keepalives",
        "keepalives_count",
        "keepalives_idle",
        "keepalives_interval",
        "krbsrvname",
        "load_balance_hosts",
        "options",
        "passfile",
        "port",
        "replication",
        "requirepeer",
        "require_auth",
        "service",
        "ssl",
        "ssl_max_protocol_version",
        "ssl_min_protocol_version",
        "sslcert",
        "sslcompression",
        "sslcrl",
        "sslcrldir",
        "sslkey",
        "sslmode",
        "sslnegotiation",
        "sslrootcert",
        "sslsni",
        "target_session_attrs",
        "tcp_user_timeout",
        "user",
    }
)
"""Connection parameters whose values are shown; every other value (``password``,
``sslpassword``, a misspelt or unknown key, any case) is masked."""

_DBNAME_KEYS = frozenset({"dbname", "database"})
_URL_PREFIXES = ("postgresql://", "postgres://")
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://")
_SHOWN_KEY = re.compile(r"[A-Za-z0-9_.%\-]{1,64}")
_PERCENT = re.compile(r"%(?![0-9A-Fa-f]{2})|%00")
_PORT = re.compile(r"[0-9]{1,5}")
_IPV6_HOST = re.compile(r"\[[^\[\]]+\](?::([^:]*))?")
# libpq's isspace() in the C locale.
_CONNINFO_SPACE = " \t\n\v\f\r"
_MAX_SHOWN = 300
_UNPRINTABLE = frozenset({"Cc", "Cs", "Zl", "Zp"})
_PERCENT_HINT = (
    "percent-encode special characters in the user name and password "
    "('@' as %40, ':' as %3A, '/' as %2F, '?' as %3F, '#' as %23, '%' as %25)"
)


def _decode(text: str) -> str:
    """Percent-decode leniently (an invalid escape stays as written)."""
    if "%" not in text:
        return text
    raw = bytearray()
    i = 0
    while i < len(text):
        ch = text[i]
        if ch == "%" and _is_hex(text[i + 1 : i + 3]):
            raw.append(int(text[i + 1 : i + 3], 16))
            i += 3
            continue
        raw.extend(ch.encode("utf-8"))
        i += 1
    return raw.decode("utf-8", "replace")


def _is_hex(pair: str) -> bool:
    return len(pair) == 2 and all(c in "0123456789abcdefABCDEF" for c in pair)


def _printable(text: str) -> str:
    """Escape control and unencodable characters, bound the length (for one-line output)."""
    out = []
    for ch in text:
        if unicodedata.category(ch) in _UNPRINTABLE:
            code = ord(ch)
            out.append(f"\\x{code:02x}" if code < 256 else f"\\u{code:04x}")
        else:
            out.append(ch)
    shown = "".join(out)
    if len(shown) > _MAX_SHOWN:
        shown = shown[: _MAX_SHOWN - 3] + "..."
    return shown


# --- URL form --------------------------------------------------------------------------


def _url_parts(dsn: str) -> tuple[str, str | None, str, str, str | None] | None:
    """Split a URL as every parser might read it: (scheme, userinfo, hosts, path, query).

    Returns None when the readings disagree about where the credentials end.
    """
    match = _SCHEME.match(dsn)
    assert match is not None
    scheme = match.group(0)
    rest = dsn[match.end() :]
    head = rest.split("/", 1)[0]
    at = head.rfind("@")
    userinfo: str | None = None
    if at >= 0:
        userinfo = head[:at]
        if "?" in userinfo:
            # libpq reads credentials past a '?', asyncpg a password parameter: no reading
            # of where the secret ends is certain.
            return None
        rest = rest[at + 1 :]
    if "@" in rest:
        # An '@' after the host part: a password with a raw '/', or an '@' in the path or
        # query. No reading is certain, so nothing is shown.
        return None
    cut = len(rest)
    for stop in "/?":
        found = rest.find(stop)
        if 0 <= found < cut:
            cut = found
    hosts, rest = rest[:cut], rest[cut:]
    path, sep, query = rest.partition("?")
    return scheme, userinfo, hosts, path, query if sep else None


def _secret_parameter(name: str, value: str) -> bool:
    """Whether a parameter's value is masked: not a known safe key, or an expanding dbname."""
    return name not in SAFE_PARAMETERS or (name in _DBNAME_KEYS and _expands(value))


def _shown_parameter(key: str, value: str | None) -> str:
    if value is None:
        return MASK  # no '=': the whole item may be a misplaced secret
    shown_key = key if _SHOWN_KEY.fullmatch(key) else MASK
    if _secret_parameter(_decode(key), _decode(value)):
        return f"{shown_key}={MASK}"
    return f"{shown_key}={value}"


def _expands(value: str) -> bool:
    # libpq expands a dbname that looks like a connection string: never show one.
    return "=" in value or "://" in value


def _redact_url(dsn: str) -> str:
    parts = _url_parts(dsn)
    scheme = _SCHEME.match(dsn).group(0)  # type: ignore[union-attr]
    if parts is None:
        return scheme + MASK
    _, userinfo, hosts, path, query = parts
    shown = scheme
    if userinfo is not None:
        user = re.split(r"[:@]", userinfo, maxsplit=1)[0]
        after_user = userinfo[len(user) :]
        # "user:" (an empty password) is shown as written; anything after the user is masked.
        masked = "" if not after_user else ":" if after_user == ":" else ":" + MASK
        shown += user + masked + "@"
    shown += hosts + path
    if query is not None:
        items = []
        after_secret = False
        for item in query.split("&"):
            key, sep, value = item.partition("=")
            if after_secret and _decode(key) not in SAFE_PARAMETERS:
                # A raw '&' in a secret value makes its tail look like a parameter of its
                # own: an unknown key after a secret may be a piece of it.
                items.append(f"{MASK}={MASK}" if sep else MASK)
                continue
            items.append(_shown_parameter(key, value if sep else None))
            after_secret = (
                after_secret or not sep or _secret_parameter(_decode(key), _decode(value))
            )
        shown += "?" + "&".join(items)
    return shown


# --- key=value form ----------------------------------------------------------------------


def _conninfo_pairs(dsn: str) -> list[tuple[str, str, str]] | None:
    """Parse a libpq ``key=value`` string as libpq does: (key, value, value as written).

    Returns None when libpq would refuse it.
    """
    pairs: list[tuple[str, str, str]] = []
    i, n = 0, len(dsn)
    while True:
        i = _skip_space(dsn, i)
        if i >= n:
            return pairs
        start = i
        while i < n and dsn[i] != "=" and dsn[i] not in _CONNINFO_SPACE:
            i += 1
        key = dsn[start:i]
        i = _skip_space(dsn, i)
        if i >= n or dsn[i] != "=" or not key:
            return None
        value_start = i = _skip_space(dsn, i + 1)
        read = _conninfo_value(dsn, i)
        if read is None:
            return None
        value, i = read
        pairs.append((key, value, dsn[value_start:i]))


def _skip_space(dsn: str, i: int) -> int:
    while i < len(dsn) and dsn[i] in _CONNINFO_SPACE:
        i += 1
    return i


def _conninfo_value(dsn: str, i: int) -> tuple[str, int] | None:
    """Read the value starting at ``dsn[i]``: (the value, where it ends), None if unterminated.

    A quoted value runs to its closing quote; a bare one to the next space. A backslash
    escapes the next character in both.
    """
    n = len(dsn)
    quoted = i < n and dsn[i] == "'"
    if quoted:
        i += 1
    value: list[str] = []
    while True:
        if i >= n:
            return None if quoted else ("".join(value), i)
        ch = dsn[i]
        if quoted and ch == "'":
            return "".join(value), i + 1
        if not quoted and ch in _CONNINFO_SPACE:
            return "".join(value), i
        if ch == "\\":
            i += 1
            if i < n:
                value.append(dsn[i])
                i += 1
            continue
        value.append(ch)
        i += 1


def _quote_conninfo(value: str) -> str:
    if value and not any(c in value for c in _CONNINFO_SPACE + "'\\"):
        return value
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _redact_conninfo(dsn: str) -> str:
    pairs = _conninfo_pairs(dsn)
    if pairs is None:
        return MASK
    shown = []
    after_secret = False
    for key, value, _ in pairs:
        if after_secret and key not in SAFE_PARAMETERS:
            # A raw space in a secret value makes its tail look like a pair of its own: an
            # unknown key after a secret may be a piece of it.
            shown.append(f"{MASK}={MASK}")
        elif _secret_parameter(key, value):
            shown.append(f"{key if _SHOWN_KEY.fullmatch(key) else MASK}={MASK}")
            after_secret = True
        else:
            shown.append(f"{key}={_quote_conninfo(value)}")
    return " ".join(shown)


# --- public ----------------------------------------------------------------------------------


def redact_dsn(dsn: object) -> str:
    """Return ``dsn`` safe to print: every password and unknown parameter value masked.

    Handles URLs (userinfo passwords with raw or percent-encoded ``@ : / ?``, ``password=``
    and ``sslpassword=`` parameters in any case or encoding) and ``key=value`` strings
    (quoted values, escapes). What cannot be read with certainty is masked whole. The
    result is one line (control characters escaped) of at most 300 characters. Never raises.
    """
    if not isinstance(dsn, str):
        return MASK
    if _SCHEME.match(dsn):
        return _printable(_redact_url(dsn))
    return _printable(_redact_conninfo(dsn))


def check_dsn(dsn: object) -> str:
    """Require a ``postgresql://`` URL that libpq and asyncpg read the same way.

    Refuses what a driver would reject with a message echoing part of the DSN (a bad port,
    a malformed parameter, a bad percent escape) and what drivers would read differently
    from what was meant (a raw ``@``, ``?``, ``/`` or ``#`` in the credentials). Messages
    never quote the DSN; show it with :func:`redact_dsn`.

    Returns:
        ``dsn`` unchanged.

    Raises:
        ConfigurationError: saying what to fix.
    """
    if not isinstance(dsn, str):
        raise ConfigurationError(f"the database URL must be a str, not {type(dsn).__name__}")
    if not dsn.startswith(_URL_PREFIXES):
        raise ConfigurationError(
            "the database URL is not a postgresql:// URL; write it like "
            "postgresql://user@host:5432/dbname"
        )
    _check_characters(dsn)
    rest = dsn.split("://", 1)[1]
    netloc = re.split(r"[/?]", rest, maxsplit=1)[0]
    _check_netloc(netloc, rest)
    query = rest.partition("?")[2]
    if query:
        _check_query(query)
    return dsn


def _check_characters(dsn: str) -> None:
    """Refuse a URL holding characters no driver reads as meant."""
    if any(ord(c) < 32 or ord(c) == 127 for c in dsn):
        raise ConfigurationError(
            "the database URL contains a control character (NUL, tab, newline...); "
            "percent-encode it or remove it"
        )
    try:
        dsn.encode("utf-8")
    except UnicodeEncodeError:
        raise ConfigurationError(
            "the database URL is not valid text (it holds an undecodable byte or a lone "
            "surrogate); write it in UTF-8"
        ) from None
    if any(c.isspace() for c in dsn):
        raise ConfigurationError(
            f"the database URL contains a space: percent-encode it as %20; {_PERCENT_HINT}"
        )
    if "#" in dsn:
        raise ConfigurationError(f"the database URL contains a raw '#': {_PERCENT_HINT}")
    if _PERCENT.search(dsn):
        raise ConfigurationError(
            f"the database URL has a '%' that is not a valid escape (or is %00): {_PERCENT_HINT}"
        )


def _check_netloc(netloc: str, rest: str) -> None:
    """Refuse credentials drivers would read differently, and bad hosts or ports."""
    if "@" in rest[len(netloc) :]:
        # Drivers would read the credentials differently (or not at all): a password with
        # a raw '/' or '?' puts its tail, and the host, into the path or the query.
        raise ConfigurationError(
            f"the database URL has an '@' after the host part: {_PERCENT_HINT}; write an "
            "'@' in the database name or a parameter as %40"
        )
    if netloc.count("@") > 1:
        raise ConfigurationError(f"the database URL has more than one '@': {_PERCENT_HINT}")
    hosts = netloc.rpartition("@")[2]
    for number, spec in enumerate(hosts.split(","), start=1):
        if spec.startswith("["):
            match = _IPV6_HOST.fullmatch(spec)
            if match is None:
                raise ConfigurationError(
                    f"host {number} of the database URL is not a valid [IPv6] address"
                    f"[:port]; {_PERCENT_HINT}"
                )
            port = match.group(1) or ""
        else:
            port = spec.partition(":")[2]
        _check_port(port, f"host {number}")


def _check_query(query: str) -> None:
    """Refuse a parameter that is not ``key=value``, and a bad ``port`` parameter."""
    for number, item in enumerate(query.split("&"), start=1):
        key, sep, value = item.partition("=")
        if not sep or not key or "=" in value:
            raise ConfigurationError(
                f"parameter {number} of the database URL is not key=value; separate "
                "parameters with '&' and percent-encode '=' and '&' in values "
                "(%3D, %26)"
            )
        if _decode(key) == "port":
            for port in _decode(value).split(","):
                _check_port(port, "the port parameter")


def _check_port(port: str, where: str) -> None:
    if port == "":
        return
    if not _PORT.fullmatch(port) or not 1 <= int(port) <= 65535:
        raise ConfigurationError(
            f"the port of {where} in the database URL is not a number from 1 to 65535; "
            f"if the password holds '/', '?' or '#', {_PERCENT_HINT}"
        )


def conninfo_url(dsn: object) -> str:
    """Return ``dsn`` as a ``postgresql://`` URL: a libpq ``key=value`` string is rewritten.

    asyncpg reads only URLs; libpq and psycopg read both forms. Every pair of a
    ``key=value`` string (``host=a,b port=5432,5433 target_session_attrs=read-write``, the
    multi-host form of a failover setup) becomes a percent-encoded query parameter of
    ``postgresql://``, which asyncpg and libpq read as the same connection. A URL (or
    anything else that is not a ``key=value`` string) is returned unchanged, for
    :func:`check_dsn` to judge.

    Raises:
        ConfigurationError: a ``key=value`` string libpq would refuse (an unterminated
            quote, a key without ``=``) or holding a lone surrogate; the message never
            quotes it.
    """
    if not isinstance(dsn, str) or _SCHEME.match(dsn) or "=" not in dsn:
        return dsn if isinstance(dsn, str) else check_dsn(dsn)
    pairs = _conninfo_pairs(dsn)
    if pairs is None or not pairs:
        raise ConfigurationError(
            "the database connection string is neither a postgresql:// URL nor a valid "
            "key=value string (check for an unterminated quote or a word without '='); "
            "write it like host=db1,db2 port=5432,5432 dbname=app target_session_attrs=read-write"
        )
    try:
        query = "&".join(f"{_encode(key, '')}={_encode(value, ',')}" for key, value, _ in pairs)
    except UnicodeEncodeError:
        raise ConfigurationError(
            "the database connection string is not valid text (it holds a lone surrogate); "
            "write it in UTF-8"
        ) from None
    return f"postgresql://?{query}"


_UNRESERVED = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~")


def _encode(text: str, safe: str) -> str:
    """Percent-encode ``text`` (UTF-8) for a URL query, keeping unreserved and ``safe``."""
    kept = _UNRESERVED | frozenset(safe)
    return "".join(
        ch if ch in kept else "".join(f"%{b:02X}" for b in ch.encode("utf-8")) for ch in text
    )


def dsn_secrets(dsn: object) -> tuple[str, ...]:
    """Every piece of ``dsn`` that some parser could read as a secret, longest first.

    For scrubbing text a driver produced (see :func:`scrub`): the password as libpq,
    asyncpg and a person would read it, raw and percent-decoded, the values of every
    parameter that :func:`redact_dsn` masks, and their fragments between delimiters.
    """
    if not isinstance(dsn, str):
        return ()
    scheme = _SCHEME.match(dsn)
    found = _url_secrets(dsn[scheme.end() :]) if scheme else _conninfo_secrets(dsn)
    pieces = set()
    for secret in found:
        decoded = _decode(secret)
        pieces.update({secret, decoded, decoded.strip(_CONNINFO_SPACE)})
        # Fragments of the written and of the decoded form (a parser may stop at an
        # encoded '@' or a space inside the value).
        for form in (secret, decoded):
            pieces.update(re.split(r"[@:/?#&=,'\\\s]", form))
    return tuple(sorted((p for p in pieces if len(p) >= 3), key=len, reverse=True))


def _url_secrets(rest: str) -> set[str]:
    """Collect what some parser could read as a secret in a URL (``rest``: after its scheme)."""
    found: set[str] = set()
    readings = [
        rest.split("/", 1)[0].rpartition("@"),  # a person: the last '@' before a '/'
        rest.split("/", 1)[0].partition("@"),  # libpq: the first '@' before a '/'
        re.split(r"[/?#]", rest, maxsplit=1)[0].partition("@"),  # asyncpg
        rest.rpartition("@"),  # a password holding a raw '/'
    ]
    for userinfo, at, _ in readings:
        if at:
            user = re.split(r"[:@]", userinfo, maxsplit=1)[0]
            found.add(userinfo[len(user) + 1 :])
    query = rest.partition("?")[2]
    after_secret = False
    for item in query.split("&") if query else ():
        key, sep, value = item.partition("=")
        if after_secret and _decode(key) not in SAFE_PARAMETERS:
            found.update({key, value})  # maybe the tail of a secret holding a raw '&'
        if not sep:
            found.add(item)
            after_secret = True
        elif _secret_parameter(_decode(key), _decode(value)):
            found.update({value, _decode(value)})
            after_secret = True
    return found


def _conninfo_secrets(dsn: str) -> set[str]:
    """Collect what some parser could read as a secret in a ``key=value`` string."""
    found: set[str] = set()
    pairs = _conninfo_pairs(dsn)
    if pairs is None:
        found.add(dsn)  # unreadable: any part of it may be the secret
    after_secret = False
    for key, value, written in pairs or ():
        if after_secret and key not in SAFE_PARAMETERS:
            found.update({key, value, written})  # maybe the tail of a secret
        elif _secret_parameter(key, value):
            found.update({value, written})
            after_secret = True
    return found


def scrub(text: str, dsn: object) -> str:
    """Return ``text`` with every secret of ``dsn`` (see :func:`dsn_secrets`) masked."""
    for secret in dsn_secrets(dsn):
        text = text.replace(secret, MASK)
    return text
