"""P/D with each daemon's engine in a thread of its HTTP process (``engine_process=False``).

The fleet test (test_pd_fleet.py) runs engines in their own processes, where the KV moves
through shared-memory stages and the decode side's copy goes in pieces. With an engine
thread neither applies: the prefill side's export server reads the engine's tensors, the
decode side hands the pulled buffer over as tensors and commits in one call. Same contract:
the answers through the gateway equal a unified pod's, and they really went through a pull.
"""

from __future__ import annotations

import contextlib

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
