"""Limits shared by the daemon and the gateway, so that both refuse the same requests.

Invariant: a body the daemon would refuse as too large is refused by the gateway too (same
default), before the gateway spends memory or CPU on it.
"""

from __future__ import annotations

DEFAULT_MAX_BODY_BYTES = 4 << 20
"""Largest request body accepted, in bytes (``--max-body-bytes`` on daemon and gateway)."""


def context_length_error(
    prompt_tokens: int, max_tokens: int | None, limit: int, *, at_least: bool = False
) -> tuple[str, str] | None:
    """``(message, param)`` of the ``context_length_exceeded`` error, or None when the
    prompt and ``max_tokens`` fit in ``limit`` tokens; the daemon and the gateway both use it
    so a client sees the same error whichever refused. ``at_least``: the count is a lower
    bound (the gateway refused without tokenizing the whole prompt)."""
    count = f"at least {prompt_tokens}" if at_least else str(prompt_tokens)
    if prompt_tokens >= limit:
        return (
            f"prompt has {count} tokens; this model's maximum context length is {limit} "
            "tokens including the output; shorten the prompt",
            "prompt",
        )
    if max_tokens is not None and prompt_tokens + max_tokens > limit:
        return (
            f"max_tokens={max_tokens} plus the prompt's {count} tokens exceeds the maximum "
            f"context length {limit}; lower max_tokens to at most {limit - prompt_tokens}",
            "max_tokens",
        )
    return None


def body_not_decoded(exc: Exception) -> str:
    """The 400's message for a body that its ``Content-Encoding`` does not decode (aiohttp's
    ``RequestPayloadError``): the same words from the daemon and the gateway."""
    return (
        f"request body could not be decoded ({exc}); send it uncompressed or with a "
        "Content-Encoding that matches it"
    )
