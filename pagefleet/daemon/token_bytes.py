"""A token's own bytes, for the ``bytes`` of chat completions logprobs.

A token's text is U+FFFD when the token is part of a multi-byte character (a byte-level
BPE piece of a CJK character or an emoji, a SentencePiece ``<0xNN>`` byte token). OpenAI
and vLLM give such a token's raw bytes, so that a client joining the ``bytes`` of the
tokens gets the text back; the UTF-8 of U+FFFD would give replacement characters instead.

The raw bytes come from the token's vocabulary piece: byte-level BPE spells every byte as
one character of a fixed 256-character alphabet (GPT-2's), SentencePiece byte fallback
spells a byte ``<0xNN>``. A token whose text is whole is its own UTF-8, as before.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

# (token id, token text) -> the token's bytes
TokenBytesFn = Callable[[int, str], list[int]]

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_alphabet() -> dict[str, int]:
    """Character -> byte of byte-level BPE: bytes that print as themselves keep their
    character, the other 68 (controls, space, a few Latin-1 ones) take 256, 257, ... in
    byte order."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("\u00a1"), ord("\u00ac") + 1),
        *range(ord("\u00ae"), ord("\u00ff") + 1),
    ]
    alphabet = {chr(b): b for b in printable}
    shifted = (b for b in range(256) if b not in alphabet.values())
    for i, b in enumerate(shifted):
        alphabet[chr(256 + i)] = b
    return alphabet


_BYTE_LEVEL = _byte_level_alphabet()


def piece_bytes(piece: str) -> bytes | None:
    """The bytes a vocabulary piece stands for; None when it is neither a byte-level BPE
    piece nor a SentencePiece byte token."""
    m = _BYTE_TOKEN.fullmatch(piece)
    if m is not None:
        return bytes([int(m.group(1), 16)])
    if piece and all(c in _BYTE_LEVEL for c in piece):
        return bytes(_BYTE_LEVEL[c] for c in piece)
    return None


def utf8_bytes(token_id: int, text: str) -> list[int]:
    """The bytes of the token's text (right for every token that is a whole text)."""
    return list(text.encode("utf-8"))


def token_bytes_of(tokenizer: Any) -> TokenBytesFn:
    """``(token id, text) -> bytes`` for ``tokenizer``: a token whose text is not whole
    (it holds U+FFFD) gets its piece's bytes when its tokenizer lists its pieces."""
    convert = getattr(tokenizer, "convert_ids_to_tokens", None)
    if convert is None:
        return utf8_bytes

    def token_bytes(token_id: int, text: str) -> list[int]:
        if "\ufffd" not in text:
            return list(text.encode("utf-8"))
        raw = piece_bytes(convert([token_id])[0] or "")
        # A piece of another kind (a real U+FFFD in a SentencePiece vocabulary): its text.
        return list(text.encode("utf-8") if raw is None else raw)

    return token_bytes
