"""Token ids to client text through the real daemon and the openai client.

The tiny model is random, so the outputs are pinned with guided_regex: the model picks
how the forced text is split into tokens (often byte by byte through a multi-byte
character), which is what the incremental detokenizer has to survive. transformers'
tokenizer on the same checkpoint is the oracle for what the text of the ids is.
"""

from __future__ import annotations

import aiohttp
import openai
import pytest
import pytest_asyncio

from pagefleet.daemon.config import DaemonConfig
from pagefleet.dev.process import free_port

from .conftest import LiveDaemon, live_daemon

pytestmark = pytest.mark.asyncio(loop_scope="module")

MODEL = "tiny-text"
FORCED = "héllo 世界 🎉 naïve 東京 end"


def config(**kw) -> DaemonConfig:
    base = dict(model="tiny", served_model_name=MODEL, port=free_port(), pod_name="pod-t",
                block_size=8, num_gpu_blocks=128, max_model_len=256, max_num_seqs=8,
                max_queue=16)  # fmt: skip
    base.update(kw)
    return DaemonConfig(**base)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def live():
    async with live_daemon(config()) as d:
        yield d


@pytest_asyncio.fixture(loop_scope="module")
async def client(live: LiveDaemon):
    c = openai.AsyncOpenAI(base_url=live.base_url, api_key="none", max_retries=0)
    yield c
    await c.close()


async def _both(client, **kw) -> tuple[list[str], dict[int, list[str]]]:
    """Non-streamed texts per choice and the streamed deltas per choice (same seed)."""
    whole = await client.completions.create(model=MODEL, **kw)
    texts = [c.text for c in sorted(whole.choices, key=lambda c: c.index)]
    deltas: dict[int, list[str]] = {}
    stream = await client.completions.create(model=MODEL, stream=True, **kw)
    async for chunk in stream:
        for c in chunk.choices:
            deltas.setdefault(c.index, []).append(c.text)
    return texts, deltas


@pytest.mark.parametrize("seed", [0, 1, 2])
async def test_multibyte_stream_equals_whole(client, seed) -> None:
    texts, deltas = await _both(
        client, prompt="Say it:", max_tokens=64, temperature=1.0, seed=seed, n=2,
        extra_body={"guided_regex": FORCED},
    )  # fmt: skip
    for i, text in enumerate(texts):
        assert text == FORCED
        assert "".join(deltas[i]) == text
        assert not any("\ufffd" in d for d in deltas[i])


@pytest.mark.parametrize(
    ("stop", "include", "want"),
    [
        (["世界"], False, "héllo "),
        (["世界"], True, "héllo 世界"),
        (["界 🎉", "llo 世"], False, "hé"),
        (["🎉"], True, "héllo 世界 🎉"),
        (["h"], False, ""),
        (["hé"], True, "hé"),
        (["zz", "ïve 東", "naï"], False, "héllo 世界 🎉 "),
    ],
)
async def test_stop_strings_stream_equals_whole(client, stop, include, want) -> None:
    texts, deltas = await _both(
        client, prompt="Say it:", max_tokens=64, temperature=1.0, seed=3, n=3, stop=stop,
        extra_body={"guided_regex": FORCED, "include_stop_str_in_output": include},
    )  # fmt: skip
    for i, text in enumerate(texts):
        assert text == want, (i, text)
        assert "".join(deltas[i]) == want


async def test_chat_stream_and_logprob_bytes_rebuild_the_text(client) -> None:
    kw = dict(
        model=MODEL, messages=[{"role": "user", "content": "Say it"}], max_tokens=64,
        temperature=1.0, seed=5, logprobs=True, top_logprobs=2,
        extra_body={"guided_regex": FORCED},
    )  # fmt: skip
    whole = await client.chat.completions.create(**kw)
    content = whole.choices[0].logprobs.content
    assert whole.choices[0].message.content == FORCED
    # Partial-character tokens carry their own bytes: joined, the bytes are the text
    # (and the EOS that ended it, whose logprob is listed as vLLM does).
    assert content[-1].token == "</s>"
    assert b"".join(bytes(t.bytes) for t in content[:-1]) == FORCED.encode()
    assert any("\ufffd" in t.token for t in content)  # the run split some characters
    streamed = ""
    async for chunk in await client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            assert "\ufffd" not in (c.delta.content or "")
            streamed += c.delta.content or ""
    assert streamed == FORCED


async def test_completion_echo_of_a_multibyte_prompt(client) -> None:
    prompt = "Écris 東京: "
    texts, deltas = await _both(
        client, prompt=prompt, max_tokens=64, temperature=1.0, seed=6, echo=True,
        extra_body={"guided_regex": FORCED},
    )  # fmt: skip
    assert texts == [prompt + FORCED]
    assert "".join(deltas[0]) == prompt + FORCED


@pytest.mark.parametrize("skip", [True, False])
async def test_skip_special_tokens(client, live: LiveDaemon, skip) -> None:
    tok = live.daemon.serving._tokenizer()
    im_start = tok.token_to_id("<|im_start|>")
    texts, deltas = await _both(
        client, prompt="x", max_tokens=3, temperature=0.0, logit_bias={str(im_start): 100},
        extra_body={"skip_special_tokens": skip, "ignore_eos": True},
    )  # fmt: skip
    want = "" if skip else "<|im_start|>" * 3
    assert texts == [want]
    assert "".join(deltas[0]) == want


async def test_text_parts_render_joined_by_newlines(live: LiveDaemon) -> None:
    """vLLM joins a message's text parts with "\\n" before the chat template reads them."""

    async def ids(content) -> list[int]:
        body = {"model": MODEL, "messages": [{"role": "user", "content": content}]}
        async with aiohttp.ClientSession() as s, s.post(f"{live.url}/tokenize", json=body) as r:
            assert r.status == 200, await r.text()
            return (await r.json())["tokens"]

    parts = [{"type": "text", "text": "Describe:"}, {"type": "text", "text": "the cat 🐈"}]
    assert await ids(parts) == await ids("Describe:\nthe cat 🐈")
    assert await ids(parts) != await ids("Describe:the cat 🐈")
