"""Logprob token strings are each token's part of the text, spaces included.

A SentencePiece decoder strips the space of a text's first word ("▁the" alone decodes to
"the"), so decoding each token by itself lost the space of every word-initial token: the
tokens no longer joined to the text, completions' text_offset drifted and chat's ``bytes``
rebuilt "thecatis". vLLM puts those spaces back; so does ``Tokenizer.token_text``.
"""

from __future__ import annotations

from pagefleet.engine.config import EngineConfig
from pagefleet.engine.engine import LLMEngine
from pagefleet.engine.parts import EngineParts
from pagefleet.engine.sampling_params import SamplingParams
from pagefleet.gguf_tokenizer import build_tokenizer
from pagefleet.testing.gguf_writer import spm_vocab
from pagefleet.tokenizer import Tokenizer

from .conftest import FakeKVRunner

WORDS = ["the", "capital", "of", "france", "is", "paris", "hello", "world", "cat"]


def _spm() -> tuple[Tokenizer, list[int]]:
    tokens, types, scores = spm_vocab(WORDS)
    fields = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
    }
    normal = [i for i, k in enumerate(types) if k == 1]
    return build_tokenizer(fields), normal


def test_token_text_keeps_the_leading_space() -> None:
    tok, _ = _spm()
    (the,) = tok.encode("the", add_special_tokens=False)
    assert tok.decode([the]) == "the"  # decode of a text: its first space is dropped
    assert tok.token_text(the) == " the"
    t = tok.token_to_id("t")  # the piece "t", as inside "cat": no space to restore
    assert t is not None and tok.token_text(t) == tok.decode([t]) == "t"
    byte = tok.token_to_id("<0xE4>")  # a lone byte of a character stays U+FFFD
    assert byte is not None and tok.token_text(byte) == "\ufffd"


def test_engine_logprob_tokens_join_to_the_text() -> None:
    tok, normal = _spm()
    n = tok.vocab_size
    config = EngineConfig(block_size=4, num_gpu_blocks=64, max_model_len=256)
    parts = EngineParts(FakeKVRunner(64, 4, n, (2,)), tok, (2,), n, 256, 64)
    engine = LLMEngine(config, None, parts=parts)
    # Only whole word pieces (no byte tokens, no specials): every token's text is whole.
    params = SamplingParams(
        max_tokens=12, logprobs=2, seed=0, temperature=1.0, logit_bias={i: 100 for i in normal}
    )
    for res in engine.generate([tok.encode("hello world")] * 3, params):
        out = res.outputs[0]
        assert out.logprobs is not None and " " in out.text
        assert "".join(lp.token for lp in out.logprobs) == out.text
