"""The gateway process on SIGTERM: a bounded graceful drain.

One real `pagefleet gateway` process (its own process group, signalled as `pagefleet up`
and a container runtime do) in front of a stand-in daemon that streams for as long as it
is told to. Before the drain was bounded, one stream open at SIGTERM kept the gateway
alive for aiohttp's 60 s shutdown timeout (SIGKILLed by `pagefleet up` after 10 s).
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from pagefleet.dev import process

DRAIN_S = 3.0
# Generous for a loaded 2-core machine; the fault this guards against took 60 s or more.
EXIT_BOUND_S = 20.0


class Upstream:
    """A stand-in daemon: each stream sends a chunk every 50 ms until its prompt's event
    is set (then a last chunk and [DONE]), or forever when it has none."""

    def __init__(self) -> None:
        self.finish: dict[str, asyncio.Event] = {"finish": asyncio.Event()}
        self.started: dict[str, asyncio.Event] = {p: asyncio.Event() for p in ("finish", "cut")}
        self.closed: dict[str, asyncio.Event] = {p: asyncio.Event() for p in ("finish", "cut")}

    async def ok(self, _: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        prompt = str((await request.json())["prompt"])
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        chunk = {"id": "c", "object": "text_completion", "model": "tiny"}
        try:
            done = self.finish.get(prompt)
            while done is None or not done.is_set():
                chunk["choices"] = [{"index": 0, "text": "x", "finish_reason": None}]
                await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
                self.started[prompt].set()
                await asyncio.sleep(0.05)
            chunk["choices"] = [{"index": 0, "text": "", "finish_reason": "length"}]
            await resp.write(f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode())
            await resp.write_eof()
            return resp
        finally:
            self.closed[prompt].set()


async def _read_stream(session: aiohttp.ClientSession, url: str, prompt: str) -> list[bytes]:
    """Every SSE data line of one stream through the gateway, until it ends or is cut."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 10_000, "stream": True}
    lines: list[bytes] = []
    try:
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            async for raw in resp.content:
                if raw.startswith(b"data: "):
                    lines.append(raw.strip())
    except aiohttp.ClientError:
        pass  # a cut stream: what was read so far is the answer
    return lines


async def _until(
    what: str,
    check: Callable[[], Awaitable[bool]],
    timeout_s: float,
    proc: subprocess.Popen[bytes],
    log: Path,
) -> None:
    """Await ``check()`` being true; fail at once if the gateway exited."""
    deadline = time.monotonic() + timeout_s
    while not await check():
        if proc.poll() is not None:
            raise AssertionError(f"{what}: gateway exited ({proc.returncode})\n{log.read_text()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s}s\n{log.read_text()}")
        await asyncio.sleep(0.05)


@pytest.mark.timeout(120)
async def test_sigterm_finishes_open_streams_within_the_drain_and_cuts_the_rest(
    tmp_path: Path,
) -> None:
    up = Upstream()
    app = web.Application()
    app.router.add_get("/ready", up.ok)
    app.router.add_get("/health", up.ok)
    app.router.add_post("/v1/completions", up.completions)
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    upstream_port = runner.addresses[0][1]
    port = process.free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "gateway.log"
    argv = [
        sys.executable, "-m", "pagefleet.cli", "gateway", "--host", "127.0.0.1",
        "--port", str(port), "--model", "tiny", "--policy", "round_robin",
        "--endpoints", f"http://127.0.0.1:{upstream_port}",
        "--drain-timeout", str(DRAIN_S), "--log-level", "warning",
    ]  # fmt: skip
    proc = process.spawn(argv, log)
    session = aiohttp.ClientSession()
    try:

        async def healthy() -> bool:
            try:
                async with session.get(f"{url}/health") as resp:
                    return resp.status == 200
            except aiohttp.ClientError:
                return False

        await _until("gateway /health", healthy, 90, proc, log)
        finishing = asyncio.create_task(_read_stream(session, url, "finish"))
        cut = asyncio.create_task(_read_stream(session, url, "cut"))
        for prompt in ("finish", "cut"):
            await asyncio.wait_for(up.started[prompt].wait(), 30)
        process.signal_group(proc, signal.SIGTERM)
        t_term = time.monotonic()

        async def draining() -> bool:
            return "stop signal: draining 2 open connection(s)" in log.read_text()

        await _until(
            "the drain's log line",
            draining,
            EXIT_BOUND_S,
            proc,
            log,
        )
        # Draining: no new connection is taken; the open ones still stream.
        async with aiohttp.ClientSession() as other:
            with pytest.raises(aiohttp.ClientConnectionError):
                await other.get(f"{url}/health", timeout=aiohttp.ClientTimeout(total=5))
        assert not up.closed["cut"].is_set() and not finishing.done()
        up.finish["finish"].set()
        lines = await asyncio.wait_for(finishing, EXIT_BOUND_S)
        assert lines and lines[-1] == b"data: [DONE]", lines[-3:]
        # The stream that never ends is cut once the drain is over, and the daemon sees it.
        cut_lines = await asyncio.wait_for(cut, EXIT_BOUND_S)
        t_cut = time.monotonic() - t_term
        assert cut_lines and b"[DONE]" not in cut_lines[-1]
        assert t_cut >= DRAIN_S * 0.9, f"cut {t_cut:.2f}s after SIGTERM, before the drain ended"
        await asyncio.wait_for(up.closed["cut"].wait(), EXIT_BOUND_S)
        status = await asyncio.to_thread(proc.wait, EXIT_BOUND_S)
        t_exit = time.monotonic() - t_term
        assert status == 0, log.read_text()
        assert t_exit < EXIT_BOUND_S, f"gateway exited {t_exit:.1f}s after SIGTERM"
    finally:
        await session.close()
        process.stop(proc, grace_s=5)
        await runner.cleanup()
