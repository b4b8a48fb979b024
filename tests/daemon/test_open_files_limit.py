"""The daemon lifts its soft open-files limit, as the gateway does.

A daemon started from a shell inherited its soft limit (1024 on most desktops, 256 here):
past that many connections accept() failed with EMFILE, and the daemon logged an accept
error per try (3295 of them for 300 connections at a limit of 256) while new clients,
health probes included, waited in the backlog.
"""

from __future__ import annotations

import os
import resource
import socket
import subprocess
import sys
import time
import urllib.request

import pytest


def _low_open_files_limit() -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))


def _soft_open_files(pid: int) -> int:
    with open(f"/proc/{pid}/limits") as f:
        lines = f.read().splitlines()
    for line in lines:
        if line.startswith("Max open files"):
            return int(line.split()[3])
    raise AssertionError(f"no open-files line in /proc/{pid}/limits")


def test_the_daemon_raises_its_inherited_soft_open_files_limit() -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < 2048:
        pytest.skip(f"the hard open-files limit here is {hard}: no headroom to raise into")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "pagefleet.cli", "daemon", "--model", "tiny",
           "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=_low_open_files_limit,
        env=dict(os.environ),
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, "the daemon exited"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                    break
            except OSError:
                assert time.monotonic() < deadline, "the daemon never answered /health"
                time.sleep(0.2)
        assert _soft_open_files(proc.pid) > 256
    finally:
        proc.terminate()
        proc.wait(30)
