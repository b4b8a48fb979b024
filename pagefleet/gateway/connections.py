"""Client connections within the open-files limit: a clean 503 past a cap, never EMFILE.

At its open-files limit the gateway could neither accept (asyncio's accept loop then logged
"socket.accept() out of system resource" with a traceback, ~5000 times a second: 126k in
25 s) nor open the upstream connection of a request it had accepted: every open request
hung, /health and /ready with them, until clients gave up. So client connections are
capped below the limit, leaving room for each one's upstream connection and a reserve
(probes, Redis, intake workers, logs); past the cap a new connection gets a canned 503 with
Retry-After and is closed -- unless it asks for a probe or scrape path (``GET /health``,
``/ready``, ``/metrics``), which is answered there: a 503 to the kubelet's liveness probe
restarted a gateway that was merely busy, cutting every stream it carried.

Invariants:
- at most ``max_connections`` connections are served; a refused one costs its file for at
  most ``REFUSAL_LINGER_S``, and at most ``max_refusing`` are kept that long at once (the
  rest are closed at once), and at most ``listen_backlog`` are accepted in one loop turn:
  a connection flood cannot eat the reserve;
- past the cap, a ``GET`` of a path in ``probes`` gets that probe's answer and every other
  request the canned 503; either way the connection is then closed (a probe past the cap
  never becomes a served connection a client could go on using);
- repeated accept failures are logged once per ``ACCEPT_LOG_INTERVAL_S``, not per attempt.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
from collections.abc import Callable, Mapping
from http import HTTPStatus
from typing import Any

from aiohttp import web

from pagefleet.ratelog import EveryInterval

logger = logging.getLogger(__name__)

# Files kept free beyond three per client connection: its own, its upstream one, and one
# being closed (asyncio closes a socket a loop turn after it is let go: in a burst, many).
# With two, a burst of 250 at a 256-file limit still ran out: 15 upstream connects failed.
FILES_PER_CONNECTION = 3
FILES_RESERVE = 256
REFUSAL_LINGER_S = 1.0
# The longest request line a connection past the cap may send to be read as a probe.
MAX_PROBE_LINE = 2048

# A probe path's answer: status, content type, body.
ProbeAnswer = Callable[[], tuple[int, str, bytes]]
ACCEPT_LOG_INTERVAL_S = 10.0


def _soft_limit() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return 1 << 20 if soft == resource.RLIM_INFINITY else soft


def files_reserve(soft_limit: int | None = None) -> int:
    """Files kept beyond the connections' own: a quarter of the limit, up to FILES_RESERVE."""
    return min(FILES_RESERVE, (soft_limit or _soft_limit()) // 4)


def auto_max_connections(soft_limit: int | None = None) -> int:
    """Client connections that fit the open-files limit: FILES_PER_CONNECTION each, after
    the reserve for everything else."""
    soft = soft_limit or _soft_limit()
    return max(1, (soft - files_reserve(soft)) // FILES_PER_CONNECTION)


def listen_backlog(soft_limit: int | None = None) -> int:
    """The listening socket's backlog, which is also how many connections asyncio accepts
    in one loop turn, each a file before the gate can refuse it: half the reserve (at a
    256-file limit the default 128 alone exhausted it in a burst), at most aiohttp's 128."""
    return max(8, min(128, files_reserve(soft_limit) // 2))


def _refusal(max_connections: int) -> bytes:
    body = json.dumps(
        {
            "error": {
                "message": f"gateway overloaded: {max_connections} client connections are "
                "open, its limit (--max-connections, within the open-files limit); retry "
                "after a second, or reuse a connection",
                "type": "server_error",
                "param": None,
                "code": "too_many_connections",
            }
        }
    ).encode()
    head = (
        "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


def _answer(status: int, content_type: str, body: bytes) -> bytes:
    head = (
        f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\nContent-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


class _PastCap(asyncio.Protocol):
    """A connection past the cap: its request line decides. A ``GET`` of a probe path gets
    the probe's answer, anything else (or nothing within ``REFUSAL_LINGER_S``) the canned
    503; then the connection closes. The rest of the request is read and dropped for a
    moment first: closing with unread bytes sends a reset, which can reach the client
    before the answer does."""

    def __init__(self, gate: ConnectionGate) -> None:
        self._gate = gate
        self._transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._head = b""
        self._answered = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        if self._gate.refusing >= self._gate.max_refusing:
            self._refuse()  # the flood outruns the linger: no file held for it
            transport.close()
            return
        self._gate.refusing += 1
        self._timer = asyncio.get_running_loop().call_later(REFUSAL_LINGER_S, self._linger_over)

    def data_received(self, data: bytes) -> None:
        if self._answered:
            return
        self._head += data
        line, found, _ = self._head.partition(b"\r\n")
        if found:
            self._reply(line)
        elif len(self._head) > MAX_PROBE_LINE:
            self._refuse()

    def _reply(self, line: bytes) -> None:
        method, _, rest = line.partition(b" ")
        path = rest.partition(b" ")[0].partition(b"?")[0].decode("latin-1")
        probe = self._gate.probes.get(path) if method == b"GET" else None
        if probe is None:
            self._refuse()
            return
        self._answered = True
        try:
            status, content_type, body = probe()
        except Exception:  # a probe must answer something: a bug is a 500, logged
            logger.exception("answering %s past the connection cap failed", path)
            status, content_type, body = 500, "text/plain", b"internal error\n"
        self._write(_answer(status, content_type, body))

    def _refuse(self) -> None:
        if self._answered:
            return
        self._answered = True
        self._gate.on_refused()
        self._write(self._gate.refusal)

    def _write(self, data: bytes) -> None:
        assert self._transport is not None
        if self._transport.is_closing():
            return
        self._transport.write(data)
        if self._transport.can_write_eof():
            self._transport.write_eof()

    def _linger_over(self) -> None:
        self._refuse()  # nothing asked within the linger: the canned 503, then close
        assert self._transport is not None
        self._transport.close()

    def eof_received(self) -> bool:
        self._refuse()  # the client is done (if it asked nothing, it gets the 503): close
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._gate.refusing -= 1


class ConnectionGate:
    """The protocol factory in front of aiohttp's ``web.Server``: its connections while
    fewer than ``max_connections`` are open, a refusal past it."""

    def __init__(
        self,
        server: web.Server,
        max_connections: int,
        on_refused: Callable[[], None] = lambda: None,
        probes: Mapping[str, ProbeAnswer] | None = None,
    ) -> None:
        self.server = server
        self.max_connections = max_connections
        # Counted here rather than by len(server.connections), which copies the list of
        # every open connection on each accept (O(n): at 300k connections, ~1 ms each).
        self.open = len(server.connections)
        made, lost = server.connection_made, server.connection_lost

        def on_made(handler: Any, transport: asyncio.Transport) -> None:
            self.open += 1
            made(handler, transport)

        def on_lost(handler: Any, exc: BaseException | None = None) -> None:
            self.open -= 1
            lost(handler, exc)

        server.connection_made = on_made  # type: ignore[method-assign]
        server.connection_lost = on_lost  # type: ignore[method-assign]
        # Lingering refusals use a quarter of the reserve (the backlog takes half).
        self.max_refusing = max(1, files_reserve() // 4)
        self.refusing = 0
        self.refusal = _refusal(max_connections)
        self.on_refused = on_refused
        self.probes: Mapping[str, ProbeAnswer] = dict(probes or {})

    def __call__(self) -> asyncio.BaseProtocol:
        if self.open >= self.max_connections:
            return _PastCap(self)
        return self.server()


def quiet_accept_errors(loop: asyncio.AbstractEventLoop) -> None:
    """Log asyncio's accept failures (out of files) once per interval, with what to do,
    rather than each with a traceback; everything else as asyncio would."""
    every = EveryInterval(logger, ACCEPT_LOG_INTERVAL_S)

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if str(context.get("message", "")).startswith("socket.accept() out of system resource"):
            every.warning(
                "cannot accept client connections: %s; lower --max-connections or raise the "
                "open-files limit (ulimit -n)",
                context.get("exception"),
            )
            return
        loop.default_exception_handler(context)

    loop.set_exception_handler(handler)
