"""guided_choice holds the output to the options' exact text, characters beyond the BMP
included (emoji): the grammar literal spelled them as JSON's \\ud83c\\udf89 surrogate
escapes, which xgrammar reads as two separate code points, so the forced output was six
bytes of encoded surrogates (six U+FFFD) instead of the emoji."""

from __future__ import annotations

import json

import pytest

from pagefleet.engine.guided import GrammarBackend
from pagefleet.engine.guided_spec import GuidedSpec
from pagefleet.engine.tiny import ensure_tiny_checkpoint
from pagefleet.tokenizer import Tokenizer


@pytest.mark.parametrize("option", ["party 🎉 time", "𝔘nicode 😀😀", "plain é 東京"])
def test_choice_with_characters_beyond_the_bmp(option: str) -> None:
    tok = Tokenizer.from_dir(ensure_tiny_checkpoint("tiny"))
    backend = GrammarBackend(tok, tok.vocab_size, tok.eos_token_ids)
    spec = GuidedSpec("choice", json.dumps([option, "other"]))
    matcher = backend.matcher(spec)
    for t in tok.encode(option, add_special_tokens=False):
        assert matcher.accept_token(t), (option, t)
    assert matcher.accept_token(tok.eos_token_ids[0])
    assert matcher.is_terminated()
