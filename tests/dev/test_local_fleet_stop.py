"""`pagefleet up` stops in bounded time even when its children ignore SIGTERM."""

from __future__ import annotations

import http.server
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import pytest

from pagefleet.dev.local_fleet import Child, FleetSpec, LocalFleet
from pagefleet.dev.process import free_port

# Ignores SIGTERM (so does the sleep it runs: an ignored signal stays ignored across exec).
STUBBORN = ["sh", "-c", "trap '' TERM; sleep 60"]


def test_stop_kills_stubborn_children_at_one_shared_deadline(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fleet = LocalFleet(FleetSpec(log_dir=tmp_path, use_redis=False))
    fleet.gateway = Child("gateway", STUBBORN, "http://127.0.0.1:1", tmp_path / "gw.log")
    fleet.daemons = [
        Child(f"daemon-{i}", STUBBORN, "http://127.0.0.1:1", tmp_path / f"d{i}.log")
        for i in range(3)
    ]
    children = [fleet.gateway, *fleet.daemons]
    for c in children:
        c.start()
    procs = [c.proc for c in children]
    # Each child's `sleep` runs only after its shell's trap (an ignored TERM survives the
    # exec), and the watching shell ignores TERM from its own trap on: wait for both in all
    # four, not for a fixed time a loaded machine can outlast.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not all(
        _runs_in_group(p.pid, "sleep") and _ignores_term(p.pid) for p in procs if p is not None
    ):
        time.sleep(0.02)
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="pagefleet.dev.local_fleet"):
        fleet.stop(grace_s=1.0)
    took = time.monotonic() - t0
    # One deadline for all four: ~1 s, not 1 s each one after another.
    assert 1.0 <= took < 2.5, took
    assert all(p is not None and p.poll() is not None for p in procs)
    killed = {r.getMessage().split()[0] for r in caplog.records if "killed" in r.getMessage()}
    assert killed == {"gateway", "daemon-0", "daemon-1", "daemon-2"}


def _runs_in_group(pgid: int, comm: str) -> bool:
    """A live ``comm`` process is in process group ``pgid``."""
    return bool(_in_group(pgid, comm))


def _in_group(pgid: int, comm: str) -> list[int]:
    """The live ``comm`` processes in process group ``pgid``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            name = (entry / "comm").read_text().strip()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid and name == comm:
            found.append(int(entry.name))
    return found


def _ignores_term(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    ignored = next(line for line in status.splitlines() if line.startswith("SigIgn:"))
    return bool(int(ignored.split()[1], 16) & (1 << (signal.SIGTERM - 1)))


# Records each SIGTERM, then takes argv[2] seconds to finish (as a daemon drains), exits 0.
_DRAINER = """
import pathlib, signal, sys, time
log = pathlib.Path(sys.argv[1])
signal.signal(signal.SIGTERM, lambda *_: log.open("a").write("TERM\\n"))
log.write_text("ready\\n")
while "TERM" not in log.read_text():
    time.sleep(0.01)
time.sleep(float(sys.argv[2]))
"""


def test_stop_sends_each_child_one_sigterm(tmp_path: Path) -> None:
    """A second SIGTERM is not harmless: a daemon whose loop has closed is back on TERM's
    default action during its exit, so a repeat killed it there (leaking its engine
    process's semaphores). Children stopped one after another each get exactly one."""
    fleet = LocalFleet(FleetSpec(log_dir=tmp_path, use_redis=False))
    logs = [tmp_path / f"d{i}.sig" for i in range(3)]
    fleet.daemons = [
        # Each drains longer than the one before: the next is still draining when the
        # previous one's stop returns.
        Child(f"daemon-{i}", [sys.executable, "-c", _DRAINER, str(log), str(0.3 + 0.6 * i)],
              "http://127.0.0.1:1", tmp_path / f"d{i}.log")
        for i, log in enumerate(logs)
    ]  # fmt: skip
    for c in fleet.daemons:
        c.start()
    procs = [c.proc for c in fleet.daemons]
    deadline = time.monotonic() + 30
    while not all(log.exists() for log in logs) and time.monotonic() < deadline:
        time.sleep(0.02)
    fleet.stop(grace_s=10.0)
    assert [p.returncode for p in procs if p is not None] == [0, 0, 0]
    assert [log.read_text().count("TERM") for log in logs] == [1, 1, 1]


def _tx_queue(local_port: int) -> int | None:
    """Bytes queued unsent on the established loopback TCP socket bound to ``local_port``."""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[1].split(":")[1], 16) == local_port and fields[3] == "01":
            return int(fields[4].split(":")[0], 16)
    return None


@pytest.mark.slow
def test_a_daemon_with_a_stalled_stream_stops_without_sigkill(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A client that stops reading its stream holds the daemon's write: the drain runs out,
    the abort cannot end that handler (5 s more), and aiohttp's cleanup waits for it twice
    its shutdown timeout before cancelling it. That whole bound must fit the fleet's grace,
    or a clean stop ends in SIGKILL (the daemon then never leaves the prefix index)."""
    fleet = LocalFleet(FleetSpec(num_daemons=1, model="tiny", use_redis=False, log_dir=tmp_path))
    daemon = fleet._daemon(0)
    fleet.daemons = [daemon]
    daemon.start()
    try:
        fleet.wait_ready([daemon])
        port = int(daemon.url.rsplit(":", 1)[1])
        body = json.dumps(
            {"model": "tiny", "prompt": "hello " * 8, "max_tokens": 2000, "stream": True,
             "ignore_eos": True, "n": 16, "logprobs": 20}
        ).encode()  # fmt: skip
        client = socket.socket()
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.connect(("127.0.0.1", port))
        client.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        # Never read: wait until the daemon's send queue is full (it stopped growing).
        deadline, last, since = time.monotonic() + 120, -1, time.monotonic()
        while time.monotonic() < deadline:
            queued = _tx_queue(port) or 0
            if queued != last:
                last, since = queued, time.monotonic()
            elif queued > 0 and time.monotonic() - since > 1.0:
                break
            time.sleep(0.1)
        else:
            pytest.fail(f"the daemon's send queue never filled (last {last} bytes)")
        proc = daemon.proc
        with caplog.at_level(logging.WARNING, logger="pagefleet.dev.local_fleet"):
            fleet.stop()
        client.close()
    finally:
        fleet.stop()
    assert not [r.getMessage() for r in caplog.records if "killed" in r.getMessage()]
    assert proc is not None and proc.returncode == 0, daemon.log_tail()


def test_a_child_that_crashed_before_the_stop_is_not_reported_as_killed_by_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A daemon SIGKILLed by someone else (the OOM killer) mid-bench was reported at the
    fleet's stop as "daemon-0 did not stop within 19.5s of SIGTERM: killed": a hang that
    never was, and no word of the crash."""
    fleet = LocalFleet(FleetSpec(log_dir=tmp_path, use_redis=False))
    fleet.daemons = [
        Child(f"daemon-{i}", ["sleep", "60"], "http://127.0.0.1:1", tmp_path / f"d{i}.log")
        for i in range(2)
    ]
    for c in fleet.daemons:
        c.start()
    crashed = fleet.daemons[0].proc
    assert crashed is not None
    # The watching shell's child is the `sleep`: kill it as the OOM killer would.
    deadline = time.monotonic() + 30
    while not (sleeps := _in_group(crashed.pid, "sleep")) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(sleeps) == 1, sleeps
    os.kill(sleeps[0], signal.SIGKILL)
    crashed.wait(10)
    assert crashed.returncode == -signal.SIGKILL
    with caplog.at_level(logging.WARNING, logger="pagefleet.dev.local_fleet"):
        fleet.stop(grace_s=10.0)
    said = [r.getMessage() for r in caplog.records]
    assert not any("did not stop" in m for m in said), said
    assert any(
        m.startswith("daemon-0 had exited on its own with status -9 before the stop") for m in said
    ), said
    assert [c.proc for c in fleet.daemons] == [None, None]


class _Ready(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


_READY_SERVER = """
import http.server, sys
class Ready(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Ready).serve_forever()
"""


def test_ready_means_this_child_listens_not_whoever_answers_its_url(tmp_path: Path) -> None:
    """A /ready answered at a child's URL by another process (a second fleet's gateway on
    the same port) made `up` report a fleet ready whose own gateway had failed to bind."""
    other = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Ready)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{other.server_address[1]}"
    own_port = free_port()
    fleet = LocalFleet(FleetSpec(log_dir=tmp_path, use_redis=False, ready_timeout_s=2.0))
    silent = Child("gateway", ["sleep", "60"], url, tmp_path / "silent.log")
    own = Child("daemon-0", [sys.executable, "-c", _READY_SERVER, str(own_port)],
                f"http://127.0.0.1:{own_port}", tmp_path / "own.log")  # fmt: skip
    try:
        for c in (silent, own):
            c.start()
        fleet.wait_ready([own])  # its own answer counts
        with pytest.raises(TimeoutError, match="gateway not ready"):
            fleet.wait_ready([silent])
    finally:
        for c in (silent, own):
            c.stop(timeout=1.0)
        other.shutdown()
        other.server_close()
