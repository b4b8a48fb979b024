"""Child processes for the dev tools and the e2e harness: one way to spawn, wait, stop.

Every child runs in its own session (its own process group), with stdout and stderr
appended to one log file, so stopping it signals the whole tree it forked and its output
can be quoted in an error. Every child is watched: a small shell runs it and SIGKILLs its
whole process group when the owner process (the one that called ``spawn``) is gone, in
any way, SIGKILL included (see ``spawn``). So a killed test run, `pagefleet up` or e2e node
agent leaves no orphan holding ports.

Invariants: a child never outlives its owner process by more than a moment; ``stop``
returns only once the child is reaped and its process group has been sent SIGKILL, so
nothing it started keeps running.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping
from pathlib import Path


def free_port() -> int:
    """A loopback TCP port that was free a moment ago, for a child to listen on.

    Another process may take it before the child binds: callers that can, retry."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn(
    argv: list[str],
    log_path: Path,
    *,
    cwd: Path | str | None = None,
    env: Mapping[str, str] | None = None,
) -> subprocess.Popen[bytes]:
    """Start ``argv`` in a new session, stdin from /dev/null, stdout+stderr appended to
    ``log_path`` (created with its directory). Raises OSError if it cannot be executed.

    ``argv`` runs under ``sh`` (the returned process, the group's leader) that holds the
    read end of a pipe whose only writer is this process; when this process ends in any
    way (SIGKILL included) the pipe reads EOF and the shell SIGKILLs the whole group. This
    follows the owner process, not the thread that called ``spawn`` (PR_SET_PDEATHSIG
    would kill the child when a short-lived starting thread ends), and reaches what the
    child forked. The returned process exits as ``argv`` does (its status, or the same
    signal), and ``stop`` / ``signal_group`` work as on ``argv`` itself: the shell ignores
    the group's SIGTERM and waits for ``argv``."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log:
        return subprocess.Popen(
            ["sh", "-c", _WATCH_OWNER, "pagefleet-watch", *argv],
            # The pipe's write end stays in the Popen (non-inheritable across exec: no
            # other child holds it), so only this process's end closes it.
            stdin=subprocess.PIPE,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=cwd,
            env=dict(env) if env is not None else None,
            start_new_session=True,
        )


# The child is forked first, before the shell ignores TERM/INT/HUP, so it starts with
# TERM's default action (forked after, it would inherit the ignore and a group SIGTERM sent
# in its first moment, before it could reset it, was lost: ``stop`` then waited out its
# grace and SIGKILLed). A SIGTERM that reaches the shell before its trap ends it with that
# signal, as it ends the child: the owner reads what it would without us. From the trap on,
# the shell outlives a group signal (it is for the child) to report the child's status; the
# child has /dev/null as stdin (fd 3, the pipe, is closed for it). A background reader
# waits for EOF on the pipe (nothing is ever written: EOF means the owner is gone) and then
# SIGKILLs the group. When the child exits first, the shell ends the reader and exits as
# the child did: its status, or (above 128) the same signal.
_WATCH_OWNER = """
exec 3<&0 0</dev/null
"$@" 3<&- &
child=$!
trap '' TERM INT HUP
{ read -r _line <&3; kill -KILL 0; } 2>/dev/null &
watcher=$!
exec 3<&-
wait "$child"
status=$?
kill -KILL "$watcher" 2>/dev/null
if [ "$status" -gt 128 ]; then
    trap - TERM INT HUP
    kill -s "$(kill -l "$status")" $$ 2>/dev/null
fi
exit "$status"
"""


def signal_group(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM) -> None:
    """Send ``sig`` to ``proc``'s process group if it is still running (no wait)."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)


def stop(proc: subprocess.Popen[bytes], grace_s: float, *, term: bool = True) -> int:
    """SIGTERM the process group led by ``proc`` (unless ``term`` is False: the caller sent
    it already), SIGKILL it after ``grace_s``; reap ``proc`` and return its exit status.

    One SIGTERM only: a second is not harmless. A Python server whose asyncio loop has
    closed is back on TERM's default action while it finishes its exit (atexit,
    multiprocessing's cleanup), so a repeated SIGTERM kills it there.

    Interrupted while waiting (KeyboardInterrupt: a second Ctrl-C), it still SIGKILLs and
    reaps the group before the exception goes on."""
    try:
        if proc.poll() is None:
            if term:
                signal_group(proc, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=grace_s)
    finally:
        # The leader may have exited while children it forked still hold the group alive.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        status = proc.wait()
        if proc.stdin is not None:  # the watch pipe: nothing left to watch
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


def group_listens(pgid: int, port: int) -> bool | None:
    """Whether a process of group ``pgid`` holds the socket listening on TCP ``port``: an
    answer at the port may come from another process. None where /proc cannot tell (not
    Linux): the caller trusts the answer then."""
    inodes: set[str] = set()
    try:
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            with contextlib.suppress(FileNotFoundError):
                for row in Path(table).read_text().splitlines()[1:]:
                    cols = row.split()
                    # local address is HEX_IP:HEX_PORT; state 0A is LISTEN; then the inode.
                    if int(cols[1].rsplit(":", 1)[1], 16) == port and cols[3] == "0A":
                        inodes.add(f"socket:[{cols[9]}]")
        entries = list(Path("/proc").iterdir())
    except OSError:
        return None
    if not inodes:
        return False
    for entry in entries:
        if not entry.name.isdigit():
            continue
        try:
            if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[2]) != pgid:
                continue
            if any(os.readlink(fd) in inodes for fd in (entry / "fd").iterdir()):
                return True
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile, or not ours to read
    return False


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
