"""What an ``LLMEngine`` runs on, and how to load it from a checkpoint.

An engine is always built the same way: ``LLMEngine(config, event_sink, parts=...)``.
``load_parts`` makes the parts of a real model (weights, KV pool size, model runner);
tests and benchmarks build ``EngineParts`` around a model-free runner instead. Either way
the engine's own setup (scheduler, KV manager, limits) is one code path.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

from pagefleet.engine.config import EngineConfig
from pagefleet.engine.detokenizer import Decoder
from pagefleet.engine.model_config import ModelConfig
from pagefleet.engine.model_runner import Runner


@dataclass(slots=True)
class EngineParts:
    """A runner over ``num_blocks`` KV blocks, the tokenizer its outputs are decoded with,
    and the model's limits. ``model_config`` is None for a model-free runner."""

    runner: Runner
    tokenizer: Decoder
    eos_token_ids: Seq[int]
    vocab_size: int
    model_max_len: int
    num_blocks: int
    model_config: ModelConfig | None = None


def load_parts(config: EngineConfig, loaded: tuple[Any, Any, Any] | None = None) -> EngineParts:
    """Load ``config.model`` (or reuse ``loaded`` = ``load_model``'s result, so several
    engines can share one set of weights), size the KV pool, build the model runner.

    Raises ValueError when the configuration cannot serve this model (context past an
    unapplied sliding window, a KV budget that holds no block).
    """
    import torch

    from pagefleet.engine.loader import load_model, resolve_model
    from pagefleet.engine.model_runner import ModelRunner, kv_cache_bytes_per_block
    from pagefleet.engine.sampler import Sampler
    from pagefleet.kernels import get_backend

    if loaded is None:
        loaded = load_model(resolve_model(config.model), config.dtype, config.device)
    model, mc, tokenizer = loaded
    if mc.sliding_window and (config.max_model_len or 0) > mc.sliding_window:
        raise ValueError(
            f"max_model_len {config.max_model_len} exceeds the model's sliding_window "
            f"{mc.sliding_window}, which pagefleet does not apply yet: tokens past the "
            f"window would attend to too much context; set max_model_len <= "
            f"{mc.max_exact_len}"
        )
    device = torch.device(config.device)
    per_block = kv_cache_bytes_per_block(
        mc.num_hidden_layers, config.block_size, mc.num_key_value_heads, mc.head_dim, mc.dtype
    )
    num_blocks = config.num_gpu_blocks or config.kv_cache_memory_bytes // per_block
    if num_blocks < 1:
        raise ValueError(
            f"kv_cache_memory_bytes={config.kv_cache_memory_bytes} holds no KV block "
            f"({per_block} bytes each); raise it or set num_gpu_blocks"
        )
    runner = ModelRunner(
        model,
        num_layers=mc.num_hidden_layers,
        num_kv_heads=mc.num_key_value_heads,
        head_dim=mc.head_dim,
        num_blocks=num_blocks,
        block_size=config.block_size,
        backend=get_backend(config.attention_backend, device),
        sampler=Sampler(mc.eos_token_ids),
        device=device,
        dtype=mc.dtype,
    )
    return EngineParts(
        runner=runner,
        tokenizer=tokenizer,
        eos_token_ids=mc.eos_token_ids,
        vocab_size=mc.vocab_size,
        model_max_len=mc.max_exact_len,
        num_blocks=num_blocks,
        model_config=mc,
    )
