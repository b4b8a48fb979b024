"""kv_wire: the decode side's socket read of a KV pull, against a real loopback server that
answers with exactly the bytes each case needs (well-formed, short, chunked, headless)."""

from __future__ import annotations

import asyncio
import socket

import pytest

from pagefleet.daemon import kv_wire


async def _answer(raw: bytes) -> tuple[asyncio.Server, int, list[bytes]]:
    """A server that reads one request head and body, then writes ``raw`` and closes."""
    seen: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
        seen.append(head + await reader.readexactly(length))
        writer.write(raw)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1], seen


def test_body_lands_in_the_callers_buffer_and_bad_responses_fail_cleanly() -> None:
    payload = bytes(range(256)) * 4096  # 1 MiB, several socket reads

    async def main() -> None:
        ok = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\nhead" % (4 + len(payload))
        server, port, seen = await _answer(ok + payload)
        async with server:
            resp = await kv_wire.post("127.0.0.1", port, "/v1/kv/pull", b'{"a":1}', 3.0)
            try:
                assert resp.status == 200 and resp.remaining == 4 + len(payload)
                assert await resp.read_exactly(4) == b"head"
                buf = bytearray(len(payload))
                await resp.read_into(memoryview(buf))
                assert buf == payload and resp.remaining == 0
                with pytest.raises(asyncio.IncompleteReadError):
                    await resp.read_exactly(1)  # never past the body
            finally:
                resp.close()
        assert seen[0].startswith(b"POST /v1/kv/pull HTTP/1.1\r\n")
        assert seen[0].endswith(b'\r\n\r\n{"a":1}')

        # The stream ends before its Content-Length: IncompleteReadError, no hang.
        server, port, _ = await _answer(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nshort")
        async with server:
            resp = await kv_wire.post("127.0.0.1", port, "/", b"{}", 3.0)
            try:
                with pytest.raises(asyncio.IncompleteReadError):
                    await asyncio.wait_for(resp.read_into(memoryview(bytearray(100))), 5)
            finally:
                resp.close()

        # Not what a KV pull expects: chunked, no length, not HTTP.
        for raw, what in (
            (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", "chunked"),
            (b"HTTP/1.1 200 OK\r\nX: y\r\n\r\nbody", "no Content-Length"),
            (b"SSH-2.0-OpenSSH\r\n\r\n", "not an HTTP"),
        ):
            server, port, _ = await _answer(raw)
            async with server:
                with pytest.raises(ValueError, match=what):
                    await kv_wire.post("127.0.0.1", port, "/", b"{}", 3.0)

        # Nobody listening: an OSError at once.
        server, port, _ = await _answer(b"")
        server.close()
        await server.wait_closed()
        with pytest.raises(OSError):
            await kv_wire.post("127.0.0.1", port, "/", b"{}", 3.0)

    asyncio.run(main())


def test_a_name_whose_first_address_refuses_connects_to_the_next(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A prefill pod named by a host name (kv_advertise_host) that resolves to an IPv6
    address first, while the daemon listens on IPv4 only (a dual-stack cluster): the pull
    tried the first address alone and failed as unreachable, on every P/D request, where
    the aiohttp client it replaced goes on to the next address."""

    async def main() -> None:
        ok = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
        server, port, _ = await _answer(ok)
        loop = asyncio.get_running_loop()

        async def resolve(host: str, port_: int, **_kw: object) -> list:
            # The name's IPv6 address first, on which nothing listens, then its IPv4 one.
            return [
                (socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("::1", port_, 0, 0)),
                (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", port_)),
            ]

        monkeypatch.setattr(loop, "getaddrinfo", resolve)
        async with server:
            resp = await kv_wire.post("prefill.example", port, "/", b"{}", 3.0)
            try:
                assert resp.status == 200 and await resp.read_exactly(2) == b"ok"
            finally:
                resp.close()

    asyncio.run(main())
