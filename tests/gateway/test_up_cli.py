"""`pagefleet up` as a user runs it: start, serve `pagefleet bench`, Ctrl-C, nothing left over."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def _port_open(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def _pipe_holders(proc: subprocess.Popen[str]) -> list[str]:
    """The processes (pid and command line) that still hold ``proc``'s stdout or stderr."""
    names = {f"pipe:[{os.fstat(f.fileno()).st_ino}]" for f in (proc.stdout, proc.stderr) if f}
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
            if any(os.readlink(f"/proc/{pid}/fd/{fd}") in names for fd in fds):
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
                found.append(f"{pid}: {cmd.decode(errors='replace')[:200]}")
        except OSError:
            continue
    return found


def test_up_serves_bench_and_stops_everything_on_ctrl_c(tmp_path: Path) -> None:
    up = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pagefleet.cli",
            "up",
            "--model",
            "tiny",
            "--port",
            "0",
            "--log-dir",
            str(tmp_path / "logs"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # As a background job of a script starts it (`cmd &` ignores SIGINT for it): Ctrl-C
        # must stop the fleet anyway. Python keeps an inherited SIG_IGN, so `up` sets its
        # handler itself; without that this test's SIGINT did nothing.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    try:
        assert up.stdout is not None
        line = up.stdout.readline()  # blocks until the fleet is ready (or up dies)
        m = re.match(r"gateway: (http://127\.0\.0\.1:(\d+))", line)
        assert m, f"unexpected first line {line!r}; stderr: {up.stderr.read() if up.stderr else ''}"
        url = m.group(1)
        bench = subprocess.run(
            [
                sys.executable,
                "-m",
                "pagefleet.cli",
                "bench",
                "--url",
                url,
                "--model",
                "tiny",
                "-n",
                "8",
                "-c",
                "2",
                "--max-tokens",
                "3",
                "--json",
                "--no-progress",
                "--plot",
                str(tmp_path / "plots"),
            ],
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert bench.returncode == 0, bench.stderr
        report = json.loads(bench.stdout.strip().splitlines()[-1])
        assert report["requests"] == 8 and report["failed"] == 0
        assert "ttft_ms" in bench.stdout and "cluster prefix hit rate" in bench.stdout
        assert len(report["pod_share"]) >= 1
        assert (tmp_path / "plots" / "latency_cdf.png").stat().st_size > 1000
        logs = sorted(p.name for p in (tmp_path / "logs").iterdir())
        assert logs == ["daemon-0.log", "daemon-1.log", "gateway.log"]
        daemon_ports = [
            int(p)
            for p in re.findall(
                r"127\.0\.0\.1:(\d+)",
                (tmp_path / "logs" / "gateway.log").read_text()
                + " ".join((tmp_path / "logs" / f"daemon-{i}.log").read_text() for i in range(2)),
            )
        ]
        up.send_signal(signal.SIGINT)
        # LocalFleet.stop's bound: one 10 s grace for the gateway and daemons, 5 s for Redis.
        try:
            _, err = up.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            if up.poll() is None:
                up.send_signal(signal.SIGUSR1)  # its threads' stacks, to stderr
                time.sleep(1)
                up.kill()
                _, err = up.communicate(timeout=10)
                pytest.fail(f"`pagefleet up` still running 30 s after Ctrl-C; stderr:\n{err}")
            pytest.fail(f"`pagefleet up` exited, its output pipes held by {_pipe_holders(up)}")
        assert up.returncode == 0, err
        assert "fleet stopped" in err
        gw_port = int(m.group(2))
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(
            _port_open("127.0.0.1", p) for p in [gw_port, *daemon_ports]
        ):
            time.sleep(0.2)
        assert not _port_open("127.0.0.1", gw_port)
        assert daemon_ports and not any(_port_open("127.0.0.1", p) for p in daemon_ports)
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()


def test_a_usage_error_leaves_the_callers_signal_handlers_alone() -> None:
    """`up` takes SIGINT/SIGTERM only once it starts a fleet: called in-process (click's
    runner) with bad arguments it must not change the caller's handlers."""
    from click.testing import CliRunner

    from pagefleet.dev.local_fleet import command

    before = signal.getsignal(signal.SIGTERM)
    result = CliRunner().invoke(command, ["--prefill", "1"])
    assert result.exit_code == 2, result.output
    assert signal.getsignal(signal.SIGTERM) is before
