"""A GGUF file's tokenizer and chat template as a ``pagefleet.tokenizer.Tokenizer``, torch-free.

llama.cpp stores the vocabulary in the file's metadata (``tokenizer.ggml.*``): the token
strings, their types (normal, control, user-defined, byte, ...), BPE merges for GPT-2-style
vocabularies or scores for SentencePiece-style ones, the special token ids, whether BOS is
prepended, and which pre-tokenizer (``tokenizer.ggml.pre``) splits text before BPE. This
module rebuilds the equivalent ``tokenizers.Tokenizer`` from that, so the daemon and the
gateway tokenize a GGUF model without transformers or torch (``gguf`` needs only numpy).

Invariant: ids agree with the model's original Hugging Face tokenizer for the vocabulary
kinds handled here (``gpt2`` and ``llama``), and an unknown kind or pre-tokenizer is an
error naming it, never a silently different tokenization.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as _HFTokenizer

from pagefleet.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# llama.cpp token types (llama_token_type).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

# The split patterns of the pre-tokenizers llama.cpp names in tokenizer.ggml.pre.
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# GPT-2's own split (ByteLevel's built-in regex), optionally after single-digit splitting
# (StarCoder-derived vocabularies such as SmolLM's never merge digits).
_GPT2_PRE = ("default", "gpt2", "gpt-2", "olmo", "mpt")
_DIGITS_THEN_GPT2_PRE = ("smollm", "starcoder", "refact", "codeshell")
_SPLIT_PRE = {
    "llama3": _LLAMA3_PATTERN,
    "llama-v3": _LLAMA3_PATTERN,
    "llama-bpe": _LLAMA3_PATTERN,
    "smaug-bpe": _LLAMA3_PATTERN,
    "qwen2": _QWEN2_PATTERN,
}
SUPPORTED_PRE_TOKENIZERS = (*_GPT2_PRE, *_DIGITS_THEN_GPT2_PRE, *_SPLIT_PRE)
# Llama 3's vocabulary comes from tiktoken, which takes a piece that is itself a token whole
# before trying merges; its tokenizer.json says so with ``ignore_merges`` (llama.cpp too).
# Without it a token no merge sequence reaches is spelled in smaller pieces.
_IGNORE_MERGES_PRE = ("llama3", "llama-v3", "llama-bpe")
# Qwen2's tokenizer NFC-normalizes text first: "e" + combining acute is the token for "é".
_NFC_PRE = ("qwen2",)
SUPPORTED_VOCABULARIES = ("gpt2", "llama")


def find_gguf_file(path: str | Path) -> Path | None:
    """``path`` itself when it is a ``.gguf`` file; the one ``.gguf`` inside a directory
    that has no ``config.json`` (a Hugging Face directory wins); else None.

    Raises ValueError for a directory with several GGUF files: which one is meant is the
    caller's choice, never a guess.
    """
    path = Path(path)
    if path.is_file():
        return path if path.suffix == ".gguf" else None
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    found = sorted(path.glob("*.gguf"))
    if len(found) > 1:
        names = ", ".join(f.name for f in found)
        raise ValueError(
            f"{path} holds several GGUF files ({names}): pass the path of the one to serve"
        )
    return found[0] if found else None


def read_fields(reader: Any) -> dict[str, Any]:
    """Every metadata value of a ``gguf.GGUFReader`` as plain Python (str, int, list, ...)."""
    return {name: field.contents() for name, field in reader.fields.items()}


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _GPT2_PRE:
        return byte_level
    if pre in _DIGITS_THEN_GPT2_PRE:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in _SPLIT_PRE:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_SPLIT_PRE[pre]), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    raise ValueError(
        f"GGUF pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not supported: pagefleet "
        f"implements {', '.join(SUPPORTED_PRE_TOKENIZERS)}; serve the model's Hugging Face "
        "directory (with tokenizer.json) instead"
    )


def _gpt2_model(tokens: list[str], merges: list[str], ignore_merges: bool) -> models.BPE:
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    return models.BPE(
        vocab=vocab,
        merges=pairs,
        fuse_unk=False,
        byte_fallback=False,
        ignore_merges=ignore_merges,
    )


def _spm_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece's rule (merge the adjacent pair whose joined
    piece scores highest): every split of every normal piece into two vocabulary pieces,
    ranked by the joined piece's score."""
    vocab = {t: i for i, t in enumerate(tokens)}
    found: list[tuple[float, int, int, int, tuple[str, str]]] = []
    for piece, score, kind in zip(tokens, scores, types, strict=True):
        if kind != _NORMAL or len(piece) < 2:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                found.append((-score, vocab[piece], vocab[left], vocab[right], (left, right)))
    found.sort()
    return [pair for *_, pair in found]


def _spm_model(
    tokens: list[str], scores: list[float], types: list[int], unk: str | None
) -> models.BPE:
    vocab = {t: i for i, t in enumerate(tokens)}
    return models.BPE(
        vocab=vocab,
        merges=_spm_merges(tokens, scores, types),
        unk_token=unk,
        fuse_unk=True,
        byte_fallback=True,
    )


def _token(tokens: list[str], fields: dict[str, Any], key: str) -> tuple[int | None, str | None]:
    tid = fields.get(f"tokenizer.ggml.{key}_token_id")
    if tid is None or not 0 <= int(tid) < len(tokens):
        return None, None
    return int(tid), tokens[int(tid)]


def build_tokenizer(fields: dict[str, Any]) -> Tokenizer:
    """The ``Tokenizer`` described by GGUF metadata ``fields`` (see ``read_fields``).

    Raises ValueError naming the vocabulary kind or pre-tokenizer when it is not one this
    module rebuilds exactly.
    """
    kind = fields.get("tokenizer.ggml.model")
    tokens = list(fields.get("tokenizer.ggml.tokens") or [])
    if not tokens:
        raise ValueError("the GGUF file has no vocabulary (tokenizer.ggml.tokens is missing)")
    types = list(fields.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens))
    bos_id, bos = _token(tokens, fields, "bos")
    eos_id, eos = _token(tokens, fields, "eos")
    _, unk = _token(tokens, fields, "unknown")
    _, pad = _token(tokens, fields, "padding")

    if kind == "gpt2":
        merges = list(fields.get("tokenizer.ggml.merges") or [])
        if not merges:
            raise ValueError("GGUF gpt2 vocabulary without tokenizer.ggml.merges: cannot rebuild")
        pre = str(fields.get("tokenizer.ggml.pre", "default"))
        tok = _HFTokenizer(_gpt2_model(tokens, merges, ignore_merges=pre in _IGNORE_MERGES_PRE))
        tok.pre_tokenizer = _pre_tokenizer(pre)
        if pre in _NFC_PRE:
            tok.normalizer = normalizers.NFC()
        tok.decoder = decoders.ByteLevel()
        add_bos_default = False
    elif kind == "llama":
        scores = [float(s) for s in fields.get("tokenizer.ggml.scores") or [0.0] * len(tokens)]
        tok = _HFTokenizer(_spm_model(tokens, scores, types, unk))
        prefix = bool(fields.get("tokenizer.ggml.add_space_prefix", True))
        # SentencePiece marks word starts with U+2581; the first word gets one too when the
        # model was trained with add_dummy_prefix.
        tok.normalizer = normalizers.Replace(" ", "\u2581")
        tok.pre_tokenizer = None
        steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
        if prefix:
            tok.normalizer = normalizers.Sequence(
                [normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")]
            )
            steps.append(decoders.Strip(" ", 1, 0))
        tok.decoder = decoders.Sequence(steps)
        add_bos_default = True
    else:
        raise ValueError(
            f"GGUF vocabulary kind {kind!r} (tokenizer.ggml.model) is not supported: pagefleet "
            f"rebuilds {', '.join(SUPPORTED_VOCABULARIES)}"
        )

    # Control tokens (chat markers, BOS/EOS) are matched whole in text and skipped when
    # decoding; user-defined ones are matched whole but kept.
    added = [
        AddedToken(t, special=(k in (_CONTROL, _UNKNOWN)), normalized=False)
        for t, k in zip(tokens, types, strict=True)
        if k in (_CONTROL, _USER_DEFINED, _UNKNOWN)
    ]
    tok.add_tokens(added)

    add_bos = bool(fields.get("tokenizer.ggml.add_bos_token", add_bos_default))
    add_eos = bool(fields.get("tokenizer.ggml.add_eos_token", False))
    if (add_bos and bos is not None) or (add_eos and eos is not None):
        single = ([f"{bos}:0"] if add_bos and bos else []) + ["$A:0"]
        single += [f"{eos}:0"] if add_eos and eos else []
        specials = [(t, i) for t, i, on in ((bos, bos_id, add_bos), (eos, eos_id, add_eos)) if on]
        tok.post_processor = processors.TemplateProcessing(
            single=single, pair=[*single, "$B:1"], special_tokens=specials
        )

    eos_ids = [eos_id] if eos_id is not None else []
    eot_id, _ = _token(tokens, fields, "eot")
    if eot_id is not None and eot_id not in eos_ids:
        eos_ids.append(eot_id)
    arch = fields.get("general.architecture")
    ctx = fields.get(f"{arch}.context_length") if arch else None
    config: dict[str, Any] = {
        "bos_token": bos,
        "eos_token": eos,
        "unk_token": unk,
        "pad_token": pad,
        "model_max_length": int(ctx) if ctx else None,
        "clean_up_tokenization_spaces": False,
        "add_bos_token": add_bos,
    }
    chat_template = fields.get("tokenizer.chat_template")
    return Tokenizer(tok, config, eos_ids, str(chat_template) if chat_template else None)


def tokenizer_from_gguf(path: str | Path) -> Tokenizer:
    """The tokenizer and chat template stored in the GGUF file ``path``."""
    import gguf

    fields = read_fields(gguf.GGUFReader(str(path)))
    return build_tokenizer(fields)
