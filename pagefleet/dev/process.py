"""Child processes for the dev tools and the e2e harness: one way to spawn, wait, stop.

Every child runs in its own session (its own process group), with stdout and stderr
appended to one log file, so stopping it signals the whole tree it forked and its output
can be quoted in an error. With ``die_with_parent`` the kernel kills it if the thread that
started it ends (a SIGKILLed test run leaves no orphan holding ports; Linux only): only
for children started from a thread that lives as long as their owner. With
``watch_owner`` a small shell runs the child and stops it when its owner process is gone,
whichever thread started it (see ``spawn``).

Invariant: ``stop`` returns only once the child is reaped and its process group has been
sent SIGKILL, so nothing it started keeps running.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping
from pathlib import Path

_PR_SET_PDEATHSIG = 1


def free_port() -> int:
    """A loopback TCP port that was free a moment ago, for a child to listen on.

    Another process may take it before the child binds: callers that can, retry."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def die_with_parent() -> None:
    """In the child between fork and exec: SIGKILL me when my parent thread exits."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def spawn(
    argv: list[str],
    log_path: Path,
    *,
    cwd: Path | str | None = None,
    env: Mapping[str, str] | None = None,
    die_with_parent: bool = False,
    watch_owner: bool = False,
) -> subprocess.Popen[bytes]:
    """Start ``argv`` in a new session, stdin from /dev/null, stdout+stderr appended to
    ``log_path`` (created with its directory). Raises OSError if it cannot be executed.

    ``watch_owner``: ``argv`` runs under ``sh`` (the returned process) that holds the read
    end of a pipe whose only writer is this process; when this process ends in any way
    (SIGKILL included) the pipe reads EOF and the shell stops ``argv`` (SIGTERM, then
    SIGKILL). ``stop`` works as without it (it signals the whole group)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    if watch_owner:
        argv = ["sh", "-c", _WATCH_OWNER, "pagefleet-watch", *argv]
    with log_path.open("ab") as log:
        return subprocess.Popen(
            argv,
            # The pipe's write end stays in the Popen (non-inheritable: no other child
            # holds it), so only this process's end closes it.
            stdin=subprocess.PIPE if watch_owner else subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=cwd,
            env=dict(env) if env is not None else None,
            start_new_session=True,
            preexec_fn=_die_with_parent_hook if die_with_parent else None,
        )


# The child runs with /dev/null as stdin (never the pipe: fd 3 is closed for it); a
# background reader waits for EOF on the pipe (nothing is ever written: EOF means the
# owner is gone) and then stops the child. The shell exits with the child's status when
# the child exits first, so an owner polling the shell sees the child's end.
_WATCH_OWNER = """
exec 3<&0 0</dev/null
"$@" 3<&- &
child=$!
{ read -r _line <&3; kill -TERM "$child"; sleep 2; kill -KILL "$child"; } 2>/dev/null &
watcher=$!
exec 3<&-
wait "$child"
status=$?
kill "$watcher" 2>/dev/null
exit "$status"
"""


def _die_with_parent_hook() -> None:
    die_with_parent()


def signal_group(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM) -> None:
    """Send ``sig`` to ``proc``'s process group if it is still running (no wait)."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)


def stop(proc: subprocess.Popen[bytes], grace_s: float) -> int:
    """SIGTERM the process group led by ``proc``, SIGKILL it after ``grace_s``; reap ``proc``
    and return its exit status."""
    if proc.poll() is None:
        signal_group(proc, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace_s)
    # The leader may have exited while children it forked still hold the group alive.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    status = proc.wait()
    if proc.stdin is not None:  # a watch_owner pipe: nothing left to watch
        proc.stdin.close()
    return status


def wait_until(
    what: str,
    check: Callable[[], bool],
    timeout_s: float,
    *,
    proc: subprocess.Popen[bytes] | None = None,
    context: Callable[[], str] = lambda: "",
) -> None:
    """Poll ``check`` (exceptions count as not yet) until it is true.

    Raises TimeoutError after ``timeout_s``, or ChildProcessError as soon as ``proc`` has
    exited; either message ends with ``context()`` (e.g. the log's tail).
    """
    deadline = time.monotonic() + timeout_s
    delay = 0.02
    while True:
        with contextlib.suppress(Exception):
            if check():
                return
        if proc is not None and proc.poll() is not None:
            raise ChildProcessError(
                f"{what}: the process exited with status {proc.returncode}\n{context()}"
            )
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not ready after {timeout_s:.0f}s\n{context()}")
        time.sleep(delay)
        delay = min(delay * 1.5, 0.5)


def tail(path: Path, lines: int = 30, errors_only: bool = False) -> str:
    """The last ``lines`` lines of a log file, or a note that it does not exist.

    ``errors_only`` keeps klog error/warning lines (E/W/F prefix) and JSON logs at error.
    """
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return f"({path} does not exist)"
    rows = text.splitlines()
    if errors_only:
        rows = [r for r in rows if r[:1] in ("E", "W", "F") or '"level":"error"' in r]
    return "\n".join(rows[-lines:])
