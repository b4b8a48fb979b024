"""The gateway's proxy path against small real upstream HTTP servers on 127.0.0.1.

The upstreams are stand-ins for daemons with scripted behaviour (stream slowly, fail, drop
the connection); the real-daemon tests live in test_e2e_fleet.py.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import aiohttp
import openai
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from pagefleet.dev.process import free_port
from pagefleet.gateway.discovery import StaticDiscovery
from pagefleet.gateway.policies import make_policy
from pagefleet.gateway.router import Router
from pagefleet.gateway.server import POD_HEADER, Gateway, ProxySettings
from pagefleet.kvindex.events import BlockStored, KVEventBatch
from pagefleet.kvindex.hashing import block_hashes
from pagefleet.kvindex.index import PodLoad
from pagefleet.kvindex.memory import MemoryKVIndex

BS = 16
NS = "proxy-test"
PROMPT = list(range(10, 10 + 4 * BS))


@dataclass
class Upstream:
    behaviour: str
    port: int = 0
    hits: int = 0
    disconnected: bool = False
    bodies: list[dict] = field(default_factory=list)
    runner: web.AppRunner | None = None

    @property
    def pod(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.hits += 1
        body = await request.json()
        self.bodies.append(body)
        if self.behaviour == "error400":
            return web.json_response(
                {
                    "error": {
                        "message": "'temperature': bad",
                        "type": "invalid_request_error",
                        "param": "temperature",
                        "code": None,
                    }
                },
                status=400,
            )
        if self.behaviour == "error500":
            return web.json_response(
                {"error": {"message": "boom", "type": "server_error", "param": None, "code": None}},
                status=500,
            )
        if self.behaviour == "busy429":
            return web.json_response(
                {
                    "error": {
                        "message": "queue full",
                        "type": "overloaded",
                        "param": None,
                        "code": None,
                    }
                },
                status=429,
            )
        if self.behaviour == "busy503":
            return web.json_response(
                {
                    "error": {
                        "message": "overloaded",
                        "type": "overloaded",
                        "param": None,
                        "code": None,
                    }
                },
                status=503,
                headers={"Retry-After": "1"},
            )
        if self.behaviour == "drop":
            assert request.transport is not None
            request.transport.close()
            await asyncio.sleep(0.05)
            return web.Response()
        if not body.get("stream"):
            return web.json_response(_completion(self.pod))
        if self.behaviour == "slow":
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            try:
                for i in range(100):
                    await resp.write(f'data: {{"n": {i}}}\n\n'.encode())
                    await asyncio.sleep(0.05)
            except (ConnectionResetError, aiohttp.ClientConnectionResetError):
                self.disconnected = True
                return resp
            await resp.write_eof()
            return resp
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(5):
            chunk = {
                "id": "cmpl-1",
                "object": "text_completion",
                "created": 1,
                "model": "m",
                "choices": [
                    {"index": 0, "text": f"t{i} ", "finish_reason": None, "logprobs": None}
                ],
            }
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
            await asyncio.sleep(0.08)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


def _completion(pod: str) -> dict:
    return {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 1,
        "model": "m",
        "choices": [
            {"index": 0, "text": f"hello from {pod}", "finish_reason": "length", "logprobs": None}
        ],
        "usage": {
            "prompt_tokens": len(PROMPT),
            "completion_tokens": 3,
            "total_tokens": len(PROMPT) + 3,
        },
    }


async def _serve(app: web.Application, port: int = 0) -> tuple[web.AppRunner, int]:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    sock = site._server.sockets[0]  # type: ignore[union-attr]
    return runner, sock.getsockname()[1]


async def _upstream(behaviour: str) -> Upstream:
    up = Upstream(behaviour)
    app = web.Application()
    app.router.add_post("/v1/completions", up.handle)
    app.router.add_post("/v1/chat/completions", up.handle)
    up.runner, up.port = await _serve(app)
    return up


@dataclass
class Fleet:
    gateway: Gateway
    url: str
    index: MemoryKVIndex
    upstreams: list[Upstream]
    runner: web.AppRunner

    async def hold_prefix(self, pod: str, tokens: list[int]) -> None:
        keys = block_hashes(tokens, BS, NS)
        await self.index.apply(pod, KVEventBatch(0.0, 0, [BlockStored(keys, None, tokens, BS)]))


@pytest.fixture
async def make_fleet() -> AsyncIterator[Callable]:
    made: list[Fleet] = []

    async def factory(behaviours: list[str], dead: int = 0, **proxy_kw) -> Fleet:
        ups = [await _upstream(b) for b in behaviours]
        urls = [u.url for u in ups] + [f"http://127.0.0.1:{free_port()}" for _ in range(dead)]
        index = MemoryKVIndex(NS)
        router = Router(
            discovery=StaticDiscovery(urls),
            policy=make_policy("cache_aware"),
            index=index,
            block_size=BS,
            kv_namespace=NS,
            seed=0,
        )
        gw = Gateway(
            router=router, tokenizer=None, served_model_name="tiny", proxy=ProxySettings(**proxy_kw)
        )
        runner, port = await _serve(gw.make_app())
        fleet = Fleet(gw, f"http://127.0.0.1:{port}", index, ups, runner)
        for url in urls:
            await index.heartbeat(url.removeprefix("http://"), PodLoad(), ttl_s=60)
        made.append(fleet)
        return fleet

    yield factory
    for f in made:
        await f.runner.cleanup()
        for u in f.upstreams:
            assert u.runner is not None
            await u.runner.cleanup()


async def test_streaming_is_passed_through_chunk_by_chunk(make_fleet) -> None:
    fleet = await make_fleet(["ok"])
    client = openai.AsyncOpenAI(base_url=fleet.url + "/v1", api_key="x", max_retries=0)
    t0 = time.perf_counter()
    arrivals: list[float] = []
    texts: list[str] = []
    stream = await client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, stream=True)
    async for chunk in stream:
        arrivals.append(time.perf_counter() - t0)
        texts.append(chunk.choices[0].text)
    await client.close()
    assert texts == [f"t{i} " for i in range(5)]
    # The upstream spaces its 5 chunks 80 ms apart: a buffering proxy would deliver them
    # all at the end. The first must arrive well before the last was even written.
    assert arrivals[-1] - arrivals[0] > 0.25
    assert fleet.upstreams[0].bodies[0]["prompt"] == PROMPT


async def test_pod_header_and_non_streaming(make_fleet) -> None:
    fleet = await make_fleet(["ok", "ok"])
    await fleet.hold_prefix(fleet.upstreams[1].pod, PROMPT)
    async with aiohttp.ClientSession() as s:
        for _ in range(3):
            async with s.post(
                fleet.url + "/v1/completions",
                json={"model": "tiny", "prompt": PROMPT, "max_tokens": 3},
            ) as r:
                assert r.status == 200
                assert r.headers[POD_HEADER] == fleet.upstreams[1].pod
                assert r.headers["x-pagefleet-predicted-hit-tokens"] == str(len(PROMPT))
                assert r.headers["x-pagefleet-route"] == "best_prefix/cache_aware"
                assert (await r.json())["choices"][0]["text"] == (
                    f"hello from {fleet.upstreams[1].pod}"
                )
    assert fleet.upstreams[0].hits == 0 and fleet.upstreams[1].hits == 3


@pytest.mark.parametrize("behaviour,status", [("error400", 400), ("error500", 500)])
async def test_upstream_errors_pass_through_with_status(make_fleet, behaviour, status) -> None:
    fleet = await make_fleet([behaviour, "ok"])
    await fleet.hold_prefix(fleet.upstreams[0].pod, PROMPT)
    client = openai.AsyncOpenAI(base_url=fleet.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.APIStatusError) as info:
        await client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3)
    await client.close()
    assert info.value.status_code == status
    assert info.value.response.headers[POD_HEADER] == fleet.upstreams[0].pod
    # The caller's mistake (or a pod error after it accepted the work) is not retried.
    assert fleet.upstreams[1].hits == 0


@pytest.mark.parametrize("behaviour", ["refused", "drop", "busy503", "busy429"])
async def test_failure_before_first_byte_retries_next_best_pod(make_fleet, behaviour) -> None:
    if behaviour == "refused":
        fleet = await make_fleet(["ok"], dead=1)
        bad_pod = fleet.gateway.router.discovery.endpoints()[1].pod
    else:
        fleet = await make_fleet([behaviour, "ok"])
        bad_pod = fleet.upstreams[0].pod
    good = fleet.upstreams[-1]
    # The failing pod holds the whole prefix, so cache_aware ranks it first.
    await fleet.hold_prefix(bad_pod, PROMPT)
    client = openai.AsyncOpenAI(base_url=fleet.url + "/v1", api_key="x", max_retries=0)
    raw = await client.completions.with_raw_response.create(
        model="tiny", prompt=PROMPT, max_tokens=3, stream=True
    )
    assert raw.headers[POD_HEADER] == good.pod
    texts = [c.choices[0].text async for c in raw.parse()]
    await client.close()
    assert texts == [f"t{i} " for i in range(5)]
    metrics = fleet.gateway.metrics.render().decode()
    assert f'pagefleet_gateway_upstream_retries_total{{pod="{bad_pod}"}} 1.0' in metrics
    assert good.hits == 1


async def test_every_pod_failing_is_a_502_and_last_503_passes_through(make_fleet) -> None:
    fleet = await make_fleet([], dead=2)
    async with (
        aiohttp.ClientSession() as s,
        s.post(fleet.url + "/v1/completions", json={"model": "tiny", "prompt": PROMPT}) as r,
    ):
        assert r.status == 502
        err = (await r.json())["error"]
        assert err["code"] == "upstream_unavailable" and "retry" in err["message"]
    # Counted: an outage of every pod is not silence on the dashboards.
    metrics = fleet.gateway.metrics.render().decode()
    assert 'pagefleet_gateway_rejected_requests_total{reason="upstream_unavailable"} 1.0' in metrics
    fleet = await make_fleet(["busy503"])
    async with (
        aiohttp.ClientSession() as s,
        s.post(fleet.url + "/v1/completions", json={"model": "tiny", "prompt": PROMPT}) as r,
    ):
        assert r.status == 503
        assert r.headers["Retry-After"] == "1"


async def test_bad_body_is_rejected_at_the_gateway(make_fleet) -> None:
    fleet = await make_fleet(["ok"])
    async with aiohttp.ClientSession() as s:
        async with s.post(fleet.url + "/v1/chat/completions", data=b"{not json") as r:
            assert r.status == 400
            assert "not valid JSON" in (await r.json())["error"]["message"]
        async with s.post(
            fleet.url + "/v1/chat/completions", json={"model": "tiny", "messages": []}
        ) as r:
            assert r.status == 400
            assert (await r.json())["error"]["type"] == "invalid_request_error"
    assert fleet.upstreams[0].hits == 0


async def test_plain_endpoints_and_metrics(make_fleet) -> None:
    fleet = await make_fleet(["ok"])
    client = openai.AsyncOpenAI(base_url=fleet.url + "/v1", api_key="x", max_retries=0)
    async with aiohttp.ClientSession() as s, s.get(fleet.url + "/metrics") as r:
        before = await r.text()
    # The decision series exists before the first request (a rate needs an earlier sample).
    count = 'pagefleet_gateway_routing_decision_seconds_count{policy="cache_aware"}'
    assert f"{count} 0.0" in before
    models = await client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    await client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3)
    await client.close()
    async with aiohttp.ClientSession() as s:
        async with s.get(fleet.url + "/health") as r:
            assert r.status == 200
        async with s.get(fleet.url + "/ready") as r:
            assert r.status == 200 and (await r.json())["endpoints"] == 1
        async with s.get(fleet.url + "/metrics") as r:
            text = await r.text()
    pod = fleet.upstreams[0].pod
    assert f'pagefleet_gateway_requests_total{{pod="{pod}",policy="cache_aware"}} 1.0' in text
    assert f"{count} 1.0" in text
    assert f'pagefleet_gateway_upstream_latency_seconds_count{{pod="{pod}"}} 1.0' in text


async def test_arrival_counters_count_uncached_prompt_tokens_when_routed(make_fleet) -> None:
    """The autoscaler's leading signal: every routed request, and its prompt tokens minus
    the prefix the gateway expects the chosen pod to hold."""
    fleet = await make_fleet(["ok"])
    client = openai.AsyncOpenAI(base_url=fleet.url + "/v1", api_key="x", max_retries=0)
    await client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3)
    # Shares its first three blocks with PROMPT, which the gateway placed on the only pod.
    second = PROMPT[: 3 * BS] + list(range(900, 900 + BS))
    await client.completions.create(model="tiny", prompt=second, max_tokens=3)
    await client.close()
    async with aiohttp.ClientSession() as s, s.get(fleet.url + "/metrics") as r:
        text = await r.text()
    values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert values["pagefleet_gateway_arrivals_total"] == 2
    uncached = len(PROMPT) + (len(PROMPT) - 3 * BS)
    assert values["pagefleet_gateway_arrival_prompt_tokens_total"] == uncached


def test_gateway_import_does_not_load_torch() -> None:
    code = (
        "import sys, pagefleet.gateway.server, pagefleet.gateway.cli, "
        "pagefleet.dev.loadgen, pagefleet.dev.local_fleet; "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


async def test_client_hangup_mid_stream_closes_the_upstream_request(make_fleet) -> None:
    fleet = await make_fleet(["slow"])
    up = fleet.upstreams[0]
    async with aiohttp.ClientSession() as s:
        resp = await s.post(
            fleet.url + "/v1/completions", json={"model": "tiny", "prompt": PROMPT, "stream": True}
        )
        assert resp.status == 200
        first = await resp.content.readany()
        assert first.startswith(b"data: ")
        resp.close()  # hang up after the first chunk
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not up.disconnected:
        await asyncio.sleep(0.05)
    # The daemon would see its client (the gateway) go away and abort the request.
    assert up.disconnected
    assert fleet.gateway.router.inflight == {}
