"""What the daemon needs from an engine: the whole surface, in one place.

``LLMEngine`` (pagefleet/engine/engine.py) satisfies these protocols structurally; so does
the scripted fake engine of the HTTP-layer unit tests. Nothing here imports torch: the
daemon's HTTP layer, and its tests, load without it.

Threading: every method of ``EngineLike`` runs on the engine thread only (``EngineLoop``
queues the calls). The two attributes ``tokenizer`` and ``max_model_len`` are fixed once the
engine is built, so the event loop may read them directly (``EngineLoop.loaded_engine``).
"""

from __future__ import annotations

from typing import Any, Protocol

from pagefleet.engine.outputs import RequestOutput
from pagefleet.engine.sampling_params import SamplingParams


class ServingTokenizer(Protocol):
    """The tokenizer calls the OpenAI serving makes (``pagefleet.tokenizer.Tokenizer``)."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def template_adds_bos(self) -> bool: ...

    @property
    def chat_content_format(self) -> str: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str: ...


class EngineStatsLike(Protocol):
    """A snapshot of the engine's counters after a step (``EngineStats``)."""

    @property
    def num_running(self) -> int: ...

    @property
    def num_waiting(self) -> int: ...

    @property
    def num_preempted_total(self) -> int: ...

    @property
    def kv_usage(self) -> float: ...

    @property
    def num_blocks(self) -> int: ...

    @property
    def num_free_blocks(self) -> int: ...

    @property
    def prefix_queries_tokens(self) -> int: ...

    @property
    def prefix_hits_tokens(self) -> int: ...

    @property
    def prompt_tokens_total(self) -> int: ...

    @property
    def generation_tokens_total(self) -> int: ...

    @property
    def evictions_total(self) -> int: ...

    @property
    def steps_total(self) -> int: ...

    @property
    def num_cached_blocks(self) -> int: ...


class EngineLike(Protocol):
    """Everything the daemon (engine loop, serving, admin endpoints, publisher) calls."""

    @property
    def tokenizer(self) -> ServingTokenizer: ...

    @property
    def max_model_len(self) -> int: ...

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        lora_id: str | None = None,
    ) -> None:
        """Queue a request; ValueError (nothing admitted) if it can never run."""
        ...

    def abort(self, request_id: str) -> bool: ...

    def step(self) -> list[RequestOutput]: ...

    def has_unfinished(self) -> bool: ...

    def stats(self) -> EngineStatsLike: ...

    def cached_block_hashes(self) -> set[int]:
        """Every block key the engine holds as cached (the publisher's resync snapshot)."""
        ...

    def reset_prefix_cache(self) -> None: ...
