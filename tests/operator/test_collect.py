"""Scraping a pod's /metrics: whatever a pod answers makes it known or unknown, never an
exception that stops the autoscaler's pass for the whole InferenceService."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from aiohttp import web

from pagefleet.operator.collect import PodTarget, scrape_pods

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


async def _scrape_one(handler: Handler, timeout_s: float) -> dict:
    """Scrape one pod whose /metrics ``handler`` answers, served on a loopback port."""
    app = web.Application()
    app.router.add_get("/metrics", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        target = PodTarget("pod-a", f"http://127.0.0.1:{port}/metrics")
        return await scrape_pods([target], timeout_s=timeout_s)
    finally:
        await runner.cleanup()


async def _scrape(body: bytes, content_type: str) -> dict:
    async def handler(_: web.Request) -> web.Response:
        return web.Response(body=body, headers={"Content-Type": content_type})

    return await _scrape_one(handler, timeout_s=2.0)


def test_a_body_that_is_not_text_makes_the_pod_unknown():
    body = b"\xff\xfe<html>\x80\x81</html>"
    scrape = asyncio.run(_scrape(body, "text/plain; charset=utf-8"))["pod-a"]
    assert scrape.snapshot is None
    assert scrape.error and "the body is not text" in scrape.error


def _daemon_text() -> bytes:
    from pagefleet.daemon.metrics import DaemonMetrics
    from pagefleet.testing.engine_stats import idle_engine_stats

    metrics = DaemonMetrics("tiny", "unified", "pod-a")
    metrics.update_stats(idle_engine_stats(num_blocks=100))
    return metrics.render()


async def _scrape_stream(head: bytes, pad_bytes: int, length: bool) -> dict:
    """A pod whose /metrics is valid daemon text followed by ``pad_bytes`` of comments,
    streamed (chunked, no Content-Length) or announced with its Content-Length."""
    pad = b"# padding of a pod whose /metrics grew without bound\n" * 4096

    async def handler(request: web.Request) -> web.StreamResponse:
        size = len(head) + pad_bytes // len(pad) * len(pad)
        resp = web.StreamResponse(headers={"Content-Type": "text/plain; version=0.0.4"})
        if length:
            resp.content_length = size
        await resp.prepare(request)
        await resp.write(head)
        try:
            for _ in range(pad_bytes // len(pad)):
                await resp.write(pad)
        except (ConnectionError, RuntimeError):
            pass  # the scraper hung up: what a bounded reader does
        return resp

    return await _scrape_one(handler, timeout_s=10.0)


def test_a_huge_metrics_body_makes_the_pod_unknown_without_reading_it_all():
    """A pod whose /metrics grew to hundreds of MB (a label explosion, a wrong port) was read
    whole into the operator and parsed while the pass held the service's lock: 300 MiB took
    38 s and 1.8 GiB of memory (the chart's limit is 512 Mi). A daemon's body is ~27 KB;
    past the cap the pod is unknown, and the scraper stops reading."""
    head = _daemon_text()
    over = 6 * 1024 * 1024  # past the 4 MiB cap (collect.MAX_METRICS_BYTES)
    for length in (False, True):
        started = time.monotonic()
        scrape = asyncio.run(_scrape_stream(head, over, length))["pod-a"]
        assert scrape.snapshot is None, f"content-length={length}: read and parsed it all"
        assert scrape.error and "larger than" in scrape.error, scrape.error
        assert time.monotonic() - started < 5.0
    # Under the cap, padding and all, it is read and parsed as usual.
    ok = asyncio.run(_scrape_stream(head, 256 * 1024, length=False))["pod-a"]
    assert ok.snapshot is not None, ok.error


def test_more_pods_than_a_connection_pool_are_scraped_at_once():
    """aiohttp's default pool holds 100 connections, and the scrape timeout counts the wait
    for one: with 120 pods answering in 1.2 s, the last 20 waited 1.2 s for a connection
    and timed out at 2 s, unknown (holding every scale-down) in the fleets big enough to
    need the autoscaler most."""

    body = _daemon_text()

    async def run() -> dict:
        async def slow(_: web.Request) -> web.Response:
            await asyncio.sleep(1.2)
            return web.Response(body=body, content_type="text/plain")

        app = web.Application()
        app.router.add_get("/{pod}/metrics", slow)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        try:
            targets = [
                PodTarget(f"pod-{i}", f"http://127.0.0.1:{port}/pod-{i}/metrics")
                for i in range(120)
            ]
            return await scrape_pods(targets, timeout_s=2.0)
        finally:
            await runner.cleanup()

    scrapes = asyncio.run(run())
    unknown = sorted(name for name, s in scrapes.items() if s.snapshot is None)
    assert unknown == [], f"{len(unknown)} pods unknown: {scrapes[unknown[0]].error}"
