"""Stateful property test: the real engine on the tiny seeded model, a small KV pool.

A hypothesis ``RuleBasedStateMachine`` interleaves at random: adding requests (prompts that
share prefixes with earlier ones, often ending exactly on a block boundary; n > 1, beam
search, seeded sampling, stop strings, ``max_tokens`` from 1 up to the model length),
aborting them (waiting, mid chunked prefill, mid decode), stepping, and resetting the
prefix cache. The pool is small, so sequences are preempted and cached blocks evicted.

After every step:
- ``check_integrity()``: free + cached-unreferenced + referenced == total, ref counts equal
  the tables holding each block, no live sequence is lost, no ended sequence holds a table;
- the KV events replayed into a set give exactly the cached blocks, prefix-closed;
- a finished or aborted request holds no block;
- a finished request's tokens equal the same request run alone on a fresh engine (a large
  pool, no prefix caching): token-exact, so neither the prefix cache nor preemption nor
  batching changes a token; an aborted request's tokens so far are a prefix of them.
  Each copy-on-write launch applies its pairs last first, as a parallel kernel may.

Engine shapes vary per run: block size 2 or 4, a pool from one max-length sequence to a
few blocks more, chunked prefill on or off (with and without a long-prefill cap), token
budgets from 5, prefix caching mostly on, cache-aware ordering. The default run is short
(the suite stays fast); PAGEFLEET_STATEFUL_EXAMPLES / _STEPS run it deeper.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from pagefleet.engine.config import EngineConfig
from pagefleet.engine.engine import LLMEngine
from pagefleet.engine.request import SequenceStatus
from pagefleet.engine.sampling_params import SamplingParams
from pagefleet.kvindex.events import AllBlocksCleared, BlockRemoved, BlockStored

PRESET = "tiny"
VOCAB_LO, VOCAB_HI = 5, 1023  # prompt token ids (the tiny model's EOS ids are 2 and 4)
# Deeper runs: PAGEFLEET_STATEFUL_EXAMPLES=300 pytest tests/engine/test_engine_stateful.py
MAX_EXAMPLES = int(os.environ.get("PAGEFLEET_STATEFUL_EXAMPLES", "8"))
STEP_COUNT = int(os.environ.get("PAGEFLEET_STATEFUL_STEPS", "12"))

_LOADED: dict[str, Any] = {}
# (prompt, block_size, max_model_len, params repr) -> per-index (tokens, finish_reason)
_REFERENCE: dict[tuple, list[tuple[list[int], str]]] = {}
_REF_ENGINES: dict[tuple[int, int], LLMEngine] = {}  # (block_size, max_len) -> engine


def _engine(event_sink=None, **kw: Any) -> LLMEngine:
    """An engine over the tiny preset's weights (loaded once per session)."""
    from pagefleet.engine.loader import load_model, resolve_model
    from pagefleet.engine.parts import load_parts

    if PRESET not in _LOADED:
        _LOADED[PRESET] = load_model(resolve_model(PRESET))
    config = EngineConfig(model=PRESET, **kw)
    return LLMEngine(config, event_sink, parts=load_parts(config, loaded=_LOADED[PRESET]))


def _collect(engine: LLMEngine, outputs, got: dict, done: dict) -> list[str]:
    """Fold ``outputs`` into ``got`` (per request, per index: tokens, finish reason);
    return the ids of the requests that finished."""
    finished = []
    for out in outputs:
        per = got.setdefault(out.request_id, {})
        for d in out.deltas:
            toks, reason = per.get(d.index, ([], None))
            assert reason is None, f"{out.request_id}[{d.index}]: a delta after its finish"
            per[d.index] = (toks + list(d.new_token_ids), d.finish_reason)
        if out.finished:
            assert out.request_id not in done, f"{out.request_id} finished twice"
            done[out.request_id] = True
            finished.append(out.request_id)
    return finished


def reference(prompt: list[int], params: SamplingParams, block_size: int, max_len: int):
    """The request alone on a fresh engine with a pool that never preempts or caches."""
    key = (tuple(prompt), block_size, max_len, repr(params))
    if key not in _REFERENCE:
        # An idle engine without prefix caching is as good as a fresh one (and cheaper).
        engine = _REF_ENGINES.get((block_size, max_len))
        if engine is None:
            engine = _REF_ENGINES[(block_size, max_len)] = _engine(
                block_size=block_size,
                num_gpu_blocks=4 * (-(-max_len // block_size)) + 8,
                max_model_len=max_len,
                enable_prefix_caching=False,
                max_num_batched_tokens=4096,
            )
        assert not engine.has_unfinished()
        rid = f"ref{len(_REFERENCE)}"
        engine.add_request(rid, list(prompt), _copy(params))
        got: dict = {}
        while engine.has_unfinished():
            _collect(engine, engine.step(), got, {})
        assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks
        per = got[rid]
        _REFERENCE[key] = [per[i] for i in range(params.n)]
    return _REFERENCE[key]


def _copy(params: SamplingParams) -> SamplingParams:
    """A fresh SamplingParams (the engine fills ``bad_words_token_ids`` in place)."""
    return dataclasses.replace(params, stop=list(params.stop), bad_words_token_ids=[])


def _copy_pairs_in_reverse(k_caches, v_caches, src, dst) -> None:
    """What a parallel copy kernel may do: a call's pairs in any order (here last first)."""
    for s, d in reversed(list(zip(src.tolist(), dst.tolist(), strict=True))):
        for cache in (*k_caches, *v_caches):
            cache[d] = cache[s]


class Replayed:
    """The KV event stream folded into a set, as the global index would."""

    def __init__(self) -> None:
        self.blocks: set[int] = set()
        self.parent: dict[int, int | None] = {}

    def __call__(self, batch) -> None:
        for e in batch.events:
            if isinstance(e, BlockStored):
                assert not self.blocks & set(e.block_hashes), "stored a block twice"
                self.blocks.update(e.block_hashes)
                parents = [e.parent_block_hash, *e.block_hashes[:-1]]
                self.parent.update(zip(e.block_hashes, parents, strict=True))
            elif isinstance(e, BlockRemoved):
                assert set(e.block_hashes) <= self.blocks, "removed an unknown block"
                self.blocks.difference_update(e.block_hashes)
            elif isinstance(e, AllBlocksCleared):
                self.blocks.clear()

    def check(self, engine: LLMEngine) -> None:
        assert self.blocks == engine.cached_block_hashes(), "KV events disagree with the pool"
        orphans = {h for h in self.blocks if self.parent[h] not in (None, *self.blocks)}
        assert not orphans, f"{len(orphans)} cached blocks outlived their parent"


class EngineMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.engine: LLMEngine | None = None
        self.prompts: list[list[int]] = []
        self.params: dict[str, SamplingParams] = {}
        self.reqs: dict[str, Any] = {}  # request id -> Request, kept after it ends
        self.got: dict[str, dict[int, tuple[list[int], str | None]]] = {}
        self.done: dict[str, bool] = {}
        self.aborted: set[str] = set()

    @initialize(
        block_size=st.sampled_from([2, 4]),
        max_len=st.integers(10, 24),
        spare_blocks=st.integers(0, 3),
        chunked=st.booleans(),
        budget=st.sampled_from([5, 8, 16, 64]),
        max_num_seqs=st.sampled_from([3, 4, 8]),
        long_prefill=st.sampled_from([0, 3]),
        caching=st.sampled_from([True, True, True, False]),
        cache_aware=st.booleans(),
        first=st.integers(2, 4),
        data=st.data(),
    )
    def setup(
        self,
        block_size: int,
        max_len: int,
        spare_blocks: int,
        chunked: bool,
        budget: int,
        max_num_seqs: int,
        long_prefill: int,
        caching: bool,
        cache_aware: bool,
        first: int,
        data: st.DataObject,
    ) -> None:
        # The smallest pool still fits one sequence of max_len: more and they compete.
        num_blocks = -(-max_len // block_size) + spare_blocks
        if not chunked:
            budget = max(budget, max_len)
        self.block_size, self.max_len = block_size, max_len
        self.sink = Replayed()
        self.engine = _engine(
            self.sink,
            block_size=block_size,
            num_gpu_blocks=num_blocks,
            max_model_len=max_len,
            enable_prefix_caching=caching,
            enable_chunked_prefill=chunked,
            max_num_batched_tokens=budget,
            max_num_seqs=max_num_seqs,
            long_prefill_token_threshold=long_prefill if chunked else 0,
            cache_aware_scheduling=cache_aware,
            max_wait_steps=3,
        )
        assert self.engine.max_model_len == max_len
        self.engine.runner.backend.copy_blocks = _copy_pairs_in_reverse
        for _ in range(first):  # every run starts with requests queued, short runs too
            self._add(data)

    # --- rules ---------------------------------------------------------------------------

    @rule(data=st.data(), count=st.integers(1, 3))
    def add(self, data: st.DataObject, count: int) -> None:
        for _ in range(count):
            self._add(data)

    def _add(self, data: st.DataObject) -> None:
        e = self.engine
        assert e is not None
        bs = self.block_size
        share = data.draw(st.sampled_from(["fresh", "prefix", "prefix", "same"]), "share")
        prompt: list[int] = []
        if self.prompts and share != "fresh":
            base = data.draw(st.sampled_from(self.prompts), "base")
            if share == "same":  # a full prefix-cache hit once the first one ran
                prompt = list(base)
            else:
                whole = [k * bs for k in range(1, len(base) // bs + 1)]
                on_block = whole and data.draw(st.booleans(), "on_block")
                cut_st = st.sampled_from(whole) if on_block else st.integers(1, len(base))
                prompt = list(base[: data.draw(cut_st, "cut")])
        room = self.max_len - 1 - len(prompt)
        if share != "same" or not prompt:
            extra = data.draw(st.integers(0 if prompt else 1, room), "extra")
            suffix = st.lists(st.integers(VOCAB_LO, VOCAB_HI), min_size=extra, max_size=extra)
            prompt += data.draw(suffix, "suffix")
            if data.draw(st.booleans(), "fill_blocks") and len(prompt) > bs:
                prompt = prompt[: len(prompt) // bs * bs]  # ends on a block boundary
        kind = data.draw(st.sampled_from(["greedy", "greedy", "sampled", "beam", "stop"]), "kind")
        max_tokens = data.draw(st.one_of(st.integers(1, 8), st.none()), "max_tokens")
        n = data.draw(st.integers(1, 3), "n")
        if kind == "beam":
            width = data.draw(st.integers(max(n, 2), 3), "width")
            params = SamplingParams(n=n, best_of=width, use_beam_search=True, temperature=0.0,
                                    max_tokens=max_tokens, ignore_eos=True)  # fmt: skip
        elif kind == "sampled":
            params = SamplingParams(n=n, temperature=0.8, top_k=40, seed=data.draw(
                st.integers(0, 99), "seed"), max_tokens=max_tokens)  # fmt: skip
        else:
            params = SamplingParams(n=n, temperature=0.0, max_tokens=max_tokens)
            if kind == "stop":
                # A stop string the answer does produce: a piece of its text.
                (toks, _), *_ = reference(prompt, params, bs, self.max_len)
                text = e.tokenizer.decode(toks)
                if len(text) >= 2:
                    at = data.draw(st.integers(0, len(text) - 2), "stop_at")
                    params = SamplingParams(n=n, temperature=0.0, max_tokens=max_tokens,
                                            stop=[text[at : at + 2]])  # fmt: skip
        if n > e.config.max_num_seqs or params.beam_width > e.config.max_num_seqs:
            return
        rid = f"r{len(self.reqs)}"
        e.add_request(rid, list(prompt), _copy(params))
        self.prompts.append(prompt)
        self.params[rid] = params
        self.reqs[rid] = e._requests[rid]

    def _live(self) -> list[str]:
        assert self.engine is not None
        return sorted(self.engine._requests)

    @precondition(lambda self: self.engine is not None and self.engine._requests)
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        self._abort(data.draw(st.sampled_from(self._live()), "victim"))

    def _in_prefill(self) -> list[str]:
        assert self.engine is not None
        return [
            rid
            for rid, req in sorted(self.engine._requests.items())
            if any(
                s.status is SequenceStatus.RUNNING
                and 0 < s.num_computed_tokens < s.num_prompt_tokens
                for s in req.seqs
            )
        ]

    @precondition(lambda self: self.engine is not None and self._in_prefill())
    @rule(data=st.data())
    def abort_mid_prefill(self, data: st.DataObject) -> None:
        self._abort(data.draw(st.sampled_from(self._in_prefill()), "victim"))

    def _abort(self, rid: str) -> None:
        assert self.engine is not None
        assert self.engine.abort(rid)
        self.aborted.add(rid)
        self._check_holds_nothing(rid)
        self.engine.check_integrity()

    @rule(times=st.integers(1, 6))
    def step(self, times: int) -> None:
        for _ in range(times):
            self._step()

    @rule()
    def reset_prefix_cache(self) -> None:
        assert self.engine is not None
        self.engine.reset_prefix_cache()
        self.engine.check_integrity()
        self.sink.check(self.engine)

    # --- checks --------------------------------------------------------------------------

    def _step(self) -> None:
        e = self.engine
        assert e is not None
        for rid in _collect(e, e.step(), self.got, self.done):
            self._check_holds_nothing(rid)
            if rid not in self.aborted:
                self._check_answer(rid)
        e.check_integrity()
        self.sink.check(e)

    def _check_holds_nothing(self, rid: str) -> None:
        e = self.engine
        assert e is not None
        req = self.reqs[rid]
        for s in req.seqs:
            assert not e.kv.has_table(s), f"{rid}: ended sequence {s.seq_id} holds blocks"
        assert rid not in e._requests

    def _check_answer(self, rid: str) -> None:
        params = self.params[rid]
        ref = reference(self.reqs[rid].prompt_token_ids, params, self.block_size, self.max_len)
        per = self.got[rid]
        got = [per[i] for i in range(params.n)]
        assert got == ref, f"{rid} ({params}) differs from the same request run alone"

    def _check_prefixes(self) -> None:
        """An aborted request's tokens so far are a prefix of its answer alone."""
        for rid in self.aborted:
            params = self.params[rid]
            if params.use_beam_search:
                continue
            ref = reference(self.reqs[rid].prompt_token_ids, params, self.block_size, self.max_len)
            for i, (toks, _) in self.got.get(rid, {}).items():
                assert toks == ref[i][0][: len(toks)], f"aborted {rid}[{i}] diverged"

    @invariant()
    def pool_accounts_for_every_block(self) -> None:
        if self.engine is None:
            return
        pool = self.engine.kv.pool
        free = sum(1 for b in pool.blocks if b.ref_cnt == 0 and b.block_hash is None)
        cached = sum(1 for b in pool.blocks if b.ref_cnt == 0 and b.block_hash is not None)
        used = sum(1 for b in pool.blocks if b.ref_cnt > 0)
        assert free + cached + used == pool.num_blocks
        assert free + cached == pool.num_free_blocks

    def teardown(self) -> None:
        e = self.engine
        if e is None:
            return
        guard = 0
        while e.has_unfinished():
            self._step()
            guard += 1
            assert guard < 3000, "the engine makes no progress"
        self._check_prefixes()
        for rid in self.reqs:
            assert self.done.get(rid), f"{rid} never finished"
        assert e.kv.pool.num_referenced_blocks == 0, "blocks referenced after every request"
        stats = e.stats()
        event(f"preempted: {stats.num_preempted_total > 0}")
        event(f"evicted: {stats.evictions_total > 0}")
        event(f"prefix hits: {stats.prefix_hits_tokens > 0}")
        event(f"aborted: {bool(self.aborted)}")


EngineMachine.TestCase.settings = settings(
    max_examples=MAX_EXAMPLES,
    stateful_step_count=STEP_COUNT,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestEngineStateMachine = EngineMachine.TestCase
