"""Requests and their sequences: the units the scheduler moves between queues.

A ``Request`` is what a caller submitted; it owns ``n`` ``Sequence`` objects, one per
sample. Before its prompt is prefilled a request has a single sequence (index 0); when the
chunk that reaches the end of the prompt is scheduled, the scheduler forks the other
``n - 1`` sequences, which share the prompt's KV blocks by reference count.

Invariants of a ``Sequence``:
- ``token_ids`` = prompt tokens + generated tokens, append-only;
- ``0 <= num_computed_tokens <= len(token_ids)``: KV exists for the first
  ``num_computed_tokens`` positions; preemption (recompute) resets it to 0 but keeps the
  tokens and the sampler's generator, so the resumed sequence continues exactly where it was;
- ``block_hashes[i]`` is the chained key of full block ``i`` of ``token_ids``; it is
  extended lazily and never invalidated because tokens are never rewritten.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from pagefleet.engine.outputs import RequestMetrics, TokenLogprob
from pagefleet.engine.sampling_params import SamplingParams
from pagefleet.kvindex.hashing import block_hashes

if TYPE_CHECKING:
    from pagefleet.engine.beam import BeamSearch
    from pagefleet.engine.detokenizer import IncrementalDetokenizer


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True)
class Sequence:
    seq_id: int
    request: Request
    index: int  # which of the request's n samples
    token_ids: list[int]
    num_prompt_tokens: int
    generator: torch.Generator | None = None  # None for greedy
    detokenizer: IncrementalDetokenizer | None = None
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    block_hashes: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    # bookkeeping for the scheduler's cache-aware ordering and for stats
    arrival_order: int = 0
    waited_steps: int = 0
    num_preemptions: int = 0
    # deltas not yet handed to the caller
    pending_token_ids: list[int] = field(default_factory=list)
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)
    reported_finish: bool = False
    # xgrammar GrammarMatcher of a structured-output request (guided.py); None otherwise
    grammar: Any = None
    # Beam search: this beam's candidates are in and it waits for its siblings' (beam.py);
    # the scheduler does not schedule a held sequence.
    held: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def full_block_hashes(self, block_size: int, namespace: str) -> list[int]:
        """Keys of every full block of ``token_ids`` (extends the cached list)."""
        n_full = len(self.token_ids) // block_size
        have = len(self.block_hashes)
        if have < n_full:
            self.block_hashes.extend(
                block_hashes(
                    self.token_ids,
                    block_size,
                    namespace=namespace,
                    extra=self.request.lora_id,
                    parent=self.block_hashes[-1] if have else None,
                    start_block=have,
                )
            )
        return self.block_hashes


@dataclass(slots=True)
class PromptScore:
    """The raw score of one prompt token (the runner's part of ``prompt_logprobs``; the
    engine adds the texts): its logprob and rank, and the top-k ids and logprobs."""

    logprob: float
    rank: int
    top_ids: list[int]
    top_logprobs: list[float]


@dataclass(slots=True)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    lora_id: str | None = None
    seqs: list[Sequence] = field(default_factory=list)
    forked: bool = False  # the n - 1 siblings of sequence 0 exist
    # P/D: keep the prompt's KV pinned under the request id when it finishes (prefill role)
    kv_export: bool = False
    # P/D: admitted with its prompt's KV already in place (imported from a prefill pod)
    kv_imported: bool = False
    # Beam search state (beam.py); its live beams are the unfinished ``seqs``.
    beam: BeamSearch | None = None
    # prompt_logprobs: entry i scores prompt token i + 1 from the logits at position i.
    # Filled in position order by the runner, chunk by chunk; a recompute (preemption, a
    # fork's recompute) finds the positions already scored and skips them. None when not
    # asked for.
    prompt_scores: list[PromptScore] | None = None
    prompt_logprobs_sent: bool = False

    @property
    def needs_prompt_logits(self) -> bool:
        """Prompt positions still lack their scores: the prefix cache must not skip them
        (a cache hit has KV but no logits), so the whole prompt is computed."""
        scores = self.prompt_scores
        return scores is not None and len(scores) < len(self.prompt_token_ids) - 1

    @property
    def is_finished(self) -> bool:
        return self.forked and all(s.is_finished for s in self.seqs)

    @property
    def fanout(self) -> int:
        """Sequences this request will occupy once forked (for the max_num_seqs bound);
        a beam search always counts its full beam width."""
        if self.beam is not None:
            return self.beam.width
        return 1 if self.forked else self.params.n


class SeqIdCounter:
    """Monotonic sequence ids; one per engine (no module-level state)."""

    __slots__ = ("_it",)

    def __init__(self) -> None:
        self._it = itertools.count()

    def __call__(self) -> int:
        return next(self._it)
