"""Beam search in the engine (beam.py) against ``transformers`` ``generate(num_beams=...)``.

Token-exact on the tiny Llama and Qwen2 checkpoints, with and without length penalty and
with each ``early_stopping`` mode. Random weights rarely emit their EOS ids, so most cases
declare as EOS a token the beams do produce mid-way (on both sides): then hypotheses end at
different lengths and the length penalty and early stopping decide the answer (the
length_penalty=0 case prefers a short hypothesis that length_penalty=1 ranks last).
``check_integrity()`` runs after every step; a small KV pool forces beams to be preempted
and recomputed mid-search; KV usage is measured against independent sequences.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from pagefleet.engine.config import EngineConfig
from pagefleet.engine.engine import LLMEngine
from pagefleet.engine.kv_cache_manager import cdiv
from pagefleet.engine.loader import resolve_model
from pagefleet.engine.parts import load_parts
from pagefleet.engine.sampling_params import SamplingParams

MAX_TOKENS = 12
PROMPT_LENS = (5, 40)  # within one block (its fork copies it on write), across blocks

_LOADED: dict[str, tuple] = {}
_HF: dict[str, object] = {}


def _hf(preset: str):
    from transformers import AutoModelForCausalLM

    if preset not in _HF:
        path = resolve_model(preset)
        _HF[preset] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return _HF[preset]


def _engine(preset: str, eos: list[int], **kw) -> LLMEngine:
    from pagefleet.engine.loader import load_model

    if preset not in _LOADED:
        _LOADED[preset] = load_model(resolve_model(preset))
    config = EngineConfig(model=preset, **kw)
    engine = LLMEngine(config, parts=load_parts(config, loaded=_LOADED[preset]))
    # The same EOS ids on both sides (the reference gets them as eos_token_id).
    engine.eos_token_ids = set(eos)
    engine.runner.sampler.eos_token_ids = list(eos)
    return engine


def _prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(5, 1024) for _ in range(n)] for n in PROMPT_LENS]


def hf_beams(preset, prompt, width, n, lp, es, eos, max_tokens=MAX_TOKENS) -> list[list[int]]:
    """transformers' n best hypotheses, generated tokens only, cut after their EOS."""
    with torch.inference_mode():
        out = _hf(preset).generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            num_beams=width,
            do_sample=False,
            max_new_tokens=max_tokens,
            length_penalty=lp,
            early_stopping=es,
            num_return_sequences=n,
            eos_token_id=eos,
            pad_token_id=eos[0],
        )
    res = []
    for row in out.tolist():
        gen = row[len(prompt) :]
        cut = next((i + 1 for i, t in enumerate(gen) if t in eos), len(gen))
        res.append(gen[:cut])
    return res


def run_beams(engine: LLMEngine, prompts, params: SamplingParams) -> tuple[list, int]:
    """Every prompt's outputs (in index order) and the peak of referenced KV blocks."""
    ids = []
    for i, p in enumerate(prompts):
        rid = f"b{i}-{engine.stats().steps_total}"
        engine.add_request(rid, p, params)
        ids.append(rid)
    got: dict[str, dict[int, list[int]]] = {r: {} for r in ids}
    reasons: dict[str, dict[int, str]] = {r: {} for r in ids}
    peak = 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id not in got:
                continue  # another request sharing the engine
            for d in out.deltas:
                assert d.index not in reasons[out.request_id], "nothing after the last delta"
                got[out.request_id].setdefault(d.index, []).extend(d.new_token_ids)
                if d.finish_reason is not None:
                    reasons[out.request_id][d.index] = d.finish_reason
        engine.check_integrity()
        peak = max(peak, engine.kv.pool.num_referenced_blocks)
    assert engine.kv.pool.num_referenced_blocks == 0
    eos = engine.eos_token_ids
    for r in ids:
        for i, toks in got[r].items():
            assert reasons[r][i] == ("stop" if toks[-1] in eos else "length")
    return [[got[r][i] for i in range(params.n)] for r in ids], peak


def _mid_eos(preset: str, prompt: list[int]) -> int:
    """A token some (not all) of the reference's 4 beams produce mid-way."""
    base = hf_beams(preset, prompt, 4, 4, 1.0, False, [2, 4])
    counts = Counter(t for b in base for t in b[2:8])
    partial = [t for t, k in counts.most_common() if k < len(base)]
    return partial[0] if partial else counts.most_common(1)[0][0]


# (beam width, n, length_penalty, early_stopping, use the mid-way EOS)
CASES = {
    "tiny": [
        (4, 4, 1.0, False, False),
        (4, 2, 0.0, False, True),
        (3, 3, -1.0, True, True),
        (4, 2, 1.5, "never", True),
    ],
    "tiny-qwen2": [(4, 2, 0.0, False, True), (4, 2, 1.5, "never", True)],
}


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen2"])
def test_beam_search_matches_transformers(preset) -> None:
    prompts = _prompts()
    mid = _mid_eos(preset, prompts[1])
    differs = set()
    hit_eos = False
    for width, n, lp, es, use_mid in CASES[preset]:
        eos = [mid] if use_mid else [2, 4]
        engine = _engine(preset, eos, block_size=16)
        params = SamplingParams(
            n=n, best_of=width, use_beam_search=True, temperature=0.0,
            max_tokens=MAX_TOKENS, length_penalty=lp, early_stopping=es,
        )  # fmt: skip
        ref = [hf_beams(preset, p, width, n, lp, es, eos) for p in prompts]
        got, _ = run_beams(engine, prompts, params)
        assert got == ref, f"width {width} n {n} length_penalty {lp} early_stopping {es}"
        differs.add(str(ref))
        hit_eos |= any(len(t) < MAX_TOKENS and t[-1] == mid for out in got for t in out)
    assert hit_eos, "no answer ended on the EOS: the cases test no early end"
    assert len(differs) == len(CASES[preset]), "the cases must not all give one answer"


def test_beam_search_preempted_and_chunked_still_exact() -> None:
    """A pool too small for every beam at once and a token budget smaller than the
    prompts: beams are preempted and recomputed (held ones too, to let a sibling in),
    prompts chunked, and two beam searches plus a greedy request share the steps; the
    answers do not change."""
    preset, width, n = "tiny", 4, 2
    prompts = _prompts()
    mid = _mid_eos(preset, prompts[1])
    eos = [mid]
    ref = [hf_beams(preset, p, width, n, 0.5, False, eos) for p in prompts]
    engine = _engine(
        preset, eos, block_size=8, num_gpu_blocks=10, max_num_batched_tokens=24,
        max_num_seqs=8,
    )  # fmt: skip
    sched = engine.scheduler
    held_preemptions = []
    preempt_held = sched._preempt_held

    def counting(preempted):
        done = preempt_held(preempted)
        held_preemptions.append(done)
        return done

    sched._preempt_held = counting
    params = SamplingParams(
        n=n, best_of=width, use_beam_search=True, temperature=0.0, max_tokens=MAX_TOKENS,
        length_penalty=0.5,
    )  # fmt: skip
    engine.add_request("greedy", prompts[0], SamplingParams(temperature=0.0, max_tokens=20))
    got, _ = run_beams(engine, prompts, params)
    assert got == ref
    assert engine.stats().num_preempted_total > 0
    assert sum(held_preemptions) > 0, "no held beam had to make room for a sibling"


def test_a_recomputed_beam_that_outgrows_its_blocks_takes_them_from_held_beams() -> None:
    """Prefix caching off and chunked prefill: a preempted beam comes back with a chunk that
    fits beside its held siblings, then needs one more block. It used to preempt itself
    every step (the waiting phase, where held beams make room, was skipped) while the held
    beams kept theirs: the search never advanced. It must end, as on a pool with room."""
    params = SamplingParams(n=3, use_beam_search=True, temperature=0.0, max_tokens=30)
    outs = []
    for blocks in (12, 64):
        engine = _engine(
            "tiny", [], block_size=4, num_gpu_blocks=blocks, max_model_len=48,
            max_num_batched_tokens=8, max_num_seqs=3, enable_prefix_caching=False,
        )  # fmt: skip
        engine.add_request("b", [11, 12, 13, 14], params)
        got: dict[int, list[int]] = {}
        for _ in range(600):
            if not engine.has_unfinished():
                break
            for out in engine.step():
                for d in out.deltas:
                    got.setdefault(d.index, []).extend(d.new_token_ids)
            engine.check_integrity()
        assert not engine.has_unfinished(), f"no end after 600 steps on {blocks} blocks"
        assert engine.kv.pool.num_referenced_blocks == 0
        outs.append(got)
    assert outs[0] == outs[1] and len(outs[0]) == 3


def test_beams_waiting_behind_a_request_without_a_seat_still_run() -> None:
    """Cache-aware ordering: a beam search (width 3 = max_num_seqs) overtakes an earlier
    one-token request on its cached prefix; then the pool preempts two of its beams. The
    earlier request, past max_wait_steps, is queued ahead of them but cannot take a seat
    while the search holds all three; the beams need none, yet admission stopped at that
    head. The held beam waited for its siblings, the siblings for the head, the head for
    the search to end: no step did anything again. Both must end, the beams with the
    answer they give alone."""
    beam = SamplingParams(best_of=3, use_beam_search=True, temperature=0.0, max_tokens=6,
                          ignore_eos=True)  # fmt: skip
    prompt = [5] * 7
    alone = _engine("tiny", [2, 4], block_size=2).generate([prompt], beam)[0]
    engine = _engine(
        "tiny", [2, 4], block_size=2, num_gpu_blocks=8, max_model_len=15, max_num_seqs=3,
        max_num_batched_tokens=15, enable_chunked_prefill=False, cache_aware_scheduling=True,
        max_wait_steps=3,
    )  # fmt: skip
    engine.generate([prompt[:6]], SamplingParams(temperature=0.0, max_tokens=1))  # cached
    engine.add_request("one", [5], SamplingParams(temperature=0.0, max_tokens=None))
    engine.add_request("beam", prompt, beam)
    got: list[int] = []
    for _ in range(200):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            if out.request_id == "beam" and out.finished:
                got = out.deltas[0].new_token_ids
        engine.check_integrity()
    assert not engine.has_unfinished(), "no end after 200 steps"
    assert engine.stats().num_preempted_total > 0
    assert got == alone.outputs[0].token_ids


def test_beam_kv_usage_far_below_independent_sequences() -> None:
    """Beams share the prompt's blocks: the peak of referenced blocks over a 4-beam search
    of a 160-token prompt stays far below 4 times one sequence's own peak (measured, both
    with prefix caching off so only live tables count)."""
    preset, width = "tiny", 4
    prompt = [random.Random(3).randrange(5, 1024) for _ in range(160)]
    kw = dict(block_size=16, enable_prefix_caching=False)
    single = _engine(preset, [2, 4], **kw)
    one = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    _, single_peak = run_beams(single, [prompt], one)
    assert single_peak == cdiv(160 + 16 - 1, 16)  # KV exists for all but the last token
    engine = _engine(preset, [2, 4], **kw)
    params = SamplingParams(
        n=width, use_beam_search=True, temperature=0.0, max_tokens=16, ignore_eos=True
    )
    _, beam_peak = run_beams(engine, [prompt], params)
    independent = width * single_peak
    print(f"beam peak {beam_peak} blocks vs {independent} for {width} independent sequences")
    # 10 shared prompt blocks + at most 2 own blocks per beam.
    assert beam_peak <= cdiv(160, 16) + 2 * width
    assert beam_peak * 2 < independent


def test_beam_logprobs_are_the_models_and_score_the_answers() -> None:
    """With logprobs, each answer's tokens carry the model's logprob (teacher-forced
    transformers forward) and the row's best alternatives; their sum scored with the
    length penalty is transformers' sequences_scores, best first."""
    preset, width, n, lp = "tiny", 4, 3, 0.7
    prompt = _prompts()[1]
    eos = [_mid_eos(preset, prompt)]
    engine = _engine(preset, eos, block_size=16)
    params = SamplingParams(
        n=n, best_of=width, use_beam_search=True, temperature=0.0, max_tokens=MAX_TOKENS,
        length_penalty=lp, logprobs=5,
    )  # fmt: skip
    (res,) = engine.generate([prompt], params)
    with torch.inference_mode():
        ref = _hf(preset).generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            num_beams=width, do_sample=False, max_new_tokens=MAX_TOKENS, length_penalty=lp,
            num_return_sequences=n, eos_token_id=eos, pad_token_id=eos[0],
            return_dict_in_generate=True, output_scores=True,
        )  # fmt: skip
    scores = []
    for out, want in zip(res.outputs, ref.sequences_scores.tolist(), strict=True):
        toks = out.token_ids
        assert [lp_.token_id for lp_ in out.logprobs] == toks
        with torch.inference_mode():
            logits = _hf(preset)(torch.tensor([prompt + toks])).logits[0, len(prompt) - 1 : -1]
        model_lp = torch.log_softmax(logits.float(), dim=-1)
        for j, tl in enumerate(out.logprobs):
            assert tl.logprob == pytest.approx(float(model_lp[j, tl.token_id]), abs=1e-3)
            assert len(tl.top) == 5
            assert [t for t, _, _ in tl.top] == model_lp[j].topk(5).indices.tolist()
            assert [v for _, _, v in tl.top] == sorted((v for _, _, v in tl.top), reverse=True)
        score = sum(t.logprob for t in out.logprobs) / len(toks) ** lp
        assert score == pytest.approx(want, abs=1e-3)
        scores.append(score)
    assert scores == sorted(scores, reverse=True)


def test_beam_abort_mid_search_ends_every_answer_and_frees_every_block() -> None:
    engine = _engine("tiny", [2, 4], block_size=8)
    params = SamplingParams(n=2, best_of=3, use_beam_search=True, temperature=0.0, max_tokens=30)
    engine.add_request("b", _prompts()[1], params)
    for _ in range(4):
        assert engine.step() == []  # nothing is reported before the search ends
        engine.check_integrity()
    assert len(engine._requests["b"].seqs) == 3  # the beams exist, forked
    assert engine.abort("b")
    engine.check_integrity()
    assert engine.kv.pool.num_referenced_blocks == 0
    (out,) = engine.step()
    assert out.finished and [(d.index, d.finish_reason) for d in out.deltas] == [
        (0, "abort"),
        (1, "abort"),
    ]
    assert not engine.has_unfinished()


@pytest.mark.parametrize(
    ("kw", "param"),
    [
        (dict(temperature=0.7), "temperature"),
        (dict(temperature=0.0, n=3, best_of=2), "best_of"),
        (dict(temperature=0.0, logit_bias={5: 1.0}), "logit_bias"),
        (dict(temperature=0.0, stop=["x"]), "stop"),
        (dict(temperature=0.0, repetition_penalty=1.2), "repetition_penalty"),
        (dict(temperature=0.0, early_stopping="sometimes"), "early_stopping"),
    ],
)
def test_beam_search_refuses_what_it_cannot_honour(kw, param) -> None:
    with pytest.raises(ValueError) as e:
        SamplingParams(use_beam_search=True, **kw)
    assert str(e.value).split(" ", 1)[0] == param


def test_best_of_without_beam_search_is_refused() -> None:
    with pytest.raises(ValueError, match=r"^best_of"):
        SamplingParams(n=1, best_of=3)
    assert SamplingParams(n=2, best_of=2).beam_width == 0
    assert SamplingParams(n=2, use_beam_search=True, temperature=0.0).beam_width == 2
