"""P/D with each daemon's engine in a thread of its HTTP process (``engine_process=False``).

The fleet test (test_pd_fleet.py) runs engines in their own processes, where the KV moves
through shared-memory stages and the decode side's copy goes in pieces. With an engine
thread neither applies: the prefill side's export server reads the engine's tensors, the
decode side hands the pulled buffer over as tensors and commits in one call. Same contract:
the answers through the gateway equal a unified pod's, and they really went through a pull.
"""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp

from .conftest import live_daemon
from .test_pd_fleet import MODEL, PROMPT, _client, _config, _gateway, _metric


async def test_pd_with_engine_threads_equals_unified() -> None:
    async with contextlib.AsyncExitStack() as stack:
        pods = {}
        for role in ("prefill", "decode", "unified"):
            config = _config(role).model_copy(update={"engine_process": False})
            pods[role] = await stack.enter_async_context(live_daemon(config))
        p, d, u = pods["prefill"], pods["decode"], pods["unified"]
        assert not (p.daemon.engine_process or d.daemon.engine_process)
        _, runner, url = await _gateway([p.url], [d.url])
        stack.push_async_callback(runner.cleanup)
        gw, uni = _client(url), _client(u.url)
        stack.push_async_callback(gw.close)
        stack.push_async_callback(uni.close)
        for kw in ({"temperature": 0.0}, {"temperature": 0.9, "seed": 5, "n": 2}):
            a = await gw.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, **kw)
            b = await uni.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, **kw)
            assert [c.text for c in a.choices] == [c.text for c in b.choices]
            assert a.usage.completion_tokens == b.usage.completion_tokens
        texts = []
        for c in (gw, uni):
            stream = await c.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=8,
                temperature=0.0, stream=True,
            )  # fmt: skip
            texts.append("".join([ch.choices[0].delta.content or "" async for ch in stream]))
        assert texts[0] == texts[1] and texts[0]
        # The first completion and the chat pulled; the second completion's prompt was in
        # the decode pod's cache by then (the gateway sends it there without a prefill).
        pulled = await _metric(d.url, "pagefleet:kv_transfer_requests_total", outcome="pulled")
        assert pulled >= 2
        assert d.daemon.pd.stages.idle_paths() == [], "an engine thread needs no stage"
        await d.daemon.engine_loop.invoke("check_integrity")


async def test_an_export_nobody_was_told_of_is_freed_when_its_request_ends() -> None:
    """A prefill request streamed with do_remote_decode answers no kv_transfer_params, so no
    decode pod can pull its KV: the export is freed as the request ends (it stayed pinned
    to the transfer timeout, 30 s by default, holding the prefill pod's blocks). One
    answered whole keeps its handle for the decode pod."""
    config = _config("prefill").model_copy(update={"engine_process": False})
    async with live_daemon(config) as p, aiohttp.ClientSession() as s:
        loop = p.daemon.engine_loop
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1,
                "kv_transfer_params": {"do_remote_decode": True}}  # fmt: skip
        async with s.post(f"{p.url}/v1/completions", json={**body, "stream": True}) as r:
            assert r.status == 200
            await r.read()
        for _ in range(50):
            if not await loop.export_handles():
                break
            await asyncio.sleep(0.05)
        assert await loop.export_handles() == [], "a streamed export stayed pinned"
        async with s.post(f"{p.url}/v1/completions", json=body) as r:
            handle = (await r.json())["kv_transfer_params"]["remote_request_id"]
        assert await loop.export_handles() == [handle]
        await loop.invoke("check_integrity")
