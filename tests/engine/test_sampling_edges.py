"""Sampling parameters at the edges of their valid ranges, and controls that contradict each
other, on the tiny model: every request the parameters' validation accepts must sample
without breaking the step it shares with other requests, and a grammar stays a hard
constraint whatever the other controls ask."""

from __future__ import annotations

import pytest

from pagefleet.engine.config import EngineConfig
from pagefleet.engine.engine import LLMEngine
from pagefleet.engine.guided import GuidedSpec
from pagefleet.engine.loader import load_model, resolve_model
from pagefleet.engine.parts import load_parts
from pagefleet.engine.sampling_params import SamplingParams

PROMPT = [17, 42, 99, 5, 300, 17, 42]


@pytest.fixture(scope="module")
def loaded() -> tuple:
    return load_model(resolve_model("tiny"))


def _engine(loaded: tuple) -> LLMEngine:
    config = EngineConfig(model="tiny")
    return LLMEngine(config, parts=load_parts(config, loaded=loaded))


def test_tiny_temperatures_sample_the_argmax_without_breaking_the_batch(loaded) -> None:
    """A temperature of 1e-38 is valid (finite, > 0), but logits / 1e-38 overflowed to inf,
    softmax gave NaN and torch.multinomial raised: the step failed for every request in
    the batch and the engine was left unusable. As the temperature goes to 0 sampling
    becomes the argmax, so that is what such a request must get."""
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    (want,) = _engine(loaded).generate([PROMPT], greedy)
    eng = _engine(loaded)
    plist = [
        SamplingParams(temperature=t, seed=1, max_tokens=6, ignore_eos=True)
        for t in (1e-6, 1e-30, 1e-38, 1e-45)
    ]
    other = SamplingParams(temperature=1.0, seed=2, max_tokens=6, ignore_eos=True)
    results = eng.generate([PROMPT] * len(plist) + [[5, 6, 7]], [*plist, other])
    for params, res in zip(plist, results, strict=False):
        assert res.outputs[0].token_ids == want.outputs[0].token_ids, params.temperature
    assert len(results[-1].outputs[0].token_ids) == 6
    # The engine still serves requests afterwards.
    (again,) = eng.generate([PROMPT], greedy)
    assert again.outputs[0].token_ids == want.outputs[0].token_ids


def test_an_extreme_repetition_penalty_samples_among_the_seen_tokens(loaded) -> None:
    """repetition_penalty=1e-38 divides the positive logits of the prompt's tokens into
    +inf; sampling then met inf - inf = NaN and failed the batch. Every such token is
    infinitely more likely than any other, so one of them must be drawn."""
    params = SamplingParams(
        temperature=1.0, seed=4, max_tokens=4, ignore_eos=True, repetition_penalty=1e-38
    )
    (res,) = _engine(loaded).generate([PROMPT], params)
    assert len(res.outputs[0].token_ids) == 4
    assert set(res.outputs[0].token_ids) <= set(PROMPT)


CHOICE = GuidedSpec.choice(["ab", "cd"])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_past_the_grammars_end_yields_to_the_grammar(loaded, temperature) -> None:
    """Once a grammar is complete only EOS is allowed; min_tokens banned EOS too, leaving a
    row of -inf. Greedy then took token 0 (outside the grammar: the output broke its
    constraint and ran on), sampling raised on the NaN distribution and failed the whole
    batch. The grammar is the hard constraint: the output ends as soon as it is complete."""
    params = SamplingParams(
        temperature=temperature, seed=5, guided=CHOICE, max_tokens=20, min_tokens=10
    )
    eng = _engine(loaded)
    res = eng.generate([PROMPT, [5, 6, 7]], [params, SamplingParams(seed=6, max_tokens=4)])
    out = res[0].outputs[0]
    assert out.text in ("ab", "cd")
    assert out.finish_reason == "stop"
    # Nothing but the choice's own tokens and the EOS that ended it (no special tokens the
    # text would hide).
    assert out.token_ids[-1] in eng.eos_token_ids
    assert eng.tokenizer.decode(out.token_ids[:-1], False) == out.text
    assert len(res[1].outputs[0].token_ids) >= 1


def test_bad_words_that_forbid_every_choice_yield_to_the_grammar(loaded) -> None:
    """bad_words banning every token the grammar allows left a row of -inf: the step
    raised for every request in the batch. The grammar wins over the bans."""
    params = SamplingParams(
        temperature=1.0, seed=7, guided=CHOICE, max_tokens=10, bad_words=["a", "ab", "c", "cd"]
    )
    (res,) = _engine(loaded).generate([PROMPT], params)
    assert res.outputs[0].text in ("ab", "cd")
    assert res.outputs[0].finish_reason == "stop"
