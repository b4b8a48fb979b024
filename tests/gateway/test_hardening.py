"""The gateway under hostile input and failing upstreams (issue 14), against real sockets.

Upstreams are small scripted HTTP servers on 127.0.0.1 (cut a stream, hang, refuse); the
real-daemon fault suite is tests/faults/. Each test here would fail on the gateway before
the hardening: it accepted 64 MB bodies, tokenized on its loop, passed cut streams through
as clean 200s and waited 300 s for a hung pod.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import logging
import os
import resource
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import openai
import pytest
from aiohttp import web

from pagefleet.dev.process import free_port
from pagefleet.gateway.discovery import StaticDiscovery
from pagefleet.gateway.intake import inspect
from pagefleet.gateway.policies import Candidate, RouteRequest, make_policy
from pagefleet.gateway.router import Router
from pagefleet.gateway.server import POD_HEADER, Gateway, ProxySettings
from pagefleet.httpauth import Credentials
from pagefleet.kvindex.index import MAX_COUNT, PodLoad
from pagefleet.kvindex.memory import MemoryKVIndex
from pagefleet.testing.slow_client import open_unread

CHUNK = {
    "id": "cmpl-1",
    "object": "text_completion",
    "created": 1,
    "model": "tiny",
    "choices": [{"index": 0, "text": "t ", "finish_reason": None, "logprobs": None}],
}
DONE_BODY = {
    "id": "cmpl-1",
    "object": "text_completion",
    "created": 1,
    "model": "tiny",
    "choices": [{"index": 0, "text": "ok", "finish_reason": "length", "logprobs": None}],
    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
}


@dataclass
class Upstream:
    """A stand-in daemon; ``behaviour`` may be changed while it runs."""

    behaviour: str
    ready_status: int = 200
    ready_hang: bool = False
    port: int = 0
    hits: int = 0
    # A stream's chunks before [DONE], and the pause after each
    chunks: int = 3
    gap_s: float = 0.02
    headers: list[dict[str, str]] = field(default_factory=list)
    runner: web.AppRunner | None = None
    gone_at: float | None = None  # "flood": when its reader went away

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pod(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def ready(self, request: web.Request) -> web.Response:
        if self.ready_hang:
            await asyncio.sleep(3600)
        return web.json_response({"status": "x"}, status=self.ready_status)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.hits += 1
        self.headers.append(dict(request.headers))
        body = await request.json()
        b = self.behaviour
        if b == "keyed":  # a daemon with API keys, and the gateway has not the right one
            err = {"message": "incorrect API key provided", "type": "invalid_request_error",
                   "param": None, "code": "invalid_api_key"}  # fmt: skip
            return web.json_response({"error": err}, status=401)
        if b == "hang" or body.get("prompt") == "hang":  # this request only, or all
            await asyncio.sleep(3600)
        if b == "503stall":  # a refusal's headers, then a body that never comes
            resp = web.StreamResponse(status=503, headers={"Content-Length": "100"})
            await resp.prepare(request)
            await asyncio.sleep(3600)
        if not body.get("stream"):
            if b == "slow":  # a long generation: the answer comes whole after a while
                await asyncio.sleep(self.gap_s * self.chunks)
                return web.json_response(DONE_BODY)
            if b == "big":  # a long answer, several MiB (n and logprobs make them)
                return web.json_response({**DONE_BODY, "pad": "x" * (4 << 20)})
            if b == "cut":  # promise more than is sent, then drop the connection
                resp = web.StreamResponse(headers={"Content-Length": "1000"})
                await resp.prepare(request)
                await resp.write(b'{"id": "cmpl-1", "choi')
                assert request.transport is not None
                request.transport.close()
                return resp
            return web.json_response(DONE_BODY)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for _ in range(self.chunks):
            await resp.write(f"data: {json.dumps(CHUNK)}\n\n".encode())
            await asyncio.sleep(self.gap_s)
        if b == "cut":
            assert request.transport is not None
            request.transport.close()
            return resp
        if b == "stall":
            await asyncio.sleep(3600)
        if b == "flood":  # as fast as the reader takes it, until the reader is gone
            chunk = f"data: {json.dumps(CHUNK)}\n\n".encode() * 64
            try:
                while True:
                    await resp.write(chunk)
            except (ConnectionError, asyncio.CancelledError):
                self.gone_at = time.monotonic()
                raise
        if b == "eof":  # a clean end of the HTTP body, but the SSE stream never finished
            await resp.write_eof()
            return resp
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


async def _serve(app: web.Application) -> tuple[web.AppRunner, int]:
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]


async def _upstream(behaviour: str) -> Upstream:
    up = Upstream(behaviour)
    app = web.Application()
    app.router.add_post("/v1/completions", up.handle)
    app.router.add_post("/v1/chat/completions", up.handle)
    app.router.add_get("/ready", up.ready)
    up.runner, up.port = await _serve(app)
    return up


@dataclass
class Fleet:
    gateway: Gateway
    url: str
    upstreams: list[Upstream]
    runner: web.AppRunner


@pytest.fixture
async def make_fleet() -> AsyncIterator[Callable]:
    made: list[Fleet] = []

    async def factory(
        behaviours: list[str],
        probe_s: float | None = None,
        credentials: Credentials | None = None,
        dead_after_s: float = 10.0,
        **proxy_kw,
    ) -> Fleet:
        ups = [await _upstream(b) for b in behaviours]
        router = Router(
            discovery=StaticDiscovery(
                [u.url for u in ups],
                probe_interval_s=probe_s,
                probe_timeout_s=probe_s or 1.0,
                dead_after_s=dead_after_s,
            ),
            policy=make_policy("round_robin"),
            seed=0,
        )
        gw = Gateway(
            router=router,
            tokenizer=None,
            served_model_name="tiny",
            proxy=ProxySettings(**proxy_kw),
            credentials=credentials or Credentials(),
        )
        runner, port = await _serve(gw.make_app())
        fleet = Fleet(gw, f"http://127.0.0.1:{port}", ups, runner)
        made.append(fleet)
        return fleet

    yield factory
    for f in made:
        await f.runner.cleanup()
        for u in f.upstreams:
            assert u.runner is not None
            await u.runner.cleanup()


def _is_openai_error(body: dict) -> bool:
    err = body.get("error")
    return isinstance(err, dict) and isinstance(err.get("message"), str) and "type" in err


# -- streams that break -------------------------------------------------------------------


@pytest.mark.parametrize("behaviour", ["cut", "eof"])
async def test_broken_stream_ends_with_an_error_event_not_done(make_fleet, behaviour) -> None:
    fleet = await make_fleet([behaviour])
    async with (
        aiohttp.ClientSession() as s,
        s.post(fleet.url + "/v1/completions", json={"prompt": "hi", "stream": True}) as r,
    ):
        assert r.status == 200
        raw = await r.read()
    events = [e for e in raw.decode().split("\n\n") if e.strip()]
    assert b"[DONE]" not in raw
    assert len(events) == 4, events  # 3 chunks, then the error
    last = json.loads(events[-1].removeprefix("data: "))
    assert _is_openai_error(last) and last["error"]["code"] == "upstream_stream_broken"
    # The official client raises instead of returning a short answer as if complete.
    client = openai.AsyncOpenAI(base_url=fleet.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.APIError, match="incomplete"):
        async for _ in await client.completions.create(model="tiny", prompt="hi", stream=True):
            pass
    await client.close()


async def test_cut_non_streamed_answer_retries_then_502s(make_fleet) -> None:
    fleet = await make_fleet(["cut", "ok"])
    async with aiohttp.ClientSession() as s:
        for _ in range(2):  # one of the two starts on the cutting pod and moves on
            async with s.post(fleet.url + "/v1/completions", json={"prompt": "hi"}) as r:
                assert r.status == 200 and (await r.json()) == DONE_BODY
        fleet.upstreams[1].behaviour = "cut"
        async with s.post(fleet.url + "/v1/completions", json={"prompt": "hi"}) as r:
            assert r.status == 502
            assert _is_openai_error(await r.json())


# -- hangs --------------------------------------------------------------------------------


async def test_hang_before_first_byte_moves_on_and_marks_the_pod(make_fleet) -> None:
    fleet = await make_fleet(["hang", "ok"], first_byte_timeout_s=0.5)
    hung = fleet.upstreams[0]
    async with aiohttp.ClientSession() as s:
        for _ in range(2):  # round robin: one of the two starts on the hung pod
            t0 = time.monotonic()
            async with s.post(
                fleet.url + "/v1/completions", json={"prompt": "hi", "stream": True}
            ) as r:
                assert r.status == 200 and r.headers[POD_HEADER] == fleet.upstreams[1].pod
                assert (await r.read()).endswith(b"data: [DONE]\n\n")
            assert time.monotonic() - t0 < 2.0
        # The hung pod is skipped now (round robin would pick it for every other one).
        for _ in range(4):
            async with s.post(fleet.url + "/v1/completions", json={"prompt": "hi"}) as r:
                assert r.status == 200
    assert hung.hits == 1


async def test_one_requests_timeout_does_not_cut_the_pods_other_streams(make_fleet) -> None:
    # A request queued in a busy pod past the first-byte timeout fails alone: the stream
    # the pod is sending meanwhile completes (it was cut when a timeout counted as a hang
    # of the whole pod), and the pod is ranked last for new requests.
    fleet = await make_fleet(["ok"], first_byte_timeout_s=0.3)
    up = fleet.upstreams[0]
    up.chunks, up.gap_s = 10, 0.08
    async with aiohttp.ClientSession() as s:

        async def flowing() -> bytes:
            body = {"prompt": "hi", "stream": True}
            async with s.post(fleet.url + "/v1/completions", json=body) as r:
                assert r.status == 200
                return await r.read()

        async def queued() -> int:
            await asyncio.sleep(0.1)  # the other stream is flowing by now
            body = {"prompt": "hang", "stream": True}
            async with s.post(fleet.url + "/v1/completions", json=body) as r:
                await r.read()
                return r.status

        raw, status = await asyncio.gather(flowing(), queued())
    assert status == 504
    assert raw.endswith(b"data: [DONE]\n\n") and b"upstream_stream_broken" not in raw
    assert fleet.gateway.metrics.unhealthy.labels(pod=up.pod)._value.get() == 1
    assert up.pod in fleet.gateway.router._ejected


async def test_non_streamed_request_past_its_timeout_is_a_504_not_re_sent(make_fleet) -> None:
    # A long generation that outlasts --request-timeout was re-sent to the next pod with
    # the same budget: the work and the wait again, up to --max-attempts times.
    fleet = await make_fleet(["hang", "hang"], request_timeout_s=0.4)
    async with aiohttp.ClientSession() as s:
        t0 = time.monotonic()
        async with s.post(fleet.url + "/v1/completions", json={"prompt": "hi"}) as r:
            assert r.status == 504
            body = await r.json()
            pod = r.headers.get(POD_HEADER)
        took = time.monotonic() - t0
    assert sum(u.hits for u in fleet.upstreams) == 1
    assert took < 0.8
    assert _is_openai_error(body) and body["error"]["code"] == "upstream_timeout"
    assert pod in [u.pod for u in fleet.upstreams]  # the pod that did not answer
    assert fleet.gateway.metrics.responses.labels(pod=pod, code="504")._value.get() == 1


@pytest.mark.parametrize("stream", [True, False])
async def test_a_503_whose_body_stalls_moves_on_in_bounded_time(make_fleet, stream) -> None:
    # The 503's body was awaited with no timeout: the request hung for as long as the pod.
    fleet = await make_fleet(["503stall", "ok"], first_byte_timeout_s=0.5)
    async with aiohttp.ClientSession() as s:
        for _ in range(2):  # round robin: one of the two starts on the stalling pod
            t0 = time.monotonic()
            async with (
                asyncio.timeout(3.0),
                s.post(fleet.url + "/v1/completions", json={"prompt": "hi", "stream": stream}) as r,
            ):
                assert r.status == 200 and r.headers[POD_HEADER] == fleet.upstreams[1].pod
                await r.read()
            assert time.monotonic() - t0 < 2.0
    assert fleet.upstreams[0].hits == 1


async def test_stall_mid_stream_is_detected_at_the_inter_chunk_timeout(make_fleet) -> None:
    fleet = await make_fleet(["stall"], inter_chunk_timeout_s=0.5)
    async with aiohttp.ClientSession() as s:
        t0 = time.monotonic()
        async with s.post(
            fleet.url + "/v1/completions", json={"prompt": "hi", "stream": True}
        ) as r:
            raw = await r.read()
        took = time.monotonic() - t0
    assert 0.5 <= took < 1.5
    assert b"[DONE]" not in raw and b"upstream_stream_broken" in raw


async def test_probe_releases_requests_waiting_on_a_frozen_pod(make_fleet) -> None:
    fleet = await make_fleet(["ok", "ok"], probe_s=0.2, dead_after_s=0.6, request_timeout_s=30.0)
    frozen = fleet.upstreams[0]
    async with aiohttp.ClientSession() as s:
        frozen.behaviour, frozen.ready_hang = "hang", True
        t0 = time.monotonic()
        results = await asyncio.gather(
            *(s.post(fleet.url + "/v1/completions", json={"prompt": "hi"}) for _ in range(4))
        )
        took = time.monotonic() - t0
        assert [r.status for r in results] == [200] * 4
        # Two probe misses at 0.2 s: the waiting requests moved on in about a second, not
        # after the 30 s request timeout.
        assert took < 2.0
        assert fleet.gateway.router.discovery.is_unreachable(frozen.pod)  # type: ignore[attr-defined]
        # Counted, and the count kept: the pod is still one of the fleet's (its series was
        # dropped as soon as its released requests ended, so no scrape could see it).
        async with s.get(fleet.url + "/metrics") as r:
            metrics = await r.text()
        assert f'pagefleet_gateway_pod_unhealthy_total{{pod="{frozen.pod}"}} 1.0' in metrics
        assert frozen.pod not in [e.pod for e in fleet.gateway.router.discovery.endpoints()]
        # It comes back when it answers again.
        frozen.behaviour, frozen.ready_hang = "ok", False
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            if len(fleet.gateway.router.discovery.endpoints()) == 2:
                break
            await asyncio.sleep(0.05)
        assert len(fleet.gateway.router.discovery.endpoints()) == 2


async def test_a_pod_that_misses_probes_while_busy_keeps_its_requests(make_fleet) -> None:
    """A saturated pod answers /ready late, while its streams still flow. Two missed probes
    cut every request waiting on it (a stream ended with an error event, a non-streamed
    one was sent again to another pod, or was a 502 when none was left): 268 of 1000 on
    two busy daemons. Now they only stop new routing to it; its open requests finish, and
    the pod is routed to again once it answers."""
    fleet = await make_fleet(
        ["slow", "slow"], probe_s=0.2, dead_after_s=30.0, request_timeout_s=30.0
    )
    busy, other = fleet.upstreams
    for up in fleet.upstreams:
        up.chunks, up.gap_s = 10, 0.3  # 3 s of work per request, the probes at 0.2 s
    discovery = fleet.gateway.router.discovery

    def routed() -> list[str]:
        return [e.pod for e in discovery.endpoints()]

    async with aiohttp.ClientSession() as s:

        async def request(stream: bool) -> tuple[str, bytes]:
            body = {"prompt": "hi", "stream": stream}
            async with s.post(fleet.url + "/v1/completions", json=body) as r:
                assert r.status == 200
                return r.headers[POD_HEADER], await r.read()

        tasks = [asyncio.create_task(request(stream)) for stream in (True, True, False, False)]
        async with asyncio.timeout(10):
            while busy.hits < 2:  # round robin: two of the four are there
                await asyncio.sleep(0.02)
            busy.ready_hang = True  # now it misses its probes while it works
            while routed() != [other.pod]:
                await asyncio.sleep(0.02)
        pending_when_out = sum(not t.done() for t in tasks)
        outs = await asyncio.gather(*tasks)
    for _, raw in outs:
        if raw.startswith(b"data: "):
            assert raw.endswith(b"data: [DONE]\n\n") and b"upstream_stream_broken" not in raw
        else:
            assert json.loads(raw) == DONE_BODY
    assert sum(pod == busy.pod for pod, _ in outs) == 2
    assert busy.hits == 2 and other.hits == 2  # nothing was sent twice
    assert pending_when_out == 4  # the probe judged the pod while its requests were open
    assert fleet.gateway.metrics.unhealthy.labels(pod=busy.pod)._value.get() == 0
    busy.ready_hang = False
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and len(routed()) < 2:
        await asyncio.sleep(0.05)
    assert routed() == [busy.pod, other.pod]


async def test_draining_pod_is_dropped_without_cancelling_its_requests(make_fleet) -> None:
    fleet = await make_fleet(["ok", "ok"], probe_s=0.1)
    fleet.upstreams[0].ready_status = 503
    # Two probes at 0.1 s must see the 503: wait for that, not for a fixed 0.4 s that a
    # loaded machine can outlast.
    want = [fleet.upstreams[1].pod]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if [e.pod for e in fleet.gateway.router.discovery.endpoints()] == want:
            break
        await asyncio.sleep(0.02)
    assert [e.pod for e in fleet.gateway.router.discovery.endpoints()] == want
    assert fleet.gateway.metrics.unhealthy.labels(pod=fleet.upstreams[0].pod)._value.get() == 0


# -- limits -------------------------------------------------------------------------------


async def _expect_continue(url: str, length: int, body: bytes = b"") -> tuple[bytes, bytes]:
    """A POST announcing ``length`` body bytes with ``Expect: 100-continue``, as curl sends a
    large upload: the first status line the gateway sends back, then the rest it sends
    after ``body`` (nothing: the client waits, as RFC 9110 lets it, for that answer)."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {length}\r\nExpect: 100-continue\r\n\r\n".encode()
        )
        async with asyncio.timeout(5):
            first = await reader.readline()
            if body:
                await reader.readline()  # the blank line after the 100
                writer.write(body)
            rest = await reader.read(65536)
        return first, rest
    finally:
        writer.close()


async def test_expect_100_continue_gets_the_refusal_before_the_body_is_sent(make_fleet) -> None:
    """aiohttp answered every ``Expect: 100-continue`` with a 100 before the gateway saw the
    headers: a client announcing a body over the cap (or over what the body budget or the
    concurrency limit has left) was told to send it all, only to get the 413/503/429 after.
    Those refusals now go out instead of the 100, and the connection closes (the body the
    client may still send is not read)."""
    fleet = await make_fleet(["ok"], max_body_bytes=4096, max_inflight_body_mb=1)
    first, rest = await _expect_continue(fleet.url, 5000)
    assert first.startswith(b"HTTP/1.1 413"), first
    assert b'"code":"request_too_large"' in rest.replace(b" ", b"")
    # Over the body budget (1 MiB): another request holds all but 100 bytes of it.
    fleet.gateway._bodies.held = fleet.gateway._bodies.limit - 100
    first, rest = await _expect_continue(fleet.url, 4000)
    assert first.startswith(b"HTTP/1.1 503"), first
    assert b'"code":"overloaded"' in rest.replace(b" ", b"")
    fleet.gateway._bodies.held = 0
    # Within every limit: the 100, then the body, then the answer.
    body = json.dumps({"prompt": "hi"}).encode()
    first, rest = await _expect_continue(fleet.url, len(body), body)
    assert first.startswith(b"HTTP/1.1 100"), first
    assert rest.startswith(b"HTTP/1.1 200"), rest[:200]


async def test_body_over_the_cap_is_a_413_in_openai_shape(make_fleet) -> None:
    fleet = await make_fleet(["ok"], max_body_bytes=4096)
    big = json.dumps({"prompt": "a" * 5000}).encode()

    async def chunked():  # no Content-Length: the cap must hold while reading too
        for i in range(0, len(big), 1000):
            yield big[i : i + 1000]

    async with aiohttp.ClientSession() as s:
        for data in (big, chunked()):
            async with s.post(fleet.url + "/v1/completions", data=data) as r:
                assert r.status == 413
                body = await r.json()
                assert _is_openai_error(body) and body["error"]["code"] == "request_too_large"
    assert fleet.upstreams[0].hits == 0


async def test_concurrency_limit_answers_429_with_retry_after(make_fleet) -> None:
    fleet = await make_fleet(["stall"], max_concurrency=2, inter_chunk_timeout_s=5)
    async with aiohttp.ClientSession() as s:
        held = [
            await s.post(fleet.url + "/v1/completions", json={"prompt": "hi", "stream": True})
            for _ in range(2)
        ]
        async with s.post(fleet.url + "/v1/completions", json={"prompt": "hi"}) as r:
            assert r.status == 429 and r.headers["Retry-After"] == "1"
            assert (await r.json())["error"]["code"] == "gateway_busy"
        async with s.get(fleet.url + "/health") as r:
            assert r.status == 200
        for h in held:
            h.close()


async def _raw(url: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = url.removeprefix("http://").split(":")
    return await asyncio.open_connection(host, int(port))


async def test_a_body_sent_slowly_is_a_408_that_frees_its_admission_slot(make_fleet) -> None:
    """Slowloris on the body: headers promise 1000 bytes, 10 arrive, then a byte a while.
    The gateway waited for the rest forever, holding one of its ``max_concurrency`` slots:
    that many such connections refused every real client with 429s."""
    fleet = await make_fleet(["ok"], max_concurrency=1, body_timeout_s=0.5)
    reader, writer = await _raw(fleet.url)
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    writer.write(head + b"Content-Length: 1000\r\n\r\n" + b'{"prompt":')
    t0 = time.monotonic()

    async def trickle() -> None:
        with contextlib.suppress(ConnectionError):
            for _ in range(100):
                await asyncio.sleep(0.2)
                writer.write(b" ")
                await writer.drain()

    dribble = asyncio.create_task(trickle())
    try:
        async with asyncio.timeout(5):
            answer = await reader.read(4096)
        took = time.monotonic() - t0
        status_line, _, rest = answer.partition(b"\r\n")
        assert status_line.split()[1] == b"408", answer
        body = json.loads(rest.partition(b"\r\n\r\n")[2])
        assert _is_openai_error(body) and body["error"]["code"] == "request_timeout"
        assert took < 2.0, f"answered after {took:.2f}s for a 0.5s body timeout"
        # The slot is free again: a real client is served, not refused with a 429.
        async with (
            aiohttp.ClientSession() as s,
            s.post(fleet.url + "/v1/completions", json={"prompt": "hi"}) as r,
        ):
            assert r.status == 200, await r.text()
        assert fleet.upstreams[0].hits == 1
    finally:
        dribble.cancel()
        writer.close()


async def test_a_client_that_stops_reading_a_stream_is_cut_and_its_pod_request_ended(
    make_fleet,
) -> None:
    """A client that opens a stream and never reads it: the gateway's write to it blocks
    once the socket buffers fill, so it stops reading the pod, whose write blocks in turn.
    Nothing timed that out: the pod's sequence and the gateway's slot stayed taken for as
    long as the client kept the connection open."""
    fleet = await make_fleet(["flood"], client_write_timeout_s=0.5, inter_chunk_timeout_s=30)
    up = fleet.upstreams[0]
    host, port = fleet.url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # fills fast
    sock.connect((host, int(port)))
    sock.setblocking(False)
    reader, writer = await asyncio.open_connection(sock=sock)
    body = json.dumps({"prompt": "hi", "stream": True}).encode()
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    first = await reader.read(200)  # the stream has begun; now stop reading
    assert first.startswith(b"HTTP/1.1 200"), first
    reader._transport.pause_reading()  # type: ignore[attr-defined]
    t0 = time.monotonic()
    try:
        deadline = t0 + 10
        while time.monotonic() < deadline and up.gone_at is None:
            await asyncio.sleep(0.05)
        assert up.gone_at is not None, "the pod's request is still open 10s later"
        assert up.gone_at - t0 < 5
        while time.monotonic() < deadline and fleet.gateway.router.inflight:
            await asyncio.sleep(0.05)
        assert fleet.gateway.router.inflight == {}
        # Counted as a cut, once, which an operator can tell from a client hanging up.
        assert _cuts(fleet) == 1
    finally:
        writer.close()


def _cuts(fleet: Fleet) -> float:
    """pagefleet_gateway_client_cuts_total{reason="write_timeout"}."""
    return fleet.gateway.metrics.client_cuts.labels(reason="write_timeout")._value.get()


async def test_a_client_that_does_not_read_a_long_answer_is_cut(make_fleet) -> None:
    """A non-streamed answer larger than the socket buffers, to a client that never
    reads it: the write waited for it without a bound, holding the connection and the
    whole answer in the gateway's memory for as long as the client stayed connected."""
    fleet = await make_fleet(["big"], client_write_timeout_s=0.5)
    writer = await open_unread(fleet.url, {"prompt": "hi"})
    server = fleet.runner.server
    assert server is not None
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and server.connections:
            await asyncio.sleep(0.05)
        assert not server.connections, "the gateway still holds the connection 10s later"
        assert _cuts(fleet) == 1
    finally:
        writer.close()


async def test_many_clients_cut_at_once_are_each_counted_and_warned_about_once(
    make_fleet, caplog
) -> None:
    """A cut was logged at debug only: under a crowd of stalled readers (or an attack)
    the operator saw nothing, nor could alert on it. Each cut is counted now, and the
    warning is rate-limited: one line, not one per request."""
    caplog.set_level(logging.WARNING, logger="pagefleet.gateway.server")
    fleet = await make_fleet(["big"], client_write_timeout_s=0.5)
    writers = [await open_unread(fleet.url, {"prompt": "hi"}) for _ in range(4)]
    server = fleet.runner.server
    assert server is not None
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and server.connections:
            await asyncio.sleep(0.05)
        assert not server.connections, "the gateway still holds connections 10s later"
        assert _cuts(fleet) == 4
        lines = [m for r in caplog.records if "--client-write-timeout" in (m := r.getMessage())]
        assert len(lines) == 1, lines
    finally:
        for writer in writers:
            writer.close()


async def test_an_answer_over_the_response_cap_is_a_502_not_buffered_whole(make_fleet) -> None:
    """A non-streamed answer is read whole before its status goes out (so a cut one is a
    retry or a 502, never a truncated 200). Unbounded, a pod's huge (or endless) answer was
    buffered whole: one such response per request could exhaust the gateway's memory."""
    fleet = await make_fleet(["big", "big"], max_response_bytes=1 << 20)
    async with aiohttp.ClientSession() as s:
        async with s.post(fleet.url + "/v1/completions", json={"prompt": "hi"}) as r:
            assert r.status == 502, r.status
            body = await r.json()
            assert _is_openai_error(body)
            assert body["error"]["code"] == "upstream_response_too_large"
            assert "stream" in body["error"]["message"]
        # Final, not retried: every pod would compute the same answer.
        assert sum(u.hits for u in fleet.upstreams) == 1
        streamed = {"prompt": "hi", "stream": True}
        async with s.post(fleet.url + "/v1/completions", json=streamed) as r:
            assert r.status == 200 and (await r.read()).endswith(b"data: [DONE]\n\n")
        async with s.get(fleet.url + "/health") as r:
            assert r.status == 200


async def test_a_model_this_gateway_does_not_serve_is_a_404_that_reaches_no_pod(
    make_fleet,
) -> None:
    """A request for another service's model was routed, counted and sent to a daemon,
    which refused it: a pod round trip (and a slot) per request a client could point at any
    name. The gateway serves one model and answers as the daemon would, itself."""
    fleet = await make_fleet(["ok"])
    client = openai.AsyncOpenAI(base_url=fleet.url + "/v1", api_key="x", max_retries=0)
    try:
        with pytest.raises(openai.NotFoundError) as exc:
            await client.completions.create(model="gpt-4", prompt="hi", max_tokens=2)
        body = exc.value.body
        assert isinstance(body, dict) and body["code"] == "model_not_found", body
        assert body["param"] == "model" and "`tiny`" in body["message"]
        with pytest.raises(openai.NotFoundError):
            await client.chat.completions.create(
                model="other", messages=[{"role": "user", "content": "hi"}], stream=True
            )
        assert fleet.upstreams[0].hits == 0
        ok = await client.completions.create(model="tiny", prompt="hi", max_tokens=2)
        assert ok.choices[0].text == "ok" and fleet.upstreams[0].hits == 1
    finally:
        await client.close()


async def test_unknown_route_and_bad_json_are_openai_shaped(make_fleet) -> None:
    fleet = await make_fleet(["ok"])
    async with aiohttp.ClientSession() as s:
        for method, path, data in (
            ("GET", "/nope", None),
            ("GET", "/v1/completions", None),
            ("POST", "/v1/completions", b"{not json"),
        ):
            async with s.request(method, fleet.url + path, data=data) as r:
                assert 400 <= r.status < 500
                assert _is_openai_error(await r.json())
        async with s.get(fleet.url + "/openapi.json") as r:
            doc = await r.json()
            assert "/v1/completions" in doc["paths"]


async def test_compressed_bodies_are_forwarded_decoded_and_undecodable_ones_are_400s(
    make_fleet,
) -> None:
    fleet = await make_fleet(["ok"])
    body = json.dumps({"prompt": "hi", "max_tokens": 1}).encode()
    gz = {"Content-Encoding": "gzip", "Content-Type": "application/json"}
    async with aiohttp.ClientSession() as s:
        # aiohttp decodes the body on read: forwarding it still marked gzip made the daemon
        # fail to decompress plain JSON (a 500 for a request the daemon itself accepts).
        async with s.post(fleet.url + "/v1/completions", data=gzip.compress(body), headers=gz) as r:
            assert r.status == 200, await r.text()
        sent = {k.lower() for k in fleet.upstreams[0].headers[-1]}
        assert "content-encoding" not in sent
        hits = fleet.upstreams[0].hits
        async with s.post(fleet.url + "/v1/completions", data=body, headers=gz) as r:
            assert r.status == 400
            err = (await r.json())["error"]
            assert "Content-Encoding" in err["message"], err
        assert fleet.upstreams[0].hits == hits


async def test_token_ids_no_model_has_are_a_400_and_a_bug_is_an_openai_shaped_500(
    make_fleet, monkeypatch
) -> None:
    # The block hashes pack ids in 32 bits: 2**32 in a full block was a struct.error and a
    # plain-text 500 ("Server got itself in trouble").
    refused = inspect("completion", json.dumps({"prompt": [1] * 15 + [2**32]}).encode(), None, None)
    assert refused.error is not None and refused.error.status == 400
    assert refused.error.param == "prompt"
    fleet = await make_fleet(["ok"])

    async def broken(*_a, **_k):
        raise RuntimeError("a bug")

    monkeypatch.setattr(Router, "route", broken)  # slots: patched on the class
    async with (
        aiohttp.ClientSession() as s,
        s.post(fleet.url + "/v1/completions", json={"prompt": "hi"}) as r,
    ):
        assert r.status == 500
        body = await r.json()
        assert _is_openai_error(body) and body["error"]["type"] == "server_error"


# -- API keys -----------------------------------------------------------------------------


async def test_api_keys(make_fleet) -> None:
    creds = Credentials.from_keys(["k1", "k2"])
    fleet = await make_fleet(["ok"], credentials=creds)
    url = fleet.url + "/v1/completions"
    async with aiohttp.ClientSession() as s:
        for auth in (None, "Bearer nope", "Basic k1", "Bearer "):
            headers = {"Authorization": auth} if auth else {}
            async with s.post(url, json={"prompt": "hi"}, headers=headers) as r:
                assert r.status == 401
                body = await r.json()
                assert _is_openai_error(body) and body["error"]["code"] == "invalid_api_key"
        async with s.post(url, json={"prompt": "hi"}, headers={"Authorization": "Bearer k2"}) as r:
            assert r.status == 200
        for path in ("/health", "/ready", "/metrics"):
            async with s.get(fleet.url + path) as r:
                assert r.status == 200
    # The client's key is the gateway's business, never forwarded to a daemon.
    assert "Authorization" not in fleet.upstreams[0].headers[0]
    client = openai.AsyncOpenAI(base_url=fleet.url + "/v1", api_key="k1", max_retries=0)
    out = await client.completions.create(model="tiny", prompt="hi")
    assert out.choices[0].text == "ok"
    client.api_key = "wrong"
    with pytest.raises(openai.AuthenticationError):
        await client.completions.create(model="tiny", prompt="hi")
    await client.close()


async def test_a_pod_refusing_the_gateways_key_is_not_blamed_on_the_client(
    make_fleet, caplog
) -> None:
    """The daemons require a key and the gateway's (PAGEFLEET_UPSTREAM_API_KEY) is missing
    or stale: each pod's 401 "incorrect API key provided" reached the client, whose key the
    gateway had just accepted, so users rotated good keys while the gateway logged nothing.
    Now a 502 (the openai client's AuthenticationError would blame the client's key) whose
    body says whose key failed."""
    fleet = await make_fleet(["keyed", "keyed"], credentials=Credentials.from_keys(["k1"]))
    client = openai.AsyncOpenAI(base_url=fleet.url + "/v1", api_key="k1", max_retries=0)
    try:
        for _ in range(2):
            with pytest.raises(openai.InternalServerError) as exc:
                await client.completions.create(model="tiny", prompt="hi")
            assert exc.value.status_code == 502
            body = exc.value.body
            assert isinstance(body, dict) and body["code"] == "upstream_auth_failed", body
            assert "not the client's" in body["message"], body
    finally:
        await client.close()
    # Not re-sent to the other pod (they share the key) and said once in the log.
    assert sum(u.hits for u in fleet.upstreams) == 2
    hints = [r for r in caplog.records if "PAGEFLEET_UPSTREAM_API_KEY" in r.getMessage()]
    assert len(hints) == 1, [r.getMessage() for r in caplog.records]


def test_credentials_from_env_files_and_hashing(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("# clients\nalpha\n\n beta \n")
    admin = tmp_path / "admin"
    admin.write_text("root-token\n")
    creds = Credentials.from_env(
        {
            "PAGEFLEET_API_KEYS": "gamma, ",
            "PAGEFLEET_API_KEYS_FILE": str(keys),
            "PAGEFLEET_ADMIN_TOKEN_FILE": str(admin),
        }
    )
    assert all(creds.is_client(k) for k in ("alpha", "beta", "gamma"))
    assert not creds.is_client("root-token") and creds.is_admin("root-token")
    assert not creds.is_client("alph") and not creds.is_client("")
    # Only digests are kept: no key appears in the object's state.
    assert b"alpha" not in repr(creds).encode() and all(len(d) == 32 for d in creds.client)
    with pytest.raises(ValueError, match="cannot read"):
        Credentials.from_env({"PAGEFLEET_API_KEYS_FILE": str(tmp_path / "missing")})
    assert not Credentials.from_env({}).enabled


# -- routing on untrusted index values ------------------------------------------------------


def test_forged_heartbeats_are_dropped_or_clamped() -> None:
    """The gateway applies kvindex's one range check to whatever a backend returns (the
    memory backend hands back the objects it was given)."""
    for forged in (
        PodLoad(running=-1_000_000),
        PodLoad(kv_usage=float("nan")),
        PodLoad(running="0"),  # type: ignore[arg-type]
        PodLoad(ts=time.time() + 3600),
    ):
        with pytest.raises(ValueError, match="heartbeat"):
            forged.checked()
    ok = PodLoad(running=10**15, waiting=3, kv_usage=7.0).checked()
    assert ok.running == MAX_COUNT and ok.waiting == 3 and ok.kv_usage == 1.0


async def test_router_drops_a_forged_heartbeat_from_the_memory_index() -> None:
    index = MemoryKVIndex("ns")
    router = Router(
        discovery=StaticDiscovery(["http://127.0.0.1:1", "http://127.0.0.1:2"]),
        policy=make_policy("least_load"),
        index=index,
        seed=0,
    )
    await index.heartbeat("127.0.0.1:1", PodLoad(running=-5, waiting=-5), ttl_s=60)
    await index.heartbeat("127.0.0.1:2", PodLoad(running=5, waiting=5), ttl_s=60)
    await router.refresh_loads()
    # Clamped to zero the forged pod would look idle and rank first; dropped, it has no
    # live heartbeat and ranks after the honest, busier pod.
    decision = await router.route([1, 2, 3])
    assert [s.endpoint.pod for s in decision.ranked] == ["127.0.0.1:2", "127.0.0.1:1"]


async def test_pods_without_heartbeat_rank_after_live_ones_and_lookups_are_clamped() -> None:
    index = MemoryKVIndex("ns")
    router = Router(
        discovery=StaticDiscovery(["http://127.0.0.1:1", "http://127.0.0.1:2"]),
        policy=make_policy("least_load"),
        index=index,
        seed=0,
    )
    await index.heartbeat("127.0.0.1:2", PodLoad(running=5, waiting=5), ttl_s=60)
    await router.refresh_loads()
    for _ in range(10):
        # Pod 1 has no heartbeat (frozen or gone): it must not look idle.
        decision = await router.route([1, 2, 3])
        assert [s.endpoint.pod for s in decision.ranked] == ["127.0.0.1:2", "127.0.0.1:1"]

    class Forged(MemoryKVIndex):
        async def lookup(self, block_hashes: list[int]) -> dict[str, int]:
            return {"127.0.0.1:1": 10**9, "127.0.0.1:2": -5}

    router.index = Forged("ns")
    matched, ok = await router.lookup([1, 2, 3])
    assert ok and matched == {"127.0.0.1:1": 3}
    # And a forged full hit cannot pin traffic on a swamped pod: the imbalance guard spills.
    policy = make_policy("cache_aware")
    eps = router.discovery.endpoints()
    ranked = policy.rank(
        [
            Candidate(eps[0], matched_blocks=3, inflight=20, prefilling=20),
            Candidate(eps[1], matched_blocks=0, inflight=0),
        ],
        RouteRequest(prompt_tokens=48, block_size=16),
        __import__("random").Random(0),
    )
    assert ranked[0].endpoint == eps[1]


# -- the event loop stays free while a maximal request is handled --------------------------


def _spawn_gateway(
    port: int,
    upstream: str,
    workers: int,
    log: Path,
    extra: tuple[str, ...] = (),
    preexec_fn: Callable[[], None] | None = None,
) -> subprocess.Popen:
    argv = [
        sys.executable, "-m", "pagefleet.cli", "gateway", "--host", "127.0.0.1",
        "--port", str(port), "--endpoints", upstream, "--policy", "least_load",
        "--model", "tiny", "--max-model-len", "4096", "--intake-workers", str(workers),
        "--probe-interval", "0", *extra,
    ]  # fmt: skip
    return subprocess.Popen(
        argv, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=os.environ, preexec_fn=preexec_fn
    )


async def _probe_health(
    s: aiohttp.ClientSession, url: str, until: Callable[[], bool]
) -> list[float]:
    lat: list[float] = []
    while not until():
        t = time.perf_counter()
        async with s.get(url + "/health") as r:
            assert r.status == 200
        lat.append(time.perf_counter() - t)
        await asyncio.sleep(0.01)
    return lat


async def _during_big_request(url: str, body: bytes) -> tuple[list[float], list[float]]:
    """/health latencies while ``body`` is handled, and while idle for as long."""
    async with aiohttp.ClientSession() as s:
        t0 = time.monotonic()
        big = asyncio.create_task(
            s.post(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
        )
        busy = await _probe_health(s, url, big.done)
        took = time.monotonic() - t0
        resp = await big
        assert resp.status == 400 and _is_openai_error(await resp.json())
        resp.close()
        t1 = time.monotonic()
        idle = await _probe_health(s, url, lambda: time.monotonic() - t1 > min(took, 3.0))
    return busy, idle


async def _warm(url: str) -> None:
    """Wait until the intake workers are up (a body large enough to go to one each)."""
    medium = json.dumps({"prompt": [7] * 20_000}).encode()
    async with aiohttp.ClientSession() as s:
        for r in await asyncio.gather(
            *(s.post(url + "/v1/completions", data=medium) for _ in range(2))
        ):
            assert r.status == 400
            r.close()


async def _wait_ready(url: str, log: Path) -> None:
    deadline = time.monotonic() + 90
    async with aiohttp.ClientSession() as s:
        while True:
            try:
                async with s.get(url + "/ready") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            assert time.monotonic() < deadline, log.read_text()
            await asyncio.sleep(0.1)


async def test_health_answers_within_50ms_while_a_maximal_request_is_handled(tmp_path) -> None:
    up = await _upstream("ok")
    # The worst body within the 4 MiB cap for the parser: ~2M token ids (refused as too long
    # for the context once parsed).
    n = ((4 << 20) - 64) // 2
    body = b'{"model":"tiny","prompt":[' + b",".join([b"7"] * n) + b"]}"
    assert len(body) <= 4 << 20
    results: dict[int, tuple[list[float], list[float]]] = {}
    try:
        for workers in (2, 0):  # 0: the old inline intake, the control
            port = free_port()
            log = tmp_path / f"gw{workers}.log"
            proc = _spawn_gateway(port, up.url, workers, log)
            url = f"http://127.0.0.1:{port}"
            try:
                await _wait_ready(url, log)
                await _warm(url)
                results[workers] = await _during_big_request(url, body)
            finally:
                proc.terminate()
                proc.wait(10)
    finally:
        assert up.runner is not None
        await up.runner.cleanup()
    busy, idle = results[2]
    p95 = statistics.quantiles(busy, n=20)[-1]
    print(
        f"\nHEALTH during a 4 MiB request: {len(busy)} probes, p95 {p95 * 1000:.1f} ms, max "
        f"{max(busy) * 1000:.1f} ms (idle max {max(idle) * 1000:.1f} ms); inline intake max "
        f"{max(results[0][0]) * 1000:.0f} ms"
    )
    # The machine is shared (2 cores, load ~10 while this was written): a lone probe may
    # wait for a core whatever the gateway does. So: 99% of probes within 50 ms, none near
    # the stall of the inline intake, which the control measures (0.4-7 s seen here).
    slow = sum(t > 0.050 for t in busy)
    p99 = statistics.quantiles(busy, n=100)[-1]
    assert len(busy) >= 10 and p99 < 0.050 and slow <= max(1, len(busy) // 100), (p99, slow)
    assert max(busy) < 0.25, max(busy)
    assert max(results[0][0]) > 0.25 and max(results[0][0]) > 4 * max(busy)
    assert up.hits == 0


async def test_idle_and_half_sent_connections_close_at_the_keepalive_timeout(tmp_path) -> None:
    """aiohttp's only timer before a request starts is its keep-alive timeout, 3630 s by
    default: a connection that sent nothing, or headers it never finished (slowloris), or
    one left idle after a request, held a socket of the gateway process for an hour."""
    up = await _upstream("ok")
    port = free_port()
    log = tmp_path / "gw.log"
    proc = _spawn_gateway(port, up.url, 0, log, ("--keepalive-timeout", "1"))
    url = f"http://127.0.0.1:{port}"
    conns = []
    try:
        await _wait_ready(url, log)
        for sent in (
            b"",
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ",
            b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n",  # answered, then left idle
        ):
            reader, writer = await _raw(url)
            writer.write(sent)
            conns.append((reader, writer))
        t0 = time.monotonic()
        for reader, _ in conns:
            async with asyncio.timeout(5):
                await reader.read()  # returns at EOF: the gateway closed the connection
        took = time.monotonic() - t0
        assert took < 4, f"connections closed after {took:.1f}s for a 1s keep-alive timeout"
        assert proc.poll() is None, log.read_text()
    finally:
        for _, writer in conns:
            writer.close()
        proc.terminate()
        proc.wait(10)
        assert up.runner is not None
        await up.runner.cleanup()


def _low_open_files_limit() -> None:
    """A desktop's default soft limit on open files, in the child only (hard left as is)."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))


async def test_hundreds_of_open_connections_do_not_lock_out_new_clients(tmp_path) -> None:
    """The gateway ran with the soft open-files limit it inherited (1024 on most desktops,
    `pagefleet up`): that many client connections, idle or not, and accept() failed with
    EMFILE, so every new client, health probes included, waited in the backlog."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < 2048:
        pytest.skip(f"the hard open-files limit here is {hard}: no headroom to raise into")
    up = await _upstream("ok")
    port = free_port()
    log = tmp_path / "gw.log"
    proc = _spawn_gateway(port, up.url, 0, log, preexec_fn=_low_open_files_limit)
    url = f"http://127.0.0.1:{port}"
    conns = []
    try:
        await _wait_ready(url, log)
        async with asyncio.timeout(20):  # before: the backlog filled and connect() hung
            for _ in range(400):  # well past the inherited 256
                conns.append(await _raw(url))
        async with aiohttp.ClientSession() as s:
            async with asyncio.timeout(5), s.get(url + "/health") as r:
                assert r.status == 200
            async with (
                asyncio.timeout(5),
                s.post(url + "/v1/completions", json={"prompt": "hi"}) as r,
            ):
                assert r.status == 200, await r.text()
    finally:
        for _, writer in conns:
            writer.close()
        proc.terminate()
        proc.wait(10)
        assert up.runner is not None
        await up.runner.cleanup()
