"""Turns one row of logits per sampling sequence into a token (and its logprobs).

Invariant: a row's result depends only on that row's logits, its sequence's parameters and
its sequence's own ``torch.Generator``; never on the other rows in the batch. So a seeded
request samples the same tokens whatever it is batched with, and a preempted sequence
resumes its random stream exactly where it stopped.

Greedy is ``argmax`` (ties to the lowest id, as in ``transformers``). Random sampling
applies temperature, then top-k, top-p and min-p, then draws from the renormalised
distribution with ``torch.multinomial``. Logprobs are those of the model's distribution
(raw logits, before temperature or truncation), as OpenAI reports them.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from pagefleet.engine.request import Sequence


@dataclass(slots=True)
class SampleResult:
    token_id: int
    logprob: float | None = None  # of the sampled token; None unless logprobs were asked
    top: list[tuple[int, float]] = field(default_factory=list)


def apply_top_k_top_p_min_p(
    logits: torch.Tensor, top_k: int, top_p: float, min_p: float
) -> torch.Tensor:
    """Mask (to -inf) the tokens outside top-k, the top-p nucleus and the min-p floor of
    one row. The most likely token always survives."""
    vocab = logits.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the tokens strictly more likely already reach top_p.
        before = torch.cumsum(probs, dim=-1) - probs
        drop_sorted = before >= top_p
        drop_sorted[0] = False
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    if min_p > 0.0:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < min_p * probs.max(), float("-inf"))
    return logits


class Sampler:
    def __init__(self, eos_token_ids: Seq[int]) -> None:
        self.eos_token_ids = list(eos_token_ids)

    def __call__(self, logits: torch.Tensor, seqs: Seq[Sequence]) -> list[SampleResult]:
        """``logits[i]`` (``[N, vocab]``) belongs to ``seqs[i]``; one result per row."""
        logits = logits.float()
        raw_logprobs: torch.Tensor | None = None
        if any(s.request.params.logprobs is not None for s in seqs):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        results: list[SampleResult] = []
        greedy_rows = [i for i, s in enumerate(seqs) if s.request.params.greedy]
        greedy_ids: dict[int, int] = {}
        if greedy_rows:
            masked = logits[greedy_rows]
            for j, i in enumerate(greedy_rows):
                banned = self._banned(seqs[i])
                if banned:
                    masked[j, banned] = float("-inf")
            greedy_ids = dict(zip(greedy_rows, masked.argmax(dim=-1).tolist(), strict=True))
        for i, seq in enumerate(seqs):
            p = seq.request.params
            if i in greedy_ids:
                token = greedy_ids[i]
            else:
                row = logits[i] / p.temperature
                banned = self._banned(seq)
                if banned:
                    row = row.clone()
                    row[banned] = float("-inf")
                row = apply_top_k_top_p_min_p(row, p.top_k, p.top_p, p.min_p)
                probs = torch.softmax(row, dim=-1)
                token = int(torch.multinomial(probs, 1, generator=seq.generator).item())
            res = SampleResult(token_id=token)
            if raw_logprobs is not None and p.logprobs is not None:
                lp = raw_logprobs[i]
                res.logprob = float(lp[token])
                if p.logprobs > 0:
                    top = torch.topk(lp, p.logprobs)
                    res.top = list(zip(top.indices.tolist(), top.values.tolist(), strict=True))
            results.append(res)
        return results

    def _banned(self, seq: Sequence) -> list[int]:
        """Tokens that would end the sequence before ``min_tokens`` is reached."""
        p = seq.request.params
        if seq.num_output_tokens >= p.min_tokens:
            return []
        return [*self.eos_token_ids, *p.stop_token_ids]
