"""``SamplingParams.prompt_logprobs`` against Hugging Face ``transformers`` on the seeded
tiny checkpoint: each prompt token's logprob is the log-softmax of the model's logits at
the position before it, whatever the engine does with the prompt (chunks, a prefix cache
that holds it, a batch of other requests, forks, preemption)."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from pagefleet.engine.config import EngineConfig
from pagefleet.engine.engine import LLMEngine
from pagefleet.engine.loader import resolve_model
from pagefleet.engine.outputs import GenerateResult, PromptLogprob
from pagefleet.engine.parts import load_parts
from pagefleet.engine.sampling_params import SamplingParams

PRESET = "tiny"
TOP = 5
ATOL = 1e-4
PROMPT_LENS = [1, 2, 17, 40, 95]


@dataclass
class Oracle:
    prompts: list[list[int]]
    log_softmax: list[torch.Tensor]  # [len(prompt), vocab]: position p predicts token p + 1


_ORACLE: list[Oracle] = []
_LOADED: list[tuple] = []


@pytest.fixture(scope="module")
def oracle() -> Oracle:
    if not _ORACLE:
        from transformers import AutoModelForCausalLM

        from pagefleet.engine.model_config import ModelConfig

        path = resolve_model(PRESET)
        vocab = ModelConfig.from_dir(path).vocab_size
        rng = random.Random(99)
        shared = [rng.randrange(5, vocab) for _ in range(64)]
        prompts = [[rng.randrange(5, vocab) for _ in range(n)] for n in PROMPT_LENS]
        prompts.append(shared[:48] + [rng.randrange(5, vocab) for _ in range(11)])
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        model.eval()
        with torch.inference_mode():
            logits = [model(torch.tensor([p])).logits[0].float() for p in prompts]
        lsm = [torch.log_softmax(row, dim=-1) for row in logits]
        _ORACLE.append(Oracle(prompts, lsm))
    return _ORACLE[0]


def _engine(**kw) -> LLMEngine:
    from pagefleet.engine.loader import load_model

    if not _LOADED:
        _LOADED.append(load_model(resolve_model(PRESET)))
    config = EngineConfig(model=PRESET, **kw)
    return LLMEngine(config, parts=load_parts(config, loaded=_LOADED[0]))


def _params(**kw) -> SamplingParams:
    base = {"temperature": 0.0, "max_tokens": 3, "ignore_eos": True, "prompt_logprobs": TOP}
    return SamplingParams(**{**base, **kw})


def _check(got: list[PromptLogprob | None] | None, prompt: list[int], lsm: torch.Tensor) -> None:
    """``got`` is transformers' log-softmax over the prompt's logits: logprob, rank, top."""
    assert got is not None, "no prompt_logprobs in the result"
    assert len(got) == len(prompt)
    assert got[0] is None, "the first prompt token has no context, so no logprob"
    for i, entry in enumerate(got[1:], start=1):
        assert entry is not None
        row = lsm[i - 1]
        tok = prompt[i]
        assert entry.token_id == tok
        assert entry.logprob == pytest.approx(float(row[tok]), abs=ATOL), f"token {i}"
        assert entry.rank == int((row > row[tok]).sum()) + 1, f"rank of token {i}"
        ref = torch.topk(row, TOP)
        assert [t for t, _, _ in entry.top] == ref.indices.tolist(), f"top of token {i}"
        got_top = torch.tensor([v for _, _, v in entry.top])
        torch.testing.assert_close(got_top, ref.values, atol=ATOL, rtol=0)


def _by_prompt(results: list[GenerateResult]) -> list[list[list[int]]]:
    return [[o.token_ids for o in r.outputs] for r in results]


def test_prompt_logprobs_match_transformers(oracle: Oracle) -> None:
    engine = _engine()
    results = engine.generate(oracle.prompts, _params())
    for res, prompt, lsm in zip(results, oracle.prompts, oracle.log_softmax, strict=True):
        _check(res.prompt_logprobs, prompt, lsm)
        # The texts are the tokens' own, as for output logprobs.
        for entry in res.prompt_logprobs[1:]:
            assert entry.token == engine.tokenizer.decode([entry.token_id], False)
    engine.check_integrity()


def test_without_prompt_logprobs_there_are_none(oracle: Oracle) -> None:
    engine = _engine()
    (res,) = engine.generate([oracle.prompts[3]], _params(prompt_logprobs=None))
    assert res.prompt_logprobs is None


def test_chunked_prefill_keeps_every_chunks_logits(oracle: Oracle) -> None:
    """Chunks of 8 tokens, 24 a step: a prompt spans many steps, each chunk's positions
    scored in its own step."""
    engine = _engine(long_prefill_token_threshold=8, max_num_batched_tokens=24)
    results = engine.generate(oracle.prompts, _params())
    assert engine.stats().steps_total > max(map(len, oracle.prompts)) // 8
    for res, prompt, lsm in zip(results, oracle.prompts, oracle.log_softmax, strict=True):
        _check(res.prompt_logprobs, prompt, lsm)


def test_prefix_cache_hit_is_skipped_but_blocks_stay_cached(oracle: Oracle) -> None:
    """A cached prompt has KV but no logits: the request recomputes it all (no hit), and
    the blocks stay cached for the requests that do not ask."""
    engine = _engine()
    prompt, lsm = oracle.prompts[-1], oracle.log_softmax[-1]
    plain = _params(prompt_logprobs=None)
    (first,) = engine.generate([prompt], plain)
    (scored,) = engine.generate([prompt], _params())
    assert scored.metrics.num_cached_tokens == 0
    _check(scored.prompt_logprobs, prompt, lsm)
    assert [o.token_ids for o in scored.outputs] == [o.token_ids for o in first.outputs]
    (again,) = engine.generate([prompt], plain)
    assert again.metrics.num_cached_tokens >= 48  # the cache still serves the others
    engine.check_integrity()


def test_batched_with_ordinary_requests_which_do_not_change(oracle: Oracle) -> None:
    plain = _params(prompt_logprobs=None, logprobs=2)
    alone = _engine().generate(oracle.prompts, plain)
    engine = _engine(long_prefill_token_threshold=16, max_num_batched_tokens=64)
    mixed = [_params() if i % 2 else plain for i in range(len(oracle.prompts))]
    results = engine.generate(oracle.prompts, mixed)
    for i, (res, ref) in enumerate(zip(results, alone, strict=True)):
        assert [o.token_ids for o in res.outputs] == [o.token_ids for o in ref.outputs]
        if i % 2:
            _check(res.prompt_logprobs, oracle.prompts[i], oracle.log_softmax[i])
        else:
            assert res.prompt_logprobs is None
            got = [lp.logprob for lp in res.outputs[0].logprobs or []]
            want = [lp.logprob for lp in ref.outputs[0].logprobs or []]
            assert got == pytest.approx(want, abs=ATOL)


def test_n_samples_share_one_prompt_score(oracle: Oracle) -> None:
    engine = _engine()
    params = _params(n=3, temperature=1.0, seed=7)
    results = engine.generate(oracle.prompts[2:], params)
    for res, prompt, lsm in zip(results, oracle.prompts[2:], oracle.log_softmax[2:], strict=True):
        assert len(res.outputs) == 3
        _check(res.prompt_logprobs, prompt, lsm)
    engine.check_integrity()


def test_preempted_and_recomputed_prompts_are_scored_once(oracle: Oracle) -> None:
    """A pool too small for the batch preempts requests mid-prompt and mid-decode; their
    recompute must neither duplicate nor skip a prompt token's score."""
    engine = _engine(
        block_size=16, num_gpu_blocks=9, max_num_batched_tokens=32, long_prefill_token_threshold=16
    )
    results = engine.generate(oracle.prompts, _params(n=2, max_tokens=12))
    assert engine.stats().num_preempted_total > 0
    for res, prompt, lsm in zip(results, oracle.prompts, oracle.log_softmax, strict=True):
        _check(res.prompt_logprobs, prompt, lsm)
    engine.check_integrity()


def test_prompt_logprobs_range_is_checked() -> None:
    with pytest.raises(ValueError, match="prompt_logprobs must be in"):
        SamplingParams(prompt_logprobs=21)


def test_beam_search_reports_prompt_logprobs_with_its_result(oracle: Oracle) -> None:
    """Beam search answers once, at the end: the prompt's scores come with that answer."""
    engine = _engine()
    params = _params(use_beam_search=True, n=2, best_of=3, max_tokens=4)
    (res,) = engine.generate([oracle.prompts[3]], params)
    assert len(res.outputs) == 2
    _check(res.prompt_logprobs, oracle.prompts[3], oracle.log_softmax[3])
    engine.check_integrity()


def test_scores_are_computed_in_slices_of_rows(oracle: Oracle, monkeypatch) -> None:
    """A chunk's positions are scored a slice of rows at a time (so a long prompt never
    holds its whole [positions, vocab] logits): slices of 7 rows, boundaries inside every
    chunk, give the same scores."""
    from pagefleet.engine import model_runner

    monkeypatch.setattr(model_runner, "PROMPT_SCORE_ROWS", 7)
    engine = _engine(long_prefill_token_threshold=20, max_num_batched_tokens=64)
    seen: list[int] = []
    score = engine.runner.score_prompt

    def spy(hidden, rows, targets, num_top):
        seen.append(len(rows))
        return score(hidden, rows, targets, num_top)

    engine.runner.score_prompt = spy
    results = engine.generate(oracle.prompts, _params())
    assert max(seen) > 7  # chunks longer than a slice were scored
    for res, prompt, lsm in zip(results, oracle.prompts, oracle.log_softmax, strict=True):
        _check(res.prompt_logprobs, prompt, lsm)
