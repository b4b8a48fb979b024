"""Prefill/decode disaggregation through real daemons and the real gateway, on loopback.

One prefill daemon, one decode daemon and a gateway given both pools, plus a unified daemon
as the reference: completions and streaming chat through the gateway with the official
openai client equal the unified answers (text and usage), and really went through a KV
pull; a dead prefill pool, forged, stale and dead-host transfer params fall back to local
prefill with the same answer; malformed params are a clear 400.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import uuid

import aiohttp
import openai
import pytest
import pytest_asyncio
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from pagefleet.daemon.config import DaemonConfig
from pagefleet.daemon.engine_client import ClientKVSource
from pagefleet.daemon.kv_stage import KVStage
from pagefleet.daemon.kv_transfer import KVExportServer
from pagefleet.dev.process import free_port
from pagefleet.dev.redis_server import LocalRedis
from pagefleet.engine.tiny import ensure_tiny_checkpoint
from pagefleet.gateway.cli import GatewayConfig, build_gateway
from pagefleet.kvindex.redis_index import RedisKVIndex

from .conftest import live_daemon

pytestmark = pytest.mark.asyncio(loop_scope="module")

MODEL = "tiny-pd"
PROMPT = (
    "In a quiet valley the river bends twice before it meets the sea, and the people "
    "who live there count the seasons by the colour of the water"
)


def _config(role: str, redis_url: str | None = None) -> DaemonConfig:
    # Pod names follow the static-discovery convention (host:port), as `pagefleet up` does,
    # so that a gateway reading Redis matches each heartbeat to its endpoint.
    port = free_port()
    return DaemonConfig(
        model="tiny", served_model_name=MODEL, port=port, pod_name=f"127.0.0.1:{port}", role=role,
        block_size=8, num_gpu_blocks=128, max_model_len=256, max_num_seqs=8, max_queue=8,
        redis_url=redis_url, heartbeat_s=0.2,
    )  # fmt: skip


async def _gateway(prefill_urls: list[str], decode_urls: list[str], **kw):
    # No /ready probes (a loaded machine can answer one late twice and drop a pod that
    # the test needs) and no intake processes (small bodies are inspected inline anyway).
    kw = {"probe_interval_s": 0, "intake_workers": 0, **kw}
    cfg = GatewayConfig(
        model=str(ensure_tiny_checkpoint("tiny")), served_model_name=MODEL, block_size=8,
        prefill_endpoints=prefill_urls, decode_endpoints=decode_urls,
        pd_min_uncached_tokens=16, pd_prefill_timeout_s=5.0, port=free_port(), **kw,
    )  # fmt: skip
    gw = build_gateway(cfg)
    runner = web.AppRunner(gw.make_app(), handler_cancellation=True)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", cfg.port).start()
    return gw, runner, f"http://127.0.0.1:{cfg.port}"


# Teardown of the whole fleet (gateway, three daemons and their engine processes, Redis):
# normally a few seconds; past this it fails loudly instead of hanging the session.
_TEARDOWN_BOUND_S = 90.0


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def fleet():
    # The P/D daemons heartbeat into a real Redis; only gateways given --redis-url read it.
    # The bound must be entered in the teardown's own task: pytest-asyncio runs a fixture's
    # setup and teardown in two different tasks, so an asyncio.timeout entered at setup
    # would, at teardown, cancel the finished setup task -- nothing (an earlier version of
    # this fixture did exactly that, so its "bounded teardown" never bounded anything).
    stack = contextlib.AsyncExitStack()
    try:
        redis = await stack.enter_async_context(LocalRedis())
        p = await stack.enter_async_context(live_daemon(_config("prefill", redis.url)))
        d = await stack.enter_async_context(live_daemon(_config("decode", redis.url)))
        u = await stack.enter_async_context(live_daemon(_config("unified")))
        gw, runner, url = await _gateway([p.url], [d.url])
        stack.push_async_callback(runner.cleanup)
        fleet = {"prefill": p, "decode": d, "unified": u, "gateway": url, "gw": gw,
                 "redis": redis.url}  # fmt: skip
    except BaseException:
        async with asyncio.timeout(_TEARDOWN_BOUND_S):
            await stack.aclose()
        raise
    yield fleet
    async with asyncio.timeout(_TEARDOWN_BOUND_S):
        await stack.aclose()


async def _metric(url: str, name: str, **labels: str) -> float:
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        text = await r.text()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


_OUTCOME = "pagefleet:kv_transfer_requests_total"


def _client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


async def test_completions_and_streaming_chat_equal_unified(fleet, monkeypatch) -> None:
    # A daemon whose engine runs in its own process moves the KV through shared-memory
    # stages (kv_stage.py), reused on both sides (StagePool): the prefill engine fills one
    # with the prompt's KV as the prefill finishes (so no pull gathers on demand), the
    # decode side receives into one, which its engine copies from on a side thread. An
    # engine thread (--no-engine-process) reads and writes the tensors in place: no stage
    # at all. The assertion follows the mode each daemon runs in.
    stages: list[str] = []
    create = KVStage.create.__func__
    on_demand: list[int] = []
    read_stage = ClientKVSource.read_stage

    def counted(cls, *a, **kw):
        stage = create(cls, *a, **kw)
        stages.append(stage.path)
        return stage

    async def gathered_on_demand(self, *a, **kw):
        on_demand.append(1)
        return await read_stage(self, *a, **kw)

    monkeypatch.setattr(KVStage, "create", classmethod(counted))
    monkeypatch.setattr(ClientKVSource, "read_stage", gathered_on_demand)
    gw, uni = _client(fleet["gateway"]), _client(fleet["unified"].url)
    dec = fleet["decode"].url
    pulled0 = await _metric(dec, "pagefleet:kv_transfer_requests_total", outcome="pulled")
    for kw in ({"temperature": 0.0}, {"temperature": 0.9, "seed": 3, "n": 2}):
        a = await gw.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, **kw)
        b = await uni.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, **kw)
        assert [c.text for c in a.choices] == [c.text for c in b.choices]
        assert a.usage.prompt_tokens == b.usage.prompt_tokens
        assert a.usage.completion_tokens == b.usage.completion_tokens
    messages = [{"role": "user", "content": PROMPT + " and the fish"}]
    texts = []
    for c in (gw, uni):
        stream = await c.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=10, temperature=0.0, stream=True,
            stream_options={"include_usage": True},
        )  # fmt: skip
        text, usage = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            if chunk.usage:
                usage = chunk.usage
        texts.append((text, usage.prompt_tokens, usage.completion_tokens))
    assert texts[0] == texts[1]
    pulled = await _metric(dec, "pagefleet:kv_transfer_requests_total", outcome="pulled")
    assert pulled - pulled0 >= 2, "the gateway's requests did not go through a KV pull"
    assert await _metric(fleet["prefill"].url, "pagefleet:kv_transfer_bytes_total") > 0
    assert await _metric(fleet["gateway"], "pagefleet_gateway_pd_requests_total", path="remote")
    for c in (gw, uni):
        await c.close()
    on_prefill = 1 if fleet["prefill"].daemon.engine_process else 0  # one, reused
    on_decode = 1 if fleet["decode"].daemon.engine_process else 0  # one, reused
    assert len(stages) == on_prefill + on_decode, "one stage a side, or none where expected"
    assert not on_demand, "a pull gathered on demand: the engine had not filled the stage"
    kept = fleet["decode"].daemon.pd.stages.idle_paths()
    kept_p = fleet["prefill"].daemon.pd.export_server.stages.idle_paths()
    assert len(kept) == on_decode and len(kept_p) == on_prefill
    assert not fleet["prefill"].daemon.pd.export_server._staged, "a pulled handle's stage held"
    left = [p for p in stages if os.path.exists(p) and p not in kept + kept_p]
    assert not left, "a KV stage file was left behind"


async def _post_as(url: str, body: dict, key: str) -> tuple[int, dict]:
    auth = {"Authorization": f"Bearer {key}"}
    async with (
        aiohttp.ClientSession(headers=auth) as s,
        s.post(url + "/v1/completions", json=body) as r,
    ):
        return r.status, await r.json()


async def _post(url: str, body: dict) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json=body) as r:
        return r.status, await r.json()


async def test_a_prompt_scoring_request_is_prefilled_on_the_decode_pod(fleet) -> None:
    """Prompt logprobs (vLLM's ``prompt_logprobs``, or ``echo`` with ``logprobs``) need the
    prompt's logits, which a pulled KV does not carry: the decode engine refused the import
    and prefilled locally anyway, after a wasted remote prefill and pull (counted as a
    failed transfer). The gateway keeps such requests whole."""
    url = fleet["gateway"]
    total = "pagefleet_gateway_pd_requests_total"
    for i, extra in enumerate(({"prompt_logprobs": 1}, {"echo": True, "logprobs": 1})):
        body = {"model": MODEL, "prompt": f"Scored {i}: " + PROMPT, "max_tokens": 1,
                "temperature": 0.0, **extra}  # fmt: skip
        local0 = await _metric(url, total, path="local", reason="prompt_logprobs")
        remote0 = await _metric(url, total, path="remote")
        status, got = await _post(url, body)
        assert status == 200, got
        assert await _metric(url, total, path="local", reason="prompt_logprobs") == local0 + 1
        assert await _metric(url, total, path="remote") == remote0


async def test_bad_transfer_params_fall_back_or_400(fleet) -> None:
    p, d, u = fleet["prefill"], fleet["decode"], fleet["unified"]
    base = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0.0}
    _, want = await _post(u.url, base)
    # A real handle, pulled once; the second pull of it (stale) falls back.
    export = {"do_remote_decode": True}
    status, pre = await _post(p.url, {**base, "max_tokens": 1, "kv_transfer_params": export})
    assert status == 200 and pre["kv_transfer_params"]["do_remote_prefill"] is True
    tp = pre["kv_transfer_params"]
    port = int(p.url.rsplit(":", 1)[1])
    cases = [
        tp,  # real
        tp,  # stale: already pulled
        {**tp, "remote_request_id": uuid.uuid4().hex},  # forged
        {**tp, "remote_port": free_port()},  # dead host
        {**tp, "remote_num_tokens": 3},  # for another prompt
        {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": port},
    ]
    failed0 = await _metric(d.url, "pagefleet:kv_transfer_pulls_failed_total")
    for params in cases:
        status, got = await _post(d.url, {**base, "kv_transfer_params": params})
        assert status == 200, got
        assert got["choices"][0]["text"] == want["choices"][0]["text"]
    failed = await _metric(d.url, "pagefleet:kv_transfer_pulls_failed_total")
    assert failed - failed0 == 5
    for reason in ("not_found", "unreachable", "prompt_mismatch", "bad_params"):
        assert await _metric(d.url, "pagefleet:kv_transfer_pulls_failed_total", reason=reason)
    # Malformed or impossible: 400 naming kv_transfer_params.
    for url, params, extra in [
        (d.url, {"do_remote_prefill": True, "remote_port": 70000}, {}),
        (d.url, "yes", {}),
        (d.url, {"do_remote_decode": True}, {}),  # a decode pod does not export
        (p.url, {"do_remote_decode": True}, {"n": 2}),  # the decode pod samples n
    ]:
        status, err = await _post(url, {**base, **extra, "kv_transfer_params": params})
        assert status == 400, err
        assert err["error"]["param"] == "kv_transfer_params"
    # No block is left referenced once the dust settles (handles expire or were pulled).
    for daemon in (p, d):
        loop = daemon.daemon.engine_loop
        await loop.invoke("collect_transfers", float("inf"))
        assert (await loop.stats()).kv_usage == 0  # referenced blocks / all blocks
        await loop.invoke("check_integrity")


async def test_a_suffix_pull_out_of_the_whole_prompts_stage(fleet, monkeypatch) -> None:
    # The decode pod holds the first blocks already, so it pulls only the rest: out of the
    # stage its prefill engine filled with every block as the prefill finished, per layer
    # K and V, a range from the middle of each. The answer must still be the unified one.
    p, d, u = fleet["prefill"], fleet["decode"], fleet["unified"]
    head = [(i * 37) % 400 + 10 for i in range(40)]  # 5 full blocks of 8
    prompt = head + [(i * 53) % 400 + 10 for i in range(21)]
    base = {"model": MODEL, "max_tokens": 6, "temperature": 0.0}
    await _post(d.url, {**base, "prompt": head})  # cached on the decode pod
    _, want = await _post(u.url, {**base, "prompt": prompt})
    status, pre = await _post(
        p.url, {**base, "prompt": prompt, "max_tokens": 1,
                "kv_transfer_params": {"do_remote_decode": True}},
    )  # fmt: skip
    assert status == 200
    on_demand: list[int] = []
    read_stage = ClientKVSource.read_stage

    async def gathered_on_demand(self, *a, **kw):
        on_demand.append(1)
        return await read_stage(self, *a, **kw)

    monkeypatch.setattr(ClientKVSource, "read_stage", gathered_on_demand)
    got0 = await _metric(d.url, "pagefleet:kv_transfer_blocks_total", direction="received")
    status, got = await _post(
        d.url, {**base, "prompt": prompt, "kv_transfer_params": pre["kv_transfer_params"]}
    )
    assert status == 200 and got["choices"][0]["text"] == want["choices"][0]["text"]
    pulled = await _metric(d.url, "pagefleet:kv_transfer_blocks_total", direction="received")
    assert pulled - got0 == 3, "blocks 5..7 of the 61-token prompt, not the cached five"
    assert not on_demand, "the pull gathered on demand instead of using the filled stage"


async def test_dead_prefill_pool_falls_back(fleet) -> None:
    _, runner, url = await _gateway([f"http://127.0.0.1:{free_port()}"], [fleet["decode"].url])
    try:
        c, uni = _client(url), _client(fleet["unified"].url)
        a = await c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0)
        b = await uni.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0)
        assert a.choices[0].text == b.choices[0].text

        async def counted() -> bool:  # the gateway's early prefill fails beside the decode
            return await _metric(url, "pagefleet_gateway_pd_requests_total",
                                 reason="prefill_failed") == 1  # fmt: skip

        await _until(counted, timeout=10.0)
        await c.close()
        await uni.close()
    finally:
        await runner.cleanup()


class _DyingDecodePod:
    """A real aiohttp server in the decode pool that is ready but drops every generation
    request before its first byte: the connection closes (non-streamed) or the response
    headers go out and the stream ends empty (streamed), as a pod that crashes would."""

    def __init__(self) -> None:
        self.seen: list[dict] = []
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        app = web.Application()
        app.router.add_get("/ready", self._ok)
        app.router.add_get("/health", self._ok)
        app.router.add_post("/v1/completions", self._die)
        app.router.add_post("/v1/chat/completions", self._die)
        self.runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=1.0)

    async def _ok(self, _: web.Request) -> web.Response:
        return web.json_response({"ready": True, "ok": True})

    async def _die(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.seen.append(body)
        if body.get("stream"):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write_eof()  # headers, then an empty stream: no first byte
            return resp
        assert request.transport is not None
        request.transport.close()  # crash: the connection drops before any response
        return web.Response()

    async def __aenter__(self) -> _DyingDecodePod:
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.runner.cleanup()


async def _complete(client: openai.AsyncOpenAI, prompt: str, stream: bool) -> tuple:
    """(text, prompt_tokens, completion_tokens) of one greedy completion."""
    kw = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0}
    if not stream:
        r = await client.completions.create(**kw)
        return r.choices[0].text, r.usage.prompt_tokens, r.usage.completion_tokens
    text, usage = "", None
    async for chunk in await client.completions.create(
        **kw, stream=True, stream_options={"include_usage": True}
    ):
        if chunk.choices:
            text += chunk.choices[0].text
        if chunk.usage:
            usage = chunk.usage
    assert usage is not None
    return text, usage.prompt_tokens, usage.completion_tokens


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_decode_pod_dying_before_first_byte_retries_with_the_same_handle(
    fleet, stream: bool
) -> None:
    """The request moves to the next decode pod carrying the handle the prefill pod made:
    one prefill per request, the second decode pod pulls it, the answer equals unified."""
    p, d, u = fleet["prefill"], fleet["decode"], fleet["unified"]
    async with _DyingDecodePod() as bad:
        # round_robin starts each request one pod further: one of the two requests below
        # meets the dying pod first, whatever the pods' names sort to.
        _, runner, url = await _gateway([p.url], [bad.url, d.url], policy="round_robin")
        gw, uni = _client(url), _client(u.url)
        try:
            exported0 = await _metric(p.url, _OUTCOME, outcome="exported")
            prompt0 = await _metric(p.url, "vllm:prompt_tokens_total")
            pulled0 = await _metric(d.url, _OUTCOME, outcome="pulled")
            fallback0 = await _metric(d.url, _OUTCOME, outcome="fallback")
            n_prompt = 0
            for prompt in (PROMPT + " at dawn", PROMPT + " at dusk"):
                got = await _complete(gw, prompt, stream)
                want = await _complete(uni, prompt, stream)
                assert got == want
                n_prompt += want[1]
            assert len(bad.seen) == 1, "exactly one request met the dying pod first"
            assert bool(bad.seen[0].get("stream")) is stream
            handle = bad.seen[0]["kv_transfer_params"]["remote_request_id"]
            exported = await _metric(p.url, _OUTCOME, outcome="exported")
            assert exported - exported0 == 2, "one remote prefill per request, none again"
            tokens = await _metric(p.url, "vllm:prompt_tokens_total") - prompt0
            assert tokens == n_prompt, "the prefill pod prefilled a prompt twice"
            pulled = await _metric(d.url, _OUTCOME, outcome="pulled")
            assert pulled - pulled0 == 2, "the retried request must pull the same handle"
            assert await _metric(d.url, _OUTCOME, outcome="fallback") == fallback0
            loop = p.daemon.engine_loop
            assert handle not in await loop.export_handles()
            retried = await _metric(
                url, "pagefleet_gateway_upstream_retries_total", pod=f"127.0.0.1:{bad.port}"
            )
            assert retried == 1
        finally:
            await gw.close()
            await uni.close()
            await runner.cleanup()


async def _prefill_load(redis_url: str, pod: str) -> int:
    index = RedisKVIndex.from_url(redis_url, namespace=MODEL, auto_gc_interval_s=None)
    try:
        load = (await index.pods()).get(pod)
        return 0 if load is None else load.running + load.waiting
    finally:
        await index.close()


async def _until(cond, timeout: float = 20.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not await cond():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.1)


@pytest.mark.timeout(120)
async def test_prefill_pool_busy_per_its_heartbeat_means_local_prefill(fleet) -> None:
    """Saturation counts the prefill pod's own load (its Redis heartbeat), not only this
    gateway's in-flight requests: traffic this gateway never sent keeps it off the pool."""
    p, d, u = fleet["prefill"], fleet["decode"], fleet["unified"]
    gateway, runner, url = await _gateway(
        [p.url], [d.url], redis_url=fleet["redis"], pd_max_prefill_inflight=2
    )
    pod = p.daemon.config.pod
    gw, uni, direct = _client(url), _client(u.url), _client(p.url)
    busy: list[asyncio.Task] = []
    try:
        # Other clients keep the prefill pod busy: long decodes sent to it directly, each
        # client sending its next as soon as one ends (a single round is over in well under
        # a second with the compiled CPU attention, before the gateway had read a heartbeat).
        # Each client decodes a different length: equal lengths ran in lockstep, all ending
        # in one step, and a heartbeat taken in that gap read the pod as idle (CI failure).
        async def keep_busy(i: int) -> None:
            while True:
                await direct.completions.create(
                    model=MODEL, prompt=f"{PROMPT} {i}", max_tokens=100 + 18 * i, temperature=0,
                    extra_body={"ignore_eos": True},
                )  # fmt: skip

        busy.extend(asyncio.create_task(keep_busy(i)) for i in range(6))
        await _until(lambda: _loaded(fleet["redis"], pod, at_least=2))
        # Until the gateway itself has read such a heartbeat (it re-reads every 0.25 s; a
        # fixed wait for that could end first on a loaded machine).
        await _until(lambda: _gateway_sees(gateway, pod, at_least=2))
        exported0 = await _metric(p.url, _OUTCOME, outcome="exported")
        prompt = "Under load: " + PROMPT  # its own first block, cached nowhere yet
        assert await _complete(gw, prompt, False) == await _complete(uni, prompt, False)
        assert await _metric(url, "pagefleet_gateway_pd_requests_total",
                             path="local", reason="prefill_saturated") == 1  # fmt: skip
        assert await _metric(p.url, _OUTCOME, outcome="exported") == exported0
        # Once the heartbeat shows the pod idle again, the pool takes prompts again.
        for t in busy:
            t.cancel()
        await asyncio.gather(*busy, return_exceptions=True)
        await _until(lambda: _loaded(fleet["redis"], pod, at_most=0))
        await _until(lambda: _gateway_sees(gateway, pod, at_most=0))
        prompt = "At rest: " + PROMPT  # its own first block: nothing of it cached anywhere
        assert await _complete(gw, prompt, False) == await _complete(uni, prompt, False)
        assert await _metric(url, "pagefleet_gateway_pd_requests_total", path="remote") == 1
        assert await _metric(p.url, _OUTCOME, outcome="exported") == exported0 + 1
    finally:
        for t in busy:
            t.cancel()
        await asyncio.gather(*busy, return_exceptions=True)
        for c in (gw, uni, direct):
            await c.close()
        await runner.cleanup()


async def _loaded(redis_url: str, pod: str, at_least: int = 0, at_most: int = 10**9) -> bool:
    return at_least <= await _prefill_load(redis_url, pod) <= at_most


async def _gateway_sees(gateway, pod: str, at_least: int = 0, at_most: int = 10**9) -> bool:
    """The prefill pod's load (running + waiting) in the last heartbeat the gateway read."""
    load = gateway.pd.prefill_router._loads.get(pod)
    n = 0 if load is None else load.running + load.waiting
    return at_least <= n <= at_most


@pytest.mark.timeout(120)
async def test_decode_pod_frees_handles_it_does_not_pull_at_once(fleet) -> None:
    """Pulled, not needed (every block already cached on the decode pod), or left behind by
    a local-prefill fallback: the prefill pod's handle is gone within a second or two, far
    before its 30 s deadline, and none of them counts as expired."""
    p, d, u = fleet["prefill"], fleet["decode"], fleet["unified"]
    # Token ids, 57 of them: the decode pod's import covers positions 0..55, seven full
    # blocks of 8, so once cached it has every block and nothing to pull.
    prompt = [(i * 13) % 200 + 5 for i in range(57)]
    base = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0.0}
    _, want = await _post(u.url, base)
    expired0 = await _metric(p.url, "pagefleet:kv_transfer_handles_expired_total")

    async def export(body: dict) -> dict:
        status, pre = await _post(
            p.url, {**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
        )
        assert status == 200, pre
        assert await _metric(p.url, "pagefleet:kv_transfer_handles_active") >= 1
        return pre["kv_transfer_params"]

    async def freed() -> bool:
        return await _metric(p.url, "pagefleet:kv_transfer_handles_active") == 0

    async def decode_with(tp: dict, outcome: str, body: dict = base) -> None:
        before = await _metric(d.url, _OUTCOME, outcome=outcome)
        status, got = await _post(d.url, {**body, "kv_transfer_params": tp})
        assert status == 200, got
        assert await _metric(d.url, _OUTCOME, outcome=outcome) == before + 1
        await _until(freed, timeout=5.0)

    await _until(freed, timeout=5.0)  # earlier tests' handles are pulled or released
    # 1. Pulled: freed as soon as the bytes are out.
    await decode_with(await export(base), "pulled")
    # 2. The decode pod now holds every block of this prompt: nothing to pull, released.
    await decode_with(await export(base), "local_hit")
    # 3. Fallback: the handle is for a prompt this request does not have; prefilled here.
    other = {**base, "prompt": [*prompt, 9]}
    await decode_with(await export(other), "fallback")
    _, got = await _post(d.url, base)
    assert got["choices"][0]["text"] == want["choices"][0]["text"]
    assert await _metric(p.url, "pagefleet:kv_transfer_handles_expired_total") == expired0
    # A handle nobody holds: the release endpoint answers 404, not an error page.
    async with aiohttp.ClientSession() as s:
        async with s.post(p.url + "/v1/kv/release", json={"handle": "nope"}) as r:
            assert r.status == 404
        async with s.post(p.url + "/v1/kv/release", json={"handle": ""}) as r:
            assert r.status == 400


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_gateway_releases_the_handle_when_every_decode_pod_fails(fleet, stream: bool) -> None:
    """No decode pod serves the request (the only one dies before its first byte): the
    client gets the gateway's 502, and the prefill pod's handle is freed by the gateway's
    release within seconds, not at its 30 s deadline, and never counts as expired."""
    p = fleet["prefill"]
    async with _DyingDecodePod() as bad:
        _, runner, url = await _gateway([p.url], [bad.url])
        try:
            expired0 = await _metric(p.url, "pagefleet:kv_transfer_handles_expired_total")
            body = {"model": MODEL, "prompt": PROMPT + " in winter", "max_tokens": 4,
                    "temperature": 0.0, "stream": stream}  # fmt: skip
            async with (
                aiohttp.ClientSession() as s,
                s.post(url + "/v1/completions", json=body) as r,
            ):
                assert r.status == 502, await r.text()
            assert len(bad.seen) == 1
            handle = bad.seen[0]["kv_transfer_params"]["remote_request_id"]

            async def released() -> bool:
                return handle not in await p.daemon.engine_loop.export_handles()

            async def counted() -> bool:
                return await _metric(
                    url, "pagefleet_gateway_pd_handles_released_total", result="released"
                ) == 1  # fmt: skip

            await _until(released, timeout=5.0)
            await _until(counted, timeout=5.0)
            assert await _metric(p.url, "pagefleet:kv_transfer_handles_expired_total") == expired0
        finally:
            await runner.cleanup()


@pytest.mark.timeout(60)
async def test_a_handle_whose_prefill_and_decode_both_fail_is_released_and_counted_once() -> None:
    """The early prefill fails (its pod is gone: nothing listens) and so does the only
    decode pod (it dies before its first byte). The gateway released the handle when the
    prefill failed and again when no decode pod served the request: two release requests
    and two counts in pagefleet_gateway_pd_handles_released_total for one handle, so the
    series read twice the handles there were. Now one release, counted once."""
    dead = f"http://127.0.0.1:{free_port()}"
    async with _DyingDecodePod() as bad:
        gw, runner, url = await _gateway([dead], [bad.url])
        try:
            body = {"model": MODEL, "prompt": PROMPT + " at noon", "max_tokens": 4,
                    "temperature": 0.0}  # fmt: skip
            async with (
                aiohttp.ClientSession() as s,
                s.post(url + "/v1/completions", json=body) as r,
            ):
                assert r.status == 502, await r.text()
            assert len(bad.seen) == 1 and bad.seen[0]["kv_transfer_params"]["remote_pending"]

            async def settled() -> bool:  # the early prefill and every release are done
                return not gw.pd._prefills and not gw.pd._releases

            await _until(settled, timeout=10.0)
            name = "pagefleet_gateway_pd_handles_released_total"
            assert await _metric(url, name) == 1
            assert await _metric(url, name, result="failed") == 1  # unreachable, once
        finally:
            await runner.cleanup()


@pytest.mark.timeout(120)
async def test_a_decode_request_aborted_mid_pull_frees_the_handle_on_the_prefill_pod(
    fleet,
) -> None:
    """A client that leaves a decode pod while its pull is under way (here: waiting for
    staging room) cancelled the pull, freed the decode pod's reservation -- and left the
    prefill pod's handle pinned until its deadline (30 s by default): nobody told it that
    no pull would come, unless a gateway was in the path. The decode pod now releases it,
    as it does when a pull fails."""
    p, d = fleet["prefill"], fleet["decode"]
    base = {"model": MODEL, "prompt": "Aborted mid-pull: " + PROMPT, "max_tokens": 8,
            "temperature": 0.0}  # fmt: skip
    export = {"do_remote_decode": True, "remote_request_id": f"pd-{uuid.uuid4().hex}"}
    status, pre = await _post(p.url, {**base, "max_tokens": 1, "kv_transfer_params": export})
    assert status == 200, pre
    handle = pre["kv_transfer_params"]["remote_request_id"]
    assert handle in await p.daemon.engine_loop.export_handles()
    budget = d.daemon.pd.pull_budget
    limit, budget.limit = budget.limit, 1
    assert budget.try_take(1)  # every pull now waits for staging room
    try:
        body = {**base, "kv_transfer_params": pre["kv_transfer_params"]}
        decode = asyncio.create_task(_post(d.url, body))
        await _until_sync(lambda: bool(budget._waiters), timeout=10.0)
        decode.cancel()  # the client goes away: its connection closes
        await asyncio.gather(decode, return_exceptions=True)

        async def freed() -> bool:
            return handle not in await p.daemon.engine_loop.export_handles()

        await _until(freed, timeout=5.0)
    finally:
        budget.give(1)
        budget.limit = limit
    loop = d.daemon.engine_loop

    async def reservation_gone() -> bool:
        return (await loop.stats()).kv_usage == 0

    await _until(reservation_gone, timeout=5.0)
    await loop.invoke("check_integrity")


@pytest.mark.timeout(120)
async def test_a_handle_released_before_its_prefill_arrives_is_not_left_pinned(fleet) -> None:
    """A decode pod whose client left while it waited for a handle releases it; when that
    release reaches the prefill pod before the prefill request itself (the two travel
    separately), the prefill pod answered 404 and forgot it: the prefill then ran,
    exported the handle, and its blocks stayed pinned for nobody until the deadline. A
    release is now remembered, and the export it names is freed as its request ends."""
    p = fleet["prefill"]
    handle = f"pd-{uuid.uuid4().hex}"
    async with (
        aiohttp.ClientSession() as s,
        s.post(p.url + "/v1/kv/release", json={"handle": handle}) as r,
    ):
        assert r.status == 404  # nothing exported under it yet
    base = {"model": MODEL, "prompt": "Released first: " + PROMPT, "max_tokens": 1,
            "temperature": 0.0}  # fmt: skip
    export = {"do_remote_decode": True, "remote_request_id": handle}
    status, pre = await _post(p.url, {**base, "kv_transfer_params": export})
    assert status == 200, pre

    async def freed() -> bool:
        return handle not in await p.daemon.engine_loop.export_handles()

    await _until(freed, timeout=5.0)
    # A wait for it says at once that it will not come.
    async with aiohttp.ClientSession() as s:
        body = {"handle": handle, "wait_s": 5.0}
        async with s.post(p.url + "/v1/kv/wait", json=body) as r:
            assert r.status == 404


async def test_releases_of_made_up_handles_are_remembered_up_to_a_bound(fleet) -> None:
    """Each release of a handle the prefill pod never exported is remembered (its prefill
    may still come) for two minutes: a caller naming fresh handles in a loop grew the
    records without bound. The oldest go past ``max_remembered``."""
    p = fleet["prefill"]
    server = p.daemon.pd.export_server
    server.max_remembered = 20
    try:
        async with aiohttp.ClientSession() as s:
            for i in range(60):
                body = {"handle": f"made-up-{i}-{uuid.uuid4().hex}"}
                async with s.post(p.url + "/v1/kv/release", json=body) as r:
                    assert r.status == 404
        assert len(server._released) <= 20 and len(server._settled) <= 20
        assert any(h.startswith("made-up-59-") for h in server._released)  # newest kept
    finally:
        server.max_remembered = KVExportServer(lambda: None, lambda: None).max_remembered


async def _until_sync(cond, timeout: float = 20.0) -> None:
    async def check() -> bool:
        return cond()

    await _until(check, timeout)


@pytest.mark.timeout(120)
async def test_early_hand_over_waits_for_the_prefill_or_falls_back(fleet) -> None:
    """A decode request sent before its prefill (``remote_pending``, the handle named by
    the caller, as the gateway does) reserves, waits for the prefill pod to export the
    handle, pulls it and answers as unified; when the prefill never comes (the gateway
    releases the handle after its prefill failed) it prefills locally at once."""
    p, d, u = fleet["prefill"], fleet["decode"], fleet["unified"]
    server = p.daemon.pd.export_server
    # A handle not announced yet is waited for this long: the prefill request sent below
    # must arrive within it however loaded the machine is.
    server.unknown_grace_s = 120.0
    port = int(p.url.rsplit(":", 1)[1])
    prompt = PROMPT + " while the tide turns"
    base = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0.0}
    _, want = await _post(u.url, base)

    def early(handle: str) -> dict:
        return {"do_remote_prefill": True, "remote_pending": True, "remote_host": "127.0.0.1",
                "remote_port": port, "remote_request_id": handle}  # fmt: skip

    # 1. The decode pod is waiting for the handle before the prefill pod has heard of it.
    pulled0 = await _metric(d.url, _OUTCOME, outcome="pulled")
    handle = f"pd-{uuid.uuid4().hex}"
    decode = asyncio.create_task(_post(d.url, {**base, "kv_transfer_params": early(handle)}))
    await _until_sync(lambda: handle in server._awaited)
    export = {"do_remote_decode": True, "remote_request_id": handle}
    status, pre = await _post(p.url, {**base, "max_tokens": 1, "kv_transfer_params": export})
    assert status == 200 and pre["kv_transfer_params"]["remote_request_id"] == handle
    status, got = await decode
    assert status == 200, got
    assert got["choices"][0]["text"] == want["choices"][0]["text"]
    assert await _metric(d.url, _OUTCOME, outcome="pulled") == pulled0 + 1
    # 2. Its prefill is given up (released): the waiting decode pod prefills locally.
    fallback0 = await _metric(d.url, _OUTCOME, outcome="fallback")
    handle = f"pd-{uuid.uuid4().hex}"
    decode = asyncio.create_task(_post(d.url, {**base, "kv_transfer_params": early(handle)}))
    await _until_sync(lambda: handle in server._awaited)
    async with aiohttp.ClientSession() as s:
        async with s.post(p.url + "/v1/kv/release", json={"handle": handle}) as r:
            assert r.status == 404  # nothing exported under it
        # A wait for a handle nobody announces ends at its own bound (408), not a hang.
        body = {"handle": "never-" + handle, "wait_s": 0.3}
        async with s.post(p.url + "/v1/kv/wait", json=body) as r:
            assert r.status == 408
    status, got = await decode
    assert status == 200 and got["choices"][0]["text"] == want["choices"][0]["text"]
    assert await _metric(d.url, _OUTCOME, outcome="fallback") == fallback0 + 1
    assert handle not in server._awaited and "never-" + handle not in server._awaited
    # A handle the caller names must be a plain token.
    bad = {"do_remote_decode": True, "remote_request_id": "a b"}
    status, err = await _post(p.url, {**base, "max_tokens": 1, "kv_transfer_params": bad})
    assert status == 400 and err["error"]["param"] == "kv_transfer_params"
    for daemon in (p, d):  # nothing stays pinned or reserved
        loop = daemon.daemon.engine_loop
        await loop.invoke("collect_transfers", float("inf"))
        assert (await loop.stats()).kv_usage == 0
    server.unknown_grace_s = KVExportServer(lambda: None, lambda: None).unknown_grace_s


@pytest.mark.timeout(120)
async def test_a_handle_named_twice_is_refused_and_the_first_export_stays_whole(fleet) -> None:
    """A caller-named handle that a running or exported request holds is a 409 for the
    second request, which touches nothing of the first: the handle still reads as exported
    to a decode pod that waits for it, and the decode pod pulls it and answers as unified
    does. (Before, the refused duplicate settled the handle as never exported and dropped
    the first request's stage.)"""
    p, d, u = fleet["prefill"], fleet["decode"], fleet["unified"]
    base = {"model": MODEL, "prompt": "Named twice: " + PROMPT, "max_tokens": 6, "temperature": 0.0}
    _, want = await _post(u.url, base)
    handle = f"twice-{uuid.uuid4().hex}"
    kvp = {"do_remote_decode": True, "remote_request_id": handle}
    pre = {**base, "max_tokens": 1, "kv_transfer_params": kvp}
    # However the three interleave, one holds the handle and the others find it held
    # (running, or already exported): the outcome does not depend on timing.
    results = await asyncio.gather(*(_post(p.url, pre) for _ in range(3)))
    assert sorted(status for status, _ in results) == [200, 409, 409], results
    refused = next(body for status, body in results if status == 409)
    assert handle in refused["error"]["message"]
    tp = next(body for status, body in results if status == 200)["kv_transfer_params"]
    assert tp["remote_request_id"] == handle
    wait = {"handle": handle, "wait_s": 5}
    async with aiohttp.ClientSession() as s, s.post(p.url + "/v1/kv/wait", json=wait) as r:
        assert r.status == 200, await r.text()
    pulled0 = await _metric(d.url, _OUTCOME, outcome="pulled")
    status, got = await _post(d.url, {**base, "kv_transfer_params": tp})
    assert status == 200, got
    assert got["choices"][0]["text"] == want["choices"][0]["text"]
    assert await _metric(d.url, _OUTCOME, outcome="pulled") == pulled0 + 1
    # Once pulled, the name is still refused while the pod remembers it as exported.
    status, again = await _post(p.url, pre)
    assert status == 409, again


@pytest.mark.timeout(120)
async def test_pd_with_api_keys_on_the_daemons_still_pulls(fleet, monkeypatch, caplog) -> None:
    """Daemons that require API keys (PAGEFLEET_API_KEYS), and the one upstream key
    (PAGEFLEET_UPSTREAM_API_KEY) on the gateway and the daemons, as documented: a request
    through the gateway goes through a real KV pull and answers as unified does; the
    gateway releases a handle with the key too. (Before, the gateway's prefill and release
    and the decode pod's wait and pull all got 401: every request prefilled locally.)"""
    fleet_key, client_key = "sk-pd-daemons", "sk-pd-client"
    monkeypatch.setenv("PAGEFLEET_API_KEYS", fleet_key)
    monkeypatch.setenv("PAGEFLEET_UPSTREAM_API_KEY", fleet_key)
    stack = contextlib.AsyncExitStack()
    try:
        p = await stack.enter_async_context(live_daemon(_config("prefill")))
        d = await stack.enter_async_context(live_daemon(_config("decode")))
        monkeypatch.setenv("PAGEFLEET_API_KEYS", client_key)  # the gateway's clients' keys
        gw, runner, url = await _gateway([p.url], [d.url])
        stack.push_async_callback(runner.cleanup)
        # The daemons do require a key, and the client's is not one of theirs.
        for auth in ({}, {"Authorization": f"Bearer {client_key}"}):
            async with (
                aiohttp.ClientSession(headers=auth) as s,
                s.post(p.url + "/v1/kv/wait", json={"handle": "x", "wait_s": 1}) as r,
            ):
                assert r.status == 401

        body = {"model": MODEL, "prompt": "Behind keys: " + PROMPT, "max_tokens": 8,
                "temperature": 0.0}  # fmt: skip
        _, want = await _post(fleet["unified"].url, body)
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=client_key, max_retries=0)
        try:
            got = await client.completions.create(**body)
        finally:
            await client.close()
        assert got.choices[0].text == want["choices"][0]["text"]
        assert got.usage.completion_tokens == want["usage"]["completion_tokens"]
        assert await _metric(d.url, _OUTCOME, outcome="pulled") == 1, "no KV pull"
        assert await _metric(d.url, "pagefleet:kv_transfer_pulls_failed_total") == 0
        assert await _metric(d.url, "pagefleet:kv_transfer_blocks_total", direction="received")
        pd_total = "pagefleet_gateway_pd_requests_total"
        assert await _metric(url, pd_total, path="remote") == 1
        assert await _metric(url, pd_total, reason="prefill_failed") == 0

        # A handle no decode pod will pull: the gateway's release, with the headers its
        # requests to daemons carry for a client's request, frees it.
        pre = {**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
        status, exported = await _post_as(p.url, pre, fleet_key)
        assert status == 200, exported
        tp = exported["kv_transfer_params"]
        asked = make_mocked_request(
            "POST", "/v1/completions", headers={"Authorization": f"Bearer {client_key}"}
        )
        gw.pd.release_later(gw._session, tp, gw._upstream_headers(asked))

        async def released() -> bool:
            total = "pagefleet_gateway_pd_handles_released_total"
            return await _metric(url, total, result="released") == 1

        await _until(released, timeout=5.0)
        assert tp["remote_request_id"] not in await p.daemon.engine_loop.export_handles()

        # A gateway without the upstream key: refused, and its log says once what to set.
        monkeypatch.delenv("PAGEFLEET_UPSTREAM_API_KEY")
        _, bare, bare_url = await _gateway([p.url], [d.url])
        stack.push_async_callback(bare.cleanup)
        with caplog.at_level(logging.WARNING, "pagefleet.gateway.pd"):
            for i in range(2):
                other = {**body, "prompt": f"{i} {PROMPT}"}
                status, _ = await _post_as(bare_url, other, client_key)
                assert status == 502  # the decode pod's 401, named as the gateway's key

            async def both_refused() -> bool:  # both early prefills have ended
                return await _metric(bare_url, pd_total, reason="prefill_failed") == 2

            await _until(both_refused, timeout=10.0)
        hints = [r.getMessage() for r in caplog.records if "401" in r.getMessage()]
        assert len(hints) == 1 and "PAGEFLEET_UPSTREAM_API_KEY" in hints[0], hints
    finally:
        async with asyncio.timeout(_TEARDOWN_BOUND_S):
            await stack.aclose()
