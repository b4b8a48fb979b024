"""What of each chat message reaches the chat template: a tool-calling conversation's
history (the assistant's tool_calls, each tool result's tool_call_id, a message's name)
is rendered as the template writes it, with the calls' arguments as objects (as vLLM and
Hugging Face templates expect), through chat completions and its render endpoint alike."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from pagefleet.tokenizer import Tokenizer

from .conftest import live_daemon
from .fake_engine import fake_config, fake_engine_factory

# The shape of the tool-calling templates of Qwen2.5 / Llama 3.1 / Hermes, in small.
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}"
    "{{ ' (' + m.name + ')' if m.name else '' }}\n"
    "{% if m.role == 'tool' %}[{{ m.tool_call_id }}] {% endif %}{{ m.content }}"
    '{% for tc in m.tool_calls or [] %}<tool_call>{"name": "{{ tc.function.name }}", '
    '"arguments": {{ tc.function.arguments | tojson }}}</tool_call>{% endfor %}'
    "<|im_end|>\n{% endfor %}{% if tools %}[tools]{% endif %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

MESSAGES = [
    {"role": "user", "content": "Weather in Paris?", "name": "bob"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]  # fmt: skip
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]

EXPECTED = (
    "<|im_start|>user (bob)\nWeather in Paris?<|im_end|>\n"
    "<|im_start|>assistant\n"
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call><|im_end|>\n'
    "<|im_start|>tool\n[call_1] sunny<|im_end|>\n"
    "[tools]<|im_start|>assistant\n"
)


@pytest.fixture
def tools_tokenizer(tiny_tokenizer: Tokenizer) -> Tokenizer:
    t = tiny_tokenizer
    return Tokenizer(t._tok, t.config, t.eos_token_ids, chat_template=TEMPLATE)


async def test_tool_call_history_reaches_the_template(tools_tokenizer: Tokenizer) -> None:
    tok = tools_tokenizer
    want = tok.encode(EXPECTED, add_special_tokens=False)
    body = {"model": "fake", "messages": MESSAGES, "tools": TOOLS, "max_tokens": 2}
    async with (
        live_daemon(fake_config(), fake_engine_factory(tok, [])) as d,
        aiohttp.ClientSession() as s,
    ):
        async with s.post(f"{d.base_url}/chat/completions/render", json=body) as r:
            assert r.status == 200, await r.text()
            (rendered,) = (await r.json())[1]
        async with s.post(f"{d.base_url}/chat/completions", json=body) as r:
            assert r.status == 200, await r.text()
            usage = (await r.json())["usage"]
    assert rendered["prompt_token_ids"] == want, rendered["prompt"]
    assert usage["prompt_tokens"] == len(want)


async def test_tokenize_counts_the_prompt_chat_builds(tools_tokenizer: Tokenizer) -> None:
    """vLLM's /tokenize takes the chat request's tools and chat_template_kwargs; they were
    kept and ignored, so its count was that of a prompt without them."""
    tok = tools_tokenizer
    want = tok.encode(EXPECTED, add_special_tokens=False)
    body = {"model": "fake", "messages": MESSAGES, "tools": TOOLS}
    async with (
        live_daemon(fake_config(), fake_engine_factory(tok, [])) as d,
        aiohttp.ClientSession() as s,
    ):
        async with s.post(f"{d.url}/tokenize", json=body) as r:
            assert r.status == 200, await r.text()
            out = await r.json()
        kwargs = {**body, "tools": None, "chat_template_kwargs": {"tools": TOOLS}}
        async with s.post(f"{d.url}/tokenize", json=kwargs) as r:
            assert (await r.json())["tokens"] == want
    assert out["tokens"] == want and out["count"] == len(want)


async def test_chat_template_kwargs_override_the_request_defaults(
    tools_tokenizer: Tokenizer,
) -> None:
    """As vLLM: chat_template_kwargs win over add_generation_prompt (clients continuing a
    turn set it there); it was a 400 quoting a Python TypeError. Setting "messages" there
    is a 400 naming chat_template_kwargs."""
    tok = tools_tokenizer
    head = EXPECTED.removesuffix("<|im_start|>assistant\n")
    want = tok.encode(head, add_special_tokens=False)
    body = {"model": "fake", "messages": MESSAGES, "tools": TOOLS, "max_tokens": 1,
            "chat_template_kwargs": {"add_generation_prompt": False}}  # fmt: skip
    async with (
        live_daemon(fake_config(), fake_engine_factory(tok, [])) as d,
        aiohttp.ClientSession() as s,
    ):
        await _render_and_chat_build(s, d.base_url, body, want)
        body["chat_template_kwargs"] = {"messages": []}
        async with s.post(f"{d.base_url}/chat/completions", json=body) as r:
            assert r.status == 400
            assert (await r.json())["error"]["param"] == "chat_template_kwargs"


async def test_a_malformed_tool_call_in_the_history_is_a_400_naming_it(
    tools_tokenizer: Tokenizer,
) -> None:
    """A tool call without its function (or not an object) reached the template, whose
    failure came back as "chat template failed: 'str object' has no attribute
    'function'" on param messages; it is now the field's own 400."""
    bad_calls = ["x", [{"id": "c"}], [{"id": "c", "function": {"arguments": "{}"}}]]
    async with (
        live_daemon(fake_config(), fake_engine_factory(tools_tokenizer, [])) as d,
        aiohttp.ClientSession() as s,
    ):
        for calls in bad_calls:
            msgs = [MESSAGES[0], {"role": "assistant", "content": None, "tool_calls": calls}]
            body = {"model": "fake", "messages": msgs, "max_tokens": 1}
            async with s.post(f"{d.base_url}/chat/completions", json=body) as r:
                assert r.status == 400, calls
                err = (await r.json())["error"]
            assert err["param"].startswith("messages.1.tool_calls"), (calls, err)
            assert "template" not in err["message"], err


async def test_continue_final_message_prefills_the_answer(tools_tokenizer: Tokenizer) -> None:
    """vLLM's continue_final_message: the prompt ends inside the final (assistant)
    message, so the model continues it (an answer prefilled with "```json\\n", say). It
    was a 400 ("not supported")."""
    tok = tools_tokenizer
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The answer"}]
    want = tok.encode(
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nThe answer",
        add_special_tokens=False,
    )
    body = {"model": "fake", "messages": msgs, "max_tokens": 1,
            "add_generation_prompt": False, "continue_final_message": True}  # fmt: skip
    async with (
        live_daemon(fake_config(), fake_engine_factory(tok, [])) as d,
        aiohttp.ClientSession() as s,
    ):
        await _render_and_chat_build(s, d.base_url, body, want)
        async with s.post(f"{d.url}/tokenize", json=body) as r:
            assert (await r.json())["tokens"] == want
        # With a generation prompt besides, there is no final message to continue.
        async with s.post(
            f"{d.base_url}/chat/completions", json={**body, "add_generation_prompt": True}
        ) as r:
            assert r.status == 400
            assert (await r.json())["error"]["param"] == "continue_final_message"


async def _render_and_chat_build(
    s: aiohttp.ClientSession, base_url: str, body: dict[str, Any], want: list[int]
) -> None:
    """Render and chat completions both build exactly ``want`` from ``body``."""
    async with s.post(f"{base_url}/chat/completions/render", json=body) as r:
        assert r.status == 200, await r.text()
        assert (await r.json())[1][0]["prompt_token_ids"] == want
    async with s.post(f"{base_url}/chat/completions", json=body) as r:
        assert r.status == 200, await r.text()
        assert (await r.json())["usage"]["prompt_tokens"] == len(want)
