"""The gateway's P/D leg against scripted stand-in pods (a review's findings).

- a client that leaves while its early remote prefill runs cancels that prefill (it ran to
  its end on the prefill pod, holding one of --pd-max-prefill-inflight slots);
- a request with several prompts is prefilled on the decode pod (a transfer handle carries
  one prompt: the prefill pod refused it with a 400, and that 400 ejected the pod);
- a frozen prefill pod (accepts connections, answers nothing) costs the client the
  gateway's --pd-prefill-timeout, not the decode pod's longer kv_transfer_timeout_s;
- a client's own kv_transfer_params are refused (they went to the daemons as sent: a
  decode pod then pulled from a host the client named, with the fleet's upstream key).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from pagefleet.dev.process import free_port

from .conftest import live_daemon
from .test_pd_fleet import MODEL, PROMPT, _config, _gateway

Script = Callable[["Pod", web.Request, dict[str, Any]], Awaitable[web.StreamResponse]]


class Pod:
    """A stand-in daemon: scripted generation endpoints; /v1/kv/* that log what they get."""

    def __init__(self, gen: Script) -> None:
        self.gen = gen
        self.log: list[tuple[str, Any]] = []
        self.release_s = 0.0  # how long a release takes to answer
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        app = web.Application()
        app.router.add_get("/ready", self._ready)
        app.router.add_post("/v1/completions", self._gen)
        app.router.add_post("/v1/chat/completions", self._gen)
        app.router.add_post("/v1/kv/release", self._release)
        app.router.add_post("/v1/kv/wait", self._wait)
        self.runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=1.0)

    async def _ready(self, _: web.Request) -> web.Response:
        return web.json_response({"ready": True})

    async def _gen(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.log.append(("gen", body))
        try:
            return await self.gen(self, request, body)
        except asyncio.CancelledError:
            self.log.append(("gen_cancelled", None))
            raise

    async def _release(self, request: web.Request) -> web.Response:
        self.log.append(("release", await request.json()))
        await asyncio.sleep(self.release_s)
        return web.json_response({"released": True})

    async def _wait(self, request: web.Request) -> web.Response:
        await asyncio.sleep(3600)
        return web.json_response({})

    async def __aenter__(self) -> Pod:
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.runner.cleanup()


async def _slow_prefill(pod: Pod, request: web.Request, body: dict[str, Any]) -> web.Response:
    await asyncio.sleep(3.0)  # a long prompt, or one queued behind others
    return web.json_response({"choices": [{"text": "x"}]})


async def _hang(pod: Pod, request: web.Request, body: dict[str, Any]) -> web.Response:
    await asyncio.sleep(3600)
    return web.json_response({})


async def _refuse(pod: Pod, request: web.Request, body: dict[str, Any]) -> web.Response:
    err = {"error": {"message": "needs one prompt", "type": "invalid_request_error"}}
    return web.json_response(err, status=400)


async def _answer(pod: Pod, request: web.Request, body: dict[str, Any]) -> web.Response:
    return web.json_response({
        "id": "c", "object": "text_completion", "created": 1, "model": MODEL,
        "choices": [{"index": 0, "text": "ok", "finish_reason": "length", "logprobs": None}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    })  # fmt: skip


async def test_a_client_that_leaves_cancels_its_early_prefill() -> None:
    async with Pod(_slow_prefill) as p, Pod(_hang) as d:
        gw, runner, url = await _gateway([p.url], [d.url])
        try:
            body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
            with pytest.raises(TimeoutError):
                async with (
                    aiohttp.ClientSession() as s,
                    asyncio.timeout(0.5),
                    s.post(url + "/v1/completions", json=body) as r,
                ):
                    await r.read()
            t0 = time.monotonic()
            while time.monotonic() - t0 < 2.0 and ("gen_cancelled", None) not in p.log:
                await asyncio.sleep(0.05)  # well before the prefill's own 3 s end
            assert ("gen_cancelled", None) in p.log, p.log
            ranked = (await gw.pd.prefill_router.route([1, 2, 3])).ranked
            assert [c.queue for c in ranked] == [0], "the abandoned prefill holds a slot"
        finally:
            await runner.cleanup()


async def test_several_prompts_are_prefilled_on_the_decode_pod_and_eject_nothing() -> None:
    async with Pod(_refuse) as p, Pod(_answer) as d:
        gw, runner, url = await _gateway([p.url], [d.url])
        try:
            body = {"model": MODEL, "prompt": [PROMPT, PROMPT + " again"], "max_tokens": 4}
            async with (
                aiohttp.ClientSession() as s,
                s.post(url + "/v1/completions", json=body) as r,
            ):
                assert r.status == 200
            await asyncio.sleep(0.2)
            assert not [b for w, b in p.log if w == "gen"], "sent for a remote prefill"
            assert not gw.pd.prefill_router._ejected
        finally:
            await runner.cleanup()


@pytest.mark.timeout(60)
async def test_a_frozen_prefill_pod_costs_the_gateways_prefill_timeout_only() -> None:
    # The decode pod, sent the request early, waits on the frozen pod's /v1/kv/wait; it
    # used to wait its own kv_transfer_timeout_s (12 s here, + 3 s of slack) before it
    # prefilled locally, though the gateway had given the prefill up at 5 s.
    cfg = _config("decode").model_copy(update={"kv_transfer_timeout_s": 12.0})
    async with Pod(_hang) as p, live_daemon(cfg) as d:
        _, runner, url = await _gateway([p.url], [d.url])  # pd_prefill_timeout_s 5
        try:
            body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
            t0 = time.monotonic()
            async with (
                aiohttp.ClientSession() as s,
                s.post(url + "/v1/completions", json=body) as r,
            ):
                assert r.status == 200, await r.text()
                out = await r.json()
            took = time.monotonic() - t0
            assert [w for w, _ in p.log][:1] == ["gen"], "no remote prefill was tried"
            assert out["usage"]["completion_tokens"] == 4
            assert took < 5.0 + 2.5, f"answered {took:.1f} s in, not at the 5 s prefill timeout"
        finally:
            await runner.cleanup()


@pytest.mark.parametrize("disaggregated", [True, False])
async def test_a_clients_kv_transfer_params_are_refused_and_reach_no_pod(
    disaggregated: bool,
) -> None:
    async with Pod(_answer) as p, Pod(_answer) as d:
        _, runner, url = await _gateway([p.url] if disaggregated else [], [d.url])
        try:
            forged = {"do_remote_prefill": True, "remote_host": "10.0.0.1", "remote_port": 80,
                      "remote_request_id": "x"}  # fmt: skip
            for path, body in (
                ("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 2}),
                ("/v1/chat/completions",
                 {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}]}),
            ):  # fmt: skip
                async with (
                    aiohttp.ClientSession() as s,
                    s.post(url + path, json={**body, "kv_transfer_params": forged}) as r,
                ):
                    assert r.status == 400, await r.text()
                    assert (await r.json())["error"]["param"] == "kv_transfer_params"
            assert not p.log and not d.log, "a pod was sent the client's transfer params"
        finally:
            await runner.cleanup()


async def _fail(pod: Pod, request: web.Request, body: dict[str, Any]) -> web.Response:
    return web.json_response({"error": {"message": "boom", "type": "server_error"}}, status=500)


async def test_a_client_leaving_while_a_failed_prefill_is_released_still_counts_it_once() -> None:
    """The early prefill fails and the gateway releases its handle; the client leaves while
    that release is under way. The release ran inside the prefill's task, which the client's
    departure cancels: it was cut off after claiming the handle's one release, so the
    handle was counted in pagefleet_gateway_pd_handles_released_total zero times (and the
    release could be cut before it was sent). Now it completes and counts once."""
    from .test_pd_fleet import _metric

    async with Pod(_fail) as p, Pod(_hang) as d:
        p.release_s = 1.0
        gw, runner, url = await _gateway([p.url], [d.url])
        try:
            body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
            with pytest.raises(TimeoutError):
                async with (
                    aiohttp.ClientSession() as s,
                    asyncio.timeout(0.5),  # the prefill failed at once; its release takes 1 s
                    s.post(url + "/v1/completions", json=body) as r,
                ):
                    await r.read()
            t0 = time.monotonic()
            while time.monotonic() - t0 < 5.0 and (gw.pd._prefills or gw.pd._releases):
                await asyncio.sleep(0.05)
            assert not gw.pd._prefills and not gw.pd._releases
            assert [w for w, _ in p.log] == ["gen", "release"], p.log
            name = "pagefleet_gateway_pd_handles_released_total"
            assert await _metric(url, name) == 1
            assert await _metric(url, name, result="released") == 1
        finally:
            await runner.cleanup()
