"""Connection failures in the server's (or TLS's) own words, with a hint that fits the cause.

A private PostgreSQL cluster (pgserver) with password authentication for a role; for TLS
(pgserver's build has none), an endpoint that answers PostgreSQL's SSLRequest and presents
a certificate for ``localhost`` signed by a CA made here.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import os
import re
import ssl
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest

pytestmark = pytest.mark.usefixtures("clean_env")

STEEPLE = [sys.executable, "-c", "from steeple.admin.cli import main; main()"]


def steeple(args: list[str], tmp_path: Path, **env: str) -> Any:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("STEEPLE_")}
    environ.update(env)
    return subprocess.run(
        [*STEEPLE, *args],
        env=environ,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def lines_of(result: Any) -> list[str]:
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 2, result.stderr
    assert lines[0].startswith("steeple: error: "), result.stderr
    assert lines[1].startswith("  what to do: "), result.stderr
    return list(lines)


def _prepend(path: Path, line: str) -> None:
    path.write_text(line + path.read_text())


@pytest.mark.slow
async def test_a_wrong_password_is_named_with_a_password_hint(
    private_pg: Any, tmp_path: Path
) -> None:
    conn = await asyncpg.connect(private_pg.get_uri())
    try:
        await conn.execute("CREATE ROLE pw_user LOGIN PASSWORD 'right-password'")
        hba = Path(await conn.fetchval("SHOW hba_file"))
        await asyncio.to_thread(_prepend, hba, "local all pw_user scram-sha-256\n")
        await conn.execute("SELECT pg_reload_conf()")
    finally:
        await conn.close()
    parts = urlsplit(private_pg.get_uri())
    wrong = urlunsplit(parts._replace(netloc="pw_user:Wrong-Password-77@"))
    for args in (["tasks"], ["schedules"]):
        result = await asyncio.to_thread(
            steeple, [*args, "--dsn", wrong], tmp_path, STEEPLE_KEYS="k1:" + "A" * 43 + "="
        )
        assert result.returncode == 3, result.stderr
        error, hint = lines_of(result)
        assert 'password authentication failed for user "pw_user"' in error
        assert "password" in hint
        assert "Wrong-Password-77" not in result.stderr
        assert "PostgreSQL is running" not in result.stderr


# --- TLS ---------------------------------------------------------------------------------------


def _certificates(directory: Path) -> dict[str, Path]:
    """A CA, a server certificate for ``localhost`` it signs, and an unrelated CA.

    The certificate names no IP address: connecting to 127.0.0.1 is a hostname mismatch.
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = dt.datetime.now(dt.UTC)

    def name(common: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])

    def authority(common: str) -> tuple[Any, x509.Certificate]:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            x509.CertificateBuilder()
            .subject_name(name(common))
            .issuer_name(name(common))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(days=1))
            .not_valid_after(now + dt.timedelta(days=2))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256())
        )
        return key, cert

    ca_key, ca = authority("steeple test CA")
    _, other = authority("some other CA")
    server_key = ec.generate_private_key(ec.SECP256R1())
    server = (
        x509.CertificateBuilder()
        .subject_name(name("localhost"))
        .issuer_name(ca.subject)
        .public_key(server_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(days=1))
        .not_valid_after(now + dt.timedelta(days=2))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    paths = {name: directory / f"{name}.pem" for name in ("ca", "other", "cert", "key")}
    paths["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths["other"].write_bytes(other.public_bytes(serialization.Encoding.PEM))
    paths["cert"].write_bytes(server.public_bytes(serialization.Encoding.PEM))
    paths["key"].write_bytes(
        server_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return paths


@contextlib.asynccontextmanager
async def tls_endpoint(paths: dict[str, Path], *, accept: bool = True) -> AsyncIterator[int]:
    """A TCP endpoint on 127.0.0.1 that answers PostgreSQL's SSLRequest and speaks TLS.

    It presents the ``localhost`` certificate; the client's verification (sslmode=
    verify-full) fails or passes before any PostgreSQL message is exchanged, which is all
    these tests look at. With ``accept`` false it declines TLS ('N'), as a server with
    ssl=off does.
    """
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(paths["cert"], paths["key"])

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readexactly(8)  # SSLRequest: length 8, code 80877103
            writer.write(b"S" if accept else b"N")
            await writer.drain()
            if accept:
                await writer.start_tls(context)
                await reader.read(1)  # until the client gives up
        except (OSError, asyncio.IncompleteReadError, ssl.SSLError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield int(server.sockets[0].getsockname()[1])
    finally:
        server.close()
        await server.wait_closed()


async def test_verify_full_failures_name_the_tls_reason(tmp_path: Path) -> None:
    paths = await asyncio.to_thread(_certificates, tmp_path)
    keys = "k1:" + "A" * 43 + "="

    def dsn(host: str, port: int, ca: Path) -> str:
        return f"postgresql://postgres@{host}:{port}/postgres?sslmode=verify-full&sslrootcert={ca}"

    async with tls_endpoint(paths) as port:
        mismatch = await asyncio.to_thread(
            steeple, ["tasks", "--dsn", dsn("127.0.0.1", port, paths["ca"])], tmp_path
        )
        unknown_ca = await asyncio.to_thread(
            steeple,
            ["schedules", "--dsn", dsn("localhost", port, paths["other"])],
            tmp_path,
            STEEPLE_KEYS=keys,
        )
    async with tls_endpoint(paths, accept=False) as port:
        declined = await asyncio.to_thread(
            steeple, ["tasks", "--dsn", dsn("127.0.0.1", port, paths["ca"])], tmp_path
        )

    assert mismatch.returncode == 3, mismatch.stderr
    error, hint = lines_of(mismatch)
    assert error.startswith(f"steeple: error: TLS verification of 127.0.0.1:{port_of(mismatch)}")
    reason = error.split(" failed: ", 1)[1]
    assert "127.0.0.1" in reason  # the certificate is not valid for that name
    assert "sslrootcert" in hint

    assert unknown_ca.returncode == 3, unknown_ca.stderr
    error, _ = lines_of(unknown_ca)
    assert "TLS verification of localhost:" in error
    assert "issuer" in error.split(" failed: ", 1)[1]  # unable to get local issuer certificate
    assert "ClientConfigurationError" not in unknown_ca.stderr

    assert declined.returncode == 3, declined.stderr
    error, hint = lines_of(declined)
    assert "does not accept TLS" in error
    assert "enable ssl" in hint


def port_of(result: Any) -> str:
    """The port an error line names (host:port)."""
    found = re.search(r":(\d+) failed", result.stderr)
    assert found, result.stderr
    return found.group(1)
