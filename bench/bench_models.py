"""Checkpoints the CPU benchmarks share: big enough that compute matters, small enough for 2
cores. Written once (seeded) under the tiny-model cache and loaded by the normal loader."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

LLAMA_4x512: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 512,
    "intermediate_size": 1408,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "max_position_embeddings": 4096,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "torch_dtype": "float32",
}


def ensure_bench_model(
    name: str = "bench-llama-4x512-v1", shape: dict[str, Any] | None = None
) -> Path:
    from pagefleet.engine.tiny import default_root, write_random_checkpoint

    root = default_root()
    path = root / name
    if (path / "config.json").is_file():
        return path
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=root))
    try:
        write_random_checkpoint(tmp, shape or LLAMA_4x512, seed=7)
        try:
            os.rename(tmp, path)
        except OSError:
            if not (path / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def bench_model(spec: str | None) -> Path:
    """The benchmarks' ``--model``: None or ``bench`` is the seeded 4x512 Llama above; any
    other value goes through the engine's resolver (a preset such as ``smollm2-135m``, a
    checkpoint directory, or a .gguf file)."""
    if spec is None or spec == "bench":
        return ensure_bench_model()
    from pagefleet.engine.loader import resolve_model

    return resolve_model(spec)


def model_shape(path: Path) -> dict[str, Any]:
    """The config.json-shaped dict of a checkpoint directory or GGUF file (hidden size,
    layers, heads: what the FLOP estimates need)."""
    import json

    from pagefleet.gguf_tokenizer import find_gguf_file

    gguf_file = find_gguf_file(path)
    if gguf_file is None:
        return json.loads((path / "config.json").read_text())
    from pagefleet.engine.gguf_loader import config_dict, open_gguf
    from pagefleet.gguf_tokenizer import read_fields

    reader = open_gguf(gguf_file)
    return config_dict(read_fields(reader), {t.name for t in reader.tensors})


def hf_causal_lm(path: Path) -> Any:
    """transformers' model of the same checkpoint in fp32 (for a GGUF file, transformers'
    own GGUF reader dequantizes it), in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    from pagefleet.gguf_tokenizer import find_gguf_file

    gguf_file = find_gguf_file(path)
    if gguf_file is None:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf_file.parent), gguf_file=gguf_file.name, dtype=torch.float32
        )
    return model.eval()
