"""The one-line cause of a fatal start-up error, where Kubernetes shows it to people.

The kubelet mounts a file per container at its ``terminationMessagePath`` (by default
``/dev/termination-log``) and, after the container exits, reports the file's content as
``lastState.terminated.message``; the operator turns that into the InferenceService's
Degraded condition. Outside Kubernetes the default file does not exist and nothing is
written: a daemon started by hand never creates files under /dev.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

DEFAULT_PATH = "/dev/termination-log"
# The kubelet reads at most 4096 bytes per container; one short line is what fits a
# condition message and `kubectl get` output.
MAX_BYTES = 1024


def one_line(message: str, limit: int = MAX_BYTES) -> str:
    """``message`` on one line (whitespace runs collapsed), at most ``limit`` bytes of UTF-8."""
    text = " ".join(message.split())
    data = text.encode()
    if len(data) <= limit:
        return text
    return data[: limit - 3].decode(errors="ignore") + "..."


def write_termination_message(message: str, path: str | None = None) -> bool:
    """Write ``message`` (one line) to the termination-message file; True when written.

    ``path`` None means the Kubernetes default, written only when the file already exists
    (the kubelet creates it); an explicit path is created if needed. Any OS error (read-only,
    no such directory, not permitted) is logged at debug level and ignored: reporting the
    cause must never mask it."""
    target = path or DEFAULT_PATH
    flags = os.O_WRONLY | os.O_TRUNC | (os.O_CREAT if path else 0)
    try:
        fd = os.open(target, flags, 0o644)
    except OSError as exc:
        logger.debug("no termination message written to %s: %s", target, exc)
        return False
    try:
        os.write(fd, (one_line(message) + "\n").encode())
    except OSError as exc:
        logger.debug("writing the termination message to %s failed: %s", target, exc)
        return False
    finally:
        os.close(fd)
    return True
