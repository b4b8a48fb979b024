"""One HTTP generation request as the engine sees it: prompts in, per-choice state out.

A job holds one engine request per prompt (``n`` sequences each), all reading one queue.
Choice ``i * n + j`` is sequence ``j`` of prompt ``i``, as OpenAI numbers them. Nothing here
knows whether the caller asked for a completion or a chat completion (responses.py does).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from pagefleet.api.openai import PromptTokensDetails, Usage
from pagefleet.daemon.engine_handle import StreamItem
from pagefleet.daemon.kv_transfer import KVTransferParams
from pagefleet.daemon.metrics import DaemonMetrics
from pagefleet.daemon.request_log import RequestLog
from pagefleet.engine.outputs import CompletionDelta, PromptLogprob, RequestOutput, TokenLogprob
from pagefleet.engine.sampling_params import SamplingParams


@dataclass(slots=True)
class Choice:
    """What one of the n sequences of one prompt has produced so far."""

    index: int
    text: str = ""
    num_tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    last_token_t: float | None = None
    sent_role: bool = False  # chat streaming: the first chunk carries role "assistant"
    # chat streaming of a forced tool call: its id once announced, argument chars sent
    tool_call_id: str | None = None
    tool_args_sent: int = 0
    # Streamed completions logprobs: characters of the tokens whose logprobs were sent, so
    # each token's text_offset is the non-streamed one (a chunk's text can start earlier
    # than its first token's, when text held back by an earlier token arrives with it).
    logprob_chars_sent: int = 0
    # Streamed echo with logprobs: the echo goes out with the choice's first chunk (its
    # prompt logprobs come with the request's first output, not before).
    sent_echo: bool = False


@dataclass(slots=True)
class Job:
    """One HTTP generation request: one engine request per prompt, read from one queue."""

    base_id: str
    prompts: list[list[int]]
    params: SamplingParams
    queue: asyncio.Queue[StreamItem | BaseException] = field(default_factory=asyncio.Queue)
    live: set[str] = field(default_factory=set)  # engine request ids not finished yet
    choices: dict[int, Choice] = field(default_factory=dict)
    cached_tokens: dict[str, int] = field(default_factory=dict)
    echo: list[str] | None = None  # prompt texts returned before the output (completions)
    forced_tool_call: bool = False  # chat: the output is a constrained {"name", "arguments"}
    # P/D: the request's kv_transfer_params (pagefleet/daemon/pd.py), None without any
    transfer: KVTransferParams | None = None
    # --request-log: when the HTTP handler started (monotonic), and where to record it
    t_http: float = 0.0
    trace: RequestLog | None = None
    # P/D prefill: the engine request id of the (only) prompt when the caller named its
    # transfer handle (kv_transfer_params.remote_request_id with do_remote_decode)
    handle: str | None = None
    # max_tokens 0 with echo (scoring): the engine generates one token, dropped here.
    echo_only: bool = False
    # The top k of vLLM's ``prompt_logprobs`` field as the caller asked for it (None: not
    # asked; echo with logprobs asks the engine for prompt logprobs without it).
    prompt_logprobs_k: int | None = None
    # Per prompt: each token's logprob (None first), from the request's first output.
    prompt_logprobs: dict[int, list[PromptLogprob | None]] = field(default_factory=dict)
    # Per prompt: the first token's text (it has no logprob entry to carry it), for echo
    # with logprobs.
    first_token_texts: list[str] = field(default_factory=list)

    def rid(self, i: int) -> str:
        if i == 0 and self.handle is not None:
            return self.handle
        return f"{self.base_id}-{i}"

    def text_base(self, choice_index: int) -> int:
        """Where a choice's generated text starts in the text returned (after any echo)."""
        return len(self.echo[choice_index // self.params.n]) if self.echo else 0

    def echo_text(self, choice_index: int) -> str:
        return self.echo[choice_index // self.params.n] if self.echo else ""

    @property
    def echo_logprobs(self) -> bool:
        """Echo with logprobs: the prompt tokens' logprobs come before the output's."""
        return self.echo is not None and self.params.logprobs is not None

    def choice_prompt_logprobs(self, choice_index: int) -> list[PromptLogprob | None] | None:
        return self.prompt_logprobs.get(choice_index // self.params.n)

    def prompt_index(self, rid: str) -> int:
        if rid == self.handle:
            return 0
        return int(rid.rsplit("-", 1)[1])

    def choice(self, rid: str, delta: CompletionDelta) -> Choice:
        idx = self.prompt_index(rid) * self.params.n + delta.index
        ch = self.choices.get(idx)
        if ch is None:
            ch = self.choices[idx] = Choice(idx)
        return ch

    def sorted_choices(self) -> list[Choice]:
        return sorted(self.choices.values(), key=lambda c: c.index)

    def usage(self) -> Usage:
        prompt = sum(len(p) for p in self.prompts)
        completion = sum(c.num_tokens for c in self.choices.values())
        return Usage(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            prompt_tokens_details=PromptTokensDetails(
                cached_tokens=sum(self.cached_tokens.values())
            ),
        )

    def absorb(
        self, item: StreamItem, metrics: DaemonMetrics
    ) -> list[tuple[Choice, CompletionDelta]]:
        """Fold one engine output into the choices; record metrics of what finished."""
        out: RequestOutput = item.output
        self.cached_tokens[out.request_id] = out.metrics.num_cached_tokens
        if out.prompt_logprobs is not None:
            self.prompt_logprobs[self.prompt_index(out.request_id)] = out.prompt_logprobs
        touched = []
        for delta in out.deltas:
            if self.echo_only:
                delta = _scoring_only(delta)
            ch = self.choice(out.request_id, delta)
            k = len(delta.new_token_ids)
            if k:
                if ch.last_token_t is not None:
                    gap = (item.t - ch.last_token_t) / k
                    for _ in range(k):
                        metrics.itl.observe(gap)
                ch.last_token_t = item.t
            ch.num_tokens += k
            ch.text += delta.new_text
            if delta.logprobs:
                ch.logprobs.extend(delta.logprobs)
            if delta.finish_reason is not None:
                ch.finish_reason = delta.finish_reason
                ch.stop_reason = delta.stop_reason
                metrics.finished(delta.finish_reason)
                metrics.request_generation_tokens.observe(ch.num_tokens)
            touched.append((ch, delta))
        if out.finished:
            self.live.discard(out.request_id)
            prompt = self.prompts[self.prompt_index(out.request_id)]
            metrics.request_prompt_tokens.observe(len(prompt))
            metrics.observe_request(out.metrics, out.num_generated_tokens // self.params.n)
            if self.trace is not None:
                self.trace.record(
                    self.t_http,
                    self.prompts[self.prompt_index(out.request_id)],
                    out.metrics,
                    out.num_generated_tokens // self.params.n,
                )
        return touched


def _scoring_only(delta: CompletionDelta) -> CompletionDelta:
    """``delta`` without what was generated (max_tokens 0): no tokens, text or logprobs,
    and an ending is "length", as OpenAI reports it (an abort stays an abort)."""
    finish = delta.finish_reason
    if finish is not None and finish != "abort":
        finish = "length"
    lps = None if delta.logprobs is None else []
    return CompletionDelta(delta.index, [], "", lps, finish, None)
