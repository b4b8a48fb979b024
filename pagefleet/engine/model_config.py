"""ModelConfig: the parts of a Hugging Face ``config.json`` the Llama-family model needs."""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pagefleet.api.model_context import rope_positions

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
# What each scaling type needs in rope_scaling beyond its name (the rest has defaults):
# without them the RoPE tables cannot be built, and the model fails deep inside its
# construction with a bare KeyError.
_ROPE_REQUIRED = {
    "linear": ("factor",),
    "llama3": ("factor", "original_max_position_embeddings"),
    "yarn": ("factor",),
}


def _int_field(cfg: dict[str, Any], key: str, source: str, default: int | None = None) -> int:
    """``cfg[key]`` as a positive int. JSON writes these as integers; a string, a fraction,
    a null or a bool is a damaged or hand-edited config, and int() would either fail with
    a message that names no field or silently truncate (4.5 heads -> 4)."""
    value = cfg.get(key)
    if value is None and default is not None:
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(
            f"{source}: {key} must be a positive integer, got {value!r}; fix the field "
            "(compare with the model's original config.json)"
        )
    return value


def _float_field(cfg: dict[str, Any], key: str, source: str, default: float) -> float:
    """``cfg[key]`` as a finite positive float (``default`` when absent or null)."""
    value = cfg.get(key)
    if value is None:
        return default
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ValueError(
            f"{source}: {key} must be a positive number, got {value!r}; fix the field "
            "(compare with the model's original config.json)"
        )
    return float(value)


def _bool_field(cfg: dict[str, Any], key: str, source: str) -> bool:
    """``cfg[key]`` as a bool (False when absent). bool("false") is True: a quoted value
    would silently flip the meaning, so only JSON true/false are accepted."""
    value = cfg.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ValueError(
            f"{source}: {key} must be true or false, got {value!r}; fix the field "
            "(JSON booleans are unquoted)"
        )
    return value


def _token_ids(value: Any, key: str, source: str) -> list[int]:
    """An id or a list of ids (eos_token_id may be either), each a non-negative int."""
    ids = value if isinstance(value, list) else [] if value is None else [value]
    for i in ids:
        if not isinstance(i, int) or isinstance(i, bool) or i < 0:
            raise ValueError(f"{source}: {key} must be a token id or a list of them, got {value!r}")
    return list(ids)


def _check_rope_scaling(scaling: dict[str, Any], rope_type: str, source: str) -> None:
    missing = [k for k in _ROPE_REQUIRED.get(rope_type, ()) if scaling.get(k) is None]
    if missing:
        raise ValueError(
            f"{source}: rope_scaling of type {rope_type!r} lacks {', '.join(missing)}; "
            "copy the model's original rope_scaling block"
        )
    for key in ("factor", "original_max_position_embeddings", "low_freq_factor",
                "high_freq_factor"):  # fmt: skip
        if key in scaling and scaling[key] is not None:
            _float_field(scaling, key, f"{source} rope_scaling", 1.0)


def read_json_file(path: Path, what: str) -> dict[str, Any]:
    """The JSON object in ``path``, with errors that name the file and the fix: the
    json module's own (\"Expecting property name ... (char 1)\") name neither."""
    try:
        text = path.read_text(encoding="utf-8")
    except PermissionError:
        raise PermissionError(
            f"cannot read {path}: permission denied for this process (uid {os.getuid()}); "
            "make the model directory readable by the daemon's user"
        ) from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path} is not UTF-8 text ({exc}): download {what} again") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"{path} is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno}): "
            f"the file is damaged or truncated; download {what} again"
        ) from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} holds a JSON {type(data).__name__}, not an object: is it {what}?")
    return data


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
    def rope_positions(self) -> int:
        """Positions the model's RoPE serves (the rows of its tables): api/model_context.py,
        the rule the gateway applies too."""
        return rope_positions(self.max_position_embeddings, self.rope_scaling)

    @property
    def max_exact_len(self) -> int:
        """Longest context this engine serves exactly. Sliding-window attention is not
        implemented, and full attention equals it only within the window."""
        if self.sliding_window:
            return min(self.rope_positions, int(self.sliding_window))
        return self.rope_positions

    def check_max_model_len(self, requested: int | None) -> None:
        """Raise ValueError when ``requested`` (--max-model-len) is longer than this model
        serves: the RoPE tables hold ``rope_positions`` rows, so a position past them is an
        index error that ends the engine (on a GPU a device-side assert), and past an
        unapplied sliding window the output would be silently wrong."""
        if requested is None or requested <= self.max_exact_len:
            return
        if self.sliding_window and requested > self.sliding_window:
            raise ValueError(
                f"max_model_len {requested} exceeds the model's sliding_window "
                f"{self.sliding_window}, which pagefleet does not apply yet: tokens past the "
                f"window would attend to too much context; set max_model_len <= "
                f"{self.max_exact_len}"
            )
        what = (
            f"YaRN context {self.rope_positions} (original_max_position_embeddings x factor)"
            if self.rope_positions != self.max_position_embeddings
            else f"max_position_embeddings {self.max_position_embeddings}"
        )
        raise ValueError(
            f"max_model_len {requested} exceeds the model's {what} (its config.json): "
            f"positions past it have no rotary embedding; set --max-model-len <= "
            f"{self.max_exact_len} or leave it unset"
        )

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_dict(
        cls,
        cfg: dict[str, Any],
        generation_config: dict | None = None,
        source: str = "config.json",
    ) -> ModelConfig:
        """Validate and normalise a config.json dict (old and new rope layouts alike).
        ``source`` names the file in errors, each of which says which field is wrong."""
        archs = cfg.get("architectures") or []
        if isinstance(archs, str):
            archs = [archs]
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
            raise ValueError(
                f"{source} lacks required fields {missing}: is it the config.json of a "
                f"Hugging Face {arch} checkpoint? Download the model's original one"
            )
        n_heads = _int_field(cfg, "num_attention_heads", source)
        n_kv = _int_field(cfg, "num_key_value_heads", source, default=n_heads)
        hidden = _int_field(cfg, "hidden_size", source)
        if cfg.get("head_dim") is None and hidden % n_heads:
            raise ValueError(
                f"{source}: hidden_size={hidden} is not a multiple of "
                f"num_attention_heads={n_heads} and no head_dim is given"
            )
        head_dim = _int_field(cfg, "head_dim", source, default=hidden // n_heads)
        if head_dim % 2:
            raise ValueError(
                f"{source}: head_dim={head_dim} is odd; rotary embeddings rotate pairs of "
                "dimensions, so it must be even"
            )
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
        rope_theta = _float_field({"rope_theta": rope_theta}, "rope_theta", source, 10000.0)
        if rope_scaling is not None and not isinstance(rope_scaling, dict):
            raise ValueError(
                f"{source}: rope_scaling must be an object or null, got {rope_scaling!r}"
            )
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
            else:
                _check_rope_scaling(rope_scaling, rope_type, source)

        if arch == "Qwen2ForCausalLM":
            attention_bias = True
        else:
            attention_bias = _bool_field(cfg, "attention_bias", source)
        qk_norm = arch == "Qwen3ForCausalLM"

        sliding_window = None
        if arch == "MistralForCausalLM" or cfg.get("use_sliding_window"):
            sliding_window = cfg.get("sliding_window")
        if sliding_window:
            sliding_window = _int_field(cfg, "sliding_window", source)
            logger.warning(
                "sliding_window=%s is not applied: contexts are capped at the window, "
                "where full attention equals it",
                sliding_window,
            )

        gen = generation_config or {}
        eos_key = "eos_token_id"
        eos_ids = _token_ids(gen.get(eos_key, cfg.get(eos_key)), eos_key, source)
        vocab_size = _int_field(cfg, "vocab_size", source)
        outside = [e for e in eos_ids if e >= vocab_size]
        if outside:
            raise ValueError(
                f"{source}: eos_token_id {outside} is outside the vocabulary "
                f"(vocab_size={vocab_size}): the model could never end a sequence; the "
                "config (or generation_config.json) belongs to another model"
            )
        torch_dtype = cfg.get("torch_dtype") or cfg.get("dtype") or "float32"
        if torch_dtype == "auto":  # seen in hand-written configs; the weights decide on GPU
            torch_dtype = "bfloat16"
        try:
            dtype = parse_dtype(torch_dtype)
        except ValueError:
            raise ValueError(
                f"{source}: torch_dtype {torch_dtype!r} is not a floating-point type "
                "pagefleet loads (float32, bfloat16, float16); serve an unquantized "
                "checkpoint, or a GGUF file for quantized weights"
            ) from None
        bos = cfg.get("bos_token_id")
        return cls(
            architecture=arch,
            vocab_size=vocab_size,
            hidden_size=hidden,
            intermediate_size=_int_field(cfg, "intermediate_size", source),
            num_hidden_layers=_int_field(cfg, "num_hidden_layers", source),
            num_attention_heads=n_heads,
            num_key_value_heads=n_kv,
            head_dim=head_dim,
            max_position_embeddings=_int_field(cfg, "max_position_embeddings", source, 2048),
            rms_norm_eps=_float_field(cfg, "rms_norm_eps", source, 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=_bool_field(cfg, "tie_word_embeddings", source),
            attention_bias=attention_bias,
            qk_norm=qk_norm,
            eos_token_ids=eos_ids,
            dtype=dtype,
            bos_token_id=bos if isinstance(bos, int) and not isinstance(bos, bool) else None,
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
        cfg = read_json_file(cfg_file, "the model's config.json")
        gen_file = path / "generation_config.json"
        gen = (
            read_json_file(gen_file, "the model's generation_config.json")
            if gen_file.is_file()
            else None
        )
        return cls.from_dict(cfg, gen, source=str(cfg_file))
