"""Children of the dev tools never outlive their owner (process.spawn(watch_owner=True)).

LocalRedis is started from short-lived threads (``asyncio.to_thread``), where the kernel's
PR_SET_PDEATHSIG would kill Redis as soon as that thread ended; the watch pipe follows the
owner process instead. The owner here is a real Python process that is SIGKILLed, so no
cleanup code of it runs.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import redis

from pagefleet.dev import process

# Starts LocalRedis from a thread that ends at once, then waits to be killed.
_OWNER = """
import threading
from pagefleet.dev.redis_server import LocalRedis
server = LocalRedis()
t = threading.Thread(target=server.start)
t.start()
t.join()
print(server.port, server._proc.pid, flush=True)
threading.Event().wait()
"""


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry.name))
    return out


def _comm(pid: int) -> str:
    return Path(f"/proc/{pid}/comm").read_text().strip()


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_redis_outlives_its_starting_thread_but_not_its_owner_process() -> None:
    owner = subprocess.Popen([sys.executable, "-c", _OWNER], stdout=subprocess.PIPE, text=True)
    redis_pids: list[int] = []
    try:
        assert owner.stdout is not None
        port, shell = map(int, owner.stdout.readline().split())
        # The process LocalRedis started, or (watched) the one its shell started.
        redis_pids = [p for p in [shell, *_children(shell)] if _comm(p) == "redis-server"]
        (redis_pid,) = redis_pids
        time.sleep(0.5)  # the starting thread is long gone: Redis must still serve
        client = redis.Redis(port=port, socket_connect_timeout=1)
        assert client.ping()
        client.close()
        owner.kill()  # no cleanup runs in the owner
        owner.wait(10)
        deadline = time.monotonic() + 10
        while _alive(redis_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(redis_pid), "redis-server outlived its SIGKILLed owner"
        assert not _alive(shell)
    finally:
        if owner.poll() is None:
            owner.kill()
        for pid in redis_pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_watched_child_that_exits_ends_its_shell_with_its_status(tmp_path: Path) -> None:
    """The owner still sees its child end (e.g. Redis failing on a taken port) at once."""
    t0 = time.monotonic()
    proc = process.spawn(["sh", "-c", "echo hi; exit 3"], tmp_path / "log", watch_owner=True)
    assert proc.wait(10) == 3
    assert time.monotonic() - t0 < 5
    assert (tmp_path / "log").read_text() == "hi\n"
    process.stop(proc, grace_s=1)
