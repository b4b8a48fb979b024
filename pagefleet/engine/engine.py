"""LLMEngine: requests in, per-step deltas out, over the paged-KV scheduler and model runner.

One ``step()`` = schedule, run the model once, append each sampled token, check stop
conditions, hand back deltas, publish the step's KV events as one batch. The engine is
single-threaded: only the thread that calls ``step()`` may call ``add_request`` and
``abort``.

Invariants:
- every accepted request ends with exactly one delta per sequence carrying a
  ``finish_reason`` ("stop", "length" or "abort"), and nothing follows it;
- a finished or aborted sequence holds no KV block;
- the KV events handed to ``event_sink``, replayed in order, give exactly
  ``cached_block_hashes()``.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING, Generic, cast, overload

import torch

from pagefleet.engine.beam import BeamSearch, apply_selection, num_beam_candidates
from pagefleet.engine.config import EngineConfig
from pagefleet.engine.detokenizer import IncrementalDetokenizer
from pagefleet.engine.errors import InvalidRequestError
from pagefleet.engine.guided import GrammarBackend, GrammarError
from pagefleet.engine.kv_cache_manager import KVCacheManager, cdiv
from pagefleet.engine.kv_export import ExportedKV, ExportRegistry, ImportPlan, tail_hash
from pagefleet.engine.outputs import (
    CompletionDelta,
    CompletionOutput,
    EngineStats,
    GenerateResult,
    PromptLogprob,
    RequestMetrics,
    RequestOutput,
    TokenLogprob,
)
from pagefleet.engine.parts import EngineParts, TokenizerT, load_parts
from pagefleet.engine.request import Request, SeqIdCounter, Sequence
from pagefleet.engine.sampler import SampleResult
from pagefleet.engine.sampling_params import SamplingParams
from pagefleet.engine.scheduler import Scheduler
from pagefleet.kvindex.events import KVEventBatch
from pagefleet.kvindex.hashing import block_hashes

if TYPE_CHECKING:
    from pagefleet.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

EventSink = Callable[[KVEventBatch], None]


class LLMEngine(Generic[TokenizerT]):
    """``LLMEngine[Tokenizer]`` when built from a checkpoint (what the daemon serves: its
    ``tokenizer`` encodes and renders chat templates); model-free parts bring any decoder."""

    tokenizer: TokenizerT
    max_model_len: int

    @overload
    def __init__(
        self: LLMEngine[Tokenizer],
        config: EngineConfig,
        event_sink: EventSink | None = None,
        *,
        parts: None = None,
    ) -> None: ...

    @overload
    def __init__(
        self,
        config: EngineConfig,
        event_sink: EventSink | None = None,
        *,
        parts: EngineParts[TokenizerT],
    ) -> None: ...

    def __init__(
        self,
        config: EngineConfig,
        event_sink: EventSink | None = None,
        *,
        parts: EngineParts[TokenizerT] | None = None,
    ) -> None:
        """Build the engine over ``parts``; without them, load ``config.model``
        (``load_parts``: weights, KV pool size, model runner). The only constructor."""
        if parts is None:
            # The first overload: without parts, TokenizerT is Tokenizer.
            parts = cast("EngineParts[TokenizerT]", load_parts(config))
        num_blocks = parts.num_blocks
        self.config = config
        self.runner = parts.runner
        self.tokenizer = parts.tokenizer
        self.model_config = parts.model_config
        self.vocab_size = parts.vocab_size
        self.eos_token_ids = set(parts.eos_token_ids)
        max_len = config.max_model_len or parts.model_max_len
        capacity = num_blocks * config.block_size
        if max_len > capacity:
            # A lone sequence must always fit, or preemption could never make progress.
            logger.warning(
                "max_model_len %d exceeds the KV pool (%d blocks x %d = %d tokens); capping it",
                max_len,
                num_blocks,
                config.block_size,
                capacity,
            )
            max_len = capacity
        self.max_model_len = max_len
        if not config.enable_chunked_prefill and config.max_num_batched_tokens < max_len:
            raise ValueError(
                f"without chunked prefill max_num_batched_tokens "
                f"({config.max_num_batched_tokens}) must be >= max_model_len ({max_len}), or "
                "long prompts could never be scheduled; enable chunked prefill or raise it"
            )
        self.kv = KVCacheManager(
            num_blocks, config.block_size, config.enable_prefix_caching, config.kv_namespace
        )
        self.scheduler = Scheduler(config, self.kv, fork=self._fork)
        self.event_sink = event_sink
        self._event_seq = 0
        self._seq_ids = SeqIdCounter()
        self._requests: dict[str, Request] = {}
        self._aborted: list[RequestOutput] = []
        self._arrivals = 0
        self._gen_counter = 0
        self._seed_rng = torch.Generator().manual_seed(config.seed)
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.steps_total = 0
        self._grammars: GrammarBackend | None = None  # built on the first guided request
        # P/D: handles of finished prefills (read by the transfer server's thread) and block
        # reservations of pulls in flight (engine thread only).
        self.exports = ExportRegistry()
        self._imports: dict[str, ImportPlan] = {}

    # --- requests ------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        lora_id: str | None = None,
        kv_export: bool = False,
    ) -> None:
        """Queue a request. Raises ValueError (naming the problem) for a duplicate id, an
        empty or too long prompt, or token ids outside the vocabulary; never half-admits.

        ``kv_export`` (prefill role): when the request finishes, its prompt's KV stays
        pinned under the request id as a transfer handle (``exports``) until a decode pod
        pulls it or ``kv_transfer_timeout_s`` passes."""
        req = self._new_request(request_id, prompt, params, arrival_time, lora_id)
        if kv_export:
            if params.n != 1 or params.use_beam_search:
                raise ValueError("a request whose KV is exported must have n=1, no beam search")
            if request_id in self.exports.handles():
                raise ValueError(f"transfer handle {request_id!r} is still live")
            req.kv_export = True
        req.seqs.append(self._new_seq(req, 0, list(req.prompt_token_ids)))
        self._requests[request_id] = req
        self.scheduler.add(req.seqs[0])
        self._arrivals += 1

    def _new_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        arrival_time: float | None,
        lora_id: str | None,
    ) -> Request:
        """A validated request without sequences (raises ValueError, changing nothing)."""
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if params.n > self.config.max_num_seqs:
            raise InvalidRequestError(
                f"n={params.n} exceeds max_num_seqs={self.config.max_num_seqs}: the samples "
                "could never run together; lower n or raise max_num_seqs",
                param="n",
            )
        if params.beam_width > self.config.max_num_seqs:
            raise InvalidRequestError(
                f"beam width {params.beam_width} (best_of, else n) exceeds max_num_seqs="
                f"{self.config.max_num_seqs}: the beams could never run together; lower it",
                param="best_of",
            )
        if isinstance(prompt, str):
            encode = getattr(self.tokenizer, "encode", None)
            if encode is None:
                raise ValueError("this engine has no tokenizer; pass prompt token ids")
            token_ids = list(encode(prompt))
        else:
            token_ids = [int(t) for t in prompt]
        if not token_ids:
            raise ValueError("the prompt is empty; send at least one token")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(token_ids)} tokens but this model accepts at most "
                f"{self.max_model_len - 1} (max_model_len {self.max_model_len} includes at "
                "least one generated token); shorten the prompt"
            )
        bad = next((t for t in token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(
                f"prompt token id {bad} is outside the vocabulary [0, {self.vocab_size})"
            )
        self._check_token_controls(params)
        if params.guided is not None:
            try:
                self.grammars().compiled(params.guided)  # a bad spec fails here, not mid-step
            except GrammarError as exc:
                raise InvalidRequestError(str(exc), param=params.guided.source) from None
        metrics = RequestMetrics(
            arrival_time=time.monotonic() if arrival_time is None else arrival_time
        )
        req = Request(
            request_id=request_id,
            prompt_token_ids=token_ids,
            params=params,
            metrics=metrics,
            lora_id=lora_id,
            forked=params.n == 1 or params.use_beam_search,  # beams fork in beam.py
        )
        if params.prompt_logprobs is not None:
            req.prompt_scores = []
        if params.use_beam_search:
            room = self.max_model_len - len(token_ids)
            eos = frozenset() if params.ignore_eos else frozenset(self.eos_token_ids)
            req.beam = BeamSearch(
                width=params.beam_width,
                num_candidates=num_beam_candidates(params.beam_width, len(self.eos_token_ids)),
                max_new_tokens=room if params.max_tokens is None else min(params.max_tokens, room),
                eos_token_ids=eos,
                length_penalty=params.length_penalty,
                early_stopping=params.early_stopping,
                num_logprobs=params.logprobs,
            )
        return req

    def _check_token_controls(self, params: SamplingParams) -> None:
        """Refuse token ids outside the vocabulary; tokenize ``bad_words`` (as vLLM: each
        word alone and after a space, since BPE spells the two differently)."""
        for name, ids in (
            ("logit_bias", list(params.logit_bias)),
            ("stop_token_ids", params.stop_token_ids),
        ):
            bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise InvalidRequestError(
                    f"{name} has token id {bad}, outside the vocabulary [0, {self.vocab_size})",
                    param=name,
                )
        if params.bad_words and not params.bad_words_token_ids:
            encode = getattr(self.tokenizer, "encode", None)
            if encode is None:
                raise InvalidRequestError(
                    "bad_words needs a tokenizer; this engine has none", param="bad_words"
                )
            words: list[list[int]] = []
            for word in params.bad_words:
                for text in (word.lstrip(), " " + word.lstrip()):
                    try:
                        ids = list(encode(text, add_special_tokens=False))
                    except TypeError:  # a tokenizer without the keyword adds nothing
                        ids = list(encode(text))
                    if ids and ids not in words:
                        words.append(ids)
            params.bad_words_token_ids = words

    def grammars(self) -> GrammarBackend:
        """The engine's grammar compiler (and cache), built on first use."""
        if self._grammars is None:
            self._grammars = GrammarBackend(
                self.tokenizer, self.vocab_size, sorted(self.eos_token_ids)
            )
        return self._grammars

    def _new_seq(self, req: Request, index: int, token_ids: list[int]) -> Sequence:
        p = req.params
        gen: torch.Generator | None = None
        if not p.greedy:
            if p.seed is not None:
                # Independent streams per (seed, index); the same seed always replays.
                digest = hashlib.blake2b(f"{p.seed}:{index}".encode(), digest_size=8).digest()
                seed = int.from_bytes(digest, "little") & ((1 << 63) - 1)
            else:
                seed = int(torch.randint(0, 1 << 62, (1,), generator=self._seed_rng).item())
            gen = torch.Generator().manual_seed(seed)
        grammar = None if p.guided is None else self.grammars().matcher(p.guided)
        return Sequence(
            grammar=grammar,
            seq_id=self._seq_ids(),
            request=req,
            index=index,
            token_ids=token_ids,
            num_prompt_tokens=len(req.prompt_token_ids),
            generator=gen,
            detokenizer=IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, p)
            if p.detokenize
            else None,
            logprobs=[] if p.logprobs is not None else None,
            arrival_order=self._arrivals,
        )

    def _fork(self, parent: Sequence) -> list[Sequence]:
        req = parent.request
        children = [self._new_seq(req, i, list(parent.token_ids)) for i in range(1, req.params.n)]
        for c in children:
            c.arrival_order = parent.arrival_order
        req.seqs.extend(children)
        return children

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its blocks; its final "abort" deltas come out of the
        next ``step()``. False if the id is unknown or already finished."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return False
        now = time.monotonic()
        deltas: list[CompletionDelta] = []
        if req.beam is not None:  # beams are never reported before the end: n endings
            for seq in req.seqs:
                if not seq.is_finished:
                    self.scheduler.finish(seq)
            req.seqs = []
            deltas = [CompletionDelta(i, [], "", None, "abort") for i in range(req.params.n)]
            req.metrics.finished_time = now
            self._aborted.append(self._request_output(req, deltas, finished=True))
            return True
        for seq in req.seqs:
            if seq.is_finished and seq.reported_finish:
                continue
            if not seq.is_finished:
                self.scheduler.finish(seq)
                seq.finish_reason = "abort"
            deltas.append(self._delta(seq, finished=True))
        # Siblings of an unforked n > 1 request never existed; each still gets its ending.
        for index in range(len(req.seqs), req.params.n):
            deltas.append(CompletionDelta(index, [], "", None, "abort"))
        req.metrics.finished_time = now
        self._aborted.append(self._request_output(req, deltas, finished=True))
        return True

    # --- stepping ------------------------------------------------------------------------

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._aborted)

    def step(self) -> list[RequestOutput]:
        """Run one iteration; return the deltas of every request that produced any."""
        outputs, self._aborted = self._aborted, []
        self.collect_transfers()
        sched = self.scheduler.schedule()
        if not sched.is_empty or sched.copies:
            self.steps_total += 1
            now = time.monotonic()
            for it in sched.scheduled:
                m = it.seq.request.metrics
                if m.first_scheduled_time is None:
                    m.first_scheduled_time = now
                    # Every prompt token once per request, cached or not (as vLLM counts).
                    self.prompt_tokens_total += len(it.seq.request.prompt_token_ids)
            results = self.runner.execute(sched, self.kv)
            self.kv.end_step()
            now = time.monotonic()
            touched: dict[str, Request] = {}
            beams: dict[str, Request] = {}
            for seq, res in results:
                req = seq.request
                if req.beam is not None:
                    assert res.beam is not None, "the sampler gives beam rows candidates"
                    req.beam.record(seq, *res.beam)
                    beams[req.request_id] = req
                    continue
                self._append_token(seq, res, now)
                touched[req.request_id] = req
            for req in beams.values():
                out = self._advance_beams(req, now)
                if out is not None:
                    outputs.append(out)
            for req in touched.values():
                deltas = [
                    self._delta(s, finished=s.is_finished)
                    for s in req.seqs
                    if s.pending_token_ids or (s.is_finished and not s.reported_finish)
                ]
                finished = req.is_finished
                if finished:
                    req.metrics.finished_time = now
                    self._requests.pop(req.request_id, None)
                outputs.append(self._request_output(req, deltas, finished))
        self._publish_events()
        return outputs

    def _advance_beams(self, req: Request, now: float) -> RequestOutput | None:
        """One beam-search selection once every live beam has its candidates (beam.py);
        the request's output (its ``n`` best hypotheses) once the search is over."""
        beam = req.beam
        assert beam is not None
        live = [s for s in req.seqs if not s.is_finished]
        if not beam.ready(live):
            return None
        sel = beam.select(live)
        new_live = apply_selection(sel, live, self.scheduler, beam, self._beam_fork)
        req.seqs = new_live
        self.generation_tokens_total += len(new_live)
        m = req.metrics
        if m.first_token_time is None:
            m.first_token_time = now
        m.last_token_time = now
        if not sel.done:
            return None
        deltas = []
        for i, hyp in enumerate(beam.finished[: req.params.n]):
            detok = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, req.params)
            text_ids = hyp.token_ids[:-1] if hyp.finish_reason == "stop" else hyp.token_ids
            for tok in text_ids:
                detok.add_token(tok, check_stop=False)
            text = detok.take_delta(True)
            lps = None
            if hyp.logprobs is not None:
                text_of = self._token_text
                lps = [
                    TokenLogprob(t, text_of(t), v, [(a, text_of(a), w) for a, w in top])
                    for t, v, top in hyp.logprobs
                ]
            deltas.append(CompletionDelta(i, list(hyp.token_ids), text, lps, hyp.finish_reason))
        m.finished_time = now
        self._requests.pop(req.request_id, None)
        out = self._request_output(req, deltas, finished=True)
        out.num_generated_tokens = sum(len(d.new_token_ids) for d in deltas)
        return out

    def _beam_fork(self, parent: Sequence) -> Sequence:
        """A new beam with ``parent``'s tokens (the scheduler gives it parent's blocks)."""
        req = parent.request
        child = self._new_seq(req, parent.index, list(parent.token_ids))
        return child

    def _append_token(self, seq: Sequence, res: SampleResult, now: float) -> None:
        req = seq.request
        p = req.params
        tok = res.token_id
        seq.token_ids.append(tok)
        seq.pending_token_ids.append(tok)
        self.generation_tokens_total += 1
        m = req.metrics
        if m.first_token_time is None:
            m.first_token_time = now
        m.last_token_time = now
        if seq.logprobs is not None and res.logprob is not None:
            lp = TokenLogprob(
                token_id=tok,
                token=self._token_text(tok),
                logprob=res.logprob,
                top=[(t, self._token_text(t), v) for t, v in res.top],
            )
            seq.logprobs.append(lp)
            seq.pending_logprobs.append(lp)
        if seq.grammar is not None:
            # The bitmask allowed only acceptable tokens, so this cannot fail.
            seq.grammar.accept_token(tok)
            if seq.grammar.is_terminated():  # it ends only on accepting an EOS token
                self._stop_on_token(seq, tok, None)
                return
        n_out = seq.num_output_tokens
        can_stop = n_out >= p.min_tokens
        if can_stop and not p.ignore_eos and tok in self.eos_token_ids:
            self._stop_on_token(seq, tok, None)
            return
        if can_stop and tok in p.stop_token_ids:
            self._stop_on_token(seq, tok, tok)
            return
        detok = seq.detokenizer  # None: the caller decodes (params.detokenize)
        stop_str = None if detok is None else detok.add_token(tok, check_stop=can_stop)
        if stop_str is not None:
            self._finish(seq, "stop", stop_str)
        elif (
            p.max_tokens is not None and n_out >= p.max_tokens
        ) or seq.num_tokens >= self.max_model_len:
            self._finish(seq, "length", None)

    def _stop_on_token(self, seq: Sequence, tok: int, stop_reason: int | None) -> None:
        """End ``seq`` on the token it just sampled (EOS, a stop token id, a grammar's end).
        As in vLLM, that token's text is part of the output only with
        ``include_stop_str_in_output`` (text_outputs.py decodes alike)."""
        detok = seq.detokenizer
        if detok is not None and seq.request.params.include_stop_str_in_output:
            detok.add_token(tok, check_stop=False)
        self._finish(seq, "stop", stop_reason)

    def _finish(self, seq: Sequence, reason: str, stop_reason: str | int | None) -> None:
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        if seq.request.kv_export and seq.index == 0:
            self._export(seq)
        self.scheduler.finish(seq)

    # --- P/D: export (prefill role) ------------------------------------------------------

    def _export(self, seq: Sequence) -> None:
        """Pin the finished prompt's blocks under the request id before they are freed."""
        req = seq.request
        bs = self.config.block_size
        blocks = self.kv.table(seq)[: cdiv(len(req.prompt_token_ids), bs)]
        handle = req.request_id
        self.kv.pin("x:" + handle, blocks)
        ns = self.config.kv_namespace
        prompt = list(req.prompt_token_ids)
        hashes = block_hashes(prompt, bs, namespace=ns, extra=req.lora_id)
        self.exports.add(
            ExportedKV(
                handle=handle,
                block_ids=[b.block_id for b in blocks],
                token_ids=prompt,
                block_hashes=hashes,
                lora_id=req.lora_id,
                deadline=time.monotonic() + self.config.kv_transfer_timeout_s,
                tail_hash=tail_hash(prompt, hashes, bs, ns, req.lora_id),
            )
        )

    def collect_transfers(self, now: float | None = None) -> int:
        """Unpin pulled and expired handles and drop expired import reservations (engine
        thread; ``step()`` calls it, an idle daemon on a timer). Returns how many handles
        expired unpulled."""
        now = time.monotonic() if now is None else now
        expired = 0
        for e in self.exports.collect(now):
            self.kv.unpin("x:" + e.handle)
            expired += not e.consumed
        for plan in list(self._imports.values()):
            if now >= plan.deadline:
                self.cancel_import(plan)
        return expired

    def release_export(self, handle: str) -> bool:
        """Give up a handle now (nobody will pull it): freed at once unless being read,
        then when the read ends. False if unknown or already gone."""
        entry = self.exports.acquire(handle, float("-inf"))
        if entry is None:
            return False
        self.exports.release(handle, consumed=True)
        self.collect_transfers()
        return True

    # --- P/D: import (decode role) -------------------------------------------------------

    def reserve_import(
        self, request_id: str, prompt: list[int], lora_id: str | None = None
    ) -> ImportPlan | None:
        """Reserve blocks for pulling ``prompt``'s KV: this engine's own cached prefix is
        pinned and fresh blocks are taken for the rest of positions ``0 .. len - 2``.

        Returns None when there is nothing to import (a one-token prompt), the id is in
        use, or the pool cannot supply the blocks now (the caller then prefills locally).
        The reservation must end in ``commit_import`` or ``cancel_import``; otherwise it
        expires after ``kv_transfer_timeout_s``.
        """
        bs = self.config.block_size
        num_blocks = cdiv(len(prompt) - 1, bs)
        key = "i:" + request_id
        if num_blocks <= 0 or key in self._imports or request_id in self._requests:
            return None
        hashes = block_hashes(prompt, bs, namespace=self.config.kv_namespace, extra=lora_id)
        hits = []
        if self.config.enable_prefix_caching:
            for h in hashes[:num_blocks]:
                block = self.kv.pool.get_cached_block(h)
                if block is None:
                    break
                hits.append(block)
        fresh = self.kv.pin_new_blocks(key, num_blocks - len(hits), hits)
        if fresh is None:
            return None
        plan = ImportPlan(
            key=key,
            request_id=request_id,
            token_ids=list(prompt),
            block_hashes=hashes,
            first_block=len(hits),
            num_blocks=num_blocks,
            block_ids=[b.block_id for b in fresh],
            lora_id=lora_id,
            deadline=time.monotonic() + self.config.kv_transfer_timeout_s,
            tail_hash=tail_hash(list(prompt), hashes, bs, self.config.kv_namespace, lora_id),
        )
        self._imports[key] = plan
        return plan

    def cancel_import(self, plan: ImportPlan) -> None:
        """Give the reservation's blocks back (a failed pull); idempotent."""
        if self._imports.pop(plan.key, None) is not None:
            self.kv.unpin(plan.key)

    def write_import(
        self,
        plan: ImportPlan,
        kv: list[tuple[torch.Tensor, torch.Tensor]],
        first_layer: int,
    ) -> None:
        """Write layers ``first_layer ..`` of the pulled KV (as ``commit_import`` takes
        them) into the reserved blocks ahead of the commit, which then copies only the
        layers not written yet. The daemon calls it once, from a side thread of the engine
        process while the engine steps (the reserved blocks belong to no sequence, so no
        step touches them), so no stream's step waits for the copy; it keeps the
        reservation from expiring meanwhile. Layers are written in order.

        Raises ValueError when the reservation expired (the caller prefills locally).
        """
        if self._imports.get(plan.key) is not plan:
            raise ValueError(
                f"the KV reservation for {plan.request_id!r} expired before the pull ended"
            )
        if first_layer != plan.layers_written:
            raise ValueError(
                f"KV layers of {plan.request_id!r} written out of order: {first_layer} after "
                f"{plan.layers_written}"
            )
        self.runner.write_kv_blocks(plan.block_ids, kv, first_layer=first_layer)  # type: ignore[attr-defined]
        plan.layers_written = first_layer + len(kv)

    def commit_import(
        self,
        plan: ImportPlan,
        kv: list[tuple[torch.Tensor, torch.Tensor]] | None,
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> None:
        """Write the pulled KV (per layer, ``[plan.num_pull_blocks, block_size, heads,
        head_dim]``) into the reserved blocks, give the full ones their keys (so the prefix
        cache and the index see them), and queue the request with every prompt token but
        the last already computed: this engine computes the last one and samples, exactly
        as a unified engine would (greedy, seeded, n > 1 alike).

        Raises ValueError, the reservation released, when it expired or the request is
        invalid; the caller then prefills locally.
        """
        if self._imports.get(plan.key) is not plan:
            raise ValueError(
                f"the KV reservation for {plan.request_id!r} expired before the pull ended"
            )
        if params.prompt_logprobs is not None:
            # Pulled KV comes without logits; the prompt must be computed here.
            self.cancel_import(plan)
            raise ValueError("prompt_logprobs needs the prompt computed locally, not imported")
        try:
            req = self._new_request(
                plan.request_id, plan.token_ids, params, arrival_time, plan.lora_id
            )
        except ValueError:
            self.cancel_import(plan)
            raise
        if plan.num_pull_blocks:
            done = plan.layers_written
            if kv is None and done != self.runner.kv_layout().num_layers:  # type: ignore[attr-defined]
                self.cancel_import(plan)
                raise ValueError("the pulled KV is missing")
            if kv is not None and done == 0:
                self.runner.write_kv_blocks(plan.block_ids, kv)  # type: ignore[attr-defined]
            elif kv is not None and done < len(kv):  # the rest of a write_import in pieces
                self.runner.write_kv_blocks(plan.block_ids, kv[done:], first_layer=done)  # type: ignore[attr-defined]
        del self._imports[plan.key]
        bs = self.config.block_size
        # Full blocks whose every position now has KV; the block holding the last prompt
        # token gets its key once this engine has written that token.
        num_full = (len(plan.token_ids) - 1) // bs
        num_hashed = self.kv.register_imported(
            plan.key,
            plan.first_block,
            max(0, num_full - plan.first_block),
            plan.block_hashes,
            plan.token_ids,
            plan.lora_id,
        )
        req.kv_imported = True
        req.metrics.num_cached_tokens = plan.first_block * bs
        seq = self._new_seq(req, 0, list(plan.token_ids))
        seq.block_hashes = list(plan.block_hashes)
        seq.num_computed_tokens = len(plan.token_ids) - 1
        req.seqs.append(seq)
        self.kv.adopt_pin(plan.key, seq, num_hashed)
        self._requests[req.request_id] = req
        self.scheduler.add(seq)
        self._arrivals += 1

    def _token_text(self, tok: int) -> str:
        # A token's text in logprobs: the tokenizer's own rule when it has one (it puts
        # back the space a SentencePiece decoder drops from a lone word piece).
        token_text = getattr(self.tokenizer, "token_text", None)
        return token_text(tok) if token_text is not None else self.tokenizer.decode([tok], False)

    def _delta(self, seq: Sequence, finished: bool) -> CompletionDelta:
        detok = seq.detokenizer
        delta = CompletionDelta(
            index=seq.index,
            new_token_ids=seq.pending_token_ids,
            new_text="" if detok is None else detok.take_delta(finished),
            logprobs=seq.pending_logprobs if seq.logprobs is not None else None,
            finish_reason=seq.finish_reason if finished else None,
            stop_reason=seq.stop_reason if finished else None,
        )
        seq.pending_token_ids = []
        seq.pending_logprobs = []
        if finished:
            seq.reported_finish = True
        return delta

    def _request_output(
        self, req: Request, deltas: list[CompletionDelta], finished: bool
    ) -> RequestOutput:
        return RequestOutput(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            deltas=deltas,
            finished=finished,
            metrics=req.metrics,
            num_generated_tokens=sum(s.num_output_tokens for s in req.seqs),
            prompt_logprobs=self._take_prompt_logprobs(req),
        )

    def _take_prompt_logprobs(self, req: Request) -> list[PromptLogprob | None] | None:
        """The request's prompt logprobs, once, as soon as every prompt token has its score
        (its first output; an abort before that gets none)."""
        scores = req.prompt_scores
        if scores is None or req.prompt_logprobs_sent or req.needs_prompt_logits:
            return None
        req.prompt_logprobs_sent = True
        texts: dict[int, str] = {}  # a prompt's top-k repeat the same few tokens

        def text(tok: int) -> str:
            t = texts.get(tok)
            if t is None:
                t = texts[tok] = self._token_text(tok)
            return t

        out: list[PromptLogprob | None] = [None]
        for tok, sc in zip(req.prompt_token_ids[1:], scores, strict=True):
            top = [(t, text(t), v) for t, v in zip(sc.top_ids, sc.top_logprobs, strict=True)]
            out.append(PromptLogprob(tok, text(tok), sc.logprob, sc.rank, top))
        return out

    def _publish_events(self) -> None:
        events = self.kv.take_events()
        if not events or self.event_sink is None:
            return
        batch = KVEventBatch(ts=time.time(), seq=self._event_seq, events=events)
        self._event_seq += 1
        self.event_sink(batch)

    # --- introspection -------------------------------------------------------------------

    def stats(self) -> EngineStats:
        pool = self.kv.pool
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_preempted_total=self.scheduler.num_preempted_total,
            kv_usage=pool.usage(),
            num_blocks=pool.num_blocks,
            num_free_blocks=pool.num_free_blocks,
            prefix_queries_tokens=self.scheduler.prefix_queries_tokens,
            prefix_hits_tokens=self.scheduler.prefix_hits_tokens,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
            evictions_total=pool.num_evictions,
            steps_total=self.steps_total,
            num_cached_blocks=len(pool.cached),
            kv_exports_live=len(self.exports),
            kv_exports_expired_total=self.exports.expired_total,
            kv_imports_live=len(self._imports),
        )

    def cached_block_hashes(self) -> set[int]:
        """Keys of every block this engine holds as cached (what the pod advertises)."""
        return self.kv.cached_block_hashes()

    def reset_prefix_cache(self) -> None:
        """Forget every cached block and publish AllBlocksCleared at once (an idle engine
        takes no step that would carry it). Blocks in use keep their KV, not their keys."""
        self.kv.reset_prefix_cache()
        self._publish_events()

    def check_integrity(self) -> None:
        """Assert the KV bookkeeping invariants (tests call this after every step)."""
        live = [s for r in self._requests.values() for s in r.seqs if not s.is_finished]
        self.kv.check_integrity([s for s in live if self.kv.has_table(s) or s.num_computed_tokens])
        queued = set(map(id, self.scheduler.waiting)) | set(map(id, self.scheduler.running))
        assert queued == set(map(id, live)), "a live sequence is in neither queue (or both)"
        assert len(self.scheduler.running) <= self.config.max_num_seqs
        pins = {"x:" + h for h in self.exports.handles()} | set(self._imports)
        assert set(self.kv.pin_keys()) == pins, "a KV pin outlived its handle or reservation"

    # --- offline convenience -------------------------------------------------------------

    def generate(
        self,
        prompts: Seq[str | list[int]],
        params: SamplingParams | list[SamplingParams],
    ) -> list[GenerateResult]:
        """Run ``prompts`` to completion; results in prompt order."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(plist)} sampling params")
        ids: list[str] = []
        for prompt, p in zip(prompts, plist, strict=True):
            rid = f"generate-{self._gen_counter}"
            self._gen_counter += 1
            self.add_request(rid, prompt, p)
            ids.append(rid)
        results: dict[str, GenerateResult] = {}
        while self.has_unfinished():
            for out in self.step():
                res = results.get(out.request_id)
                if res is None:
                    n = plist[ids.index(out.request_id)].n
                    res = results[out.request_id] = GenerateResult(
                        out.request_id,
                        out.prompt_token_ids,
                        [CompletionOutput(i, [], "") for i in range(n)],
                        out.metrics,
                    )
                if out.prompt_logprobs is not None:
                    res.prompt_logprobs = out.prompt_logprobs
                for d in out.deltas:
                    o = res.outputs[d.index]
                    o.token_ids.extend(d.new_token_ids)
                    o.text += d.new_text
                    if d.logprobs is not None:
                        o.logprobs = (o.logprobs or []) + d.logprobs
                    if d.finish_reason is not None:
                        o.finish_reason = d.finish_reason
                        o.stop_reason = d.stop_reason
        return [results[r] for r in ids]
