"""Iteration-level scheduler: which sequences run in the next step and with how many tokens.

Each step has one token budget (``max_num_batched_tokens``) and a cap on live sequences
(``max_num_seqs``). Running sequences are served first, oldest first: a decode costs one
token, an unfinished (chunked) prefill takes what budget is left. Then waiting sequences are
admitted in queue order while budget, sequence slots and KV blocks last; a prompt longer than
the remaining budget is chunked (when chunked prefill is on), so prefills mix with decodes.

When a running sequence cannot get a block, the newest running sequence is preempted by
recompute: its blocks are freed, its ``num_computed_tokens`` reset, and it goes to the front
of the waiting queue. It keeps its tokens and sampler state, so the recomputed sequence
continues exactly. Nothing accepted is ever dropped: a sequence leaves only by finishing or
being aborted. A step that preempted admits nobody new (memory is short), and while
others run an admission must leave a small watermark of blocks free.

Beam search (beam.py): a ``held`` beam, whose candidates are in while a sibling's are not,
is never scheduled; a beam search takes its width once against ``max_num_seqs``, so its
waiting beams need no seat and go past a head that waits for one; a step that would
otherwise schedule nothing preempts held beams to give a sibling their blocks.

Invariant: ``num_computed_tokens`` of every scheduled sequence is advanced here, at
schedule time, to what it will be once the step's forward has run.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from pagefleet.engine.config import EngineConfig
from pagefleet.engine.kv_cache_manager import KVCacheManager
from pagefleet.engine.request import Sequence, SequenceStatus

# Fraction of the pool a new admission must leave free while others run. Without it the
# pool fills to the last block and every block boundary a decode crosses preempts someone
# (on the kv_utilization trace: 288 preemptions at 0, 117 at 1%, utilization unchanged).
WATERMARK_FRACTION = 0.01


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    start: int  # first position computed this step (num_computed_tokens before the step)
    num_new_tokens: int
    # sequences that draw a token from this row's logits: [seq] plus forked siblings when
    # the prompt completes for n > 1; empty for a prefill chunk short of the prompt's end
    samplers: list[Sequence] = field(default_factory=list)

    @property
    def is_decode(self) -> bool:
        return self.num_new_tokens == 1


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSeq]
    # (src, dst) block ids to copy before the forward, in this order: a later pair may
    # write a block an earlier one reads (model_runner.copy_waves)
    copies: list[tuple[int, int]]
    preempted: list[Sequence]
    num_batched_tokens: int

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        kv: KVCacheManager,
        fork: Callable[[Sequence], list[Sequence]] | None = None,
    ) -> None:
        """``fork(parent)`` builds the n - 1 sibling sequences of a request's sequence 0."""
        self.config = config
        self.kv = kv
        self._fork = fork
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preempted_total = 0
        self.watermark_blocks = int(WATERMARK_FRACTION * kv.num_blocks)
        self.prefix_queries_tokens = 0
        self.prefix_hits_tokens = 0

    # --- queue management --------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def finish(self, seq: Sequence) -> None:
        """Remove a sequence for good (finished or aborted) and free its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.kv.free(seq)
        seq.status = SequenceStatus.FINISHED

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, seq: Sequence) -> None:
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preempted_total += 1

    def _decodes_behind(self) -> list[int]:
        """For each index of ``running``: how many sequences after it decode one token."""
        out = [0] * len(self.running)
        n = 0
        for j in range(len(self.running) - 1, -1, -1):
            out[j] = n
            seq = self.running[j]
            n += not seq.held and seq.num_tokens - seq.num_computed_tokens == 1
        return out

    # --- one step ------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        cfg = self.config
        self.kv.begin_step()
        budget = cfg.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        preempted: list[Sequence] = []
        forked: list[Sequence] = []

        # 1. Running sequences, oldest first. Victims are taken from the end of the list,
        # which holds only sequences not yet visited this step. A running prefill chunk
        # leaves one token of the budget to every running decode behind it: with a small
        # budget (a decode pod's) a chunk would otherwise take it all and the streams that
        # joined after that prompt would get no token for as many steps as it has chunks.
        decodes_behind = self._decodes_behind()
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.held:  # a beam waiting for its siblings' candidates (beam.py)
                i += 1
                continue
            num_new = self._cap_prefill(seq.num_tokens - seq.num_computed_tokens)
            room = budget
            if num_new > 1 and cfg.enable_chunked_prefill:
                room -= decodes_behind[i]
            if num_new > room:
                if not cfg.enable_chunked_prefill or room <= 0:
                    i += 1
                    continue
                num_new = room
            while not self.kv.allocate_slots(seq, num_new):
                if self._release_waiting_imports():
                    continue  # blocks held by queued imports come back first
                # Held beams wait for their siblings anyway, so they give up blocks first:
                # else a recomputed beam that outgrows its blocks preempts itself every
                # step (skipping the waiting phase, where held beams are preempted) while
                # the held ones keep theirs, and the request never advances.
                j = self._newest_held()
                if j is None:
                    victim = self.running.pop()
                else:
                    victim = self.running.pop(j)
                    del decodes_behind[j]  # a held beam is not counted in it
                    if j < i:
                        i -= 1
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is SequenceStatus.WAITING:  # preempted itself
                break
            scheduled.append(self._schedule_one(seq, num_new, forked))
            budget -= num_new
            i += 1

        # 2. Waiting sequences, unless memory was short this step.
        if not preempted:
            if cfg.cache_aware_scheduling and len(self.waiting) > 1:
                self._order_waiting_cache_aware()
            # Seats taken: a request still in prefill holds all n of its future sequences,
            # or admitting others meanwhile would overflow max_num_seqs when it forks.
            # A beam search takes its beam width once, whichever of its beams run.
            seats, beam_reqs = self._seats()
            seats += len(forked)
            pending = self._pending_prefill_blocks()
            while self.waiting and budget > 0:
                seq = self._next_waiting(pending)
                if seq is None:
                    break
                req = seq.request
                need = 0 if req.beam is not None and id(req) in beam_reqs else req.fanout
                if seats + need > cfg.max_num_seqs:
                    # Seats come back only as requests end, and a seated beam search ends
                    # only once its waiting beams (which need no seat) have run: they go
                    # past this head, or the search's held beams and the head wait forever.
                    seq = self._next_seated_beam(beam_reqs, pending)
                    if seq is None:
                        break
                    req, need = seq.request, 0
                imported = self.kv.has_table(seq)  # KV pulled from a prefill pod
                if imported:
                    hits, num_cached = [], seq.num_computed_tokens
                    num_held = len(self.kv.block_ids(seq))
                else:
                    hits, num_cached = self.kv.get_computed_blocks(seq)
                    num_held = len(hits)
                num_new = self._cap_prefill(seq.num_tokens - num_cached)
                if num_new > budget:
                    if not cfg.enable_chunked_prefill:
                        break
                    num_new = budget
                if (
                    self.running and not self._leaves_headroom(num_cached + num_new, num_held)
                ) or not self.kv.allocate_slots(seq, num_new, hits, num_cached):
                    if self._release_waiting_imports():
                        continue  # retry the head with the imports' blocks back
                    if not scheduled and self._preempt_held(preempted):
                        continue  # only held beams hold the blocks: they wait elsewhere
                    break
                if self.waiting[0] is seq:
                    self.waiting.popleft()
                else:
                    self.waiting.remove(seq)
                self.prefix_queries_tokens += seq.num_tokens
                if imported:  # only the local cache hits count as hits
                    self.prefix_hits_tokens += seq.request.metrics.num_cached_tokens
                else:
                    self.prefix_hits_tokens += num_cached
                if seq.num_preemptions == 0 and seq.index == 0 and not imported:
                    seq.request.metrics.num_cached_tokens = num_cached
                seq.num_computed_tokens = num_cached
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
                seats += need
                if req.beam is not None:
                    beam_reqs.add(id(req))
                scheduled.append(self._schedule_one(seq, num_new, forked))
                budget -= num_new
                if pending is not None:
                    self._add_pending(seq, pending)

        self.running.extend(forked)
        for seq in self.waiting:
            seq.waited_steps += 1
        return SchedulerOutput(
            scheduled=scheduled,
            copies=self.kv.take_copies(),
            preempted=preempted,
            num_batched_tokens=cfg.max_num_batched_tokens - budget,
        )

    def _seats(self) -> tuple[int, set[int]]:
        """Sequence slots the running sequences take (a request still in prefill counts
        all n of its future samples; a beam search its width once) and the ids of the
        beam-search requests among them."""
        seats = 0
        beam_reqs: set[int] = set()
        for s in self.running:
            req = s.request
            if req.beam is not None:
                if id(req) not in beam_reqs:
                    beam_reqs.add(id(req))
                    seats += req.fanout
            else:
                seats += req.fanout if s.index == 0 else 1
        return seats, beam_reqs

    def _next_waiting(self, pending: set[int] | None = None) -> Sequence | None:
        """The first waiting sequence that is not a held beam (held beams need nothing
        until their siblings catch up, so they must not block the queue) and whose prompt
        shares no block a running prefill has yet to compute (``pending``)."""
        head = self.waiting[0]
        if not head.held and not self._defers(head, pending):
            return head
        return next((s for s in self.waiting if not s.held and not self._defers(s, pending)), None)

    def _next_seated_beam(self, beam_reqs: set[int], pending: set[int] | None) -> Sequence | None:
        """The first waiting beam, not held, of a beam search that already holds its seats
        (``beam_reqs``), that ``_next_waiting`` would admit; None if there is none."""
        return next(
            (
                s
                for s in self.waiting
                if not s.held
                and s.request.beam is not None
                and id(s.request) in beam_reqs
                and not self._defers(s, pending)
            ),
            None,
        )

    def _pending_prefill_blocks(self) -> set[int] | None:
        """Hashes of the full prompt blocks that running chunked prefills compute in later
        steps (None: prefix caching off). A waiting prompt that shares one would compute
        the same blocks again beside them (admitted mid-prefill, it finds only the chunks
        done so far cached); it waits instead and then hits them all. With one-step
        prefills nothing is pending: a prompt's blocks are cached in the step that
        computes them, and a twin admitted in that step attends to them."""
        if not self.kv.enable_caching:
            return None
        pending: set[int] = set()
        for seq in self.running:
            self._add_pending(seq, pending)
        return pending

    def _add_pending(self, seq: Sequence, pending: set[int]) -> None:
        done = seq.num_computed_tokens
        if done < seq.num_prompt_tokens and seq.block_hashes:
            pending.update(seq.block_hashes[done // self.kv.block_size :])

    def _defers(self, seq: Sequence, pending: set[int] | None) -> bool:
        if not pending or self.kv.has_table(seq):  # imported KV (P/D) computes nothing
            return False
        hashes = seq.full_block_hashes(self.kv.block_size, self.kv.namespace)
        return any(h in pending for h in hashes)

    def _preempt_held(self, preempted: list[Sequence]) -> bool:
        """Preempt the newest running held beam; False if none runs.

        Without this, beams whose candidates are in could keep the blocks a sibling needs
        to produce its own, and the step after would schedule nothing, forever. A held
        beam keeps its candidates: it is recomputed only if the selection keeps it."""
        j = self._newest_held()
        if j is None:
            return False
        seq = self.running.pop(j)
        self._preempt(seq)
        preempted.append(seq)
        return True

    def _newest_held(self) -> int | None:
        """Index in ``running`` of the newest held beam, or None."""
        for j in range(len(self.running) - 1, -1, -1):
            if self.running[j].held:
                return j
        return None

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Queue ``child`` (a copy of ``parent``'s tokens) right after ``parent``.

        A running parent shares every block with it (ref counts up; the partly filled last
        block is copied on write by whichever writes it first); the child of a waiting
        (preempted) parent has no KV and is computed on admission like its parent."""
        child.arrival_order = parent.arrival_order
        if parent.status is SequenceStatus.RUNNING:
            self.kv.fork(parent, child)
            child.num_computed_tokens = parent.num_computed_tokens
            child.status = SequenceStatus.RUNNING
            self.running.insert(self.running.index(parent) + 1, child)
        else:
            child.block_hashes = list(parent.block_hashes)
            child.num_computed_tokens = 0
            child.status = SequenceStatus.WAITING
            self.waiting.insert(self.waiting.index(parent) + 1, child)

    def _release_waiting_imports(self) -> bool:
        """Free the blocks of queued sequences that were admitted with imported KV (P/D).

        A waiting sequence holding blocks could otherwise starve the very sequences ahead
        of it that need them, forever. Released ones recompute like a preempted sequence
        (their full imported blocks stay in the prefix cache, so mostly as cache hits).
        Returns whether anything was freed."""
        freed = False
        for seq in self.waiting:
            if self.kv.has_table(seq):
                self.kv.free(seq)
                seq.num_computed_tokens = 0
                freed = True
        return freed

    def _cap_prefill(self, num_new: int) -> int:
        """A long prefill's chunk for this step (decodes, one token, are never capped)."""
        cap = self.config.long_prefill_token_threshold
        return min(num_new, cap) if cap else num_new

    def _leaves_headroom(self, num_tokens: int, num_held: int) -> bool:
        """Admit only if the blocks left afterwards stay above the watermark, so running
        sequences can keep growing for a while without being preempted by a newcomer.
        ``num_held``: blocks the sequence already has (cache hits or imported KV)."""
        need = -(-num_tokens // self.kv.block_size) - num_held
        return self.kv.pool.num_free_blocks - need >= self.watermark_blocks

    def _schedule_one(self, seq: Sequence, num_new: int, forked: list[Sequence]) -> ScheduledSeq:
        start = seq.num_computed_tokens
        seq.num_computed_tokens = start + num_new
        item = ScheduledSeq(seq=seq, start=start, num_new_tokens=num_new)
        if seq.num_computed_tokens == seq.num_tokens:
            item.samplers.append(seq)
            req = seq.request
            if not req.forked:
                req.forked = True
                children = self._fork(seq) if self._fork is not None else []
                for child in children:
                    self.kv.fork(seq, child)
                    child.num_computed_tokens = seq.num_computed_tokens
                    child.status = SequenceStatus.RUNNING
                    item.samplers.append(child)
                    forked.append(child)
        return item

    def _order_waiting_cache_aware(self) -> None:
        """Longest cached prefix first, but a sequence that has waited ``max_wait_steps``
        steps (or was preempted) goes ahead of everyone in arrival order: no request waits
        more than ``max_wait_steps`` steps behind later arrivals."""
        limit = self.config.max_wait_steps

        def key(seq: Sequence) -> tuple[int, int, int]:
            if seq.num_preemptions or seq.waited_steps >= limit:
                return (0, 0, seq.arrival_order)
            return (1, -self.kv.num_cached_prefix_tokens(seq), seq.arrival_order)

        self.waiting = deque(sorted(self.waiting, key=key))
