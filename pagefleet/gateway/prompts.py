"""Request body -> the prompt token ids the daemon will see, to compute block keys.

Invariant: for a request the daemon accepts, these are exactly the ids the daemon's engine
prefills (same tokenizer files, same chat-template rendering, same BOS rule); otherwise the
gateway's block keys would never match the daemons' and cache_aware would route blind.
"""

from __future__ import annotations

import logging
from pathlib import Path

from pagefleet.api import chat_prompt
from pagefleet.api.openai import ChatCompletionRequest, CompletionRequest
from pagefleet.gateway.segment_cache import SegmentCachedEncoder
from pagefleet.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class PromptTokenizer:
    def __init__(
        self, tokenizer: Tokenizer, spec: str | None = None, cache_segments: bool = True
    ) -> None:
        self.tokenizer = tokenizer
        # The --model value (directory or preset), so a worker process can load the same.
        self.spec = spec
        # Chat turns repeat their system prompt and history: encode only what is new.
        self.segments = SegmentCachedEncoder(tokenizer) if cache_segments else None

    @classmethod
    def from_dir(cls, path: str | Path) -> PromptTokenizer:
        return cls(Tokenizer.from_dir(path), str(path))

    @classmethod
    def from_spec(cls, spec: str) -> PromptTokenizer:
        """A checkpoint directory or a preset name (torch-free, see pagefleet.presets)."""
        from pagefleet.presets import load_tokenizer

        return cls(load_tokenizer(spec), spec)

    def completion_ids(self, req: CompletionRequest) -> list[int]:
        """Ids of the first prompt of the batch (a batch is routed as one unit)."""
        first = req.prompts()[0]
        if isinstance(first, list):
            return list(first)
        return self.tokenizer.encode(first, add_special_tokens=req.add_special_tokens)

    def chat_text(self, req: ChatCompletionRequest) -> str:
        """The prompt text the daemon renders for ``req`` (the same function renders it
        there: api/chat_prompt.py), so the gateway routes and judges length on the prompt
        that will run. Raises what rendering raises (the daemon answers those with a 400)."""
        tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
        return chat_prompt.render_chat(
            self.tokenizer,
            req.messages,
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            chat_template_kwargs=req.chat_template_kwargs,
            tools=tools,
            documents=req.documents,
        )

    def chat_text_ids(self, text: str, requested: bool | None = None) -> list[int]:
        """Ids of a rendered chat prompt; ``requested``: the request's add_special_tokens."""
        add = chat_prompt.add_special_tokens(requested)
        if self.segments is not None:
            return self.segments.encode(text, add_special_tokens=add)
        return self.tokenizer.encode(text, add_special_tokens=add)

    def chat_ids(self, req: ChatCompletionRequest) -> list[int]:
        return self.chat_text_ids(self.chat_text(req), req.add_special_tokens)
