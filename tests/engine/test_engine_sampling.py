"""Sampling on the real tiny model: seeded reproducibility independent of batch
composition, n > 1, outputs identical with prefix caching on and off, logprobs."""

from __future__ import annotations

import random

import pytest
import torch

from pagefleet.engine.config import EngineConfig
from pagefleet.engine.engine import LLMEngine
from pagefleet.engine.parts import load_parts
from pagefleet.engine.sampler import Sampler, apply_top_k_top_p_min_p
from pagefleet.engine.sampling_params import SamplingParams

_LOADED: dict[str, tuple] = {}


def _engine(**kw) -> LLMEngine:
    from pagefleet.engine.loader import load_model, resolve_model

    if "tiny" not in _LOADED:
        _LOADED["tiny"] = load_model(resolve_model("tiny"))
    config = EngineConfig(model="tiny", **kw)
    return LLMEngine(config, parts=load_parts(config, loaded=_LOADED["tiny"]))


def _tokens(results) -> list[list[list[int]]]:
    return [[o.token_ids for o in r.outputs] for r in results]


def _prompts() -> list[list[int]]:
    rng = random.Random(7)
    system = [rng.randrange(5, 1000) for _ in range(40)]
    # Shared prefixes ending on a block boundary (16, 32) and off it (21, 40), plus strays.
    cut = [16, 21, 32, 40, 40]
    out = [system[:c] + [rng.randrange(5, 1000) for _ in range(rng.randint(1, 9))] for c in cut]
    out.append(system[:32])  # exactly two full cached blocks: the last token is recomputed
    out += [[rng.randrange(5, 1000) for _ in range(n)] for n in (3, 25)]
    return out


SEEDED = SamplingParams(
    temperature=0.9, top_p=0.9, top_k=40, seed=11, max_tokens=8, ignore_eos=True
)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_caching_on_and_off_give_identical_outputs(params) -> None:
    prompts = _prompts()
    off = _engine(enable_prefix_caching=False)
    want = _tokens(off.generate(prompts, params))
    on = _engine(enable_prefix_caching=True)
    first = _tokens(on.generate(prompts, params))  # fills the cache (and hits within it)
    second = _tokens(on.generate(prompts, params))  # served mostly from the cache
    assert first == want and second == want
    s = on.stats()
    assert s.prefix_hits_tokens > 0.5 * sum(map(len, prompts))


def test_seeded_samples_are_independent_of_the_batch() -> None:
    params = SamplingParams(
        n=3, temperature=1.0, min_p=0.05, seed=123, max_tokens=10, ignore_eos=True
    )
    prompt = [17, 42, 99, 5, 300]
    alone = _tokens(_engine().generate([prompt], params))[0]
    assert len({tuple(t) for t in alone}) == 3  # the n samples differ from one another
    crowd = _engine(max_num_batched_tokens=32)
    others = [[random.Random(i).randrange(5, 1000) for _ in range(10 + 7 * i)] for i in range(6)]
    plist = [SamplingParams(temperature=0.7, seed=i, max_tokens=6) for i in range(6)]
    res = crowd.generate([*others[:3], prompt, *others[3:]], [*plist[:3], params, *plist[3:]])
    assert [o.token_ids for o in res[3].outputs] == alone
    # And a different seed gives different samples.
    other = _tokens(
        _engine().generate(
            [prompt],
            SamplingParams(
                n=3, temperature=1.0, min_p=0.05, seed=124, max_tokens=10, ignore_eos=True
            ),
        )
    )[0]
    assert other != alone


def test_logprobs_are_the_models_distribution() -> None:
    eng = _engine()
    (res,) = eng.generate(
        [[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=4, logprobs=3, ignore_eos=True)
    )
    out = res.outputs[0]
    assert out.logprobs is not None and len(out.logprobs) == 4
    for tok, lp in zip(out.token_ids, out.logprobs, strict=True):
        assert lp.token_id == tok and lp.logprob <= 0
        assert next(t for t, _, _ in lp.top) == tok  # greedy picks the top-1
        vals = [v for _, _, v in lp.top]
        assert vals == sorted(vals, reverse=True) and abs(vals[0] - lp.logprob) < 1e-6


def test_truncation_filters() -> None:
    logits = torch.tensor([0.0, 3.0, 1.0, 2.9, -5.0])
    k2 = apply_top_k_top_p_min_p(logits, 2, 1.0, 0.0)
    assert torch.isfinite(k2).tolist() == [False, True, False, True, False]
    p_small = apply_top_k_top_p_min_p(logits, -1, 0.3, 0.0)
    assert torch.isfinite(p_small).tolist() == [False, True, False, False, False]
    p_mid = apply_top_k_top_p_min_p(logits, -1, 0.6, 0.0)  # top two hold ~0.46 + 0.42
    assert torch.isfinite(p_mid).tolist() == [False, True, False, True, False]
    m = apply_top_k_top_p_min_p(logits, -1, 1.0, 0.5)
    assert torch.isfinite(m).tolist() == [False, True, False, True, False]


def test_sampler_rows_do_not_interact(make_seq) -> None:
    sampler = Sampler(eos_token_ids=[0])
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))

    def seq_with_seed(seed):
        s = make_seq([1, 2])
        s.request.params = SamplingParams(temperature=1.0, seed=seed)
        s.generator = torch.Generator().manual_seed(seed)
        return s

    together = sampler(logits, [seq_with_seed(1), seq_with_seed(2), seq_with_seed(3)])
    alone = sampler(logits[1:2], [seq_with_seed(2)])
    assert together[1].token_id == alone[0].token_id


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_tokens_through_the_engine(include) -> None:
    eng = _engine()
    prompt = [11, 12, 13, 14]
    base = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    (free,) = eng.generate([prompt], base)
    ids, full = free.outputs[0].token_ids, free.outputs[0].text
    tok = eng.tokenizer
    # Two characters either side of the boundary between two generated tokens.
    cut = next(
        len(tok.decode(ids[:k]))
        for k in range(2, len(ids))
        if 0 < len(tok.decode(ids[:k])) < len(full) - 1
        and full.startswith(tok.decode(ids[:k]))
        and "\ufffd" not in full[: len(tok.decode(ids[:k])) + 1]
    )
    stop = full[cut - 1 : cut + 1]
    params = SamplingParams(
        temperature=0.0,
        max_tokens=24,
        ignore_eos=True,
        stop=[stop],
        include_stop_str_in_output=include,
    )
    (res,) = eng.generate([prompt], params)
    out = res.outputs[0]
    at = full.find(stop)
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == (full[: at + len(stop)] if include else full[:at])
    assert out.token_ids == ids[: len(out.token_ids)] and len(out.token_ids) < len(ids)
