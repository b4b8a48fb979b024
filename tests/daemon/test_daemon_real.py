"""The daemon on the real engine and the tiny model, driven by the official openai client.

One daemon serves the whole module (loading the model once keeps the file fast).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path

import aiohttp
import openai
import pytest
import pytest_asyncio

from pagefleet.daemon.config import DaemonConfig
from pagefleet.dev.process import free_port

from .conftest import LiveDaemon, live_daemon

pytestmark = pytest.mark.asyncio(loop_scope="module")

MODEL = "tiny-test"
PROMPT = "The quick brown fox jumps over the lazy dog and then"


def config(**kw) -> DaemonConfig:
    base = dict(model="tiny", served_model_name=MODEL, port=free_port(), pod_name="pod-r",
                block_size=8, num_gpu_blocks=96, max_model_len=256, max_num_seqs=8,
                max_queue=8, cost_per_hour=2.5)  # fmt: skip
    base.update(kw)
    return DaemonConfig(**base)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def live(tmp_path_factory):
    log = tmp_path_factory.mktemp("reqlog") / "requests.jsonl"
    async with live_daemon(config(request_log=str(log))) as d:
        yield d


@pytest_asyncio.fixture(loop_scope="module")
async def client(live: LiveDaemon):
    c = openai.AsyncOpenAI(base_url=live.base_url, api_key="none", max_retries=0)
    yield c
    await c.close()


async def metrics_text(live: LiveDaemon) -> str:
    async with aiohttp.ClientSession() as s, s.get(f"{live.url}/metrics") as r:
        assert r.status == 200
        return await r.text()


def sample(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.M)
    assert m, f"{name} missing from /metrics"
    return float(m.group(1))


async def test_completion_usage_and_cached_tokens(client):
    first = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0)
    assert first.choices[0].finish_reason in ("length", "stop")
    assert first.usage.completion_tokens == 5 or first.choices[0].finish_reason == "stop"
    n_prompt = first.usage.prompt_tokens
    assert n_prompt > 8
    again = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0)
    assert again.choices[0].text == first.choices[0].text  # greedy is deterministic
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached == (n_prompt - 1) // 8 * 8 or cached == n_prompt // 8 * 8
    assert cached >= 8


async def test_chat_and_stream_equals_nonstream(client):
    msgs = [{"role": "user", "content": "Tell me a story about a cat."}]
    full = await client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=12, temperature=0.9, seed=7
    )
    assert full.choices[0].message.role == "assistant"
    text = full.choices[0].message.content
    assert text
    stream = await client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=12, temperature=0.9, seed=7, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    parts, usage, finish = [], None, None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            parts.append(ch.delta.content or "")
            finish = ch.finish_reason or finish
    assert "".join(parts) == text
    assert finish == full.choices[0].finish_reason
    assert usage.completion_tokens == full.usage.completion_tokens
    assert usage.prompt_tokens == full.usage.prompt_tokens


async def test_completion_stream_equals_nonstream(client):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=1.0, seed=123)
    full = await client.completions.create(**kw)
    parts = [c.choices[0].text async for c in await client.completions.create(stream=True, **kw)
             if c.choices]  # fmt: skip
    assert "".join(parts) == full.choices[0].text


async def test_n3_and_seed(client):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0, n=3, seed=42)
    a = await client.completions.create(**kw)
    b = await client.completions.create(**kw)
    assert sorted(c.index for c in a.choices) == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert len({c.text for c in a.choices}) > 1, "n samples should differ at temperature 1"
    assert a.usage.completion_tokens == sum(
        8 if c.finish_reason == "length" else 1 for c in a.choices
    ) or all(c.finish_reason in ("length", "stop") for c in a.choices)
    other = await client.completions.create(**{**kw, "seed": 43})
    assert [c.text for c in other.choices] != [c.text for c in a.choices]


async def test_stop_string(client):
    base = await client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
    )
    text = base.choices[0].text
    assert len(text) > 4
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    cut = await client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop],
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[: text.index(stop)]


async def test_logprobs(client):
    c = await client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == 4 == len(lp.token_logprobs) == len(lp.top_logprobs)
    assert all(v <= 0 for v in lp.token_logprobs)
    assert all(1 <= len(t) <= 2 for t in lp.top_logprobs)
    # Greedy: the sampled token is the most likely one.
    assert all(
        abs(max(t.values()) - v) < 1e-4
        for t, v in zip(lp.top_logprobs, lp.token_logprobs, strict=True)
    )
    assert "".join(lp.tokens) == c.choices[0].text
    chat = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3, temperature=0,
        logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True},
    )  # fmt: skip
    content = chat.choices[0].logprobs.content
    assert len(content) == 3
    assert all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in content)


async def test_echo_returns_the_prompt_and_scores_it_with_logprobs(client, live):
    """echo puts the prompt before the output, whole and streamed. With logprobs the prompt
    tokens' logprobs come first, as OpenAI's (the first null), with text offsets into the
    echoed text; max_tokens 0 scores the prompt alone (lm-eval's loglikelihood requests).
    Echo with logprobs used to be a 400: the engine computed no logprobs for the prompt."""
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0,
              extra_body={"ignore_eos": True})  # fmt: skip
    plain = await client.completions.create(**kw)
    echoed = await client.completions.create(echo=True, **kw)
    text = echoed.choices[0].text
    assert text == PROMPT + plain.choices[0].text
    parts = [c async for c in await client.completions.create(echo=True, stream=True, **kw)]
    streamed = "".join(c.choices[0].text for c in parts if c.choices)
    assert streamed == text

    body = {"model": MODEL, "prompt": PROMPT}
    async with aiohttp.ClientSession() as s, s.post(f"{live.url}/tokenize", json=body) as r:
        ids = (await r.json())["tokens"]
    n_prompt = len(ids)
    out = (await client.completions.create(logprobs=2, **kw)).choices[0].logprobs
    whole = await client.completions.create(echo=True, logprobs=2, **kw)
    choice = whole.choices[0]
    lp = choice.logprobs
    assert choice.text == text
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == n_prompt + 4
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    assert all(len(t) >= 1 for t in lp.top_logprobs[1:])
    # The output's part is what the same request without echo returns.
    assert lp.tokens[n_prompt:] == out.tokens
    assert lp.token_logprobs[n_prompt:] == pytest.approx(out.token_logprobs, abs=1e-4)
    # Offsets index the echoed text: every prompt token after the BOS the tokenizer adds
    # sits where its text is, and the output starts where the prompt ends.
    assert lp.text_offset == sorted(lp.text_offset)
    for tok, off in zip(lp.tokens[1:n_prompt], lp.text_offset[1:n_prompt], strict=True):
        assert text[off : off + len(tok)] == tok
    assert lp.text_offset[n_prompt] == len(PROMPT)

    # Scoring prompt + continuation (max_tokens 0, as lm-eval) gives the continuation's
    # tokens the logprobs they had when generated: the prompt path agrees with decoding.
    gen = await client.completions.create(
        model=MODEL,
        prompt=ids,
        max_tokens=4,
        temperature=0,
        logprobs=0,
        extra_body={"ignore_eos": True},
    )
    body = {"model": MODEL, "prompt": PROMPT + gen.choices[0].text}
    async with aiohttp.ClientSession() as s, s.post(f"{live.url}/tokenize", json=body) as r:
        full = (await r.json())["tokens"]
    scored = await client.completions.create(
        model=MODEL, prompt=full, max_tokens=0, echo=True, logprobs=1
    )
    sc = scored.choices[0]
    assert sc.finish_reason == "length" and scored.usage.completion_tokens == 0
    assert sc.text == "<s>" + PROMPT + gen.choices[0].text  # ids echo their special tokens
    assert len(sc.logprobs.tokens) == len(full)
    # The continuation re-tokenizes as generated (greedy, so this holds run to run).
    assert full[:n_prompt] == ids and len(full) == n_prompt + 4
    assert sc.logprobs.tokens[n_prompt:] == gen.choices[0].logprobs.tokens
    assert sc.logprobs.token_logprobs[n_prompt:] == pytest.approx(
        gen.choices[0].logprobs.token_logprobs, abs=1e-4
    )

    # Streamed: the echo chunk carries the prompt's logprobs; joined, the stream's
    # logprobs are the whole answer's.
    for max_tokens in (4, 0):
        args = {**kw, "max_tokens": max_tokens}
        ref = (await client.completions.create(echo=True, logprobs=2, **args)).choices[0]
        chunks = [
            c.choices[0]
            async for c in await client.completions.create(
                echo=True, logprobs=2, stream=True, **args
            )
            if c.choices
        ]
        assert chunks[0].text.startswith(PROMPT)
        assert chunks[0].logprobs.token_logprobs[0] is None
        tokens, lps, offsets = [], [], []
        for c in chunks:
            if c.logprobs:
                tokens += c.logprobs.tokens
                lps += c.logprobs.token_logprobs
                offsets += c.logprobs.text_offset
        assert "".join(c.text for c in chunks) == ref.text
        assert tokens == ref.logprobs.tokens and offsets == ref.logprobs.text_offset
        assert lps[0] is None and lps[1:] == pytest.approx(ref.logprobs.token_logprobs[1:])
        assert chunks[-1].finish_reason == "length"
        if max_tokens == 0:
            assert ref.text == PROMPT and len(tokens) == n_prompt

    # n samples: each choice's first chunk carries the echo and the prompt's logprobs.
    firsts: dict[int, object] = {}
    async for c in await client.completions.create(
        echo=True, logprobs=1, stream=True, n=2, **{**kw, "temperature": 1.0}
    ):
        for ch in c.choices:
            firsts.setdefault(ch.index, ch)
    assert sorted(firsts) == [0, 1]
    for ch in firsts.values():
        assert ch.text.startswith(PROMPT) and ch.logprobs.token_logprobs[0] is None
        assert ch.logprobs.tokens[:n_prompt] == lp.tokens[:n_prompt]

    # max_tokens 0 means nothing without echo: a 400 naming it.
    with pytest.raises(openai.BadRequestError) as e:
        await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0)
    assert e.value.body["param"] == "max_tokens", e.value.body


async def test_prompt_logprobs_as_vllm_returns_them(client):
    """vLLM's ``prompt_logprobs``: per completion choice (on the chat response), None for
    the first token, then token id -> {logprob, rank, decoded_token} of the prompt token
    and the top k; refused with stream, as vLLM."""
    r = await client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0, n=2,
        extra_body={"prompt_logprobs": 3},
    )  # fmt: skip
    n_prompt = r.usage.prompt_tokens
    first = r.choices[0].prompt_logprobs
    assert len(first) == n_prompt and first[0] is None
    assert r.choices[1].prompt_logprobs == first  # one prompt, n samples
    for entry in first[1:]:
        assert 3 <= len(entry) <= 4  # the prompt token, and the top 3
        ranks = sorted(v["rank"] for v in entry.values())
        assert ranks[:3] == [1, 2, 3] or ranks[0] == 1
        assert all(
            v["logprob"] <= 0 and isinstance(v["decoded_token"], str) for v in entry.values()
        )
    # The legacy echo logprobs and vLLM's agree on every prompt token.
    e = await client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=0,
        extra_body={"prompt_logprobs": 0},
    )  # fmt: skip
    c = e.choices[0]
    for i, entry in enumerate(c.prompt_logprobs[1:], start=1):
        (only,) = entry.values()  # prompt_logprobs 0: the prompt token alone
        assert only["logprob"] == pytest.approx(c.logprobs.token_logprobs[i], abs=1e-6)
        assert only["decoded_token"] == c.logprobs.tokens[i]
    chat = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1,
        extra_body={"prompt_logprobs": 1},
    )  # fmt: skip
    plp = chat.model_extra["prompt_logprobs"]
    assert len(plp) == chat.usage.prompt_tokens and plp[0] is None
    assert all(1 <= len(x) <= 2 for x in plp[1:])
    # vLLM's chat echo with logprobs: the prompt's logprobs (top_logprobs of each) come in
    # prompt_logprobs, as if asked for; they were missing, so the echoed text had none.
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The fox"}]
    cont = {"echo": True, "add_generation_prompt": False, "continue_final_message": True}
    kw = dict(model=MODEL, messages=msgs, max_tokens=2, temperature=0, logprobs=True)
    echoed = await client.chat.completions.create(**kw, top_logprobs=2, extra_body=cont)
    asked = await client.chat.completions.create(
        **kw, top_logprobs=2, extra_body={**cont, "prompt_logprobs": 2}
    )
    plp = echoed.model_extra["prompt_logprobs"]
    assert plp == asked.model_extra["prompt_logprobs"]
    assert len(plp) == echoed.usage.prompt_tokens and plp[0] is None
    assert all(2 <= len(x) <= 3 for x in plp[1:])
    assert echoed.choices[0].message.content.startswith("The fox")
    # Not asked for without logprobs, nor when streamed (vLLM streams none).
    plain = await client.chat.completions.create(**{**kw, "logprobs": False}, extra_body=cont)
    assert plain.model_extra.get("prompt_logprobs") is None
    stream = await client.chat.completions.create(**kw, stream=True, extra_body=cont)
    streamed = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert streamed == echoed.choices[0].message.content
    for call in (
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, stream=True,
                                  extra_body={"prompt_logprobs": 1}),
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=1, stream=True,
                                       extra_body={"prompt_logprobs": 1}),
    ):  # fmt: skip
        with pytest.raises(openai.BadRequestError) as err:
            await call
        assert err.value.body["param"] == "prompt_logprobs"


async def test_bad_inputs_on_real_engine(client, live):
    with pytest.raises(openai.BadRequestError) as e:
        await client.completions.create(model=MODEL, prompt="word " * 400, max_tokens=4)
    assert e.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as e:
        await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=250)
    assert e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError):
        await client.completions.create(model="other", prompt=PROMPT)
    with pytest.raises(openai.BadRequestError) as e:
        await client.chat.completions.create(model=MODEL, messages=[], max_tokens=2)
    assert e.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError):
        await client.completions.create(model=MODEL, prompt=PROMPT, temperature=-1)
    # n above max_num_seqs (8): the engine refuses it, naming n rather than the prompt.
    with pytest.raises(openai.BadRequestError) as e:
        await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, n=9)
    assert e.value.body["param"] == "n"
    assert "max_num_seqs" in e.value.body["message"]
    ok = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    assert ok.choices[0].text is not None


async def test_disconnect_mid_stream_frees_blocks(live):
    total = sample(await metrics_text(live), "pagefleet:kv_cache_num_blocks")
    async with aiohttp.ClientSession() as s:
        body = {"model": MODEL, "prompt": PROMPT * 3, "max_tokens": 200, "stream": True,
                "ignore_eos": True}  # fmt: skip
        async with s.post(f"{live.base_url}/completions", json=body) as r:
            assert r.status == 200
            seen = 0
            while seen < 3:  # three chunks: the request is decoding
                line = await r.content.readline()
                assert line.startswith(b"data: ") or line == b"\n"
                seen += line.startswith(b"data: ")
            mid = await metrics_text(live)
            assert sample(mid, "vllm:num_requests_running") == 1
            assert sample(mid, "vllm:kv_cache_usage_perc") > 0
    for _ in range(100):
        text = await metrics_text(live)
        if sample(text, "vllm:kv_cache_usage_perc") == 0:
            break
        await asyncio.sleep(0.05)
    assert sample(text, "vllm:kv_cache_usage_perc") == 0
    assert sample(text, "vllm:num_requests_running") == 0
    assert sample(text, "pagefleet:kv_cache_free_blocks") == total
    assert live.daemon.admission.inflight == 0
    stats = await live.daemon.engine_loop.stats()
    assert stats.num_free_blocks == stats.num_blocks


async def test_metrics_names_after_traffic(client, live):
    await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4)
    text = await metrics_text(live)
    for name in [
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:request_time_per_output_token_seconds_count",
        "vllm:inter_token_latency_seconds_count", "vllm:e2e_request_latency_seconds_count",
        "vllm:request_queue_time_seconds_count", "vllm:request_prefill_time_seconds_count",
        "vllm:request_decode_time_seconds_count", "vllm:num_requests_running",
        "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc",
        "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
        "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
        "vllm:num_preemptions_total", "vllm:request_success_total",
    ]:  # fmt: skip
        assert re.search(rf"^{re.escape(name)}\{{", text, re.M), name
    assert f'model_name="{MODEL}"' in text and 'role="unified"' in text and 'pod="pod-r"' in text
    assert sample(text, "vllm:e2e_request_latency_seconds_count") >= 1
    assert sample(text, "vllm:prompt_tokens_total") > 0
    assert sample(text, "vllm:prefix_cache_hits_total") > 0  # the repeated prompt above hit


async def test_probes_models_tokenize(live):
    async with aiohttp.ClientSession() as s:
        for path in ("/health", "/ready", "/version", "/get_model_info", "/get_server_info"):
            async with s.get(live.url + path) as r:
                assert r.status == 200, path
        async with s.get(f"{live.base_url}/models") as r:
            data = (await r.json())["data"]
            assert data[0]["id"] == MODEL and data[0]["max_model_len"] == 256
        async with s.post(f"{live.url}/tokenize", json={"prompt": PROMPT}) as r:
            tok = await r.json()
            assert tok["count"] == len(tok["tokens"]) > 0 and tok["max_model_len"] == 256
        async with s.post(f"{live.url}/detokenize", json={"tokens": tok["tokens"]}) as r:
            assert PROMPT in (await r.json())["prompt"]


async def test_what_the_peer_routers_ask_of_a_worker(live, caplog):
    """sglang-router reads /model_info and /server_info (model_path); vllm-router renders
    prompts with /v1/completions/render; both get answers, not 404s."""
    async with aiohttp.ClientSession() as s:
        for path in ("/model_info", "/server_info"):
            async with s.get(live.url + path) as r:
                assert r.status == 200, path
                info = await r.json()
                assert info["model_path"] == "tiny", path
        async with s.post(f"{live.url}/tokenize", json={"prompt": PROMPT}) as r:
            want = (await r.json())["tokens"]
        rendered = []
        for prompt in ([PROMPT, "and then"], want[:5]):
            body = {"model": MODEL, "prompt": prompt}
            async with s.post(f"{live.base_url}/completions/render", json=body) as r:
                assert r.status == 200, await r.text()
                rendered += await r.json()
        assert len(rendered) == 3
        assert rendered[0]["prompt_token_ids"] == want and rendered[0]["prompt"] == PROMPT
        assert rendered[2]["prompt_token_ids"] == want[:5]
        msgs = [{"role": "user", "content": "Hello there"}]
        async with s.post(f"{live.url}/tokenize", json={"messages": msgs}) as r:
            chat_ids = (await r.json())["tokens"]
        body = {"model": MODEL, "messages": msgs}
        async with s.post(f"{live.base_url}/chat/completions/render", json=body) as r:
            conversation, prompts = await r.json()
        assert conversation == msgs and prompts[0]["prompt_token_ids"] == chat_ids
        assert "Hello there" in prompts[0]["prompt"]
        async with s.post(
            f"{live.base_url}/completions/render", json={"model": "other", "prompt": "x"}
        ) as r:
            assert r.status == 404 and "error" in await r.json()
        # Ids past the vocabulary: the 400 the generation endpoints give, not a silently
        # shortened text (5000) or a 500 from the tokenizer (2**64).
        for bad in ([5000, 3], [2**64]):
            body = {"model": MODEL, "prompt": bad}
            async with s.post(f"{live.base_url}/completions/render", json=body) as r:
                assert r.status == 400 and (await r.json())["error"]["param"] == "prompt"
    # An HTTP/2 connection preface: a plain 400, and no stack trace at ERROR.
    caplog.clear()
    host, port = live.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
    await writer.drain()
    head = await asyncio.wait_for(reader.read(64), 10)
    writer.close()
    assert re.match(rb"HTTP/1\.[01] 400 ", head), head
    await asyncio.sleep(0.05)
    assert not [r for r in caplog.records if r.levelno >= 40], caplog.text


async def test_sampling_controls_reach_the_engine(client):
    """logit_bias, penalties and bad_words through the official client change the answer."""
    base = dict(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0,
                extra_body={"ignore_eos": True})  # fmt: skip
    plain = await client.completions.create(**base)
    biased = await client.completions.create(**base, logit_bias={"77": 100})
    assert biased.choices[0].text != plain.choices[0].text
    repeated = await client.completions.create(**base, logit_bias={"77": 100}, logprobs=0)
    toks = repeated.choices[0].logprobs.tokens
    assert len(toks) == 6 and len(set(toks)) == 1
    penal = await client.completions.create(
        **{**base, "extra_body": {"ignore_eos": True, "repetition_penalty": 1.8}},
        presence_penalty=1.5, frequency_penalty=1.0, logit_bias={"77": 4},
    )  # fmt: skip
    assert penal.choices[0].text != biased.choices[0].text
    with pytest.raises(openai.BadRequestError) as e:
        await client.completions.create(**base, logit_bias={"999999": 1})
    assert e.value.body["param"] == "logit_bias"
    # Past OpenAI's range a bias is clamped to it, as vLLM does (it was a 400 here): 1000
    # forces the token as 100 does, -1000 bans it as -100 does, chat and completions alike.
    for bias in (1000, -1000):
        clamped = 100 if bias > 0 else -100
        far = await client.completions.create(**base, logit_bias={"77": bias}, logprobs=0)
        edge = await client.completions.create(**base, logit_bias={"77": clamped}, logprobs=0)
        assert far.choices[0].logprobs.tokens == edge.choices[0].logprobs.tokens
        assert (far.choices[0].logprobs.tokens == toks) == (bias > 0)
        msgs = [{"role": "user", "content": PROMPT}]
        chat = dict(model=MODEL, messages=msgs, max_tokens=6, temperature=0, logprobs=True)
        far = await client.chat.completions.create(**chat, logit_bias={"77": bias})
        edge = await client.chat.completions.create(**chat, logit_bias={"77": clamped})
        far_ids = [t.token for t in far.choices[0].logprobs.content]
        assert far_ids == [t.token for t in edge.choices[0].logprobs.content]
    with pytest.raises(openai.BadRequestError) as e:
        await client.completions.create(**base, presence_penalty=2.5)
    assert e.value.body["param"] == "presence_penalty"
    with pytest.raises(openai.BadRequestError) as e:
        await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
            response_format={"type": "json_object"}, extra_body={"truncate_prompt_tokens": 1},
        )  # fmt: skip
    assert e.value.body["param"] in {"response_format", "truncate_prompt_tokens"}


async def test_structured_output_through_the_openai_client(client):
    """response_format json_schema (whole and streamed), guided_choice and guided_regex on
    the random-weight model: only the constraint makes the output valid."""
    schema = {"type": "object", "additionalProperties": False, "required": ["n", "ok"],
              "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                             "ok": {"type": "boolean"}}}  # fmt: skip
    fmt = {"type": "json_schema", "json_schema": {"name": "t", "schema": schema}}
    msgs = [{"role": "user", "content": "Give me JSON"}]
    whole = await client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=40, temperature=1.0, seed=5, n=2,
        response_format=fmt,
    )  # fmt: skip
    streamed = await client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=40, temperature=1.0, seed=5, n=2,
        response_format=fmt, stream=True,
    )  # fmt: skip
    texts = ["", ""]
    async for chunk in streamed:
        for ch in chunk.choices:
            texts[ch.index] += ch.delta.content or ""
    assert texts == [c.message.content for c in whole.choices]
    for text in texts:
        obj = json.loads(text)
        assert set(obj) == {"n", "ok"} and type(obj["n"]) is int and 0 <= obj["n"] <= 99
        assert isinstance(obj["ok"], bool)
    obj_fmt = await client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=40, temperature=0,
        response_format={"type": "json_object"}, logit_bias={},
        extra_body={"guided_json": None},
    )  # fmt: skip
    assert obj_fmt.choices[0].message.content.startswith("{")
    choice = await client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0,
        extra_body={"guided_choice": ["alpha", "beta"]},
    )  # fmt: skip
    assert choice.choices[0].text in ("alpha", "beta")
    regex = await client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0.7, seed=1,
        extra_body={"guided_regex": r"\d{3}-[a-c]{2}"},
    )  # fmt: skip
    assert re.fullmatch(r"\d{3}-[a-c]{2}", regex.choices[0].text)
    for extra, param in (
        ({"guided_regex": "(", "guided_choice": ["a"]}, "response_format"),  # two at once
        ({"guided_json": "{bad"}, "guided_json"),  # a bad spec: the field that sent it
        ({"guided_regex": "("}, "guided_regex"),
    ):
        with pytest.raises(openai.BadRequestError) as e:
            await client.completions.create(model=MODEL, prompt=PROMPT, extra_body=extra)
        assert e.value.body["param"] == param, extra


async def test_tools_need_a_template_that_shows_them(client):
    msgs = [{"role": "user", "content": "weather?"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    with pytest.raises(openai.BadRequestError) as e:
        await client.chat.completions.create(
            model=MODEL, messages=msgs, tools=tools, tool_choice="required", max_tokens=4
        )
    assert e.value.body["param"] == "tools" and "template" in e.value.body["message"]


async def test_forced_tool_calls_are_openai_shaped(tmp_path):
    """A copy of the tiny checkpoint whose template renders tools: tool_choice "required"
    and a named function yield tool_calls whose arguments match the function's schema."""
    import shutil

    from pagefleet.engine.loader import resolve_model

    ckpt = tmp_path / "tiny-tools"
    shutil.copytree(resolve_model("tiny"), ckpt)
    cfg_path = ckpt / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = (
        "{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
        + cfg["chat_template"]
    )
    cfg_path.write_text(json.dumps(cfg))
    weather = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
               "properties": {"city": {"enum": ["Paris", "Oslo"]},
                              "days": {"type": "integer", "minimum": 1, "maximum": 7}}}  # fmt: skip
    tools = [
        {"type": "function", "function": {"name": "get_weather", "parameters": weather}},
        {"type": "function", "function": {"name": "get_time",
                                          "parameters": {"type": "object", "properties": {},
                                                         "additionalProperties": False}}},
    ]  # fmt: skip
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    async with live_daemon(config(model=str(ckpt), max_model_len=1024, num_gpu_blocks=512)) as d:
        c = openai.AsyncOpenAI(base_url=d.base_url, api_key="none", max_retries=0)
        named = await c.chat.completions.create(
            model=MODEL, messages=msgs, tools=tools, max_tokens=120, temperature=0,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
        )  # fmt: skip
        ch = named.choices[0]
        # A named call ends with "stop", as OpenAI's and vLLM's ("tool_calls" is for the
        # calls the model chose: auto and required).
        assert ch.finish_reason == "stop" and ch.message.content is None
        (call,) = ch.message.tool_calls
        assert call.type == "function" and call.function.name == "get_weather"
        args = json.loads(call.function.arguments)
        assert args["city"] in ("Paris", "Oslo") and 1 <= args["days"] <= 7
        required = await c.chat.completions.create(
            model=MODEL, messages=msgs, tools=tools, max_tokens=120, temperature=1.0, seed=3,
            n=3, tool_choice="required",
        )  # fmt: skip
        for ch in required.choices:
            assert ch.message.tool_calls[0].function.name in ("get_weather", "get_time")
            assert ch.finish_reason == "tool_calls"
        # Streamed as OpenAI does: id, type and name first, then the arguments piece by
        # piece; the official client's accumulation gives the non-streamed call back.
        async with c.chat.completions.stream(
            model=MODEL, messages=msgs, tools=tools, max_tokens=120, temperature=0,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
        ) as stream:  # fmt: skip
            pieces, chunk_calls, empty = [], [], 0
            async for event in stream:
                if event.type == "chunk" and event.chunk.choices:
                    chunk_calls += event.chunk.choices[0].delta.tool_calls or []
                    # Each chunk says something (OpenAI sends no empty deltas mid-stream).
                    ch = event.chunk.choices[0]
                    empty += not ch.delta.model_dump(exclude_none=True) and not ch.finish_reason
                elif event.type == "tool_calls.function.arguments.delta":
                    pieces.append(event.arguments_delta)
            final = await stream.get_final_completion()
        assert empty == 0, f"{empty} chunks with an empty delta"
        head, *rest = chunk_calls
        assert head.id and head.type == "function" and head.function.name == "get_weather"
        assert rest and all(tc.id is None and tc.function.name is None for tc in rest)
        assert len([p for p in pieces if p]) > 3, pieces  # not one chunk
        (streamed,) = final.choices[0].message.tool_calls
        assert final.choices[0].finish_reason == "stop"
        assert streamed.function.name == "get_weather"
        assert streamed.function.arguments == call.function.arguments  # the same text
        auto = await c.chat.completions.create(
            model=MODEL, messages=msgs, tools=tools, max_tokens=5, temperature=0
        )
        assert auto.choices[0].message.content is not None  # "auto" may answer in text
        with pytest.raises(openai.BadRequestError) as e:
            await c.chat.completions.create(
                model=MODEL, messages=msgs, tools=tools, max_tokens=5,
                tool_choice={"type": "function", "function": {"name": "nope"}},
            )  # fmt: skip
        assert e.value.body["param"] == "tool_choice"
        # A tool whose parameters are not a schema the grammar compiles: the 400 names
        # tools (the caller sent no response_format).
        bad = [{"type": "function", "function": {"name": "f", "parameters": {"type": "foo"}}}]
        with pytest.raises(openai.BadRequestError) as e:
            await c.chat.completions.create(
                model=MODEL, messages=msgs, tools=bad, max_tokens=5, tool_choice="required"
            )
        assert e.value.body["param"] == "tools", e.value.body
        # A forced call with two output constraints besides: a 400, not a 500.
        with pytest.raises(openai.BadRequestError) as e:
            await c.chat.completions.create(
                model=MODEL, messages=msgs, tools=tools, max_tokens=5, tool_choice="required",
                extra_body={"guided_regex": "a", "guided_choice": ["a"]},
            )  # fmt: skip
        assert "at most one" in e.value.body["message"]
        # Cut short by max_tokens inside the arguments: whole and streamed answers agree,
        # a call of the named function whose arguments are the text so far (as vLLM and
        # OpenAI answer); the whole one gave the raw JSON text as content instead.
        short = named.usage.completion_tokens - 3
        weather = {"type": "function", "function": {"name": "get_weather"}}
        kw = dict(model=MODEL, messages=msgs, tools=tools, max_tokens=short, temperature=0,
                  tool_choice=weather)  # fmt: skip
        cut = (await c.chat.completions.create(**kw)).choices[0]
        assert cut.finish_reason == "length" and cut.message.content is None, cut
        (cut_call,) = cut.message.tool_calls
        assert cut_call.function.name == "get_weather"
        assert call.function.arguments.startswith(cut_call.function.arguments)
        assert cut_call.function.arguments != call.function.arguments
        names, args, finish = [], "", None
        async for chunk in await c.chat.completions.create(stream=True, **kw):
            for ch in chunk.choices:
                assert ch.delta.content is None, ch.delta
                for tc in ch.delta.tool_calls or []:
                    names += [tc.function.name] if tc.function.name else []
                    args += tc.function.arguments or ""
                finish = ch.finish_reason or finish
        assert (names, args, finish) == (["get_weather"], cut_call.function.arguments, "length")
        await c.close()


async def test_cost_per_token_on_metrics(client, live):
    await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
    text = await metrics_text(live)
    assert sample(text, "pagefleet:cost_per_hour_dollars") == 2.5
    spent = sample(text, "pagefleet:cost_dollars_total")
    assert spent > 0
    for kind, tokens in (("input", "vllm:prompt_tokens_total"),
                         ("output", "vllm:generation_tokens_total")):  # fmt: skip
        price = sample(text, f"pagefleet:cost_per_million_{kind}_tokens_dollars")
        # Both read in one scrape: the same uptime, so the same ratio up to clock ticks.
        assert price == pytest.approx(spent / sample(text, tokens) * 1e6, rel=1e-3)


async def test_beam_search_through_the_openai_client(client):
    """use_beam_search with best_of beams and n answers: the n best hypotheses of
    transformers' beam search on the same checkpoint, text for text; the combinations that
    make no sense are 400s naming the field."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pagefleet.engine.loader import resolve_model

    path = resolve_model("tiny")
    prompt = [(i * 37) % 1000 + 5 for i in range(30)]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = hf.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, 30, dtype=torch.long),
            num_beams=4, do_sample=False, max_new_tokens=8, length_penalty=0.5,
            num_return_sequences=2, pad_token_id=2,
        )  # fmt: skip
    tok = AutoTokenizer.from_pretrained(path)
    want = [tok.decode(row[30:], skip_special_tokens=True) for row in out.tolist()]
    beam = dict(model=MODEL, prompt=prompt, max_tokens=8, n=2, best_of=4)
    extra = {"use_beam_search": True, "length_penalty": 0.5}
    got = await client.completions.create(**beam, extra_body=extra)
    assert [c.index for c in got.choices] == [0, 1]
    assert [c.text for c in got.choices] == want
    assert got.usage.completion_tokens == 16 or any(c.finish_reason == "stop" for c in got.choices)
    with_lp = await client.completions.create(**beam, logprobs=2, extra_body=extra)
    assert [c.text for c in with_lp.choices] == want  # logprobs change nothing else
    for c in with_lp.choices:
        lp = c.logprobs
        assert "".join(lp.tokens) == c.text or c.finish_reason == "stop"
        pairs = zip(lp.top_logprobs, lp.token_logprobs, strict=True)
        assert lp.tokens and all(len(top) <= 2 and v <= 0 for top, v in pairs)
    refused = [
        ({"stream": True}, extra, "stream"),
        ({"temperature": 0.8}, extra, "temperature"),
        ({"n": 5}, extra, "best_of"),  # n > best_of
        ({"top_p": 0.5}, extra, "top_p"),
        ({}, {**extra, "guided_choice": ["a", "b"]}, "response_format"),
        ({"best_of": None}, {"length_penalty": 0.5}, "length_penalty"),
        ({}, {"early_stopping": True}, "early_stopping"),
        ({"best_of": 3}, {}, "best_of"),  # sampling best_of is not implemented
    ]
    for kw, body, param in refused:
        with pytest.raises(openai.BadRequestError) as e:
            await client.completions.create(**{**beam, **kw}, extra_body=body)
            pytest.fail(f"accepted: {kw} {body}")
        assert e.value.body["param"] == param, (kw, body, e.value.body)
    chat = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6, n=2,
        extra_body={"use_beam_search": True, "best_of": 3},
    )  # fmt: skip
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.choices[0].message.content != chat.choices[1].message.content
    with pytest.raises(openai.BadRequestError) as e:  # width above max_num_seqs (8)
        await client.completions.create(**{**beam, "best_of": 9}, extra_body=extra)
    assert e.value.body["param"] == "best_of"


async def test_request_log_names_each_prompt_and_orders_its_times(client, live):
    """--request-log: one line per finished prompt, named by its token ids' fingerprint,
    with monotonic times in causal order and the cached tokens the usage reported."""
    from pagefleet.daemon.request_log import prompt_fingerprint

    path = live.daemon.config.request_log
    assert path is not None
    prompt = PROMPT + " a request-log probe"
    t0 = time.monotonic()
    await client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0)
    again = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0)
    async with (
        aiohttp.ClientSession() as s,
        s.post(f"{live.url}/tokenize", json={"model": MODEL, "prompt": prompt}) as r,
    ):
        ids = (await r.json())["tokens"]
    fp = prompt_fingerprint(ids)
    lines = [json.loads(x) for x in Path(path).read_text().splitlines()]
    mine = [x for x in lines if x["fp"] == fp]
    assert len(mine) == 2, lines[-3:]
    for x in mine:
        assert x["pod"] == "pod-r" and x["prompt"] == len(ids) and x["output"] == 3
        assert t0 <= x["http"] <= x["arrival"] <= x["scheduled"] <= x["first_token"]
        assert x["first_token"] <= x["finished"] <= time.monotonic()
    assert mine[1]["cached"] == again.usage.prompt_tokens_details.cached_tokens > 0


async def test_echo_top_logprobs_and_tokenize_give_what_was_sent(client, live):
    """echo returns the prompt as sent (a re-encode and decode dropped its special tokens);
    the sampled token keeps its own logprob in top_logprobs when other tokens show the same
    text (every partial UTF-8 token is U+FFFD: the lowest-ranked one overwrote it); and
    /tokenize of chat messages counts the prompt chat builds (content parts were a 400)."""
    prompt = "Hello <|im_end|> world"
    r = await client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=1, temperature=0, echo=True
    )
    assert r.choices[0].text.startswith(prompt), r.choices[0].text
    r = await client.completions.create(
        model=MODEL, prompt="Unicode: ", max_tokens=12, temperature=0, logprobs=5
    )
    lp = r.choices[0].logprobs
    for i, top in enumerate(lp.top_logprobs):
        assert top[lp.tokens[i]] == pytest.approx(lp.token_logprobs[i]), (i, lp.tokens[i], top)
    msgs = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    chat = await client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=1)
    async with (
        aiohttp.ClientSession() as s,
        s.post(f"{live.url}/tokenize", json={"model": MODEL, "messages": msgs}) as t,
    ):
        body = await t.json()
        assert t.status == 200, body
    assert body["count"] == chat.usage.prompt_tokens


async def test_streamed_text_offsets_equal_the_non_streamed_ones(client):
    """A token whose text was held back (an incomplete character) arrives in a later chunk
    with the next token's text: each token keeps its own offset, as in the whole answer."""
    kw = dict(model=MODEL, prompt="Unicode: ", max_tokens=12, temperature=0, logprobs=1)
    whole = (await client.completions.create(**kw)).choices[0].logprobs.text_offset
    streamed = []
    async for chunk in await client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            if c.logprobs:
                streamed += c.logprobs.text_offset
    assert streamed == whole


async def test_chat_logprob_bytes_are_each_tokens_own_bytes(client):
    """A token that is part of a multi-byte character shows as U+FFFD, but its ``bytes``
    are its own: the bytes of the tokens, joined, are the answer's text (with the bytes of
    U+FFFD each partial token gave 3 bytes, and a character split over two tokens came back
    as two replacement characters)."""
    own_bytes = 0  # partial tokens whose bytes are not those of U+FFFD
    for content in ["日本語を話しますか", "Unicode: ", "Écris en français: é à ü"]:
        r = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=16,
            temperature=0, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True},
        )  # fmt: skip
        choice = r.choices[0]
        joined = b"".join(bytes(t.bytes) for t in choice.logprobs.content)
        assert joined.decode("utf-8", "replace") == choice.message.content, content
        for t in choice.logprobs.content:
            for alt in [t, *t.top_logprobs]:
                if "\ufffd" not in alt.token:  # a whole text: its bytes are its UTF-8
                    assert bytes(alt.bytes) == alt.token.encode(), alt
                own_bytes += "\ufffd" in alt.token and bytes(alt.bytes) != "\ufffd".encode()
    assert own_bytes, "no partial token was generated: the test saw nothing"


async def test_an_over_long_chat_prompt_names_messages(client):
    msgs = [{"role": "user", "content": "word " * 400}]
    with pytest.raises(openai.BadRequestError) as e:
        await client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4)
    assert e.value.body["param"] == "messages"
    assert e.value.body["code"] == "context_length_exceeded"


async def test_an_over_long_max_completion_tokens_names_it(client):
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError) as e:
        await client.chat.completions.create(model=MODEL, messages=msgs, max_completion_tokens=1000)
    assert e.value.body["param"] == "max_completion_tokens"
    assert "max_completion_tokens" in e.value.body["message"]


async def test_completion_top_logprobs_hold_the_sampled_token(client):
    """OpenAI: "the API will always return the logprob of the sampled token, so there may
    be up to logprobs+1 elements" (vLLM does so): a client reading top_logprobs[i] at
    tokens[i] found nothing when a sampled token was not among the most likely, and
    logprobs=0 gave empty dicts."""
    for k in (0, 1):
        kw = dict(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=1.5, seed=11,
                  logprobs=k, extra_body={"ignore_eos": True})  # fmt: skip
        whole = (await client.completions.create(**kw)).choices[0].logprobs
        streamed = [c.choices[0].logprobs async for c in await client.completions.create(
            stream=True, **kw) if c.choices and c.choices[0].logprobs]  # fmt: skip
        tops = [t for lp in streamed for t in lp.top_logprobs]
        assert tops == whole.top_logprobs
        for tok, v, top in zip(whole.tokens, whole.token_logprobs, tops, strict=True):
            assert top[tok] == pytest.approx(v) and 1 <= len(top) <= k + 1, (tok, top)


async def test_vllm_structured_outputs_field(client):
    """vLLM replaced the guided_* fields with one ``structured_outputs`` object (json,
    regex, choice, grammar, json_object); a client written for it got a 400."""
    choice = await client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0,
        extra_body={"structured_outputs": {"choice": ["alpha", "beta"]}},
    )  # fmt: skip
    assert choice.choices[0].text in ("alpha", "beta")
    regex = await client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0.7, seed=1,
        extra_body={"structured_outputs": {"regex": r"\d{3}-[a-c]{2}"}},
    )  # fmt: skip
    assert re.fullmatch(r"\d{3}-[a-c]{2}", regex.choices[0].text)
    schema = {"type": "object", "additionalProperties": False, "required": ["ok"],
              "properties": {"ok": {"type": "boolean"}}}  # fmt: skip
    msgs = [{"role": "user", "content": "Give me JSON"}]
    for spec in (schema, json.dumps(schema)):
        r = await client.chat.completions.create(
            model=MODEL, messages=msgs, max_tokens=20, temperature=1.0, seed=2,
            extra_body={"structured_outputs": {"json": spec}},
        )  # fmt: skip
        assert isinstance(json.loads(r.choices[0].message.content)["ok"], bool)
    r = await client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=40, temperature=0,
        extra_body={"structured_outputs": {"json_object": True}},
    )  # fmt: skip
    assert r.choices[0].message.content.startswith("{")
    for so in ({"regex": "("}, {"choice": ["a"], "regex": "a"}, {"structural_tag": "x"}):
        with pytest.raises(openai.BadRequestError) as e:
            await client.completions.create(
                model=MODEL, prompt=PROMPT, extra_body={"structured_outputs": so}
            )
        assert e.value.body["param"].startswith("structured_outputs"), (so, e.value.body)
