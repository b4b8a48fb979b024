"""Chat logprobs' ``bytes``: a token that is part of a character gets its own raw bytes
(byte-level BPE pieces, SentencePiece byte tokens), so joining them gives the text back."""

from __future__ import annotations

import pytest

from pagefleet.daemon.token_bytes import piece_bytes, token_bytes_of, utf8_bytes
from pagefleet.gguf_tokenizer import build_tokenizer
from pagefleet.testing.gguf_writer import spm_vocab
from pagefleet.tokenizer import Tokenizer

TEXT = "héllo 日本 😀 ok"


def _joined(tok: Tokenizer, ids: list[int]) -> bytes:
    token_bytes = token_bytes_of(tok)
    return b"".join(bytes(token_bytes(i, tok.decode([i], False))) for i in ids)


def test_byte_level_tokens_join_to_the_text(tiny_tokenizer: Tokenizer) -> None:
    ids = tiny_tokenizer.encode(TEXT, add_special_tokens=False)
    texts = [tiny_tokenizer.decode([i], False) for i in ids]
    assert any("\ufffd" in t for t in texts), "no token splits a character: nothing tested"
    assert _joined(tiny_tokenizer, ids) == TEXT.encode()


def test_sentencepiece_byte_tokens_are_their_byte() -> None:
    tokens, types, scores = spm_vocab(["hello", "ok"])
    tok = build_tokenizer({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
                           "tokenizer.ggml.token_type": types, "tokenizer.ggml.scores": scores,
                           "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
                           "tokenizer.ggml.unknown_token_id": 0})  # fmt: skip
    ids = tok.encode("日", add_special_tokens=False)
    pieces = tok.convert_ids_to_tokens(ids)
    assert pieces[-3:] == ["<0xE6>", "<0x97>", "<0xA5>"], pieces
    token_bytes = token_bytes_of(tok)
    assert [token_bytes(i, tok.decode([i], False)) for i in ids[-3:]] == [[0xE6], [0x97], [0xA5]]


@pytest.mark.parametrize(
    ("piece", "raw"),
    [("<0x0A>", b"\n"), ("Ġthe", b" the"), ("æĹ", b"\xe6\x97"), ("ï¿½", "\ufffd".encode()),
     ("\ufffd", None), ("\u2581the", None), ("", None)],
)  # fmt: skip
def test_piece_bytes(piece: str, raw: bytes | None) -> None:
    assert piece_bytes(piece) == raw


def test_a_tokenizer_without_pieces_keeps_the_texts_utf8() -> None:
    assert token_bytes_of(object()) is utf8_bytes
    assert utf8_bytes(3, "\ufffd") == [0xEF, 0xBF, 0xBD]
