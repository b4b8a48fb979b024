"""The llama-bpe (Llama 3) and qwen2 pre-tokenizers of GGUF files, against transformers.

The vocabulary is byte-level BPE trained here with each model's own split pattern
(tiktoken-style ranks, the way both vocabularies were made), plus one word whose token no
merge sequence reaches. From the same ranks, the references are what transformers builds
for these models:

- Llama 3: ``TikTokenConverter`` (how Meta's tiktoken file became its tokenizer.json:
  split regex, byte level, ``ignore_merges``), with BOS prepended as Llama 3's
  post-processor does;
- Qwen2: ``Qwen2Tokenizer`` (NFC, one digit per piece, byte-level BPE).

The GGUF files hold the tokens and merges as llama.cpp's converter stores them, and
``tokenizer.ggml.pre`` names the pre-tokenizer. A second check runs the split alone through
Python's ``regex`` module with llama.cpp's own spelling of each pattern (case-explicit
contractions): a second regex engine besides tokenizers' Oniguruma.
"""

from __future__ import annotations

import unicodedata
from pathlib import Path

import pytest
import regex
from tokenizers import Tokenizer as HFTokenizer

from pagefleet.testing.gguf_writer import (
    byte_level_alphabet,
    train_byte_bpe,
    write_tokenizer_gguf,
)
from pagefleet.tokenizer import Tokenizer

# llama.cpp's spelling (llama-vocab.cpp), not the one pagefleet or transformers use.
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
LLAMA_CPP_SPLIT = {
    "llama-bpe": _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "qwen2": _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}
SPECIALS = {
    "llama-bpe": [
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eot_id|>",
    ],
    "qwen2": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
}
SPECIAL_TEXT = {
    "llama-bpe": "<|start_header_id|>user<|end_header_id|>\n\nhi there<|eot_id|> after",
    "qwen2": "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
}
# A word with its own token that no merge builds (splits of it are not in the vocabulary):
# tiktoken, and so Llama 3's ignore_merges, still returns it whole.
UNREACHABLE = " zqxjv"
TEXTS = [
    "Hello world! It's 2024-12-01; the price is $1,234,567.89 (or 3.14159).",
    "I'm sure you're right, they'll say it's OK, WE'VE won, she'D go, y'all, O'Neil's",
    "1 12 123 1234 12345 123456 1234567 0.5 10000000000 x2y33z444",
    "café naïve Zürich 日本語のテキスト 한국어 Ελληνικά русский текст",
    "emoji 🚀👍🏽 and 👨\u200d👩\u200d👧 family, ½ ² ٣ Ⅻ",
    "cafe\u0301 or caf\u00e9, A\u030a or \u00c5",
    "tabs\tand  two   three    four spaces, trailing   ",
    "   leading spaces",
    "line one\nline two\n\n\nline five\r\nwindows\r\n\r\nend\n",
    "  \n  \n\t\n",
    "code: def f(x):\n    return x**2  # square\n\n",
    "punctuation!!! ...?? --- ''quoted'' \"double\" `back` \u00a0nbsp",
    "mixed中文123abc456",
    UNREACHABLE + UNREACHABLE,
]
CORPUS = (
    "The capital of France is Paris. It's the largest city, and they've said it's "
    "beautiful in 2024 and in 1999; 100 200 300 1234 56789. I'm here, you're there.\n\n"
    "def main():\n    return 42\n\n" + " ".join(t for t in TEXTS if UNREACHABLE not in t)
)


def _merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """Every split of every token into two tokens, ordered by the joined token's rank: the
    merges Hugging Face's tiktoken conversion writes (and llama.cpp copies)."""
    found = []
    for token, rank in ranks.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ranks and right in ranks:
                found.append((rank, ranks[left], ranks[right], left, right))
    return [(left, right) for *_, left, right in sorted(found)]


def _spell(piece: bytes) -> str:
    alphabet = byte_level_alphabet()
    return "".join(alphabet[b] for b in piece)


def _ranks(pre: str) -> dict[bytes, int]:
    ranks = train_byte_bpe(CORPUS, LLAMA_CPP_SPLIT[pre], num_merges=400)
    word = UNREACHABLE.encode()
    assert not any(word[:cut] in ranks and word[cut:] in ranks for cut in range(1, len(word)))
    ranks[word] = len(ranks)
    return ranks


def _reference(pre: str, ranks: dict[bytes, int]):
    """What transformers builds for this model kind from the same ranks."""
    import transformers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    specials = SPECIALS[pre]
    if pre == "llama-bpe":

        class FromRanks(TikTokenConverter):
            """The tiktoken file's contents, without the file (and without tiktoken)."""

            def load_tiktoken_bpe(self, tiktoken_url: str) -> dict[bytes, int]:
                return ranks

        tok = FromRanks(vocab_file="ranks", extra_special_tokens=specials).converted()
        return lambda text: [len(ranks), *tok.encode(text).ids]  # BOS, Llama 3's template
    vocab = {_spell(t): r for t, r in ranks.items()}
    vocab.update({s: len(ranks) + i for i, s in enumerate(specials)})
    merges = [(_spell(a), _spell(b)) for a, b in _merges(ranks)]
    qwen = transformers.Qwen2Tokenizer(vocab=vocab, merges=merges)
    qwen.add_special_tokens({"additional_special_tokens": specials[1:]})
    return lambda text: qwen(text).input_ids


@pytest.fixture(scope="module", params=["llama-bpe", "qwen2"])
def case(request, tmp_path_factory) -> tuple[str, Tokenizer, object, dict[bytes, int]]:
    pre = request.param
    ranks = _ranks(pre)
    tokens = [_spell(t) for t, _ in sorted(ranks.items(), key=lambda kv: kv[1])]
    specials = SPECIALS[pre]
    path = Path(tmp_path_factory.mktemp(pre)) / "tok.gguf"
    write_tokenizer_gguf(
        path,
        [*tokens, *specials],
        [1] * len(tokens) + [3] * len(specials),
        [f"{_spell(a)} {_spell(b)}" for a, b in _merges(ranks)],
        pre=pre,
        bos=specials[0],
        eos=specials[-1] if pre == "qwen2" else "<|eot_id|>",
        add_bos=pre == "llama-bpe",
        architecture="llama" if pre == "llama-bpe" else "qwen2",
    )
    return pre, Tokenizer.from_dir(path), _reference(pre, ranks), ranks


def test_ids_match_transformers(case) -> None:
    pre, ours, reference, _ = case
    for text in [*TEXTS, SPECIAL_TEXT[pre]]:
        ids = ours.encode(text)
        assert ids == reference(text), f"{pre}: {text!r}"
        expected = unicodedata.normalize("NFC", text) if pre == "qwen2" else text
        if text == SPECIAL_TEXT[pre]:
            assert ours.decode(ids, skip_special_tokens=False).endswith(expected)
        else:
            assert ours.decode(ids) == expected, f"{pre}: {text!r}"


def test_split_matches_llama_cpp_regex(case) -> None:
    """The pieces BPE sees are the ones llama.cpp's pattern cuts (Python's regex engine)."""
    pre, ours, _, _ = case
    backend: HFTokenizer = ours._tok
    for text in TEXTS:
        if pre == "qwen2":
            text = unicodedata.normalize("NFC", text)
        pieces = [p for p, _ in backend.pre_tokenizer.pre_tokenize_str(text)]
        expected = [_spell(p.encode()) for p in regex.findall(LLAMA_CPP_SPLIT[pre], text)]
        assert pieces == expected, f"{pre}: {text!r}"


def test_the_cases_that_tell_the_pre_tokenizers_apart(case) -> None:
    """Facts the comparison above depends on, so it cannot pass by both sides agreeing on
    something trivial: digit grouping, the unreachable word, NFC, specials kept whole."""
    pre, ours, _, ranks = case
    digits = [ours.convert_ids_to_tokens([i])[0] for i in ours.encode("1234567", False)]
    unreachable = ours.encode(UNREACHABLE, add_special_tokens=False)
    if pre == "llama-bpe":
        assert ours.encode("hi")[0] == ours.token_to_id("<|begin_of_text|>")
        assert all(len(d) <= 3 for d in digits) and "".join(digits) == "1234567"
        assert b"123" in ranks and digits[0] == "123"  # trained merges do group digits
        assert unreachable == [ranks[UNREACHABLE.encode()]]
    else:
        assert ours.encode("hi") == ours.encode("hi", add_special_tokens=False)
        assert digits == list("1234567")
        assert len(unreachable) == len(UNREACHABLE)  # merges only: byte by byte
        assert ours.encode("cafe\u0301", False) == ours.encode("caf\u00e9", False)
    special = SPECIALS[pre][1]
    assert ours.encode(f"a{special}b", False)[1] == ours.token_to_id(special)
    # The tokens are real BPE output, not bytes: common words are one token each.
    assert len(ours.encode(" the capital", False)) == 2
