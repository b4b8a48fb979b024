"""GGUF checkpoints (llama.cpp's format): config, tokenizer and dequantized weights.

A GGUF file holds everything a Hugging Face directory does, in one file: hyper-parameters
under ``{arch}.*`` keys, the vocabulary under ``tokenizer.*`` and the tensors, often
block-quantized. Loading turns the metadata into a config.json-shaped dict (so
``ModelConfig.from_dict`` validates it like any other checkpoint), renames llama.cpp's
tensors to the Hugging Face names ``load_weights`` understands, dequantizes each one with
the ``gguf`` package, and undoes the row permutation llama.cpp's converter applies to the
Q and K projections of Llama-architecture models (ggml's rope rotates adjacent pairs; the
Hugging Face layout, which our model uses, rotates halves).

Invariant: every tensor arrives in the Hugging Face layout, exactly the values
``gguf.quants.dequantize`` gives for the stored blocks; an unsupported architecture or
quantization type raises ValueError naming it before anything is allocated.
"""

from __future__ import annotations

import os
import re
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

# GGUF general.architecture -> (HF architecture, HF model_type, Q/K rows permuted by
# llama.cpp's converter). Qwen models use NeoX-style rope there, so their rows are kept.
GGUF_ARCHITECTURES: dict[str, tuple[str, str, bool]] = {
    "llama": ("LlamaForCausalLM", "llama", True),
    "qwen2": ("Qwen2ForCausalLM", "qwen2", False),
    "qwen3": ("Qwen3ForCausalLM", "qwen3", False),
}

# What the gguf package dequantizes and we have exercised: plain floats, the classic
# block quants and the K-quants.
SUPPORTED_TYPES = (
    "F32",
    "F16",
    "BF16",
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q8_0",
    "Q2_K",
    "Q3_K",
    "Q4_K",
    "Q5_K",
    "Q6_K",
)

# llama.cpp tensor name -> Hugging Face name (per layer: the part after "blk.N.").
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
# Rope tables llama.cpp precomputes; our model builds them from the config.
_SKIPPED = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")

_FILE_TYPE_DTYPES = {0: "float32", 1: "float16", 32: "bfloat16"}


def open_gguf(path: str | Path) -> Any:  # -> gguf.GGUFReader
    """A memory-mapped reader of the GGUF file ``path``.

    Raises PermissionError or ValueError naming the file: the gguf package's own errors
    ("Sorry, file appears to be version 544603 which we cannot handle"; numpy's "cannot
    reshape array" for a truncated file, whose tensor slices come out short) name neither
    the file nor what to do."""
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except PermissionError:
        raise PermissionError(
            f"cannot read GGUF file {path}: permission denied for this process (uid "
            f"{os.getuid()}); make the model files readable by the daemon's user"
        ) from None
    except (ValueError, OSError, IndexError, KeyError, TypeError, struct.error) as exc:
        raise ValueError(
            f"{path} is not a GGUF file pagefleet can read ({exc}): it is truncated or "
            "damaged, or written in a newer GGUF version; download it again"
        ) from None


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face parameter name of a llama.cpp tensor name; None for tensors the
    model does not load (precomputed rope tables)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    if gguf_name in _SKIPPED:
        return None
    m = _LAYER_RE.match(gguf_name)
    if m is None or m.group(2) not in _LAYER_NAMES:
        raise ValueError(
            f"GGUF tensor {gguf_name!r} has no counterpart in pagefleet's Llama-family "
            "model: the file is of an architecture variant pagefleet does not serve"
        )
    layer, part, kind = m.groups()
    return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"


def config_dict(fields: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    """A config.json-shaped dict from GGUF metadata ``fields`` (see
    ``pagefleet.gguf_tokenizer.read_fields``); ``ModelConfig.from_dict`` validates it."""
    arch = str(fields.get("general.architecture", ""))
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported: pagefleet loads "
            f"{', '.join(GGUF_ARCHITECTURES)} GGUF files"
        )
    hf_arch, model_type, _ = GGUF_ARCHITECTURES[arch]

    def get(key: str, default: Any = None) -> Any:
        return fields.get(f"{arch}.{key}", default)

    missing = [
        k
        for k in ("embedding_length", "block_count", "attention.head_count", "feed_forward_length")
        if get(k) is None
    ]
    if missing:
        raise ValueError(f"GGUF metadata lacks {[f'{arch}.{k}' for k in missing]}")
    shape_keys = (
        "embedding_length",
        "block_count",
        "attention.head_count",
        "feed_forward_length",
        "attention.head_count_kv",
        "attention.key_length",
    )
    for key in shape_keys:
        value = get(key)
        # A 0 (or a per-layer array, as some converters write for head counts) used to
        # end in "integer division or modulo by zero" or an int() TypeError, named nowhere.
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ValueError(
                f"GGUF metadata {arch}.{key} is {value!r}; pagefleet needs a positive integer "
                "(one value for all layers): the file is damaged or from an unsupported "
                "variant of the architecture"
            )
    hidden = int(get("embedding_length"))
    n_heads = int(get("attention.head_count"))
    head_dim = int(get("attention.key_length") or hidden // n_heads)
    rot_dim = get("rope.dimension_count")
    if rot_dim is not None and int(rot_dim) != head_dim:
        raise ValueError(
            f"GGUF model rotates {rot_dim} of {head_dim} head dimensions (partial rope): "
            "pagefleet's Llama-family model rotates all of them"
        )
    if "rope_freqs.weight" in tensor_names:
        raise ValueError(
            "GGUF file carries rope_freqs (precomputed Llama 3.1 rope scaling factors) without "
            "the parameters they came from: serve the Hugging Face directory of this model"
        )
    tokens = fields.get("tokenizer.ggml.tokens") or []
    vocab = int(get("vocab_size") or len(tokens))
    cfg: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(get("attention.head_count_kv") or n_heads),
        "head_dim": head_dim,
        "max_position_embeddings": int(get("context_length") or 2048),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "mlp_bias": "blk.0.ffn_up.bias" in tensor_names,
        "torch_dtype": _FILE_TYPE_DTYPES.get(int(fields.get("general.file_type", -1)), "bfloat16"),
    }
    scaling = str(get("rope.scaling.type", "none"))
    if scaling == "linear":
        # Raw values: ModelConfig.from_dict names a missing or mistyped one (float(None),
        # the old conversion here, failed with a TypeError that named nothing).
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": get("rope.scaling.factor")}
    elif scaling == "yarn":
        cfg["rope_scaling"] = {
            "rope_type": "yarn",
            "factor": get("rope.scaling.factor"),
            "original_max_position_embeddings": get("rope.scaling.original_context_length"),
        }
    elif scaling != "none":
        raise ValueError(
            f"GGUF rope scaling {scaling!r} is not supported: pagefleet reads none, linear, yarn"
        )
    for key in ("bos", "eos", "padding"):
        tid = fields.get(f"tokenizer.ggml.{key}_token_id")
        if tid is not None:
            cfg["pad_token_id" if key == "padding" else f"{key}_token_id"] = int(tid)
    return cfg


def check_tensor_types(reader: Any) -> None:
    """Raise ValueError naming the first tensor whose type pagefleet cannot dequantize."""
    for t in reader.tensors:
        if t.tensor_type.name not in SUPPORTED_TYPES:
            raise ValueError(
                f"GGUF tensor {t.name!r} is stored as {t.tensor_type.name}, which pagefleet "
                f"does not dequantize (supported: {', '.join(SUPPORTED_TYPES)}); convert the "
                "file to one of those types with llama.cpp's llama-quantize"
            )


def unpermute_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row order: within each head, ggml stores the rotated pairs
    interleaved (row 2i, 2i+1) where Hugging Face keeps halves (row i, i + d/2)."""
    rows = w.shape[0]
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def dequantize(tensor: Any) -> np.ndarray:
    """The float values of one ``gguf.ReaderTensor`` in numpy row-major order (GGUF lists
    dimensions fastest-first, so the shape is reversed)."""
    from gguf.quants import dequantize as gguf_dequantize

    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    name = tensor.tensor_type.name
    if name in ("F32", "F16"):
        return np.asarray(tensor.data).reshape(shape)
    return gguf_dequantize(tensor.data, tensor.tensor_type).reshape(shape)


def iter_gguf_tensors(
    reader: Any, config: dict[str, Any], dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every (Hugging Face name, tensor in ``dtype``) of the file, dequantized one by one."""
    permuted = GGUF_ARCHITECTURES[str(reader_arch(reader))][2]
    n_heads = int(config["num_attention_heads"])
    n_kv = int(config["num_key_value_heads"])
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None:
            continue
        array = dequantize(t)
        if not array.flags.writeable or not array.flags.c_contiguous:
            array = np.array(array, order="C")  # F32/F16 data is the read-only file mapping
        value = torch.from_numpy(array)
        if permuted and ".self_attn.q_proj." in name:
            value = unpermute_rows(value, n_heads)
        elif permuted and ".self_attn.k_proj." in name:
            value = unpermute_rows(value, n_kv)
        yield name, value.to(dtype)


def reader_arch(reader: Any) -> str:
    return str(reader.fields["general.architecture"].contents())
