"""`pagefleet bench --url` pointed at a daemon, not a gateway: a real daemon process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pagefleet.dev.local_fleet import Child, FleetSpec, LocalFleet
from pagefleet.dev.process import free_port

pytestmark = pytest.mark.slow


@pytest.mark.timeout(300)
def test_bench_at_a_daemon_says_the_pod_share_is_unknown(tmp_path: Path) -> None:
    """A daemon sends no x-pagefleet-pod header (only the gateway knows where it routed):
    the report said "per-pod share ? 100%", a pod named "?" taking every request. It now
    says the share is unknown and why, and the JSON has no "" pod."""
    port = free_port()
    daemon = Child(
        "daemon",
        [sys.executable, "-m", "pagefleet.cli", "daemon", "--model", "tiny", "--port", str(port)],
        f"http://127.0.0.1:{port}",
        tmp_path / "daemon.log",
    )
    daemon.start()
    try:
        LocalFleet(FleetSpec(log_dir=tmp_path, use_redis=False)).wait_ready([daemon])
        argv = [
            sys.executable, "-m", "pagefleet.cli", "bench", "--url", daemon.url,
            "--model", "tiny", "-n", "2", "-c", "1", "--max-tokens", "2", "--json", "--no-progress",
        ]  # fmt: skip
        bench = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    finally:
        daemon.stop()
    assert bench.returncode == 0, bench.stderr
    report = json.loads(bench.stdout.strip().splitlines()[-1])
    assert report["requests"] == 2 and report["failed"] == 0
    assert report["pod_share"] == {} and report["max_pod_share"] is None
    text = " ".join(bench.stdout.split())  # rich wraps lines at 80 columns
    assert "per-pod share unknown" in text and "x-pagefleet-pod" in text, text
    assert "?" not in text.split("per-pod share")[1].split("{")[0], text


@pytest.mark.timeout(300)
def test_bench_without_model_drives_the_model_the_url_serves(tmp_path: Path) -> None:
    """README: `pagefleet up --model tiny`, then `pagefleet bench --url ...`. --model
    defaulted to smollm2-135m, so every request was a 404 and bench exited 1. Without
    --model it now asks GET /v1/models and drives the one model served there."""
    port = free_port()
    daemon = Child(
        "daemon",
        [sys.executable, "-m", "pagefleet.cli", "daemon", "--model", "tiny", "--port", str(port)],
        f"http://127.0.0.1:{port}",
        tmp_path / "daemon.log",
    )
    daemon.start()
    try:
        LocalFleet(FleetSpec(log_dir=tmp_path, use_redis=False)).wait_ready([daemon])
        argv = [
            sys.executable, "-m", "pagefleet.cli", "bench", "--url", daemon.url,
            "-n", "2", "-c", "1", "--max-tokens", "2", "--json", "--no-progress",
        ]  # fmt: skip
        bench = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    finally:
        daemon.stop()
    assert bench.returncode == 0, bench.stdout + bench.stderr
    report = json.loads(bench.stdout.strip().splitlines()[-1])
    assert report["requests"] == 2 and report["failed"] == 0, report
