"""The text of the token that ends a sequence (a stop token id, EOS with
``skip_special_tokens=False``): left out of the output, unless
``include_stop_str_in_output`` asks for it, as vLLM does; the same whether the engine
decodes or the daemon's HTTP process does (text_outputs.py)."""

from __future__ import annotations

import pytest

from pagefleet.daemon.text_outputs import RequestText, engine_params
from pagefleet.engine.sampling_params import SamplingParams

from .conftest import ByteTokenizer

BANG = ord("!")
PROMPT = [72, 105, 32]


def _text_in_the_http_process(engine, params: SamplingParams) -> str:
    """Run ``params`` on an engine that leaves the text to its caller, decode as the daemon
    does, and return the whole text."""
    engine.add_request("r", PROMPT, engine_params(params))
    text = RequestText(ByteTokenizer(), PROMPT, params)
    out = ""
    while engine.has_unfinished():
        for res in engine.step():
            text.fill(res)
            out += "".join(d.new_text for d in res.deltas)
    return out


@pytest.mark.parametrize("include", [False, True])
def test_stop_token_text_follows_include_stop_str_in_output(fake_engine, include) -> None:
    """With include_stop_str_in_output the stop token's text was still dropped: a client
    stopping on "!" (as a token id) never saw it, where vLLM returns it."""
    params = SamplingParams(
        temperature=0.0,
        max_tokens=8,
        logit_bias={BANG: 100.0},
        stop_token_ids=[BANG],
        include_stop_str_in_output=include,
    )
    (res,) = fake_engine().generate([PROMPT], params)
    out = res.outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == BANG
    assert out.token_ids == [BANG]
    want = "!" if include else ""
    assert out.text == want
    assert _text_in_the_http_process(fake_engine(), params) == want


@pytest.mark.parametrize("include", [False, True])
def test_eos_text_kept_only_with_special_tokens_and_include(fake_engine, include) -> None:
    """EOS (ByteTokenizer's id 0, decoded as NUL when special tokens are kept) ends the
    output; its text appears only when both ask for it."""
    params = SamplingParams(
        temperature=0.0,
        max_tokens=8,
        logit_bias={0: 100.0},
        skip_special_tokens=False,
        include_stop_str_in_output=include,
    )
    (res,) = fake_engine().generate([PROMPT], params)
    out = res.outputs[0]
    assert out.finish_reason == "stop" and out.token_ids == [0]
    want = "\x00" if include else ""
    assert out.text == want
    assert _text_in_the_http_process(fake_engine(), params) == want
