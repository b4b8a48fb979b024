"""A scripted stand-in for LLMEngine, for the fast HTTP-layer unit tests only.

The real engine is exercised by the other test files; this one lets the server's plumbing
(queues, streaming, errors, aborts, back-pressure, KV events) be tested in milliseconds and
with exact expectations: token ``k`` of sequence ``i`` is ``(base + 7 * i + k) % 200 + 300``.
It emits BlockStored for each prompt's full blocks on admission and BlockRemoved on abort,
so the publisher sees a realistic event stream.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from pagefleet.daemon.config import DaemonConfig
from pagefleet.dev.process import free_port
from pagefleet.engine.outputs import (
    CompletionDelta,
    EngineStats,
    RequestMetrics,
    RequestOutput,
    TokenLogprob,
)
from pagefleet.engine.sampling_params import SamplingParams
from pagefleet.kvindex.events import BlockRemoved, BlockStored, KVEventBatch
from pagefleet.kvindex.hashing import block_hashes
from pagefleet.testing.engine_stats import idle_engine_stats
from pagefleet.tokenizer import Tokenizer


@dataclass
class _Req:
    rid: str
    prompt: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    generated: list[list[int]] = field(default_factory=list)
    done: list[bool] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)


class FakeEngine:
    def __init__(self, tokenizer: Tokenizer, event_sink=None, step_delay_s: float = 0.0,
                 max_model_len: int = 256, block_size: int = 4,
                 crash_at_step: int | None = None, hang_at_step: int | None = None,
                 hang_until: threading.Event | None = None) -> None:  # fmt: skip
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self._sink = event_sink
        self._delay = step_delay_s
        self._crash_at = crash_at_step
        self._hang_at = hang_at_step  # this step blocks until ``hang_until`` is set
        self._hang_until = hang_until
        self._bs = block_size
        self._reqs: dict[str, _Req] = {}
        self._cached: set[int] = set()
        self._seq = 0
        self._pending: list = []
        self.s = idle_engine_stats()
        self.aborted: list[str] = []
        self._aborted_outputs: list[RequestOutput] = []

    def add_request(self, request_id, prompt, params, arrival_time=None, lora_id=None) -> None:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if request_id in self._reqs:
            raise ValueError(f"duplicate request id {request_id}")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt too long: {len(ids)}")
        r = _Req(request_id, ids, params, RequestMetrics(arrival_time or time.monotonic()))
        r.generated = [[] for _ in range(params.n)]
        r.done = [False] * params.n
        r.hashes = block_hashes(ids, self._bs)
        new = [h for h in r.hashes if h not in self._cached]
        self._cached.update(new)
        if new:
            self._pending.append(BlockStored(new, None, ids, self._bs))
        self._reqs[request_id] = r
        self.s.prompt_tokens_total += len(ids)

    def abort(self, request_id: str) -> bool:
        r = self._reqs.pop(request_id, None)
        if r is None:
            return False
        self.aborted.append(request_id)
        # Like the real engine: the request's final "abort" deltas come out of the next step.
        ends = [
            CompletionDelta(i, [], "", None, "abort") for i in range(r.params.n) if not r.done[i]
        ]
        r.metrics.finished_time = time.monotonic()
        self._aborted_outputs.append(
            RequestOutput(request_id, r.prompt, ends, True, r.metrics,
                          sum(len(g) for g in r.generated))
        )  # fmt: skip
        # Aborting drops the request's blocks from the cache (unlike the real engine) so the
        # publisher has BlockRemoved events to carry.
        gone = [h for h in r.hashes if h in self._cached]
        self._cached.difference_update(gone)
        if gone:
            self._pending.append(BlockRemoved(gone))
        self._flush_events()
        return True

    def has_unfinished(self) -> bool:
        return bool(self._reqs) or bool(self._aborted_outputs)

    def cached_block_hashes(self) -> set[int]:
        return set(self._cached)

    def _flush_events(self) -> None:
        if self._pending and self._sink is not None:
            self._seq += 1
            self._sink(KVEventBatch(time.time(), self._seq, self._pending))
        self._pending = []

    def step(self) -> list[RequestOutput]:
        if self._delay:
            time.sleep(self._delay)
        if self._crash_at is not None and self.s.steps_total >= self._crash_at:
            raise RuntimeError("simulated CUDA error")
        if self._hang_at is not None and self.s.steps_total == self._hang_at:
            assert self._hang_until is not None
            self._hang_until.wait()  # a stuck kernel or a deadlock: the step never returns
        now = time.monotonic()
        outs: list[RequestOutput] = self._aborted_outputs
        self._aborted_outputs = []
        for rid, r in list(self._reqs.items()):
            if r.metrics.first_scheduled_time is None:
                r.metrics.first_scheduled_time = now
            deltas = []
            for i in range(r.params.n):
                if r.done[i]:
                    continue
                k = len(r.generated[i])
                tok = (sum(r.prompt) + 7 * i + k) % 200 + 300
                r.generated[i].append(tok)
                text = self.tokenizer.decode([tok])
                lps = None
                if r.params.logprobs is not None:
                    top = [(tok, text, -0.5), (tok + 1, f"alt{tok}", -1.5)][: r.params.logprobs]
                    lps = [TokenLogprob(tok, text, -0.5, top)]
                finish = None
                if r.params.max_tokens is not None and k + 1 >= r.params.max_tokens:
                    finish = "length"
                    r.done[i] = True
                deltas.append(CompletionDelta(i, [tok], text, lps, finish))
            self.s.generation_tokens_total += len(deltas)
            r.metrics.first_token_time = r.metrics.first_token_time or now
            r.metrics.last_token_time = now
            finished = all(r.done)
            if finished:
                r.metrics.finished_time = now
                del self._reqs[rid]
            outs.append(
                RequestOutput(rid, r.prompt, deltas, finished, r.metrics,
                              sum(len(g) for g in r.generated))
            )  # fmt: skip
        self.s.steps_total += 1
        self.s.num_running = len(self._reqs)
        self._flush_events()
        return outs

    def stats(self) -> EngineStats:
        return dataclasses.replace(self.s, num_cached_blocks=len(self._cached))


def fake_config(**overrides: Any) -> DaemonConfig:
    """A daemon config for the fake engine on a fresh loopback port; ``overrides`` win."""
    base: dict[str, Any] = dict(model="tiny", served_model_name="fake", port=free_port(),
                                   pod_name="pod-a", max_num_seqs=4, max_queue=4)  # fmt: skip
    base.update(overrides)
    return DaemonConfig(**base)


def fake_engine_factory(tok: Tokenizer, holder: list[FakeEngine], **kw: object):
    """An engine factory for ``live_daemon`` that builds a FakeEngine and appends it to
    ``holder`` so the test can script and inspect it."""

    def make(cfg: DaemonConfig, sink: Any) -> FakeEngine:
        eng = FakeEngine(tok, event_sink=sink, **kw)
        holder.append(eng)
        return eng

    return make
