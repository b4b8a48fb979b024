"""The gateway's view of a chat request is the daemon's: the prompt it routes and judges
length on is the one the daemon renders (tool calls and results, tools, template
variables), and a context-length refusal names the fields the caller sent, as the
daemon's does ("messages", "max_completion_tokens")."""

from __future__ import annotations

import json

from pagefleet.api.openai import ChatCompletionRequest, template_messages
from pagefleet.engine.tiny import ensure_tiny_checkpoint
from pagefleet.gateway.intake import inspect
from pagefleet.gateway.prompts import PromptTokenizer
from pagefleet.tokenizer import Tokenizer


def _tok() -> PromptTokenizer:
    return PromptTokenizer.from_dir(ensure_tiny_checkpoint("tiny"))


def test_over_long_chat_names_messages() -> None:
    body = json.dumps({"messages": [{"role": "user", "content": "word " * 400}]}).encode()
    out = inspect("chat", body, _tok(), 256)
    assert out.error is not None and out.error.code == "context_length_exceeded"
    assert out.error.param == "messages", out.error


def test_over_long_max_completion_tokens_names_it() -> None:
    body = json.dumps(
        {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 1000}
    ).encode()
    out = inspect("chat", body, _tok(), 256)
    assert out.error is not None and out.error.param == "max_completion_tokens", out.error


TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'tool' %}[{{ m.tool_call_id }}] {% endif %}{{ m.content }}"
    "{% for tc in m.tool_calls or [] %}<tool_call>{{ tc.function.name }}"
    "{{ tc.function.arguments | tojson }}</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if tools %}[tools]{% endif %}<|im_start|>assistant\n"
)


def test_gateway_renders_what_the_daemon_renders() -> None:
    t = Tokenizer.from_dir(ensure_tiny_checkpoint("tiny"))
    tok = Tokenizer(t._tok, t.config, t.eos_token_ids, chat_template=TEMPLATE)
    req = ChatCompletionRequest.model_validate(
        {
            "messages": [
                {"role": "user", "content": "Weather?"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
            ],
            "tools": [{"type": "function", "function": {"name": "get_weather"}}],
        }
    )
    daemon = tok.apply_chat_template(
        template_messages(req.messages), tools=[x.model_dump(exclude_none=True) for x in req.tools]
    )
    assert PromptTokenizer(tok, cache_segments=False).chat_text(req) == daemon
