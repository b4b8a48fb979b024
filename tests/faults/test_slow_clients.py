"""Slow and stalled clients against real processes: one daemon on the tiny model and a
gateway, started as `pagefleet up` does (tests/gateway/test_hardening.py covers the same
timeouts against scripted upstreams, in detail).

A client that opens a stream and stops reading must not hold the gateway's request, and
with it the connection to the daemon (its handler and the output it has queued), for as
long as the client keeps its socket open: the gateway cuts it at ``--client-write-timeout``.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Iterator

import aiohttp
import pytest

from pagefleet.dev.local_fleet import FleetSpec, LocalFleet
from pagefleet.testing.slow_client import open_unread

MAX_TOKENS = 4000  # the tiny model's context is 4096: seconds of generation on a CPU
# 8 sequences with top-20 logprobs: ~23 MB of stream, past every socket buffer on the way
# (loopback autotunes them to megabytes) long before the daemon finishes.


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFleet]:
    spec = FleetSpec(
        num_daemons=1,
        use_redis=False,
        gateway_args=["--client-write-timeout", "1", "--probe-interval", "0"],
        log_dir=tmp_path_factory.mktemp("fleet"),
        seed=0,
    )
    with LocalFleet(spec) as f:
        yield f


async def _finished(s: aiohttp.ClientSession, daemon: str) -> dict[str, float]:
    """The daemon's finished requests by reason (vllm:request_success_total)."""
    async with s.get(daemon + "/metrics") as r:
        text = await r.text()
    pattern = r'^vllm:request_success_total\{[^}]*finished_reason="(\w+)"[^}]*\} (\S+)$'
    return {m[1]: float(m[2]) for m in re.finditer(pattern, text, re.M)}


async def _gateway_inflight(s: aiohttp.ClientSession, gateway: str) -> float:
    """Requests the gateway holds open to its pods (pagefleet_gateway_inflight_requests)."""
    async with s.get(gateway + "/metrics") as r:
        text = await r.text()
    pattern = r"^pagefleet_gateway_inflight_requests\{[^}]*\} (\S+)$"
    return sum(float(m[1]) for m in re.finditer(pattern, text, re.M))


async def test_a_stream_nobody_reads_is_let_go_by_the_gateway(fleet: LocalFleet) -> None:
    daemon, gateway = fleet.daemon_urls[0], fleet.gateway_url
    body = {"model": "tiny", "prompt": "The slow reader", "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True, "stream": True,
            "logprobs": 20, "n": 8}  # fmt: skip
    async with aiohttp.ClientSession() as s:
        before = await _finished(s, daemon)
        t0 = time.monotonic()
        writer = await open_unread(gateway, body)
        try:
            held = await _gateway_inflight(s, gateway)
            assert held == 1, held
            while time.monotonic() - t0 < 60 and held:
                await asyncio.sleep(0.1)
                held = await _gateway_inflight(s, gateway)
            took = time.monotonic() - t0
            # The daemon counts the abort once it notices the gateway's connection went:
            # a moment after the gateway lets go (seconds on a loaded machine).
            after = await _finished(s, daemon)
            deadline = time.monotonic() + 15
            while after == before and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
                after = await _finished(s, daemon)
        finally:
            writer.close()
    ended = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    print(f"\nSLOW READER: the gateway let go after {took:.1f}s; the daemon's request: {ended}")
    # Before --client-write-timeout the gateway held it for as long as the client's socket
    # stayed open, and the daemon's sequence with it (seen: both still open after the 60 s
    # of the loop, the daemon's request neither finished nor aborted). Now the cut reaches
    # the daemon, which aborts the sequence (or it has just finished: "length").
    assert not held, "the gateway still holds the unread stream's pod request after 60 s"
    assert sum(ended.values()) == 1, ended
