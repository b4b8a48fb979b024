"""Sampling controls (penalties, logit_bias, min_tokens, stop_token_ids, bad_words, top-k,
top-p, min-p) against straightforward references: transformers' logits processors where
one exists, a plain loop otherwise; per row in a mixed batch, and through the engine on the
tiny model (greedy against a transformers loop, batched against one at a time)."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    NoBadWordsLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from pagefleet.engine.config import EngineConfig
from pagefleet.engine.engine import LLMEngine
from pagefleet.engine.errors import InvalidRequestError
from pagefleet.engine.loader import load_model, resolve_model
from pagefleet.engine.outputs import RequestMetrics
from pagefleet.engine.parts import load_parts
from pagefleet.engine.request import Request, Sequence
from pagefleet.engine.sampler import Sampler, apply_truncation
from pagefleet.engine.sampling_params import SamplingParams

VOCAB = 300
EOS = 2


def _seq(prompt: list[int], output: list[int], params: SamplingParams) -> Sequence:
    req = Request("r", list(prompt), params, RequestMetrics(arrival_time=0.0), forked=True)
    return Sequence(0, req, 0, [*prompt, *output], len(prompt))


def _reference(seq: Sequence, logits: torch.Tensor) -> torch.Tensor:
    """The same controls, one processor at a time, in vLLM's order."""
    p = seq.request.params
    scores = logits.clone().unsqueeze(0)
    out = torch.tensor([seq.output_token_ids], dtype=torch.long)
    full = torch.tensor([seq.token_ids], dtype=torch.long)
    if p.bad_words_token_ids:
        scores = NoBadWordsLogitsProcessor(p.bad_words_token_ids, eos_token_id=EOS)(out, scores)
    if p.logit_bias:
        bias = {(t,): v for t, v in p.logit_bias.items()}
        scores = SequenceBiasLogitsProcessor(bias)(full, scores)
    if p.min_tokens:
        scores = MinNewTokensLengthLogitsProcessor(
            seq.num_prompt_tokens, p.min_tokens, [EOS, *p.stop_token_ids]
        )(full, scores)
    if p.repetition_penalty != 1.0:
        scores = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(full, scores)
    row = scores[0]
    # No transformers processor has OpenAI's presence/frequency penalties: a plain loop.
    for tok in set(seq.output_token_ids):
        count = seq.output_token_ids.count(tok)
        row[tok] -= p.frequency_penalty * count + p.presence_penalty
    return row


CASES = [
    SamplingParams(repetition_penalty=1.7),
    SamplingParams(repetition_penalty=0.6),
    SamplingParams(frequency_penalty=0.9),
    SamplingParams(presence_penalty=-1.2),
    SamplingParams(logit_bias={5: 30.0, 17: -100.0, 250: 2.5}),
    SamplingParams(min_tokens=30, max_tokens=64, stop_token_ids=[7, 8]),
    SamplingParams(min_tokens=2, stop_token_ids=[7]),  # already reached: nothing banned
    SamplingParams(bad_words_token_ids=[[11], [40, 41], [3, 4, 5]]),
    SamplingParams(),
    SamplingParams(
        repetition_penalty=1.3,
        frequency_penalty=0.5,
        presence_penalty=0.4,
        logit_bias={9: 5.0},
        min_tokens=20,
        max_tokens=64,
        stop_token_ids=[12],
        bad_words_token_ids=[[4, 5], [99]],
    ),
]


def test_controls_match_the_reference_per_row_in_a_mixed_batch() -> None:
    rng = random.Random(3)
    gen = torch.Generator().manual_seed(3)
    seqs = []
    for i, params in enumerate(CASES):
        prompt = [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 12))]
        output = [rng.randrange(3, 60) for _ in range(6 + i)]
        if params.bad_words_token_ids:
            output[-2:] = [3, 4]  # ends with the prefix of [3, 4, 5] and of [4, 5]
        seqs.append(_seq(prompt, output, params))
    logits = torch.randn(len(seqs), VOCAB, generator=gen) * 3
    sampler = Sampler([EOS])
    batched = sampler.process(logits, seqs)
    for i, seq in enumerate(seqs):
        want = _reference(seq, logits[i])
        torch.testing.assert_close(batched[i], want, rtol=1e-5, atol=1e-5)
        alone = sampler.process(logits[i : i + 1], [seq])[0]
        assert torch.equal(alone, batched[i])
        if i not in (6, 8):  # 6: min_tokens already reached; 8: no control
            assert not torch.equal(batched[i], logits[i]), f"case {i} changed nothing"
    # The bans really are bans.
    assert torch.isinf(batched[5, [EOS, 7, 8]]).all() and torch.isfinite(batched[6, 7])
    assert torch.isinf(batched[7, [11, 5]]).all() and torch.isfinite(batched[7, 41])


def test_truncation_matches_transformers_warpers_per_row() -> None:
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(6, VOCAB, generator=gen) * 2
    top_k = [1, 5, 40, VOCAB, VOCAB, 17]
    top_p = [1.0, 1.0, 0.9, 0.5, 1.0, 0.8]
    min_p = [0.0, 0.0, 0.0, 0.0, 0.1, 0.05]
    got = apply_truncation(logits, torch.tensor(top_k), torch.tensor(top_p), torch.tensor(min_p))
    ids = torch.zeros(1, 1, dtype=torch.long)
    for i in range(6):
        want = logits[i : i + 1]
        if top_k[i] < VOCAB:
            want = TopKLogitsWarper(top_k[i])(ids, want)
        if top_p[i] < 1.0:
            want = TopPLogitsWarper(top_p[i])(ids, want)
        if min_p[i] > 0:
            want = MinPLogitsWarper(min_p[i])(ids, want)
        assert torch.isfinite(got[i]).tolist() == torch.isfinite(want[0]).tolist(), i
        kept = torch.isfinite(got[i])
        assert torch.equal(got[i][kept], logits[i][kept])
        assert 1 <= int(kept.sum()) <= top_k[i]


# -- through the engine on the tiny model -------------------------------------------------

_LOADED: dict[str, tuple] = {}


def _engine(**kw) -> LLMEngine:
    if "tiny" not in _LOADED:
        _LOADED["tiny"] = load_model(resolve_model("tiny"))
    config = EngineConfig(model="tiny", **kw)
    return LLMEngine(config, parts=load_parts(config, loaded=_LOADED["tiny"]))


def _hf_greedy(prompt: list[int], params: SamplingParams, eos: list[int], steps: int):
    """Greedy decoding with transformers' model and processors, one token at a time."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(resolve_model("tiny"), dtype=torch.float32)
    out: list[int] = []
    with torch.inference_mode():
        for _ in range(steps):
            logits = model(torch.tensor([prompt + out])).logits[0, -1].float()
            seq = _seq(prompt, out, params)
            scores = _reference_with_eos(seq, logits, eos)
            out.append(int(scores.argmax()))
    return out


def _reference_with_eos(seq: Sequence, logits: torch.Tensor, eos: list[int]) -> torch.Tensor:
    global EOS
    saved, EOS = EOS, eos[0]
    try:
        return _reference(seq, logits)
    finally:
        EOS = saved


def test_greedy_with_controls_matches_transformers_on_the_tiny_model() -> None:
    eng = _engine()
    eos = sorted(eng.eos_token_ids)
    prompt = [17, 42, 99, 5, 300, 17, 42]
    base = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    (plain,) = eng.generate([prompt], base)
    free = plain.outputs[0].token_ids
    params = SamplingParams(
        temperature=0.0,
        max_tokens=12,
        ignore_eos=True,
        repetition_penalty=1.5,
        frequency_penalty=0.7,
        presence_penalty=0.3,
        logit_bias={free[1]: -100.0},
        min_tokens=4,
        bad_words_token_ids=[[free[0]], [free[2], free[3]]],
    )
    (res,) = eng.generate([prompt], params)
    got = res.outputs[0].token_ids
    assert got != free
    assert got == _hf_greedy(prompt, params, eos, 12)


def test_batched_controls_equal_one_at_a_time_and_bans_hold() -> None:
    rng = random.Random(11)
    prompts = [[rng.randrange(5, 1000) for _ in range(rng.randint(3, 30))] for _ in range(6)]
    plist = [
        SamplingParams(temperature=0.0, max_tokens=10, repetition_penalty=1.4, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=1, max_tokens=10, frequency_penalty=1.5),
        SamplingParams(temperature=1.0, seed=2, top_k=5, min_p=0.1, presence_penalty=1.0),
        SamplingParams(temperature=0.0, max_tokens=10, logit_bias={77: 100.0}),
        SamplingParams(n=2, temperature=0.9, seed=3, max_tokens=10, min_tokens=10),
        SamplingParams(temperature=0.0, max_tokens=8, bad_words_token_ids=[[77]]),
    ]
    eng = _engine()
    together = eng.generate(prompts, plist)
    for prompt, params, res in zip(prompts, plist, together, strict=True):
        (alone,) = eng.generate([prompt], params)  # alone in the batch this time
        assert [o.token_ids for o in res.outputs] == [o.token_ids for o in alone.outputs]
    assert together[3].outputs[0].token_ids == [77] * 10  # the bias dominates
    assert all(len(o.token_ids) == 10 for o in together[4].outputs)  # min_tokens held
    assert 77 not in together[5].outputs[0].token_ids


def test_bad_words_are_tokenized_and_token_ids_checked() -> None:
    eng = _engine()
    params = SamplingParams(bad_words=["hello world"])
    eng.add_request("a", [5, 6], params)
    assert params.bad_words_token_ids and all(params.bad_words_token_ids)
    # A word written with its leading space bans it both alone and after a space, as
    # the same word without the space does (vLLM strips it before either spelling).
    spaced = SamplingParams(bad_words=[" hello"])
    eng.add_request("s", [5, 6], spaced)
    plain = SamplingParams(bad_words=["hello"])
    eng.add_request("p", [5, 6], plain)
    assert sorted(spaced.bad_words_token_ids) == sorted(plain.bad_words_token_ids)
    with pytest.raises(InvalidRequestError) as err:
        eng.add_request("b", [5, 6], SamplingParams(logit_bias={10**6: 1.0}))
    assert err.value.param == "logit_bias"
    with pytest.raises(ValueError, match="presence_penalty"):
        SamplingParams(presence_penalty=3.0)


def test_plain_greedy_fast_path_equals_the_general_path() -> None:
    """A batch of plain greedy rows skips the per-row controls: the same tokens (ties to
    the lowest id) as processing and sampling them; one row with a control anywhere in the
    batch (here min_tokens not yet reached) sends the batch down the general path."""
    sampler = Sampler([EOS])
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(6, VOCAB, generator=g)
    logits[1, [7, 3]] = 50.0  # a tie: the lowest id wins in both paths
    logits[4, EOS] = 60.0
    seqs = [_seq([5, 6], [9] * i, SamplingParams(temperature=0)) for i in range(6)]
    fast = sampler(logits, seqs)
    general = sampler.sample(sampler.process(logits, seqs), seqs, logits)
    assert [r.token_id for r in fast] == [r.token_id for r in general]
    assert fast[1].token_id == 3 and fast[4].token_id == EOS
    assert all(r.logprob is None and r.top == [] and r.beam is None for r in fast)
    seqs[4] = _seq([5, 6], [9] * 4, SamplingParams(temperature=0, min_tokens=5))
    mixed = sampler(logits, seqs)
    assert mixed[4].token_id != EOS  # banned until min_tokens: the general path ran
    assert [r.token_id for i, r in enumerate(mixed) if i != 4] == [
        r.token_id for i, r in enumerate(fast) if i != 4
    ]
