"""Scraping a pod's /metrics: whatever a pod answers makes it known or unknown, never an
exception that stops the autoscaler's pass for the whole InferenceService."""

from __future__ import annotations

import asyncio

from aiohttp import web

from pagefleet.operator.collect import PodTarget, scrape_pods


async def _scrape(body: bytes, content_type: str) -> dict:
    async def handler(_: web.Request) -> web.Response:
        return web.Response(body=body, headers={"Content-Type": content_type})

    app = web.Application()
    app.router.add_get("/metrics", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        target = PodTarget("pod-a", f"http://127.0.0.1:{port}/metrics")
        return await scrape_pods([target], timeout_s=2.0)
    finally:
        await runner.cleanup()


def test_a_body_that_is_not_text_makes_the_pod_unknown():
    body = b"\xff\xfe<html>\x80\x81</html>"
    scrape = asyncio.run(_scrape(body, "text/plain; charset=utf-8"))["pod-a"]
    assert scrape.snapshot is None
    assert scrape.error and "the body is not text" in scrape.error
