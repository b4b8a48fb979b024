"""Sampling parameters at the edges of their valid ranges, and controls that contradict each
other, on the tiny model: every request the parameters' validation accepts must sample
without breaking the step it shares with other requests."""

from __future__ import annotations

import pytest

from pagefleet.engine.config import EngineConfig
from pagefleet.engine.engine import LLMEngine
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
