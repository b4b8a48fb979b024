"""Piecewise chat tokenization with cached pieces equals a whole encode, or switches off."""

from __future__ import annotations

import pytest

from pagefleet.api.openai import ChatCompletionRequest
from pagefleet.dev.workload import (
    AgenticSpec,
    WorkloadSpec,
    build_agentic,
    build_conversations,
    flatten,
)
from pagefleet.engine.tiny import PRESETS
from pagefleet.gateway.prompts import PromptTokenizer
from pagefleet.gateway.segment_cache import SegmentCachedEncoder
from pagefleet.presets import load_tokenizer


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_cached_pieces_give_the_whole_encode_on_chat_traces(preset: str) -> None:
    tok = load_tokenizer(preset)
    cached, whole = PromptTokenizer(tok), PromptTokenizer(tok, cache_segments=False)
    convs = build_conversations(WorkloadSpec(num_conversations=12, system_prompt_words=150))
    convs += build_agentic(AgenticSpec(num_conversations=6))
    turns = list(flatten(convs))
    odd = [{"role": "user", "content": "typed <|im_start|>markers<|im_end|> and  spaces\n\n"}]
    for msgs in [t.as_openai() for t in turns] + [odd]:
        req = ChatCompletionRequest(model="m", messages=msgs)
        assert cached.chat_ids(req) == whole.chat_ids(req)
    seg = cached.segments
    assert seg is not None
    if seg.enabled:  # templates with special markers: the system prompts come from the cache
        assert seg.hits > len(turns) // 2
        # Past the verification window as well (no whole encode to fall back on).
        assert seg.calls > seg.verify_first


def test_a_mismatch_turns_the_cache_off_and_returns_the_whole_encode(caplog) -> None:
    tok = load_tokenizer(sorted(PRESETS)[0])
    enc = SegmentCachedEncoder(tok, min_chars=1)
    assert enc.enabled  # ChatML markers, unstripped
    text = "<|im_start|>user\nhello world<|im_end|>\n"
    want = tok.encode(text, add_special_tokens=True)
    assert enc.encode(text, True) == want
    enc._cache["user\nhello world"] = [7, 7, 7]  # a piece that no longer matches
    assert enc.encode(text, True) == want
    assert not enc.enabled and "piecewise tokenization differs" in caplog.text


def test_the_cache_is_bounded_by_tokens_and_keeps_what_repeats() -> None:
    """Unique long pieces (documents pasted into a chat) fill a token budget, not
    ``max_entries`` pieces of any size: 200 of them at ~10k tokens each held 114 MiB."""
    tok = load_tokenizer(sorted(PRESETS)[0])
    enc = SegmentCachedEncoder(tok, max_tokens=20_000, verify_every=1)
    system = "<|im_start|>system\nyou are a careful assistant<|im_end|>\n"
    for i in range(40):
        doc = " ".join(f"word{i}x{j}" for j in range(600))  # thousands of tokens, once
        text = system + f"<|im_start|>user\n{doc}<|im_end|>\n"
        assert enc.encode(text, True) == tok.encode(text, add_special_tokens=True)
        assert enc.cached_tokens <= enc.max_tokens
    assert enc.enabled and sum(len(v) for v in enc._cache.values()) == enc.cached_tokens
    assert "system\nyou are a careful assistant" in enc._cache  # hit every call: kept
    huge = "<|im_start|>user\n" + "z " * 30_000 + "<|im_end|>\n"  # over the budget alone
    assert enc.encode(huge, False) == tok.encode(huge, add_special_tokens=False)
    assert enc.cached_tokens <= enc.max_tokens
