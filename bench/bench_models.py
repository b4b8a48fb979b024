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
