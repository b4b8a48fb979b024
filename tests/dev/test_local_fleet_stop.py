"""`pagefleet up` stops in bounded time even when its children ignore SIGTERM."""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

import pytest

from pagefleet.dev.local_fleet import Child, FleetSpec, LocalFleet

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
    time.sleep(0.3)  # let the shells install their trap
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="pagefleet.dev.local_fleet"):
        fleet.stop(grace_s=1.0)
    took = time.monotonic() - t0
    # One deadline for all four: ~1 s, not 1 s each one after another.
    assert 1.0 <= took < 2.5, took
    assert all(p is not None and p.poll() is not None for p in procs)
    killed = {r.getMessage().split()[0] for r in caplog.records if "killed" in r.getMessage()}
    assert killed == {"gateway", "daemon-0", "daemon-1", "daemon-2"}


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
