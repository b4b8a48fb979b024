"""The one line a server prints when it cannot listen on its address (daemon and gateway)."""

from __future__ import annotations

import errno
import os
import socket


def listen_error(host: str, port: int, exc: OSError) -> str:
    """One line for a socket a server could not listen on, with the likely fix."""
    # asyncio's strerror repeats the address ("error while attempting to bind on address
    # (...): address already in use"); the errno's own text is enough beside host:port.
    if isinstance(exc, socket.gaierror) or not exc.errno:
        why = exc.strerror or str(exc)
    else:
        why = os.strerror(exc.errno)
    if exc.errno == errno.EADDRINUSE:
        fix = (
            "another process holds the port (a second daemon or gateway?): stop it or "
            "choose another --port"
        )
    elif exc.errno == errno.EACCES:
        fix = "ports below 1024 need privileges: choose a --port of 1024 or more"
    elif exc.errno == errno.EADDRNOTAVAIL or isinstance(exc, socket.gaierror):
        fix = "the address is not one of this machine's: pass --host 0.0.0.0 or an own address"
    else:
        fix = "check --host and --port"
    return f"cannot listen on {host}:{port}: {why}; {fix}"
