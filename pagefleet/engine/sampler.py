"""Turns one row of logits per sampling sequence into a token (and its logprobs).

Invariant: a row's result depends only on that row's logits, its sequence's parameters and
its sequence's own ``torch.Generator``; never on the other rows in the batch. So a seeded
request samples the same tokens whatever it is batched with, and a preempted sequence
resumes its random stream exactly where it stopped.

Every control is a batched tensor operation over ``[N, vocab]`` (Python only walks each
sequence's own short lists: its bias entries, its bad words, its tokens), in vLLM's order:

0. the grammar's token bitmask of a structured-output sequence (guided.py);
1. bad words, ``logit_bias``, and the ``min_tokens`` ban of EOS / stop token ids;
2. penalties: repetition (prompt and output tokens), then frequency and presence (output);
   a row that steps 1-2 leave without any token gets its step-0 logits back (the grammar
   wins: a finished grammar ends the output even before ``min_tokens``);
3. greedy rows (temperature below ``GREEDY_TEMPERATURE``, as vLLM) take ``argmax`` (ties
   to the lowest id, as in ``transformers``); the others divide by temperature, keep
   top-k, then the top-p nucleus, then the min-p floor, and draw from the renormalised
   distribution with ``torch.multinomial`` and their own generator. (vLLM v0 and
   transformers apply min-p last too; vLLM v1 before top-k/top-p. Min-p's test is
   relative to the top token, which every filter keeps, so only top-p's nucleus can
   differ between the two orders, when both are set.)

Logprobs are those of the model's distribution (raw logits, before any of the above), as
OpenAI and vLLM report them.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from pagefleet.engine.beam import num_beam_candidates
from pagefleet.engine.guided import apply_grammar_bitmask
from pagefleet.engine.request import Sequence


@dataclass(slots=True)
class SampleResult:
    token_id: int
    logprob: float | None = None  # of the sampled token; None unless logprobs were asked
    top: list[tuple[int, float]] = field(default_factory=list)
    # Beam search rows: the best continuations (token ids, logprobs of the raw logits),
    # best first, as many as beam.num_beam_candidates asks for (or the row's ``logprobs``
    # if more); None for other rows.
    beam: tuple[list[int], list[float]] | None = None


def apply_truncation(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Mask (to -inf) the tokens of each row outside its top-k (``top_k[i] >= vocab``
    disables), its top-p nucleus and its min-p floor. The most likely token survives."""
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    vocab = logits.shape[-1]
    k = top_k.clamp(1, vocab).to(torch.int64)
    kth = sorted_logits.gather(-1, (k - 1).unsqueeze(-1))
    # Ties with the k-th value survive, as transformers' TopKLogitsWarper keeps them.
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if bool((top_p < 1.0).any()):
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the tokens strictly more likely already reach top_p.
        before = torch.cumsum(probs, dim=-1) - probs
        drop = before >= top_p.unsqueeze(-1)
        drop[..., 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    out = torch.empty_like(logits).scatter_(-1, order, sorted_logits)
    if bool((min_p > 0.0).any()):
        probs = torch.softmax(out, dim=-1)
        floor = min_p.unsqueeze(-1) * probs.max(dim=-1, keepdim=True).values
        out = out.masked_fill(probs < floor, float("-inf"))
    return out


def apply_top_k_top_p_min_p(
    logits: torch.Tensor, top_k: int, top_p: float, min_p: float
) -> torch.Tensor:
    """``apply_truncation`` for one row with scalar parameters."""
    vocab = logits.shape[-1]
    k = top_k if 0 < top_k < vocab else vocab
    out = apply_truncation(
        logits.unsqueeze(0),
        torch.tensor([k]),
        torch.tensor([top_p], dtype=logits.dtype),
        torch.tensor([min_p], dtype=logits.dtype),
    )
    return out[0]


def _scale(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """``logits / temperature`` per row, never +inf (softmax would make it NaN and
    ``torch.multinomial`` raise, failing the whole batch's step).

    A row that overflows (a logit pushed to or near the float limit by an extreme
    ``repetition_penalty``) is shifted so its largest logit is 0 first: the same
    distribution, the top tokens tied. Other rows are divided as they are, so ordinary
    requests keep bit-identical probabilities (and seeded draws)."""
    scaled = logits / temperature
    over = torch.isposinf(scaled).any(dim=-1)
    if bool(over.any()):
        top = torch.finfo(logits.dtype).max
        capped = logits[over].clamp(max=top)
        shifted = capped - capped.max(dim=-1, keepdim=True).values
        scaled[over] = shifted / temperature[over]
    return scaled


def _padded(rows: list[list[int]], pad: int) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0) or 1
    return torch.tensor([r + [pad] * (width - len(r)) for r in rows], dtype=torch.int64)


def apply_penalties(
    logits: torch.Tensor,
    prompt_ids: list[list[int]],
    output_ids: list[list[int]],
    repetition: torch.Tensor,
    frequency: torch.Tensor,
    presence: torch.Tensor,
) -> torch.Tensor:
    """vLLM's penalties on every row: repetition over tokens seen in the prompt or the
    output (positive logits divided, negative multiplied), then ``frequency * count`` and
    ``presence * (count > 0)`` over output tokens subtracted."""
    n, vocab = logits.shape
    # An extra column takes the padding, so ragged lists scatter in one call.
    out_t = _padded(output_ids, vocab)
    counts = torch.zeros(n, vocab + 1).scatter_add_(1, out_t, torch.ones(out_t.shape))
    counts = counts[:, :vocab]
    in_prompt = torch.zeros(n, vocab + 1, dtype=torch.bool)
    in_prompt.scatter_(1, _padded(prompt_ids, vocab), True)
    seen = in_prompt[:, :vocab] | (counts > 0)
    r = repetition.unsqueeze(-1)
    penalised = torch.where(logits > 0, logits / r, logits * r)
    logits = torch.where(seen, penalised, logits)
    logits = logits - frequency.unsqueeze(-1) * counts
    return logits - presence.unsqueeze(-1) * (counts > 0).to(logits.dtype)


def banned_by_bad_words(output_ids: list[int], bad_words: list[list[int]]) -> list[int]:
    """Last tokens of the bad words whose other tokens end the output (vLLM: a word of
    one token is always banned; the prompt does not count)."""
    banned: list[int] = []
    for word in bad_words:
        prefix = len(word) - 1
        if prefix > len(output_ids):
            continue
        if prefix == 0 or output_ids[-prefix:] == word[:-1]:
            banned.append(word[-1])
    return banned


def _revive_empty_rows(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """``logits`` with every row that forbids all tokens replaced by that row of ``allowed``
    (the logits after the grammar's bitmask alone).

    Bans (bad words, ``min_tokens``) and overflowing penalties can leave a row no token: a
    grammar that is complete allows only EOS, which ``min_tokens`` bans; bad words can ban
    every token a grammar allows. Sampling such a row raised (NaN probabilities, failing
    the batch's step) and its argmax was token 0, outside the grammar. The grammar is the
    one hard constraint (its output must parse), so the other controls yield to it."""
    empty = torch.isneginf(logits).all(dim=-1)
    if not bool(empty.any()):
        return logits
    return torch.where(empty.unsqueeze(-1), allowed, logits)


def _plain_greedy(seq: Sequence) -> bool:
    """Whether every step of the module docstring leaves ``seq``'s row as it is, except the
    argmax: greedy, no grammar, bias, bans, penalties, logprobs or beams."""
    p = seq.request.params
    return (
        p.greedy
        and seq.grammar is None
        and not p.logit_bias
        and not p.bad_words_token_ids
        and p.min_tokens <= seq.num_output_tokens
        and p.logprobs is None
        and not p.use_beam_search
        and p.presence_penalty == 0.0
        and p.frequency_penalty == 0.0
        and p.repetition_penalty == 1.0
    )


class Sampler:
    def __init__(self, eos_token_ids: Seq[int]) -> None:
        self.eos_token_ids = list(eos_token_ids)

    def __call__(self, logits: torch.Tensor, seqs: Seq[Sequence]) -> list[SampleResult]:
        """``logits[i]`` (``[N, vocab]``) belongs to ``seqs[i]``; one result per row."""
        raw = logits.float()
        if all(map(_plain_greedy, seqs)):
            # Nothing to apply and nothing to report: the general path's argmax of the
            # unchanged logits, without its per-row Python (most steps of most servers).
            return [SampleResult(t) for t in raw.argmax(dim=-1).tolist()]
        return self.sample(self.process(raw, seqs), seqs, raw)

    def process(self, logits: torch.Tensor, seqs: Seq[Sequence]) -> torch.Tensor:
        """Steps 1 and 2 of the module docstring: the logits greedy decoding maximises."""
        params = [s.request.params for s in seqs]
        guided = [i for i, s in enumerate(seqs) if s.grammar is not None]
        if guided:
            logits = logits.clone()
            apply_grammar_bitmask(logits, guided, [seqs[i].grammar for i in guided])
        allowed = logits
        logits = self._bias_and_bans(logits, seqs)
        pen_rows = [i for i, p in enumerate(params) if p.has_penalties]
        if pen_rows:
            sub = apply_penalties(
                logits[pen_rows],
                [seqs[i].token_ids[: seqs[i].num_prompt_tokens] for i in pen_rows],
                [seqs[i].output_token_ids for i in pen_rows],
                torch.tensor([params[i].repetition_penalty for i in pen_rows]),
                torch.tensor([params[i].frequency_penalty for i in pen_rows]),
                torch.tensor([params[i].presence_penalty for i in pen_rows]),
            )
            logits = logits.index_copy(0, torch.tensor(pen_rows), sub)
        return _revive_empty_rows(logits, allowed)

    def sample(
        self, logits: torch.Tensor, seqs: Seq[Sequence], raw: torch.Tensor | None = None
    ) -> list[SampleResult]:
        """Step 3: one token per row of processed ``logits``; logprobs from ``raw``."""
        params = [s.request.params for s in seqs]
        vocab = logits.shape[-1]
        tokens = logits.argmax(dim=-1)
        rand_rows = [i for i, p in enumerate(params) if not p.greedy]
        if rand_rows:
            rp = [params[i] for i in rand_rows]
            temps = torch.tensor([p.temperature for p in rp]).unsqueeze(-1)
            row = _scale(logits[rand_rows], temps)
            row = apply_truncation(
                row,
                torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in rp]),
                torch.tensor([p.top_p for p in rp]),
                torch.tensor([p.min_p for p in rp]),
            )
            probs = torch.softmax(row, dim=-1)
            for j, i in enumerate(rand_rows):
                drawn = torch.multinomial(probs[j], 1, generator=seqs[i].generator)
                tokens[i] = drawn[0]
        token_ids = tokens.tolist()
        results = [SampleResult(token_id=t) for t in token_ids]
        beam_rows = [i for i, p in enumerate(params) if p.use_beam_search]
        if beam_rows:
            # transformers ranks log_softmax(logits) in float32, before any processor.
            base = raw if raw is not None else logits
            lp_beam = torch.log_softmax(base[beam_rows].float(), dim=-1)
            for j, i in enumerate(beam_rows):
                p = params[i]
                k = num_beam_candidates(p.beam_width, len(self.eos_token_ids))
                top = torch.topk(lp_beam[j], min(max(k, p.logprobs or 0), vocab))
                results[i].beam = (top.indices.tolist(), top.values.tolist())
        if any(p.logprobs is not None for p in params):
            lp_all = torch.log_softmax(raw if raw is not None else logits, dim=-1)
            for i, p in enumerate(params):
                if p.logprobs is None:
                    continue
                lp = lp_all[i]
                results[i].logprob = float(lp[token_ids[i]])
                if p.logprobs > 0:
                    top = torch.topk(lp, p.logprobs)
                    results[i].top = list(
                        zip(top.indices.tolist(), top.values.tolist(), strict=True)
                    )
        return results

    def _bias_and_bans(self, logits: torch.Tensor, seqs: Seq[Sequence]) -> torch.Tensor:
        bias_rows: list[int] = []
        bias_cols: list[int] = []
        bias_vals: list[float] = []
        ban_rows: list[int] = []
        ban_cols: list[int] = []
        vocab = logits.shape[-1]
        for i, seq in enumerate(seqs):
            p = seq.request.params
            for tok, val in p.logit_bias.items():
                if 0 <= tok < vocab:
                    bias_rows.append(i)
                    bias_cols.append(tok)
                    bias_vals.append(val)
            banned = banned_by_bad_words(seq.output_token_ids, p.bad_words_token_ids)
            if seq.num_output_tokens < p.min_tokens:
                banned += [*self.eos_token_ids, *p.stop_token_ids]
            banned = [t for t in banned if 0 <= t < vocab]
            ban_rows += [i] * len(banned)
            ban_cols += banned
        if not bias_rows and not ban_rows:
            return logits
        logits = logits.clone()
        if bias_rows:
            idx = (torch.tensor(bias_rows), torch.tensor(bias_cols))
            logits.index_put_(idx, torch.tensor(bias_vals, dtype=logits.dtype), accumulate=True)
        if ban_rows:
            logits[torch.tensor(ban_rows), torch.tensor(ban_cols)] = float("-inf")
        return logits
