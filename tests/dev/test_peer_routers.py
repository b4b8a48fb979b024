"""A peer router that lost its port between free_port() and its bind is started again."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from pagefleet.dev.local_fleet import Child, free_port
from pagefleet.dev.peer_routers import wait_peer_ready

# Fails its first start as a Rust router does when a port is taken; serves /v1/models after.
FAKE = r"""
import json, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
marker = Path(sys.argv[1])
port = int(sys.argv[sys.argv.index("--port") + 1])
if not marker.exists():
    marker.write_text("x")
    print("Error: Address already in use (os error 98)", flush=True)
    sys.exit(1)
class H(BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"data": [{"id": "m"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
HTTPServer(("127.0.0.1", port), H).serve_forever()
"""


def test_port_taken_restarts_on_fresh_ports(tmp_path: Path) -> None:
    port = free_port()
    argv = [sys.executable, "-c", FAKE, str(tmp_path / "started"), "--port", str(port),
            "--prometheus-port", str(free_port())]  # fmt: skip
    child = Child("fake-router", argv, f"http://127.0.0.1:{port}", tmp_path / "r.log")
    child.start()
    try:
        wait_peer_ready(child, "m", timeout_s=30)
        assert child.alive
        assert child.url.endswith(child.argv[child.argv.index("--port") + 1])
    finally:
        child.stop()


@pytest.mark.parametrize("earlier_clash", [False, True])
def test_other_exit_is_not_retried(tmp_path: Path, earlier_clash: bool) -> None:
    log = tmp_path / "r.log"
    if earlier_clash:  # the log is appended to: an earlier run's lines stay in it
        log.write_text("Error: Address already in use (os error 98)\n")
    argv = [sys.executable, "-c", "print('boom'); raise SystemExit(1)", "--port", "1",
            "--prometheus-port", "2"]  # fmt: skip
    child = Child("fake-router", argv, "http://127.0.0.1:1", log)
    child.start()
    try:
        with pytest.raises(RuntimeError, match="boom"):
            wait_peer_ready(child, "m", timeout_s=30)
        assert child.argv[child.argv.index("--port") + 1] == "1", "retried on fresh ports"
    finally:
        child.stop()
