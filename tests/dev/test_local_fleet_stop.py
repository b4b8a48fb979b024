"""`pagefleet up` stops in bounded time even when its children ignore SIGTERM."""

from __future__ import annotations

import logging
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
