"""The autoscaler's Prometheus mode (``--prometheus-url``) against a server that answers
something other than a Prometheus instant vector: whatever it says makes the role's pods
unknown with a condition, never an exception out of the pass. (A real Prometheus is in
test_autoscaler.py.)"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest
from aiohttp import web
from fake_kube import FakeKube
from test_autoscaler import Clock, replicas, scaling_active, tick, world

from pagefleet.dev.redis_server import LocalRedis
from pagefleet.operator.autoscaler import Autoscaler, AutoscalerSettings
from pagefleet.operator.builders import BuildSettings
from pagefleet.operator.metrics import OperatorMetrics


@pytest.fixture(scope="module")
def redis() -> Iterator[str]:
    with LocalRedis() as server:
        yield server.url


class FakePrometheus:
    """An HTTP server at /api/v1/query that answers whatever ``body`` says (a Prometheus
    behind a wrong URL, a proxy, another JSON API)."""

    def __init__(self) -> None:
        self.body = b"{}"
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

        async def handler(_: web.Request) -> web.Response:
            return web.Response(body=self.body, content_type="application/json")

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


@pytest.mark.parametrize(
    "body",
    [
        b"[]",
        b'"ok"',
        b"null",
        b'{"status": "success"}',
        b'{"status": "success", "data": {"resultType": "vector", "result": {"a": 1}}}',
        b'{"status": "success", "data": {"result": [{"metric": {"pod": "chat-a"}}]}}',
    ],
)
def test_a_prometheus_answering_other_json_holds_with_a_condition(redis: str, body: bytes) -> None:
    """A --prometheus-url that answers JSON of another shape (a list, a string, a success
    without data) raised out of the pass (AttributeError, KeyError): no decision, no
    condition, only a traceback in the operator's log every tick."""
    prom = FakePrometheus()
    try:
        prom.body = body
        kube, clock, events = FakeKube(), Clock(), []
        world(kube, redis, 2, [("chat-a", "127.0.0.2")])
        scaler = Autoscaler(
            kube,
            BuildSettings(),
            AutoscalerSettings(scrape_timeout_s=1.0, prometheus_url=prom.url),
            OperatorMetrics(),
            clock=clock,
        )
        (out,) = tick(scaler, kube, events)
    finally:
        prom.close()
    assert replicas(kube) == 2 and out.decision.reason.value == "InputsUnknown"
    cond = scaling_active(kube)
    assert cond["status"] == "False" and f"Prometheus {prom.url}" in cond["message"], cond
