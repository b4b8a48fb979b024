"""The prompt a chat request makes: its rendered text and how that text is encoded.

Invariant: the daemon (which prefills the prompt) and the gateway (which routes on its block
keys) both build it here, so the two compute the same token ids for the same request; a
change to what reaches the template or to the BOS rule lands on both sides at once.
"""

from __future__ import annotations

from typing import Any, Protocol

from pagefleet.api.openai import (
    ChatMessage,
    ContentFormat,
    ReplyRole,
    cut_after_final,
    template_messages,
)


class ChatTokenizer(Protocol):
    """What rendering and encoding a chat prompt needs (``pagefleet.tokenizer.Tokenizer``)."""

    @property
    def chat_content_format(self) -> str: ...

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str: ...


class ChatPromptError(ValueError):
    """The request cannot make a prompt; ``param`` is the field to name in the 400."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


def content_format(tok: ChatTokenizer) -> ContentFormat:
    return "openai" if tok.chat_content_format == "openai" else "string"


def render_chat(
    tok: ChatTokenizer,
    messages: list[ChatMessage],
    *,
    add_generation_prompt: bool,
    continue_final_message: bool,
    chat_template_kwargs: dict[str, Any] | None = None,
    tools: list[dict[str, Any]] | None = None,
    documents: list[dict[str, Any]] | None = None,
) -> str:
    """The prompt text of a chat request. Raises ChatPromptError for a request that cannot
    make one (the daemon's 400); a template's own failure (``raise_exception``, a role it
    refuses) propagates as is, for the caller to report."""
    kwargs = dict(chat_template_kwargs or {})
    if "messages" in kwargs:
        raise ChatPromptError(
            "chat_template_kwargs cannot set 'messages'; send them as the request's messages",
            "chat_template_kwargs",
        )
    # As vLLM: the caller's template variables win over the request's fields.
    add_generation_prompt = bool(kwargs.pop("add_generation_prompt", add_generation_prompt))
    if continue_final_message and add_generation_prompt:
        raise ChatPromptError(
            "continue_final_message continues the last message, add_generation_prompt "
            "starts a new one: set add_generation_prompt to false",
            "continue_final_message",
        )
    # Defined even when not sent, as transformers (and so vLLM) render: a template that
    # tests ``tools is not none`` wrote an empty tools section for every request here.
    if tools:
        kwargs["tools"] = tools
    kwargs.setdefault("tools", None)
    kwargs.setdefault("documents", documents)
    fmt = content_format(tok)
    rendered = template_messages(messages, fmt)
    text = tok.apply_chat_template(rendered, add_generation_prompt=add_generation_prompt, **kwargs)
    if not continue_final_message:
        return text
    cut = cut_after_final(text, _final_text(messages, fmt))
    if cut is None:
        raise ChatPromptError(
            "continue_final_message: the chat template does not write the final message's "
            "text where it could be continued; send a non-empty final message or drop the "
            "flag",
            "continue_final_message",
        )
    return cut


def _final_text(messages: list[ChatMessage], fmt: ContentFormat) -> str:
    """What the rendered prompt ends with when it ends inside the final message: its text,
    or with parts its last part's (a template joins parts its own way)."""
    if not messages:
        return ""
    last = messages[-1]
    if fmt == "openai":
        parts = last.text_parts()
        return parts[-1]["text"] if parts else ""
    return last.text()


def add_special_tokens(requested: bool | None) -> bool:
    """Whether encoding the rendered prompt adds the tokenizer's special tokens: as the
    request says (vLLM's ``add_special_tokens``: true adds them on top of the template's),
    and not said, none, as vLLM's chat and transformers' ``apply_chat_template(tokenize=
    True)`` encode: the template alone decides the prompt's BOS. (Adding the tokenizer's
    BOS when the template wrote none gave a template without BOS a prompt its model never
    saw on vLLM, and other ids for the same request than vLLM's prefix caches.)"""
    return bool(requested)


def reply_role(messages: list[ChatMessage], add_generation_prompt: bool) -> ReplyRole:
    """The role the reply is reported with, as vLLM's ``get_chat_request_role``: the
    assistant's when the prompt opens a new assistant turn, else the final message's, which
    the reply continues (a user turn continued with add_generation_prompt false is the
    user's text, not an assistant reply)."""
    if add_generation_prompt or not messages:
        return "assistant"
    return messages[-1].role


def echo_text(messages: list[ChatMessage], add_generation_prompt: bool) -> str:
    """vLLM's chat ``echo``: the final message's text when it has the reply's role
    (``reply_role``), which the reply then starts with."""
    if not messages or messages[-1].role != reply_role(messages, add_generation_prompt):
        return ""
    return messages[-1].text()
