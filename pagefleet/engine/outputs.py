"""What ``LLMEngine.step()`` hands back: per-request deltas since the previous step.

Invariant: for each (request_id, index) the concatenation of ``new_token_ids`` over all
deltas is the full generated sequence and the concatenation of ``new_text`` is its
detokenized text (stop strings excluded unless asked); exactly one delta per sequence has
``finish_reason`` set, and none follows it.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    token: str
    logprob: float
    top: list[tuple[int, str, float]] = field(default_factory=list)  # (id, text, logprob)


@dataclass(slots=True)
class PromptLogprob:
    """One prompt token's score (``SamplingParams.prompt_logprobs``): the log-softmax of
    the raw logits at the position before it. ``rank`` is 1 for the most likely token;
    ``top`` the k most likely ``(id, text, logprob)``, best first (ranks 1..k)."""

    token_id: int
    token: str
    logprob: float
    rank: int
    top: list[tuple[int, str, float]] = field(default_factory=list)


@dataclass(slots=True)
class CompletionDelta:
    index: int  # which of the n sequences
    new_token_ids: list[int]
    new_text: str
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: str | int | None = None  # the stop string or token id that matched


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    deltas: list[CompletionDelta]
    finished: bool  # every sequence of the request has finished
    metrics: RequestMetrics
    num_generated_tokens: int = 0  # over all n sequences, so far
    # With prompt_logprobs: one entry per prompt token (None for the first, which has no
    # context), on the request's first output only; None otherwise.
    prompt_logprobs: list[PromptLogprob | None] | None = None


@dataclass(slots=True)
class CompletionOutput:
    """One finished sequence, as ``LLMEngine.generate`` returns it."""

    index: int
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


@dataclass(slots=True)
class GenerateResult:
    """A whole request after it finished: its ``n`` outputs in index order."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    metrics: RequestMetrics
    prompt_logprobs: list[PromptLogprob | None] | None = None


@dataclass(slots=True)
class EngineStats:
    """The engine's counters after a step (``LLMEngine.stats``); it crosses the engine
    process's pipe every step, so it lives here, free of torch."""

    num_running: int
    num_waiting: int
    num_preempted_total: int
    kv_usage: float  # fraction of blocks referenced by live requests
    num_blocks: int
    num_free_blocks: int
    prefix_queries_tokens: int  # cumulative
    prefix_hits_tokens: int
    prompt_tokens_total: int
    generation_tokens_total: int
    evictions_total: int
    steps_total: int
    num_cached_blocks: int = 0  # blocks holding a prefix-cache key (what the index shows)
    kv_exports_live: int = 0  # P/D: prefill handles waiting to be pulled
    kv_exports_expired_total: int = 0  # P/D: handles freed by their deadline, never pulled
    kv_imports_live: int = 0  # P/D: block reservations for pulls in flight
