"""Write small GGUF files the way llama.cpp's converter does, for tests of the GGUF loader.

``write_llama_gguf`` takes a Hugging Face-layout state dict (float32) and a config.json
dict, renames tensors to llama.cpp's names, permutes the Q/K rows the way the converter
does for Llama-architecture models, and stores each 2-D weight in the requested type
(1-D norms stay F32, as llama.cpp keeps them). Types the ``gguf`` package cannot quantize
(the K-quants) get seeded random blocks instead, with every byte masked so the fp16 scales
inside them stay finite; the caller then compares against what was stored, which
``write_llama_gguf`` returns dequantized in the file's own (permuted) layout.
"""

from __future__ import annotations

import itertools
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

BYTE_MASK = 0x3B  # keeps any fp16 inside a block below 2.0: exponent bits 0x7C -> 0x38

CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_HF_TO_GGUF_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def permute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter order for Q/K rows: each head's two halves interleaved."""
    return (
        w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def byte_level_alphabet() -> list[str]:
    """GPT-2's printable stand-in for each of the 256 bytes, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    out: dict[int, str] = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + extra)
            extra += 1
    return [out[b] for b in range(256)]


def gpt2_vocab(words: list[str]) -> tuple[list[str], list[int], list[str]]:
    """A small byte-level BPE vocabulary: three ChatML specials, the 256 byte symbols, and
    merges that spell each of ``words`` (with its leading space, as "Ġword") letter by
    letter. Returns (tokens, token types, merges)."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = [*specials, *byte_level_alphabet()]
    merges: list[str] = []
    known = set(tokens)
    for word in words:
        piece = "Ġ" + word
        current = piece[0]
        for ch in piece[1:]:
            merged = current + ch
            if merged not in known:
                merges.append(f"{current} {ch}")
                tokens.append(merged)
                known.add(merged)
            current = merged
    types = [3] * len(specials) + [1] * (len(tokens) - len(specials))
    return tokens, types, merges


def spm_vocab(words: list[str]) -> tuple[list[str], list[int], list[float]]:
    """A small SentencePiece-style vocabulary: <unk>, <s>, </s>, the 256 byte tokens, the
    letters of ``words`` and every prefix of "▁word" (longer pieces score higher, as
    later BPE merges do). Returns (tokens, token types, scores)."""
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    types = [2, 3, 3, *([6] * 256)]
    scores = [0.0] * len(tokens)
    letters = sorted({c for w in words for c in w} | {"\u2581"})
    for c in letters:
        tokens.append(c)
        types.append(1)
        scores.append(-1000.0)
    for word in words:
        piece = "\u2581" + word
        for end in range(2, len(piece) + 1):
            if piece[:end] not in tokens:
                tokens.append(piece[:end])
                types.append(1)
                scores.append(-float(len(tokens)) / end)
    return tokens, types, scores


def write_llama_gguf(
    path: str | Path,
    config: dict[str, Any],
    state: dict[str, np.ndarray],
    qtype_name: str,
    tokens: list[str],
    token_types: list[int],
    merges: list[str],
    *,
    seed: int = 0,
    chat_template: str = CHATML_TEMPLATE,
    architecture: str = "llama",
    extra_fields: dict[str, Any] | None = None,
    spm_scores: list[float] | None = None,
) -> dict[str, np.ndarray]:
    """Write ``state`` (HF names, float32) as a GGUF file; return what each HF-named
    tensor holds in the file, dequantized, in the file's layout (Q/K rows permuted).

    With ``spm_scores`` the vocabulary is SentencePiece-style (``tokenizer.ggml.model`` =
    llama, scores instead of merges, BOS added); otherwise GPT-2 byte-level BPE."""
    import gguf
    from gguf.quants import dequantize, quantize

    qtype = gguf.GGMLQuantizationType[qtype_name]
    n_heads = int(config["num_attention_heads"])
    n_kv = int(config.get("num_key_value_heads") or n_heads)
    writer = gguf.GGUFWriter(str(path), architecture)
    a = architecture
    writer.add_uint32(f"{a}.block_count", int(config["num_hidden_layers"]))
    writer.add_uint32(f"{a}.context_length", int(config["max_position_embeddings"]))
    writer.add_uint32(f"{a}.embedding_length", int(config["hidden_size"]))
    writer.add_uint32(f"{a}.feed_forward_length", int(config["intermediate_size"]))
    writer.add_uint32(f"{a}.attention.head_count", n_heads)
    writer.add_uint32(f"{a}.attention.head_count_kv", n_kv)
    writer.add_float32(f"{a}.rope.freq_base", float(config.get("rope_theta", 10000.0)))
    writer.add_float32(
        f"{a}.attention.layer_norm_rms_epsilon", float(config.get("rms_norm_eps", 1e-6))
    )
    writer.add_uint32(f"{a}.vocab_size", int(config["vocab_size"]))
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // n_heads)
    writer.add_uint32(f"{a}.rope.dimension_count", head_dim)
    if spm_scores is None:
        writer.add_string("tokenizer.ggml.model", "gpt2")
        writer.add_string("tokenizer.ggml.pre", "smollm")
        writer.add_array("tokenizer.ggml.merges", merges)
        writer.add_uint32("tokenizer.ggml.bos_token_id", tokens.index("<|im_start|>"))
        writer.add_uint32("tokenizer.ggml.eos_token_id", tokens.index("<|im_end|>"))
        writer.add_bool("tokenizer.ggml.add_bos_token", False)
    else:
        writer.add_string("tokenizer.ggml.model", "llama")
        writer.add_array("tokenizer.ggml.scores", [float(s) for s in spm_scores])
        writer.add_uint32("tokenizer.ggml.unknown_token_id", tokens.index("<unk>"))
        writer.add_uint32("tokenizer.ggml.bos_token_id", tokens.index("<s>"))
        writer.add_uint32("tokenizer.ggml.eos_token_id", tokens.index("</s>"))
        writer.add_bool("tokenizer.ggml.add_bos_token", True)
    writer.add_array("tokenizer.ggml.tokens", tokens)
    writer.add_array("tokenizer.ggml.token_type", token_types)
    writer.add_string("tokenizer.chat_template", chat_template)
    for key, value in (extra_fields or {}).items():
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_uint32(key, int(value))

    rng = np.random.default_rng(seed)
    stored: dict[str, np.ndarray] = {}
    for name, value in state.items():
        value = np.asarray(value, dtype=np.float32)
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        elif name == "lm_head.weight":
            gname = "output.weight"
        else:
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            gname = f"blk.{layer}.{_HF_TO_GGUF_LAYER[rest]}"
        if architecture == "llama" and name.endswith("q_proj.weight"):
            value = permute_rows(value, n_heads)
        elif architecture == "llama" and name.endswith("k_proj.weight"):
            value = permute_rows(value, n_kv)
        if value.ndim == 1 or qtype_name == "F32":
            writer.add_tensor(gname, value)
            stored[name] = value
        elif qtype_name == "F16":
            half = value.astype(np.float16)
            writer.add_tensor(gname, half)
            stored[name] = half.astype(np.float32)
        else:
            try:
                blocks = quantize(value, qtype)
            except NotImplementedError:
                block, size = gguf.GGML_QUANT_SIZES[qtype]
                shape = (value.shape[0], value.shape[1] // block * size)
                blocks = rng.integers(0, 256, size=shape, dtype=np.uint8) & BYTE_MASK
            writer.add_tensor(gname, blocks, raw_dtype=qtype)
            stored[name] = dequantize(blocks, qtype).reshape(value.shape)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return stored


def train_byte_bpe(text: str, split_pattern: str, num_merges: int) -> dict[bytes, int]:
    """tiktoken-style ranks learned from ``text``: the 256 single bytes (ranks 0-255), then
    the most frequent adjacent pair inside the pieces ``split_pattern`` cuts the text into,
    ``num_merges`` times (ties broken by the pair's bytes, so the result is deterministic).
    This is how the vocabularies of Llama 3 and Qwen2 were made, at a toy size."""
    import regex

    words = Counter(
        tuple(bytes([b]) for b in piece.encode("utf-8"))
        for piece in regex.findall(split_pattern, text)
    )
    ranks = {bytes([b]): b for b in range(256)}
    for _ in range(num_merges):
        pairs: Counter[tuple[bytes, bytes]] = Counter()
        for word, count in words.items():
            for pair in itertools.pairwise(word):
                pairs[pair] += count
        if not pairs:
            break
        (left, right), _ = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        ranks.setdefault(left + right, len(ranks))
        merged: Counter[tuple[bytes, ...]] = Counter()
        for word, count in words.items():
            out: list[bytes] = []
            i = 0
            while i < len(word):
                if i + 1 < len(word) and (word[i], word[i + 1]) == (left, right):
                    out.append(left + right)
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            merged[tuple(out)] += count
        words = merged
    return ranks


def write_tokenizer_gguf(
    path: str | Path,
    tokens: list[str],
    token_types: list[int],
    merges: list[str],
    *,
    pre: str,
    bos: str | None,
    eos: str,
    add_bos: bool,
    architecture: str = "llama",
    chat_template: str | None = None,
) -> None:
    """A GGUF file holding only a byte-level BPE tokenizer (``tokenizer.ggml.model`` gpt2)
    with pre-tokenizer ``pre``, as llama.cpp's converter writes it for Llama 3 or Qwen2: no
    tensors, so a tokenizer test needs no model."""
    import gguf

    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_uint32(f"{architecture}.context_length", 4096)
    writer.add_string("tokenizer.ggml.model", "gpt2")
    writer.add_string("tokenizer.ggml.pre", pre)
    writer.add_array("tokenizer.ggml.tokens", tokens)
    writer.add_array("tokenizer.ggml.token_type", token_types)
    writer.add_array("tokenizer.ggml.merges", merges)
    if bos is not None:
        writer.add_uint32("tokenizer.ggml.bos_token_id", tokens.index(bos))
    writer.add_uint32("tokenizer.ggml.eos_token_id", tokens.index(eos))
    writer.add_bool("tokenizer.ggml.add_bos_token", add_bos)
    if chat_template is not None:
        writer.add_string("tokenizer.chat_template", chat_template)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
