"""HTTP-layer unit tests against a scripted engine (tests/daemon/fake_engine.py).

Fast and exact: the plumbing (SSE framing, n, logprobs shape, errors, aborts, 429, the
publisher's ordering and resync) is checked here; test_daemon_real.py repeats the
user-facing checks against the real engine on the tiny model.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import threading
import time

import aiohttp
import pytest

from pagefleet.api.openai import CompletionRequest, parse_body
from pagefleet.kvindex.memory import MemoryKVIndex

from .conftest import live_daemon
from .fake_engine import FakeEngine, fake_config, fake_engine_factory


async def test_completion_n_and_usage(tiny_tokenizer):
    engines: list[FakeEngine] = []
    async with (
        live_daemon(fake_config(), fake_engine_factory(tiny_tokenizer, engines)) as d,
        aiohttp.ClientSession() as s,
    ):
        body = {"model": "fake", "prompt": [[1, 2, 3], [4, 5]], "n": 2, "max_tokens": 3,
                "logprobs": 1, "rid": "x"}  # fmt: skip
        async with s.post(f"{d.base_url}/completions", json=body) as r:
            assert r.status == 200, await r.text()
            out = await r.json()
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    assert out["usage"]["prompt_tokens"] == 5
    assert out["usage"]["completion_tokens"] == 12
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    for c in out["choices"]:
        assert c["finish_reason"] == "length"
        assert len(c["logprobs"]["tokens"]) == 3
        assert c["logprobs"]["token_logprobs"] == [-0.5] * 3
    # Sequence 1 of prompt 0 starts at (6 + 7) % 200 + 300.
    assert out["choices"][1]["text"].startswith(tiny_tokenizer.decode([313]))


async def test_stream_framing_and_usage(tiny_tokenizer):
    async with (
        live_daemon(fake_config(), fake_engine_factory(tiny_tokenizer, [])) as d,
        aiohttp.ClientSession() as s,
    ):
        body = {"messages": [{"role": "user", "content": "hi"}], "stream": True,
                "max_tokens": 4, "stream_options": {"include_usage": True}}  # fmt: skip
        async with s.post(f"{d.base_url}/chat/completions", json=body) as r:
            assert r.status == 200
            assert r.headers["Content-Type"].startswith("text/event-stream")
            raw = (await r.read()).decode()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"


async def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(tiny_tokenizer):
    async with (
        live_daemon(fake_config(), fake_engine_factory(tiny_tokenizer, [])) as d,
        aiohttp.ClientSession() as s,
    ):
        opts = {"include_usage": True, "continuous_usage_stats": True}
        body = {"prompt": "hi", "stream": True, "max_tokens": 4, "stream_options": opts}
        async with s.post(f"{d.base_url}/completions", json=body) as r:
            raw = (await r.read()).decode()
        chunks = [json.loads(e[6:]) for e in raw.split("\n\n") if e and e != "data: [DONE]"]
        counts = [c["usage"]["completion_tokens"] for c in chunks]
        assert all(c["usage"]["prompt_tokens"] > 0 for c in chunks)
        assert counts == sorted(counts) and counts[-1] == 4 and counts[0] < 4
        # Options of a stream on a request that is not streamed: a 400, as vLLM answers.
        body = {"prompt": "hi", "max_tokens": 4, "stream_options": opts}
        async with s.post(f"{d.base_url}/completions", json=body) as r:
            assert r.status == 400
            assert (await r.json())["error"]["param"] == "stream_options"


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        (b"{not json", 400, None),
        (b"[1, 2]", 400, None),
        (b'{"prompt": 5}', 400, "prompt"),
        (b'{"prompt": "x", "n": 0}', 400, "n"),
        (b'{"prompt": "x", "n": "2"}', 400, "n"),
        (b'{"prompt": "x", "temperature": -0.1}', 400, "temperature"),
        (b'{"prompt": "x", "max_tokens": 0}', 400, "max_tokens"),
        (b'{"prompt": "x", "max_tokens": 100000}', 400, "max_tokens"),
        (b'{"prompt": [1, 2, 99999999]}', 400, "prompt"),
        (b'{"prompt": "x", "model": "nope"}', 404, "model"),
        # Field names that begin like pydantic's union tags ("str") keep their name.
        (b'{"prompt": "x", "stream": "yes"}', 400, "stream"),
        (b'{"prompt": "x", "stream_options": "yes"}', 400, "stream_options"),
        # More prompts than the daemon ever admits (max_num_seqs 4 + max_queue 4): a 400,
        # not a 429 that every retry would meet again.
        (b'{"prompt": ["a", "b", "c", "d", "e", "f", "g", "h", "i"]}', 400, "prompt"),
    ],
)
async def test_bad_input(tiny_tokenizer, body, status, param):
    async with (
        live_daemon(fake_config(), fake_engine_factory(tiny_tokenizer, [])) as d,
        aiohttp.ClientSession() as s,
    ):
        async with s.post(f"{d.base_url}/completions", data=body) as r:
            assert r.status == status
            err = (await r.json())["error"]
            assert set(err) == {"message", "type", "param", "code"}
            assert err["param"] == param and err["message"]
        async with s.post(f"{d.base_url}/completions", json={"prompt": "ok"}) as r:
            assert r.status == 200


async def test_body_too_large_and_unknown_route(tiny_tokenizer):
    async with (
        live_daemon(fake_config(max_body_bytes=2048), fake_engine_factory(tiny_tokenizer, [])) as d,
        aiohttp.ClientSession() as s,
    ):
        big = json.dumps({"prompt": "x" * 5000})
        async with s.post(f"{d.base_url}/completions", data=big) as r:
            assert r.status == 413
            assert "too large" in (await r.json())["error"]["message"]
        async with s.get(f"{d.url}/v1/nothing") as r:
            assert r.status == 404
            assert (await r.json())["error"]["code"] == "not_found"


async def test_disconnect_aborts(tiny_tokenizer):
    engines: list[FakeEngine] = []
    factory = fake_engine_factory(tiny_tokenizer, engines, step_delay_s=0.02)
    async with live_daemon(fake_config(), factory) as d, aiohttp.ClientSession() as s:
        body = {"prompt": [1, 2, 3, 4, 5], "max_tokens": 200, "stream": True}
        async with s.post(f"{d.base_url}/completions", json=body) as r:
            await r.content.readline()  # first chunk arrived: the request is running
        for _ in range(100):
            if engines[0].aborted and not engines[0].has_unfinished():
                break
            await asyncio.sleep(0.02)
        assert len(engines[0].aborted) == 1
        assert not engines[0].has_unfinished()
        assert d.daemon.admission.inflight == 0


async def test_flood_gets_429_and_accepted_complete(tiny_tokenizer):
    factory = fake_engine_factory(tiny_tokenizer, [], step_delay_s=0.01)
    async with (
        live_daemon(fake_config(max_num_seqs=2, max_queue=3), factory) as d,
        aiohttp.ClientSession() as s,
    ):

        async def one(i):
            body = {"prompt": [i + 1], "max_tokens": 10}
            async with s.post(f"{d.base_url}/completions", json=body) as r:
                return r.status, r.headers.get("Retry-After"), await r.json()

        results = await asyncio.gather(*(one(i) for i in range(20)))
    ok = [r for r in results if r[0] == 200]
    busy = [r for r in results if r[0] == 429]
    assert len(ok) + len(busy) == 20
    assert 1 <= len(ok) <= 20 and busy, "the flood must hit the bound"
    assert all(r[1] == "1" for r in busy)
    assert all(r[2]["choices"][0]["finish_reason"] == "length" for r in ok)


async def test_publisher_mirrors_engine_and_clears(tiny_tokenizer):
    engines: list[FakeEngine] = []
    index = MemoryKVIndex()
    await index.apply("pod-a", _stale_batch())  # a previous life's entries
    async with (
        live_daemon(fake_config(), fake_engine_factory(tiny_tokenizer, engines), index=index) as d,
        aiohttp.ClientSession() as s,
    ):
        for p in ([1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 9, 9, 1]):
            body = {"prompt": p, "max_tokens": 2}
            async with s.post(f"{d.base_url}/completions", json=body) as r:
                assert r.status == 200
        await _settle(d.daemon.publisher)
        assert index.block_set("pod-a") == engines[0].cached_block_hashes()
        assert len(index.block_set("pod-a")) == 3
        assert "pod-a" in await index.pods()
    assert index.block_set("pod-a") == set()


async def _settle(publisher, timeout=5.0) -> None:
    for _ in range(int(timeout / 0.02)):
        if publisher.idle and not publisher._need_resync:
            await asyncio.sleep(0.05)
            if publisher.idle:
                return
        await asyncio.sleep(0.02)
    raise AssertionError("publisher did not settle")


def _stale_batch():
    from pagefleet.kvindex.events import BlockStored, KVEventBatch

    return KVEventBatch(0.0, 1, [BlockStored([12345], None, [1, 2, 3, 4], 4)])


class _FlakyIndex(MemoryKVIndex):
    """A memory index that can be switched off, failing every call like a dead Redis."""

    def __init__(self) -> None:
        super().__init__()
        self.down = False

    def _check(self) -> None:
        if self.down:
            raise ConnectionError("index down")

    async def apply(self, pod, batch):
        self._check()
        await super().apply(pod, batch)

    async def heartbeat(self, pod, load, ttl_s):
        self._check()
        await super().heartbeat(pod, load, ttl_s)

    async def resync(self, pod, block_hashes):
        self._check()
        # An index that came back empty (Redis restarted without persistence).
        await super().resync(pod, block_hashes)


async def test_publisher_resyncs_after_outage(tiny_tokenizer):
    engines: list[FakeEngine] = []
    index = _FlakyIndex()
    cfg = fake_config(heartbeat_s=0.05)
    async with live_daemon(cfg, fake_engine_factory(tiny_tokenizer, engines), index=index) as d:
        pub = d.daemon.publisher
        pub._backoff_initial_s = 0.02
        async with aiohttp.ClientSession() as s:
            body = {"prompt": [1, 2, 3, 4, 5, 6, 7, 8], "max_tokens": 2}
            async with s.post(f"{d.base_url}/completions", json=body) as r:
                assert r.status == 200
            await _settle(pub)
            index.down = True
            index._pod_blocks.clear()  # the restarted Redis lost everything
            index._block_pods.clear()
            for p in ([5, 5, 5, 5], [6, 6, 6, 6, 6, 6, 6, 6]):  # served while the index is down
                async with s.post(f"{d.base_url}/completions", json={"prompt": p}) as r:
                    assert r.status == 200
            # The publisher learns of the outage on its next write: wait for it (bounded).
            for _ in range(250):
                if not pub.in_sync.is_set():
                    break
                await asyncio.sleep(0.02)
            assert not pub.in_sync.is_set()
            index.down = False
            await asyncio.wait_for(pub.in_sync.wait(), 5)
            await _settle(pub)
        assert pub.resyncs >= 1
        assert index.block_set("pod-a") == engines[0].cached_block_hashes()
        assert len(index.block_set("pod-a")) == 5


async def test_unsupported_fields_are_refused_ignorable_ones_pass_and_long_prompt(
    tiny_tokenizer,
):
    async with (
        live_daemon(fake_config(), fake_engine_factory(tiny_tokenizer, [])) as d,
        aiohttp.ClientSession() as s,
    ):
        # Router-added and bookkeeping fields change nothing: accepted.
        for extra in (
            {"sglang_rid": "abc"},
            {"no_stop_trim": True, "user": "u"},
            {"metadata": {"k": "v"}, "request_id": "x"},
            {"use_beam_search": False},
            {"session_id": "abc"},  # the gateway's session policy reads it from the body
        ):
            body = {"prompt": [1, 2], "max_tokens": 1, **extra}
            async with s.post(f"{d.base_url}/completions", json=body) as r:
                assert r.status == 200, (extra, await r.text())
        # A field that would change the answer and is not implemented: a 400 naming it.
        for extra in ({"frobnicate": 1}, {"truncate_prompt_tokens": 3}):
            body = {"prompt": [1, 2], "max_tokens": 1, **extra}
            async with s.post(f"{d.base_url}/completions", json=body) as r:
                assert r.status == 400, extra
                err = (await r.json())["error"]
                assert err["param"] == next(iter(extra)) and next(iter(extra)) in err["message"]
        body = {
            "messages": [{"role": "user", "content": "hi"}],
            "return_tokens_as_token_ids": True,
        }
        async with s.post(f"{d.base_url}/chat/completions", json=body) as r:
            assert r.status == 400
            assert (await r.json())["error"]["param"] == "return_tokens_as_token_ids"
        # Large enough to be tokenized off the event loop; still refused by length.
        async with s.post(f"{d.base_url}/completions", json={"prompt": "hello " * 4000}) as r:
            assert r.status == 400
            assert (await r.json())["error"]["param"] == "prompt"


async def test_an_unknown_field_sent_as_null_asks_for_nothing(tiny_tokenizer):
    """The openai client sends what it is given: ``reasoning_effort=None`` or ``audio=None``
    go out as JSON null, which OpenAI (and vLLM) take as not set; a 400 naming a field
    whose value asks for nothing fails such clients for no reason."""
    async with (
        live_daemon(fake_config(), fake_engine_factory(tiny_tokenizer, [])) as d,
        aiohttp.ClientSession() as s,
    ):
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                "reasoning_effort": None, "audio": None, "prediction": None,
                "web_search_options": None, "prompt_logprobs": None}  # fmt: skip
        async with s.post(f"{d.base_url}/chat/completions", json=body) as r:
            assert r.status == 200, await r.text()
        body["reasoning_effort"] = "high"  # a value that asks for something: still a 400
        async with s.post(f"{d.base_url}/chat/completions", json=body) as r:
            assert r.status == 400
            assert (await r.json())["error"]["param"] == "reasoning_effort"


async def test_null_for_a_field_with_a_default_means_the_default(tiny_tokenizer):
    """The OpenAI API declares n, stream, logprobs and echo nullable ("integer or null,
    defaults to 1"), and vLLM accepts null for them: clients that write every field send
    "n": null. Those were 400s ("Input should be a valid integer")."""
    async with (
        live_daemon(fake_config(), fake_engine_factory(tiny_tokenizer, [])) as d,
        aiohttp.ClientSession() as s,
    ):
        nulls = {"n": None, "stream": None, "ignore_eos": None, "min_tokens": None}
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                "logprobs": None, **nulls}  # fmt: skip
        cmpl = {"prompt": [1, 2], "max_tokens": 2, "echo": None, **nulls}
        for path, body in (("chat/completions", chat), ("completions", cmpl)):
            async with s.post(f"{d.base_url}/{path}", json=body) as r:
                assert r.status == 200, (path, await r.text())
                out = await r.json()
            (choice,) = out["choices"]  # n: 1, not streamed, no logprobs
            assert choice["logprobs"] is None and out["usage"]["completion_tokens"] == 2
    # A field that can hold null keeps it: max_tokens null is vLLM's "up to the context".
    req = parse_body(CompletionRequest, '{"prompt": "x", "max_tokens": null, "n": null}')
    assert req.max_tokens is None and req.n == 1


async def test_logit_bias_keys_are_ascii_token_ids(tiny_tokenizer):
    """str.isdigit() is true of "²" and "٣": the first failed int() and came back as a 400
    naming param "invalid", the second was read as token 3."""
    async with (
        live_daemon(fake_config(), fake_engine_factory(tiny_tokenizer, [])) as d,
        aiohttp.ClientSession() as s,
    ):
        for key in ("\u00b2", "\u0663", "-1", "1.0", " 5"):
            body = {"prompt": [1, 2], "max_tokens": 1, "logit_bias": {key: 1}}
            async with s.post(f"{d.base_url}/completions", json=body) as r:
                assert r.status == 400, key
                err = (await r.json())["error"]
                assert err["param"] == "logit_bias" and "token ids" in err["message"], err
        body = {"prompt": [1, 2], "max_tokens": 1, "logit_bias": {"07": 1}}
        async with s.post(f"{d.base_url}/completions", json=body) as r:
            assert r.status == 200, await r.text()


async def test_nonstream_disconnect_aborts(tiny_tokenizer):
    engines: list[FakeEngine] = []
    factory = fake_engine_factory(tiny_tokenizer, engines, step_delay_s=0.02)
    async with live_daemon(fake_config(), factory) as d:
        timeout = aiohttp.ClientTimeout(total=0.3)
        async with aiohttp.ClientSession(timeout=timeout) as s:
            with pytest.raises(TimeoutError):
                body = {"prompt": [1, 2, 3], "max_tokens": 200}
                async with s.post(f"{d.base_url}/completions", json=body) as r:
                    await r.read()
        for _ in range(100):
            if engines[0].aborted:
                break
            await asyncio.sleep(0.02)
        assert len(engines[0].aborted) == 1
        assert d.daemon.admission.inflight == 0


def test_cli_accepts_pd_roles():
    from pagefleet.daemon.cli import command

    for role in ("prefill", "decode"):
        ctx = command.make_context(
            "daemon", ["--role", role, "--kv-transfer-timeout", "5", "--kv-pull-timeout", "2"]
        )
        assert ctx.params["role"] == role
        assert ctx.params["kv_transfer_timeout_s"] == 5.0
        assert ctx.params["kv_pull_timeout_s"] == 2.0


async def test_drain_past_grace_aborts_and_ends_streams(tiny_tokenizer):
    engines: list[FakeEngine] = []
    factory = fake_engine_factory(tiny_tokenizer, engines, step_delay_s=0.02)
    async with live_daemon(fake_config(), factory) as d, aiohttp.ClientSession() as s:
        body = {"prompt": [1, 2, 3], "max_tokens": 200, "stream": True}
        async with s.post(f"{d.base_url}/completions", json=body) as r:
            await r.content.readline()
            drain = asyncio.create_task(d.daemon.drain(grace_s=0.2))
            async with s.get(f"{d.url}/ready") as rr:
                assert rr.status == 503
            rest = (await r.read()).decode()
            await drain
        assert '"finish_reason":"abort"' in rest
        assert rest.rstrip().endswith("data: [DONE]")
        assert engines[0].aborted and d.daemon.admission.inflight == 0


async def test_engine_crash_fails_requests_and_health(tiny_tokenizer):
    factory = fake_engine_factory(tiny_tokenizer, [], crash_at_step=2)
    async with live_daemon(fake_config(), factory) as d, aiohttp.ClientSession() as s:
        body = {"prompt": [1, 2, 3], "max_tokens": 50}
        async with s.post(f"{d.base_url}/completions", json=body) as r:
            assert r.status == 503
            assert "crashed" in (await r.json())["error"]["message"]
        async with s.get(f"{d.url}/health") as r:
            assert r.status == 503
        async with s.get(f"{d.url}/ready") as r:
            assert r.status == 503
        async with s.post(f"{d.base_url}/completions", json=body) as r:
            assert r.status == 503  # refused at once, not hung


async def test_hung_engine_thread_fails_health_and_ends_the_daemon(tiny_tokenizer):
    """Thread mode (--no-engine-process): a step that never returns, while a request is in
    flight, is a hang past --engine-hang-timeout: the stream ends, /health fails and the
    daemon is told to exit. Idle longer than the timeout, or stepping slower than it in
    total but faster than it per step, is no hang."""
    timeout, step_s, hang_at = 0.6, 0.2, 8
    release = threading.Event()
    factory = fake_engine_factory(tiny_tokenizer, [], step_delay_s=step_s, hang_at_step=hang_at,
                                  hang_until=release)  # fmt: skip
    try:
        async with live_daemon(fake_config(engine_hang_timeout_s=timeout), factory) as d:
            assert not d.daemon.engine_process
            async with aiohttp.ClientSession() as s:
                await asyncio.sleep(2 * timeout)  # idle: nothing owed, no hang
                async with s.get(f"{d.url}/health") as r:
                    assert r.status == 200
                body = {"prompt": [1, 2, 3], "max_tokens": 50, "stream": True}
                t0 = time.monotonic()
                async with s.post(f"{d.base_url}/completions", json=body) as r:
                    assert r.status == 200
                    unhealthy = None
                    while unhealthy is None and time.monotonic() - t0 < 10:
                        async with s.get(f"{d.url}/health") as h:
                            if h.status == 503:
                                unhealthy = time.monotonic() - t0
                        await asyncio.sleep(0.05)
                    rest = (await asyncio.wait_for(r.read(), 5)).decode()
            # 8 steps of 0.2 s (1.6 s, longer than the timeout) were progress, not a hang.
            assert unhealthy is not None, "a hung engine thread never failed /health"
            assert hang_at * step_s + timeout < unhealthy < hang_at * step_s + timeout + 2
            assert '"finish_reason":"length"' not in rest and "hung" in rest
            assert d.daemon.engine_died.is_set()
            assert d.daemon.engine_loop is not None
            assert "the engine thread hung" in d.daemon.engine_loop.end_reason()
    finally:
        release.set()


async def test_side_call_replies_do_not_hide_a_hung_engine_thread(tiny_tokenizer):
    """Side calls (a prefill pod's exported-KV reads for decode pods' pulls) are answered
    on threads of their own, so their replies say nothing of the engine thread: a step that
    never returns is still a hang while pulls keep arriving. Each reply used to count as
    the engine being heard from, so a steady trickle of pulls kept /health at 200."""
    timeout = 0.6
    release = threading.Event()
    factory = fake_engine_factory(tiny_tokenizer, [], step_delay_s=0.05, hang_at_step=2,
                                  hang_until=release)  # fmt: skip
    try:
        async with live_daemon(fake_config(engine_hang_timeout_s=timeout), factory) as d:
            loop = d.daemon.engine_loop
            assert loop is not None
            async with aiohttp.ClientSession() as s:
                body = {"prompt": [1, 2, 3], "max_tokens": 50, "stream": True}
                t0 = time.monotonic()
                async with s.post(f"{d.base_url}/completions", json=body) as r:
                    assert r.status == 200
                    unhealthy = None
                    while unhealthy is None and time.monotonic() - t0 < 6:
                        with contextlib.suppress(Exception):  # no such handle: still a reply
                            await loop.side("export_handles")
                        async with s.get(f"{d.url}/health") as h:
                            if h.status == 503:
                                unhealthy = time.monotonic() - t0
                        await asyncio.sleep(0.1)
            assert unhealthy is not None, "side-call replies kept a hung engine healthy"
    finally:
        release.set()


async def test_a_body_its_content_encoding_does_not_decode_is_a_400(tiny_tokenizer):
    body = json.dumps({"prompt": "hi", "max_tokens": 1}).encode()
    gz = {"Content-Encoding": "gzip", "Content-Type": "application/json"}
    async with (
        live_daemon(fake_config(), fake_engine_factory(tiny_tokenizer, [])) as d,
        aiohttp.ClientSession() as s,
    ):
        async with s.post(f"{d.base_url}/completions", data=gzip.compress(body), headers=gz) as r:
            assert r.status == 200
        async with s.post(f"{d.base_url}/completions", data=body, headers=gz) as r:
            assert r.status == 400  # was a 500 "see the daemon's log"
            assert "Content-Encoding" in (await r.json())["error"]["message"]


async def test_a_non_text_content_part_is_refused_by_chat_and_its_render(tiny_tokenizer):
    part = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, part]}]}
    async with (
        live_daemon(fake_config(), fake_engine_factory(tiny_tokenizer, [])) as d,
        aiohttp.ClientSession() as s,
    ):
        for path in ("/chat/completions", "/chat/completions/render"):
            async with s.post(d.base_url + path, json=body) as r:
                assert r.status == 400, path  # render dropped the image to "" silently
                assert (await r.json())["error"]["param"] == "messages.0.content"
