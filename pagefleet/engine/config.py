"""Engine configuration: every knob of one engine instance.

Invariant: an ``EngineConfig`` that passed ``validate()`` describes an engine that can
start; bad values raise ``ValueError`` naming the field and the accepted range.
"""

from __future__ import annotations

from dataclasses import dataclass

_DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(slots=True)
class EngineConfig:
    model: str = "tiny"  # a directory, a .gguf file, or a preset name (tiny*, smollm2-135m)
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "cpu"
    attention_backend: str | None = None
    block_size: int = 16
    num_gpu_blocks: int | None = None  # explicit KV pool size in blocks, else from memory
    kv_cache_memory_bytes: int = 256 << 20
    # On CUDA: size the KV pool from free device memory so the daemon fills at most this
    # share of the GPU (replaces kv_cache_memory_bytes; num_gpu_blocks still wins).
    gpu_memory_utilization: float | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    # Most prompt tokens one sequence may prefill per step (0: up to the whole budget). A
    # long cold prompt then takes several shorter steps and leaves budget for short ones
    # (cache hits) in each, instead of making them wait out one long step: lower TTFT for
    # short requests, slightly higher for long ones. vLLM calls this knob the same.
    long_prefill_token_threshold: int = 0
    cache_aware_scheduling: bool = False
    max_wait_steps: int = 64  # bounded unfairness of cache-aware ordering
    kv_namespace: str = ""  # block-key namespace (the InferenceService's model key)
    seed: int = 0
    # P/D: how long a finished prefill's KV stays pinned for a decode pod to pull it, and
    # how long a decode engine keeps blocks reserved for a pull in flight.
    kv_transfer_timeout_s: float = 30.0
    # Replay pure-decode steps from CUDA graphs captured at a set of batch sizes
    # (cuda_graphs.py). Only with the Triton backend on CUDA; elsewhere a warning and eager
    # steps. Opt-in until a GPU run has checked it (bench/gpu_check.sh).
    cuda_graphs: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` for any value the engine cannot run with."""
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_gpu_blocks is not None and self.num_gpu_blocks < 1:
            raise ValueError(f"num_gpu_blocks must be >= 1 or None, got {self.num_gpu_blocks}")
        if self.kv_cache_memory_bytes < 1:
            raise ValueError(
                f"kv_cache_memory_bytes must be positive, got {self.kv_cache_memory_bytes}"
            )
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2 or None, got {self.max_model_len}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(
                "long_prefill_token_threshold must be >= 0 (0 = off), got "
                f"{self.long_prefill_token_threshold}"
            )
        if self.long_prefill_token_threshold and not self.enable_chunked_prefill:
            raise ValueError(
                "long_prefill_token_threshold needs chunked prefill: enable it or set 0"
            )
        if self.kv_transfer_timeout_s <= 0:
            raise ValueError(f"kv_transfer_timeout_s must be > 0, got {self.kv_transfer_timeout_s}")
        if self.max_wait_steps < 0:
            raise ValueError(f"max_wait_steps must be >= 0, got {self.max_wait_steps}")
