"""Structured output on the random-weight tiny model: only the grammar can make its output
valid, so every finished output must parse and match its constraint; the compiled grammar
is cached by spec; a bad spec is refused at admission."""

from __future__ import annotations

import json
import re

import pytest

from pagefleet.engine.config import EngineConfig
from pagefleet.engine.engine import LLMEngine
from pagefleet.engine.errors import InvalidRequestError
from pagefleet.engine.guided import GuidedSpec
from pagefleet.engine.loader import load_model, resolve_model
from pagefleet.engine.parts import load_parts
from pagefleet.engine.sampling_params import SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"enum": ["cat", "dog"]},
    },
    "required": ["name", "age", "pet"],
    "additionalProperties": False,
}


def check_schema(text: str) -> None:
    """SCHEMA's rules, checked by hand (no JSON-schema validator is a dependency)."""
    obj = json.loads(text)
    assert set(obj) == {"name", "age", "pet"}, obj
    assert isinstance(obj["name"], str) and len(obj["name"]) <= 6
    assert type(obj["age"]) is int and 0 <= obj["age"] <= 120
    assert obj["pet"] in ("cat", "dog")


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    config = EngineConfig(model="tiny")
    return LLMEngine(config, parts=load_parts(config, loaded=load_model(resolve_model("tiny"))))


def test_constrained_outputs_are_valid_batched_and_cached(engine: LLMEngine) -> None:
    schema = GuidedSpec("json", json.dumps(SCHEMA))
    regex = r"[a-z]{3,6}-\d{2}"
    choice = GuidedSpec.choice(["yes", "no", "maybe"])
    ebnf = GuidedSpec("grammar", 'root ::= "(" [0-9] ("+" [0-9])? ")"')
    cases = [
        SamplingParams(temperature=0.0, max_tokens=60, guided=schema),
        SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=60, guided=schema),
        SamplingParams(n=2, temperature=1.0, seed=2, max_tokens=20,
                       guided=GuidedSpec("regex", regex)),
        SamplingParams(temperature=0.8, seed=3, max_tokens=8, guided=choice),
        SamplingParams(temperature=0.0, max_tokens=8, guided=ebnf),
        SamplingParams(temperature=0.0, max_tokens=8),  # unconstrained, in the same batch
    ]  # fmt: skip
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13], [14], [15, 16], [5, 6, 7, 8]]
    before = engine.grammars().compilations
    results = engine.generate(prompts, cases)
    outs = [[o for o in r.outputs] for r in results]
    for o in outs[0] + outs[1]:
        assert o.finish_reason == "stop", o.text
        check_schema(o.text)
    for o in outs[2]:
        assert re.fullmatch(regex, o.text), o.text
    assert outs[3][0].text in ("yes", "no", "maybe")
    assert re.fullmatch(r"\(\d(\+\d)?\)", outs[4][0].text), outs[4][0].text
    assert not re.fullmatch(r"\(\d(\+\d)?\)", outs[5][0].text)  # free text is not valid
    assert len({o.text for o in outs[1]}) > 1  # sampling still varies within the grammar
    # Batched equals alone, and the schema compiled once for all of it.
    (alone,) = engine.generate([prompts[1]], cases[1])
    assert [o.token_ids for o in alone.outputs] == [o.token_ids for o in outs[1]]
    assert engine.grammars().compilations - before == 4


def test_bad_specs_are_refused_at_admission(engine: LLMEngine) -> None:
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request("bad", [5], SamplingParams(guided=GuidedSpec("json", "{not json")))
    assert err.value.param == "response_format"
    with pytest.raises(InvalidRequestError):
        engine.add_request("bad2", [5], SamplingParams(guided=GuidedSpec("regex", "(unclosed")))
