"""vLLM's chat (and completions) request parameters that shape the prompt, through the real
daemon and the openai client: add_special_tokens, templates that loop over content parts,
documents, chat_template_kwargs, echo, continue_final_message, a request's own template.

Each prompt the daemon builds is also computed by the gateway's intake for the same body
and must be the same ids: the gateway's routing keys are hashes of them.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import openai
import pytest

from pagefleet.gateway.intake import inspect
from pagefleet.gateway.prompts import PromptTokenizer
from pagefleet.tokenizer import Tokenizer

from .conftest import LiveDaemon, live_daemon
from .fake_engine import fake_config, fake_engine_factory

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Writes BOS itself, as Llama's and Mistral's templates do.
BOS_CHATML = "{{ bos_token }}" + CHATML
# Reads content only as a list of parts (as Llama 4's and several VLMs' templates do).
PARTS = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% for part in m.content %}{% if part.type == 'text' %}{{ part.text }}{% endif %}"
    "{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Retrieval templates read ``documents``; Qwen3's reads ``enable_thinking``.
DOCS_THINK = (
    "{% if documents %}{% for d in documents %}[{{ d.title }}: {{ d.text }}]\n{% endfor %}"
    "{% endif %}" + CHATML + "{% if add_generation_prompt and enable_thinking is defined "
    "and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
)

USER = [{"role": "user", "content": "Hello there"}]


def _with_template(base: Tokenizer, template: str) -> Tokenizer:
    return Tokenizer(base._tok, base.config, base.eos_token_ids, chat_template=template)


@asynccontextmanager
async def _served(tok: Tokenizer) -> AsyncIterator[tuple[LiveDaemon, openai.AsyncOpenAI]]:
    async with live_daemon(fake_config(), fake_engine_factory(tok, [])) as d:
        client = openai.AsyncOpenAI(base_url=d.base_url, api_key="none", max_retries=0)
        try:
            yield d, client
        finally:
            await client.close()


async def _daemon_ids(d: LiveDaemon, body: dict[str, Any]) -> list[int]:
    """The ids the daemon prefills for a chat body (its render endpoint, which the chat
    endpoint's usage is checked against in each test)."""
    async with (
        aiohttp.ClientSession() as s,
        s.post(f"{d.base_url}/chat/completions/render", json=body) as r,
    ):
        assert r.status == 200, await r.text()
        (rendered,) = (await r.json())[1]
    return rendered["prompt_token_ids"]


def _gateway_ids(tok: Tokenizer, body: dict[str, Any], kind: str = "chat") -> list[int] | None:
    out = inspect(kind, json.dumps(body).encode(), PromptTokenizer(tok), None)
    assert out.error is None, out.error
    return out.token_ids


async def _chat(client: openai.AsyncOpenAI, messages: list, **extra: Any) -> Any:
    return await client.chat.completions.create(
        model="fake", messages=messages, max_tokens=2, extra_body=extra
    )


# -- add_special_tokens -------------------------------------------------------------------


async def test_chat_add_special_tokens_has_vllms_meaning(tiny_tokenizer: Tokenizer) -> None:
    """vLLM's chat add_special_tokens: false encodes the rendered prompt with no special
    tokens, true adds the tokenizer's on top of what the template writes. It was a 400
    for false and for true alike; the gateway computes the same ids."""
    tok = _with_template(tiny_tokenizer, BOS_CHATML)
    text = tok.apply_chat_template(USER)
    plain = tok.encode(text, add_special_tokens=False)
    bos = tok.bos_token_id
    assert plain[0] == bos  # the template's BOS
    async with _served(tok) as (d, client):
        for flag, want in ((None, plain), (False, plain), (True, [bos, *plain])):
            extra = {} if flag is None else {"add_special_tokens": flag}
            resp = await _chat(client, USER, **extra)
            assert resp.usage.prompt_tokens == len(want), flag
            body = {"model": "fake", "messages": USER, **extra}
            assert await _daemon_ids(d, body) == want, flag
            assert _gateway_ids(tok, body) == want, flag
            async with (
                aiohttp.ClientSession() as s,
                s.post(f"{d.url}/tokenize", json=body) as r,
            ):
                assert (await r.json())["tokens"] == want, flag


async def test_chat_prompt_gets_no_bos_its_template_does_not_write(
    tiny_tokenizer: Tokenizer,
) -> None:
    """The tiny preset's template (ChatML) writes no BOS; its tokenizer's post-processor
    adds one to every encode that asks for special tokens. A chat request that did not send
    add_special_tokens got that BOS here ("BOS once"), where vLLM's chat (add_special_tokens
    false unless sent) and transformers' apply_chat_template(tokenize=True) give none: one
    token more in every prompt, and ids no vLLM prefix cache shares. The daemon, its render
    and tokenize endpoints and the gateway's routing ids now all equal transformers'."""
    from transformers import PreTrainedTokenizerFast

    from pagefleet.engine.tiny import ensure_tiny_checkpoint

    tok = tiny_tokenizer
    oracle = PreTrainedTokenizerFast.from_pretrained(str(ensure_tiny_checkpoint("tiny")))
    assert oracle("x").input_ids[0] == oracle.bos_token_id  # the tokenizer does add BOS
    async with _served(tok) as (d, client):
        for messages in (USER, [{"role": "system", "content": "Be brief."}, *USER]):
            want = oracle.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
            want = list(want["input_ids"] if hasattr(want, "keys") else want)
            assert want[0] != oracle.bos_token_id
            resp = await _chat(client, messages)
            assert resp.usage.prompt_tokens == len(want)
            body = {"model": "fake", "messages": messages}
            assert await _daemon_ids(d, body) == want
            assert _gateway_ids(tok, body) == want
            async with (
                aiohttp.ClientSession() as s,
                s.post(f"{d.url}/tokenize", json=body) as r,
            ):
                assert (await r.json())["tokens"] == want


async def test_completion_add_special_tokens_false_drops_bos(tiny_tokenizer: Tokenizer) -> None:
    """Completions' add_special_tokens (vLLM's default true): false sends the text's ids
    without BOS. It was a 400."""
    tok = tiny_tokenizer
    with_bos = tok.encode("Hello there")
    assert with_bos[0] == tok.bos_token_id
    async with _served(tok) as (_, client):
        for flag, want in ((True, with_bos), (False, with_bos[1:])):
            resp = await client.completions.create(
                model="fake", prompt="Hello there", max_tokens=2,
                extra_body={"add_special_tokens": flag},
            )  # fmt: skip
            assert resp.usage.prompt_tokens == len(want)
            body = {"model": "fake", "prompt": "Hello there", "add_special_tokens": flag}
            assert _gateway_ids(tok, body, "completion") == want


# -- templates that loop over content parts -----------------------------------------------


def test_content_format_is_detected_from_the_template() -> None:
    from pagefleet.tokenizer import detect_content_format

    assert detect_content_format(CHATML) == "string"
    assert detect_content_format(PARTS) == "openai"
    assert detect_content_format(None) == "string"
    # Through a variable, under a filter, or in the list branch of a template that reads
    # both shapes (as vLLM: such a template gets the list).
    via_var = (
        "{% for m in messages %}{% set c = m['content'] %}"
        "{% for p in c | list %}{{ p['text'] }}{% endfor %}{% endfor %}"
    )
    both = (
        "{% for m in messages %}{% if m.content is string %}{{ m.content }}{% else %}"
        "{% for p in m.content %}{{ p.text }}{% endfor %}{% endif %}{% endfor %}"
    )
    assert detect_content_format(via_var) == "openai"
    assert detect_content_format(both) == "openai"
    # Looping over other things of a message is not reading content parts.
    tools = "{% for m in messages %}{% for t in m.tool_calls %}{{ t }}{% endfor %}{% endfor %}"
    assert detect_content_format(tools) == "string"


async def test_a_template_that_loops_over_parts_gets_the_parts(tiny_tokenizer: Tokenizer) -> None:
    """A template that reads content only as a list of parts was given a string: it looped
    over its characters, whose ``.type`` is undefined, and wrote nothing of any message
    (the model saw empty turns). As vLLM, it now gets the parts, for a string content too."""
    tok = _with_template(tiny_tokenizer, PARTS)
    parts = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hello"},
                                     {"type": "text", "text": " there"}]},
    ]  # fmt: skip
    want_text = (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello there<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    want = tok.encode(want_text, add_special_tokens=False)
    async with _served(tok) as (d, client):
        resp = await _chat(client, parts)
        assert resp.usage.prompt_tokens == len(want)
        body = {"model": "fake", "messages": parts}
        assert await _daemon_ids(d, body) == want
        assert _gateway_ids(tok, body) == want
        # continue_final_message finds the final part's text in the rendered prompt.
        cont = [*parts, {"role": "assistant", "content": "Sure"}]
        body = {"model": "fake", "messages": cont, "add_generation_prompt": False,
                "continue_final_message": True}  # fmt: skip
        ids = await _daemon_ids(d, body)
        assert tok.decode(ids, skip_special_tokens=False).endswith("assistant\nSure")
        assert _gateway_ids(tok, body) == ids


# -- documents, chat_template_kwargs -------------------------------------------------------


async def test_documents_and_template_kwargs_reach_the_template(
    tiny_tokenizer: Tokenizer,
) -> None:
    """vLLM's ``documents`` is the template's variable of that name; it was a 400.
    chat_template_kwargs (Qwen3's enable_thinking) reach the template as variables."""
    tok = _with_template(tiny_tokenizer, DOCS_THINK)
    docs = [{"title": "Paris", "text": "Sunny."}, {"title": "Oslo", "text": "Snow."}]
    head = "[Paris: Sunny.]\n[Oslo: Snow.]\n"
    chat = "<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n"
    add = False  # vLLM: the template alone decides BOS
    cases = [
        ({"documents": docs}, head + chat),
        ({"chat_template_kwargs": {"enable_thinking": False}}, chat + "<think>\n\n</think>\n\n"),
        ({"chat_template_kwargs": {"enable_thinking": True}}, chat),
    ]
    async with _served(tok) as (d, client):
        for extra, text in cases:
            want = tok.encode(text, add_special_tokens=add)
            resp = await _chat(client, USER, **extra)
            assert resp.usage.prompt_tokens == len(want), extra
            body = {"model": "fake", "messages": USER, **extra}
            assert await _daemon_ids(d, body) == want, extra
            assert _gateway_ids(tok, body) == want, extra


async def test_tools_and_documents_not_sent_are_none_as_in_transformers(
    tiny_tokenizer: Tokenizer,
) -> None:
    """transformers (which vLLM renders through) defines ``tools`` and ``documents`` as
    None when a request has none; they were undefined here, so a template testing
    ``tools is not none`` wrote an empty tools section into every prompt."""
    from transformers import PreTrainedTokenizerFast

    from pagefleet.engine.tiny import ensure_tiny_checkpoint

    template = (
        "{% if tools is not none %}[tools]{% endif %}"
        "{% if documents is not none %}[docs]{% endif %}" + CHATML
    )
    tok = _with_template(tiny_tokenizer, template)
    oracle = PreTrainedTokenizerFast.from_pretrained(str(ensure_tiny_checkpoint("tiny")))
    hf_text = oracle.apply_chat_template(
        USER, chat_template=template, tokenize=False, add_generation_prompt=True
    )
    assert "[tools]" not in hf_text and "[docs]" not in hf_text
    want = tok.encode(hf_text, add_special_tokens=False)
    async with _served(tok) as (d, _):
        body = {"model": "fake", "messages": USER}
        assert await _daemon_ids(d, body) == want
        assert _gateway_ids(tok, body) == want


# -- echo, continue_final_message ---------------------------------------------------------


async def test_chat_echo_starts_the_reply_with_the_continued_message(
    tiny_tokenizer: Tokenizer,
) -> None:
    """vLLM's chat echo: with continue_final_message the reply's content is the whole
    assistant message, the prefilled start included, streamed or not. It was a 400."""
    tok = _with_template(tiny_tokenizer, CHATML)
    msgs = [*USER, {"role": "assistant", "content": "The answer is"}]
    extra = {"echo": True, "add_generation_prompt": False, "continue_final_message": True}
    async with _served(tok) as (_, client):
        plain = await _chat(client, msgs, add_generation_prompt=False, continue_final_message=True)
        generated = plain.choices[0].message.content
        assert generated
        whole = await _chat(client, msgs, **extra)
        assert whole.choices[0].message.content == "The answer is" + generated
        streamed = ""
        stream = await client.chat.completions.create(
            model="fake", messages=msgs, max_tokens=2, stream=True, extra_body=extra
        )
        roles = []
        async for chunk in stream:
            for c in chunk.choices:
                streamed += c.delta.content or ""
                roles.append(c.delta.role)
        assert streamed == "The answer is" + generated
        assert roles.count("assistant") == 1 and roles[0] == "assistant"
        # Each of n choices starts with it, streamed too.
        many = await client.chat.completions.create(
            model="fake", messages=msgs, max_tokens=2, n=2, extra_body=extra
        )
        assert [c.message.content[:13] for c in many.choices] == ["The answer is"] * 2
        per_choice: dict[int, str] = {}
        stream = await client.chat.completions.create(
            model="fake", messages=msgs, max_tokens=2, n=2, stream=True, extra_body=extra
        )
        async for chunk in stream:
            for c in chunk.choices:
                per_choice[c.index] = per_choice.get(c.index, "") + (c.delta.content or "")
        assert per_choice == {c.index: c.message.content for c in many.choices}
        # A new assistant turn after a user message: nothing of the user's is echoed.
        reply = await _chat(client, USER, echo=True)
        assert (
            reply.choices[0].message.content
            == (await _chat(client, USER)).choices[0].message.content
        )


async def test_reply_continuing_a_message_has_that_messages_role(
    tiny_tokenizer: Tokenizer,
) -> None:
    """vLLM's get_chat_request_role: with add_generation_prompt false the reply continues
    the final message and is reported in its role (a user turn continued is "user"). It
    was always "assistant", whole and streamed."""
    tok = _with_template(tiny_tokenizer, CHATML)
    msgs = [{"role": "user", "content": "Finish my sentence: the sky is"}]
    cases = [
        ({"add_generation_prompt": False}, "user"),
        ({"add_generation_prompt": False, "continue_final_message": True}, "user"),
        ({"add_generation_prompt": False, "echo": True}, "user"),
        ({}, "assistant"),
        ({"echo": True}, "assistant"),
    ]
    async with _served(tok) as (_, client):
        for extra, role in cases:
            for n in (1, 2):
                whole = await client.chat.completions.create(
                    model="fake", messages=msgs, max_tokens=2, n=n, extra_body=extra
                )
                assert [c.message.role for c in whole.choices] == [role] * n, extra
                stream = await client.chat.completions.create(
                    model="fake", messages=msgs, max_tokens=2, n=n, stream=True, extra_body=extra
                )
                roles: dict[int, list[str | None]] = {}
                async for chunk in stream:
                    for c in chunk.choices:
                        roles.setdefault(c.index, []).append(c.delta.role)
                # Each choice's first chunk carries the role, and no later one does.
                for got in roles.values():
                    assert got[0] == role and got.count(role) == 1, (extra, got)
                assert len(roles) == n


async def test_continue_final_message_with_a_generation_prompt_is_a_400(
    tiny_tokenizer: Tokenizer,
) -> None:
    """As vLLM (and transformers): continuing the final message and starting a new one
    cannot both be asked; add_generation_prompt is true unless sent."""
    tok = _with_template(tiny_tokenizer, CHATML)
    msgs = [*USER, {"role": "assistant", "content": "The answer is"}]
    async with _served(tok) as (_, client):
        for extra in ({"continue_final_message": True},
                      {"continue_final_message": True, "add_generation_prompt": True}):  # fmt: skip
            with pytest.raises(openai.BadRequestError) as err:
                await _chat(client, msgs, **extra)
            assert err.value.body["param"] == "continue_final_message"


# -- a request's own template --------------------------------------------------------------


async def test_a_request_template_is_refused_by_name(tiny_tokenizer: Tokenizer) -> None:
    """A template sent with the request is code: refused (vLLM too, unless started with
    --trust-request-chat-template), as a field and in chat_template_kwargs, where it was
    taken as a mere variable and silently ignored. The gateway refuses it alike."""
    tok = _with_template(tiny_tokenizer, CHATML)
    evil = "{% for i in range(10**9) %}x{% endfor %}"
    async with _served(tok) as (_, client):
        for extra in ({"chat_template_kwargs": {"chat_template": evil}}, {"chat_template": evil}):
            with pytest.raises(openai.BadRequestError) as err:
                await _chat(client, USER, **extra)
            param = next(iter(extra))
            assert err.value.body["param"] == param, err.value.body
            assert "trust-request-chat-template" in err.value.body["message"]
            body = json.dumps({"model": "fake", "messages": USER, **extra}).encode()
            out = inspect("chat", body, PromptTokenizer(tok), None)
            assert out.error is not None and out.error.param == param
