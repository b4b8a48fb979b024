"""A stand-in for Prometheus' HTTP API (/api/v1/query) on loopback: answers what a test
says, to drive the autoscaler's Prometheus mode with exact figures or with answers no real
Prometheus gives (tests of the real one use pagefleet.dev.prometheus)."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable

from aiohttp import web


def vector(values: dict[str, float]) -> bytes:
    """An instant-vector answer: one sample per pod."""
    result = [{"metric": {"pod": p}, "value": [0, str(v)]} for p, v in values.items()]
    return json.dumps(
        {"status": "success", "data": {"resultType": "vector", "result": result}}
    ).encode()


class FakePrometheus:
    """An HTTP server at /api/v1/query that answers whatever ``body`` says (a Prometheus
    behind a wrong URL, a proxy, another JSON API), or what ``answer`` returns for the
    query."""

    def __init__(self) -> None:
        self.body = b"{}"
        self.answer: Callable[[str], bytes] | None = None
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

        async def handler(request: web.Request) -> web.Response:
            query = request.query.get("query", "")
            body = self.body if self.answer is None else self.answer(query)
            return web.Response(body=body, content_type="application/json")

        async def start() -> tuple[web.AppRunner, int]:
            app = web.Application()
            app.router.add_get("/api/v1/query", handler)
            runner = web.AppRunner(app)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            return runner, site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

        self.runner, port = asyncio.run_coroutine_threadsafe(start(), self.loop).result(10)
        self.url = f"http://127.0.0.1:{port}"

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
