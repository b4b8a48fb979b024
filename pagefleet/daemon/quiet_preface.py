"""An HTTP/2 connection preface on the HTTP/1.1 port: answer 400, log nothing at ERROR.

Routers that speak HTTP/2 first (sglang-router probes workers that way) send
``PRI * HTTP/2.0`` to a worker; aiohttp answers 400 and closes, which is right, but logs
the parser's stack trace at ERROR for every such connection. This filter drops those
records from ``aiohttp.server`` (keeping them, without the trace, when that logger is at
DEBUG), so real request errors stay visible.

Invariant: only records whose exception is aiohttp's HTTP/2-preface parse error are
touched; every other record passes unchanged.
"""

from __future__ import annotations

import logging

_MARKER = "PRI/Upgrade"


class Http2PrefaceFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if exc is None or _MARKER not in str(exc):
            return True
        if not logging.getLogger(record.name).isEnabledFor(logging.DEBUG):
            return False
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        record.msg = "HTTP/2 connection preface answered 400 (this port speaks HTTP/1.1): %s"
        record.args = (getattr(exc, "message", exc),)
        record.exc_info = record.exc_text = None
        return True


def install(logger_name: str = "aiohttp.server") -> None:
    """Add the filter to ``logger_name`` once (idempotent)."""
    log = logging.getLogger(logger_name)
    if not any(isinstance(f, Http2PrefaceFilter) for f in log.filters):
        log.addFilter(Http2PrefaceFilter())
