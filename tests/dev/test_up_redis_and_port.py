"""`pagefleet up` says what it does with the flags a user gave: an external Redis
(--redis-url) is used, not started, and --port is the gateway's port, --bench included."""

from __future__ import annotations

import contextlib
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from pagefleet.dev.process import free_port
from pagefleet.dev.redis_server import LocalRedis

pytestmark = pytest.mark.slow


@contextlib.contextmanager
def _up(tmp_path: Path, *args: str) -> Iterator[subprocess.Popen[str]]:
    """`pagefleet up` on the tiny model with one daemon and ``args``; interrupted (SIGINT,
    as Ctrl-C) and reaped on the way out."""
    up = subprocess.Popen(
        [sys.executable, "-m", "pagefleet.cli", "up", "--model", "tiny", "-n", "1",
         "--log-dir", str(tmp_path / "logs"), *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        yield up
    finally:
        if up.poll() is None:
            up.send_signal(signal.SIGINT)
            try:
                up.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                up.kill()
                up.communicate()


def _gateway_port(up: subprocess.Popen[str]) -> int:
    """The port of the ``gateway: URL`` line `up` prints once the fleet is ready."""
    assert up.stdout is not None and up.stderr is not None
    line = up.stdout.readline()  # blocks until the fleet is ready (or up dies)
    m = re.match(r"gateway: http://127\.0\.0\.1:(\d+)", line)
    assert m, f"unexpected first line {line!r}; stderr: {up.stderr.read()}"
    return int(m.group(1))


def test_an_external_redis_is_used_not_started(tmp_path: Path) -> None:
    """With --redis-url, `up` started no Redis but said "starting Redis" all the same: the
    user could not tell whether the fleet indexed into theirs. It must name theirs, and the
    daemons must publish there."""
    with LocalRedis() as external, _up(tmp_path, "--port", "0", "--redis-url", external.url) as up:
        assert up.stderr is not None
        first = up.stderr.readline()
        assert "starting Redis" not in first, first
        assert external.url in first, first
        _gateway_port(up)
        client = redis.Redis.from_url(external.url)
        try:
            assert client.dbsize() > 0, "the daemon published nothing into the given Redis"
        finally:
            client.close()


def test_bench_keeps_the_port_given(tmp_path: Path) -> None:
    """`up --bench --port N` put the gateway on a random port: a second client, a
    dashboard or a firewall rule pointed at N found nothing."""
    port = free_port()
    with _up(tmp_path, "--bench", "--bench-requests", "2", "--port", str(port)) as up:
        assert _gateway_port(up) == port


def test_a_second_up_on_the_same_port_is_refused_while_the_first_starts(tmp_path: Path) -> None:
    """Two `up`s on one port, the second started while the first loads its model: the
    port was only probed (free until the first's gateway starts), so the second started a
    whole fleet, its gateway failed to bind, and its readiness probe got the first fleet's
    gateway: it said "fleet ready" and served nothing of its own."""
    port = free_port()
    with _up(tmp_path / "first", "--port", str(port)) as first:
        assert first.stderr is not None
        assert first.stderr.readline().startswith("starting Redis")  # its port is checked
        second = subprocess.Popen(
            [sys.executable, "-m", "pagefleet.cli", "up", "--model", "tiny", "-n", "1",
             "--port", str(port), "--log-dir", str(tmp_path / "second")],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            _, err = second.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            second.send_signal(signal.SIGINT)
            _, err = second.communicate(timeout=60)
            pytest.fail(f"the second `up` on port {port} ran on: {err}")
        assert second.returncode == 2, err
        assert f"port {port} is in use" in err
        assert _gateway_port(first) == port  # the first fleet gets its port all the same
