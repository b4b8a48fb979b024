"""The decode side's KV pull on the wire: one HTTP/1.1 POST over a plain socket whose
response body is received straight into the caller's buffer (a shared-memory stage).

Why not aiohttp's client here: it hands a body over as newly allocated chunks that the
caller then copies into the stage. For a prompt's ~29 MB of KV that cost ~43 ms of CPU per
pull against ~25 ms with ``sock_recv_into`` (loopback, the 2-core VM, docs/benchmarks.md
session 6), and the decode pod's HTTP process shares its core with the engine stepping
every stream: CPU a pull takes is taken from decode steps.

Only what ``/v1/kv/pull`` needs: one POST (with the caller's extra headers: its
``Authorization`` for a prefill pod that requires a key), ``Connection: close``, a response
that carries a Content-Length (the export server always sends one). Errors are the standard
ones the caller maps to pull-failure reasons: OSError (unreachable), TimeoutError,
IncompleteReadError (the stream ended early), ValueError (not the response expected).
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Mapping
from typing import Any

_MAX_HEAD = 64 << 10
_RECV = 1 << 16


class WireResponse:
    """A response whose head is parsed; the body is read with ``read_exactly`` and
    ``read_into`` (never past its Content-Length). Close it in a ``finally``."""

    __slots__ = ("_loop", "_pending", "_sock", "remaining", "status")

    def __init__(self, sock: socket.socket, status: int, length: int, pending: bytes) -> None:
        self._loop = asyncio.get_running_loop()
        self._sock = sock
        self.status = status
        if len(pending) > length:
            raise ValueError("the response carries more bytes than its Content-Length")
        self._pending = pending
        self.remaining = length  # body bytes not yet handed to the caller

    async def read_exactly(self, n: int) -> bytes:
        """The next ``n`` body bytes (IncompleteReadError past the body or on EOF)."""
        if n > self.remaining:
            raise asyncio.IncompleteReadError(b"", n)
        out = bytearray(n)
        await self.read_into(memoryview(out))
        return bytes(out)

    async def read_into(self, view: memoryview) -> None:
        """Fill all of ``view`` with the next body bytes, received in place."""
        n = len(view)
        if n > self.remaining:
            raise asyncio.IncompleteReadError(b"", n)
        take = min(n, len(self._pending))
        view[:take] = self._pending[:take]
        self._pending = self._pending[take:]
        off = take
        while off < n:
            got = await self._loop.sock_recv_into(self._sock, view[off:])
            if not got:
                raise asyncio.IncompleteReadError(b"", n - off)
            off += got
        self.remaining -= n

    def close(self) -> None:
        self._sock.close()


async def post(
    host: str,
    port: int,
    path: str,
    body: bytes,
    connect_timeout_s: float,
    headers: Mapping[str, str] | None = None,
) -> WireResponse:
    """POST ``body`` (JSON) to ``host:port`` ``path`` with ``headers`` besides the ones it
    always sends; the response with its head read."""
    fields = list((headers or {}).items())
    if any(c in k + v for k, v in fields for c in "\r\n\0"):
        raise ValueError("a header name or value holds a line break")  # never split the head
    extra = "".join(f"{k}: {v}\r\n" for k, v in fields)
    loop = asyncio.get_running_loop()
    host = host.strip("[]")  # an IPv6 literal as written in a URL
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    sock = await _connect(infos, connect_timeout_s)
    try:
        where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {where}\r\nContent-Type: application/json\r\n"
            f"{extra}Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        ).encode()
        await loop.sock_sendall(sock, head + body)
        buf = bytearray()
        while (end := buf.find(b"\r\n\r\n")) < 0:
            if len(buf) > _MAX_HEAD:
                raise ValueError("the response head is too long")
            chunk = await loop.sock_recv(sock, _RECV)
            if not chunk:
                raise asyncio.IncompleteReadError(bytes(buf), None)
            buf += chunk
        status, length = parse_head(bytes(buf[:end]))
        return WireResponse(sock, status, length, bytes(buf[end + 4 :]))
    except BaseException:
        sock.close()
        raise


async def _connect(infos: list[Any], timeout_s: float) -> socket.socket:
    """A connected non-blocking socket to the first address of ``infos`` that accepts,
    within ``timeout_s`` in all: a name may resolve to an address its server does not
    listen on (IPv6 first, a daemon bound to IPv4) before one it does."""
    loop = asyncio.get_running_loop()
    failed: OSError = OSError("the name resolved to no address")
    async with asyncio.timeout(timeout_s):
        for family, kind, proto, _, addr in infos:
            sock = None
            try:  # a family this host lacks (no IPv6) fails at socket(): the next one
                sock = socket.socket(family, kind, proto)
                sock.setblocking(False)
                await loop.sock_connect(sock, addr)
            except OSError as exc:
                if sock is not None:
                    sock.close()
                failed = exc
                continue
            except BaseException:
                if sock is not None:
                    sock.close()
                raise
            return sock
    raise failed


def parse_head(head: bytes) -> tuple[int, int]:
    """(status, Content-Length) of an HTTP/1.x response head; ValueError otherwise."""
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    # A status is three ASCII digits (RFC 9112): the caller names failures by it, so any
    # other run of digits would be a new metric label each time.
    status = parts[1] if len(parts) >= 2 else ""
    three_digits = len(status) == 3 and status.isascii() and status.isdigit()
    if not parts[0].startswith("HTTP/1.") or not three_digits:
        raise ValueError(f"not an HTTP/1.x response: {lines[0][:80]!r}")
    fields: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if sep:
            fields[name.strip().lower()] = value.strip()
    if "chunked" in fields.get("transfer-encoding", "").lower():
        raise ValueError("a chunked response: the KV pull expects a Content-Length")
    length = fields.get("content-length", "")
    if not length.isdigit():
        raise ValueError("the response has no Content-Length")
    return int(status), int(length)
