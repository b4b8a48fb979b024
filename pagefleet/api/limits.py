"""Limits shared by the daemon and the gateway, so that both refuse the same requests.

Invariant: a body the daemon would refuse as too large is refused by the gateway too (same
default), before the gateway spends memory or CPU on it.
"""

from __future__ import annotations

DEFAULT_MAX_BODY_BYTES = 4 << 20
"""Largest request body accepted, in bytes (``--max-body-bytes`` on daemon and gateway)."""


def context_length_error(
    prompt_tokens: int,
    max_tokens: int | None,
    limit: int,
    *,
    at_least: bool = False,
    prompt_param: str = "prompt",
    max_tokens_param: str = "max_tokens",
) -> tuple[str, str] | None:
    """``(message, param)`` of the ``context_length_exceeded`` error, or None when the
    prompt and ``max_tokens`` fit in ``limit`` tokens; the daemon and the gateway both use it
    so a client sees the same error whichever refused. ``at_least``: the count is a lower
    bound (the gateway refused without tokenizing the whole prompt). ``prompt_param`` and
    ``max_tokens_param`` are the fields the caller sent: chat's prompt is its "messages",
    its output bound may be "max_completion_tokens"."""
    count = f"at least {prompt_tokens}" if at_least else str(prompt_tokens)
    what = "prompt" if prompt_param == "prompt" else f"prompt built from the {prompt_param}"
    if prompt_tokens >= limit:
        return (
            f"{what} has {count} tokens; this model's maximum context length is {limit} "
            f"tokens including the output; shorten the {prompt_param}",
            prompt_param,
        )
    if max_tokens is not None and prompt_tokens + max_tokens > limit:
        tokens = f"the prompt's {count} tokens"
        if what != "prompt":
            tokens = f"the {count} tokens of the {what}"
        return (
            f"{max_tokens_param}={max_tokens} plus {tokens} exceeds the maximum "
            f"context length {limit}; lower {max_tokens_param} to at most "
            f"{limit - prompt_tokens}",
            max_tokens_param,
        )
    return None


def body_not_decoded(exc: Exception) -> str:
    """The 400's message for a body that its ``Content-Encoding`` does not decode (aiohttp's
    ``RequestPayloadError``): the same words from the daemon and the gateway."""
    return (
        f"request body could not be decoded ({exc}); send it uncompressed or with a "
        "Content-Encoding that matches it"
    )
