"""Beam search inside the engine: a request's beams are sequences that fork over shared
blocks, and one selection per step picks the next beams from all of them at once.

Scoring and stopping follow ``transformers``' ``generate(num_beams=W, do_sample=False)``
(``GenerationMixin._beam_search`` in transformers 5.x), so the engine reproduces it token for
token:

- a running beam's score is the sum of its tokens' logprobs (``log_softmax`` of the raw
  logits); each step the best ``K = max(2, 1 + #EOS ids) * W`` continuations over all beams
  are ranked, the best ``W`` that do not end become the next beams;
- a continuation ends on an EOS id (unless ``ignore_eos``) or when it reaches the length
  limit; only an ending continuation ranked among the first ``W`` may enter the finished
  list, scored ``sum_logprob / generated_len ** length_penalty`` (``generated_len`` counts
  the generated tokens, the EOS included, never the prompt); the list keeps the best ``W``;
- ``early_stopping``: ``True`` stops once ``W`` hypotheses finished; ``False`` stops once
  the best running beam, scored at its current length, cannot beat the worst of ``W``
  finished ones; ``"never"`` does the same but, with ``length_penalty > 0``, scores the
  running beam at the maximum length (an optimistic bound). The search also stops when
  every continuation ends (the length limit). The ``n`` best finished hypotheses are the
  answer.

Invariants (checked by the tests after every step):
- a request's live beams are exactly its unfinished ``req.seqs``, best running score first;
- beams advance in lock step: a beam whose candidates are in is ``held`` (the scheduler
  does not schedule it) until every live beam of its request has its candidates; then
  ``BeamSearch.select`` runs once and ``apply_selection`` appends each next beam's token;
- a beam with no continuation is finished at once, freeing its blocks in that step; a beam
  with several continuations keeps the first on its own sequence and forks the others,
  which share all its blocks by reference count (the partly filled last block is copied on
  write when a fork first writes into it, by the KV cache manager);
- a request holds at most ``W`` live beams, so it takes ``W`` of ``max_num_seqs``.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagefleet.engine.request import Sequence

if TYPE_CHECKING:
    from pagefleet.engine.scheduler import Scheduler


def num_beam_candidates(width: int, num_eos: int) -> int:
    """Continuations ranked per step (transformers' ``beams_to_keep``): enough that ``W``
    of them go on even when every beam's best continuations are EOS ids."""
    return max(2, 1 + num_eos) * width


# One generated token's logprob and its row's best alternatives: (token, logprob, top).
RawLogprob = tuple[int, float, list[tuple[int, float]]]


@dataclass(slots=True)
class Hypothesis:
    """A finished beam: its generated tokens (an ending EOS included) and its score."""

    token_ids: list[int]
    score: float  # cum_logprob / len(token_ids) ** length_penalty
    cum_logprob: float
    finish_reason: str  # "stop" (EOS) or "length"
    logprobs: list[RawLogprob] | None = None  # with SamplingParams.logprobs only


@dataclass(slots=True)
class Candidate:
    parent: Sequence
    token_id: int
    cum_logprob: float
    logprob: RawLogprob | None = None  # with SamplingParams.logprobs only


@dataclass(slots=True)
class Selection:
    """One step's decision: the next beams (best first), the beams without continuation,
    and whether the search is over."""

    next_beams: list[Candidate]
    pruned: list[Sequence]
    done: bool


@dataclass(slots=True)
class BeamSearch:
    """Per-request beam state; pure bookkeeping, no KV (``apply_selection`` does that)."""

    width: int
    num_candidates: int
    max_new_tokens: int  # generated tokens at which a beam ends ("length")
    eos_token_ids: frozenset[int]  # empty with ignore_eos
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    num_logprobs: int | None = None  # SamplingParams.logprobs: keep each token's logprobs
    cum_logprobs: dict[int, float] = field(default_factory=dict)  # seq_id -> running score
    # seq_id -> (token ids, logprobs) of its best continuations, this step
    pending: dict[int, tuple[list[int], list[float]]] = field(default_factory=dict)
    finished: list[Hypothesis] = field(default_factory=list)  # best first, <= width
    token_logprobs: dict[int, list[RawLogprob]] = field(default_factory=dict)  # seq_id ->
    improvable: bool = True  # transformers' is_early_stop_heuristic_unsatisfied
    done: bool = False

    def record(self, seq: Sequence, token_ids: list[int], logprobs: list[float]) -> None:
        """``seq``'s best continuations this step; holds it until the selection."""
        self.pending[seq.seq_id] = (token_ids, logprobs)
        seq.held = True

    def ready(self, live: Seq[Sequence]) -> bool:
        return bool(live) and all(s.seq_id in self.pending for s in live)

    def select(self, live: Seq[Sequence]) -> Selection:
        """Rank every live beam's continuations and update the finished list (module
        docstring). ``live`` is in rank order, all with the same number of output tokens."""
        gen_len = live[0].num_output_tokens + 1  # after this step's token
        cands: list[tuple[float, int, int, Candidate]] = []
        for rank, seq in enumerate(live):
            base = self.cum_logprobs.get(seq.seq_id, 0.0)
            ids, lps = self.pending.pop(seq.seq_id)
            top = None
            if self.num_logprobs is not None:
                top = list(zip(ids[: self.num_logprobs], lps[: self.num_logprobs], strict=True))
            k = self.num_candidates
            for t, lp in zip(ids[:k], lps[:k], strict=True):
                raw = None if top is None else (t, lp, top)
                cands.append((-(base + lp), rank, t, Candidate(seq, t, base + lp, raw)))
        # transformers ranks over the flattened [beam, vocab] scores: ties go to the lower
        # beam rank, then the lower token id.
        cands.sort(key=lambda c: c[:3])
        top = [c[3] for c in cands[: self.num_candidates]]
        ends = [c.token_id in self.eos_token_ids or gen_len >= self.max_new_tokens for c in top]

        new_hyps: list[Hypothesis] = []
        full = len(self.finished) >= self.width
        if self.improvable and not (self.early_stopping is True and full):
            for c, end in zip(top[: self.width], ends[: self.width], strict=True):
                if end:
                    eos = c.token_id in self.eos_token_ids
                    new_hyps.append(
                        Hypothesis(
                            token_ids=[*c.parent.output_token_ids, c.token_id],
                            score=c.cum_logprob / gen_len**self.length_penalty,
                            cum_logprob=c.cum_logprob,
                            finish_reason="stop" if eos else "length",
                            logprobs=self.logprobs_after(c),
                        )
                    )
        # Stable: an earlier hypothesis wins a tie, as in transformers' merge.
        self.finished = sorted(self.finished + new_hyps, key=lambda h: -h.score)[: self.width]

        next_beams = [c for c, end in zip(top, ends, strict=True) if not end][: self.width]
        if next_beams and len(self.finished) >= self.width:
            if self.early_stopping == "never" and self.length_penalty > 0.0:
                best_len = self.max_new_tokens
            else:
                best_len = gen_len
            best = next_beams[0].cum_logprob / best_len**self.length_penalty
            self.improvable = self.improvable and best > self.finished[-1].score
        self.done = (
            not next_beams
            or not self.improvable
            or (self.early_stopping is True and len(self.finished) >= self.width)
        )
        if self.done:
            next_beams = []
        parents = {id(c.parent) for c in next_beams}
        pruned = [s for s in live if id(s) not in parents]
        return Selection(next_beams=next_beams, pruned=pruned, done=self.done)

    def logprobs_after(self, c: Candidate) -> list[RawLogprob] | None:
        """The parent's token logprobs with ``c``'s appended (None without logprobs)."""
        if c.logprob is None:
            return None
        return [*self.token_logprobs.get(c.parent.seq_id, ()), c.logprob]


def apply_selection(
    sel: Selection,
    live: list[Sequence],
    scheduler: Scheduler,
    beam: BeamSearch,
    new_seq: Callable[[Sequence], Sequence],
) -> list[Sequence]:
    """Make ``sel`` real and return the new live beams, best first.

    Pruned beams are finished (blocks freed) before any fork, so the copies-on-write the
    forks will need can use those blocks. ``new_seq(parent)`` builds a fresh sequence with
    ``parent``'s tokens; the scheduler places it beside its parent and shares its blocks.
    """
    for seq in sel.pruned:
        scheduler.finish(seq)
        beam.cum_logprobs.pop(seq.seq_id, None)
    # Computed before any sequence changes: a fork and its parent read the same list.
    logprobs = [beam.logprobs_after(c) for c in sel.next_beams]
    for seq in sel.pruned:
        beam.token_logprobs.pop(seq.seq_id, None)
    taken: set[int] = set()
    out: list[Sequence] = []
    children: list[tuple[Sequence, int]] = []
    for c, lps in zip(sel.next_beams, logprobs, strict=True):
        if id(c.parent) in taken:
            child = new_seq(c.parent)
            scheduler.fork(c.parent, child)
            children.append((child, c.token_id))
            seq = child
        else:
            taken.add(id(c.parent))
            seq = c.parent
        beam.cum_logprobs[seq.seq_id] = c.cum_logprob
        if lps is not None:
            beam.token_logprobs[seq.seq_id] = lps
        out.append(seq)
    # Tokens are appended only now: every fork above copied its parent's tokens before
    # the parent's own continuation was added.
    by_parent = {id(c.parent): c.token_id for c in reversed(sel.next_beams)}
    for seq in out:
        if id(seq) in by_parent:
            seq.token_ids.append(by_parent[id(seq)])
        seq.held = False
    for child, tok in children:
        child.token_ids.append(tok)
    return out
