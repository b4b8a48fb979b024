"""Clients reaching a daemon directly (no gateway in front, or a router without write
timeouts) that stop reading, hang up while queued, or hold connections open without a
request. Real daemons on the tiny model, raw sockets for the misbehaving clients.

What a stalled reader must not hold: the daemon's admission slot, the engine's sequences
(their KV blocks), the connection, or the output the engine made meanwhile (a stream of
n=8 choices with top-20 logprobs is tens of MB).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from pagefleet.daemon.app import Daemon
from pagefleet.daemon.config import DaemonConfig
from pagefleet.dev.process import free_port
from pagefleet.ratelog import EveryInterval
from pagefleet.testing.slow_client import open_unread

from .conftest import LiveDaemon, wait_daemon_ready

# Seconds of generation on a CPU, tens of MB of SSE with n=8 and top-20 logprobs: far more
# than the socket buffers on the way take (the client's receive buffer is pinned to 4 KiB).
HEAVY = {"model": "tiny", "prompt": "The slow reader", "max_tokens": 3000, "temperature": 0,
         "ignore_eos": True, "logprobs": 20, "n": 8}  # fmt: skip


def config(**kw: object) -> DaemonConfig:
    base: dict[str, object] = dict(model="tiny", port=free_port(), pod_name="pod-slow",
                                   max_num_seqs=8, max_queue=8)  # fmt: skip
    base.update(kw)
    return DaemonConfig(**base)  # type: ignore[arg-type]


def rss_bytes() -> int:
    """This process's resident memory (the daemon's HTTP side runs in it; its engine not)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def by_label(d: Served, series: str, label: str) -> dict[str, float]:
    """A counter's values on the daemon's /metrics, by the value of ``label``."""
    async with aiohttp.ClientSession() as s, s.get(d.url + "/metrics") as r:
        text = await r.text()
    pattern = rf'^{re.escape(series)}\{{[^}}]*{label}="(\w+)"[^}}]*\}} (\S+)$'
    return {m[1]: float(m[2]) for m in re.finditer(pattern, text, re.M)}


async def finished(d: Served) -> dict[str, float]:
    """Finished sequences by reason (vllm:request_success_total)."""
    return await by_label(d, "vllm:request_success_total", "finished_reason")


async def cuts(d: Served) -> dict[str, float]:
    """Clients cut for not reading, by reason (pagefleet:client_cuts_total)."""
    return await by_label(d, "pagefleet:client_cuts_total", "reason")


@dataclass
class Served:
    """A daemon served as ``live_daemon`` does, with its runner at hand (open connections)."""

    live: LiveDaemon
    runner: web.AppRunner

    @property
    def url(self) -> str:
        return self.live.url

    def held(self) -> tuple[int, int, int]:
        """(admitted requests, engine requests running or waiting, open connections)."""
        stats = self.live.daemon.metrics.latest_stats
        engine = 0 if stats is None else stats.num_running + stats.num_waiting
        server = self.runner.server
        conns = 0 if server is None else len(server.connections)
        return self.live.daemon.admission.inflight, engine, conns


@asynccontextmanager
async def serve(cfg: DaemonConfig) -> AsyncIterator[Served]:
    """Start a Daemon on the real engine exactly as ``live_daemon`` (conftest.py) does."""
    daemon = Daemon(cfg)
    runner = web.AppRunner(daemon.app, handler_cancellation=True, access_log=None)
    await runner.setup()
    # The daemon's sockets get a small fixed send buffer (accepted sockets inherit it from
    # the listening one): loopback autotunes it to 4 MiB, which the tiny model on a loaded
    # CPU takes ~10 s to fill. A client across a network has such a window anyway; the
    # daemon's code paths are the same either way.
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16384)
    sock.bind(("127.0.0.1", cfg.port))
    await web.SockSite(runner, sock).start()
    try:
        await daemon.start()
        yield Served(LiveDaemon(daemon, f"http://127.0.0.1:{cfg.port}"), runner)
    finally:
        await daemon.drain(grace_s=2.0)
        await daemon.stop()
        await runner.cleanup()


async def wait_released(d: Served, within_s: float) -> tuple[float, int]:
    """Seconds until the daemon holds nothing for the client (no slot, no engine request,
    no connection), and the most this process's memory grew by meanwhile."""
    t0, rss0, peak = time.monotonic(), rss_bytes(), 0
    while time.monotonic() - t0 < within_s:
        peak = max(peak, rss_bytes() - rss0)
        if d.held() == (0, 0, 0):
            return time.monotonic() - t0, peak
        await asyncio.sleep(0.1)
    return float("inf"), peak


async def test_a_stream_nobody_reads_is_cut_at_the_write_timeout_and_its_sequences_aborted():
    """Before: the handler's write waited for the client forever. The engine finished the
    sequences (on a CPU the tiny model outruns any socket), the outputs queued up in the
    handler, and the admission slot and connection stayed taken for as long as the client
    kept its socket open."""
    async with serve(config(client_write_timeout_s=1.0)) as d:
        before = await finished(d)
        writer = await open_unread(d.url, {**HEAVY, "stream": True})
        try:
            took, grew = await wait_released(d, within_s=30)
            print(f"\nSTALLED STREAM: released after {took:.2f}s; memory grew {grew >> 20} MiB")
            # (the socket buffers on the way fill first: seconds on a loaded CPU)
            assert took < 20, f"still held 30s later (slot, engine, connections): {d.held()}"
        finally:
            writer.close()
        after = await finished(d)
        cut = await cuts(d)
    ended = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    # Cut well before the 3000 tokens: the request (its 8 sequences) was aborted.
    assert ended == {"abort": 1}, ended
    # ... and counted once as a cut, which an operator can tell from a client hanging up.
    assert cut == {"write_timeout": 1}, cut


async def test_a_stream_too_far_behind_its_client_is_aborted_before_the_write_timeout(caplog):
    """The bound on what one stream may hold: a client 1 MiB behind is cut long before the
    120 s write timeout, instead of the daemon queueing the engine's whole output for it
    (and a client that reads, only too slowly, would never trip a write timeout at all)."""
    async with serve(config(client_write_timeout_s=120.0, max_stream_backlog_mb=1)) as d:
        before = await finished(d)
        writer = await open_unread(d.url, {**HEAVY, "stream": True})
        try:
            took, grew = await wait_released(d, within_s=40)
            print(f"\nBACKLOG CUT: released after {took:.2f}s; memory grew {grew >> 20} MiB")
            assert took < 30, f"still held 40s later (slot, engine, connections): {d.held()}"
        finally:
            writer.close()
        after = await finished(d)
        cut = await cuts(d)
    ended = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    assert ended == {"abort": 1}, ended
    assert cut == {"backlog": 1}, cut
    assert "--max-stream-backlog-mb" in caplog.text


async def test_a_whole_answer_nobody_reads_is_dropped_at_the_write_timeout():
    """A non-streamed answer is written once, at the end; MBs of it (n=8, top-20 logprobs)
    to a client that never reads waited in aiohttp's send without a bound, holding the
    connection and the answer for as long as the client kept its socket open."""
    async with serve(config(client_write_timeout_s=1.0)) as d:
        writer = await open_unread(d.url, {**HEAVY, "max_tokens": 400})
        try:
            took, _ = await wait_released(d, within_s=15)
            print(f"\nUNREAD ANSWER: connection closed {took:.2f}s after its first bytes")
            assert took < 6, f"still held 15s later (slot, engine, connections): {d.held()}"
        finally:
            writer.close()
        cut = await cuts(d)
    assert cut == {"write_timeout": 1}, cut


async def test_many_clients_cut_at_once_are_each_counted_and_warned_about_once(caplog):
    """Cuts are client-triggered, one per request: a warning each flooded the log under a
    crowd of stalled readers (or an attack). Each cut is counted; one line is logged."""
    caplog.set_level(logging.WARNING, logger="pagefleet.daemon.serving")
    # A few hundred KB each (top-20 logprobs): more than the socket buffers on the way.
    body = {**HEAVY, "n": 1, "max_tokens": 300}
    async with serve(config(client_write_timeout_s=1.0)) as d:
        writers = await asyncio.gather(*(open_unread(d.url, body) for _ in range(4)))
        try:
            took, _ = await wait_released(d, within_s=30)
            assert took < 20, f"still held 30s later (slot, engine, connections): {d.held()}"
        finally:
            for writer in writers:
                writer.close()
        cut = await cuts(d)
    assert cut == {"write_timeout": 4}, cut
    lines = [r for r in caplog.records if "answer dropped" in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in lines]


def test_a_rate_limited_warning_says_how_many_it_left_out(caplog):
    """EveryInterval: one line per interval; the next line counts the ones left out."""
    caplog.set_level(logging.WARNING, logger="pagefleet.test")
    now = [100.0]
    log = EveryInterval(logging.getLogger("pagefleet.test"), 10.0, clock=lambda: now[0])
    assert log.warning("cut %s", "a")
    for t in (101.0, 105.0, 109.9):
        now[0] = t
        assert not log.warning("cut %s", "b")
    now[0] = 112.0
    assert log.warning("cut %s", "c")
    now[0] = 123.0
    assert log.warning("cut %s", "d")
    assert [r.getMessage() for r in caplog.records] == [
        "cut a",
        "cut c (3 more like it in the last 12 s were not logged)",
        "cut d",
    ]


@pytest.mark.parametrize("stream", [True, False])
async def test_a_client_that_hangs_up_while_queued_is_dropped_at_once(stream: bool):
    """A request waiting behind a running one (max_num_seqs=1) whose client disconnects:
    the daemon drops it from its queue and its admission slot within a fraction of a
    second, without a gateway in front to do it."""
    async with serve(config(max_num_seqs=1)) as d, aiohttp.ClientSession() as s:
        busy = {**HEAVY, "n": 1, "logprobs": None}
        running = asyncio.create_task(s.post(d.url + "/v1/completions", json=busy))
        t0 = time.monotonic()
        while d.held()[:2] != (1, 1) and time.monotonic() - t0 < 10:
            await asyncio.sleep(0.01)  # the busy one runs before the other is sent
        host, port = d.url.removeprefix("http://").split(":")
        _, writer = await asyncio.open_connection(host, int(port))
        data = json.dumps({**busy, "max_tokens": 5, "stream": stream}).encode()
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(data)}\r\n\r\n".encode()
            + data
        )
        t0 = time.monotonic()
        while d.held()[:2] != (2, 2) and time.monotonic() - t0 < 10:
            await asyncio.sleep(0.02)
        assert d.held()[:2] == (2, 2), d.held()  # one running, one waiting
        writer.close()
        t0 = time.monotonic()
        while d.held()[:2] != (1, 1) and time.monotonic() - t0 < 10:
            await asyncio.sleep(0.01)
        took = time.monotonic() - t0
        print(f"\nQUEUED CLIENT GONE (stream={stream}): dropped after {took:.3f}s")
        assert d.held()[:2] == (1, 1), d.held()
        assert took < 1.0
        running.cancel()
        assert await cuts(d) == {}, "a client that hung up was counted as cut"


def spawn_daemon(port: int, log: Path, *args: str) -> subprocess.Popen:
    argv = [sys.executable, "-m", "pagefleet.cli", "daemon", "--model", "tiny",
            "--port", str(port), "--max-model-len", "256", "--block-size", "8",
            "--num-gpu-blocks", "64", *args]  # fmt: skip
    return subprocess.Popen(
        argv, stdout=log.open("wb"), stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"},
    )  # fmt: skip


async def test_idle_slowloris_and_trickled_bodies_are_closed_in_bounded_time(tmp_path):
    """`pagefleet daemon` ran aiohttp's default keep-alive timeout, 3630 s, its only timer
    before a request starts: a connection that sent nothing, headers it never finished, or
    was left idle after a request, held a socket for an hour; a body sent a byte at a time
    held a handler for as long as it trickled."""
    port = free_port()
    log = tmp_path / "daemon.log"
    proc = spawn_daemon(port, log, "--keepalive-timeout", "1", "--body-timeout", "0.5")
    url = f"http://127.0.0.1:{port}"
    conns = []
    try:
        async with aiohttp.ClientSession() as s:
            await wait_daemon_ready(s, url, proc)
        for sent in (
            b"",
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ",
            b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n",  # answered, then left idle
        ):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(sent)
            conns.append((reader, writer))
        t0 = time.monotonic()
        for reader, _ in conns:
            async with asyncio.timeout(8):
                await reader.read()  # returns at EOF: the daemon closed the connection
        took = time.monotonic() - t0
        print(f"\nIDLE/SLOWLORIS: all closed after {took:.2f}s (keep-alive timeout 1s)")
        assert took < 4, f"connections closed after {took:.1f}s for a 1s keep-alive timeout"
        # A body promised whole but trickled: a 408 at the body timeout, connection closed.
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        conns.append((reader, writer))
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000\r\n\r\n" + b'{"prompt":'
        )
        t0 = time.monotonic()

        async def trickle() -> None:
            with contextlib.suppress(ConnectionError):
                for _ in range(50):
                    await asyncio.sleep(0.2)
                    writer.write(b" ")
                    await writer.drain()

        dribble = asyncio.create_task(trickle())
        try:
            async with asyncio.timeout(8):
                answer = await reader.read(4096)  # the answer; aiohttp then lingers (10 s)
        finally:
            dribble.cancel()
        took = time.monotonic() - t0
        status, _, rest = answer.partition(b"\r\n")
        assert status.split()[1] == b"408", answer
        error = json.loads(rest.partition(b"\r\n\r\n")[2])["error"]
        assert error["code"] == "request_timeout", error
        assert took < 3, f"the trickled body was answered after {took:.1f}s"
        assert proc.poll() is None, log.read_text()
    finally:
        for _, writer in conns:
            writer.close()
        proc.terminate()
        proc.wait(20)
