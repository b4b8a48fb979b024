"""ModelConfig parsing: old and new config.json layouts, family flags, dtype resolution."""

from __future__ import annotations

import logging

import pytest
import torch

from pagefleet.engine.model_config import ModelConfig, parse_dtype, resolve_dtype

BASE = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 1000,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
}


def test_defaults_follow_transformers() -> None:
    cfg = ModelConfig.from_dict(BASE)
    assert cfg.num_key_value_heads == 4  # MHA when absent
    assert cfg.head_dim == 16  # hidden / heads when absent
    assert cfg.rope_theta == 10000.0
    assert cfg.rope_scaling is None
    assert cfg.tie_word_embeddings is False
    assert cfg.attention_bias is False and cfg.qk_norm is False
    assert cfg.dtype == torch.float32
    assert cfg.eos_token_ids == []


def test_rope_parameters_layout_of_transformers_5() -> None:
    cfg = ModelConfig.from_dict(
        {**BASE, "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}
    )
    assert cfg.rope_theta == 500000.0
    assert cfg.rope_scaling is None
    cfg = ModelConfig.from_dict(
        {
            **BASE,
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "original_max_position_embeddings": 8192,
            },
        }
    )
    assert cfg.rope_theta == 500000.0
    assert cfg.rope_scaling == {
        "rope_type": "llama3",
        "factor": 8.0,
        "original_max_position_embeddings": 8192,
    }


def test_legacy_rope_scaling_type_key() -> None:
    cfg = ModelConfig.from_dict(
        {**BASE, "rope_theta": 1e6, "rope_scaling": {"type": "linear", "factor": 2.0}}
    )
    assert cfg.rope_theta == 1e6
    assert cfg.rope_scaling is not None and cfg.rope_scaling["rope_type"] == "linear"


def test_dynamic_ntk_is_refused_clearly() -> None:
    with pytest.raises(ValueError, match="unsupported rope_scaling type 'dynamic'"):
        ModelConfig.from_dict({**BASE, "rope_scaling": {"type": "dynamic", "factor": 2.0}})


def test_family_flags() -> None:
    qwen2 = ModelConfig.from_dict({**BASE, "architectures": ["Qwen2ForCausalLM"]})
    assert qwen2.attention_bias  # Qwen2 always biases q/k/v
    qwen3 = ModelConfig.from_dict(
        {**BASE, "architectures": ["Qwen3ForCausalLM"], "head_dim": 32, "attention_bias": False}
    )
    assert qwen3.qk_norm and qwen3.head_dim == 32 and not qwen3.attention_bias
    assert qwen3.q_size == 128 and qwen3.kv_size == 128
    # A config without "architectures" still resolves through model_type.
    bare = {k: v for k, v in BASE.items() if k != "architectures"}
    assert ModelConfig.from_dict({**bare, "model_type": "mistral"}).architecture == (
        "MistralForCausalLM"
    )


def test_null_head_dim_falls_back() -> None:
    assert ModelConfig.from_dict({**BASE, "head_dim": None}).head_dim == 16


def test_eos_prefers_generation_config() -> None:
    cfg = ModelConfig.from_dict({**BASE, "eos_token_id": 2}, {"eos_token_id": [7, 2]})
    assert cfg.eos_token_ids == [7, 2]
    assert ModelConfig.from_dict({**BASE, "eos_token_id": 2}).eos_token_ids == [2]


def test_sliding_window_is_reported(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="pagefleet.engine.model_config"):
        cfg = ModelConfig.from_dict(
            {**BASE, "architectures": ["MistralForCausalLM"], "sliding_window": 4096}
        )
    assert cfg.sliding_window == 4096
    assert "sliding_window=4096 is not applied" in caplog.text


def test_missing_fields_are_named() -> None:
    with pytest.raises(ValueError, match=r"lacks required fields \['hidden_size'\]"):
        ModelConfig.from_dict({k: v for k, v in BASE.items() if k != "hidden_size"})


def test_dtypes() -> None:
    assert parse_dtype("bf16") == torch.bfloat16
    assert parse_dtype("torch.float16") == torch.float16
    assert parse_dtype(torch.float32) == torch.float32
    assert resolve_dtype("auto", torch.bfloat16, "cpu") == torch.float32
    assert resolve_dtype("auto", torch.bfloat16, "cuda") == torch.bfloat16
    assert resolve_dtype("float16", torch.bfloat16, "cpu") == torch.float16
    with pytest.raises(ValueError, match="use one of auto, float32, bfloat16, float16"):
        parse_dtype("int8")
    cfg = ModelConfig.from_dict({**BASE, "torch_dtype": "bfloat16"})
    assert cfg.dtype == torch.bfloat16
    # transformers 5 writes "dtype" instead of "torch_dtype".
    assert ModelConfig.from_dict({**BASE, "dtype": "float16"}).dtype == torch.float16
