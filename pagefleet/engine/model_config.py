"""ModelConfig: the parts of a Hugging Face ``config.json`` the Llama-family model needs."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)

# model_type -> architecture, for configs that omit "architectures".
_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """``"bfloat16"``/``"bf16"``/``torch.bfloat16`` -> ``torch.bfloat16`` (and so on)."""
    if isinstance(name, torch.dtype):
        return name
    key = str(name).lower().removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}: use one of auto, float32, bfloat16, float16")
    return _DTYPES[key]


def resolve_dtype(
    dtype: str | torch.dtype, checkpoint_dtype: torch.dtype, device: str
) -> torch.dtype:
    """``auto`` is float32 on CPU (fast and exact there) and the checkpoint's dtype on GPU."""
    if isinstance(dtype, str) and dtype.lower() == "auto":
        if torch.device(device).type == "cpu":
            return torch.float32
        return checkpoint_dtype
    return parse_dtype(dtype)


@dataclass(slots=True)
class ModelConfig:
    """Parsed from config.json; ``dtype`` is the checkpoint's stored dtype until the loader
    replaces it with the dtype the model actually runs in."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    eos_token_ids: list[int]
    dtype: torch.dtype
    bos_token_id: int | None = None
    sliding_window: int | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def max_exact_len(self) -> int:
        """Longest context this engine serves exactly. Sliding-window attention is not
        implemented, and full attention equals it only within the window."""
        if self.sliding_window:
            return min(self.max_position_embeddings, int(self.sliding_window))
        return self.max_position_embeddings

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], generation_config: dict | None = None) -> ModelConfig:
        """Validate and normalise a config.json dict (old and new rope layouts alike)."""
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None and not archs:
            arch = _MODEL_TYPES.get(cfg.get("model_type", ""))
        if arch is None:
            raise ValueError(
                f"unsupported architecture {archs or cfg.get('model_type')!r}: pagefleet serves "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        missing = [
            k
            for k in (
                "vocab_size",
                "hidden_size",
                "intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
            )
            if k not in cfg
        ]
        if missing:
            raise ValueError(f"config.json lacks required fields {missing}")
        n_heads = int(cfg["num_attention_heads"])
        n_kv = int(cfg.get("num_key_value_heads") or n_heads)
        hidden = int(cfg["hidden_size"])
        head_dim = int(cfg.get("head_dim") or hidden // n_heads)
        if n_heads % n_kv:
            raise ValueError(
                f"num_attention_heads={n_heads} is not a multiple of num_key_value_heads={n_kv}"
            )

        # transformers >= 5 nests rope settings in rope_parameters; older files use
        # rope_theta + rope_scaling at top level.
        rope_params = cfg.get("rope_parameters")
        rope_scaling = cfg.get("rope_scaling")
        rope_theta = cfg.get("rope_theta")
        if isinstance(rope_params, dict):
            rope_theta = rope_params.get("rope_theta", rope_theta)
            rope_scaling = dict(rope_params)
        rope_theta = float(rope_theta if rope_theta is not None else 10000.0)
        if rope_scaling is not None:
            rope_scaling = dict(rope_scaling)
            rope_scaling.pop("rope_theta", None)
            rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
            rope_scaling["rope_type"] = rope_type
            if rope_type == "default":
                rope_scaling = None
            elif rope_type not in SUPPORTED_ROPE_TYPES:
                raise ValueError(
                    f"unsupported rope_scaling type {rope_type!r}: pagefleet implements "
                    f"{', '.join(SUPPORTED_ROPE_TYPES)}"
                )

        if arch == "Qwen2ForCausalLM":
            attention_bias = True
        else:
            attention_bias = bool(cfg.get("attention_bias", False))
        qk_norm = arch == "Qwen3ForCausalLM"

        sliding_window = None
        if arch == "MistralForCausalLM" or cfg.get("use_sliding_window"):
            sliding_window = cfg.get("sliding_window")
        if sliding_window:
            logger.warning(
                "sliding_window=%s is not applied: contexts are capped at the window, "
                "where full attention equals it",
                sliding_window,
            )

        gen = generation_config or {}
        eos = gen.get("eos_token_id", cfg.get("eos_token_id"))
        eos_ids = (
            [int(e) for e in eos] if isinstance(eos, list) else ([] if eos is None else [int(eos)])
        )
        torch_dtype = cfg.get("torch_dtype") or cfg.get("dtype") or "float32"
        if torch_dtype == "auto":  # seen in hand-written configs; the weights decide on GPU
            torch_dtype = "bfloat16"
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=n_heads,
            num_key_value_heads=n_kv,
            head_dim=head_dim,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            qk_norm=qk_norm,
            eos_token_ids=eos_ids,
            dtype=parse_dtype(torch_dtype),
            bos_token_id=cfg.get("bos_token_id"),
            sliding_window=sliding_window,
            raw=dict(cfg),
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        """Read ``config.json`` (and ``generation_config.json`` for EOS ids) from ``path``."""
        path = Path(path)
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise FileNotFoundError(
                f"{cfg_file} not found: a model directory needs a Hugging Face config.json "
                "next to its *.safetensors files"
            )
        cfg = json.loads(cfg_file.read_text(encoding="utf-8"))
        gen_file = path / "generation_config.json"
        gen = json.loads(gen_file.read_text(encoding="utf-8")) if gen_file.is_file() else None
        return cls.from_dict(cfg, gen)
