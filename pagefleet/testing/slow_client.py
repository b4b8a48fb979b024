"""A client that stops reading: for tests of what a server holds for it.

The socket's receive buffer is 4 KiB, so once the first bytes are read and reading is
paused, the kernel's window fills within a few KiB and stays full: every further write of
the server waits on this client, as on one behind a stalled network or a stopped process.
"""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any


async def open_unread(url: str, body: dict[str, Any], first: int = 100) -> asyncio.StreamWriter:
    """POST ``body`` to ``url``'s /v1/completions, read the first ``first`` bytes of the
    answer (a 200 is asserted), then never read again. Close the returned writer to hang up."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    sock.setblocking(False)
    reader, writer = await asyncio.open_connection(sock=sock)
    data = json.dumps(body).encode()
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    head = await reader.read(first)
    assert head.startswith(b"HTTP/1.1 200"), head
    reader._transport.pause_reading()  # type: ignore[attr-defined]
    return writer
