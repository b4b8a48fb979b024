"""What an ``LLMEngine`` runs on, and how to load it from a checkpoint.

An engine is always built the same way: ``LLMEngine(config, event_sink, parts=...)``.
``load_parts`` makes the parts of a real model (weights, KV pool size, model runner);
tests and benchmarks build ``EngineParts`` around a model-free runner instead. Either way
the engine's own setup (scheduler, KV manager, limits) is one code path.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from pagefleet.engine.config import EngineConfig
from pagefleet.engine.detokenizer import Decoder
from pagefleet.engine.model_config import ModelConfig
from pagefleet.engine.model_runner import Runner
from pagefleet.tokenizer import Tokenizer

# The tokenizer an engine carries: a checkpoint's full ``Tokenizer`` (what the daemon serves
# with) for loaded models, any decoder for the model-free runners of tests and benchmarks.
TokenizerT = TypeVar("TokenizerT", bound=Decoder)


@dataclass(slots=True)
class EngineParts(Generic[TokenizerT]):
    """A runner over ``num_blocks`` KV blocks, the tokenizer its outputs are decoded with,
    and the model's limits. ``model_config`` is None for a model-free runner."""

    runner: Runner
    tokenizer: TokenizerT
    eos_token_ids: Seq[int]
    vocab_size: int
    model_max_len: int
    num_blocks: int
    model_config: ModelConfig | None = None


def _kv_pool_bytes(config: EngineConfig, device: Any, vocab_size: int) -> int:
    """The KV budget: ``kv_cache_memory_bytes``, or on CUDA with ``gpu_memory_utilization``
    what that share of the GPU leaves after the (already loaded) weights."""
    if config.gpu_memory_utilization is None or config.num_gpu_blocks is not None:
        return config.kv_cache_memory_bytes
    if device.type != "cuda":
        raise ValueError(
            f"gpu_memory_utilization sizes the KV pool on CUDA only, but the device is "
            f"{device.type!r}; size it with kv_cache_memory_bytes (--kv-cache-memory-mb)"
        )
    import torch

    from pagefleet.engine.kv_sizing import activation_reserve_bytes, gpu_kv_pool_bytes

    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    reserve = activation_reserve_bytes(
        config.max_num_batched_tokens, config.max_num_seqs, vocab_size
    )
    return gpu_kv_pool_bytes(free, total, config.gpu_memory_utilization, reserve)


def load_parts(
    config: EngineConfig, loaded: tuple[Any, Any, Tokenizer] | None = None
) -> EngineParts[Tokenizer]:
    """Load ``config.model`` (or reuse ``loaded`` = ``load_model``'s result, so several
    engines can share one set of weights), size the KV pool, build the model runner.

    Raises ValueError when the configuration cannot serve this model (context past an
    unapplied sliding window, a KV budget that holds no block).
    """
    import torch

    from pagefleet.engine.kv_sizing import check_kv_holds_max_len
    from pagefleet.engine.loader import load_model, resolve_model
    from pagefleet.engine.model_runner import ModelRunner, kv_cache_bytes_per_block
    from pagefleet.engine.sampler import Sampler
    from pagefleet.kernels import get_backend

    if loaded is None:
        loaded = load_model(resolve_model(config.model), config.dtype, config.device)
    model, mc, tokenizer = loaded
    mc.check_max_model_len(config.max_model_len)
    device = torch.device(config.device)
    per_block = kv_cache_bytes_per_block(
        mc.num_hidden_layers, config.block_size, mc.num_key_value_heads, mc.head_dim, mc.dtype
    )
    kv_bytes = _kv_pool_bytes(config, device, mc.vocab_size)
    num_blocks = config.num_gpu_blocks or kv_bytes // per_block
    if num_blocks < 1:
        mib = 1 << 20
        raise ValueError(
            f"a KV budget of {kv_bytes / mib:.1f} MiB holds no KV block of this model "
            f"({per_block / mib:.1f} MiB each: {config.block_size} tokens x "
            f"{mc.num_hidden_layers} layers x K and V in {mc.dtype}); raise "
            "--kv-cache-memory-mb (or --gpu-memory-utilization on CUDA) or set --num-gpu-blocks"
        )
    check_kv_holds_max_len(config.max_model_len, num_blocks, config.block_size, per_block)
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
    if config.cuda_graphs:
        from pagefleet.engine.cuda_graphs import build_decode_graphs

        # The engine caps max_model_len at what the KV pool holds; graphs use the same bound.
        bound = min(config.max_model_len or mc.max_exact_len, num_blocks * config.block_size)
        runner.decode_graphs = build_decode_graphs(
            True, model, runner.kv_caches, runner.backend, device, config.block_size, bound,
            config.max_num_seqs,
        )  # fmt: skip
    return EngineParts(
        runner=runner,
        tokenizer=tokenizer,
        eos_token_ids=mc.eos_token_ids,
        vocab_size=mc.vocab_size,
        model_max_len=mc.max_exact_len,
        num_blocks=num_blocks,
        model_config=mc,
    )
