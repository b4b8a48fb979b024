"""Incremental detokenization: multi-byte characters, stop strings across tokens."""

from __future__ import annotations

import pytest

from pagefleet.engine.detokenizer import IncrementalDetokenizer
from pagefleet.engine.sampling_params import SamplingParams

from .conftest import ByteTokenizer


def _feed(text_tokens: list[int], params: SamplingParams, prompt=(72, 105)):
    detok = IncrementalDetokenizer(ByteTokenizer(), list(prompt), params)
    deltas, stopped = [], None
    for t in text_tokens:
        stopped = detok.add_token(t)
        deltas.append(detok.take_delta(finished=stopped is not None))
        if stopped:
            break
    else:
        deltas.append(detok.take_delta(finished=True))
    return deltas, stopped


def test_multibyte_characters_are_never_split() -> None:
    text = "héllo → 世界 🎉!"
    deltas, _ = _feed(list(text.encode()), SamplingParams())
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    # The 4-byte emoji arrives as one delta, after its last byte.
    assert "🎉" in deltas


def test_incomplete_character_at_the_end_is_flushed_as_replacement() -> None:
    deltas, _ = _feed([104, 105, 0xE4, 0xB8], SamplingParams())
    assert deltas[:4] == ["h", "i", "", ""]
    assert deltas[-1] == "\ufffd"


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_token_boundaries(include) -> None:
    params = SamplingParams(stop=["END", "xyz"], include_stop_str_in_output=include)
    deltas, stopped = _feed(list(b"abcEN") + list(b"Dmore"), params)
    assert stopped == "END"
    assert "".join(deltas) == ("abcEND" if include else "abc")
    # "E" and "EN" could start "END": they were held back, never emitted then retracted.
    assert deltas[:5] == ["a", "b", "c", "", ""]


def test_held_back_prefix_is_released_when_it_cannot_match() -> None:
    deltas, stopped = _feed(list(b"aENx"), SamplingParams(stop=["END"]))
    assert stopped is None
    assert deltas == ["a", "", "", "ENx", ""]


def test_stop_string_inside_a_multibyte_run() -> None:
    deltas, stopped = _feed(list("ab世界cd".encode()), SamplingParams(stop=["界"]))
    assert stopped == "界" and "".join(deltas) == "ab世"


def test_real_tokenizer_deltas_concatenate_to_decode() -> None:
    from pagefleet.engine.loader import resolve_model
    from pagefleet.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(resolve_model("tiny"))
    text = "Ünïcode wörks: naïve café — 東京 ok"
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, tok.encode("Prompt:"), SamplingParams())
    out = ""
    for t in ids:
        detok.add_token(t)
        d = detok.take_delta(False)
        assert "\ufffd" not in d
        out += d
    out += detok.take_delta(True)
    assert out == tok.decode(ids)


def test_stop_strings_are_ignored_when_not_checked() -> None:
    detok = IncrementalDetokenizer(ByteTokenizer(), [], SamplingParams(stop=["a"]))
    assert detok.add_token(ord("a"), check_stop=False) is None
    assert detok.add_token(ord("b")) is None
    assert detok.add_token(ord("a")) == "a"
    assert detok.take_delta(True) == "ab"


def test_detokenize_false_leaves_the_text_to_the_caller(fake_engine) -> None:
    """``detokenize=False`` (the daemon decodes in its HTTP process): the same tokens and
    finish reasons, no text; stop strings, which need the text, are refused."""
    prompts = [[72, 105, 33], [104, 101, 108, 108, 111]]
    on = fake_engine().generate(prompts, SamplingParams(max_tokens=12, seed=1))
    off = fake_engine().generate(prompts, SamplingParams(max_tokens=12, seed=1, detokenize=False))
    for a, b in zip(on, off, strict=True):
        assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
        assert [o.finish_reason for o in a.outputs] == [o.finish_reason for o in b.outputs]
        assert [o.text for o in b.outputs] == [""] * len(b.outputs)
    assert any(o.text for r in on for o in r.outputs)
    with pytest.raises(ValueError, match="detokenize"):
        SamplingParams(stop=["x"], detokenize=False)


def test_a_short_stop_string_in_text_before_the_check_began_does_not_stop() -> None:
    """Each stop string is looked for only where it takes in the new token's text. With one
    window for all (the longest string's), "0" -- sent during min_tokens, never checked --
    matched once checks began, cut the text back under what was streamed and ended the
    output; adding a stop string that never occurs changed the answer."""
    for stops in (["0"], ["0", "zzzz"]):
        params = SamplingParams(stop=stops, min_tokens=2)
        detok = IncrementalDetokenizer(ByteTokenizer(), [72], params)
        sent = ""
        for i, t in enumerate(b"00 pedd"):
            stopped = detok.add_token(t, check_stop=i >= 2)
            sent += detok.take_delta(finished=False)
            assert stopped is None, (stops, i, stopped)
        assert sent == "00 pedd", stops
